"""
The checkpoint, in one room: its files, its format, when and how a run saves, and what a resume puts
back.

- The files: ckpt.pt (train.py's training state; finetune.py's best model), ckpt_best.pt, finetune.py's
  ckpt_last.pt, the ckpt_<iter>.pt snapshots, each with a JSON sidecar (everything but the tensors); which
  file an init_from names (checkpoint_path), and going back to a snapshot (resume_point, branch_off).
- The format: a dict of tensors and plain values, nanoGPT's keys ('model', 'optimizer', 'model_args',
  'iter_num', 'best_val_loss', 'config') then ours ('model_extra_args', 'tokenizer', 'provenance'; a training
  checkpoint's 'loader', 'rng', 'scaler', 'spike_guard'; a fine-tune's 'head', 'task', ...). Nothing in it is
  a pickled object, so torch.load(weights_only=True) reads it, and nanoGPT's sample.py too. A save writes a
  temp file, fsyncs it and renames it over the old one; a load memory-maps the tensors and refuses, in one
  line, a file that is missing, truncated or holds a pickled Python object.
- Saving: the Checkpointer of train.py and finetune.py keeps the cadence (every evaluation, only an
  improvement, every checkpoint_interval; a final save and one at a clean stop), the best model, the
  snapshots, and the write itself (the ranks vote that the weights are finite, gather what rank 0 writes,
  and all learn whether it worked). What a checkpoint holds is the caller's: train.py's checkpoint() spells
  it out.
- Resuming: restore_training_state puts the optimizer, scaler, RNG, loader and spike-guard states back.

Usage:
    from nanogpt_plus.checkpoint import load_checkpoint, save_checkpoint, Checkpointer
    save_checkpoint(ckpt, 'out/ckpt.pt')          # and out/ckpt.json
    ckpt = load_checkpoint('out/ckpt.pt')         # tensors memory-mapped, weights_only=True
    saver = Checkpointer('out', dist_info, raw_model, optimizer, policy=cfg.select(CheckpointPolicy))
"""

import fcntl
import json
import math
import os
import random
import re
import shutil
import sys
import zipfile
from dataclasses import dataclass

import numpy as np
import torch

from nanogpt_plus.distributed import (
    all_reduce_sum,
    fail_everywhere,
    full_state_dicts,
    load_optimizer_state,
    local_parameters,
    master_decides,
)
from nanogpt_plus.errors import UserError, error_line, load_error
from nanogpt_plus.files import atomic_write, refuse_special_file

# train.py's checkpoint: the training state to resume from (the best model without
# always_save_checkpoint)
CHECKPOINT = 'ckpt.pt'
# with always_save_checkpoint=False: the best model so far, kept beside ckpt.pt
BEST = 'ckpt_best.pt'
# finetune.py's training state (its ckpt.pt is the best model)
LAST = 'ckpt_last.pt'
# the best val loss of a run before its first evaluation (nanoGPT's 1e9): any loss improves on it
NO_BEST = 1e9
# ckpt_<iter>.pt, the snapshots keep_checkpoints retains
SNAPSHOT = re.compile(r'^ckpt_(\d+)\.pt$')
# linux/fs.h: make this file a copy-on-write clone of another
FICLONE = 0x40049409


# -----------------------------------------------------------------------------
# writing

def save_checkpoint(ckpt, path, sidecar=True):
    """
    Atomically write ckpt (a dict of tensors and plain values) to path, plus path's .json sidecar. A
    failed write (a full disk, say) raises files.WriteFailed, a UserError that is also an OSError;
    the file that was at path stays as it was.
    """
    atomic_write(path, lambda f: _torch_save(ckpt, f))
    if sidecar:
        text = json.dumps(_json_summary(ckpt), indent=2, default=str)
        atomic_write(sidecar_of(path), lambda f: f.write(text), binary=False)


def _torch_save(obj, f):
    """
    torch.save into the file object f. When f.write fails (a full disk) torch reports a RuntimeError
    of its own ('unexpected pos ...', 'file write failed') with the OSError only as its context:
    raise the OSError, which says what went wrong, so the atomic writer turns it into one line.
    """
    try:
        torch.save(obj, f)
    except RuntimeError as e:
        cause = e.__cause__ or e.__context__
        if isinstance(cause, OSError):
            raise cause from None
        if 'file write failed' in str(e):
            raise OSError(f"torch.save could not write the file ({error_line(e)})") from None
        raise


