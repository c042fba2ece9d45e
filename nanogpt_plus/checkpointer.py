"""
The Checkpointer: when and where a run's checkpoints are written, the one implementation for train.py and
finetune.py. It owns
  - the cadence: train.py saves at every evaluation (always_save_checkpoint), or only when the val loss improved
    (the best model, also kept as ckpt_best.pt), or every checkpoint_interval iterations; a final save and one at
    a clean stop whatever the cadence;
  - the best model so far (its val loss);
  - snapshots: the last keep_checkpoints saves also kept as ckpt_<iter>.pt, older ones pruned;
  - the write itself, in the same steps for every file: the ranks vote on whether the weights are finite (so no
    rank walks on alone), gather what rank 0 saves (RNG states of every rank, FSDP's shards), then rank 0
    writes atomically and every rank learns whether it worked (master_decides); a write that fails (a full
    disk, permissions) is one line naming the file.
What a checkpoint holds is the caller's: it passes a function that builds the dict from what was gathered.

Usage:
    ckpt = Checkpointer('out', dist_info, raw_model, optimizer, always_save_checkpoint=True)
    saved = ckpt.evaluated(iter_num, val_loss, build)   # build(gathered) -> the checkpoint dict
    if ckpt.due(iter_num, local_iter_num) and not saved:
        ckpt.save(iter_num, build)
"""

import fcntl
import os
import re
import shutil
import sys
from dataclasses import dataclass

import torch

from nanogpt_plus.checkpoint import load_checkpoint, save_checkpoint
from nanogpt_plus.distributed import all_reduce_sum, fail_everywhere, master_decides
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import atomic_write
from nanogpt_plus.outdir import check_new_run
from nanogpt_plus.parallel import full_state_dicts, load_optimizer_state, local_parameters
from nanogpt_plus.rng import gather_rng_states, restore_rng_states

CHECKPOINT = 'ckpt.pt'  # train.py's checkpoint: the training state to resume from (the best model without always_save)
BEST = 'ckpt_best.pt'  # with always_save_checkpoint=False: the best model so far, kept beside ckpt.pt
SNAPSHOT = re.compile(r'^ckpt_(\d+)\.pt$')  # ckpt_<iter>.pt, the snapshots keep_checkpoints retains
FICLONE = 0x40049409  # linux/fs.h: make this file a copy-on-write clone of another


@dataclass
class Gathered:
    """ What every rank helped gather for rank 0 to save (None on the other ranks, or when not asked for). """
    model: dict = None  # the full model state dict (unsharded under FSDP)
    optimizer: dict = None
    rng: list = None  # the RNG states of every rank, in rank order


