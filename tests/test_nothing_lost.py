"""
Nothing a user does can destroy or distort a run's work (issue 24): snapshots are copies, going back to one
keeps the line it leaves, a new run is refused over any checkpoint, only an evaluated model is ever the best,
token ids, datasets and settings that would train silently wrong are refused, and the last tracebacks are lines.
"""
import json
import os
import shutil

import numpy as np
import pytest

import train
from configurator import ConfigError, parse_config
from helpers import iter_losses, run_python, train_args
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.dataloader import TokenSource
from nanogpt_plus.errors import UserError
from nanogpt_plus.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def run(dataset, out_dir, capsys=None, **settings):
    """ train.py in this process; its stdout when capsys is given. """
    train.main(train_args(dataset, out_dir, num_threads=1, **settings))
    return capsys.readouterr().out if capsys else None


def snapshot_names(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith('ckpt_') and n.endswith('.pt'))


def files(directory):
    return {n: (directory / n).read_bytes() for n in sorted(os.listdir(directory)) if n.endswith('.pt')}


# -----------------------------------------------------------------------------
# snapshots and going back to one

def test_snapshots_are_copies_nothing_done_to_one_name_changes_another(dataset, tmp_path):
    out = tmp_path / 'out'
    run(dataset, out, checkpoint_interval=3, keep_checkpoints=2, always_save_checkpoint=False)
    names = sorted(n for n in os.listdir(out) if n.endswith('.pt'))
    assert names == ['ckpt.pt', 'ckpt_12.pt', 'ckpt_13.pt', 'ckpt_best.pt'], names
    assert len({os.stat(out / n).st_ino for n in names}) == 4  # no two names share a file
    before = files(out)
    # what `cp ckpt_12.pt ckpt.pt` does: write into ckpt.pt's file
    with open(out / 'ckpt.pt', 'r+b') as f:
        f.write(before['ckpt_12.pt'])
        f.truncate()
    after = files(out)
    assert {n: after[n] == before[n] for n in before if n != 'ckpt.pt'} == {n: True for n in before if n != 'ckpt.pt'}


def test_going_back_to_a_snapshot_keeps_the_line_it_leaves(dataset, tmp_path, capsys):
    out = tmp_path / 'out'
    first = run(dataset, out, capsys, checkpoint_interval=2, keep_checkpoints=3, max_iters=9, lr_decay_iters=12)
    assert snapshot_names(out) == ['ckpt_10.pt', 'ckpt_6.pt', 'ckpt_8.pt']
    line = files(out)
    second = run(dataset, out, capsys, init_from='resume', resume_from='6', max_iters=11, lr_decay_iters=12,
                 checkpoint_interval=2, keep_checkpoints=3)
    kept = out / 'abandoned_1'
    assert f"resuming at iter 6: the later files of this run (ckpt.pt, ckpt_8.pt, ckpt_10.pt) are kept, " \
           f"unchanged, in {kept}" in second
    # byte for byte
    assert files(kept) == {n: line[n] for n in ('ckpt.pt', 'ckpt_8.pt', 'ckpt_10.pt')}
    # the new line resumed exactly at 6 (the same steps as the first line's), its snapshots are its own and the
    # keep window counts them only: ckpt_6.pt, shared history, was pruned in its turn
    a = iter_losses(first)
    b = iter_losses(second)
    assert min(b) == 6 and all(a[i] == b[i] for i in range(6, 10))
    assert snapshot_names(out) == ['ckpt_10.pt', 'ckpt_12.pt', 'ckpt_8.pt']
    assert files(kept) == {n: line[n] for n in ('ckpt.pt', 'ckpt_8.pt', 'ckpt_10.pt')}
    assert load_checkpoint(str(out / 'ckpt.pt'))['iter_num'] == 12
    # the metrics file reads as the new line's trajectory from iter 6 on
    records = [r for r in read_metrics(str(out / 'metrics.jsonl')) if r['type'] == 'iter']
    assert [r['iter'] for r in records] == list(range(12)) and records[-1]['run'] == 2


