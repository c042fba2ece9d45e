"""
scripts/bench_weights.py: the bytes each weight format reads, and the multiple-choice file it scores.
"""
import json
import os

import pytest
import torch

from helpers import REPO
from model import GPT, GPTConfig

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_benchmark_counts_the_bytes_each_format_reads(tmp_path, monkeypatch):
    import importlib.util
    monkeypatch.syspath_prepend(os.path.join(REPO, 'scripts'))  # its benchtools
    spec = importlib.util.spec_from_file_location('bench_weights', os.path.join(REPO, 'scripts', 'bench_weights.py'))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=16, vocab_size=128)).eval()
    sizes = {fmt: bench.matrix_bytes(bench.convert(model, fmt)) for fmt in bench.FORMATS}
    # the Blocks' four and the head
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    n_matrix = sum(m.weight.numel() + (0 if m.bias is None else m.bias.numel()) for m in linears)
    # the weights and their biases, no embedding or LayerNorm
    assert sizes['plain float32'] == 4 * n_matrix
    # packed for oneDNN: the bound is measured on this one
    assert sizes['float32'] == sizes['plain float32']
    assert 0.49 < sizes['bfloat16'] / sizes['plain float32'] <= 0.5
    assert 0.25 < sizes['int8'] / sizes['plain float32'] < 0.3  # plus the scales and float32 biases
    # the multiple-choice file it scores: HellaSwag's fields, the true continuation at the label
    text = "".join(chr(97 + i % 26) for i in range(5000))
    bench.write_choice_task(tmp_path / 'c.jsonl', text, n=20)
    rows = [json.loads(line) for line in (tmp_path / 'c.jsonl').read_text().splitlines()]
    assert len(rows) == 20
    for row in rows:
        start = text.index(row['ctx'])
        assert row['endings'][row['label']] == text[start + 64:start + 88] and len(row['endings']) == 4
