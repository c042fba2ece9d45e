"""
Time the training step (forward, backward, optimizer) of any model size and batch on CPU, CUDA or
MPS, as nanoGPT's bench.py does, with the model, data loader, optimizer and step of train.py: the
same nanogpt_plus pieces build them (checkpoint.init_model makes the model, as train.py
--init_from=scratch).

Simple mode: burn-in steps, then timed steps; prints each step's loss and then
    time per iteration: Xms, MFU: Y%
plus the median step time, tokens/s, and `peak memory: X MiB (what was measured, ...)`. MFU is
measured against the peak FLOP/s of the device actually used (hardware.device_peak_flops; override
with
NANOGPT_PEAK_FLOPS=<FLOP/s>).
Profiler mode (--profile=True): a torch.profiler trace in profile_dir (open it in chrome://tracing
or TensorBoard) and a table of the most expensive ops.

Usage:
$ python bench.py                                             # GPT-2 124M, 12 x 1024, auto device/dtype
$ python bench.py --device=cpu --dataset=shakespeare_char --block_size=64 --batch_size=12 \\
      --n_layer=4 --n_head=4 --n_embd=128                     # nanoGPT's laptop model
$ python bench.py --real_data=False --compile=True --dtype=bfloat16   # synthetic tokens, compiled
$ python bench.py --dataset=data/fineweb --data_order=sequential     # a directory of llm.c token shards
$ python bench.py --profile=True                              # trace + top ops
$ python bench.py --activation_checkpointing=True             # the peak memory with the Blocks recomputed
"""
# first, before torch is imported (seconds): from here on a signal stops the work in one line and
# exit code 130 (it can't resume; no output is left half-written), or is only said once it is done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import functools
import os
import resource
import statistics
import sys
import time

import torch

from configurator import Group, Schema, Setting, configure
from nanogpt_plus import optimizer as opt
from nanogpt_plus import settings
from nanogpt_plus.dataloader import TokenWindowLoader
from nanogpt_plus.dataset import find_dataset, split_files
from nanogpt_plus.distributed import wrap_model
from nanogpt_plus.init_from import ModelSpec, check_new_model_fits, init_model, scratch_model
from nanogpt_plus.machine import (
    check_environment,
    compute_setup,
    cpu_peak,
    describe_thread_choice,
    device_type_of,
    resolve_device,
    tune_cpu_threads,
)
from nanogpt_plus.outputs import check_output
from nanogpt_plus.runtime import provenance, run_main
from nanogpt_plus.settings import check_model_shape, flag, non_negative, positive

# -----------------------------------------------------------------------------
# The settings and their defaults: train.py's data, model and step (nanoGPT's bench.py: GPT-2
# 124M, 12 x 1024, its optimizer settings), then what to measure; `python bench.py --help` prints
# them with their help. A setting other entry points share has its type, range and help in
# nanogpt_plus/settings.py and its default here.
DATA = Group(
    'data',
    dataset=settings.dataset('openwebtext'),
    data_order=settings.data_order('random'),
    batch_size=settings.batch_size(12),
    block_size=settings.block_size(1024),
)
ADAMW = Group(
    'adamw optimizer',
    learning_rate=settings.learning_rate(1e-4),
    weight_decay=settings.weight_decay(1e-2),
    beta1=settings.beta1(0.9),
    beta2=settings.beta2(0.95),
    grad_clip=settings.grad_clip(1.0),
    optimizer=settings.optimizer('adamw'),
    muon_lr=settings.muon_lr(0.02),
    muon_momentum=settings.muon_momentum(0.95),
    muon_weight_decay=settings.muon_weight_decay(0.0),
    muon_ns_steps=settings.muon_ns_steps(5),
)
BENCH = Group(
    'what bench.py measures',
    real_data=flag(True, "True: batches of the dataset's train split; False: random tokens"),
    fused=Setting(None, "None = auto (fused AdamW where available); False = PyTorch's default "
                        "AdamW for the device", kind=bool, choices=(None, True, False)),
    burnin=non_negative(10, "untimed steps first (compilation, allocator and cache warm-up)"),
    steps=positive(20, "timed steps"),
    profile=flag(False, "True: a torch.profiler trace and op table instead of the timings"),
    profile_dir=Setting('bench_log', "where the profiler trace goes", not_empty=True),
)
MODEL = Group(
    'model',
    n_layer=settings.n_layer(12),
    n_head=settings.n_head(12),
    n_embd=settings.n_embd(768),
    dropout=settings.dropout(0.0),
    bias=settings.bias(False),
    gelu=settings.gelu('none'),
    attention=settings.attention('flash'),
    pos=settings.pos('learned'),
    norm=settings.norm('layernorm'),
    qk_norm=settings.qk_norm(False),
    mlp_act=settings.mlp_act('gelu'),
    logit_softcap=settings.logit_softcap(0.0),
    tie_embeddings=settings.tie_embeddings(True),
)
SYSTEM = Group(
    'system',
    device=settings.device('auto'),
    dtype=settings.dtype('auto'),
    compile=settings.compile(None),
    activation_checkpointing=settings.activation_checkpointing(False),
    num_threads=settings.num_threads(0),
    seed=settings.seed(1337),
)
DEFAULTS = Schema(DATA, MODEL, ADAMW, SYSTEM, BENCH)
# -----------------------------------------------------------------------------