def test_a_snapshot_copied_over_ckpt_pt_by_hand_branches_off_too(dataset, tmp_path, capsys):
    out = tmp_path / 'out'
    run(dataset, out, capsys, checkpoint_interval=4, keep_checkpoints=4)
    # the .pt only: its ckpt.json sidecar still says 13
    shutil.copyfile(out / 'ckpt_4.pt', out / 'ckpt.pt')
    line = files(out)
    printed = run(dataset, out, capsys, init_from='resume', max_iters=6)
    assert "resuming at iter 4: the later files of this run (ckpt_8.pt, ckpt_12.pt, ckpt_13.pt)" in printed
    assert files(out / 'abandoned_1') == {n: line[n] for n in ('ckpt_8.pt', 'ckpt_12.pt', 'ckpt_13.pt')}


def test_resume_from_names_a_snapshot_that_exists(dataset, tmp_path):
    out = tmp_path / 'out'
    run(dataset, out, checkpoint_interval=4, keep_checkpoints=1)
    with pytest.raises(UserError, match=r"no snapshot .*ckpt_4.pt to resume from; .* holds ckpt_13.pt"):
        run(dataset, out, init_from='resume', resume_from='4')
    with pytest.raises(UserError, match="needs --init_from=resume"):
        train.check_settings(parse_config(train.DEFAULTS, ["--resume_from=4"]))


# -----------------------------------------------------------------------------
# a new run over an earlier one, and the best checkpoint

@pytest.mark.parametrize("keep", ['ckpt_best.pt', 'ckpt_12.pt'])
def test_a_new_run_over_any_checkpoint_is_refused(dataset, tmp_path, keep):
    out = tmp_path / 'out'
    run(dataset, out, checkpoint_interval=6, keep_checkpoints=2, always_save_checkpoint=False)
    for name in os.listdir(out):
        if name.endswith('.pt') and name != keep:
            os.remove(out / name)
    before = files(out)
    with pytest.raises(UserError, match=f"already holds the checkpoint {keep}"):
        run(dataset, out)
    assert files(out) == before


def test_only_an_evaluated_model_of_this_run_is_the_best(dataset, tmp_path):
    out = tmp_path / 'out'
    # saves every 2 iterations, evaluations every 6: most saves are of never-evaluated models
    run(dataset, out, checkpoint_interval=2, eval_interval=6, always_save_checkpoint=False)
    evals = {r['iter']: r['val_loss'] for r in read_metrics(str(out / 'metrics.jsonl')) if r['type'] == 'eval'}
    best = load_checkpoint(str(out / 'ckpt_best.pt'))
    # its own val loss
    assert best['iter_num'] in evals and best['best_val_loss'] == evals[best['iter_num']]
    # a new run over it (--overwrite=True) never takes the old run's files as its best
    old_best = (out / 'ckpt_best.pt').read_bytes()
    run(dataset, out, overwrite=True, max_iters=4, checkpoint_interval=2, eval_interval=100,
        always_save_checkpoint=False)
    assert not (out / 'ckpt_best.pt').exists() or (out / 'ckpt_best.pt').read_bytes() != old_best
    assert sorted(n for n in os.listdir(out) if n.endswith('.pt')) == ['ckpt.pt']


# -----------------------------------------------------------------------------
# settings and data that would train silently wrong

def test_min_lr_above_learning_rate_is_refused():
    with pytest.raises(UserError, match=r"min_lr \(0.01\) is above learning_rate \(0.001\)"):
        train.check_settings(parse_config(train.DEFAULTS, ["--learning_rate=1e-3", "--min_lr=1e-2"]))
    train.check_settings(parse_config(train.DEFAULTS, ["--learning_rate=1e-3", "--min_lr=1e-2", "--decay_lr=False"]))


