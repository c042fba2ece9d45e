"""
When a run saves, and how: the Checkpointer of train.py and finetune.py, and its inverse on resume. It owns
  - the cadence: train.py saves at every evaluation (always_save_checkpoint), or only when the val loss improved
    (the best model, also kept as ckpt_best.pt), or every checkpoint_interval iterations; a final save and one at
    a clean stop whatever the cadence;
  - the best model so far (its val loss);
  - snapshots: the last keep_checkpoints saves also kept as ckpt_<iter>.pt, older ones pruned (out_dir.py);
  - the write itself, in the same steps for every file: the ranks vote on whether the weights are finite (so no
    rank walks on alone), gather what rank 0 saves (every rank's RNG states, FSDP's shards), then rank 0
    writes atomically and every rank learns whether it worked (master_decides); a write that fails (a full
    disk, permissions) is one line naming the file.
What a checkpoint holds is the caller's: it passes a function that builds the dict from what was gathered.
restore_training_state puts a checkpoint's optimizer, scaler, RNG, loader and spike-guard states back.

Usage:
    ckpt = Checkpointer('out', dist_info, raw_model, optimizer, policy=cfg.select(CheckpointPolicy))
    saved = ckpt.evaluated(iter_num, val_loss, build)   # build(gathered) -> the checkpoint dict
    if ckpt.due(iter_num, local_iter_num) and not saved:
        ckpt.save(iter_num, build)
"""

import os
import random
import sys
from dataclasses import dataclass

import numpy as np
import torch

from nanogpt_plus.checkpoint import save_checkpoint
from nanogpt_plus.distributed import all_reduce_sum, fail_everywhere, master_decides
from nanogpt_plus.errors import UserError
from nanogpt_plus.out_dir import (
    BEST,
    CHECKPOINT,
    checkpoint_files,
    copy_checkpoint,
    remove_checkpoint,
    snapshot_checkpoint,
)
from nanogpt_plus.parallel import full_state_dicts, load_optimizer_state, local_parameters


@dataclass
class Gathered:
    """ What every rank helped gather for rank 0 to save (None on the other ranks, or when not asked for). """
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
        model: the plain module whose weights are saved (sharded in place under FSDP); optimizer: its optimizer.
        policy: a CheckpointPolicy, the cadence of evaluated() and due() (finetune.py's own saves
        ignore it).
        replaces_a_run: a new run with --overwrite=True: its first save replaces the earlier run's checkpoint of
        that name and deletes the earlier run's others (ckpt_best.pt, ckpt_last.pt, snapshots), which it was
        allowed to replace, so that none of them is ever taken for this run's.
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
                # --overwrite=True: the earlier run's other checkpoints go at this run's first save
                for earlier in self.earlier:
                    if earlier != name:
                        remove_checkpoint(self.out_dir, earlier)
                self.earlier = []
                if after_write is not None:
                    after_write(path)
            # full disk, permissions, a directory in the way: the user's to fix
            except OSError as e:
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
    # the first such rank says
    if rng and restore_rng_states(rng, dist_info.rank) and dist_info.rank == len(rng):
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
# RNG states, for exact resume: every generator a training step can draw from (torch's CPU and CUDA ones for
# dropout, Python's and numpy's), as tensors and plain values that a weights_only checkpoint can hold, gathered
# from every rank so that rank 0 can save them all

def rng_state():
    """ Every RNG a training step can touch (dropout, shuffles), as tensors and plain values. """
    state = {'torch': torch.get_rng_state(), 'python': _python_rng_state(), 'numpy': _numpy_rng_state()}
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


def restore_rng_states(states, rank):
    """
    On resume, this rank's RNG states from a checkpoint's list of every saved rank's. A rank the checkpoint has no
    state for (resuming on more ranks than were saved) starts from rank 0's, then is reseeded with a number drawn
    from it plus its rank: its own stream, the same on every resume, never another rank's copy (which would give
    two ranks the same dropout masks). Returns whether the state was derived.
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
