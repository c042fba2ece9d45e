"""
Owning an out_dir (nanogpt_plus/outputs.py and train.py/finetune.py around it): the lock against a second
run, stale locks and temp files of killed runs, the refusal to overwrite a checkpoint, checkpoint cadence
(checkpoint_interval, the final checkpoint, keep_checkpoints), the exit code of a clean stop, and
metrics.jsonl after a resume.
"""
import functools
import json
import multiprocessing
import os
import re
import shlex
import shutil
import socket
import sys
import time

import pytest
import torch

import finetune
import train
from helpers import dead_pid, exit_code, iter_losses, start_python, train_args
from nanogpt_plus.errors import EXIT_INTERRUPTED, UserError
from nanogpt_plus.metrics import read_metrics
from nanogpt_plus.outputs import LOCK_NAME, OutDirLock, OutDirSpec, prepare_out_dir
from nanogpt_plus.signals import GracefulExit

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

tiny_args = functools.partial(train_args, num_threads=1)


def run_train(capsys, args):
    train.main(args)
    return capsys.readouterr()


# -----------------------------------------------------------------------------
# overwrite protection

def test_a_scratch_run_over_a_checkpoint_is_refused_and_overwrite_replaces_it(dataset, tmp_path, capsys):
    args = tiny_args(dataset, tmp_path, max_iters=2, eval_interval=2)
    run_train(capsys, args)
    before = (tmp_path / "ckpt.pt").read_bytes()
    # the same command again: that run is complete, so resuming it is no advice
    assert exit_code(lambda: train.main(args)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds the checkpoint ckpt.pt (iter 3) of an earlier run" in err
    assert "--init_from=resume" not in err
    others = ' '.join(a for a in args if not a.startswith('--out_dir='))
    assert f"`python train.py {others} --out_dir={tmp_path}-2`" in err
    assert f"`python train.py {' '.join(args)} --overwrite=True`" in err
    # with more iterations it can continue, and the command it gives does
    longer = args + ["--max_iters=4"]
    assert exit_code(lambda: train.main(longer)) == 2
    resume = f"python train.py {' '.join(longer)} --init_from=resume"
    assert f"`{resume}`" in capsys.readouterr().err
    assert (tmp_path / "ckpt.pt").read_bytes() == before  # untouched
    assert not (tmp_path / LOCK_NAME).exists()  # a refused run leaves no lock behind
    out = run_train(capsys, args + ["--overwrite=True", "--max_iters=3"]).out
    assert "overwrite=True: the earlier run's checkpoint" in out
    # the new run's final save
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"] == 4


def test_the_refusal_over_another_architecture_suggests_what_works(dataset, tmp_path, capsys):
    """ The quick start's run, then nanoGPT's bigger config into the same out_dir: resuming can't work. """
    args = tiny_args(dataset, tmp_path / "out", max_iters=2, eval_interval=2)
    run_train(capsys, args)
    bigger = args + ["--n_layer=3", "--max_iters=4"]
    assert exit_code(lambda: train.main(bigger)) == 2
    err = capsys.readouterr().err
    assert "--init_from=resume" not in err
    suggested = re.search(r"write this run elsewhere with `python train\.py (.*?)`", err).group(1)
    run_train(capsys, shlex.split(suggested))
    assert torch.load(tmp_path / "out-2" / "ckpt.pt", weights_only=True)["model_args"]["n_layer"] == 3


def test_why_a_resume_would_be_refused_is_asked_only_over_an_earlier_run(tmp_path):
    """ A new run into an empty out_dir never reads an earlier checkpoint (resume_refusal), one over a run does. """
    spec = OutDirSpec(out_dir=str(tmp_path), init_from='scratch', resume_from='', overwrite=False, eval_only=False)
    asked = []

    def resume_refusal():
        asked.append(True)
        return "another architecture"

    prepare_out_dir(spec, 'train.py', [], resume_refusal)
    assert asked == []
    (tmp_path / "ckpt.pt").write_bytes(b"an earlier run's")
    with pytest.raises(UserError, match="write this run elsewhere"):
        prepare_out_dir(spec, 'train.py', [], resume_refusal)
    assert asked == [True]


def test_out_dir_that_is_a_file(dataset, tmp_path):
    (tmp_path / "out").write_text("not a directory")
    with pytest.raises(UserError, match="is a file, not a directory"):
        train.main(tiny_args(dataset, tmp_path / "out"))


# -----------------------------------------------------------------------------
# the lock

def test_a_second_run_is_refused_while_the_first_holds_the_lock_then_takes_it_over(dataset, tmp_path, capsys):
    """ A real train.py holds out_dir; a second run is refused; once it is SIGKILLed its lock is taken over. """
    args = tiny_args(dataset, tmp_path, max_iters=100000, lr_decay_iters=100000, eval_interval=100000)
    first = start_python(["-u", "train.py", *args], env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        for line in first.stdout:
            if line.startswith("iter 1:"):
                break
        holder = json.loads((tmp_path / LOCK_NAME).read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname() and "train.py" in holder["command"]
        with pytest.raises(UserError, match=rf"is in use by another run \(pid {first.pid} on .*, started .*; lock "):
            train.main(tiny_args(dataset, tmp_path, max_iters=2))
    finally:
        first.kill()  # SIGKILL: no clean-up, run.lock stays behind
        first.communicate()
    assert (tmp_path / LOCK_NAME).exists()
    captured = run_train(capsys, tiny_args(dataset, tmp_path, max_iters=1))
    assert f"warning: took over the lock {tmp_path / LOCK_NAME} of a run that ended without releasing it " \
           f"(pid {first.pid} on {socket.gethostname()}" in captured.err
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end


def test_a_lock_from_another_host_is_refused(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "x"}))
    with pytest.raises(UserError, match=r"a run on elsewhere .* if it has ended, delete .*run.lock and start again"):
        OutDirLock(str(tmp_path)).acquire()


def _race_for_lock(out_dir, started, results):
    started.wait()
    try:
        lock = OutDirLock(out_dir).acquire()
    except UserError:
        results.put(False)
        return
    results.put(True)
    time.sleep(0.5)  # hold it while the others try
    lock.release()


@pytest.mark.parametrize("stale", [False, True])
def test_runs_starting_together_take_the_lock_once(tmp_path, stale):
    """ Four processes at the same moment, into a free out_dir or one with a dead run's lock: exactly one wins. """
    if stale:
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname()}))
    ctx = multiprocessing.get_context("fork")  # file operations only: no torch work in the children
    started = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=_race_for_lock, args=(str(tmp_path), started, results)) for _ in range(4)]
    for p in procs:
        p.start()
    started.set()
    outcomes = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sorted(outcomes) == [False, False, False, True]
    assert not (tmp_path / LOCK_NAME).exists() and not [n for n in os.listdir(tmp_path) if ".tmp." in n]


