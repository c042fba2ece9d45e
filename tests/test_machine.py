"""
nanogpt_plus/machine.py: the choices that depend on the device, checked on the CPU by standing in for torch.cuda
(auto dtype, compile without triton, float16 where it can't train), the peak FLOPs tables and probe, the CPU thread
tuner and retuner, and the memory check of a new model (causal masks and activations against the free memory, which
the tests pin).
"""
import os
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

import train
from configurator import parse_config
from helpers import run_python, train_args, write_split_files
from model import GPT, GPTConfig
from nanogpt_plus import machine
from nanogpt_plus.errors import UserError
from nanogpt_plus.machine import (
    FIRST_RECHECK,
    ThreadRetuner,
    check_model_memory,
    cpu_peak_flops,
    device_peak_flops,
    gpu_peak_flops,
    resolve_dtype,
    thread_candidates,
    tune_cpu_threads,
)


def fake_gpu(monkeypatch, major, emulates_bf16):
    """ torch.cuda as is_bf16_supported sees it on a GPU of compute capability `major`. """
    monkeypatch.setattr(torch.version, 'hip', None)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 0)
    monkeypatch.setattr(torch.cuda, 'get_device_properties', lambda device: SimpleNamespace(major=major))
    # where a bf16 tensor can be made although there are no bf16 tensor cores (V100, T4): emulation
    monkeypatch.setattr(torch.cuda, '_check_bf16_tensor_supported', lambda device: emulates_bf16)


@pytest.mark.parametrize("major, expected", [(7, 'float16'), (8, 'bfloat16'), (9, 'bfloat16')])
def test_auto_dtype_takes_bf16_only_where_it_is_native(monkeypatch, major, expected):
    """ V100/T4 (sm 7.x) emulate bf16, which torch counts as supported by default: they get fp16 + a GradScaler. """
    fake_gpu(monkeypatch, major, emulates_bf16=True)
    assert torch.cuda.is_bf16_supported()  # the default answer counts the emulation
    assert resolve_dtype('auto', 'cuda') == expected
    assert resolve_dtype('auto', 'cuda:1') == expected


def test_auto_dtype_asks_for_native_bf16(monkeypatch):
    calls = []

    def is_bf16_supported(including_emulation=True):
        calls.append(including_emulation)
        return including_emulation  # a GPU that only emulates bf16

    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', is_bf16_supported)
    assert resolve_dtype('auto', 'cuda') == 'float16'
    assert calls == [False]
    assert resolve_dtype('auto', 'cpu') == 'float32' and calls == [False]  # the CPU never asks


def test_explicit_dtypes_are_kept(monkeypatch):
    fake_gpu(monkeypatch, 7, emulates_bf16=True)
    # asked for: the user's choice, emulated or not
    assert resolve_dtype('bfloat16', 'cuda') == 'bfloat16'
    assert resolve_dtype('float16', 'cuda') == 'float16'
    assert resolve_dtype('float32', 'cuda') == 'float32'


# -----------------------------------------------------------------------------
# machines without Triton (Windows with CUDA) and Apple's MPS, as those machines report themselves

def no_triton(monkeypatch):
    """ importlib as it answers where the triton package is not installed (torch on Windows). """
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'triton' else find_spec(name, *a))


def test_compile_on_cuda_without_triton_runs_eager_or_is_refused(monkeypatch, capsys):
    from nanogpt_plus.machine import resolve_compile, triton_installed
    # auto compiles on CUDA where Triton is
    assert resolve_compile(None, 'cuda', triton=True) is True
    no_triton(monkeypatch)
    assert not triton_installed()
    # auto: eager, in one line that says why and what to do
    assert resolve_compile(None, 'cuda') is False
    out = capsys.readouterr().out
    assert out.count('\n') == 1 and out.startswith("compile: torch.compile on CUDA needs Triton, which is not "
                                                   "installed; running without compile (install it")
    # asked for: refused before any work
    with pytest.raises(UserError, match=r"^--compile=True on CUDA needs Triton, which is not installed; install it "
                                        r"\(pip install triton; on Windows: pip install triton-windows\)"):
        resolve_compile(True, 'cuda')
    # the CPU's compile needs no Triton (C++ code), and compile=False asks for nothing
    assert resolve_compile(True, 'cpu') is True and resolve_compile(False, 'cuda') is False
    assert resolve_compile(None, 'cpu') is False and not capsys.readouterr().out


