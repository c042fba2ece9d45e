"""
nanogpt_plus/spike_guard.py (skip_loss_z / skip_grad_z): the running statistics, a spike skipped, printed, logged
and counted, an exact resume with the guard, and the non-finite check that reads the loss where the guard needs it.
"""
import functools
import json
import math
import re

import pytest
import torch

import train
from helpers import iter_losses, tiny_args
from model import GPT
from nanogpt_plus import spike_guard
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.errors import UserError
from nanogpt_plus.spike_guard import SPIKE_WINDOW, SpikeGuard

PLAIN_FORWARD = GPT.forward  # what inject_spike wraps (never a wrapper a previous injection left)


# the integration runs use a short window, so it fills in 16 iterations instead of 128
SHORT_WINDOW = 16


SKIP_LINE = re.compile(r"^iter (\d+): skipped the update: loss (\S+) is (\S+) standard deviations above its running "
                       r"mean (\S+) \(skip_loss_z=5\.0\); grad norm (\S+) is (\S+) standard deviations above its "
                       r"running mean (\S+) \(skip_grad_z=5\.0\)$", re.M)


def test_spike_guard_z_window_and_state():
    guard = SpikeGuard(skip_loss_z=5.0)
    assert guard.enabled and not SpikeGuard().enabled
    for k in range(SPIKE_WINDOW - 1):
        # z undefined: window not full
        assert guard.check(1000.0 if k == 50 else 1.0 + (k % 2) * 2) is None
    guard = SpikeGuard(skip_loss_z=5.0, skip_grad_z=5.0)
    for k in range(SPIKE_WINDOW):
        # mean 2, standard deviation 1; no grad norm measured
        guard.check(1.0 + (k % 2) * 2, grad_norm=None)
    assert guard.z_score('loss', 6.5) == pytest.approx(4.5)
    assert guard.check(6.5) is None  # 4.5 deviations: kept (and now part of the window)
    # never enter the window
    assert guard.check(float('nan')) is None and guard.check(float('inf')) is None
    assert len(guard.history['loss']) == SPIKE_WINDOW and math.isfinite(sum(guard.history['loss']))
    assert guard.history['grad_norm'] == []
    # plain values: weights_only-loadable in a checkpoint
    state = json.loads(json.dumps(guard.state_dict()))
    restored = SpikeGuard(skip_loss_z=5.0, skip_grad_z=5.0)
    restored.load_state_dict(state)
    spike = guard.check(100.0)
    assert spike.outliers == ['loss'] and guard.skipped == 1
    assert spike.describe().startswith("loss 100.0000 is ") and "(skip_loss_z=5.0)" in spike.describe()
    again = restored.check(100.0)
    # the skipped value entered
    assert again.describe() == spike.describe() and restored.history == guard.history
    assert spike.record(7) == {'type': 'skip', 'iter': 7, 'loss': 100.0, 'grad_norm': None,
                               'loss_z': spike.stats['loss'][1], 'grad_z': None}


# -----------------------------------------------------------------------------
# the spike guard in train.py

def inject_spike(monkeypatch, spike_iter, first_iter=0, factor=30.0, accumulation=2):
    """ Multiply the training loss of iteration spike_iter by factor (the run's own count of training forwards). """
    calls = {'n': 0}
    spiked = range(accumulation * (spike_iter - first_iter), accumulation * (spike_iter - first_iter + 1))

    def forward(self, idx, targets=None, kv_cache=None):
        logits, loss = PLAIN_FORWARD(self, idx, targets, kv_cache)
        if self.training:
            if calls['n'] in spiked:
                loss = loss * factor
            calls['n'] += 1
        return logits, loss
    monkeypatch.setattr(GPT, 'forward', forward)


@pytest.fixture
def short_window(monkeypatch):
    # train.py imports SpikeGuard from its module when the guard is on: the module's name is the one to replace
    monkeypatch.setattr(spike_guard, 'SpikeGuard', functools.partial(SpikeGuard, window=SHORT_WINDOW))


def snapshots_per_iteration(monkeypatch):
    """ {iter: (weights, AdamW first moments)} after each iteration's update, taken at its log step. """
    taken = {}
    real_log = train.log_iteration

    def log_iteration(run, state, *args):
        params = list(run.raw_model.parameters())
        taken[state.iter_num] = ([p.detach().clone() for p in params],
                                 [run.optimizer.state[p]['exp_avg'].clone() for p in params])
        real_log(run, state, *args)
    monkeypatch.setattr(train, 'log_iteration', log_iteration)
    return taken