class Checkpointer:

    def __init__(self, out_dir, dist_info, model, optimizer=None, always_save_checkpoint=True,
                 checkpoint_interval=0, keep_checkpoints=0, replaces_a_run=False):
        """
        model: the plain module whose weights are saved (sharded in place under FSDP); optimizer: its optimizer.
        replaces_a_run: a new run with --overwrite=True: its first save replaces the earlier run's ckpt.pt and
        deletes the earlier run's other checkpoints (ckpt_best.pt, snapshots), which it was allowed to replace.
        """
        self.out_dir, self.dist_info = out_dir, dist_info
        self.model, self.optimizer = model, optimizer
        self.always_save = always_save_checkpoint
        self.interval = checkpoint_interval
        self.keep = keep_checkpoints
        self.replaces_a_run = replaces_a_run
        self.best_val_loss = 1e9  # the best val loss so far (a resumed run sets the checkpoint's)

    def path(self, name=CHECKPOINT):
        return os.path.join(self.out_dir, name)

    # -------------------------------------------------------------------------
    # train.py's cadence

    def evaluated(self, iter_num, val_loss, build):
        """
        After an evaluation at iter_num: remember a better val loss, then save at every evaluation
        (always_save_checkpoint, unless checkpoint_interval sets the saves) or, without always_save_checkpoint,
        only the best model. Iteration 0 has nothing new to save. Returns whether it saved.
        """
        improved = val_loss < self.best_val_loss
        if improved:
            self.best_val_loss = val_loss
        if iter_num == 0:
            return False
        if not self.always_save and improved:
            self.save(iter_num, build, best=True)
            return True
        if self.always_save and self.interval == 0:
            self.save(iter_num, build)
            return True
        return False

    def due(self, iter_num, local_iter_num):
        """ checkpoint_interval=N: save the state after every N steps (not where this process began: nothing new). """
        return self.interval > 0 and iter_num % self.interval == 0 and local_iter_num > 0

    def save(self, iter_num, build, reason='', best=False):
        """
        out_dir/ckpt.pt of iteration iter_num; every rank calls this. best=True: the model of an evaluation that
        improved the val loss (always_save_checkpoint=False), also copied to ckpt_best.pt: only such a model, of
        this run and with its own val loss, is ever kept as the best. Snapshots follow (keep_checkpoints).
        """
        def after_write(path):
            if self.replaces_a_run:  # --overwrite=True: the earlier run's other checkpoints go at our first save
                for name in checkpoint_files(self.out_dir):
                    if name != CHECKPOINT:
                        _remove(self.out_dir, name)
                self.replaces_a_run = False
            if best:
                copy_checkpoint(path, self.path(BEST))
            if self.keep > 0:
                snapshot_checkpoint(self.out_dir, iter_num, self.keep)

        self.write(CHECKPOINT, build, iter_num, announce=f"saving checkpoint to {self.out_dir}"
                   + (f" ({reason})" if reason else ""), after_write=after_write)

    # -------------------------------------------------------------------------
    # the write, the same for every file

    def write(self, name, build, iter_num, training_state=True, announce=None, done=None, after_write=None):
        """
        out_dir/name, holding build(Gathered) (called on rank 0 only). Every rank calls this: the weights are
        voted finite, then (training_state) the optimizer state, full weights and every rank's RNG state are
        gathered, then rank 0 writes; every rank raises when the weights are not finite or rank 0 could not
        write, so none waits for the others. announce / done: rank 0's lines before and after the write.
        """
        self.check_finite(iter_num)
        gathered = self.gather() if training_state else Gathered()
        path = self.path(name)

        def save():
            ckpt = build(gathered)
            try:
                if announce:
                    print(announce)
                save_checkpoint(ckpt, path)
                if after_write is not None:
                    after_write(path)
            except OSError as e:  # full disk, permissions, a directory in the way: the user's to fix
                raise UserError(f"could not write the checkpoint {path} ({e.strerror or e}); make room or fix "
                                f"--out_dir, then resume from the last checkpoint with --init_from=resume") from None
            if done:
                print(done)
        master_decides(self.dist_info, save)  # rank 0 saves; all ranks learn whether it worked

    def check_finite(self, iter_num):
        """
        Every rank checks the weights it holds (its shards under FSDP) and the verdicts are summed: one decision
        for all, taken before anything is gathered; a model that is not finite is never saved over a good one.
        """
        not_finite, = all_reduce_sum([0.0 if tensors_finite(local_parameters(self.model)) else 1.0], self.dist_info)
        if not_finite:
            fail_everywhere(UserError(f"the model's weights are not finite at iter {iter_num}; not saving, so "
                                      f"the last good checkpoint in {self.out_dir} is kept. Lower the learning "
                                      f"rate and resume"), self.dist_info)

    def gather(self):
        """ The training state for rank 0 to save: collectives, so every rank calls this at the same point. """
        rng = gather_rng_states(self.dist_info)
        # FSDP: every rank takes part in gathering each tensor, only rank 0 keeps the full copy (None elsewhere)
        model_state, optimizer_state = full_state_dicts(self.model, self.optimizer)
        return Gathered(model_state, optimizer_state, rng)