def synchronize(device):
    """
    Wait for the device to finish queued work (a no-op on the CPU, which runs synchronously).
    """
    device_type = device_type_of(device)
    if device_type == 'cuda':
        torch.cuda.synchronize(device)
    elif device_type == 'mps':
        torch.mps.synchronize()


def peak_memory(device):
    """
    (label, bytes): the allocator's peak on CUDA (torch.cuda.max_memory_allocated), the driver's
    allocation on MPS, the peak resident set size of the whole process on the CPU (ru_maxrss: it
    can't be reset, so compare configurations in separate bench.py processes).
    """
    device_type = device_type_of(device)
    if device_type == 'cuda':
        return 'peak CUDA memory allocated', torch.cuda.max_memory_allocated(device)
    if device_type == 'mps':
        return 'MPS driver memory', torch.mps.driver_allocated_memory()
    scale = 1 if sys.platform == 'darwin' else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    return 'peak process RSS', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def check_settings(cfg):
    """
    Every setting, before anything is built: train.py's rules for the model, data and step, plus the
    timing.
    """
    DEFAULTS.check(cfg)
    check_model_shape(cfg.n_embd, cfg.n_head, cfg.pos)
    # the model and its first step in this machine's memory, as train.py checks a new model
    # (block_size=100000 used to fail in the CPU's allocator, a traceback)
    check_new_model_fits(cfg.select(ModelSpec), dataset=cfg.dataset if cfg.real_data else None,
                         batch_size=cfg.batch_size, attention=cfg.attention,
                         on_cpu=resolve_device(cfg.device) == 'cpu')
    if cfg.profile:  # now, not after the benchmark: a file in the way, or a dataset's directory
        check_output(cfg.profile_dir, 'profile_dir', overwrite=None, kind='directory')


def main(argv=None):
    cfg = configure(DEFAULTS, argv, doc=__doc__)
    check_settings(cfg)
    check_environment()  # NANOGPT_PEAK_FLOPS, before the timing it is used for
    device = resolve_device(cfg.device)
    device_type = device_type_of(device)
    torch.manual_seed(cfg.seed)
    device_threads = torch.get_num_threads()  # the CPU's peak is for these (every core by default)
    dtype, ctx, compile_model, peak_flops = compute_setup(device, cfg.dtype, cfg.compile,
                                                          cfg.num_threads)

    # the data before the model, so a missing dataset is reported before anything is built
    loader = None
    if cfg.real_data:
        loader = TokenWindowLoader(split_files(cfg.dataset, 'train'),
                                   cfg.batch_size,
                                   cfg.block_size,
                                   seed=cfg.seed,
                                   device=device,
                                   dataset=cfg.dataset,
                                   order=cfg.data_order)
    model = bench_model(cfg)
    if loader is not None:
        # an id the model has no embedding for: one line
        loader.check_vocab(model.config.vocab_size)
    model.set_attention(cfg.attention)
    model.set_activation_checkpointing(cfg.activation_checkpointing)
    model.to(device)
    next_batch = loader.next_batch if loader else random_batches(
        cfg.batch_size, cfg.block_size, model.config.vocab_size, device)
    X, Y = next_batch()
    if device_type == 'cpu' and cfg.num_threads == 0:
        threads, timings = tune_cpu_threads(model, X, Y, ctx)
        if timings:
            print(describe_thread_choice(threads, timings))
    # Muon's work is no model FLOPs
    muon = cfg.select(opt.MuonSpec) if cfg.optimizer == 'muon' else None
    optimizer = opt.make_optimizer(model, cfg.select(opt.AdamWSpec), device_type, muon=muon,
                                   fused=cfg.fused)
    scaler = opt.make_grad_scaler(device_type, dtype)
    raw_model = model
    model = wrap_model(model, None, compile_model)
    print("provenance: " + str(dict(provenance(device), dtype=dtype, compile=compile_model,
                                    gelu=raw_model.config.gelu, **raw_model.config.modern())))
    step = functools.partial(train_step, model, optimizer, scaler, ctx, next_batch,
                             cfg.grad_clip)

    if cfg.profile:
        profile(step, X, Y, cfg.burnin, cfg.profile_dir, device_type)
        return
    if device_type == 'cuda':
        # the peak of the training steps (weights, AdamW state included)
        torch.cuda.reset_peak_memory_stats(device)
    times = time_steps(step, X, Y, cfg.burnin, cfg.steps, device)
    report(times, raw_model, cfg.batch_size, peak_flops, device, dtype, device_threads)


