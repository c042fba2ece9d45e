"""
scripts/make_reference.py: a reference curve made from a config's runs over several seeds (a tiny config here), the
file train.py reads; finished seeds reused; a dataset that doesn't record its text's digest refused in one line.
"""
import json

import pytest

from helpers import assert_one_line_error, run, run_python
from nanogpt_plus import reference
from nanogpt_plus.prepare.shakespeare import prepare_char

TINY_CONFIG = """
n_layer = 1
n_head = 2
n_embd = 16
block_size = 16
batch_size = 4
gradient_accumulation_steps = 1
max_iters = 6
lr_decay_iters = 6
warmup_iters = 1
eval_interval = 3
eval_iters = 2
device = 'cpu'
compile = False
"""


def test_make_reference_writes_a_curve_train_py_reads(tmp_path):
    data = tmp_path / 'data'
    prepare_char("To be, or not to be, that is the question.\n" * 300, str(data))
    config = tmp_path / 'tiny.py'
    config.write_text(TINY_CONFIG)
    args = ['scripts/make_reference.py', f'--config={config}', f'--dataset={data}', '--seeds=2',
            f'--work_dir={tmp_path / "work"}', f'--output={tmp_path / "tiny.json"}', '--data_name=Hamlet']
    r = run_python(args, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "seed 1: done" in r.stdout and "seed 2: done" in r.stdout
    ref = reference.load_reference(str(tmp_path / 'tiny.json'))
    assert [p['iter'] for p in ref['points']] == [0, 3, 6] and ref['seeds'] == [1, 2]
    assert ref['data']['text_sha256'] == reference.data_key(str(data))['text_sha256']
    assert ref['data']['name'] == 'Hamlet' and ref['settings']['n_layer'] == 1 and ref['settings']['global_batch'] == 4
    assert ref['torch'] and ref['machine']['cpu'] and 'make_reference.py' in ref['command']
    for point in ref['points']:
        band = point['val']
        assert band['half_width'] >= reference.FLOOR and band['mean'] == pytest.approx(sum(band['seeds']) / 2, abs=2e-4)
    # the seeds' runs are reused: made again at once, the same file
    before = (tmp_path / 'tiny.json').read_text()
    r = run_python(args, timeout=600)
    assert r.returncode == 0 and "done in" not in r.stdout, r.stdout
    assert json.loads((tmp_path / 'tiny.json').read_text())['points'] == json.loads(before)['points']


def test_a_dataset_without_its_text_digest_is_refused_in_one_line(tiny_dataset, monkeypatch, capsys, tmp_path):
    code, _, err = run('scripts/make_reference.py', monkeypatch, capsys, f'--dataset={tiny_dataset}',
                       f'--work_dir={tmp_path}', '--seeds=2')
    assert_one_line_error(code, err, "records no text digest")
    assert not list(tmp_path.iterdir())
