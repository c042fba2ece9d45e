"""
The pieces of a training loop that train.py and finetune.py share: the learning-rate schedule, model
wrapping (DDP / torch.compile), gradient-sync control, the optimizer step with clipping and GradScaler,
RNG state for exact resume, graceful SIGINT/SIGTERM, and metrics logging (JSON lines + wandb).

Usage:
    from training import get_lr, wrap_model, optimizer_step, MetricsLogger, GracefulExit
"""

import collections
import json
import math
import os
import random
import signal
import sys
import time
from contextlib import contextmanager

import numpy as np
import torch


def get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """ Learning rate decay scheduler (cosine with warmup), as nanoGPT. """
    # 1) linear warmup for warmup_iters steps
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    # 2) if it > lr_decay_iters, return min learning rate (also when there is no decay phase at all)
    if it > lr_decay_iters or lr_decay_iters <= warmup_iters:
        return min_lr
    # 3) in between, use cosine decay down to min learning rate
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    assert 0 <= decay_ratio <= 1
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))  # coeff ranges 0..1
    return min_lr + coeff * (learning_rate - min_lr)


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
    from model import device_peak_flops
    from runtime import PTDTYPE, device_type_of, precision
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


def wrap_model(model, dist_info, compile_model=False, parallelism='ddp'):
    """
    torch.compile and/or DistributedDataParallel around a plain model; returns the model to train.
    parallelism='fsdp' (under torchrun) shards the model in place with FSDP2 instead of DDP, so create the
    optimizer after this call: its parameters are the sharded ones.
    """
    distributed = dist_info is not None and dist_info.ddp
    fsdp = distributed and parallelism == 'fsdp'
    if fsdp:
        shard_model(model, dist_info)  # in place, before compile
    if compile_model:
        print("compiling the model... (takes a ~minute)")
        model = torch.compile(model)  # requires PyTorch 2.0
    if distributed and not fsdp:
        from torch.nn.parallel import DistributedDataParallel as DDP
        device_ids = [dist_info.local_rank] if 'cuda' in dist_info.device else None
        model = DDP(model, device_ids=device_ids)
    return model


def shard_model(model, dist_info):
    """
    FSDP2: shard every Block, then the root (which keeps wte/lm_head, one tied parameter, plus wpe and
    ln_f), over all ranks. Each rank then holds 1/world_size of every parameter, gradient and AdamW
    state; a Block's full weights are all-gathered just for its forward and backward. FSDP also moves
    the model to the device, one Block at a time, so the full model never has to fit there.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    # every rank seeded its own init (seed + rank); DDP broadcasts rank 0's weights, FSDP would shard
    # each rank's own, so start from rank 0's (resumed or pretrained weights are the same everywhere)
    with torch.no_grad():
        for p in model.parameters():
            buf = p.detach().to(dist_info.device)  # nccl needs the GPU; gloo works in place on the CPU
            dist.broadcast(buf, src=0)
            if buf.data_ptr() != p.data_ptr():
                p.copy_(buf)
    mesh = init_device_mesh(torch.device(dist_info.device).type, (dist_info.world_size,))
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def is_fsdp(model):
    from torch.distributed.fsdp import FSDPModule
    return isinstance(getattr(model, '_orig_mod', model), FSDPModule)


def local_param_count(model):
    """ The number of parameter values this rank stores (its shards under FSDP, all of them otherwise). """
    from torch.distributed.tensor import DTensor
    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())


def full_state_dicts(model, optimizer):
    """
    The model and optimizer state dicts of the plain, unsharded model (what ckpt.pt holds, so sample.py
    and a single-process or DDP resume read it unchanged). Under FSDP every shard is all-gathered, so
    every rank must call this at the same point.
    """
    if not is_fsdp(model):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.tensor import DTensor
    gathered = {}  # id(DTensor) -> full CPU tensor, so the tied wte/lm_head weight stays one tensor

    def full(t):
        if not isinstance(t, DTensor):
            return t.detach() if torch.is_tensor(t) else t
        if id(t) not in gathered:
            gathered[id(t)] = t.full_tensor().detach().cpu()
        return gathered[id(t)]
    model_state = {k: full(v) for k, v in model.state_dict(keep_vars=True).items()}
    opt = optimizer.state_dict()  # AdamW's own format: state keyed by parameter index, values sharded
    opt_state = {i: {k: full(v) for k, v in s.items()} for i, s in sorted(opt['state'].items())}
    return model_state, {'state': opt_state, 'param_groups': opt['param_groups']}


def load_optimizer_state(optimizer, state_dict):
    """ optimizer.load_state_dict for a full (unsharded) state dict, sharding it for FSDP parameters. """
    from torch.distributed.tensor import DTensor, distribute_tensor
    params = [p for group in optimizer.param_groups for p in group['params']]
    if any(isinstance(p, DTensor) for p in params):
        state = {}
        for i, s in sorted(state_dict['state'].items()):  # the same order on every rank: collectives
            p = params[int(i)]
            state[i] = {k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                        if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == p.shape else v
                        for k, v in s.items()}
        state_dict = dict(state_dict, state=state)
    optimizer.load_state_dict(state_dict)


def apply_cpu_threads(num_threads):
    """ num_threads > 0 fixes torch's CPU thread count; 0 keeps it (see tune_cpu_threads). """
    from runtime import UserError
    if num_threads < 0:
        raise UserError(f"num_threads must be 0 (auto) or a positive number, got {num_threads}")
    if num_threads > 0:
        torch.set_num_threads(num_threads)


