"""
bench.py: the timing and profiler modes on the CPU, real and synthetic data, honest MFU (against the CPU's peak),
the peak memory line, the model train.py builds, and its settings' one-line refusals.
"""
import ast
import glob
import json
import os
import re

import numpy as np
import pytest
import torch

import bench
import train
from configurator import parse_config
from helpers import REPO, iter_losses, run_python, train_args
from model import GPT, GPTConfig
from nanogpt_plus.errors import UserError

TINY = ['--device=cpu', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=4',
        '--burnin=2', '--steps=4', '--num_threads=1']


@pytest.fixture
def dataset(tmp_path):
    d = tmp_path / 'ds'
    d.mkdir()
    np.tile(np.arange(30, dtype=np.uint16), 200).tofile(d / 'train.bin')
    # a vocabulary of its 30 ids (meta.json must agree with itself)
    stoi = {chr(65 + i): i for i in range(30)}
    (d / 'meta.json').write_text(json.dumps({'kind': 'char', 'vocab_size': 30, 'stoi': stoi,
                                             'itos': {i: c for c, i in stoi.items()}}))
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
    with pytest.raises(UserError, match=r"num_threads must be >= 0 and <= \d+, got -1"):
        bench.main(TINY + ['--num_threads=-1'])


def test_profile_mode_writes_trace_and_top_ops(tmp_path, capsys):
    bench.main(TINY + ['--real_data=False', '--profile=True', f'--profile_dir={tmp_path / "trace"}', '--burnin=0'])
    out = capsys.readouterr().out
    assert re.search(r"aten::(add)?mm", out)  # the table of the most expensive ops
    traces = glob.glob(str(tmp_path / 'trace' / '*.json'))
    assert traces and json.load(open(traces[0]))['traceEvents']


def test_bench_prints_peak_memory(capsys):
    bench.main(['--device=cpu', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=4',
                '--burnin=1', '--steps=2', '--num_threads=1', '--real_data=False', '--activation_checkpointing=True'])
    m = re.search(r"^peak memory: ([\d,]+) MiB \(peak process RSS, activation_checkpointing=True\)$",
                  capsys.readouterr().out, re.M)
    assert m and int(m.group(1).replace(',', '')) > 50


@pytest.mark.usefixtures('one_thread')
def test_bench_py_advises_no_setting_it_lacks(tmp_path):
    (tmp_path / 'ckpt.pt').write_bytes(b'a run')
    with pytest.raises(UserError) as refused:
        bench.check_settings(
            parse_config(bench.DEFAULTS, ["--profile=True", f"--profile_dir={tmp_path}"])
        )
    assert str(refused.value).endswith("; pass another --profile_dir") and "overwrite" not in str(
        refused.value
    )


@pytest.mark.usefixtures('one_thread')
def test_bench_profile_dir_that_is_a_file_is_refused_before_the_benchmark(tmp_path, capsys):
    (tmp_path / 'trace').write_text('mine')
    with pytest.raises(UserError, match=r"--profile_dir=.*trace is a file, not a directory"):
        bench.main(['--profile=True', f'--profile_dir={tmp_path / "trace"}', '--device=cpu', '--real_data=False',
                    '--n_layer=1', '--n_head=2', '--n_embd=16', '--block_size=16', '--batch_size=2'])
    assert 'ms' not in capsys.readouterr().out  # nothing was timed
    assert (tmp_path / 'trace').read_text() == 'mine'


def test_a_model_that_cant_fit_is_refused_before_it_is_built(tmp_path, monkeypatch, capsys):
    """ bench.py skipped train.py's memory check: --block_size=100000 failed in the CPU's allocator (a
    traceback) after minutes of building. Now refused with the settings, in one line. """
    from helpers import assert_one_line_error, run
    monkeypatch.chdir(tmp_path)
    code, out, err = run("bench.py", monkeypatch, capsys, "--device=cpu", "--real_data=False", "--block_size=100000",
                         "--n_layer=2", "--n_head=2", "--n_embd=32", "--compile=False")
    assert_one_line_error(code, err, "GiB of causal masks: n_layer x block_size^2 bytes")
    assert "use a smaller --block_size, --batch_size or model" in err and os.listdir(tmp_path) == []
