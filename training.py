"""
The pieces of a training loop that train.py and finetune.py share: the learning-rate schedule, model
wrapping (DDP / torch.compile), gradient-sync control, the optimizer step with clipping and GradScaler,
RNG state for exact resume, graceful SIGINT/SIGTERM, and metrics logging (JSON lines + wandb).

Usage:
    from training import get_lr, wrap_model, optimizer_step, MetricsLogger, GracefulExit
"""

import json
import math
import os
import random
import signal
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch


def get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """ Learning rate decay scheduler (cosine with warmup), as nanoGPT. """
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate
    if it > lr_decay_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)


def make_grad_scaler(device_type, dtype):
    """ A GradScaler, enabled only for float16 (bf16 and fp32 don't need loss scaling). """
    return torch.amp.GradScaler(device_type if device_type == 'cuda' else 'cpu', enabled=(dtype == 'float16'))


def wrap_model(model, dist_info, compile_model=False):
    """ torch.compile and/or DistributedDataParallel around a plain model; returns the model to train. """
    if compile_model:
        print("compiling the model... (takes a ~minute)")
        model = torch.compile(model)  # requires PyTorch 2.0
    if dist_info.ddp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        device_ids = [dist_info.local_rank] if 'cuda' in dist_info.device else None
        model = DDP(model, device_ids=device_ids)
    return model


def grad_sync_context(model, sync):
    """ Skip DDP's gradient all-reduce on all but the last micro-step of gradient accumulation. """
    if not sync and hasattr(model, 'no_sync'):
        return model.no_sync()
    return nullcontext()


def optimizer_step(model, optimizer, scaler, grad_clip):
    """ Unscale, clip, step, update the scaler and zero the grads; returns the grad norm tensor (or None). """
    norm = None
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    # step the optimizer and scaler if training in fp16
    scaler.step(optimizer)
    scaler.update()
    # flush the gradients as soon as we can, no need for this memory anymore
    optimizer.zero_grad(set_to_none=True)
    return norm


def all_reduce_mean(values, dist_info):
    """ Mean over ranks of a list of floats (returns them unchanged in a single process). """
    if not dist_info.ddp:
        return values
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64, device=dist_info.device)
    dist.all_reduce(t)
    return (t / dist_info.world_size).tolist()


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
    if not dist_info.ddp:
        return [state]
    import torch.distributed as dist
    states = [None] * dist_info.world_size
    dist.all_gather_object(states, state)
    return states


def params_finite(model):
    return all(torch.isfinite(p).all() for p in model.parameters())


class GracefulExit:
    """
    SIGINT/SIGTERM (Ctrl-C, preemption) set a flag instead of killing the process, so the loop can finish
    the current iteration and save. A second Ctrl-C exits at once.
    """

    def __init__(self):
        self.requested = False
        self._previous = {}

    def install(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        print(f"\nreceived {signal.Signals(signum).name}: finishing this iteration, then saving a checkpoint",
              file=sys.stderr, flush=True)

    def should_stop(self, dist_info):
        """ True on every rank as soon as any rank got a signal (all ranks must stop at the same step). """
        if not dist_info.ddp:
            return self.requested
        import torch.distributed as dist
        flag = torch.tensor([1.0 if self.requested else 0.0], device=dist_info.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def uninstall(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class MetricsLogger:
    """
    One JSON object per line in out_dir/metrics.jsonl (always, on the master rank) and, when asked, the
    same numbers to wandb. A wandb that can't start (not installed, not logged in, offline without
    WANDB_MODE=offline) is a warning, not a crash.
    """

    def __init__(self, path, enabled=True, wandb_log=False, wandb_project=None, wandb_run_name=None,
                 config=None, wandb_dir=None):
        self.enabled = enabled
        self.path = path
        self.wandb = None
        self.t_start = time.time()
        if not enabled:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file = open(path, 'a', encoding='utf-8')
        if wandb_log:
            try:
                import wandb
                wandb.init(project=wandb_project, name=wandb_run_name, config=config, dir=wandb_dir)
                self.wandb = wandb
            except Exception as e:  # wandb raises many kinds (UsageError, CommError, ...): all mean "no wandb"
                print(f"warning: wandb could not start ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); "
                      f"continuing without it (set WANDB_MODE=offline to log locally)", file=sys.stderr)

    def log(self, record):
        if not self.enabled:
            return
        record = dict(record, wall_time=round(time.time() - self.t_start, 3))
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None:
            step = record.get('iter')
            self.wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float)) and k != 'iter'},
                           step=step)

    def close(self):
        if not self.enabled:
            return
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()
