"""
The spike guard (skip_loss_z / skip_grad_z), activation checkpointing, the out-of-memory message, and the
non-finite check that runs every iteration.
"""
import functools
import json
import math
import re

import pytest
import torch

import bench
import train
from helpers import assert_losses_close, iter_losses, run_python, train_args
from model import GPT, GPTConfig
from nanogpt_plus import spike_guard
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.errors import UserError
from nanogpt_plus.optimizer import skip_update, take_update, unscale_and_clip
from nanogpt_plus.runtime import run_main
from nanogpt_plus.spike_guard import SPIKE_WINDOW, SpikeGuard

tiny_args = functools.partial(train_args, dropout=0.1, num_threads=1)  # fixed threads: bitwise runs
PLAIN_FORWARD = GPT.forward  # what inject_spike wraps (never a wrapper a previous injection left)
# the integration runs use a short window, so it fills in 16 iterations instead of 128
SHORT_WINDOW = 16
SKIP_LINE = re.compile(r"^iter (\d+): skipped the update: loss (\S+) is (\S+) standard deviations above its running "
                       r"mean (\S+) \(skip_loss_z=5\.0\); grad norm (\S+) is (\S+) standard deviations above its "
                       r"running mean (\S+) \(skip_grad_z=5\.0\)$", re.M)


# -----------------------------------------------------------------------------
# SpikeGuard on its own

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


def test_skip_update_leaves_weights_optimizer_and_scaler_as_they_were():
    """ Also with an enabled GradScaler (float16's), whose next unscale_ must still work after a skip. """
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=12))
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu')
    scaler = torch.amp.GradScaler('cpu', enabled=True, init_scale=1024.0)
    x = torch.randint(12, (2, 8))

    def half_step():
        scaler.scale(model(x, x)[1]).backward()
        return unscale_and_clip(model, optimizer, scaler, grad_clip=0.0, measure=True)

    half_step()
    take_update(optimizer, scaler)  # AdamW state exists from here on
    weights = [p.detach().clone() for p in model.parameters()]
    moments = [optimizer.state[p]['exp_avg'].clone() for p in model.parameters()]
    scale = scaler.get_scale()
    growth = scaler._growth_tracker.item()
    norm = half_step()
    assert norm is not None and math.isfinite(float(norm)) and float(norm) > 0
    skip_update(optimizer, scaler)
    assert all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))
    assert all(torch.equal(m, optimizer.state[p]['exp_avg']) for m, p in zip(moments, model.parameters()))
    assert all(p.grad is None for p in model.parameters())
    assert (scaler.get_scale(), scaler._growth_tracker.item()) == (scale, growth)
    half_step()
    take_update(optimizer, scaler)  # the next step unscales and steps as usual
    assert not all(torch.equal(a, p) for a, p in zip(weights, model.parameters()))


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


# -----------------------------------------------------------------------------
# activation checkpointing

def test_activation_checkpointing_gives_the_plain_gradients():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=20, dropout=0.2))
    x = torch.randint(20, (4, 16))
    y = torch.randint(20, (4, 16))

    def loss_and_grads(enabled):
        model.zero_grad(set_to_none=True)
        model.set_activation_checkpointing(enabled)
        torch.manual_seed(1)  # the same dropout masks for both runs
        loss = model(x, y)[1]
        loss.backward()
        return loss, [p.grad for p in model.parameters()], torch.get_rng_state()

    plain_loss, plain_grads, plain_rng = loss_and_grads(False)
    loss, grads, rng = loss_and_grads(True)
    torch.testing.assert_close(loss, plain_loss)
    for a, b in zip(grads, plain_grads):
        torch.testing.assert_close(a, b)
    # the recomputation leaves the RNG where the plain run leaves it
    assert torch.equal(rng, plain_rng)
    model.eval()
    with torch.no_grad():  # evaluation never recomputes (nothing to save memory on)
        torch.testing.assert_close(model(x, y)[1], GPT.forward(model, x, y)[1])