def test_float16_training_on_mps_is_refused_in_one_line(monkeypatch, tmp_path, capsys, tiny_dataset):
    import train
    from helpers import train_args
    from nanogpt_plus.machine import compute_setup
    with pytest.raises(UserError, match=r"^--dtype=float16 training on MPS is not supported"):
        compute_setup('mps', 'float16', None, num_threads=1, peak=False)
    # train.py on a Mac: MPS there, float16 asked for; refused before the model is built
    monkeypatch.setattr(torch.backends.mps, 'is_available', lambda: True)
    with pytest.raises(UserError, match=r"^--dtype=float16 training on MPS is not supported"):
        train.main(train_args(tiny_dataset, tmp_path / 'out', device='mps', dtype='float16', max_iters=1))
    assert "number of parameters" not in capsys.readouterr().out
    assert not (tmp_path / 'out' / 'ckpt.pt').exists()


def test_gpu_peak_flops_table():
    assert gpu_peak_flops('NVIDIA H100 80GB HBM3', torch.bfloat16) == 989e12
    assert gpu_peak_flops('NVIDIA H100 80GB HBM3', torch.float16) == 989e12
    assert gpu_peak_flops('NVIDIA H100 80GB HBM3', torch.float32) == 494.5e12  # tf32 column
    assert gpu_peak_flops('NVIDIA A100-SXM4-40GB', torch.bfloat16) == 312e12
    assert gpu_peak_flops('NVIDIA A100-SXM4-40GB', torch.float32) == 156e12
    assert gpu_peak_flops('NVIDIA H200', torch.bfloat16) == 989e12
    # name fragments that contain each other resolve to the more specific entry
    assert gpu_peak_flops('NVIDIA H100 PCIe', torch.bfloat16) == 756e12
    assert gpu_peak_flops('NVIDIA H100 PCIe', torch.float32) == 378e12
    assert gpu_peak_flops('NVIDIA H100 NVL', torch.bfloat16) == 835e12
    assert gpu_peak_flops('NVIDIA GH200 480GB', torch.bfloat16) == 989e12
    assert gpu_peak_flops('NVIDIA A10G', torch.bfloat16) == 70e12
    assert gpu_peak_flops('NVIDIA L40S', torch.bfloat16) == 362e12
    assert gpu_peak_flops('NVIDIA L4', torch.bfloat16) == 121e12
    # unknown GPU: nanoGPT's A100 assumption
    assert gpu_peak_flops('Some Future GPU', torch.bfloat16) == 312e12


def test_cpu_peak_flops_and_env_override(monkeypatch):
    assert cpu_peak_flops(num_cores=2, clock_hz=3e9, vector_isa='avx2') == 2 * 3e9 * 32
    assert cpu_peak_flops(num_cores=4, clock_hz=2e9, vector_isa='avx512') == 4 * 2e9 * 64
    monkeypatch.delenv('NANOGPT_PEAK_FLOPS', raising=False)
    from nanogpt_plus.machine import cpu_peak
    peak = device_peak_flops('cpu')
    # the CPU's figure, never below the nominal one
    assert peak == cpu_peak()[0] and peak >= cpu_peak_flops()
    monkeypatch.setenv('NANOGPT_PEAK_FLOPS', '123e12')
    assert device_peak_flops('cpu') == 123e12
    assert device_peak_flops('cuda', torch.bfloat16) == 123e12  # wins before any device lookup