def thread_candidates():
    """ The CPU thread counts worth trying: torch's current count (one per core by default), half, ..., 1. """
    candidates, n = [], torch.get_num_threads()
    while n >= 1:
        candidates.append(n)
        n = n // 2 if n > 1 else 0
    return candidates


def tune_cpu_threads(model, X, Y, ctx, repeats=3, max_flops=2e10):
    """
    Pick the fastest CPU thread count for this model and batch by timing a few forward/backward passes
    with torch's default (one thread per core), half of it, ..., down to 1, and keep the fastest. Small
    models are bound by per-op overhead, where extra OpenMP threads mostly wait on each other (and
    collapse when the cores are shared with other processes); big ones (a forward/backward of more than
    max_flops) keep every core without trying. The passes leave no trace: gradients are dropped and the
    RNG restored. The choice is re-checked during training by ThreadRetuner.
    Returns (threads, {threads: mean seconds}).
    """
    candidates = thread_candidates()
    if len(candidates) == 1 or 6 * model.get_num_params() * X.numel() > max_flops:
        return candidates[0], {}
    rng = torch.get_rng_state()

    def fwd_bwd():
        with ctx:
            _, loss = model(X, Y)
        loss.backward()

    timings = {}
    for n in candidates:
        torch.set_num_threads(n)
        fwd_bwd()  # warm-up (allocator, thread pool)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fwd_bwd()
            ts.append(time.perf_counter() - t0)
        timings[n] = sum(ts) / len(ts)  # the mean: on shared cores the cost is in occasional stalls
    model.zero_grad(set_to_none=True)
    torch.set_rng_state(rng)
    best = min(timings, key=timings.get)
    torch.set_num_threads(best)
    return best, timings


def describe_thread_choice(threads, timings):
    """ The line train.py and bench.py print after tune_cpu_threads (scripts/bench_train_cpu.py reads it). """
    return (f"using {threads} CPU threads (fwd+bwd ms: "
            + ", ".join(f"{n} threads {t * 1000:.1f}" for n, t in timings.items()) + ")")