def bench_model(cfg):
    """
    The GPT to time, built as train.py builds a new one for the same settings
    (checkpoint.init_model): with the dataset's vocabulary for real data, GPT-2's (padded to 50304)
    for random tokens, which have no dataset.
    """
    spec = cfg.select(ModelSpec)
    if cfg.real_data:
        data = find_dataset(cfg.dataset, splits=('train',))
        model, _, _ = init_model('scratch', dataset=data, spec=spec)
        return model
    return scratch_model(spec, data_meta=None, data_dir=None)


def random_batches(batch_size, block_size, vocab_size, device):
    """
    A next_batch() of uniformly random tokens (targets: the inputs shifted by one), for
    --real_data=False.
    """
    def next_batch():
        x = torch.randint(vocab_size, (batch_size, block_size), device=device)
        return x, torch.roll(x, -1, dims=1)
    return next_batch


def train_step(model, optimizer, scaler, ctx, next_batch, grad_clip, X, Y):
    """
    train.py's step with one micro-batch; returns (the loss of X, Y as a tensor, the next batch).
    """
    with ctx:
        _, loss = model(X, Y)
    X, Y = next_batch()  # the next batch, fetched while an accelerator works on this one
    scaler.scale(loss).backward()
    opt.optimizer_step(model, optimizer, scaler, grad_clip)
    return loss, X, Y


def profile(step, X, Y, burnin, profile_dir, device_type):
    """
    burnin steps outside the profiler's view, then its schedule: 5 steps skipped, 5 of warm-up
    (recorded and thrown away), 5 recorded. Writes a TensorBoard/Chrome trace to profile_dir and
    prints the top ops.
    """
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device_type == 'cuda':
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    skipped = 5
    warm_up = 5
    recorded = 5
    total = burnin + skipped + warm_up + recorded
    schedule = torch.profiler.schedule(wait=skipped, warmup=warm_up, active=recorded, repeat=1)
    with torch.profiler.profile(
        activities=activities,
        schedule=schedule,
        on_trace_ready=torch.profiler.tensorboard_trace_handler(profile_dir),
        record_shapes=False,
        profile_memory=False,
        with_stack=False,  # Python stacks cost time in every op, and the op table doesn't use them
        with_flops=True,
        with_modules=False,  # module hierarchy: TorchScript models only
    ) as prof:
        for k in range(total):
            loss, X, Y = step(X, Y)
            print(f"{k}/{total} loss: {loss.item():.4f}")
            if k >= burnin:
                prof.step()  # the schedule counts steps from the end of the burn-in
    sort_by = 'self_cuda_time_total' if device_type == 'cuda' else 'self_cpu_time_total'
    print(prof.key_averages().table(sort_by=sort_by, row_limit=20))
    print(f"trace written to {profile_dir}/")


def time_steps(step, X, Y, burnin, steps, device):
    """
    burnin untimed steps (compilation, allocator and caches warm up), then `steps` timed ones, each
    between two device synchronisations so the time is that step's alone; returns the timed steps'
    seconds.
    """
    times = []
    for timed, num_steps in ((False, burnin), (True, steps)):
        for k in range(num_steps):
            synchronize(device)
            t0 = time.perf_counter()
            loss, X, Y = step(X, Y)
            lossf = loss.item()  # waits for the step, like nanoGPT's
            t1 = time.perf_counter()
            if timed:
                times.append(t1 - t0)
            print(f"{k}/{num_steps} loss: {lossf:.4f}")
    return times


def report(times, model, batch_size, peak_flops, device, dtype, device_threads):
    """
    nanoGPT's `time per iteration` line (mean step time), then the median, tokens/s and the peak
    memory.
    """
    tokens_per_iter = batch_size * model.config.block_size
    dt = sum(times) / len(times)
    dt_median = statistics.median(times)
    mfu = model.estimate_mfu(batch_size, dt, peak_flops=peak_flops)
    print(f"time per iteration: {dt*1000:.4f}ms, MFU: {mfu*100:.2f}%")
    mem_label, mem_bytes = peak_memory(device)
    cpu_cores = ''
    if device_type_of(device) == 'cpu' and not os.environ.get('NANOGPT_PEAK_FLOPS'):
        cpu_cores = f", {device_threads} cores, {torch.get_num_threads()} threads used"
        print(f"cpu peak: {cpu_peak(device_threads)[1]}")
    print(
        f"median time per iteration: {dt_median*1000:.4f}ms, tokens/s: {tokens_per_iter / dt_median:,.0f}, "
        f"MFU (median): {model.estimate_mfu(batch_size, dt_median, peak_flops=peak_flops)*100:.2f}% "
        f"of {peak_flops/1e12:.4g} TFLOP/s peak ({device}, {dtype}{cpu_cores}), "
        f"{mem_label}: {mem_bytes / 2**20:,.0f} MiB")
    # the same peak on a line of its own, with what it depends on most (compare two bench.py
    # processes)
    print(f"peak memory: {mem_bytes / 2**20:,.0f} MiB ({mem_label}, "
          f"activation_checkpointing={model.activation_checkpointing})")


if __name__ == '__main__':
    run_main(main)
