"""bench.py: timing and profiler modes on the CPU, real and synthetic data, honest MFU; the CPU thread tuner."""
import ast
import glob
import json
import os
import re

import numpy as np
import pytest
import torch

import bench
from helpers import REPO, iter_losses, run_python, train_args
from model import GPT, GPTConfig
from nanogpt_plus import machine
from nanogpt_plus.machine import ThreadRetuner, thread_candidates, tune_cpu_threads

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
    dt = float(m.group(1)) / 1000
    mfu = float(m.group(2)) / 100
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
    from nanogpt_plus.machine import cpu_peak, cpu_peak_flops
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


def test_bench_builds_and_steps_the_model_train_py_does(tiny_dataset, tmp_path, capsys):
    """ Both build the model through checkpoint.init_model: for the same settings and seed, the same weights,
    hence the same losses step after step (one micro-batch, constant learning rate, no dropout, one thread). """
    settings = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=4, bias=True, gelu='tanh',
                    learning_rate=1e-2, weight_decay=1e-2, grad_clip=1.0, dropout=0.0, device='cpu', num_threads=1)
    bench.main([f'--{k}={v}' for k, v in settings.items()] + [f'--dataset={tiny_dataset}', '--burnin=2', '--steps=4'])
    bench_out = capsys.readouterr().out
    import train
    train.main(train_args(tiny_dataset, tmp_path, **settings, gradient_accumulation_steps=1, decay_lr=False,
                          beta2=0.95, max_iters=5, eval_interval=100))
    train_out = capsys.readouterr().out
    assert 'found vocab_size = 20' in bench_out and 'found vocab_size = 20' in train_out
    bench_losses = [float(x) for x in re.findall(r"^\d+/\d+ loss: ([\d.]+)$", bench_out, re.M)]
    train_losses = iter_losses(train_out)
    assert len(bench_losses) == 6 and [train_losses[i] for i in range(6)] == bench_losses


def test_entry_points_import_no_other_entry_point():
    """ bench.py and train.py share code through nanogpt_plus only (bench.py used to import train.py). """
    entry_points = {'train', 'bench', 'sample', 'eval', 'finetune', 'export_hf'}
    for name in ('bench', 'train'):
        tree = ast.parse(open(os.path.join(REPO, f'{name}.py')).read())
        imported = {alias.name.split('.')[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        imported |= {node.module.split('.')[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not imported & entry_points, (name, imported & entry_points)


def test_missing_dataset_is_one_clear_error(tmp_path):
    r = run_python(['bench.py', f'--dataset={tmp_path / "nope"}', *TINY], timeout=120)
    assert r.returncode == 2 and 'prepare' in r.stderr and 'Traceback' not in r.stderr


def test_negative_thread_count_is_one_clear_error():
    from nanogpt_plus.errors import UserError
    with pytest.raises(UserError, match=r"num_threads must be >= 0, got -1"):
        bench.main(TINY + ['--num_threads=-1'])


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


def test_train_retunes_threads_only_in_auto_mode(tiny_dataset, tmp_path, monkeypatch):
    import train

    class Recording(ThreadRetuner):
        def observe(self, dt):
            self.seen.append((dt, torch.get_num_threads()))
            return super().observe(dt)

    made = []

    def make(candidates):
        made.append(Recording(candidates, interval=2, probe=1))
        made[-1].seen = []
        return made[-1]

    monkeypatch.setattr(machine, 'ThreadRetuner', make)  # what train.py's thread choice makes
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        args = [f'--dataset={tiny_dataset}', '--device=cpu', '--n_layer=1', '--n_head=2', '--n_embd=16',
                '--block_size=8', '--batch_size=2', '--max_iters=12', '--eval_interval=5', '--eval_iters=1',
                '--log_interval=100', '--compile=False', '--always_save_checkpoint=False']
        train.main(args + ['--num_threads=0', f'--out_dir={tmp_path}/auto'])
        assert len(made) == 1 and made[0].candidates == [2, 1]
        # iterations 0..12 ran; 0, 5 and 10 evaluated (their time is not the training step's), so 10 were seen,
        # with real times, and both thread counts were tried during training
        assert len(made[0].seen) == 10 and all(dt > 0 for dt, _ in made[0].seen)
        assert {n for _, n in made[0].seen} == {1, 2}
        made.clear()
        torch.set_num_threads(2)
        train.main(args + ['--num_threads=1', f'--out_dir={tmp_path}/fixed'])
        assert made == [] and torch.get_num_threads() == 1  # a fixed count is never changed
    finally:
        torch.set_num_threads(before)


def test_matmul_floor_replays_every_matmul_of_the_step(tiny_dataset, capsys):
    import importlib.util
    path = os.path.join(REPO, 'scripts', 'bench_train_cpu.py')
    spec = importlib.util.spec_from_file_location('bench_train_cpu', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    before = torch.get_num_threads()
    try:
        result = module.matmul_floor(rounds=1, steps=1, threads=1, dataset=tiny_dataset)
    finally:
        torch.set_num_threads(before)
    # 4 Linears per block + lm_head forward, each with two products backward (input and weight grads)
    assert result['count'] == 3 * (4 * 4 + 1)
    from nanogpt_plus.dataset import read_dataset_meta
    c = module.LAPTOP
    vocab = read_dataset_meta(tiny_dataset)['vocab_size']
    tokens = 12 * 64
    # the matmul weights, lm_head = wte included
    params = 4 * 12 * c['n_embd'] ** 2 + vocab * c['n_embd']
    assert result['flops'] == 6 * tokens * params
    assert all(result[k] > 0 for k in ('nanogpt', 'ours', 'matmuls'))
    out = capsys.readouterr().out
    assert f"its {result['count']} matmuls alone, replayed" in out and "ceiling for any fp32" in out


def test_nanogpt_baseline_loop_runs(tmp_path, tiny_dataset):
    r = run_python(['scripts/bench_train_cpu.py', '--mode=nanogpt', '--max_iters=3',
                        '--baseline_threads=1', f'--out_dir={tmp_path}',
                        f'--dataset={tiny_dataset}'], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert re.search(r"^step 0: train loss [\d.]+, val loss [\d.]+$", r.stdout, re.M)
    assert len(re.findall(r"^iter \d+: loss [\d.]+, time [\d.]+ms, mfu -?\d+\.\d{2}%$", r.stdout, re.M)) == 4
    assert 'using fused AdamW: False' in r.stdout
