"""
nanogpt_plus/optimizer.py: the learning-rate schedules (cosine, wsd), the rates of Muon and AdamW, a skipped update
that leaves the weights, optimizer and scaler as they were, and the optimizer settings a resume applies.
"""
import math

import pytest
import torch

from helpers import modern_config, muon_optimizer, run_train, train_args
from model import GPT, GPTConfig
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.optimizer import LRSchedule, set_learning_rate, skip_update, take_update, unscale_and_clip


def test_lr_schedule():
    from nanogpt_plus.optimizer import LRSchedule
    schedule = LRSchedule(learning_rate=1e-3, warmup_iters=10, lr_decay_iters=100, min_lr=1e-4)
    lrs = [schedule.rate(it) for it in range(120)]
    # linear warmup
    assert lrs[0] == pytest.approx(1e-3 / 11) and lrs[9] == pytest.approx(1e-3 * 10 / 11)
    assert lrs[10] == pytest.approx(1e-3)  # cosine starts at the max
    assert lrs[55] == pytest.approx((1e-3 + 1e-4) / 2)  # halfway through the decay
    assert all(a >= b for a, b in zip(lrs[10:101], lrs[11:101]))  # monotone decay
    assert lrs[100] == pytest.approx(1e-4) and lrs[119] == 1e-4
    no_decay = LRSchedule(learning_rate=1e-3, warmup_iters=10, lr_decay_iters=10, min_lr=1e-4)
    assert no_decay.rate(10) == 1e-4  # no decay phase: no division by zero


@pytest.mark.usefixtures('one_thread')
def test_set_learning_rate_scales_muon_and_gives_adamw_the_schedule():
    model = GPT(modern_config(pos='rope'))
    opt = muon_optimizer(model, learning_rate=1e-3, muon_lr=0.05)
    for it in (0, 5, 50, 95, 120):
        for name in ('cosine', 'wsd'):
            lr = lr_schedule(1e-3, 1e-4, name, cooldown_frac=0.2).rate(it)
            assert set_learning_rate(opt, lr) == lr
            # exactly the schedule's rate
            assert [g['lr'] for g in opt.adamw.param_groups] == [lr, lr]
            # muon_lr / learning_rate times it
            assert opt.muon.param_groups[0]['lr'] == pytest.approx(lr * 50)
    constant = LRSchedule(learning_rate=1e-3, warmup_iters=10, lr_decay_iters=100, min_lr=1e-4,
                          decay_lr=False)
    set_learning_rate(opt, constant.rate(50))
    assert [g['lr'] for g in opt.param_groups] == pytest.approx([0.05, 1e-3, 1e-3])


def lr_schedule(lr, low, name='cosine', cooldown_frac=0.2):
    """ A schedule with warmup_iters=10 and lr_decay_iters=100. """
    return LRSchedule(learning_rate=lr, warmup_iters=10, lr_decay_iters=100, min_lr=low,
                      lr_schedule=name, cooldown_frac=cooldown_frac)


@pytest.mark.usefixtures('one_thread')
def test_wsd_schedule_and_cosine_unchanged():
    lr = 1e-3
    low = 1e-4
    wsd = [lr_schedule(lr, low, 'wsd', 0.2).rate(it) for it in range(120)]
    assert wsd[:10] == pytest.approx([lr * (it + 1) / 11 for it in range(10)])  # the same warmup
    assert wsd[10:81] == [lr] * 71  # stable until the last 20% of lr_decay_iters
    # straight line
    assert wsd[80:101] == pytest.approx([lr + (it - 80) / 20 * (low - lr) for it in range(80, 101)])
    assert wsd[90] == pytest.approx((lr + low) / 2) and wsd[100] == pytest.approx(low) and wsd[101:] == [low] * 19
    # cooldown_frac 1: the line starts where the warmup ends; 0: flat to lr_decay_iters
    full = [lr_schedule(lr, low, 'wsd', 1.0).rate(it) for it in range(10, 101)]
    assert full == pytest.approx([lr + (it - 10) / 90 * (low - lr) for it in range(10, 101)])
    flat = lr_schedule(lr, low, 'wsd', 0.0)
    assert [flat.rate(it) for it in (10, 99, 100, 101)] == [lr, lr, lr, low]
    # 'cosine', the default, is still nanoGPT's formula
    cosine = lr_schedule(lr, low, 'cosine')
    for it in range(120):
        if it < 10:
            expected = lr * (it + 1) / 11
        elif it > 100:
            expected = low
        else:
            expected = low + 0.5 * (1 + math.cos(math.pi * (it - 10) / 90)) * (lr - low)
        default = LRSchedule(learning_rate=lr, warmup_iters=10, lr_decay_iters=100, min_lr=low)
        assert default.rate(it) == cosine.rate(it) == pytest.approx(expected)


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
# optimizer settings given on resume are applied, and the checkpoint says so

@pytest.mark.usefixtures('one_thread')
def test_adamw_settings_given_on_resume_are_applied(dataset, tmp_path, capsys):
    run_train(capsys, train_args(dataset, tmp_path, max_iters=4, eval_interval=4, num_threads=1))
    out = run_train(capsys, train_args(dataset, tmp_path, max_iters=6, eval_interval=4, num_threads=1,
                                       init_from='resume', beta2=0.99, weight_decay=0.05)).out
    assert "resuming with this run's optimizer settings: betas (0.9, 0.95) -> (0.9, 0.99), weight_decay 0.1 -> " \
           "0.05" in out
    ckpt = load_checkpoint(str(tmp_path / 'ckpt.pt'))
    groups = ckpt['optimizer']['param_groups']
    assert [tuple(g['betas']) for g in groups] == [(0.9, 0.99)] * 2
    assert [g['weight_decay'] for g in groups] == [0.05, 0.0]  # the vectors never decay
    assert ckpt['config']['beta2'] == 0.99 and ckpt['config']['weight_decay'] == 0.05
    # an unchanged resume changes nothing and says nothing
    out = run_train(capsys, train_args(dataset, tmp_path, max_iters=7, eval_interval=4, num_threads=1,
                                       init_from='resume', beta2=0.99, weight_decay=0.05)).out
    assert "optimizer settings" not in out


@pytest.mark.usefixtures('one_thread')
def test_muon_settings_given_on_resume_are_applied(dataset, tmp_path, capsys):
    run = dict(max_iters=4, eval_interval=4, num_threads=1, optimizer='muon')
    run_train(capsys, train_args(dataset, tmp_path, **run))
    run_train(capsys, train_args(dataset, tmp_path, **dict(run, max_iters=6), init_from='resume', muon_momentum=0.9,
                                 muon_lr=0.01, muon_weight_decay=0.01, muon_ns_steps=3))
    muon = load_checkpoint(str(tmp_path / 'ckpt.pt'))['optimizer']['muon']['param_groups'][0]
    assert muon['momentum'] == 0.9 and muon['weight_decay'] == 0.01 and muon['ns_steps'] == 3
    # muon_lr / learning_rate (tests' learning_rate 1e-2)
    assert muon['lr_ratio'] == pytest.approx(0.01 / 1e-2)
