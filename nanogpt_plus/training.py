"""
The pieces of a training loop that train.py and finetune.py share: the learning-rate schedule (and
setting it on the optimizer), the GradScaler, the optimizer step with clipping (in two halves, so the
spike guard can refuse an update in between), the out-of-memory message, RNG state for exact resume,
graceful SIGINT/SIGTERM, and metrics logging (JSON lines + wandb) and reading them back.

Usage:
    from nanogpt_plus.training import set_learning_rate, optimizer_step, MetricsLogger, GracefulExit
    lr = set_learning_rate(optimizer, iter_num, 6e-4, 2000, 600000, 6e-5)
"""

import json
import math
import os
import random
import signal
import sys
import time
from datetime import datetime

import numpy as np
import torch

from nanogpt_plus.hardware import device_peak_flops
from nanogpt_plus.parallel import load_optimizer_state
from nanogpt_plus.runtime import PTDTYPE, UserError, device_type_of, error_line, precision
from nanogpt_plus.threads import apply_cpu_threads


def get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """
    The learning rate of iteration `it`, nanoGPT's schedule: a linear ramp up to learning_rate over
    warmup_iters, a half cosine from learning_rate down to min_lr that ends at lr_decay_iters, then min_lr.
    """
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)  # never 0, so iteration 0 already learns
    if it > lr_decay_iters or lr_decay_iters <= warmup_iters:  # past the decay, or no decay phase at all
        return min_lr
    progress = (it - warmup_iters) / (lr_decay_iters - warmup_iters)  # 0 after the warmup, 1 at lr_decay_iters
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))  # from 1 down to 0
    return min_lr + cosine * (learning_rate - min_lr)


def set_learning_rate(optimizer, it, learning_rate, warmup_iters, lr_decay_iters, min_lr, decay_lr=True):
    """ Set iteration `it`'s learning rate on every parameter group and return it (no decay_lr: learning_rate). """
    lr = get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr) if decay_lr else learning_rate
    for group in optimizer.param_groups:
        group['lr'] = lr
    return lr


def make_grad_scaler(device_type, dtype):
    """ A GradScaler, enabled only for float16 (bf16 and fp32 don't need loss scaling). """
    return torch.amp.GradScaler(device_type if device_type == 'cuda' else 'cpu', enabled=(dtype == 'float16'))


def compute_setup(device, dtype, compile_setting, num_threads, peak=True):
    """
    Everything a run on `device` decides before building the model: TF32 on CUDA, the dtype ('auto'
    resolved), the autocast context, whether to torch.compile, the device's peak FLOP/s for MFU (None
    with peak=False: on a CPU finding it runs a short matmul probe), and the CPU thread count.
    Returns (dtype, ctx, compile_model, peak_flops).
    """
    device_type = device_type_of(device)
    dtype, ctx = precision(device, dtype)
    compile_model = resolve_compile(compile_setting, device_type)
    # MFU against the whole device: on the CPU every core torch uses by default, whatever num_threads
    peak_flops = device_peak_flops(device, PTDTYPE[dtype]) if peak else None
    apply_cpu_threads(num_threads)
    return dtype, ctx, compile_model, peak_flops


def resolve_compile(setting, device_type):
    """
    compile=None (auto) compiles on CUDA only: on the CPU the compile time (20-100 s on 2 cores) costs
    about what it saves over a few thousand small-model iterations (measured with bench.py).
    """
    return setting if setting is not None else device_type == 'cuda'


def optimizer_step(model, optimizer, scaler, grad_clip):
    """ Unscale, clip, step, update the scaler and zero the grads; returns the grad norm tensor (or None). """
    norm = unscale_and_clip(model, optimizer, scaler, grad_clip)
    take_update(optimizer, scaler)
    return norm


def unscale_and_clip(model, optimizer, scaler, grad_clip, measure=False):
    """
    The first half of an optimizer step: unscale the float16 gradients and clip them to grad_clip. Returns
    their global norm before clipping (a tensor, the same on every rank), or None when grad_clip is 0 and
    measure is False. measure=True measures the norm without clipping (the spike guard needs it).
    """
    if grad_clip == 0.0 and not measure:
        return None
    scaler.unscale_(optimizer)
    if grad_clip != 0.0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    if hasattr(norm, 'full_tensor'):  # FSDP: a DTensor; the same total norm on every rank
        norm = norm.full_tensor()
    return norm


