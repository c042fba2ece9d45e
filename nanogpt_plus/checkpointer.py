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

import os
import re
import shutil
from dataclasses import dataclass

import torch

from nanogpt_plus.checkpoint import save_checkpoint
from nanogpt_plus.distributed import all_reduce_sum, fail_everywhere, master_decides
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import temp_path
from nanogpt_plus.parallel import full_state_dicts, load_optimizer_state, local_parameters
from nanogpt_plus.rng import gather_rng_states, set_rng_state

CHECKPOINT = 'ckpt.pt'  # train.py's checkpoint: the training state to resume from (the best model without always_save)
BEST = 'ckpt_best.pt'  # with always_save_checkpoint=False: the best model so far, kept beside ckpt.pt
SNAPSHOT = re.compile(r'^ckpt_(\d+)\.pt$')  # ckpt_<iter>.pt, the snapshots keep_checkpoints retains


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
        replaces_a_run: a new run with --overwrite=True, whose saves replace an earlier run's snapshots.
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
        out_dir/ckpt.pt of iteration iter_num; every rank calls this. best=True: the best model so far
        (always_save_checkpoint=False), also kept as ckpt_best.pt. Snapshots follow (keep_checkpoints).
        """
        def after_write(path):
            if best:
                keep_checkpoint_as(path, self.path(BEST))
            if self.keep > 0:
                snapshot_checkpoint(self.out_dir, iter_num, self.keep, drop_later=self.replaces_a_run)

        # without always_save_checkpoint ckpt.pt is the best model until a save that isn't (a checkpoint_interval
        # save, an interrupted or final one) replaces it: then keep it as ckpt_best.pt first, if not kept yet
        before_write = self.keep_best if not self.always_save and not best else None
        self.write(CHECKPOINT, build, iter_num, announce=f"saving checkpoint to {self.out_dir}"
                   + (f" ({reason})" if reason else ""), before_write=before_write, after_write=after_write)

    def keep_best(self):
        path, best_path = self.path(), self.path(BEST)
        if os.path.exists(path) and not os.path.exists(best_path):
            keep_checkpoint_as(path, best_path)
            print(f"kept the best checkpoint so far as {best_path}")

    # -------------------------------------------------------------------------
    # the write, the same for every file

    def write(self, name, build, iter_num, training_state=True, announce=None, done=None, before_write=None,
              after_write=None):
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
                if before_write is not None:
                    before_write()
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


def restore_training_state(ckpt, optimizer, scaler, dist_info):
    """ On resume: the optimizer state (sharded for FSDP), the GradScaler's if saved, and this rank's RNGs. """
    load_optimizer_state(optimizer, ckpt['optimizer'])
    if ckpt.get('scaler'):
        scaler.load_state_dict(ckpt['scaler'])
    rng = ckpt.get('rng')
    if rng:
        set_rng_state(rng[dist_info.rank] if dist_info.rank < len(rng) else rng[0])


# -----------------------------------------------------------------------------
# extra copies of the checkpoint

def keep_checkpoint_as(path, new_path):
    """ new_path (and its .json sidecar) becomes the complete checkpoint at path, atomically. """
    _keep_file_as(path, new_path)
    sidecar = os.path.splitext(path)[0] + '.json'
    if os.path.exists(sidecar):
        _keep_file_as(sidecar, os.path.splitext(new_path)[0] + '.json')


def _keep_file_as(path, new_path):
    # a hard link to the file (the next save renames a new file over path, so the link keeps this one);
    # a copy where the file system has no links
    tmp = temp_path(new_path)
    try:
        try:
            os.link(path, tmp)
        except OSError:
            shutil.copyfile(path, tmp)
        os.replace(tmp, new_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def snapshot_checkpoint(out_dir, iter_num, keep, drop_later=False):
    """
    After out_dir/ckpt.pt of iteration iter_num is complete: keep it as ckpt_<iter_num>.pt too, then delete
    the snapshots other than the `keep` newest up to iter_num. Snapshots of larger iterations belong to another
    line of the run: one that --overwrite=True replaces (drop_later: deleted), or one the user went back from by
    resuming an older snapshot (left alone: never deleted without being asked). Returns the deleted names.
    """
    keep_checkpoint_as(os.path.join(out_dir, 'ckpt.pt'), os.path.join(out_dir, f'ckpt_{iter_num}.pt'))
    iters = sorted(int(m.group(1)) for m in map(SNAPSHOT.match, os.listdir(out_dir)) if m)
    kept = set([i for i in iters if i <= iter_num][-keep:])
    deleted = []
    for i in iters:
        if i in kept or (i > iter_num and not drop_later):
            continue
        for name in (f'ckpt_{i}.pt', f'ckpt_{i}.json'):
            try:
                os.remove(os.path.join(out_dir, name))
                deleted.append(name)
            except FileNotFoundError:
                pass
    return deleted