def test_stale_temp_files_are_removed_at_start_up(dataset, tmp_path, capsys):
    dead = tmp_path / f".ckpt.pt.nanogpt_plus.tmp.{dead_pid()}"
    live = tmp_path / f".ckpt.pt.nanogpt_plus.tmp.{os.getppid()}"
    dead.write_bytes(b"half a checkpoint")
    live.write_bytes(b"another process is writing this one")
    out = run_train(capsys, tiny_args(dataset, tmp_path, max_iters=1)).out
    assert f"removed 1 temp file(s) that killed runs left in {tmp_path}: {dead.name}" in out
    assert not dead.exists() and live.exists()


# -----------------------------------------------------------------------------
# checkpoint cadence and retention

def test_final_checkpoint_when_max_iters_is_not_a_multiple_of_eval_interval(dataset, tmp_path, capsys):
    full = run_train(capsys, tiny_args(dataset, tmp_path / "full", max_iters=10, eval_interval=3)).out
    part1 = run_train(capsys, tiny_args(dataset, tmp_path / "split", max_iters=7, eval_interval=3)).out
    assert f"saving checkpoint to {tmp_path / 'split'} (final, iter 8)" in part1
    ckpt = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)
    # max_iters + 1: the steps done, iteration 7's included (not only up to iter 6)
    assert ckpt["iter_num"] == 8
    part2 = run_train(capsys, tiny_args(dataset, tmp_path / "split", max_iters=10, eval_interval=3,
                                        init_from="resume")).out
    assert min(iter_losses(part2)) == 8
    assert {**iter_losses(part1), **iter_losses(part2)} == iter_losses(full)