def test_cpu_peak_is_never_below_what_a_matmul_reaches(monkeypatch):
    """ Virtual machines report the base clock; when the cores turbo past it, the nominal peak is too low
    and MFU would exceed 100%, so the peak is the larger of the nominal figure and a measured matmul. """
    monkeypatch.delenv('NANOGPT_PEAK_FLOPS', raising=False)
    nominal = cpu_peak_flops(2)
    monkeypatch.setattr(machine, 'measured_matmul_flops', lambda n: nominal * 1.5)
    peak, how = machine.cpu_peak(2)
    assert peak == nominal * 1.5 and 'measured 1024^3 fp32 matmul' in how and '2 cores' in how
    monkeypatch.setattr(machine, 'measured_matmul_flops', lambda n: nominal * 0.5)
    assert machine.cpu_peak(2)[0] == nominal
    monkeypatch.setattr(machine, 'measured_matmul_flops', lambda n: 7e15)
    assert device_peak_flops('cpu') == 7e15


def test_matmul_probe_leaves_threads_and_rng_alone():
    from nanogpt_plus.machine import measured_matmul_flops
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    measured_matmul_flops.cache_clear()
    flops = measured_matmul_flops(1, n=128, repeats=2)
    assert flops > 1e8  # any CPU does more than 0.1 GFLOP/s
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), rng)


def test_tune_cpu_threads_picks_a_candidate_and_leaves_no_trace():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=11, dropout=0.1))
    X = torch.randint(11, (2, 8))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        rng = torch.get_rng_state()
        threads, timings = tune_cpu_threads(model, X, X, torch.autocast('cpu', enabled=False), repeats=1)
        assert set(timings) == {2, 1} and threads == min(timings, key=timings.get)
        assert torch.get_num_threads() == threads
        assert torch.equal(torch.get_rng_state(), rng)  # dropout draws undone
        assert all(p.grad is None for p in model.parameters())
        # a big model keeps every core without timing anything
        torch.set_num_threads(2)
        assert tune_cpu_threads(model, X, X, torch.autocast('cpu', enabled=False), max_flops=1) == (2, {})
    finally:
        torch.set_num_threads(before)


def drive_retuner(retuner, ms_per_thread_count, iterations):
    """ Feed the retuner `iterations` iteration times given by the current thread count's (fake) speed. """
    messages = []
    for _ in range(iterations):
        message = retuner.observe(ms_per_thread_count[torch.get_num_threads()] / 1000)
        if message:
            messages.append(message)
    return messages


def test_thread_retuner_follows_the_load():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        assert thread_candidates() == [4, 2, 1]
        torch.set_num_threads(1)  # the start-up choice
        retuner = ThreadRetuner([4, 2, 1], interval=10, probe=3, window=5)
        # the machine got quiet: 4 threads are now fastest; nothing changes before `interval` iterations
        speed = {4: 10.0, 2: 14.0, 1: 20.0}
        assert drive_retuner(retuner, speed, 9) == [] and torch.get_num_threads() == 1
        # the 10th starts a round: 1 thread's mean is known; then 4 and 2 are timed (warm-up + 3 each)
        messages = drive_retuner(retuner, speed, 1 + (1 + 3) + (1 + 3))
        assert torch.get_num_threads() == 4
        assert messages == ["using 4 CPU threads instead of 1 (ms/iter: 1 threads 20.0, 4 threads 10.0, "
                            "2 threads 14.0)"]
        # the load changed again: 1 thread is best, 2 collapse and are dropped after one timed iteration
        speed = {4: 20.0, 2: 90.0, 1: 15.0}
        messages = drive_retuner(retuner, speed, 10 + (1 + 1) + (1 + 3))
        assert torch.get_num_threads() == 1 and len(messages) == 1
        assert "using 1 CPU threads instead of 4" in messages[0] and "2 threads 90.0" in messages[0]
        # steady state: rounds that confirm the current count say nothing and change nothing
        assert drive_retuner(retuner, speed, 100) == [] and torch.get_num_threads() == 1
        # a single candidate never starts a round
        lone = ThreadRetuner([1], interval=1)
        assert drive_retuner(lone, speed, 5) == [] and not lone.todo
    finally:
        torch.set_num_threads(before)


