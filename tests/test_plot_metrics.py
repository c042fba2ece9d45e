"""
scripts/plot_metrics.py: a run's losses drawn, and a character and a BPE run on one bits-per-byte axis.
"""
import json
import math
import os
import runpy

import pytest

import train
from helpers import REPO, run_python, tiny_args, train_args, train_out
from nanogpt_plus.errors import UserError
from nanogpt_plus.metrics import read_metrics


def test_plot_metrics(dataset, tmp_path, capsys):
    train_out(capsys, tiny_args(dataset, tmp_path, max_iters=4, eval_interval=2))
    r = run_python(["scripts/plot_metrics.py", f"--out_dir={tmp_path}"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "plotted 5 iterations and 3 evaluations" in r.stdout
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_a_char_and_a_bpe_run_on_one_bpb_axis(two_datasets, tmp_path, capsys):
    for kind in ('char', 'gpt2'):
        train.main(train_args(two_datasets[kind][0], tmp_path / kind, max_iters=4, eval_interval=2,
                              lr_decay_iters=4, n_embd=16, block_size=16))
    capsys.readouterr()
    main = runpy.run_path(os.path.join(REPO, 'scripts', 'plot_metrics.py'))
    png = tmp_path / 'both.png'
    counts = main['plot'](str(tmp_path / 'char' / 'metrics.jsonl'), str(png), bpb=True,
                          others=[str(tmp_path / 'gpt2' / 'metrics.jsonl')])
    assert counts == (5, 3, 0) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the curves drawn are the bits per byte: the per-iteration losses over the train split's bytes
    records = read_metrics(str(tmp_path / 'gpt2' / 'metrics.jsonl'))
    iters, evals, _ = main['iterations_and_evaluations'](str(tmp_path / 'gpt2' / 'metrics.jsonl'))
    drawn_iters, drawn_evals = main['in_bits_per_byte'](str(tmp_path / 'gpt2' / 'metrics.jsonl'), iters, evals)
    per_token = next(r['train'] for r in records if r['type'] == 'bytes_per_token')
    assert [r['loss'] for r in drawn_iters] == pytest.approx([r['loss'] / math.log(2) / per_token for r in iters])
    assert [r['val_loss'] for r in drawn_evals] == [r['val_bpb'] for r in evals]
    # a run logged before bits per byte existed: one line
    old = tmp_path / 'old' / 'metrics.jsonl'
    os.makedirs(old.parent)
    old.write_text(json.dumps({'type': 'eval', 'iter': 0, 'train_loss': 1.0, 'val_loss': 1.0, 'lr': 0.1}) + '\n')
    with pytest.raises(UserError, match='without val_bpb.*plot it without --bpb'):
        main['plot'](str(old), str(tmp_path / 'x.png'), bpb=True)