def take_update(optimizer, scaler):
    """ The second half: step (the scaler skips it if float16 gradients overflowed), update the scaler, zero. """
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)  # None, not zeros: the memory is free until the next backward


def skip_update(optimizer, scaler):
    """
    The second half of a step the spike guard refused: the weights and AdamW state stay exactly as they
    were, the gradients are dropped. A float16 scaler keeps its scale and growth count (new_scale=its own
    scale only clears the record of this iteration's unscale_, which the next unscale_ would refuse).
    """
    if scaler.is_enabled():
        scaler.update(new_scale=scaler.get_scale())
    optimizer.zero_grad(set_to_none=True)


# -----------------------------------------------------------------------------
# the spike guard: skip the updates of outlier steps (llm.c's -sl / -sg)

SPIKE_WINDOW = 128  # the running statistics cover the last 128 steps, as llm.c's OutlierDetector


class SpikeGuard:
    """
    Skips an update whose loss (or gradient norm) lies more than skip_loss_z (skip_grad_z) standard
    deviations above the mean of the last SPIKE_WINDOW steps: one bad batch or a numerical blow-up then
    costs one step instead of the run. 0 turns a check off. As in llm.c, z is undefined (nothing is skipped)
    until the window is full, every finite value enters the window, skipped or not (so a lasting shift in
    the loss is soon the new normal), and non-finite values never do (those stop the run elsewhere, or are
    the float16 GradScaler's to skip). The state is plain lists of floats, for weights_only checkpoints.

        guard = SpikeGuard(skip_loss_z=5.0, skip_grad_z=5.0)
        spike = guard.check(loss, grad_norm)  # None: take the update; else a Spike to report
    """

    def __init__(self, skip_loss_z=0.0, skip_grad_z=0.0, window=SPIKE_WINDOW):
        self.limits = {'loss': float(skip_loss_z), 'grad_norm': float(skip_grad_z)}
        self.window = window
        self.history = {'loss': [], 'grad_norm': []}  # the last `window` finite values of each, oldest first
        self.skipped = 0  # updates skipped so far in the run (a resumed run goes on counting)

    @property
    def enabled(self):
        return any(z > 0 for z in self.limits.values())

    def z_score(self, name, value):
        """ How many standard deviations value lies above the window's mean (None: window not full, or flat). """
        values = self.history[name]
        if value is None or not math.isfinite(value) or len(values) < self.window:
            return None
        mean = sum(values) / len(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / len(values))
        return (value - mean) / std if std > 0 else None

    def check(self, loss, grad_norm=None):
        """ Judge one step (grad_norm None: not measured), then add its values to the windows. """
        values = {'loss': loss, 'grad_norm': grad_norm}
        stats = {name: (value, self.z_score(name, value), self.mean(name)) for name, value in values.items()}
        for name, value in values.items():
            if value is not None and math.isfinite(value):
                self.history[name] = (self.history[name] + [float(value)])[-self.window:]
        outliers = [name for name, (_, z, _) in stats.items() if z is not None and 0 < self.limits[name] < z]
        if not outliers:
            return None
        self.skipped += 1
        return Spike(stats, outliers, self.limits)

    def mean(self, name):
        values = self.history[name]
        return sum(values) / len(values) if values else None

    def state_dict(self):
        return {'loss': list(self.history['loss']), 'grad_norm': list(self.history['grad_norm']),
                'skipped': self.skipped}

    def load_state_dict(self, state):
        for name in self.history:
            self.history[name] = [float(v) for v in state.get(name, [])][-self.window:]
        self.skipped = int(state.get('skipped', 0))


class Spike:
    """ A step the SpikeGuard refused: {name: (value, z, running mean)} and the names that were too high. """

    def __init__(self, stats, outliers, limits):
        self.stats, self.outliers, self.limits = stats, outliers, limits

    def describe(self):
        """ 'loss 4.1234 is 6.2 standard deviations above its running mean 3.1000 (skip_loss_z=5.0)', ... """
        words = {'loss': ('loss', 'skip_loss_z'), 'grad_norm': ('grad norm', 'skip_grad_z')}
        parts = []
        for name in self.outliers:
            value, z, mean = self.stats[name]
            label, setting = words[name]
            parts.append(f"{label} {value:.4f} is {z:.1f} standard deviations above its running mean {mean:.4f} "
                         f"({setting}={self.limits[name]})")
        return '; '.join(parts)

    def record(self, iter_num):
        """ The metrics record of the skip. """
        (loss, loss_z, _), (grad_norm, grad_z, _) = self.stats['loss'], self.stats['grad_norm']
        return {'type': 'skip', 'iter': iter_num, 'loss': loss, 'grad_norm': grad_norm, 'loss_z': loss_z,
                'grad_z': grad_z}


