"""
scripts/bench_train_cpu.py: the matmul floor replays every matmul of a training step, and nanoGPT's baseline loop
runs.
"""
import os
import re

import torch

from helpers import REPO, run_python


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