def sidecar_of(path):
    """ The readable JSON beside a checkpoint: ckpt.pt -> ckpt.json. """
    return os.path.splitext(path)[0] + '.json'


def _json_summary(ckpt):
    """ The human-readable part of a checkpoint (no tensors), for ckpt.json. """
    keep = ('model_args', 'model_extra_args', 'iter_num', 'best_val_loss', 'config', 'provenance',
            'task')
    summary = {k: ckpt[k] for k in keep if k in ckpt}
    tok = ckpt.get('tokenizer')
    if tok is not None:
        summary['tokenizer'] = {k: v for k, v in tok.items() if k in ('kind', 'vocab_size')}
    return summary


def build_checkpoint(model, iter_num, best_val_loss, config, tokenizer, provenance,
                     model_state=None, **extra):
    """
    A checkpoint of a model's weights in this format: nanoGPT's keys ('model', 'model_args',
    'iter_num', 'best_val_loss', 'config'), the model settings beyond nanoGPT's, the tokenizer and
    provenance, then whatever the caller adds (finetune.py: the task head and its labels, its
    training state). train.py writes its own dict, with the whole training state, where it saves.
    model_state replaces model.state_dict() where the caller already holds the full state (FSDP).
    """
    ckpt = {
        'model': model.state_dict() if model_state is None else model_state,
        'model_args': model.config.model_args(),
        'model_extra_args': model.config.model_extra_args(),
        'iter_num': iter_num,
        'best_val_loss': best_val_loss,
        'config': dict(config),
        'tokenizer': tokenizer,
        'provenance': provenance,
    }
    ckpt.update(extra)
    return ckpt


# -----------------------------------------------------------------------------
# reading