def out_of_memory_error(iter_num, out_dir, checkpoint_file, fsdp=True):
    """
    The one line a CUDA out-of-memory error in the training loop ends with: what to change so the step fits.
    Nothing is saved after it (a checkpoint needs memory too, and the step's state is half-done), so the last
    checkpoint stays as it was.
    """
    path = os.path.join(out_dir, checkpoint_file)
    if os.path.exists(path):
        kept = f"the last checkpoint, {path}, is kept (nothing was saved after the error)"
        then = "resume with --init_from=resume"
    else:
        kept, then = f"no checkpoint had been saved to {out_dir} yet", "start again"
    fixes = ["a smaller --batch_size with more --gradient_accumulation_steps (the same tokens per step)",
             "--activation_checkpointing=True (recompute each Block in the backward pass)"]
    if fsdp:
        fixes.append("--parallelism=fsdp under torchrun (shard the weights and optimizer state)")
    fixes.append("a smaller --block_size")
    return UserError(f"out of GPU memory at iter {iter_num}; {kept}. To fit, use " + ", ".join(fixes[:-1])
                     + f" or {fixes[-1]}, then {then}")


def fit_block_size(model, block_size):
    """ Crop the model to block_size (model surgery) when it is smaller; a larger one is an error. 0 = keep. """
    if block_size and block_size < model.config.block_size:
        model.crop_block_size(block_size)  # model surgery: keeps the first block_size positions of wpe
    elif block_size > model.config.block_size:
        raise UserError(f"block_size {block_size} is larger than the model's {model.config.block_size}; "
                        f"use --block_size={model.config.block_size} or less")


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


def restore_training_state(ckpt, optimizer, scaler, dist_info):
    """ On resume: the optimizer state (sharded for FSDP), the GradScaler's if saved, and this rank's RNGs. """
    load_optimizer_state(optimizer, ckpt['optimizer'])
    if ckpt.get('scaler'):
        scaler.load_state_dict(ckpt['scaler'])
    rng = ckpt.get('rng')
    if rng:
        set_rng_state(rng[dist_info.rank] if dist_info.rank < len(rng) else rng[0])


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


def tensors_finite(tensors):
    """ Whether every floating-point tensor (weights before a checkpoint is written) is free of inf/nan. """
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


