"""
The machine a script computes on: the device ('auto' resolved), the dtype and its autocast context,
TF32 on CUDA, whether to torch.compile, the free memory and whether a new model's first step fits in
it, the peak FLOP/s MFU is measured against, and the CPU thread count (chosen by timing, re-checked as
the load changes).

Usage:
    from nanogpt_plus.machine import precision, resolve_device
    device = resolve_device('auto')               # cuda, else mps, else cpu
    dtype, ctx = precision(device, 'auto')        # TF32 on CUDA, dtype, autocast context
    peak = device_peak_flops('cuda', torch.bfloat16)   # FLOP/s; NANOGPT_PEAK_FLOPS=<FLOP/s> overrides
"""

import collections
import functools
import math
import os
import platform
import time
from contextlib import nullcontext

import torch

from nanogpt_plus.errors import MachineError, UserError

# -----------------------------------------------------------------------------
# the device, its precision and compile choice, its free memory

PTDTYPE = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}
# the dtype setting's choices: 'auto' (resolve_dtype picks for the device) or one of PTDTYPE
DTYPES = ('auto', *PTDTYPE)


def resolve_device(device='auto'):
    """
    'auto' -> cuda, else mps, else cpu; validates explicit choices ('cpu', 'cuda', 'cuda:N', 'mps').
    """
    if device == 'auto':
        if torch.cuda.is_available():
            return 'cuda'
        if getattr(torch.backends, 'mps', None) is not None and torch.backends.mps.is_available():
            return 'mps'
        return 'cpu'
    kind, _, index = device.partition(':')
    if kind not in ('cpu', 'cuda', 'mps') or (index and not index.isdigit()) or (index and
                                                                                 kind != 'cuda'):
        raise UserError(f"unknown device '{device}': use auto, cpu, cuda, cuda:N or mps")
    if kind == 'cuda':
        if not torch.cuda.is_available():
            raise MachineError(
                f"device '{device}' was asked for but CUDA is not available; use --device=cpu (or auto)"
            )
        if index and int(index) >= torch.cuda.device_count():
            raise MachineError(
                f"device '{device}' does not exist: this machine has {torch.cuda.device_count()} GPU(s)"
            )
    if kind == 'mps' and not (getattr(torch.backends, 'mps', None) and
                              torch.backends.mps.is_available()):
        raise MachineError(
            "device 'mps' was asked for but MPS is not available; use --device=cpu (or auto)")
    return device


def device_type_of(device):
    return 'cuda' if 'cuda' in str(device) else ('mps' if 'mps' in str(device) else 'cpu')


def resolve_dtype(dtype, device):
    """ 'auto' -> bfloat16 on GPUs with native bf16, float16 on other GPUs, float32 elsewhere. """
    device_type = device_type_of(device)
    if dtype == 'auto':
        if device_type == 'cuda':
            # by default is_bf16_supported() also says yes where bf16 is only emulated (V100, T4: no
            # bf16 tensor cores), which runs far slower than fp16 with a GradScaler; count native
            # support only
            return 'bfloat16' if torch.cuda.is_bf16_supported(
                including_emulation=False) else 'float16'
        return 'float32'
    if dtype not in PTDTYPE:
        raise UserError(f"unknown dtype '{dtype}': use auto, float32, bfloat16 or float16")
    if dtype == 'float16' and device_type == 'cpu':
        # every script resolves its dtype here: training, sampling and evaluation alike
        raise UserError("--dtype=float16 is not supported on CPU; use --dtype=bfloat16 or float32")
    return dtype


def autocast_context(device, dtype):
    """
    Mixed precision for the forward pass; float32 (and so the CPU default) runs without autocast.
    """
    device_type = device_type_of(device)
    if dtype == 'float32':
        return nullcontext()
    return torch.amp.autocast(device_type=device_type, dtype=PTDTYPE[dtype])


def enable_tf32():
    """
    float32 matmuls and convolutions on CUDA may use TF32 tensor cores (10-bit mantissa inputs, fp32
    sums).
    """
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def precision(device, dtype):
    """
    The numerics of a run on device: TF32 on CUDA, dtype ('auto' resolved) and its autocast context.
    """
    if device_type_of(device) == 'cuda':
        enable_tf32()
    dtype = resolve_dtype(dtype, device)
    return dtype, autocast_context(device, dtype)