def snapshots(out_dir):
    return sorted(n for n in os.listdir(out_dir) if n.startswith("ckpt_") and n[5].isdigit())


def test_checkpoint_interval_and_keep_checkpoints(dataset, tmp_path, capsys):
    out = run_train(capsys, tiny_args(dataset, tmp_path, max_iters=9, eval_interval=100, checkpoint_interval=2,
                                      keep_checkpoints=2)).out
    saves = [line for line in out.splitlines() if line.startswith("saving checkpoint")]
    assert len(saves) == 5  # after 2, 4, 6, 8 steps and the final one (10); evaluations add none
    assert snapshots(tmp_path) == ["ckpt_10.json", "ckpt_10.pt", "ckpt_8.json", "ckpt_8.pt"]
    for it in (8, 10):
        assert torch.load(tmp_path / f"ckpt_{it}.pt", weights_only=True)["iter_num"] == it
    # a copy, not a hard link: a file written over one name (cp ckpt_8.pt ckpt.pt) must not change the other
    assert not os.path.samefile(tmp_path / "ckpt.pt", tmp_path / "ckpt_10.pt")
    assert (tmp_path / "ckpt.pt").read_bytes() == (tmp_path / "ckpt_10.pt").read_bytes()
    # a new run over it: the old run's snapshots (8 and 10 > its iterations) go at its first save
    (tmp_path / "ckpt_50.pt").write_bytes(b"from a run before that")
    run_train(capsys, tiny_args(dataset, tmp_path, max_iters=3, eval_interval=100, checkpoint_interval=2,
                                keep_checkpoints=2, overwrite=True))
    assert snapshots(tmp_path) == ["ckpt_2.json", "ckpt_2.pt", "ckpt_4.json", "ckpt_4.pt"]
    assert torch.load(tmp_path / "ckpt_2.pt", weights_only=True)["iter_num"] == 2
    # going back: resume the older snapshot; the later one is another line of the run: kept apart, never deleted
    # or counted (its name could collide with this line's)
    shutil.copyfile(tmp_path / "ckpt_2.pt", tmp_path / "ckpt.pt")
    run_train(capsys, tiny_args(dataset, tmp_path, max_iters=2, eval_interval=100, checkpoint_interval=2,
                                keep_checkpoints=1, init_from="resume"))
    assert snapshots(tmp_path) == ["ckpt_3.json", "ckpt_3.pt"]  # 2 pruned
    assert snapshots(tmp_path / "abandoned_1") == ["ckpt_4.json", "ckpt_4.pt"]  # 4 kept, apart


