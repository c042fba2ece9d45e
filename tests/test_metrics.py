"""
nanogpt_plus/metrics.py: metrics.jsonl read past records of another kind, one trajectory after a resume, and wandb
(offline, a resumed run continuing its wandb run, a missing wandb said in one line).
"""
import errno
import json
import os

import pytest

from helpers import iter_losses, run_train, tiny_args, train_args, train_here, train_out
from nanogpt_plus import metrics
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.metrics import MetricsLogger, read_metrics


def test_wandb_offline(dataset, tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    train_out(capsys, tiny_args(dataset, tmp_path, wandb_log=True, max_iters=2, eval_interval=2))
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run")]
    assert runs, os.listdir(tmp_path / "wandb")


def test_wandb_resume_continues_its_run_and_a_new_run_gets_a_new_one(dataset, tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")

    def wandb_ids():
        # offline-run-<date>_<time>-<id>[-<n>], one directory per wandb.init (-n: the same id in the same second);
        # two runs started in the same second sort by id, not by start, so compare counts, not order
        return sorted(d.split("-")[3] for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run"))
    train_out(capsys, tiny_args(dataset, tmp_path, wandb_log=True, max_iters=2, eval_interval=2))
    first = load_checkpoint(str(tmp_path / "ckpt.pt"))["wandb_id"]
    assert wandb_ids() == [first]
    # preempted and resumed (twice, the second by auto_resume): the same wandb run each time
    train_out(capsys, tiny_args(dataset, tmp_path, wandb_log=True, max_iters=4, eval_interval=2, init_from="resume"))
    train_out(capsys, tiny_args(dataset, tmp_path, wandb_log=True, max_iters=6, eval_interval=2, auto_resume=True))
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["wandb_id"] == first
    assert wandb_ids() == [first] * 3
    # started over: a new run, under a new id
    train_out(capsys, tiny_args(dataset, tmp_path, wandb_log=True, max_iters=2, eval_interval=2, overwrite=True))
    second = load_checkpoint(str(tmp_path / "ckpt.pt"))["wandb_id"]
    assert second != first and wandb_ids() == sorted([first] * 3 + [second])


@pytest.mark.usefixtures('one_thread')
def test_metrics_after_a_resume_are_one_trajectory(dataset, tmp_path, capsys):
    first = run_train(capsys, train_args(dataset, tmp_path, max_iters=6, eval_interval=3, checkpoint_interval=2,
                                        keep_checkpoints=3)).out
    # as if the run had crashed after its save at iter 4: resume from there, repeating iterations 4-6
    os.replace(tmp_path / "ckpt_4.pt", tmp_path / "ckpt.pt")
    second = run_train(capsys, train_args(dataset, tmp_path, max_iters=6, eval_interval=3, init_from="resume")).out
    assert iter_losses(second) == {k: v for k, v in iter_losses(first).items() if k >= 4}
    raw = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    starts = [(r["run"], r["iter"], r["init_from"]) for r in raw if r["type"] == "start"]
    assert starts == [(1, 0, "scratch"), (2, 4, "resume")] and all("run" in r for r in raw)
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    iters = [(r["iter"], r["run"]) for r in records if r["type"] == "iter"]
    assert iters == [(i, 1) for i in range(4)] + [(i, 2) for i in range(4, 7)]  # no iteration twice
    evals = [(r["iter"], r["run"]) for r in records if r["type"] == "eval"]
    assert evals == [(0, 1), (3, 1), (6, 2)]


class FillingDisk:
    """ A file whose disk is full after `room` writes: every later flush fails with ENOSPC, as the OS's would. """

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, text):
        self.room -= 1
        # past its room, half a record reaches the file
        return self.f.write(text if self.room >= 0 else text[:len(text) // 2])

    def flush(self):
        self.f.flush()
        if self.room < 0:
            raise OSError(errno.ENOSPC, 'No space left on device')

    def __getattr__(self, name):
        return getattr(self.f, name)


@pytest.mark.usefixtures('one_thread')
def test_a_full_disk_stops_the_metrics_not_the_run(dataset, tmp_path, capsys, monkeypatch):
    real_open = open
    monkeypatch.setattr(metrics, 'open', lambda path, mode='r', **kw: FillingDisk(real_open(path, mode, **kw), 3)
                        if 'a' in mode else real_open(path, mode, **kw), raising=False)
    out = run_train(capsys, train_args(dataset, tmp_path, max_iters=4, eval_interval=2))
    warnings = [line for line in out.err.splitlines() if line.startswith('warning: could not write')]
    assert warnings == [f"warning: could not write {tmp_path / 'metrics.jsonl'} (No space left on device); the run "
                        f"goes on without it from iter 0 (make room on the disk: checkpoints need it too)"]
    assert iter_losses(out.out).keys() == set(range(5))  # every step trained
    assert load_checkpoint(str(tmp_path / 'ckpt.pt'))['iter_num'] == 5  # and saved at the end
    monkeypatch.undo()
    lines = (tmp_path / 'metrics.jsonl').read_text().splitlines()
    # three whole records, then half of iter 0's: nothing after it
    assert [json.loads(line)['type'] for line in lines[:3]] == ['start', 'bytes_per_token', 'eval'] and len(lines) == 4
    assert lines[3].startswith('{"type": "iter", "iter": 0,')
    # the next start writes on a line of its own after the half record, and the file reads as before
    run_train(capsys, train_args(dataset, tmp_path, max_iters=6, eval_interval=2, init_from='resume'))
    assert [r['iter'] for r in read_metrics(str(tmp_path / 'metrics.jsonl')) if r['type'] == 'iter'] == [5, 6]


@pytest.mark.usefixtures('one_thread')
def test_a_metrics_file_with_records_of_another_kind_is_read_past(dataset, tmp_path):
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'metrics.jsonl').write_text('{"type": "start", "run": "x", "iter": 0}\n{"type": "iter", "iter": "a"}\n'
                                       '[1, 2]\n{"type": "start"\n')
    train_here(dataset, out, max_iters=2)
    records = read_metrics(str(out / 'metrics.jsonl'))
    assert [r['iter'] for r in records if r['type'] == 'iter'] == [0, 1, 2] and records[0]['run'] == 1


@pytest.mark.usefixtures('one_thread')
def test_a_missing_wandb_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(
        __import__('sys').modules, 'wandb', None
    )  # `import wandb` fails as if not installed
    logger = MetricsLogger(
        str(tmp_path / 'metrics.jsonl'), wandb_log=True, wandb_project='p', wandb_run_name='r'
    )
    logger.close()
    err = capsys.readouterr().err
    assert (
        "warning: wandb is not installed; continuing without it (pip install wandb to log "
        "there, or --wandb_log=False)"
    ) in err and 'WANDB_MODE' not in err