def test_a_wrong_start_up_choice_is_corrected_at_the_first_recheck_then_every_interval():
    """ train.py's retuner (first=FIRST_RECHECK): a start-up choice that stalls is undone after `first` iterations,
    not after a whole interval; the rounds after it come every interval. """
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # chosen at start-up, but beside busy processes 2 threads stall
        retuner = ThreadRetuner([2, 1], interval=250, probe=4, window=50, first=30)
        speed = {2: 300.0, 1: 100.0}
        assert drive_retuner(retuner, speed, 29) == [] and torch.get_num_threads() == 2
        messages = drive_retuner(retuner, speed, 1 + (1 + 4))
        assert torch.get_num_threads() == 1 and messages == [
            "using 1 CPU threads instead of 2 (ms/iter: 2 threads 300.0, 1 threads 100.0)"]
        # the machine got quiet: the next round is a whole interval later
        speed = {2: 50.0, 1: 100.0}
        assert drive_retuner(retuner, speed, 249) == [] and torch.get_num_threads() == 1
        drive_retuner(retuner, speed, 1 + (1 + 4))
        assert torch.get_num_threads() == 2
        # train.py's retuner checks first after FIRST_RECHECK iterations
        assert 10 <= FIRST_RECHECK <= 50
    finally:
        torch.set_num_threads(before)


def test_thread_retuner_judges_by_throughput_not_the_typical_iteration():
    """ On shared cores too many threads mostly cost rare long stalls; the mean sees them, a median not. """
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        retuner = ThreadRetuner([2, 1], interval=20, probe=4, window=20)
        # 2 threads: usually 20 ms, but every 5th iteration stalls for 200 ms (mean 56)
        for i in range(20):
            retuner.observe(0.2 if i % 5 == 4 else 0.02)
        drive_retuner(retuner, {1: 30.0, 2: 20.0}, 1 + 4)  # 1 thread: a steady 30 ms
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures('one_thread')
def test_a_first_step_that_cant_fit_is_refused_before_anything_is_built(monkeypatch):
    monkeypatch.setenv('NANOGPT_FREE_MEMORY_GIB', '8')
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=40000, vocab_size=65)
    # the masks (2 x 40000^2 bytes) fit; the activations of a CPU step come on top of them
    check_model_memory(config, batch_size=12, attention='flash', on_cpu=False)
    with pytest.raises(UserError, match=r"GiB of causal masks.*GiB of activations for batch_size=12\), and "
                                        r"NANOGPT_FREE_MEMORY_GIB=8 says this machine has 8 GiB free \(unset it to "
                                        r"use what the machine has\); use a smaller --block_size, --batch_size or"):
        check_model_memory(config, batch_size=12, attention='manual', on_cpu=True)
    # the logits of a large vocabulary count too
    with pytest.raises(UserError, match="GiB of activations"):
        check_model_memory(replace(config, block_size=8192, vocab_size=50304), batch_size=64, attention='flash',
                           on_cpu=True)
    # nanoGPT's Shakespeare: fine
    check_model_memory(replace(config, block_size=256), batch_size=12, attention='flash', on_cpu=True)


@pytest.mark.usefixtures('one_thread')
def test_the_free_memory_figure_is_pinned_in_tests_and_can_be_set(monkeypatch, tmp_path):
    # the suite's own pin (conftest): the GPT-2 default config passes whatever else the machine runs (on a prepared
    # dataset of GPT-2's vocabulary: one not prepared is said, with its prepare.py, before any memory figure)
    gpt2_data = write_split_files(tmp_path / 'owt', range(1000), meta={'kind': 'gpt2', 'vocab_size': 50257})
    defaults = ["--device=cpu", f"--dataset={gpt2_data}"]
    assert machine.available_host_memory() == 64 * 2**30
    train.check_settings(parse_config(train.DEFAULTS, defaults))
    monkeypatch.setenv('NANOGPT_FREE_MEMORY_GIB', '2.5')
    assert machine.available_host_memory() == int(2.5 * 2**30)
    with pytest.raises(UserError, match=r"NANOGPT_FREE_MEMORY_GIB=2.5 says this machine has 2.5 GiB free"):
        train.check_settings(parse_config(train.DEFAULTS, defaults))
    for bad in ('lots', 'nan', '1e999', '-5'):
        monkeypatch.setenv('NANOGPT_FREE_MEMORY_GIB', bad)
        with pytest.raises(UserError, match=f"NANOGPT_FREE_MEMORY_GIB='{bad}' is not a number of GiB"):
            machine.available_host_memory()
    # a figure too small to show as GiB with one decimal: the line names the variable and its value
    monkeypatch.setenv('NANOGPT_FREE_MEMORY_GIB', '0.001')
    with pytest.raises(UserError, match=r"and NANOGPT_FREE_MEMORY_GIB=0.001 says this machine has 0.001 GiB free"):
        train.check_settings(parse_config(train.DEFAULTS, defaults))
    # unset: the machine's own figure (Linux), or None
    monkeypatch.delenv('NANOGPT_FREE_MEMORY_GIB')
    assert machine.available_host_memory() is None or machine.available_host_memory() > 0


