"""
Peak FLOP/s of the device in use, the denominator of MFU: a table of GPUs by name and dtype, and for CPUs
the larger of the nominal figure (cores x clock x FLOPs per cycle) and what a large fp32 matmul reaches.

Usage:
    from nanogpt_plus.hardware import device_peak_flops
    peak = device_peak_flops('cuda', torch.bfloat16)   # FLOP/s; NANOGPT_PEAK_FLOPS=<FLOP/s> overrides
"""

import functools
import os
import platform
import time

import torch

# dense tensor-core TFLOPS by GPU name fragment: (bf16/fp16, tf32 used for float32 matmuls)
GPU_PEAK_TFLOPS = [
    ('H200', 989.0, 494.5), ('GH200', 989.0, 494.5), ('H100 NVL', 835.0, 417.5), ('H100 PCIe', 756.0, 378.0),
    ('H100', 989.0, 494.5), ('H800', 989.0, 494.5), ('B200', 2250.0, 1100.0), ('B100', 1750.0, 875.0),
    ('A100', 312.0, 156.0), ('A800', 312.0, 156.0), ('A10G', 70.0, 35.0), ('A10', 125.0, 62.5),
    ('L40S', 362.0, 183.0), ('L40', 181.0, 90.5), ('L4', 121.0, 60.0), ('A6000', 154.8, 77.4),
    ('RTX 4090', 165.2, 82.6), ('RTX 3090', 71.0, 35.6), ('V100', 125.0, 15.7), ('T4', 65.0, 8.1),
]
CPU_FLOPS_PER_CYCLE = {'avx512': 64, 'avx2': 32, 'avx': 16, 'sse': 8, 'neon': 16}  # fp32, per core


def device_peak_flops(device, dtype=torch.float32):
    """
    Peak FLOP/s of `device` for matmuls in `dtype`. The environment variable NANOGPT_PEAK_FLOPS (FLOP/s,
    e.g. 989e12) overrides the lookup, for hardware the table below doesn't know.
    """
    override = os.environ.get('NANOGPT_PEAK_FLOPS')
    if override:
        return float(override)
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
    (peak FLOP/s, how it was found) of the CPU for fp32 matmuls on num_cores threads (default: torch's
    current thread count): the nominal peak (cores x clock x FLOPs per cycle), or what a large fp32 matmul
    measurably reaches when that is more. Virtual machines report the base clock, not the turbo clock the
    cores actually run at, so the nominal figure alone can be below what the CPU does (MFU over 100%).
    """
    num_cores = num_cores or torch.get_num_threads()
    isa, hz = _cpu_info()
    nominal = cpu_peak_flops(num_cores, hz, isa)
    measured = measured_matmul_flops(num_cores)
    how = (f"max of nominal {num_cores} cores x {hz / 1e9:.2f} GHz x {CPU_FLOPS_PER_CYCLE[isa]} FLOP/cycle "
           f"({isa}) = {nominal / 1e12:.4g} TFLOP/s and a measured {MATMUL_PROBE_SIZE}^3 fp32 matmul "
           f"{measured / 1e12:.4g} TFLOP/s")
    return max(nominal, measured), how


def cpu_peak_flops(num_cores=None, clock_hz=None, vector_isa=None):
    """ Nominal fp32 peak of the CPU cores torch uses: cores x clock x FLOPs per cycle (from the vector width). """
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
    FLOP/s of the fastest of `repeats` fp32 (n x n) @ (n x n) matmuls on num_threads CPU threads (about
    0.1 s once per thread count; cached). Touches no random number generator, so training is unaffected.
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
    """ (vector ISA, clock in Hz) from /proc/cpuinfo and sysfs, with safe guesses where unreadable. """
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