def tensors_finite(tensors):
    """ Whether every floating-point tensor (weights before a checkpoint is written) is free of inf/nan. """
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def restore_training_state(ckpt, optimizer, scaler, dist_info, loader=None, spike_guard=None):
    """
    On resume: the optimizer state (sharded for FSDP), the GradScaler's if saved, this rank's RNGs (derived
    ones for ranks the checkpoint has none for, rng.restore_rng_states) and, when given, the training loader's
    position and the spike guard's running statistics, so the run goes on as the uninterrupted one would.
    """
    load_optimizer_state(optimizer, ckpt['optimizer'])
    if ckpt.get('scaler'):
        scaler.load_state_dict(ckpt['scaler'])
    rng = ckpt.get('rng')
    if rng and restore_rng_states(rng, dist_info.rank) and dist_info.rank == len(rng):  # the first such rank says
        print(f"note: the checkpoint holds the RNG states of {len(rng)} rank(s); ranks {len(rng)} and up got "
              f"their own, drawn from rank 0's (their dropout differs from a run on {len(rng)} rank(s))")
    if spike_guard is not None and ckpt.get('spike_guard'):
        spike_guard.load_state_dict(ckpt['spike_guard'])
    if loader is not None and ckpt.get('loader'):
        loader.load_state_dict(ckpt['loader'])
    elif loader is not None and dist_info.master:
        print("warning: the checkpoint has no data-loader state (a nanoGPT checkpoint?); the data order after "
              "resuming will differ from an uninterrupted run", file=sys.stderr)


# -----------------------------------------------------------------------------
# the files of a run in its out_dir: ckpt.pt, ckpt_best.pt, the snapshots, and lines of a run left behind

def snapshots(out_dir):
    """ {iteration: file name} of the ckpt_<iter>.pt snapshots in out_dir. """
    return {int(m.group(1)): m.group(0) for m in map(SNAPSHOT.match, os.listdir(out_dir)) if m}


def checkpoint_files(out_dir):
    """ The names of the checkpoints a train.py run keeps in out_dir (ckpt.pt, ckpt_best.pt, snapshots). """
    if not os.path.isdir(out_dir):
        return []
    named = [n for n in (CHECKPOINT, BEST) if os.path.isfile(os.path.join(out_dir, n))]
    return named + [name for _, name in sorted(snapshots(out_dir).items())]


def copy_checkpoint(path, new_path):
    """
    new_path (and its .json sidecar) becomes a copy of the complete checkpoint at path, atomically. A copy,
    never a hard link: with a link, a file copied over one name (cp ckpt_2000.pt ckpt.pt) would be written
    through into the other. Where the file system can clone (btrfs, XFS: copy-on-write), the copy takes no
    time and no space until one of them changes.
    """
    for src, dst in ((path, new_path), (sidecar_of(path), sidecar_of(new_path))):
        if src == path or os.path.exists(src):
            atomic_write(dst, lambda f, src=src: _clone_into(src, f))


def _clone_into(path, f):
    with open(path, 'rb') as source:
        try:
            fcntl.ioctl(f.fileno(), FICLONE, source.fileno())
        except OSError:  # no reflinks here (ext4, tmpfs, another file system): copy the bytes
            shutil.copyfileobj(source, f, 1 << 24)


def sidecar_of(path):
    return os.path.splitext(path)[0] + '.json'


def saved_iter(path):
    """ The iter_num of a checkpoint file, read from the file itself (memory-mapped: its tensors aren't read). """
    return int(load_checkpoint(path)['iter_num'])  # not the .json sidecar: a file copied by hand may lack its own


def snapshot_checkpoint(out_dir, iter_num, keep):
    """
    After out_dir/ckpt.pt of iteration iter_num is complete: copy it to ckpt_<iter_num>.pt, then delete the
    snapshots other than the `keep` newest. (Those of another line of the run never count: branch_off moved
    them away before this line's first save.) Returns the deleted names.
    """
    copy_checkpoint(os.path.join(out_dir, CHECKPOINT), os.path.join(out_dir, f'ckpt_{iter_num}.pt'))
    iters = sorted(snapshots(out_dir))
    deleted = []
    for i in iters[:-keep]:
        deleted += _remove(out_dir, f'ckpt_{i}.pt')
    return deleted