class ThreadRetuner:
    """
    Keeps the automatic CPU thread count (num_threads=0) the fastest while training. The best count moves
    with the machine's load (other processes on the cores), so a choice made at start-up can go stale.
    Every `interval` iterations, each other candidate count is timed on `probe` real training iterations
    (after one warm-up iteration) and compared with the mean of the current count's last `window`
    iterations; the lowest mean time per iteration wins. Means, not medians: on shared cores the cost of
    too many threads is mostly rare long stalls (a thread descheduled at a barrier), which a median hides
    and throughput pays for. A candidate whose first timed iteration takes over 1.5x the current mean is
    dropped at once, so a round costs little. Feed it the time of every ordinary iteration (not those
    that evaluated or saved a checkpoint).
    """

    def __init__(self, candidates, interval=250, probe=8, window=50):
        self.candidates = list(candidates)
        self.interval, self.probe = interval, probe
        self.recent = collections.deque(maxlen=window)  # the current count's latest iteration times
        self.since_round = 0  # ordinary iterations since the last round
        self.todo = []  # candidates still to time in this round; the first one is being timed
        self.times = []  # the timed iterations of todo[0]
        self.means = {}  # thread count -> mean seconds per iteration, this round
        self.start = None  # the thread count in use when this round started
        self.warmup = 0  # iterations to ignore after a change of thread count

    def observe(self, dt):
        """ Record an iteration's time in seconds. Returns a message when the thread count changed. """
        if not self.todo:
            self.recent.append(dt)
            self.since_round += 1
            if self.since_round >= self.interval and len(self.candidates) > 1:
                self.start = torch.get_num_threads()
                self.means = {self.start: sum(self.recent) / len(self.recent)}
                self.todo = [n for n in self.candidates if n != self.start]
                self._time_next()
            return None
        if self.warmup:
            self.warmup -= 1
            return None
        self.times.append(dt)
        hopeless = dt > 1.5 * self.means[self.start]
        if len(self.times) < self.probe and not hopeless:
            return None
        self.means[self.todo.pop(0)] = sum(self.times) / len(self.times)
        if self.todo:
            self._time_next()
            return None
        best = min(self.means, key=self.means.get)
        torch.set_num_threads(best)
        self.since_round = 0
        self.recent.clear()
        if best == self.start:
            return None
        return (f"using {best} CPU threads instead of {self.start} (ms/iter: "
                + ", ".join(f"{k} threads {v * 1000:.1f}" for k, v in self.means.items()) + ")")

    def _time_next(self):
        torch.set_num_threads(self.todo[0])
        self.times = []
        self.warmup = 1


@contextmanager
def grad_sync_context(model, sync):
    """
    Skip the gradient communication on all but the last micro-step of gradient accumulation: DDP's
    all-reduce (no_sync), or FSDP's reduce-scatter (gradients then accumulate unsharded on each rank).
    """
    if sync:
        yield
    elif hasattr(model, 'no_sync'):
        with model.no_sync():
            yield
    elif hasattr(model, 'set_requires_gradient_sync'):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def optimizer_step(model, optimizer, scaler, grad_clip):
    """ Unscale, clip, step, update the scaler and zero the grads; returns the grad norm tensor (or None). """
    norm = None
    if grad_clip != 0.0:
        scaler.unscale_(optimizer)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        if hasattr(norm, 'full_tensor'):  # FSDP: a DTensor; the same total norm on every rank
            norm = norm.full_tensor()
    # step the optimizer and scaler if training in fp16
    scaler.step(optimizer)
    scaler.update()
    # flush the gradients as soon as we can, no need for this memory anymore
    optimizer.zero_grad(set_to_none=True)
    return norm


def all_reduce_sum(values, dist_info):
    """ Sum over ranks of a list of floats (returns them unchanged in a single process). """
    if not dist_info.ddp:
        return list(values)
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64, device=dist_info.device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_mean(values, dist_info):
    """ Mean over ranks of a list of floats (returns them unchanged in a single process). """
    return [v / dist_info.world_size for v in all_reduce_sum(values, dist_info)]


def accumulation_per_rank(gradient_accumulation_steps, dist_info):
    """
    The micro-steps each of world_size processes runs, so that the global batch (batch_size x
    gradient_accumulation_steps) is the same for any number of processes.
    """
    from runtime import UserError
    w = dist_info.world_size
    if gradient_accumulation_steps % w != 0:
        raise UserError(f"gradient_accumulation_steps ({gradient_accumulation_steps}) must be divisible by the "
                        f"number of processes ({w}); pick a multiple of {w}")
    return gradient_accumulation_steps // w


def fit_block_size(model, block_size):
    """ Crop the model to block_size (model surgery) when it is smaller; a larger one is an error. 0 = keep. """
    from runtime import UserError
    if block_size and block_size < model.config.block_size:
        model.crop_block_size(block_size)
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

    def should_stop(self, dist_info, sync_point=True):
        """
        True on every rank once any rank got a signal (all ranks must stop at the same step). With several
        processes that takes a collective and a host sync, so it is only asked at sync_point steps (the
        loop's log steps, which sync anyway); a single process just reads its flag.
        """
        if not dist_info.ddp:
            return self.requested
        if not sync_point:
            return False
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
