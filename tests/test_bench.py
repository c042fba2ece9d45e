"""bench.py: timing and profiler modes on the CPU, real and synthetic data, honest MFU; the CPU thread tuner."""
import glob
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import bench
from model import GPT, GPTConfig
from training import tune_cpu_threads

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ['--device=cpu', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=4',
        '--burnin=2', '--steps=4', '--num_threads=1']


@pytest.fixture
def dataset(tmp_path):
    d = tmp_path / 'ds'
    d.mkdir()
    np.tile(np.arange(30, dtype=np.uint16), 200).tofile(d / 'train.bin')
    (d / 'meta.json').write_text(json.dumps({'kind': 'char', 'vocab_size': 30, 'stoi': {}, 'itos': {}}))
    return str(d)


def test_timing_mode_prints_nanogpt_line_and_honest_mfu(capsys, monkeypatch):
    peak = 1e10  # a made-up device peak, so the expected MFU follows from the printed time alone
    monkeypatch.setenv('NANOGPT_PEAK_FLOPS', str(peak))
    bench.main(TINY + ['--real_data=False'])
    out = capsys.readouterr().out
    assert len(re.findall(r"^\d+/4 loss: [\d.]+$", out, re.M)) == 4  # the timed steps
    m = re.search(r"^time per iteration: ([\d.]+)ms, MFU: ([\d.]+)%$", out, re.M)
    dt, mfu = float(m.group(1)) / 1000, float(m.group(2)) / 100
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50304, bias=False))
    N = model.get_num_params()
    flops_per_iter = (6 * N + 12 * 2 * 2 * 16 * 16) * 16 * 4  # PaLM's estimate, batch 4 x 16 tokens
    assert mfu == pytest.approx(flops_per_iter / dt / peak, rel=0.02)
    m = re.search(r"^median time per iteration: ([\d.]+)ms, tokens/s: ([\d,]+), .* peak process RSS: ([\d,]+) MiB",
                  out, re.M)
    assert float(m.group(2).replace(',', '')) == pytest.approx(64 / (float(m.group(1)) / 1000), rel=0.01)
    assert int(m.group(3).replace(',', '')) > 50
    assert 'using fused AdamW: True' in out


def test_cpu_mfu_is_against_the_cpu_peak(capsys, monkeypatch):
    monkeypatch.delenv('NANOGPT_PEAK_FLOPS', raising=False)
    bench.main(TINY + ['--real_data=False', '--fused=False'])
    out = capsys.readouterr().out
    assert 'using fused AdamW: False' in out
    from model import cpu_peak, cpu_peak_flops
    m = re.search(r"of ([\d.]+) TFLOP/s peak \(cpu, float32, (\d+) cores, 1 threads used\)", out)
    cores = int(m.group(2))
    assert cores == torch.get_num_threads()  # every core torch uses by default, not just the 1 used
    peak = float(m.group(1)) * 1e12
    assert peak == pytest.approx(cpu_peak(cores)[0], rel=1e-3)
    assert peak >= cpu_peak_flops(cores) * (1 - 1e-3)  # never below the nominal peak
    assert f"cpu peak: {cpu_peak(cores)[1]}" in out  # says how the peak was found


def test_real_data_uses_the_dataset_vocabulary(dataset, capsys):
    bench.main(TINY + [f'--dataset={dataset}', '--learning_rate=1e-2'])
    out = capsys.readouterr().out
    assert 'found vocab_size = 30' in out
    losses = [float(x) for x in re.findall(r"^\d+/\d+ loss: ([\d.]+)$", out, re.M)]
    assert len(losses) == 6 and losses[-1] < losses[0]  # a repeating pattern is learnable


def test_missing_dataset_is_one_clear_error(tmp_path):
    r = subprocess.run([sys.executable, 'bench.py', f'--dataset={tmp_path / "nope"}', *TINY], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and 'prepare' in r.stderr and 'Traceback' not in r.stderr


def test_profile_mode_writes_trace_and_top_ops(tmp_path, capsys):
    bench.main(TINY + ['--real_data=False', '--profile=True', f'--profile_dir={tmp_path / "trace"}', '--burnin=0'])
    out = capsys.readouterr().out
    assert re.search(r"aten::(add)?mm", out)  # the table of the most expensive ops
    traces = glob.glob(str(tmp_path / 'trace' / '*.json'))
    assert traces and json.load(open(traces[0]))['traceEvents']


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


def test_nanogpt_baseline_loop_runs(tmp_path, tiny_dataset):
    r = subprocess.run([sys.executable, 'scripts/bench_train_cpu.py', '--mode=nanogpt', '--max_iters=3',
                        '--baseline_threads=1', f'--out_dir={tmp_path}',
                        f'--dataset={tiny_dataset}'], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"^step 0: train loss [\d.]+, val loss [\d.]+$", r.stdout, re.M)
    assert len(re.findall(r"^iter \d+: loss [\d.]+, time [\d.]+ms, mfu", r.stdout, re.M)) == 4
    assert 'using fused AdamW: False' in r.stdout