# -----------------------------------------------------------------------------
# the memory a first step really holds

@pytest.mark.usefixtures('one_thread')
def test_a_long_context_on_a_tiny_model_is_refused_with_a_margin(monkeypatch):
    # the case: 2 x 100000^2 bytes of masks (18.6 GiB) with 21 GiB free passed before
    monkeypatch.setenv('NANOGPT_FREE_MEMORY_GIB', '21')
    config = GPTConfig(
        n_layer=2, n_head=2, n_embd=32, block_size=100000, vocab_size=20, dropout=0.0
    )
    with pytest.raises(
        UserError,
        match=r"18.6 GiB of causal masks.*and NANOGPT_FREE_MEMORY_GIB=21 says this machine has 21 GiB free \(unset "
        r"it to use what the machine has\); use a "
        r"smaller --block_size, --batch_size or model \(a step may use 90% of",
    ):
        check_model_memory(config, batch_size=4, attention='flash', on_cpu=True)
    # dropout on a CPU: the fused attention falls back to the written-out one, (T, T) per head
    monkeypatch.setenv('NANOGPT_FREE_MEMORY_GIB', '2')
    config = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8192, vocab_size=65, dropout=0.0)
    check_model_memory(config, batch_size=1, attention='flash', on_cpu=True)  # measured: 0.2 GiB
    with pytest.raises(
        UserError, match=r"GiB of activations for batch_size=1"
    ):  # measured: 2.2 GiB
        check_model_memory(
            GPTConfig(**dict(vars(config), dropout=0.1)),
            batch_size=1,
            attention='flash',
            on_cpu=True,
        )