def resolve_compile(setting, device_type, triton=None):
    """
    compile=None (auto) compiles on CUDA only: on the CPU the compile time (20-100 s on 2 cores)
    costs about what it saves over a few thousand small-model iterations (measured with bench.py).
    On CUDA torch.compile writes Triton kernels: without Triton (Windows has none by default) auto
    runs eager, saying so in one line, and compile=True is refused before any work, instead of
    failing at the first step. triton: whether Triton is importable (None: look).
    """
    wanted = setting if setting is not None else device_type == 'cuda'
    if not wanted or device_type != 'cuda':
        return wanted
    if triton is None:
        triton = triton_installed()
    if triton:
        return True
    fix = "install it (pip install triton; on Windows: pip install triton-windows)"
    if setting is None:
        if int(os.environ.get('RANK', 0)) == 0:
            print(
                f"compile: torch.compile on CUDA needs Triton, which is not installed; running without compile "
                f"({fix}, or pass --compile=False to say so)")
        return False
    raise UserError(
        f"--compile=True on CUDA needs Triton, which is not installed; {fix}, or pass --compile=False"
    )


def triton_installed():
    """ Whether the triton package (torch.compile's CUDA code generator) can be imported. """
    import importlib.util
    return importlib.util.find_spec('triton') is not None


def check_training_dtype(device_type, dtype):
    """
    float16 training needs a loss scaler, and torch.amp.GradScaler's for MPS is not one this code
    has tested (nor can, without a Mac): refused in one line rather than trained with a scaler built
    for the wrong device.
    """
    if device_type == 'mps' and dtype == 'float16':
        raise UserError(
            "--dtype=float16 training on MPS is not supported (its loss scaler is CUDA's); use "
            "--dtype=float32, or bfloat16 on macOS 14 or later")


def compute_setup(device, dtype, compile_setting, num_threads, peak=True):
    """
    Everything a run on `device` decides before building the model: TF32 on CUDA, the dtype ('auto'
    resolved), the autocast context, whether to torch.compile, the device's peak FLOP/s for MFU
    (None with peak=False: on a CPU finding it runs a short matmul probe), and the CPU thread count.
    Returns (dtype, ctx, compile_model, peak_flops).
    """
    device_type = device_type_of(device)
    check_training_dtype(device_type, dtype)
    dtype, ctx = precision(device, dtype)
    compile_model = resolve_compile(compile_setting, device_type)
    # MFU against the whole device: on the CPU every core torch uses by default, whatever
    # num_threads
    peak_flops = device_peak_flops(device, PTDTYPE[dtype]) if peak else None
    apply_cpu_threads(num_threads)
    return dtype, ctx, compile_model, peak_flops


# -----------------------------------------------------------------------------
# the environment variables the project reads, in one place: each is checked at start-up, on every
# rank (check_environment, from distributed.start and bench.py), so a bad value is one line before
# any work, never a traceback at the first step that uses it (an MFU estimate at iteration 5)

def _number(text, whole):
    value = int(text) if whole else float(text)
    return value if math.isfinite(value) else None


# name: (what it must be, as a user reads it; whole number?; the least value it may have; exclusive?)
ENVIRONMENT = {
    # the device's peak FLOP/s, the denominator of MFU (device_peak_flops): a number, not '989 TFLOPS'
    'NANOGPT_PEAK_FLOPS': ("a number of FLOP/s above 0 (e.g. 989e12)", False, 0, True),
    # the free host memory a new model is counted against (available_host_memory)
    'NANOGPT_FREE_MEMORY_GIB': ("a number of GiB above 0 (e.g. 16)", False, 0, True),
    # the token files' size up to which the loader scans them whole at start-up (dataloader.py)
    'NANOGPT_PLUS_SCAN_TOKENS': ("a whole number of tokens, 0 or more (e.g. 67108864)", True, 0, False),
}


def environment_value(name):
    """
    The value of the environment variable name (one of ENVIRONMENT), or None where it is unset or
    empty; a value that is not what ENVIRONMENT says raises a UserError that names it.
    """
    text = os.environ.get(name, '').strip()
    if not text:
        return None
    what, whole, least, exclusive = ENVIRONMENT[name]
    try:
        value = _number(text, whole)
    except ValueError:
        value = None
    if value is None or value < least or (exclusive and value == least):
        raise MachineError(f"the environment variable {name}={os.environ[name]!r} is not {what}; "
                        f"set it to one or unset it")
    return value


