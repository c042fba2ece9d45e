"""
nanogpt_plus/muon.py: Muon's float32 Newton-Schulz against PyTorch's iteration, the batched orthogonalisation, its
split of the parameters (the Blocks' matrices; AdamW for the rest), its step and state dict against PyTorch's own.
"""
import math

import pytest
import torch
from torch.testing import assert_close

from helpers import ALL_OPTIONS, modern_config, modern_model, muon_optimizer
from model import GPT
from nanogpt_plus.distributed import load_optimizer_state
from nanogpt_plus.errors import UserError
from nanogpt_plus.muon import float32_newton_schulz, newton_schulz_float32, orthogonalise
from nanogpt_plus.optimizer import LRSchedule, set_learning_rate

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def newton_schulz_float64(g, coefficients, steps):
    """ Muon's quintic Newton-Schulz iteration, X <- a X + (b A + c A^2) X with A = X X^T, in float64. """
    a, b, c = coefficients
    x = g.double()
    tall = x.size(0) > x.size(1)
    x = x.T if tall else x
    x = x / x.norm()
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def muon_coefficients():
    from torch.optim import _muon
    return (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C), _muon.DEFAULT_NS_STEPS


@pytest.mark.parametrize('shape', [(32, 96), (96, 32), (32, 32)])
def test_newton_schulz_float32_is_pytorchs_iteration(shape):
    from torch.optim._muon import EPS, _zeropower_via_newtonschulz
    coefficients, steps = muon_coefficients()
    g = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    ours = newton_schulz_float32(g, coefficients, steps, EPS)
    assert ours.shape == g.shape and ours.dtype == torch.float32
    # PyTorch's own (bfloat16): equal within bfloat16's rounding (~1.5% here); the same iteration in float64:
    # equal within float32's
    pytorch = _zeropower_via_newtonschulz(g, coefficients, steps, EPS).float()
    assert (ours - pytorch).norm() / pytorch.norm() < 0.05
    exact = newton_schulz_float64(g, coefficients, steps)
    assert ((ours.double() - exact).norm() / exact.norm()).item() < 1e-5
    # near-orthogonal: every singular value of the result in Muon's (0.5, 1.5) band (from ~0.1-0.3 before)
    singular = torch.linalg.svdvals(ours.double())
    assert singular.min() > 0.5 and singular.max() < 1.5, singular
    assert torch.linalg.svdvals(g / g.norm()).max() < 0.35
    # scale-free: a gradient 1000 times larger gives the same direction
    assert_close(newton_schulz_float32(1000 * g, coefficients, steps, EPS), ours, atol=1e-5, rtol=1e-4)


def test_orthogonalise_batches_by_shape_and_is_each_matrix_alone():
    """ The batched orthogonalisation (the CPU's Muon step) against each matrix alone and against float64, with
    the Gram-matrix iteration where a shape is wider than 1.5:1 and without it. """
    from torch.optim._muon import EPS
    coefficients, steps = muon_coefficients()
    gen = torch.Generator().manual_seed(1)
    # two shapes twice each, one tall and one wide of the same size (never stacked together), one square, one
    # at 1.5:1 (the plain steps), one 4:1 of rank 3 plus a little noise (a gradient's usual look)
    shapes = [(96, 32), (32, 96), (96, 32), (32, 32), (32, 96), (48, 32), (128, 32)]
    grads = [torch.randn(s, generator=gen) * (i + 1) for i, s in enumerate(shapes)]
    grads[-1] = torch.randn(128, 3, generator=gen) @ torch.randn(3, 32, generator=gen) + 1e-3 * grads[-1]
    for gram in (True, False):
        out = orthogonalise(grads, coefficients, steps, EPS, gram=gram)
        for g, o in zip(grads, out):
            assert o.shape == g.shape and o.dtype == torch.float32
            exact = newton_schulz_float64(g, coefficients, steps)
            # float32 rounding: ~1e-6 for a random matrix, ~1e-5 (plain) and ~1e-4 (Gram) for the low-rank one,
            # far under the bfloat16 PyTorch's Muon computes in (~1e-2); a wrong polynomial is ~1
            assert ((o.double() - exact).norm() / exact.norm()).item() < (5e-4 if gram else 1e-4)
            # the same steps as one matrix alone, but for the batched matmuls' rounding
            if not gram:
                alone = newton_schulz_float32(g, coefficients, steps, EPS)
                assert ((o - alone).norm() / alone.norm()).item() < 1e-4
    # which shapes take the Gram path: only those wider than 1.5:1 (the plain steps are bitwise the same)
    plain = orthogonalise(grads, coefficients, steps, EPS, gram=False)
    same = [torch.equal(o, p) for o, p in zip(orthogonalise(grads, coefficients, steps, EPS), plain)]
    assert same == [False, False, False, True, False, True, False], same