def load_checkpoint(path, map_location='cpu'):
    """
    torch.load with weights_only=True and one clear error for a missing or corrupt file. The tensors
    are memory-mapped from the file (torch.save's zip format), not read into RAM: a tensor's pages
    come from disk when it is used, and the processes of one machine share them through the page
    cache, so resuming a large model under torchrun doesn't hold one copy of the whole file per
    rank.
    """
    if not os.path.exists(path):
        raise UserError(
            f"no checkpoint at {path}; train a model first (python train.py ...) or check --out_dir"
        )
    refuse_special_file(path, "checkpoint")
    # mmap needs the zip format; an old or damaged file is read the ordinary way (and its error
    # reported below)
    mmap = zipfile.is_zipfile(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except OSError as e:
        if e.errno is None:  # not the file system's: what torch.load made of the content
            raise load_error(path, e) from None
        # the file system's (no read permission, a directory in its place): the content is not at
        # fault
        raise UserError(f"checkpoint {path} could not be read ({e.strerror or e}); check the file and "
                        f"its permissions, or use another checkpoint") from None
    except Exception as e:  # truncated zip, foreign pickle, ... all mean the file can't be used
        raise load_error(path, e) from None
    if not isinstance(ckpt, dict):
        raise UserError(f"checkpoint {path} holds a {type(ckpt).__name__}, not a checkpoint's dict of "
                        f"entries; use a checkpoint written by train.py (or nanoGPT)")
    missing = [key for key in ('model', 'model_args') if key not in ckpt]
    if missing:
        raise UserError(f"checkpoint {path} has no {' or '.join(repr(k) for k in missing)} entry; "
                        f"use a checkpoint written by train.py (or nanoGPT)")
    return ckpt


def saved_iter(path):
    """
    The iter_num of a checkpoint file, read from the file itself (memory-mapped: its tensors aren't
    read).
    """
    # not the .json sidecar: a file copied by hand may lack its own
    return saved_count(load_checkpoint(path), path)


def require_entries(ckpt, path, keys):
    """
    Refuse a checkpoint (at path) that lacks one of keys, naming the first missing one: a file of
    ours always holds them, so one without was edited or written by other code.
    """
    missing = [key for key in keys if key not in ckpt]
    if missing:
        raise UserError(f"checkpoint {path} has no {missing[0]!r} entry: it was edited or written by "
                        f"other code; use another checkpoint")


def saved_count(ckpt, path, key='iter_num'):
    """
    A counter of a checkpoint (iter_num, a fine-tune's epoch): an int >= 0, else one line naming
    path (a file edited by hand, or written by other code, can hold anything there).
    """
    require_entries(ckpt, path, [key])
    value = ckpt[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise UserError(f"checkpoint {path} holds {key}={value!r}, not a count of steps: it was "
                        f"edited or written by other code; use another checkpoint")
    return value


# -----------------------------------------------------------------------------
# saving: when a run saves, the write every rank takes part in, and a resume's inverse

@dataclass
class Gathered:
    """
    What every rank helped gather for rank 0 to save (None on the other ranks, or when not asked
    for).
    """
    model: dict = None  # the full model state dict (unsharded under FSDP)
    optimizer: dict = None
    rng: list = None  # the RNG states of every rank, in rank order


@dataclass(frozen=True)
class CheckpointPolicy:
    """ When train.py saves (see above); the defaults: at every evaluation, ckpt.pt only. """
    always_save_checkpoint: bool = True
    checkpoint_interval: int = 0
    keep_checkpoints: int = 0


class Checkpointer:

    def __init__(self, out_dir, dist_info, model, optimizer=None, policy=CheckpointPolicy(),
                 replaces_a_run=False):
        """
        model: the plain module whose weights are saved (sharded in place under FSDP); optimizer:
        its optimizer. policy: a CheckpointPolicy, the cadence of evaluated() and due()
        (finetune.py's own saves ignore it).
        replaces_a_run: a new run with --overwrite=True: its first save replaces the earlier run's
        checkpoint of that name and deletes the earlier run's others (ckpt_best.pt, ckpt_last.pt,
        snapshots), which it was allowed to replace, so that none of them is ever taken for this
        run's.
        """
        self.out_dir = out_dir
        self.dist_info = dist_info
        self.model = model
        self.optimizer = optimizer
        self.always_save = policy.always_save_checkpoint
        self.interval = policy.checkpoint_interval
        self.keep = policy.keep_checkpoints
        # the earlier run's checkpoints, which this run's first save removes
        self.earlier = checkpoint_files(out_dir) if replaces_a_run and dist_info.master else []
        self.best_val_loss = NO_BEST  # the best val loss so far (a resumed run: resume_best)

    def path(self, name=CHECKPOINT):
        return os.path.join(self.out_dir, name)

    def resume_best(self, saved, source):
        """
        A resumed run's best val loss: its checkpoint's (saved, at source). NaN (every comparison
        with it is false) or one below 0 (no cross-entropy is) would never be improved on, so no
        later evaluation would count as the best, and without always_save_checkpoint none would
        be saved: such a value is taken as "no best yet", said in one line.
        """
        best = float(saved)
        if math.isnan(best) or best < 0:
            if self.dist_info.master:
                print(f"note: {source} records best_val_loss={best}, which no val loss can improve on; "
                      f"this run starts with no best, so its next evaluation counts as the best")
            best = NO_BEST
        self.best_val_loss = best

    # -------------------------------------------------------------------------
    # train.py's cadence

    def evaluated(self, iter_num, val_loss, build):
        """
        After an evaluation at iter_num: remember a better val loss, then save at every evaluation
        (always_save_checkpoint, unless checkpoint_interval sets the saves) or, without
        always_save_checkpoint, only the best model. Iteration 0 has nothing new to save. Returns
        whether it saved.
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
        """
        checkpoint_interval=N: save the state after every N steps (not where this process began:
        nothing new).
        """
        return self.interval > 0 and iter_num % self.interval == 0 and local_iter_num > 0

    def save(self, iter_num, build, reason='', best=False):
        """
        out_dir/ckpt.pt of iteration iter_num; every rank calls this. best=True: the model of an
        evaluation that improved the val loss (always_save_checkpoint=False), also copied to
        ckpt_best.pt: only such a model, of this run and with its own val loss, is ever kept as the
        best. Snapshots follow (keep_checkpoints).
        """
        def after_write(path):
            if best:
                copy_checkpoint(path, self.path(BEST))
            if self.keep > 0:
                snapshot_checkpoint(self.out_dir, iter_num, self.keep)

        self.write(CHECKPOINT, build, iter_num, announce=f"saving checkpoint to {self.out_dir}"
                   + (f" ({reason})" if reason else ""), after_write=after_write)

    # -------------------------------------------------------------------------
    # the write, the same for every file

    def write(self, name, build, iter_num, training_state=True, announce=None, done=None,
              after_write=None):
        """
        out_dir/name, holding build(Gathered) (called on rank 0 only). Every rank calls this: the
        weights are voted finite, then (training_state) the optimizer state, full weights and every
        rank's RNG state are gathered, then rank 0 writes; every rank raises when the weights are
        not finite or rank 0 could not write, so none waits for the others. announce / done: rank
        0's lines before and after the write.
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
                # --overwrite=True: the earlier run's other checkpoints go at this run's first save
                for earlier in self.earlier:
                    if earlier != name:
                        remove_checkpoint(self.out_dir, earlier)
                self.earlier = []
                if after_write is not None:
                    after_write(path)
            # full disk, permissions, a directory in the way: the user's to fix
            except OSError as e:
                # the write is atomic: a checkpoint saved before is still there, else none is
                then = ("resume from the last checkpoint with --init_from=resume"
                        if os.path.isfile(path) else "start the run again (no checkpoint was saved yet)")
                raise UserError(
                    f"could not write the checkpoint {path} ({e.strerror or e}); make room or fix "
                    f"--out_dir, then {then}") from None
            if done:
                print(done)
        master_decides(self.dist_info, save)  # rank 0 saves; all ranks learn whether it worked

    def check_finite(self, iter_num):
        """
        Every rank checks the weights it holds (its shards under FSDP) and the verdicts are summed:
        one decision for all, taken before anything is gathered; a model that is not finite is never
        saved over a good one.
        """
        not_finite, = all_reduce_sum([0.0 if tensors_finite(local_parameters(self.model)) else 1.0],
                                     self.dist_info)
        if not_finite:
            fail_everywhere(
                UserError(f"the model's weights are not finite at iter {iter_num}; not saving, so "
                          f"the last good checkpoint in {self.out_dir} is kept. Lower the learning "
                          f"rate and resume"), self.dist_info)

    def gather(self):
        """
        The training state for rank 0 to save: collectives, so every rank calls this at the same
        point.
        """
        rng = gather_rng_states(self.dist_info)
        # FSDP: every rank takes part in gathering each tensor, only rank 0 keeps the full copy
        # (None elsewhere)
        model_state, optimizer_state = full_state_dicts(self.model, self.optimizer)
        return Gathered(model_state, optimizer_state, rng)


def tensors_finite(tensors):
    """
    Whether every floating-point tensor (weights before a checkpoint is written) is free of inf/nan.
    """
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


def restore_training_state(ckpt, optimizer, scaler, dist_info, loader=None, spike_guard=None):
    """
    On resume: the optimizer state (sharded for FSDP), the GradScaler's if saved, this rank's RNGs
    (derived ones for ranks the checkpoint has none for, rng.restore_rng_states) and, when given,
    the training loader's position and the spike guard's running statistics, so the run goes on as
    the uninterrupted one would.
    """
    try:
        load_optimizer_state(optimizer, ckpt['optimizer'])
    # torch's check of the saved groups against this optimizer's: another number of parameter
    # groups, or of parameters in one (a file edited, or saved by other code)
    except ValueError as e:
        raise UserError(f"the checkpoint's optimizer state does not fit this run's optimizer "
                        f"({error_line(e)}); resume from another checkpoint, or start a new run "
                        f"in another --out_dir") from None
    if ckpt.get('scaler'):
        scaler.load_state_dict(ckpt['scaler'])
    rng = ckpt.get('rng')
    # the first such rank says
    if rng and restore_checked_rng_states(rng, dist_info.rank) and dist_info.rank == len(rng):
        print(
            f"note: the checkpoint holds the RNG states of {len(rng)} rank(s); ranks {len(rng)} and up got "
            f"their own, drawn from rank 0's (their dropout differs from a run on {len(rng)} rank(s))"
        )
    if spike_guard is not None and ckpt.get('spike_guard'):
        spike_guard.load_state_dict(ckpt['spike_guard'])
    if loader is not None and ckpt.get('loader'):
        loader.load_state_dict(ckpt['loader'])
    elif loader is not None and dist_info.master:
        print(
            "warning: the checkpoint has no data-loader state (a nanoGPT checkpoint?); the data order after "
            "resuming will differ from an uninterrupted run",
            file=sys.stderr)


# -----------------------------------------------------------------------------
# RNG states, for exact resume: every generator a training step can draw from (torch's CPU and CUDA
# ones for dropout, Python's and numpy's), as tensors and plain values that a weights_only
# checkpoint can hold, gathered from every rank so that rank 0 can save them all

def rng_state():
    """ Every RNG a training step can touch (dropout, shuffles), as tensors and plain values. """
    state = {
        'torch': torch.get_rng_state(),
        'python': _python_rng_state(),
        'numpy': _numpy_rng_state()
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state['cuda'])
    if 'python' in state:
        version, internal, gauss = state['python']
        random.setstate((version, tuple(internal), gauss))
    if 'numpy' in state:
        name, keys, pos, has_gauss, cached = state['numpy']
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _python_rng_state():
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _numpy_rng_state():
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def gather_rng_states(dist_info):
    """ The RNG state of every rank, gathered to all ranks (so rank 0 can save them all). """
    state = rng_state()
    if not dist_info.under_torchrun:
        return [state]
    import torch.distributed as dist
    states = [None] * dist_info.world_size
    dist.all_gather_object(states, state)
    return states


def restore_checked_rng_states(states, rank):
    """
    restore_rng_states of a checkpoint's 'rng' entry, or one line when it is not the list of
    per-rank states this project saves (a string, a state of the wrong shape: a file edited, or
    saved by other code).
    """
    bad = UserError("the checkpoint's RNG states ('rng') are not the per-rank states this project "
                    "saves; resume from another checkpoint, or start a new run in another --out_dir")
    if not (isinstance(states, list) and all(isinstance(s, dict) and 'torch' in s for s in states)):
        raise bad
    try:
        return restore_rng_states(states, rank)
    # torch's, random's and numpy's own checks of a state: a wrong type, size or value
    except (TypeError, ValueError, RuntimeError, IndexError, KeyError):
        raise bad from None


def restore_rng_states(states, rank):
    """
    On resume, this rank's RNG states from a checkpoint's list of every saved rank's. A rank the
    checkpoint has no state for (resuming on more ranks than were saved) starts from rank 0's, then
    is reseeded with a number drawn from it plus its rank: its own stream, the same on every resume,
    never another rank's copy (which would give two ranks the same dropout masks). Returns whether
    the state was derived.
    """
    if rank < len(states):
        set_rng_state(states[rank])
        return False
    set_rng_state(states[0])
    seed = int(torch.randint(2 ** 62, (1,)).item()) + rank
    torch.manual_seed(seed)  # every device's generator too
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    return True


# -----------------------------------------------------------------------------
# the checkpoints a run keeps: ckpt.pt, ckpt_best.pt, the snapshots; going back to one

def checkpoint_files(out_dir):
    """
    The checkpoints a run keeps in out_dir: ckpt.pt, ckpt_best.pt, finetune.py's ckpt_last.pt, the
    snapshots.
    """
    if not os.path.isdir(out_dir):
        return []
    named = [n for n in (CHECKPOINT, BEST, LAST) if os.path.isfile(os.path.join(out_dir, n))]
    return named + [name for _, name in sorted(snapshots(out_dir).items())]


def is_checkpoint_name(name):
    """
    Whether a run saves under this name: ckpt.pt, ckpt_best.pt, ckpt_last.pt, a snapshot, or the
    .json sidecar of one of them.
    """
    named = (CHECKPOINT, BEST, LAST)
    return name in named or name in map(sidecar_of, named) or bool(
        SNAPSHOT.match(name) or SNAPSHOT.match(os.path.splitext(name)[0] + '.pt'))


def snapshot_name(iter_num):
    """ The file name of the snapshot of iteration iter_num: ckpt_<iter_num>.pt. """
    return f'ckpt_{iter_num}.pt'


def snapshots(out_dir):
    """ {iteration: file name} of the ckpt_<iter>.pt snapshots in out_dir. """
    return {int(m.group(1)): m.group(0) for m in map(SNAPSHOT.match, os.listdir(out_dir)) if m}


def copy_checkpoint(path, new_path):
    """
    new_path (and its .json sidecar) becomes a copy of the complete checkpoint at path, atomically.
    A copy, never a hard link: with a link, a file copied over one name (cp ckpt_2000.pt ckpt.pt)
    would be written through into the other. Where the file system can clone (btrfs, XFS:
    copy-on-write), the copy takes no time and no space until one of them changes.
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


def snapshot_checkpoint(out_dir, iter_num, keep):
    """
    After out_dir/ckpt.pt of iteration iter_num is complete: copy it to ckpt_<iter_num>.pt, then
    delete the snapshots other than the `keep` newest. (Those of another line of the run never
    count: branch_off moved them away before this line's first save.) Returns the deleted names.
    """
    copy_checkpoint(os.path.join(out_dir, CHECKPOINT), os.path.join(out_dir, snapshot_name(iter_num)))
    iters = sorted(snapshots(out_dir))
    deleted = []
    for i in iters[:-keep]:
        deleted += remove_checkpoint(out_dir, snapshot_name(i))
    # a run killed between a snapshot and its sidecar's removal (before the order below) left the
    # sidecar alone: it would describe a checkpoint that isn't there
    held = snapshots(out_dir)
    for name in os.listdir(out_dir):
        found = re.match(r'^ckpt_(\d+)\.json$', name)
        if found and int(found.group(1)) not in held:
            deleted += remove_checkpoint(out_dir, snapshot_name(found.group(1)))
    return deleted


def remove_checkpoint(out_dir, name):
    """
    Delete a checkpoint and its sidecar (the sidecar first: a kill between the two leaves a
    checkpoint without its summary, never a summary of nothing); returns the names deleted.
    """
    deleted = []
    for n in (sidecar_of(name), name):
        try:
            os.remove(os.path.join(out_dir, n))
            deleted.append(n)
        except FileNotFoundError:
            pass
    return deleted


def resume_point(out_dir, resume_from=''):
    """
    The file --init_from=resume continues from: ckpt.pt, or the snapshot resume_from names ('2000'
    or its name).
    """
    if not resume_from:
        return os.path.join(out_dir, CHECKPOINT)
    name = snapshot_name(resume_from) if resume_from.isdigit() else resume_from
    if not SNAPSHOT.match(name):
        raise UserError(
            f"--resume_from={resume_from!r} is not a snapshot: give its iteration (2000) or its name "
            f"(ckpt_2000.pt) in out_dir")
    path = os.path.join(out_dir, name)
    if not os.path.isfile(path):
        held = ', '.join(snapshots(out_dir).values()) if os.path.isdir(out_dir) else ''
        raise UserError(f"there is no snapshot {path} to resume from; {out_dir} holds "
                        f"{held or 'no snapshots'} (--keep_checkpoints=K keeps the last K saves)")
    return path


def branch_off(out_dir, resume_from=''):
    """
    On rank 0, out_dir locked, before a resumed run writes anything. A run resumed at iteration k
    (ckpt.pt's, or the snapshot resume_from names) continues a line of its own: the files of the
    line it leaves (ckpt.pt when going back to a snapshot, the snapshots of later iterations, a
    ckpt_best.pt saved after k) move unchanged into out_dir/abandoned_<n>/, so the new line's saves
    can neither overwrite nor prune them; then the snapshot becomes ckpt.pt (a copy). The same
    happens when the user copied an older snapshot over ckpt.pt by hand. metrics.jsonl stays: its
    reader drops the left line's records past k (metrics.read_metrics).
    """
    start = resume_point(out_dir, resume_from)
    k = saved_iter(start)
    later = [name for i, name in sorted(snapshots(out_dir).items()) if i > k]
    if os.path.isfile(os.path.join(out_dir, BEST)) and saved_iter(os.path.join(out_dir, BEST)) > k:
        later.append(BEST)
    current = os.path.join(out_dir, CHECKPOINT)
    # ckpt.pt is the latest state of the line left behind
    leaving = resume_from and os.path.isfile(current)
    if later or leaving:
        n = 1 + max([int(d.rsplit('_', 1)[1]) for d in os.listdir(out_dir)
                     if d.startswith('abandoned_') and d.rsplit('_', 1)[1].isascii()
                     and d.rsplit('_', 1)[1].isdigit()] or [0])
        keep_dir = os.path.join(out_dir, f'abandoned_{n}')
        os.makedirs(keep_dir)
        for name in later:  # moved (a kill halfway leaves each file in one of the two places)
            for part in (name, sidecar_of(name)):
                if os.path.exists(os.path.join(out_dir, part)):
                    os.replace(os.path.join(out_dir, part), os.path.join(keep_dir, part))
        if leaving:  # copied, then replaced below: out_dir always holds a ckpt.pt to resume from
            copy_checkpoint(current, os.path.join(keep_dir, CHECKPOINT))
            later.insert(0, CHECKPOINT)
        print(
            f"resuming at iter {k}: the later files of this run ({', '.join(later)}) are kept, unchanged, in "
            f"{keep_dir}")
    if resume_from:
        copy_checkpoint(start, current)


def checkpoint_path(init_from, out_dir, resume_file=CHECKPOINT):
    """
    The checkpoint file init_from names: 'resume' (out_dir/resume_file), a directory holding
    ckpt.pt, a file.
    """
    if init_from == 'resume':
        return os.path.join(out_dir, resume_file)
    if os.path.isfile(init_from):
        return init_from
    if os.path.isdir(init_from) and os.path.exists(os.path.join(init_from, CHECKPOINT)):
        return os.path.join(init_from, CHECKPOINT)
    return None
