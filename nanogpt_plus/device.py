"""
Where and in what precision a script computes: the device ('auto' resolved), the dtype and its autocast
context, TF32 on CUDA, whether to torch.compile, and (for training) the peak FLOP/s MFU is measured against
and the CPU thread count.

Usage:
    from nanogpt_plus.device import precision, resolve_device
    device = resolve_device('auto')               # cuda, else mps, else cpu
    dtype, ctx = precision(device, 'auto')        # TF32 on CUDA, dtype, autocast context
"""

import math
import os
from contextlib import nullcontext

import torch

from nanogpt_plus.errors import UserError
from nanogpt_plus.hardware import device_peak_flops
from nanogpt_plus.threads import apply_cpu_threads

PTDTYPE = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}


def resolve_device(device='auto'):
    """ 'auto' -> cuda, else mps, else cpu; validates explicit choices ('cpu', 'cuda', 'cuda:N', 'mps'). """
    if device == 'auto':
        if torch.cuda.is_available():
            return 'cuda'
        if getattr(torch.backends, 'mps', None) is not None and torch.backends.mps.is_available():
            return 'mps'
        return 'cpu'
    kind, _, index = device.partition(':')
    if kind not in ('cpu', 'cuda', 'mps') or (index and not index.isdigit()) or (index and kind != 'cuda'):
        raise UserError(f"unknown device '{device}': use auto, cpu, cuda, cuda:N or mps")
    if kind == 'cuda':
        if not torch.cuda.is_available():
            raise UserError(f"device '{device}' was asked for but CUDA is not available; use --device=cpu (or auto)")
        if index and int(index) >= torch.cuda.device_count():
            raise UserError(f"device '{device}' does not exist: this machine has {torch.cuda.device_count()} GPU(s)")
    if kind == 'mps' and not (getattr(torch.backends, 'mps', None) and torch.backends.mps.is_available()):
        raise UserError("device 'mps' was asked for but MPS is not available; use --device=cpu (or auto)")
    return device


def device_type_of(device):
    return 'cuda' if 'cuda' in str(device) else ('mps' if 'mps' in str(device) else 'cpu')


def resolve_dtype(dtype, device):
    """ 'auto' -> bfloat16 on GPUs with native bf16, float16 on other GPUs, float32 elsewhere. """
    device_type = device_type_of(device)
    if dtype == 'auto':
        if device_type == 'cuda':
            # by default is_bf16_supported() also says yes where bf16 is only emulated (V100, T4: no bf16
            # tensor cores), which runs far slower than fp16 with a GradScaler; count native support only
            return 'bfloat16' if torch.cuda.is_bf16_supported(including_emulation=False) else 'float16'
        return 'float32'
    if dtype not in PTDTYPE:
        raise UserError(f"unknown dtype '{dtype}': use auto, float32, bfloat16 or float16")
    if dtype == 'float16' and device_type == 'cpu':
        raise UserError("float16 training is not supported on CPU; use --dtype=bfloat16 or float32")
    return dtype


def autocast_context(device, dtype):
    """ Mixed precision for the forward pass; float32 (and so the CPU default) runs without autocast. """
    device_type = device_type_of(device)
    if dtype == 'float32':
        return nullcontext()
    return torch.amp.autocast(device_type=device_type, dtype=PTDTYPE[dtype])


def enable_tf32():
    """ float32 matmuls and convolutions on CUDA may use TF32 tensor cores (10-bit mantissa inputs, fp32 sums). """
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def precision(device, dtype):
    """ The numerics of a run on device: TF32 on CUDA, dtype ('auto' resolved) and its autocast context. """
    if device_type_of(device) == 'cuda':
        enable_tf32()
    dtype = resolve_dtype(dtype, device)
    return dtype, autocast_context(device, dtype)


def resolve_compile(setting, device_type, triton=None):
    """
    compile=None (auto) compiles on CUDA only: on the CPU the compile time (20-100 s on 2 cores) costs
    about what it saves over a few thousand small-model iterations (measured with bench.py). On CUDA
    torch.compile writes Triton kernels: without Triton (Windows has none by default) auto runs eager, saying so
    in one line, and compile=True is refused before any work, instead of failing at the first step.
    triton: whether Triton is importable (None: look).
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
            print(f"compile: torch.compile on CUDA needs Triton, which is not installed; running without compile "
                  f"({fix}, or pass --compile=False to say so)")
        return False
    raise UserError(f"--compile=True on CUDA needs Triton, which is not installed; {fix}, or pass --compile=False")


def triton_installed():
    """ Whether the triton package (torch.compile's CUDA code generator) can be imported. """
    import importlib.util
    return importlib.util.find_spec('triton') is not None


def check_training_dtype(device_type, dtype):
    """
    float16 training needs a loss scaler, and torch.amp.GradScaler's for MPS is not one this code has tested (nor
    can, without a Mac): refused in one line rather than trained with a scaler built for the wrong device.
    """
    if device_type == 'mps' and dtype == 'float16':
        raise UserError("--dtype=float16 training on MPS is not supported (its loss scaler is CUDA's); use "
                        "--dtype=float32, or bfloat16 on macOS 14 or later")


def compute_setup(device, dtype, compile_setting, num_threads, peak=True):
    """
    Everything a run on `device` decides before building the model: TF32 on CUDA, the dtype ('auto'
    resolved), the autocast context, whether to torch.compile, the device's peak FLOP/s for MFU (None
    with peak=False: on a CPU finding it runs a short matmul probe), and the CPU thread count.
    Returns (dtype, ctx, compile_model, peak_flops).
    """
    device_type = device_type_of(device)
    check_training_dtype(device_type, dtype)
    dtype, ctx = precision(device, dtype)
    compile_model = resolve_compile(compile_setting, device_type)
    # MFU against the whole device: on the CPU every core torch uses by default, whatever num_threads
    peak_flops = device_peak_flops(device, PTDTYPE[dtype]) if peak else None
    apply_cpu_threads(num_threads)
    return dtype, ctx, compile_model, peak_flops


def available_host_memory():
    """
    The bytes of RAM this machine can give a new allocation now (/proc/meminfo's MemAvailable), or None (not
    Linux: no check). NANOGPT_FREE_MEMORY_GIB overrides it: what a container's memory limit really leaves, or a
    fixed figure so that a test's outcome does not depend on what else the machine runs. A new
    model's memory is counted against it where models are built (init_from.check_model_memory).
    """
    override = os.environ.get('NANOGPT_FREE_MEMORY_GIB')
    if override:
        try:
            gib = float(override)
        except ValueError:
            gib = math.nan
        if not (math.isfinite(gib) and gib > 0):
            raise UserError(f"NANOGPT_FREE_MEMORY_GIB={override!r} is not a number of GiB; set it to one "
                            f"(e.g. 16) or unset it")
        return int(gib * 2**30)
    try:
        with open('/proc/meminfo', encoding='ascii') as f:
            for line in f:
                if line.startswith('MemAvailable:'):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None  # not Linux: no check