def check_environment():
    """ Every variable of ENVIRONMENT checked (environment_value): one line for the first that is wrong. """
    for name in ENVIRONMENT:
        environment_value(name)


def available_host_memory():
    """
    The bytes of RAM this machine can give a new allocation now (/proc/meminfo's MemAvailable), or
    None (not Linux: no check). NANOGPT_FREE_MEMORY_GIB overrides it: what a container's memory
    limit really leaves, or a fixed figure so that a test's outcome does not depend on what else the
    machine runs. A new
    model's memory is counted against it before the model is built (check_model_memory).
    """
    gib = environment_value('NANOGPT_FREE_MEMORY_GIB')
    if gib is not None:
        return int(gib * 2**30)
    try:
        with open('/proc/meminfo', encoding='ascii') as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None  # not Linux: no check


def check_model_memory(config, batch_size, attention, on_cpu):
    """
    Refuse, before anything is built, a new model (config, a GPTConfig) whose first step can't fit
    this machine's free memory (available_host_memory) with a margin (MEMORY_MARGIN of it
    kept free, for the rest of the process and the machine), instead of being killed by the kernel
    a minute later (exit 137, no word) or swapping a step that can't honour a signal. Counted: each
    Block's causal mask (block_size^2 bytes, so a long context costs quadratically), the weights
    with their gradients and AdamW's two moments (16 bytes per parameter), and, when the CPU
    computes (on_cpu), the first step's activations, as measured on a CPU (float32, batch_size 1-4,
    block_size 2048-32768, 1-2 layers): per token about 16 n_embd values per Block kept for the
    backward pass and 4 copies of the logits (they, their log-softmax and both gradients); the
    (T, T) scores of every head where they are materialised: attention='manual', or dropout > 0
    (the CPU's fused attention has no dropout: PyTorch falls back to the written-out one), about 2
    transient copies plus 1 kept per Block (2 with dropout); and ~100 MiB of the first step's own
    (kernels, allocator), counted as FIRST_STEP. Passing says "not hopeless", not "fits".
    """
    available = available_host_memory()
    if available is None:
        return
    n_layer, n_embd, block_size = config.n_layer, config.n_embd, config.block_size
    vocab_size = config.vocab_size
    masks = n_layer * block_size ** 2
    params = 12 * n_layer * n_embd ** 2 + (vocab_size + block_size) * n_embd
    activations = 0
    if on_cpu:
        per_token = n_layer * 16 * n_embd + 4 * vocab_size
        activations = 4 * batch_size * block_size * per_token + FIRST_STEP
        if attention == 'manual' or config.dropout > 0:
            copies = 2 + n_layer * (2 if config.dropout > 0 else 1)
            activations += copies * 4 * batch_size * config.n_head * block_size ** 2
    need = masks + 16 * params + activations
    usable = available * (1 - MEMORY_MARGIN)
    if need > usable:
        parts = [f"{masks / 2**30:,.1f} GiB of causal masks: n_layer x block_size^2 bytes",
                 f"{16 * params / 2**30:,.1f} GiB of weights, gradients and AdamW state"]
        if activations:
            parts.append(f"{activations / 2**30:,.1f} GiB of activations for "
                         f"batch_size={batch_size}")
        free = f"this machine has {available / 2**30:,.1f} GiB free"
        if environment_value('NANOGPT_FREE_MEMORY_GIB') is not None:  # the figure is the user's
            free = (f"NANOGPT_FREE_MEMORY_GIB={os.environ['NANOGPT_FREE_MEMORY_GIB']} says this "
                    f"machine has {available / 2**30:,.3g} GiB free (unset it to use what the "
                    f"machine has)")
        raise MachineError(f"this model needs at least {need / 2**30:,.1f} GiB of memory "
                        f"({'; '.join(parts)}), and {free}; use a smaller --block_size, "
                        f"--batch_size or model (a step may use "
                        f"{100 * (1 - MEMORY_MARGIN):.0f}% of the free memory)")


# the share of the free memory a new model's first step must leave (check_model_memory): the
# estimate is a lower bound, and a machine that swaps can't stop a step when asked
MEMORY_MARGIN = 0.1
# what a CPU's first training step holds beyond its tensors (measured: 90-110 MiB)
FIRST_STEP = 128 * 2**20