def test_train_with_activation_checkpointing(dataset, tmp_path, capsys):
    train.main(tiny_args(dataset, tmp_path / 'plain', max_iters=6, eval_interval=6))
    plain = iter_losses(capsys.readouterr().out)
    train.main(tiny_args(dataset, tmp_path / 'ac', max_iters=6, eval_interval=6, activation_checkpointing=True))
    recomputed = iter_losses(capsys.readouterr().out)
    assert_losses_close(recomputed, plain, range(7))
    assert 'activation_checkpointing' not in load_checkpoint(str(tmp_path / 'ac' / 'ckpt.pt'))['model_extra_args']


def test_bench_prints_peak_memory(capsys):
    bench.main(['--device=cpu', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=4',
                '--burnin=1', '--steps=2', '--num_threads=1', '--real_data=False', '--activation_checkpointing=True'])
    m = re.search(r"^peak memory: ([\d,]+) MiB \(peak process RSS, activation_checkpointing=True\)$",
                  capsys.readouterr().out, re.M)
    assert m and int(m.group(1).replace(',', '')) > 50


# -----------------------------------------------------------------------------
# out of memory

def test_out_of_memory_is_one_message_and_keeps_the_checkpoint(dataset, tmp_path, capsys, monkeypatch):
    train.main(tiny_args(dataset, tmp_path, max_iters=3, eval_interval=3))
    saved = (tmp_path / 'ckpt.pt').read_bytes()
    calls = {'n': 0}
    real_forward = GPT.forward

    def forward(self, idx, targets=None, kv_cache=None):
        calls['n'] += self.training
        if calls['n'] > 3:  # the second micro-step of the second iteration after the resume
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return real_forward(self, idx, targets, kv_cache)
    monkeypatch.setattr(GPT, 'forward', forward)
    capsys.readouterr()
    args = tiny_args(dataset, tmp_path, max_iters=12, eval_interval=100, init_from='resume')
    with pytest.raises(SystemExit) as exit_info:
        run_main(lambda: train.main(args))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    # the resume starts at iter 4, the final checkpoint's (max_iters + 1); the failing forward is in iter 5
    assert len(err) == 1 and err[0].startswith(f"error: out of GPU memory at iter 5; the last checkpoint, "
                                               f"{tmp_path / 'ckpt.pt'}, is kept")
    for fix in ('--batch_size', '--gradient_accumulation_steps', '--activation_checkpointing=True',
                '--parallelism=fsdp', '--block_size', '--init_from=resume'):
        assert fix in err[0]
    assert (tmp_path / 'ckpt.pt').read_bytes() == saved


# -----------------------------------------------------------------------------
# on a CUDA GPU (skipped without one): GPT-2 124M's shape

GPT2_SHAPE = ['--n_layer=12', '--n_head=12', '--n_embd=768', '--block_size=1024']


def bench_peak_mib(*settings):
    """ bench.py's peak memory (MiB) in a process of its own, GPT-2 124M, random tokens, eager, on CUDA. """
    r = run_python(['bench.py', '--device=cuda', '--real_data=False', '--compile=False',
                        '--batch_size=8', '--burnin=1', '--steps=2', *GPT2_SHAPE, *settings], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"^peak memory: ([\d,]+) MiB \(peak CUDA memory allocated", r.stdout, re.M)
    return int(m.group(1).replace(',', ''))


@pytest.mark.gpu
def test_activation_checkpointing_lowers_the_cuda_peak_of_gpt2():
    plain = bench_peak_mib()
    recomputed = bench_peak_mib('--activation_checkpointing=True')
    # the Blocks' activations at 8 x 1024 tokens are ~2 GiB in bf16; the logits and AdamW state stay either way
    assert recomputed < plain - 1024, (plain, recomputed)


@pytest.mark.gpu
def test_real_cuda_out_of_memory_is_one_message(dataset, tmp_path):
    # 4096 sequences of 1024 tokens through GPT-2 124M's Blocks: hundreds of GiB of activations
    args = train_args(dataset, tmp_path, device='cuda', batch_size=4096, gradient_accumulation_steps=1,
                      max_iters=2, eval_interval=100, n_layer=12, n_head=12, n_embd=768, block_size=1024)
    r = run_python(['train.py', *args], timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: out of GPU memory at iter 0; no checkpoint had been")