def test_a_config_file_that_exits_is_refused(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("batch_size = 4\nimport sys\nsys.exit(0)\n")
    with pytest.raises(ConfigError, match=f"config file {path} calls exit\\(\\) on line 3"):
        parse_config(train.DEFAULTS, [str(path)])
    # os._exit would end the process with exit 0 and no word: it is refused the same way, and os._exit is back
    path.write_text("batch_size = 4\nimport os\nos._exit(0)\n")
    with pytest.raises(ConfigError, match=f"config file {path} calls exit\\(\\) on line 3"):
        parse_config(train.DEFAULTS, [str(path)])
    assert os._exit.__module__ == 'posix'
    path.write_bytes("out_dir = 'caf\u00e9'\n".encode('latin-1'))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        parse_config(train.DEFAULTS, [str(path)])


def test_ids_in_a_padded_vocabulary_are_refused(tmp_path):
    d = tmp_path / 'gpt2ids'
    d.mkdir()
    # 50260: padding, no text
    np.array([1, 2, 50256, 50260] * 100, dtype=np.uint16).tofile(d / 'train.bin')
    np.array([1, 2, 3] * 100, dtype=np.uint16).tofile(d / 'val.bin')
    (d / 'meta.json').write_text(json.dumps({'kind': 'gpt2', 'vocab_size': 50257}))
    with pytest.raises(UserError, match=r"train.bin holds token ids up to 50260, beyond the tokenizer's vocabulary "
                                        r"\(50,257 tokens; the model's ids from 50,257 to 50,304 are padding"):
        run(str(d), tmp_path / 'out', n_embd=8, n_head=1, n_layer=1)


def test_a_dataset_replaced_or_removed_while_read_stops_in_one_line(tmp_path):
    path = tmp_path / 'train.bin'
    np.arange(1000, dtype=np.uint16).tofile(path)
    source = TokenSource([str(path)])
    source.tokens(0)
    np.arange(500, dtype=np.uint16).tofile(tmp_path / 'new.bin')
    os.replace(tmp_path / 'new.bin', path)  # prepared again: another file, shorter
    with pytest.raises(UserError, match="train.bin changed while the run was reading it"):
        source.tokens(0)
    os.remove(path)
    with pytest.raises(UserError, match="changed while the run was reading it"):
        source.tokens(0)


# -----------------------------------------------------------------------------
# the last tracebacks, one line each

def one_line(args, timeout=120, **kwargs):
    r = run_python(['train.py'] + args, timeout=timeout, **kwargs)
    assert r.returncode == 2 and r.stderr.startswith('error: ') and r.stderr.strip().count('\n') == 0, r.stderr[-2000:]
    return r.stderr


@pytest.mark.parametrize("arg, message", [
    ("--seed=18446744073709551616", "seed must be >= 0 and <= 4294967295"),
    ("--block_size=5000 --n_layer=2000", "GiB of causal masks"),
])
def test_settings_that_crashed_are_one_line(dataset, tmp_path, arg, message):
    assert message in one_line(train_args(dataset, tmp_path / 'out') + arg.split())
    assert not (tmp_path / 'out').exists()


@pytest.mark.parametrize("make, message", [
    (lambda out: (out / 'run.lock').mkdir(parents=True), "run.lock is not a lock file"),
    (lambda out: (out / 'metrics.jsonl').mkdir(parents=True), "metrics.jsonl is not a file"),
])
def test_an_out_dir_with_things_in_the_way_is_one_line(dataset, tmp_path, make, message):
    out = tmp_path / 'out'
    make(out)
    assert message in one_line(train_args(dataset, out, max_iters=1))


def test_an_unwritable_out_dir_is_one_line(dataset):
    if not os.path.isdir('/proc/sys'):
        pytest.skip("needs Linux's read-only /proc/sys")
    assert "could not write in out_dir /proc/sys" in one_line(train_args(dataset, '/proc/sys', max_iters=1))


def test_a_metrics_file_with_records_of_another_kind_is_read_past(dataset, tmp_path):
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'metrics.jsonl').write_text('{"type": "start", "run": "x", "iter": 0}\n{"type": "iter", "iter": "a"}\n'
                                       '[1, 2]\n{"type": "start"\n')
    run(dataset, out, max_iters=2)
    records = read_metrics(str(out / 'metrics.jsonl'))
    assert [r['iter'] for r in records if r['type'] == 'iter'] == [0, 1, 2] and records[0]['run'] == 1


def test_a_signal_during_set_up_stops_before_the_first_iteration(dataset, tmp_path):
    # SIGTERM while the dataset is being read (set-up): exit 75 and one line, not 143
    code = ("import os, signal, train; real = train.training_data\n"
            "train.training_data = lambda *a, **k: (os.kill(os.getpid(), signal.SIGTERM), real(*a, **k))[1]\n"
            "from nanogpt_plus.runtime import run_main; run_main(train.main)")
    r = run_python(['-c', code] + train_args(dataset, tmp_path / 'out', num_threads=1), timeout=120)
    assert r.returncode == 75, r.stderr[-2000:]
    assert "stopped before iter 0: a signal came during set-up; nothing new to save" in r.stdout
    assert not iter_losses(r.stdout) and not (tmp_path / 'out' / 'ckpt.pt').exists()