# -----------------------------------------------------------------------------
# peak FLOP/s, the denominator of MFU: a table of GPUs by name and dtype; for a CPU the larger of
# the nominal figure (cores x clock x FLOPs per cycle) and what a large fp32 matmul reaches

# dense tensor-core TFLOPS by GPU name fragment: (bf16/fp16, tf32 used for float32 matmuls)
GPU_PEAK_TFLOPS = [
    ('H200', 989.0, 494.5),
    ('GH200', 989.0, 494.5),
    ('H100 NVL', 835.0, 417.5),
    ('H100 PCIe', 756.0, 378.0),
    ('H100', 989.0, 494.5),
    ('H800', 989.0, 494.5),
    ('B200', 2250.0, 1100.0),
    ('B100', 1750.0, 875.0),
    ('A100', 312.0, 156.0),
    ('A800', 312.0, 156.0),
    ('A10G', 70.0, 35.0),
    ('A10', 125.0, 62.5),
    ('L40S', 362.0, 183.0),
    ('L40', 181.0, 90.5),
    ('L4', 121.0, 60.0),
    ('A6000', 154.8, 77.4),
    ('RTX 4090', 165.2, 82.6),
    ('RTX 3090', 71.0, 35.6),
    ('V100', 125.0, 15.7),
    ('T4', 65.0, 8.1),
]
CPU_FLOPS_PER_CYCLE = {'avx512': 64, 'avx2': 32, 'avx': 16, 'sse': 8, 'neon': 16}  # fp32, per core


def device_peak_flops(device, dtype=torch.float32):
    """
    Peak FLOP/s of `device` for matmuls in `dtype`. The environment variable NANOGPT_PEAK_FLOPS
    (FLOP/s, e.g. 989e12) overrides the lookup, for hardware the table below doesn't know.
    """
    override = environment_value('NANOGPT_PEAK_FLOPS')
    if override is not None:
        return override
    device = torch.device(device)
    if device.type == 'cuda':
        name = torch.cuda.get_device_name(device)
        return gpu_peak_flops(name, dtype)
    if device.type == 'cpu':
        return cpu_peak()[0]
    # mps and others: no reliable figure; nanoGPT's A100 number, set NANOGPT_PEAK_FLOPS to fix
    return 312e12


def gpu_peak_flops(name, dtype):
    for fragment, half, tf32 in GPU_PEAK_TFLOPS:
        if fragment in name:
            return (half if dtype in (torch.bfloat16, torch.float16) else tf32) * 1e12
    # unknown GPU: assume an A100
    return 312e12 if dtype in (torch.bfloat16, torch.float16) else 156e12


def cpu_peak(num_cores=None):
    """
    (peak FLOP/s, how it was found) of the CPU for fp32 matmuls on num_cores threads (default:
    torch's current thread count): the nominal peak (cores x clock x FLOPs per cycle), or what a
    large fp32 matmul measurably reaches when that is more. Virtual machines report the base clock,
    not the turbo clock the cores actually run at, so the nominal figure alone can be below what the
    CPU does (MFU over 100%).
    """
    num_cores = num_cores or torch.get_num_threads()
    isa, hz = _cpu_info()
    nominal = cpu_peak_flops(num_cores, hz, isa)
    measured = measured_matmul_flops(num_cores)
    how = (
        f"max of nominal {num_cores} cores x {hz / 1e9:.2f} GHz x {CPU_FLOPS_PER_CYCLE[isa]} FLOP/cycle "
        f"({isa}) = {nominal / 1e12:.4g} TFLOP/s and a measured {MATMUL_PROBE_SIZE}^3 fp32 matmul "
        f"{measured / 1e12:.4g} TFLOP/s")
    return max(nominal, measured), how


def cpu_peak_flops(num_cores=None, clock_hz=None, vector_isa=None):
    """
    Nominal fp32 peak of the CPU cores torch uses: cores x clock x FLOPs per cycle (from the vector
    width).
    """
    num_cores = num_cores or torch.get_num_threads()
    if clock_hz is None or vector_isa is None:
        isa, hz = _cpu_info()
        vector_isa = vector_isa or isa
        clock_hz = clock_hz or hz
    return num_cores * clock_hz * CPU_FLOPS_PER_CYCLE[vector_isa]


MATMUL_PROBE_SIZE = 1024