def _remove(out_dir, name):
    """ Delete a checkpoint and its sidecar; returns the names deleted. """
    deleted = []
    for n in (name, os.path.splitext(name)[0] + '.json'):
        try:
            os.remove(os.path.join(out_dir, n))
            deleted.append(n)
        except FileNotFoundError:
            pass
    return deleted


def resume_point(out_dir, resume_from=''):
    """ The file --init_from=resume continues from: ckpt.pt, or the snapshot resume_from names ('2000' or its name). """
    if not resume_from:
        return os.path.join(out_dir, CHECKPOINT)
    name = f'ckpt_{resume_from}.pt' if resume_from.isdigit() else resume_from
    if not SNAPSHOT.match(name):
        raise UserError(f"--resume_from={resume_from!r} is not a snapshot: give its iteration (2000) or its name "
                        f"(ckpt_2000.pt) in out_dir")
    path = os.path.join(out_dir, name)
    if not os.path.isfile(path):
        held = ', '.join(snapshots(out_dir).values()) if os.path.isdir(out_dir) else ''
        raise UserError(f"there is no snapshot {path} to resume from; {out_dir} holds "
                        f"{held or 'no snapshots'} (--keep_checkpoints=K keeps the last K saves)")
    return path


def branch_off(out_dir, resume_from=''):
    """
    On rank 0, out_dir locked, before a resumed run writes anything. A run resumed at iteration k (ckpt.pt's, or
    the snapshot resume_from names) continues a line of its own: the files of the line it leaves (ckpt.pt when
    going back to a snapshot, the snapshots of later iterations, a ckpt_best.pt saved after k) move unchanged
    into out_dir/abandoned_<n>/, so the new line's saves can neither overwrite nor prune them; then the snapshot
    becomes ckpt.pt (a copy). The same happens when the user copied an older snapshot over ckpt.pt by hand.
    metrics.jsonl stays: its reader drops the left line's records past k (metrics.read_metrics).
    """
    start = resume_point(out_dir, resume_from)
    k = saved_iter(start)
    later = [name for i, name in sorted(snapshots(out_dir).items()) if i > k]
    if os.path.isfile(os.path.join(out_dir, BEST)) and saved_iter(os.path.join(out_dir, BEST)) > k:
        later.append(BEST)
    current = os.path.join(out_dir, CHECKPOINT)
    leaving = resume_from and os.path.isfile(current)  # ckpt.pt is the latest state of the line left behind
    if later or leaving:
        n = 1 + max([int(d.rsplit('_', 1)[1]) for d in os.listdir(out_dir)
                     if d.startswith('abandoned_') and d.rsplit('_', 1)[1].isdigit()] or [0])
        keep_dir = os.path.join(out_dir, f'abandoned_{n}')
        os.makedirs(keep_dir)
        for name in later:  # moved (a kill halfway leaves each file in one of the two places)
            for part in (name, os.path.splitext(name)[0] + '.json'):
                if os.path.exists(os.path.join(out_dir, part)):
                    os.replace(os.path.join(out_dir, part), os.path.join(keep_dir, part))
        if leaving:  # copied, then replaced below: out_dir always holds a ckpt.pt to resume from
            copy_checkpoint(current, os.path.join(keep_dir, CHECKPOINT))
            later.insert(0, CHECKPOINT)
        print(f"resuming at iter {k}: the later files of this run ({', '.join(later)}) are kept, unchanged, in "
              f"{keep_dir}")
    if resume_from:
        copy_checkpoint(start, current)


def prepare_out_dir(cfg, script, argv):
    """
    train.py's start in its out_dir, on rank 0 with out_dir locked: a resume continues a line of its own
    (branch_off keeps the files of the line it leaves); a new run into an out_dir that holds an earlier run's
    checkpoints (ckpt.pt, ckpt_best.pt, snapshots) is refused with the commands to resume it or start over,
    unless --overwrite=True. eval_only runs write no checkpoint and change nothing.
    """
    if cfg['eval_only']:
        return
    if cfg['init_from'] == 'resume':
        branch_off(cfg['out_dir'], cfg['resume_from'])
        return
    check_new_run(cfg['out_dir'], checkpoint_files(cfg['out_dir']), script, argv, cfg['overwrite'])