def test_checkpoint_interval_keeps_the_best_model_apart(dataset, tmp_path, capsys):
    """ always_save_checkpoint=False with checkpoint_interval: the state in ckpt.pt, the best in ckpt_best.pt. """
    out = run_train(capsys, tiny_args(dataset, tmp_path, max_iters=7, eval_interval=3, checkpoint_interval=2,
                                      always_save_checkpoint=False)).out
    val = {int(line.split()[1][:-1]): float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")}
    best, state = (torch.load(tmp_path / name, weights_only=True) for name in ("ckpt_best.pt", "ckpt.pt"))
    best_iter = min((v, it) for it, v in val.items() if it > 0)[1]
    assert best["iter_num"] == best_iter and abs(best["best_val_loss"] - val[best_iter]) < 1e-4
    assert state["iter_num"] == 8


# -----------------------------------------------------------------------------
# exit code of a clean stop, metrics after a resume

def test_interrupted_fine_tune_exits_75_and_a_new_one_is_refused(tmp_path, monkeypatch, capsys):
    from test_finetune import make_source, make_task
    src = make_source(tmp_path / "src")
    train_file, _ = make_task(tmp_path, "classification", n_train=32, n_val=4)
    argv = ["--task=classification", f"--init_from={src}", f"--train_file={train_file}",
            f"--out_dir={tmp_path / 'ft'}", "--device=cpu", "--batch_size=8", "--epochs=1"]
    monkeypatch.setattr(sys, "argv", ["finetune.py"] + argv)
    # a signal in the first step
    monkeypatch.setattr(GracefulExit, "should_stop", lambda self, dist_info: True)
    assert exit_code(finetune.main) == EXIT_INTERRUPTED == 75
    assert "stopped cleanly" in capsys.readouterr().out
    assert exit_code(finetune.main) == 2  # the same command again would start over the saved state
    err = capsys.readouterr().err
    assert "already holds the checkpoint ckpt_last.pt" in err and "--init_from=resume`" in err
    assert "--overwrite=True`" in err and not (tmp_path / "ft" / LOCK_NAME).exists()


def test_metrics_after_a_resume_are_one_trajectory(dataset, tmp_path, capsys):
    first = run_train(capsys, tiny_args(dataset, tmp_path, max_iters=6, eval_interval=3, checkpoint_interval=2,
                                        keep_checkpoints=3)).out
    # as if the run had crashed after its save at iter 4: resume from there, repeating iterations 4-6
    os.replace(tmp_path / "ckpt_4.pt", tmp_path / "ckpt.pt")
    second = run_train(capsys, tiny_args(dataset, tmp_path, max_iters=6, eval_interval=3, init_from="resume")).out
    assert iter_losses(second) == {k: v for k, v in iter_losses(first).items() if k >= 4}
    raw = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    starts = [(r["run"], r["iter"], r["init_from"]) for r in raw if r["type"] == "start"]
    assert starts == [(1, 0, "scratch"), (2, 4, "resume")] and all("run" in r for r in raw)
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    iters = [(r["iter"], r["run"]) for r in records if r["type"] == "iter"]
    assert iters == [(i, 1) for i in range(4)] + [(i, 2) for i in range(4, 7)]  # no iteration twice
    evals = [(r["iter"], r["run"]) for r in records if r["type"] == "eval"]
    assert evals == [(0, 1), (3, 1), (6, 2)]


# -----------------------------------------------------------------------------
# round 3 (issue 32): a lock replaced under a live run, a full disk, a dataset's directory

def test_a_lock_replaced_under_a_live_run_is_not_taken_over(tmp_path):
    """ eval.py --output_file=<out_dir>/run.lock replaced the live run's lock (a new file, not flocked): a second
    run found nothing holding it and took over. check_output refuses that output now; and a run.lock that is not
    a lock of ours is refused rather than taken over, so a second run never trains beside the first. """
    first = OutDirLock(str(tmp_path)).acquire()
    try:
        replaced = tmp_path / "other"
        replaced.write_text('{"task": "loss", "metrics": {"loss": 1.0}, "source": "x"}\n')
        os.replace(replaced, tmp_path / LOCK_NAME)
        with pytest.raises(UserError, match=r"run.lock is not a lock this project wrote .*; if no run uses .*, "
                                            r"delete .*run.lock and start again"):
            OutDirLock(str(tmp_path)).acquire()
        assert "task" in (tmp_path / LOCK_NAME).read_text()  # left as it was
    finally:
        first.release()  # no longer its file: not removed by it either
    assert (tmp_path / LOCK_NAME).exists()


def test_a_full_disk_while_writing_the_lock_is_one_line(tmp_path, monkeypatch):
    import errno

    from nanogpt_plus import outputs

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(outputs.os, "write", full)
    with pytest.raises(UserError, match=r"^could not write the lock .*run.lock \(No space left on device\); make "
                                        r"room on the disk"):
        OutDirLock(str(tmp_path)).acquire()
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []  # no lock and no temp file left behind


def test_an_out_dir_that_is_a_datasets_directory_is_refused(dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    before = sorted(os.listdir(data))
    with pytest.raises(UserError, match=r"out_dir .*data is a dataset's directory \(it holds train.bin\)"):
        train.main(tiny_args(str(data), data, max_iters=1))
    assert sorted(os.listdir(data)) == before