@functools.lru_cache(maxsize=None)
def measured_matmul_flops(num_threads, n=MATMUL_PROBE_SIZE, repeats=5):
    """
    FLOP/s of the fastest of `repeats` fp32 (n x n) @ (n x n) matmuls on num_threads CPU threads
    (about 0.1 s once per thread count; cached). Touches no random number generator, so training is
    unaffected.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        a = torch.full((n, n), 0.5)
        b = torch.full((n, n), 0.25)
        out = torch.mm(a, b)  # warm-up: thread pool, MKL buffers
        best = float('inf')
        for _ in range(repeats):
            t0 = time.perf_counter()
            torch.mm(a, b, out=out)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous)
    return 2 * n ** 3 / best


@functools.lru_cache(maxsize=None)
def _cpu_info():
    """
    (vector ISA, clock in Hz) from /proc/cpuinfo and sysfs, with safe guesses where unreadable.
    """
    flags = set()
    mhz = None
    try:
        with open('/proc/cpuinfo') as f:
            for line in f:
                key, _, value = line.partition(':')
                key = key.strip()
                if key in ('flags', 'Features') and not flags:
                    flags = set(value.split())
                elif key == 'cpu MHz' and mhz is None:
                    mhz = float(value)
    except OSError:
        pass
    try:  # the rated maximum is a better peak than the current (possibly throttled) clock
        with open('/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq') as f:
            mhz = int(f.read()) / 1000
    except (OSError, ValueError):
        pass
    if 'avx512f' in flags:
        isa = 'avx512'
    elif 'avx2' in flags and 'fma' in flags:
        isa = 'avx2'
    elif 'avx' in flags:
        isa = 'avx'
    elif 'asimd' in flags or platform.machine() in ('arm64', 'aarch64'):
        isa = 'neon'
    else:
        isa = 'sse'
    return isa, (mhz or 2500.0) * 1e6


# -----------------------------------------------------------------------------
# the CPU thread count: timed at start-up over a few units of the run's work (training passes,
# sampling steps, evaluation batches) at each candidate count and re-checked while running as the
# load changes (num_threads=0), or fixed by the user; docs/cpu-speed.md says how

def apply_cpu_threads(num_threads):
    """ num_threads > 0 fixes torch's CPU thread count; 0 keeps it (see tune_cpu_threads). """
    if num_threads < 0:
        raise UserError(f"num_threads must be 0 (auto) or a positive number, got {num_threads}")
    if num_threads > 0:
        torch.set_num_threads(num_threads)


def thread_candidates():
    """
    The CPU thread counts worth trying: torch's current count (one per core by default), half, ...,
    1.
    """
    candidates = []
    n = torch.get_num_threads()
    while n >= 1:
        candidates.append(n)
        n = n // 2 if n > 1 else 0
    return candidates


def time_thread_counts(work, candidates, repeats=3, min_seconds=0.0, max_repeats=500):
    """
    Time work() (one unit of a run's real work) with each candidate CPU thread count: a warm-up
    call (allocator, thread pool), then the mean of `repeats` calls, or of as many as fill
    min_seconds (at most max_repeats): the mean, because on shared cores the cost is in occasional
    stalls, which a few millisecond-long calls can miss. The fastest count is set. Returns
    (threads, {threads: mean seconds}).
    """
    timings = {}
    for n in candidates:
        torch.set_num_threads(n)
        work()
        ts = []
        while len(ts) < repeats or (sum(ts) < min_seconds and len(ts) < max_repeats):
            t0 = time.perf_counter()
            work()
            ts.append(time.perf_counter() - t0)
        timings[n] = sum(ts) / len(ts)
    best = min(timings, key=timings.get)
    torch.set_num_threads(best)
    return best, timings


def tune_cpu_threads(model, X, Y, ctx, repeats=3, max_flops=2e10, announce=None):
    """
    Pick the fastest CPU thread count for this model and batch by timing a few forward/backward
    passes with torch's default (one thread per core), half of it, ..., down to 1, and keep the
    fastest. Small models are bound by per-op overhead, where extra OpenMP threads mostly wait on
    each other (and collapse when the cores are shared with other processes); big ones (a
    forward/backward of more than max_flops) keep every core without trying. The passes leave no
    trace: gradients are dropped and the RNG restored. The choice is re-checked during training by
    ThreadRetuner. announce: called with a line that says what is being timed, before the timing
    starts (print, say).
    Returns (threads, {threads: mean seconds}).
    """
    candidates = thread_candidates()
    if len(candidates) == 1 or 6 * model.get_num_params() * X.numel() > max_flops:
        return candidates[0], {}
    if announce is not None:
        # seconds of silence otherwise (9 s on 2 busy cores) before the run's first iteration
        announce(f"timing CPU thread counts {', '.join(map(str, candidates))} for this model "
                 f"({repeats + 1} forward/backward passes each, a few seconds) ...")
    rng = torch.get_rng_state()

    def fwd_bwd():
        with ctx:
            _, loss = model(X, Y)
        loss.backward()

    best, timings = time_thread_counts(fwd_bwd, candidates, repeats)
    model.zero_grad(set_to_none=True)
    torch.set_rng_state(rng)
    return best, timings