@pytest.mark.usefixtures('one_thread')
def test_the_block_size_100000_run_is_refused_before_any_work(tiny_dataset, tmp_path):
    env = dict(os.environ, NANOGPT_FREE_MEMORY_GIB='21')
    r = run_python(
        ['train.py', *train_args(tiny_dataset, tmp_path / 'out', block_size=100000)],
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.strip().count('\n') == 0, r.stderr[-2000:]
    assert "GiB of causal masks" in r.stderr and not (tmp_path / 'out').exists()


@pytest.mark.usefixtures('one_thread')
def test_float16_on_a_cpu_is_said_for_every_script():
    with pytest.raises(
        UserError,
        match=r"^--dtype=float16 is not supported on CPU; use --dtype=bfloat16 or "
        r"float32$",
    ):
        resolve_dtype('float16', 'cpu')


def test_auto_threads_only_on_a_cpu_with_num_threads_0():
    """ The other scripts' choice: a GPU keeps torch's count, N > 0 fixes it, 0 on a CPU times it (AutoThreads). """
    from nanogpt_plus.machine import AutoThreads, auto_threads
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert auto_threads('cuda', 0, 'batch') is None and auto_threads('mps', 0, 'batch') is None
        assert torch.get_num_threads() == 2
        assert auto_threads('cpu', 1, 'batch') is None and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        lines = []
        threads = auto_threads('cpu', 0, 'batch', say=lines.append, interval=3)
        assert isinstance(threads, AutoThreads)
        # too big to time: every core stays, nothing said
        threads.choose(lambda: torch.randn(4), flops=1e12)
        assert threads.retuner is None and torch.get_num_threads() == 2 and lines == []
        with pytest.raises(UserError, match="num_threads must be 0"):
            auto_threads('cpu', -1, 'batch')
    finally:
        torch.set_num_threads(before)


def test_a_later_pass_still_times_every_count_after_another_loop_set_one_thread(monkeypatch):
    """ finetune.py makes its val pass's AutoThreads at set-up and chooses only at the first val pass, after the
    training retuner may have set 1 thread: the counts it tries are the ones there were at set-up, not [1]. """
    from nanogpt_plus.machine import AutoThreads
    tried = []
    monkeypatch.setattr(machine, 'time_thread_counts',
                        lambda work, candidates, *args: (tried.append(list(candidates)) or (1, {2: 0.2, 1: 0.1})))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        later = AutoThreads('batch', say=lambda line: None)
        torch.set_num_threads(1)  # what the training loop's retuner did meanwhile
        later.choose(lambda: None)
        assert tried == [[2, 1]] and later.retuner is not None
    finally:
        torch.set_num_threads(before)


def test_short_work_is_timed_for_at_least_min_seconds(monkeypatch):
    """ A ~1 ms sampling step is repeated until min_seconds are filled: 3 calls can miss the stalls of a busy core. """
    from nanogpt_plus import machine
    clock = [0.0]
    monkeypatch.setattr(machine.time, 'perf_counter', lambda: clock[0])
    calls = []

    def work():  # a fake 1/256 s of work, whatever the count
        calls.append(torch.get_num_threads())
        clock[0] += 1 / 256
    before = torch.get_num_threads()
    try:
        machine.time_thread_counts(work, [2, 1], repeats=3, min_seconds=10 / 256)
        assert calls == [2] * 11 + [1] * 11  # a warm-up, then 10 timed calls each
        calls.clear()
        machine.time_thread_counts(work, [2, 1], repeats=3)  # tune_cpu_threads': the repeats only
        assert calls == [2] * 4 + [1] * 4
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize('name, bad, what', [
    ('NANOGPT_PEAK_FLOPS', '989 TFLOPS', 'a number of FLOP/s above 0'),
    ('NANOGPT_PEAK_FLOPS', '0', 'a number of FLOP/s above 0'),
    ('NANOGPT_PEAK_FLOPS', 'inf', 'a number of FLOP/s above 0'),
    ('NANOGPT_FREE_MEMORY_GIB', '0', 'a number of GiB above 0'),
    ('NANOGPT_PLUS_SCAN_TOKENS', '1.5', 'a whole number of tokens, 0 or more'),
    ('NANOGPT_PLUS_SCAN_TOKENS', '-1', 'a whole number of tokens, 0 or more'),
])
def test_every_environment_variable_is_checked_in_one_place(monkeypatch, name, bad, what):
    monkeypatch.setenv(name, bad)
    with pytest.raises(UserError, match=rf"^the environment variable {name}='{re.escape(bad)}' is not {what}"
                                        rf".*; set it to one or unset it$"):
        machine.check_environment()
    # and where it is read: one line there too, never a ValueError or ZeroDivisionError later
    with pytest.raises(UserError, match=name):
        machine.environment_value(name)


def test_good_environment_values_are_read(monkeypatch):
    monkeypatch.setenv('NANOGPT_PEAK_FLOPS', '989e12')
    monkeypatch.setenv('NANOGPT_PLUS_SCAN_TOKENS', '0')
    machine.check_environment()
    assert machine.device_peak_flops('cpu') == 989e12
    assert machine.environment_value('NANOGPT_PLUS_SCAN_TOKENS') == 0
    assert set(machine.ENVIRONMENT) == {'NANOGPT_PEAK_FLOPS', 'NANOGPT_FREE_MEMORY_GIB', 'NANOGPT_PLUS_SCAN_TOKENS'}
