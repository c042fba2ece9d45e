"""train.py under torchrun with 2 gloo processes when the ranks' work is uneven or something goes wrong:
evaluation with eval_iters not a multiple of the ranks, a checkpoint rank 0 cannot write, a rank that dies,
and SIGTERM to torchrun. Every launch has a timeout, so a hang fails the test instead of stalling the suite."""
import os
import re
import signal
import subprocess
import time

import pytest
import torch

from helpers import TORCHRUN, iter_losses, project_frames, start_python, train_args
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.evaluation import score_examples

TORCHRUN_2 = TORCHRUN + ["--standalone", "--nproc_per_node=2"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
EVAL_LINE = re.compile(r"^step 0: train loss (\S+), val loss (\S+)$", re.M)


def launch(cmd_args, nproc=2, timeout=60):
    """ train.py (under torchrun for nproc=2) to the end; a hang fails after timeout seconds. """
    launcher = TORCHRUN_2 if nproc == 2 else []
    proc = start(launcher + ["train.py", *cmd_args])
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start(args):
    return start_python(args, env=ENV)


def workers_of(proc):
    """ The pids of torchrun's worker processes (its children). """
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def stop(proc):
    """ Kill proc and its workers if still running: torchrun starts them in sessions of their own, so a
    hung test would otherwise leave them behind. """
    if proc.poll() is not None:
        return
    for pid in workers_of(proc):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.communicate()


@pytest.mark.parametrize("parallelism,eval_iters", [("fsdp", 3), ("ddp", 1)])
def test_uneven_evaluation_finishes_with_the_single_process_losses(dataset, tmp_path, parallelism, eval_iters):
    # 3 batches over 2 ranks (FSDP: every forward all-gathers), 1 batch over 2 (DDP: the first forward
    # broadcasts buffers): both used to hang at step 0
    common = dict(eval_only=True, eval_iters=eval_iters, num_threads=1)
    two = launch(train_args(dataset, tmp_path / "two", parallelism=parallelism, **common))
    one = launch(train_args(dataset, tmp_path / "one", **common), nproc=1)
    assert two.returncode == 0 and one.returncode == 0, two.stderr[-2000:] + one.stderr[-2000:]
    (a,) = EVAL_LINE.findall(one.stdout)
    (b,) = EVAL_LINE.findall(two.stdout)
    # the ranks sum their shares of the batches in another order: equal within rounding, not bitwise
    assert all(abs(float(x) - float(y)) < 2e-4 for x, y in zip(a, b)), (a, b)


def test_a_checkpoint_rank0_cannot_write_stops_every_rank_with_one_message(dataset, tmp_path):
    # a directory where rank 0 must write the file, put there once the run has started (one there
    # before is refused when the out_dir is claimed): the save at iteration 300 fails
    began = time.time()
    proc = start(TORCHRUN_2 + ["train.py", *train_args(dataset, tmp_path, max_iters=300, eval_interval=300,
                                                       lr_decay_iters=300, num_threads=1)])
    try:
        wait_for_line(proc, "iter 0:")
        os.makedirs(tmp_path / "ckpt.pt")
        out, err = proc.communicate(timeout=60)
    finally:
        stop(proc)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert time.time() - began < 60, "the ranks waited for each other"
    assert r.returncode != 0
    assert r.stderr.count("error: could not write the checkpoint") == 1, r.stderr[-3000:]
    # no worker traceback (torchrun prints its summary)
    assert not project_frames(r.stderr), r.stderr[-3000:]
    assert "finishing this iteration" not in r.stderr


def test_a_rank_that_dies_ends_the_run_without_saving(dataset, tmp_path):
    proc = start_endless_run(dataset, tmp_path, log_interval=1)
    try:
        wait_for_line(proc, "iter 3:")
        workers = workers_of(proc)
        assert len(workers) == 2, workers
        os.kill(max(workers), signal.SIGKILL)  # one worker disappears mid-run (the OOM killer, say)
        _, err = proc.communicate(timeout=20)
    finally:
        stop(proc)
    assert proc.returncode != 0
    assert "another process of this run is gone" in err, err[-3000:]
    assert not project_frames(err), err[-3000:]  # one line, no traceback of the surviving rank
    assert not os.path.exists(tmp_path / "ckpt.pt")


def endless_run_args(dataset, out_dir, log_interval):
    """ A 2-rank run that would go on for 100,000 iterations (no evaluation after iter 0): a test ends it. """
    return train_args(dataset, out_dir, max_iters=100000, lr_decay_iters=100000, eval_interval=100000,
                      log_interval=log_interval, num_threads=1)


def start_endless_run(dataset, out_dir, log_interval):
    return start(TORCHRUN_2 + ["train.py", *endless_run_args(dataset, out_dir, log_interval)])


def wait_for_line(proc, prefix, timeout=60):
    """ Read proc's stdout until a line starts with prefix; returns what was read. """
    seen = ""
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        seen += line
        if line.startswith(prefix):
            return seen
        assert line, "the run ended early: " + seen[-2000:] + proc.stderr.read()[-3000:]
    raise AssertionError(f"no '{prefix}' line within {timeout} s: " + seen[-2000:])


def test_sigterm_to_torchrun_stops_every_rank_at_once_and_resumes(dataset, tmp_path):
    # a log step only at iter 0: the stop must not wait for the next one (torchrun SIGKILLs after 30 s)
    args = endless_run_args(dataset, tmp_path, log_interval=100000)
    proc = start(TORCHRUN_2 + ["train.py", *args])
    try:
        seen = wait_for_line(proc, "iter 0:")
        time.sleep(1.0)  # some iterations in
        # what a scheduler does on preemption: torchrun forwards it once
        proc.send_signal(signal.SIGTERM)
        signalled = time.time()
        out, err = proc.communicate(timeout=28)
        stopped_in = time.time() - signalled
    finally:
        stop(proc)
    seen += out
    # torchrun's own code after a signal (its SignalException), as before
    assert proc.returncode == 1, err[-3000:]
    m = re.findall(r"saving checkpoint to .* \(interrupted at iter (\d+)\)", seen)
    assert len(m) == 1, seen[-2000:] + err[-3000:]
    stopped_at = int(m[0])
    assert stopped_at > 1 and stopped_in < 25, (stopped_at, stopped_in)  # torchrun SIGKILLs at 30 s
    assert err.count("received SIGTERM: all processes stop here and save a checkpoint") == 1, err[-3000:]
    assert "stopped cleanly" in seen
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert ckpt["iter_num"] == stopped_at and len(ckpt["rng"]) == 2
    resumed = launch(args + ["--log_interval=1", "--init_from=resume", f"--max_iters={stopped_at + 1}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(iter_losses(resumed.stdout)) == [stopped_at, stopped_at + 1]


class CountingModel(torch.nn.Module):
    """ Logits of all-zero weights, and a count of its forward passes. """

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def forward(self, idx, all_positions=False):
        self.forwards += 1
        return torch.zeros(*idx.shape, 5), None


class FakeDist:
    under_torchrun = True
    device = 'cpu'

    def __init__(self, rank, world_size):
        self.rank = rank
        self.world_size = world_size


def test_score_examples_runs_as_many_forwards_on_every_rank(monkeypatch):
    # 5 examples of one row over 2 ranks with batches of 2: rank 0 has 3 rows (2 batches), rank 1 has 2 (1)
    import torch.distributed as dist
    # one process plays each rank in turn
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None: None)
    rows = [([1, 2, 3], 2)] * 5
    counts = []
    tables = []
    for rank in range(2):
        model = CountingModel()
        tables.append(score_examples(model, rows, list(range(6)), 2, 'cpu', dist_info=FakeDist(rank, 2)))
        counts.append(model.forwards)
    assert counts == [2, 2]
    # the padding forward is not in the results: rank 1's table holds its 2 rows only
    assert tables[1][:, 1].tolist() == [0, 2, 0, 2, 0]


class CountingClassifier(torch.nn.Module):
    """ finetuning.evaluate's model interface: constant class logits, and a count of its forward passes. """
    task = 'classification'

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def forward(self, idx, extract_pos, choice_mask, lm_targets=None):
        self.forwards += 1
        return torch.tensor([[1.0, 0.0]]).expand(idx.size(0), 2), None


def test_finetune_validation_runs_as_many_batches_on_every_rank():
    from nanogpt_plus.finetuning import evaluate
    encoded = [[[1, 2, 3]]] * 3
    labels = [0, 1, 0]
    special = {'start': 10}
    results = []
    # 3 examples, batches of 1: rank 0 has 2, rank 1 one plus a padding forward
    for rank in range(2):
        model = CountingClassifier()
        correct, seen, _, preds = evaluate(model, encoded, labels, special, 1, 'cpu', torch.no_grad(),
                                           range(rank, 3, 2), num_batches=2)
        results.append((model.forwards, correct, seen, [p[0] for p in preds]))
    assert results == [(2, 2, 2, [0, 2]), (2, 0, 1, [1])]


def test_dist_timeout_reaches_the_process_group(dataset, tmp_path, monkeypatch, capsys):
    """ --dist_timeout=S is the timeout train.py's process group is made with (0: PyTorch's own). A real group of
    one gloo rank, in this process, as torchrun's environment describes it. """
    import datetime
    import socket

    import torch.distributed as dist

    import train
    with socket.socket() as s:  # a free port for the group's store
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK='0', LOCAL_RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1',
                           MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    made = []
    real = dist.init_process_group

    def init_process_group(**kwargs):
        made.append(kwargs)
        return real(**kwargs)
    monkeypatch.setattr(dist, 'init_process_group', init_process_group)
    train.main(train_args(dataset, tmp_path / 'a', max_iters=1, eval_interval=1, num_threads=1, dist_timeout=77))
    assert made == [{'backend': 'gloo', 'timeout': datetime.timedelta(seconds=77)}]
    dist.destroy_process_group()
    train.main(train_args(dataset, tmp_path / 'b', max_iters=1, eval_interval=1, num_threads=1))
    assert made[1] == {'backend': 'gloo'}  # 0: the default, not a timeout of 0 s
    capsys.readouterr()


def test_a_single_process_describes_nothing_to_compare(tiny_dataset, tmp_path, monkeypatch):
    """ same_start reads files and asks git: a run of one process (no torchrun) has no rank to compare with. """
    import train
    from nanogpt_plus.distributed import DistInfo, same_everywhere

    def describe():
        raise AssertionError('described in a single process')
    same_everywhere(DistInfo(False, 0, 0, 1, 'cpu'), describe, {})
    monkeypatch.setattr(train, 'same_start', describe)
    train.main(train_args(tiny_dataset, tmp_path / 'out', max_iters=1))
    assert (tmp_path / 'out' / 'ckpt.pt').exists()