class GracefulExit:
    """
    SIGINT/SIGTERM (Ctrl-C, preemption) set a flag instead of killing the process, so the loop can finish
    the current iteration and save. A second Ctrl-C exits at once.

    Under torchrun the launcher forwards one signal to every worker and SIGKILLs them --shutdown_timeout
    seconds later (30 by default), so the ranks agree on the flag after every iteration (should_stop) rather
    than at log steps only. The same signal arrives when torchrun tears the job down because one rank failed;
    the agreement then fails (the peer is gone) and the rank exits without saving, so a worker only announces
    the stop once every rank has joined the agreement.
    """

    def __init__(self):
        self.requested = False
        self.signum = 0  # the signal received, 0 = none
        self._previous = {}
        self._flag_group = None  # the (gloo, CPU) process group the flag is all-reduced over

    def install(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        if _in_process_group():
            self._cpu_group()  # a collective: made here, before the loop, where every rank calls install()
        return self

    def _handle(self, signum, frame):
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested, self.signum = True, int(signum)
        if not _in_process_group():  # several processes: should_stop says it, once they all agreed
            print(f"\nreceived {signal.Signals(signum).name}: finishing this iteration, then saving a checkpoint",
                  file=sys.stderr, flush=True)

    def should_stop(self, dist_info):
        """
        True on every rank once any rank got a signal, at the same iteration on all of them: call it once per
        iteration on every rank. With several processes that is a one-number all-reduce each time, over a
        gloo group on the CPU: it never waits for the GPU (no host sync, unlike a flag on the device); it costs
        0.5-0.7 ms per iteration measured with 2 ranks on a busy 2-core CPU, against a training step of tens of
        milliseconds (tiny models) to seconds. Rank 0 then prints why the run stops.
        """
        if not dist_info.ddp:
            return self.requested
        import torch.distributed as dist
        flag = torch.tensor([self.signum], dtype=torch.int64)  # the signal (max over ranks) or 0
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._cpu_group())
        signum = int(flag.item())
        if signum and dist_info.master:
            print(f"received {signal.Signals(signum).name}: all processes stop here and save a checkpoint",
                  file=sys.stderr, flush=True)
        return bool(signum)

    def _cpu_group(self):
        import torch.distributed as dist
        if dist.get_backend() == 'gloo':
            return None  # the default group already reduces CPU tensors
        if self._flag_group is None:  # made by install() on every rank (new_group is a collective)
            self._flag_group = dist.new_group(backend='gloo')
        return self._flag_group

    def uninstall(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _in_process_group():
    import torch.distributed as dist
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class MetricsLogger:
    """
    One JSON object per line in out_dir/metrics.jsonl (always, on the master rank) and, when asked, the
    same numbers to wandb. A wandb that can't start (not installed, not logged in, offline without
    WANDB_MODE=offline) is a warning, not a crash.

    Every start of a run into the out_dir is a new 'run' (1, 2, ... counted from the file): each record
    carries its number, and start() writes a {'type': 'start', 'run', 'iter', ...} record first, so a
    resumed run's repeated iterations can be told from the ones they replace (read_metrics).
    """

    def __init__(self, path, enabled=True, wandb_log=False, wandb_project=None, wandb_run_name=None,
                 config=None, wandb_dir=None):
        self.enabled = enabled
        self.path = path
        self.wandb = None
        self.t_start = time.time()
        self.run = None
        if not enabled:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.run = last_run_number(path) + 1
        self.file = open(path, 'a', encoding='utf-8')
        if self.file.tell() and not _ends_with_newline(path):
            self.file.write("\n")  # a run killed mid-line left half a record: ours start on a line of their own
        if wandb_log:
            try:
                import wandb
                wandb.init(project=wandb_project, name=wandb_run_name, config=config, dir=wandb_dir)
                self.wandb = wandb
            except Exception as e:  # wandb raises many kinds (UsageError, CommError, ...): all mean "no wandb"
                print(f"warning: wandb could not start ({error_line(e)}); "
                      f"continuing without it (set WANDB_MODE=offline to log locally)", file=sys.stderr)

    def start(self, iter_num, init_from):
        """ The record that opens this run: where it starts (a resume: the checkpoint's iteration) and from what. """
        self.log({'type': 'start', 'iter': iter_num, 'init_from': init_from,
                  'time': datetime.now().astimezone().isoformat(timespec='seconds')})

    def log(self, record):
        if not self.enabled:
            return
        record = dict(record, run=self.run, wall_time=round(time.time() - self.t_start, 3))
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb is not None and record.get('type') != 'start':
            numbers = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ('iter', 'run')}
            self.wandb.log(numbers, step=record.get('iter'))

    def close(self):
        if not self.enabled:
            return
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def last_run_number(path):
    """ The highest 'run' of the start records in a metrics file (0 for none, or no file). """
    last = 0
    for record in _metrics_records(path):
        if record.get('type') == 'start':
            last = max(last, int(record.get('run') or 0))
    return last


def read_metrics(path):
    """
    The records of a metrics.jsonl that make up the run's true trajectory, in order: a later run's records
    replace an earlier run's at iterations from its start on (a resume from iter 1000 drops the first run's
    records past 1000; a new run from iter 0 into the same out_dir drops all of them). Its 'start' records
    stay. Records of files from before the 'run' marks pass as they are.
    """
    kept = []
    for record in _metrics_records(path):
        if record.get('type') == 'start':
            start = record.get('iter', 0)
            kept = [r for r in kept if r.get('type') == 'start' or r.get('iter', -1) < start]
        kept.append(record)
    return kept


def _metrics_records(path):
    """ The JSON objects of a metrics file, skipping lines a killed run left unfinished; none for no file. """
    if not os.path.exists(path):
        return
    with open(path, encoding='utf-8', errors='replace') as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # half a line: the process was killed while writing it
            if isinstance(record, dict):
                yield record


def _ends_with_newline(path):
    with open(path, 'rb') as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