def unchanged(snapshots, it):
    """ Whether iteration `it` left the weights and AdamW moments bitwise as iteration it - 1 did. """
    before = snapshots[it - 1]
    after = snapshots[it]
    return all(torch.equal(a, b) for tensors_a, tensors_b in zip(before, after) for a, b in zip(tensors_a, tensors_b))


def test_spike_is_skipped_printed_logged_and_counted(dataset, tmp_path, capsys, monkeypatch, short_window):
    spike_at = 24
    inject_spike(monkeypatch, spike_at)
    snapshots = snapshots_per_iteration(monkeypatch)
    guarded = tiny_args(dataset, tmp_path / 'guarded', max_iters=30, eval_interval=30, lr_decay_iters=30,
                        skip_loss_z=5.0, skip_grad_z=5.0)
    train.main(guarded)
    out = capsys.readouterr().out
    skips = SKIP_LINE.findall(out)
    assert [int(s[0]) for s in skips] == [spike_at] and float(skips[0][2]) > 5 and float(skips[0][5]) > 5
    assert float(skips[0][1]) == iter_losses(out)[spike_at]  # the loss of the `iter` line
    assert unchanged(snapshots, spike_at) and not unchanged(snapshots, spike_at - 1)
    records = [json.loads(line) for line in open(tmp_path / 'guarded' / 'metrics.jsonl')]
    skip_records = [r for r in records if r['type'] == 'skip']
    assert len(skip_records) == 1 and skip_records[0]['iter'] == spike_at and skip_records[0]['skipped_updates'] == 1
    assert skip_records[0]['loss_z'] > 5 and skip_records[0]['grad_z'] > 5
    assert load_checkpoint(str(tmp_path / 'guarded' / 'ckpt.pt'))['spike_guard']['skipped'] == 1

    # the same spike without the guard: the update is taken
    monkeypatch.undo()
    inject_spike(monkeypatch, spike_at)
    snapshots = snapshots_per_iteration(monkeypatch)
    train.main(tiny_args(dataset, tmp_path / 'plain', max_iters=spike_at, eval_interval=30, lr_decay_iters=30))
    assert "skipped the update" not in capsys.readouterr().out
    assert not unchanged(snapshots, spike_at)


def test_resume_with_the_spike_guard_is_exact(dataset, tmp_path, capsys, monkeypatch, short_window):
    """ The running statistics come back from the checkpoint: the resumed run skips the same update. """
    spike_at = 26
    stop_at = 20
    settings = dict(max_iters=30, eval_interval=stop_at, lr_decay_iters=30, skip_loss_z=5.0, skip_grad_z=5.0)
    inject_spike(monkeypatch, spike_at)
    train.main(tiny_args(dataset, tmp_path / 'full', **settings))
    full = capsys.readouterr().out
    train.main(tiny_args(dataset, tmp_path / 'split', **dict(settings, max_iters=stop_at)))
    part1 = capsys.readouterr().out
    # the final checkpoint of part 1 is at max_iters + 1
    inject_spike(monkeypatch, spike_at, first_iter=stop_at + 1)
    train.main(tiny_args(dataset, tmp_path / 'split', **settings, init_from='resume'))
    part2 = capsys.readouterr().out
    assert [int(s[0]) for s in SKIP_LINE.findall(full)] == [int(s[0]) for s in SKIP_LINE.findall(part2)] == [spike_at]
    assert {**iter_losses(part1), **iter_losses(part2)} == iter_losses(full)


def test_nan_at_a_non_log_iteration_stops(dataset, tmp_path, monkeypatch):
    """
    The loss is read (a host sync) at log steps, and at every step only when the spike guard needs it (issue 25):
    a NaN at a non-log iteration stops the run at the next place that reads a loss (here the evaluation at 6,
    log_interval=4), never saving the weights it left; with the spike guard on, at that very iteration.
    """
    inject_spike(monkeypatch, 5, factor=float('nan'))
    with pytest.raises(UserError, match=r"loss is nan at iter 6; stopping without saving"):
        train.main(tiny_args(dataset, tmp_path / 'a', max_iters=12, log_interval=4))
    assert not (tmp_path / 'a' / 'ckpt.pt').exists()
    inject_spike(monkeypatch, 5, factor=float('nan'))  # counted again from this run's first forward
    with pytest.raises(UserError, match=r"loss is nan at iter 5; stopping without saving"):
        train.main(tiny_args(dataset, tmp_path / 'b', max_iters=12, log_interval=4, skip_loss_z=5.0))