def describe_thread_choice(threads, timings, unit='fwd+bwd'):
    """
    The line train.py and bench.py print after tune_cpu_threads (scripts/bench_train_cpu.py reads
    it); the other scripts name their own unit of work.
    """
    return (f"using {threads} CPU threads ({unit} ms: "
            + ", ".join(f"{n} threads {t * 1000:.1f}" for n, t in timings.items()) + ")")


class ThreadRetuner:
    """
    Keeps the automatic CPU thread count (num_threads=0) the fastest while training. The best count
    moves with the machine's load (other processes on the cores), so a choice made at start-up can
    go stale. Every `interval` iterations, each other candidate count is timed on `probe` real
    training iterations (after one warm-up iteration) and compared with the mean of the current
    count's last `window` iterations; the lowest mean time per iteration wins. Means, not medians:
    on shared cores the cost of too many threads is mostly rare long stalls (a thread descheduled at
    a barrier), which a median hides and throughput pays for. A candidate whose first timed
    iteration takes over 1.5x the current mean is dropped at once, so a round costs little. Feed it
    the time of every ordinary iteration (not those that evaluated or saved a checkpoint). first:
    the iterations before the first round (default: interval), fewer where the count in use was
    timed on a few passes only: beside busy processes a few passes can all miss the stalls of too
    many threads.
    """

    def __init__(self, candidates, interval=250, probe=8, window=50, first=None):
        self.candidates = list(candidates)
        self.interval = interval
        self.probe = probe
        self.recent = collections.deque(maxlen=window)  # the current count's latest iteration times
        # ordinary iterations since the last round (as if a round had ended `first` iterations ago)
        self.since_round = interval - (interval if first is None else first)
        self.todo = []  # candidates still to time in this round; the first one is being timed
        self.times = []  # the timed iterations of todo[0]
        self.means = {}  # thread count -> mean seconds per iteration, this round
        self.start = None  # the thread count in use when this round started
        self.warmup = 0  # iterations to ignore after a change of thread count

    def observe(self, dt):
        """
        Record an iteration's time in seconds. Returns a message when the thread count changed.
        """
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


# train.py's first re-check of the thread count, after this many iterations: the start-up choice times 4 passes
# of each count, and beside two busy processes 2 threads once won those 4 and then stalled for seconds at a time
# (a laptop run took 99 s where 1 thread took 57 s); a round costs ~9 iterations at the other count, or 2 where
# that count is hopeless
FIRST_RECHECK = 30


def choose_threads(model, loader, ctx, dist_info, fsdp=False):
    """
    num_threads=0 on the CPU: small models run faster on fewer threads than cores (per-op overhead
    outweighs the parallelism), so time the candidates on a batch of an evaluation stream (rewound
    before every evaluation, so the training stream is untouched) and keep the fastest. Returns a
    ThreadRetuner that re-checks while training, as the machine's load changes (None when there was
    nothing to choose). Under FSDP the other ranks' models are on the meta device and can't run a
    forward: rank 0 times for them all and its choice is set on every rank (same cores per process,
    same model: the same best count).
    """
    if not fsdp:
        return _time_threads(model, loader, ctx, dist_info.master)
    import torch.distributed as dist
    choice = [None, None]  # (threads, the counts timed, or None when there was nothing to choose)
    if dist_info.rank == 0:
        retuner = _time_threads(model, loader, ctx, master=True)
        choice = [torch.get_num_threads(), retuner and retuner.candidates]
    dist.broadcast_object_list(choice, src=0)
    threads, candidates = choice
    torch.set_num_threads(threads)
    return ThreadRetuner(candidates, first=FIRST_RECHECK) if candidates else None