@pytest.mark.parametrize('ns_steps', [5, 3])
def test_muon_batched_step_is_pytorchs_step(ns_steps):
    """ Three CPU steps of MuonWithAdamW (batched orthogonalisation) against PyTorch's own loop (float32 NS):
    the same weights within float32 rounding, and the same state, under PyTorch's keys; with PyTorch's 5
    Newton-Schulz steps and with muon_ns_steps=3 (both loops take the group's count). """
    models = [modern_model(**ALL_OPTIONS).train() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [muon_optimizer(m, ns_steps=ns_steps) for m in models]
    assert [opt.muon.param_groups[0]['ns_steps'] for opt in opts] == [ns_steps] * 2
    idx = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        for model in models:
            model(idx, idx)[1].backward()
        opts[0].step()
        with float32_newton_schulz():
            opts[1].muon.step()
        opts[1].adamw.step()
        for opt in opts:
            opt.zero_grad()
    # the Gram-matrix steps round differently from PyTorch's plain ones (~5e-4 of an update at most, see the test
    # above): ~1e-6 here after 3 steps at muon_lr 0.02 (an atol of 1e-6 was 96% used on one CPU), against ~2e-3
    # per step for a wrong update
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    ours, pytorchs = (opt.state_dict()['muon'] for opt in opts)
    assert ours['param_groups'] == pytorchs['param_groups']
    assert [sorted(v) for v in ours['state'].values()] == [['momentum_buffer']] * len(pytorchs['state'])
    for i, state in pytorchs['state'].items():
        assert_close(ours['state'][i]['momentum_buffer'], state['momentum_buffer'], atol=1e-6, rtol=1e-5)


def test_float32_newton_schulz_swaps_pytorchs_function_and_puts_it_back():
    import torch.optim._muon as muon_impl
    original = muon_impl._zeropower_via_newtonschulz
    with float32_newton_schulz():
        assert muon_impl._zeropower_via_newtonschulz is newton_schulz_float32
    assert muon_impl._zeropower_via_newtonschulz is original
    with float32_newton_schulz(enabled=False):
        assert muon_impl._zeropower_via_newtonschulz is original
    with pytest.raises(RuntimeError), float32_newton_schulz():
        raise RuntimeError("a step that fails")
    assert muon_impl._zeropower_via_newtonschulz is original


BLOCK_MATRICES = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')


@pytest.mark.parametrize('options', [{}, ALL_OPTIONS], ids=['gpt2', 'all'])
def test_muon_takes_the_block_matrices_and_adamw_the_rest(options, capsys):
    model = GPT(modern_config(**options))
    opt = muon_optimizer(model)
    names = {id(p): n for n, p in model.named_parameters()}
    (muon_group,) = opt.muon.param_groups
    decay, no_decay = opt.adamw.param_groups
    want = [f'transformer.h.{i}.{m}' for i in range(2) for m in BLOCK_MATRICES]
    assert [names[id(p)] for p in muon_group['params']] == want
    # AdamW: the embeddings and an untied head decayed, the gains and biases not; every parameter exactly once
    embeddings = ['transformer.wte.weight'] + (['transformer.wpe.weight'] if 'pos' not in options else []) \
        + (['lm_head.weight'] if 'tie_embeddings' in options else [])
    assert sorted(names[id(p)] for p in decay['params']) == sorted(embeddings)
    assert all(p.dim() == 1 for p in no_decay['params'])
    assert (decay['weight_decay'], no_decay['weight_decay'], muon_group['weight_decay']) == (0.1, 0.0, 0.0)
    ids = [id(p) for g in opt.param_groups for p in g['params']]
    assert sorted(ids) == sorted(names) and len(ids) == len(set(ids))
    n_muon = sum(p.numel() for p in muon_group['params'])
    assert f"muon: 8 matrices with {n_muon:,} parameters" in capsys.readouterr().out


def test_muon_step_is_lr_times_the_float32_orthogonalised_gradient():
    """ The first step from zero momentum moves each Block matrix by muon_lr x sqrt(max(1, rows/cols)) x NS(grad),
    NS in float32 on the CPU (bfloat16's would differ by ~1%); the rest by AdamW at the schedule's rate. """
    from torch.optim._muon import EPS
    coefficients, steps = muon_coefficients()
    model = modern_model(**ALL_OPTIONS).train()
    opt = muon_optimizer(model, learning_rate=1e-3, muon_lr=0.02)
    wsd = LRSchedule(learning_rate=1e-3, warmup_iters=0, lr_decay_iters=1000, min_lr=1e-4,
                     lr_schedule='wsd')
    lr = set_learning_rate(opt, wsd.rate(100))  # the flat part: 1e-3
    assert lr == 1e-3 and opt.muon.param_groups[0]['lr'] == pytest.approx(0.02)
    idx = torch.randint(0, 50, (4, 16), generator=torch.Generator().manual_seed(0))
    model(idx, idx)[1].backward()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    after = dict(model.named_parameters())
    for i in range(2):
        for m in BLOCK_MATRICES:
            name = f'transformer.h.{i}.{m}'
            rows, cols = before[name].shape
            # Nesterov momentum from zero is a multiple of the gradient, which Newton-Schulz normalises away
            step = 0.02 * math.sqrt(max(1, rows / cols)) * newton_schulz_float32(grads[name], coefficients, steps, EPS)
            assert_close(before[name] - after[name].detach(), step, atol=1e-6, rtol=1e-4)
    # AdamW's first step at the schedule's rate: the update m / sqrt(v) is the gradient's sign, after the decay
    head = 'lm_head.weight'
    assert_close(before[head] - after[head].detach(), 1e-3 * 0.1 * before[head] + 1e-3 * grads[head].sign(),
                 atol=1e-6, rtol=1e-4)


def test_muon_state_dict_round_trip_and_refusals():
    model = modern_model(**ALL_OPTIONS).train()
    opt = muon_optimizer(model)
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    model(idx, idx)[1].backward()
    opt.step()
    state = opt.state_dict()
    assert set(state) == {'muon', 'adamw'}
    assert all(set(s) == {'momentum_buffer'} for s in state['muon']['state'].values())
    assert len(state['muon']['state']) == 8 and state['muon']['param_groups'][0]['lr_ratio'] == pytest.approx(20)
    fresh = muon_optimizer(modern_model(**ALL_OPTIONS))
    load_optimizer_state(fresh, state)
    for a, b in zip(fresh.muon.state.values(), opt.muon.state.values()):
        assert torch.equal(a['momentum_buffer'], b['momentum_buffer'])
    for a, b in zip(fresh.adamw.state.values(), opt.adamw.state.values()):
        assert torch.equal(a['exp_avg'], b['exp_avg']) and torch.equal(a['exp_avg_sq'], b['exp_avg_sq'])
    # an AdamW state into Muon, or a Muon state into AdamW: refused, not loaded into the wrong tensors
    adamw = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    with pytest.raises(ValueError, match="not a Muon"):
        fresh.load_state_dict(adamw.state_dict())
    for optimizer, wrong in ((fresh, adamw.state_dict()), (adamw, state)):
        with pytest.raises(UserError, match="not of this run's optimizer setting"):
            load_optimizer_state(optimizer, wrong)