def _time_threads(model, loader, ctx, master):
    # the master says what it is timing, then what it chose
    announce = functools.partial(print, flush=True) if master else None
    threads, timings = tune_cpu_threads(model, *loader.next_batch(), ctx, announce=announce)
    if not timings:
        # too large to time before training (a GPT-2-vocabulary model) or nothing to choose: the running
        # iterations are timed instead. Beside two busy loops the laptop model at GPT-2's vocabulary kept 2
        # threads, stalled at every operation's end and took 270 s against 56 s quiet
        candidates = thread_candidates()
        return ThreadRetuner(candidates, first=FIRST_RECHECK) if len(candidates) > 1 else None
    if master:
        print(describe_thread_choice(threads, timings))
    return ThreadRetuner(list(timings), first=FIRST_RECHECK)  # the thread counts it timed


class AutoThreads:
    """
    train.py's thread choice for a script whose work is a loop of like units (sample.py's tokens,
    eval.py's batches, finetune.py's training steps and prediction batches), with num_threads=0 on
    a CPU. choose(work, flops) times one unit of the real work (work(), leaving no trace) at each
    candidate count (thread_candidates, read when it is made) before the loop and keeps the fastest; work over max_flops
    keeps every core untimed, as tune_cpu_threads does. over(steps) then feeds a ThreadRetuner the
    time of every unit of the loop, so the count follows the machine's load while the work is long;
    interval, probe and window are the retuner's, in units of the loop. Only the first choose()
    times: a script may call it at the start of every pass (an epoch's evaluation, CORE's tasks).
    say: where the choice and its changes are reported (print, stderr, or nothing on ranks > 0).
    """

    def __init__(self, unit, say=print, interval=100, probe=8, window=50, repeats=3,
                 min_seconds=0.05, max_flops=2e10):
        self.unit = unit  # what one timed unit is, in the printed line: 'decode step', 'batch'
        self.say = say
        self.retuner_settings = dict(interval=interval, probe=probe, window=window)
        self.repeats = repeats
        # a sampling step of a small model takes ~1 ms: 3 of them can miss the stalls that make a
        # second thread slow on a busy machine (1 run in 6 chose 2 threads and ran 5x slower), so
        # each count is timed for at least this long
        self.min_seconds = min_seconds
        self.max_flops = max_flops
        self.chosen = False
        self.retuner = None  # a ThreadRetuner once a choice was timed
        # the counts worth trying, read now, at set-up: by the time a later pass chooses (finetune.py's
        # val batches), another loop's retuner may have set 1 thread, which would leave nothing to try
        self.candidates = thread_candidates()

    def choose(self, work, flops=0):
        """ Time work() at each candidate count and keep the fastest (once; later calls: no-op). """
        if self.chosen:
            return
        self.chosen = True
        if len(self.candidates) == 1 or flops > self.max_flops:
            return
        # the same random stream whatever was timed (work() may sample or drop out)
        rng = torch.get_rng_state()
        threads, timings = time_thread_counts(work, self.candidates, self.repeats, self.min_seconds)
        torch.set_rng_state(rng)
        self.say(describe_thread_choice(threads, timings, self.unit))
        self.retuner = ThreadRetuner(list(timings), **self.retuner_settings)

    def observe(self, dt):
        """ One unit of the loop took dt seconds: re-check the count every `interval` units. """
        if self.retuner is not None:
            message = self.retuner.observe(dt)
            if message:
                self.say(message)

    def over(self, steps):
        """
        Yield steps' items, observing the time from one item to the next: the work of making the
        next (a generator's) and of the loop body that used this one (a loop over a range).
        Whatever runs before the first item (a prefill, the timing) is not counted.
        """
        last = None
        for item in steps:
            now = time.perf_counter()
            if last is not None:
                self.observe(now - last)
            last = now
            yield item


def auto_threads(device, num_threads, unit, say=print, **retuner):
    """
    The CPU thread count of a script other than train.py and bench.py: num_threads > 0 fixes it
    (apply_cpu_threads), 0 on a CPU returns an AutoThreads to choose it by timing and re-check it
    as the load changes; None otherwise (a fixed count, or a GPU, where nothing changes).
    """
    apply_cpu_threads(num_threads)
    if num_threads != 0 or device_type_of(device) != 'cpu':
        return None
    return AutoThreads(unit, say=say, **retuner)
