"""
The modern options of GPTConfig (rotary positions, RMSNorm, QK-norm, ReLU^2, a logit soft cap, an untied head),
optimizer='muon' and lr_schedule='wsd': each forward against a reference written out here from the state dict,
the defaults left as GPT-2's (and nanoGPT's model_args), the KV cache and the sampler with rotary positions,
Muon's float32 Newton-Schulz and its split of the parameters, a bitwise resume, the one-line refusals, and the
scripts (train, eval, sample, finetune, bench; DDP and FSDP) running with the options on.

Usage:
    python -m pytest tests/test_modern.py -q
"""
import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import re

import numpy as np
import pytest
import torch
from torch.nn import functional as F
from torch.testing import assert_close

import bench
import eval as eval_script
import finetune
import sample
import train
from configurator import Settings
from helpers import (
    COMPILE,
    REPO,
    iter_losses,
    run_python,
    run_script,
    save_test_checkpoint,
    train_args,
    train_one_and_two_ranks,
)
from model import GPT, MODERN, NANOGPT_MODEL_ARGS, GPTConfig, apply_rotary, rotary_tables
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.distributed import DistInfo, load_optimizer_state
from nanogpt_plus.engine import KVCache, generate, last_position_logits
from nanogpt_plus.errors import UserError
from nanogpt_plus.finetuning import FinetuneModel, make_batch, model_from_finetune_checkpoint
from nanogpt_plus.init_from import init_model, model_from_checkpoint
from nanogpt_plus.muon import MuonWithAdamW, float32_newton_schulz, newton_schulz_float32, orthogonalise
from nanogpt_plus.optimizer import AdamWSpec, LRSchedule, MuonSpec, make_optimizer, set_learning_rate
from nanogpt_plus.tokenizer import CharTokenizer
from nanogpt_plus.weight_formats import set_weights

# every option away from GPT-2's at once, for the models the tests build
ALL_OPTIONS = dict(pos='rope', norm='rmsnorm', qk_norm=True, mlp_act='relu2', logit_softcap=1.5,
                   tie_embeddings=False)
# the configurations whose forward is checked: GPT-2 itself, each option alone, all of them (with and without
# biases and with either GELU, though relu2 makes the GELU moot there)
FORWARD_CASES = {
    'gpt2': {},
    'rope': dict(pos='rope'),
    'rmsnorm': dict(norm='rmsnorm'),
    'qk_norm': dict(qk_norm=True),
    'relu2': dict(mlp_act='relu2'),
    'softcap': dict(logit_softcap=1.5),
    'untied': dict(tie_embeddings=False),
    'rope_tanh_gelu_qk_norm': dict(pos='rope', qk_norm=True, gelu='tanh'),
    'all': ALL_OPTIONS,
    'all_no_bias': dict(ALL_OPTIONS, bias=False),
}
# a model for the sampler tests: rotary positions with the options that act in the attention and the head
CACHE_OPTIONS = dict(pos='rope', qk_norm=True, logit_softcap=3.0, tie_embeddings=False)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def tiny_config(**options):
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50, dropout=0.0, bias=True)
    args.update(options)
    return GPTConfig(**args)


@torch.no_grad()
def randomized(model, seed=0):
    """
    The model with every parameter drawn afresh so that each option shows in the logits: O(1) activations and
    attention scores (GPT-2's N(0, 0.02) init makes every attention nearly uniform, which would hide a wrong
    rotation), gains away from 1 and biases away from 0 (a dropped one would change nothing otherwise).
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith('.bias'):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif p.dim() == 1:  # the norms' gains
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.size(1)))
    return model.eval()


def modern_model(seed=0, **options):
    torch.manual_seed(seed)
    return randomized(GPT(tiny_config(**options)), seed)


# -----------------------------------------------------------------------------
# the reference: GPT's forward written out from the state dict, in float64, for every option

def rotate_pairs(x):
    """
    Rotary positions by complex numbers: pair i of a head is x[i] + j x[i + hs/2], multiplied by e^(j p theta_i)
    at position p, theta_i = 10000^(-2i/hs). x: (B, nh, T, hs) at positions 0..T-1.
    """
    T = x.size(-2)
    hs = x.size(-1)
    half = hs // 2
    theta = 10000.0 ** (-2.0 * torch.arange(half, dtype=torch.float64) / hs)
    angle = torch.arange(T, dtype=torch.float64)[:, None] * theta[None, :]  # (T, hs/2)
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angle), angle)
    return torch.cat((z.real, z.imag), dim=-1)


def reference_logits(state_dict, cfg, idx):
    """
    The logits (B, T, V) of the tokens idx (B, T), computed from the state dict by the textbook formulas; cfg: a
    dict of GPTConfig's fields (a test may turn one option off to see that it matters).
    """
    p = {k: v.detach().double() for k, v in state_dict.items()}
    B, T = idx.shape
    C = cfg['n_embd']
    nh = cfg['n_head']
    hs = C // nh

    def norm(x, name):
        if cfg['norm'] == 'rmsnorm':  # x / rms(x) * gain: no mean, no bias
            return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * p[name + '.weight']
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + 1e-5) * p[name + '.weight'] + p.get(name + '.bias', 0.0)

    def linear(x, name):
        return x @ p[name + '.weight'].T + p.get(name + '.bias', 0.0)

    def heads(t):
        return t.view(B, T, nh, hs).transpose(1, 2)

    x = p['transformer.wte.weight'][idx]
    # (a rotary model has no wpe: its weights with pos='learned' are a model without positions)
    if cfg['pos'] == 'learned' and 'transformer.wpe.weight' in p:
        x = x + p['transformer.wpe.weight'][:T]
    causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
    for i in range(cfg['n_layer']):
        h = f'transformer.h.{i}.'
        q, k, v = map(heads, linear(norm(x, h + 'ln_1'), h + 'attn.c_attn').split(C, dim=-1))
        if cfg['qk_norm']:  # each head's query and key divided by its RMS, no gain
            q = q / torch.sqrt((q * q).mean(-1, keepdim=True) + 1e-5)
            k = k / torch.sqrt((k * k).mean(-1, keepdim=True) + 1e-5)
        if cfg['pos'] == 'rope':
            q = rotate_pairs(q)
            k = rotate_pairs(k)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        y = torch.softmax(scores.masked_fill(~causal, float('-inf')), dim=-1) @ v
        x = x + linear(y.transpose(1, 2).reshape(B, T, C), h + 'attn.c_proj')
        m = linear(norm(x, h + 'ln_2'), h + 'mlp.c_fc')
        if cfg['mlp_act'] == 'relu2':
            m = torch.clamp(m, min=0) ** 2
        elif cfg['gelu'] == 'tanh':
            m = 0.5 * m * (1 + torch.tanh(math.sqrt(2 / math.pi) * (m + 0.044715 * m ** 3)))
        else:
            m = 0.5 * m * (1 + torch.erf(m / math.sqrt(2)))
        x = x + linear(m, h + 'mlp.c_proj')
    x = norm(x, 'transformer.ln_f')
    # a tied head is the embedding matrix itself; an untied one is lm_head's own
    head = p['transformer.wte.weight'] if cfg['tie_embeddings'] else p['lm_head.weight']
    logits = x @ head.T
    cap = cfg['logit_softcap']
    return cap * torch.tanh(logits / cap) if cap else logits


@pytest.mark.parametrize('attention', ['manual', 'flash'])
@pytest.mark.parametrize('case', list(FORWARD_CASES))
def test_forward_matches_the_reference(case, attention):
    options = FORWARD_CASES[case]
    model = modern_model(**options)
    model.set_attention(attention)
    cfg = dataclasses.asdict(model.config)
    idx = torch.randint(0, 50, (3, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, _ = model(idx, all_positions=True)
    expected = reference_logits(model.state_dict(), cfg, idx)
    assert_close(logits.double(), expected, atol=1e-5, rtol=1e-5)
    # every option on changes the logits: the same weights with it back at GPT-2's value compute something else,
    # so the agreement above is not that of two computations that both ignore it
    for name in sorted(set(options) & set(MODERN)):
        without = reference_logits(model.state_dict(), dict(cfg, **{name: MODERN[name]}), idx)
        assert (expected - without).abs().max() > 1e-2, name
    if cfg['logit_softcap']:  # the cap bites: uncapped logits go well past it
        uncapped = reference_logits(model.state_dict(), dict(cfg, logit_softcap=0.0), idx)
        assert logits.abs().max() < cfg['logit_softcap'] < uncapped.abs().max() - 1.0


def test_rotary_turns_half_split_pairs_and_scores_see_relative_positions():
    hs = 8
    T = 12
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, T, hs, generator=g)
    cos, sin = rotary_tables(T, hs)
    assert cos.shape == sin.shape == (T, hs // 2) and cos.dtype == torch.float32
    turned = apply_rotary(x, cos, sin)
    assert_close(turned.double(), rotate_pairs(x.double()), atol=1e-5, rtol=1e-5)
    assert_close(turned[..., 0, :], x[..., 0, :])  # position 0: no turn
    assert_close(turned.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps lengths
    # q.k of a query at m and a key at n depends on m - n only: the same pair of vectors at shifted positions
    q = torch.randn(hs, generator=g)
    k = torch.randn(hs, generator=g)
    rows = q.expand(T, hs), k.expand(T, hs)
    # q and k at every position 0..T-1
    qs, ks = (apply_rotary(r[None, None], cos, sin)[0, 0] for r in rows)
    scores = qs @ ks.T  # scores[m, n]
    for shift in (1, 3, 7):
        assert_close(scores[shift:, shift:], scores[:-shift, :-shift], atol=1e-5, rtol=1e-5)
    assert (scores[0, 1:] - scores[0, 0]).abs().max() > 1e-2  # and it does depend on the difference


def test_each_option_has_the_parameters_it_should():
    plain = GPT(tiny_config())
    keys = list(plain.state_dict())
    assert 'transformer.wpe.weight' in keys and plain.rope_cos is None
    # rope: no position table; the cos/sin tables are buffers built from block_size, never saved
    rope = GPT(tiny_config(pos='rope'))
    assert list(rope.state_dict()) == [k for k in keys if k != 'transformer.wpe.weight']
    assert rope.rope_cos.shape == rope.rope_sin.shape == (16, 8)
    assert_close(rope.rope_cos, rotary_tables(16, 16)[0], rtol=0, atol=0)
    # rmsnorm: a gain, no bias, even in a model with biases elsewhere
    rms = GPT(tiny_config(norm='rmsnorm'))
    assert all(isinstance(m, torch.nn.RMSNorm) and m.eps == 1e-5 for n, m in rms.named_modules() if 'ln_' in n)
    assert list(rms.state_dict()) == [k for k in keys if not ('ln_' in k and k.endswith('.bias'))]
    # qk_norm, relu2 and the soft cap have no parameters
    for options in (dict(qk_norm=True), dict(mlp_act='relu2'), dict(logit_softcap=30.0)):
        assert list(GPT(tiny_config(**options)).state_dict()) == keys, options


def test_untied_head_is_a_matrix_of_its_own():
    model = modern_model(tie_embeddings=False)
    wte = model.transformer.wte.weight
    head = model.lm_head.weight
    assert wte is not head and not torch.equal(wte, head)
    assert sum(p is wte for p in model.parameters()) == 1 and sum(p is head for p in model.parameters()) == 1
    sd = model.state_dict()
    assert sd['transformer.wte.weight'].data_ptr() != sd['lm_head.weight'].data_ptr()
    # the figure for MFU leaves out the tables only looked up: wpe and, untied, wte (lm_head multiplies)
    total = sum(p.numel() for p in model.parameters())
    assert model.get_num_params(non_embedding=False) == total
    assert model.get_num_params() == total - wte.numel() - model.transformer.wpe.weight.numel()
    rope = GPT(tiny_config(pos='rope', tie_embeddings=False))
    assert rope.get_num_params() == sum(p.numel() for p in rope.parameters()) - 50 * 32
    tied = GPT(tiny_config(pos='rope'))
    # tied: wte is the head, it counts
    assert tied.get_num_params() == sum(p.numel() for p in tied.parameters())
    # each matrix gets its own gradient, and AdamW decays both
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    model(idx, idx)[1].backward()
    assert wte.grad.abs().sum() > 0 and head.grad.abs().sum() > 0 and not torch.equal(wte.grad, head.grad)
    decay, _ = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu').param_groups
    assert {id(wte), id(head)} <= {id(p) for p in decay['params']}


def test_untied_and_tied_checkpoints_load_as_they_were_saved(tmp_path):
    tok = {'kind': 'char', 'vocab_size': 50, 'stoi': {chr(200 + i): i for i in range(50)},
           'itos': {i: chr(200 + i) for i in range(50)}}
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    for options in (ALL_OPTIONS, dict(pos='rope')):
        model = modern_model(**options)
        path = save_test_checkpoint(model, tok, tmp_path / f"{len(options)}_options.pt")
        ckpt = load_checkpoint(path)
        assert ckpt['model_args'] == dict({k: getattr(model.config, k) for k in NANOGPT_MODEL_ARGS}, **options)
        loaded, _, _ = init_model(path)
        loaded.eval()
        tied = options.get('tie_embeddings', True)
        assert (loaded.lm_head.weight is loaded.transformer.wte.weight) == tied
        assert loaded.rope_cos.shape == (16, 8)  # rebuilt: no state dict holds it
        with torch.no_grad():
            assert_close(loaded(idx, idx)[0], model(idx, idx)[0], rtol=0, atol=0)


# -----------------------------------------------------------------------------
# the defaults stay GPT-2's, and nanoGPT's GPTConfig refuses what it can't compute

@dataclasses.dataclass
class NanoGPTConfig:
    """ nanoGPT's own GPTConfig (its model.py), field for field: what its sample.py builds from model_args. """
    block_size: int = 1024
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True


def test_defaults_are_gpt2_and_nanogpt_refuses_modern_model_args():
    default = GPTConfig()
    assert default.modern() == {}
    assert dataclasses.asdict(default).items() >= MODERN.items()
    assert set(default.model_args()) == set(NANOGPT_MODEL_ARGS) and len(default.model_args()) == 7
    NanoGPTConfig(**default.model_args())  # nanoGPT builds a default model's config
    for name, value in ALL_OPTIONS.items():
        config = tiny_config(**{name: value})
        assert config.modern() == {name: value}
        assert config.model_args() == dict({k: getattr(config, k) for k in NANOGPT_MODEL_ARGS}, **{name: value})
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            NanoGPTConfig(**config.model_args())
    everything = tiny_config(**ALL_OPTIONS)
    assert everything.modern() == ALL_OPTIONS and set(everything.model_args()) == set(NANOGPT_MODEL_ARGS) | set(MODERN)
    # an option at GPT-2's value is no option: nothing extra in model_args
    assert set(tiny_config(**MODERN).model_args()) == set(NANOGPT_MODEL_ARGS)


def test_bad_options_are_refused_by_the_config():
    for options, message in ((dict(pos='alibi'), "pos must be one of"), (dict(norm='batchnorm'), "norm must be one"),
                             (dict(mlp_act='swiglu'), "mlp_act must be one of"),
                             (dict(logit_softcap=-1.0), "logit_softcap must be 0"),
                             (dict(pos='rope', n_embd=30, n_head=2), "even head size, got n_embd / n_head = 15")):
        with pytest.raises(ValueError, match=message):
            tiny_config(**options)
    # an odd head size is fine without rotary positions
    tiny_config(pos='learned', n_embd=30, n_head=2)


# -----------------------------------------------------------------------------
# KV cache and sampling with rotary positions

def cache_model(attention='flash', seed=0):
    model = modern_model(seed, **CACHE_OPTIONS)
    model.set_attention(attention)
    return model


@pytest.mark.parametrize('attention', ['manual', 'flash'])
def test_kv_cache_matches_full_forwards(attention):
    """ Each cached step rotates its query and key by its own position: the logits of full forwards. """
    model = cache_model(attention)
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(idx, all_positions=True)[0]
        cache = KVCache(model.config.n_layer, 16)
        steps = [model(idx[:, :5], kv_cache=cache, all_positions=True)[0]]  # prefill 5
        # a chunk after the prefix
        steps.append(model(idx[:, 5:11], kv_cache=cache, all_positions=True)[0])
        for t in range(11, 16):  # then one token at a time
            steps.append(model(idx[:, t:t + 1], kv_cache=cache)[0])
    assert cache.pos == 16
    assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize('attention', ['manual', 'flash'])
@pytest.mark.parametrize('T', [1, 2, 9, 16])
def test_last_position_logits_equal_the_full_forward(attention, T):
    model = cache_model(attention)
    idx = torch.randint(0, 50, (3, T), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        assert_close(last_position_logits(model, idx), model(idx)[0], atol=1e-5, rtol=1e-5)


def reference_fast_greedy(model, idx, n):
    """ mode='fast' computed naively (as tests/test_engine.py): past the block, restart from its last half. """
    bs = model.config.block_size
    seq = idx[:, -bs:]
    out = idx
    with torch.no_grad():
        for _ in range(n):
            nxt = model(seq)[0][:, -1].argmax(dim=-1, keepdim=True)
            out = torch.cat((out, nxt), dim=1)
            seq = torch.cat((seq, nxt), dim=1)
            if seq.size(1) > bs:
                seq = seq[:, -(bs // 2):]
    return out


@pytest.mark.parametrize('attention', ['manual', 'flash'])
@pytest.mark.parametrize('mode', ['exact', 'fast'])
def test_cached_greedy_sampling_equals_full_forwards(attention, mode):
    model = cache_model(attention)
    idx = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(3))
    # 30 tokens after a 5-token prompt: inside the block first, then past it
    reference = model.generate(idx, 30, top_k=1) if mode == 'exact' else reference_fast_greedy(model, idx, 30)
    out = generate(model, idx, 30, temperature=0, mode=mode)
    assert torch.equal(out, reference)
    # sampled (not greedy) inside the block: the same draws as nanoGPT's uncached generate with the same seed
    torch.manual_seed(5)
    drawn = model.generate(idx[:1], 11, temperature=0.8, top_k=10)
    assert torch.equal(generate(model, idx[:1], 11, temperature=0.8, top_k=10,
                                generator=torch.Generator().manual_seed(5)), drawn)


def test_crop_block_size_keeps_the_rotary_positions():
    model = modern_model(**dict(ALL_OPTIONS, logit_softcap=0.0))
    idx = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        before = model(idx, idx)[0]
    cos = model.rope_cos.clone()
    model.crop_block_size(8)
    assert model.config.block_size == 8 and model.rope_cos.shape == (8, 8)
    assert torch.equal(model.rope_cos, cos[:8])
    assert all(block.attn.bias.shape == (1, 1, 8, 8) for block in model.transformer.h)
    for path in ('flash', 'manual'):
        model.set_attention(path)
        with torch.no_grad():
            assert_close(model(idx, idx)[0], before, atol=1e-5, rtol=1e-5)
    model.init_buffers()  # rebuilt for the new block size: the same tables
    assert_close(model.rope_cos, cos[:8], rtol=0, atol=0)
    with pytest.raises(ValueError, match="block size"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_resize_token_embeddings_grows_both_untied_matrices():
    model = modern_model(**ALL_OPTIONS)
    wte = model.transformer.wte.weight.detach().clone()
    head = model.lm_head.weight.detach().clone()
    model.resize_token_embeddings(53)
    new_wte = model.transformer.wte.weight
    new_head = model.lm_head.weight
    assert new_wte is not new_head and new_wte.shape == new_head.shape == (53, 32)
    # an optimizer built now trains them
    assert {id(new_wte), id(new_head)} <= {id(p) for p in model.parameters()}
    assert torch.equal(new_wte[:50].detach(), wte) and torch.equal(new_head[:50].detach(), head)
    # new rows: GPT-2's N(0, 0.02), not copies of each other
    for rows in (new_wte[50:], new_head[50:]):
        assert 0 < rows.detach().std() < 0.1
    assert not torch.equal(new_wte[50:], new_head[50:])
    assert model.config.vocab_size == 53 and model.lm_head.out_features == 53
    idx = torch.tensor([[1, 52, 51, 3]])
    logits, loss = model(idx, idx)
    assert logits.shape == (1, 4, 53)
    loss.backward()
    assert new_wte.grad[52].abs().sum() > 0 and new_head.grad[52].abs().sum() > 0
    tied = GPT(tiny_config(pos='rope'))
    tied.resize_token_embeddings(53)
    assert tied.transformer.wte.weight is tied.lm_head.weight


@pytest.mark.parametrize('weights', ['bfloat16', 'int8'])
def test_weight_formats_keep_an_untied_embedding(weights):
    """ sample.py's rounded weight formats: an untied embedding stays itself (a tied one reads the rounded head). """
    model = cache_model()
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        expected = model(idx, all_positions=True)[0]
        wte = model.transformer.wte
        set_weights(model, weights)
        assert model.transformer.wte is wte and type(model.lm_head).__name__ != 'Linear'
        rounded = model(idx, all_positions=True)[0]
    # the rounding moves the logits by ~1-2%; an embedding read from the head's matrix would by ~100%
    assert (rounded - expected).norm() / expected.norm() < 0.1


# -----------------------------------------------------------------------------
# Muon, and the learning-rate schedules

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


def test_muon_batched_step_is_pytorchs_step():
    """ Three CPU steps of MuonWithAdamW (batched orthogonalisation) against PyTorch's own loop (float32 NS):
    the same weights within float32 rounding, and the same state, under PyTorch's keys. """
    models = [modern_model(**ALL_OPTIONS).train() for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [muon_optimizer(m) for m in models]
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


def muon_optimizer(model, learning_rate=1e-3, muon_lr=0.02):
    """ What train.py builds for optimizer='muon' on the CPU (make_optimizer). """
    adamw = AdamWSpec(learning_rate=learning_rate, weight_decay=0.1, beta1=0.9, beta2=0.95)
    muon = MuonSpec(muon_lr=muon_lr, muon_momentum=0.95, muon_weight_decay=0.0)
    opt = make_optimizer(model, adamw, 'cpu', muon=muon)
    assert isinstance(opt, MuonWithAdamW) and opt.float32_ns
    return opt


@pytest.mark.parametrize('options', [{}, ALL_OPTIONS], ids=['gpt2', 'all'])
def test_muon_takes_the_block_matrices_and_adamw_the_rest(options, capsys):
    model = GPT(tiny_config(**options))
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


def test_set_learning_rate_scales_muon_and_gives_adamw_the_schedule():
    model = GPT(tiny_config(pos='rope'))
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


# -----------------------------------------------------------------------------
# train.py with the options: a bitwise resume, the refusals, and the other scripts on its checkpoint

# train.py's settings for a model with every option and Muon; the soft cap at modded-nanogpt's 15
MODERN_RUN = dict(pos='rope', norm='rmsnorm', qk_norm=True, mlp_act='relu2', logit_softcap=15.0,
                  tie_embeddings=False, optimizer='muon', lr_schedule='wsd', cooldown_frac=0.5)
ARCHITECTURE_OPTIONS = {k: v for k, v in MODERN_RUN.items() if k in MODERN}
# fixed threads: bitwise runs (as tests/test_train.py)
modern_args = functools.partial(train_args, num_threads=1, **MODERN_RUN)


def run_train(args):
    """ train.main(args) in this process; returns what it printed. """
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train.main(args)
    return out.getvalue()


@pytest.fixture(scope='module')
def modern_ckpt(tiny_dataset, tmp_path_factory):
    """ The out_dir of a short train.py run with every option and Muon on the tiny dataset (24 iterations, which
    learn its repeating pattern), for the tests that read a modern checkpoint. """
    out_dir = tmp_path_factory.mktemp('modern')
    run_train(modern_args(tiny_dataset, out_dir, max_iters=24, lr_decay_iters=24, eval_interval=24))
    return out_dir


def test_resume_with_muon_and_the_options_is_bitwise(dataset, tmp_path):
    full = run_train(modern_args(dataset, tmp_path / 'full', dropout=0.1))
    part1 = run_train(modern_args(dataset, tmp_path / 'split', dropout=0.1, max_iters=6))
    # resumed without the architecture options or the optimizer: both are the checkpoint's
    resume = train_args(dataset, tmp_path / 'split', dropout=0.1, num_threads=1, init_from='resume',
                        lr_schedule='wsd', cooldown_frac=0.5)
    part2 = run_train(resume)
    assert min(iter_losses(part2)) == 7
    assert {**iter_losses(part1), **iter_losses(part2)} == iter_losses(full)
    a, b = (load_checkpoint(str(tmp_path / d / 'ckpt.pt')) for d in ('full', 'split'))
    assert a['iter_num'] == b['iter_num'] == 13
    assert b['config']['optimizer'] == 'muon' and a['model_args'] == b['model_args']
    assert a['model_args'].items() >= ARCHITECTURE_OPTIONS.items()
    assert 'transformer.wpe.weight' not in a['model']
    assert a['model'].keys() == b['model'].keys()
    for k in a['model']:
        assert torch.equal(a['model'][k], b['model'][k]), k
    # the optimizers' states, bitwise: Muon's momentum buffers, AdamW's moments and step counts
    assert set(a['optimizer']) == {'muon', 'adamw'}
    for part, keys in (('muon', {'momentum_buffer'}), ('adamw', {'exp_avg', 'exp_avg_sq', 'step'})):
        sa = a['optimizer'][part]['state']
        sb = b['optimizer'][part]['state']
        assert sa.keys() == sb.keys() and len(sa) == (8 if part == 'muon' else len(a['model']) - 8)
        for i in sa:
            assert set(sa[i]) == keys
            for key in keys:
                assert torch.equal(sa[i][key], sb[i][key]), (part, i, key)
        assert a['optimizer'][part]['param_groups'] == b['optimizer'][part]['param_groups']


def run_cli(script, *args):
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return run_python([script, *args], timeout=120,
                          env=env)


def refusal_args(case, out_dir, dataset):
    """ (script, arguments, what the one line says) of each refusal. """
    # a tiny run that would finish in seconds, not a GPT-2 124M, were a refusal to go missing
    tiny = train_args(dataset, f'{out_dir}/new', max_iters=0, eval_iters=1, num_threads=1)
    resume = train_args(dataset, out_dir, init_from='resume', max_iters=40, eval_iters=1, num_threads=1)
    return {
        'muon_fsdp': ('train.py', tiny + ['--optimizer=muon', '--parallelism=fsdp'],
                      "optimizer='muon' orthogonalises whole matrices, which FSDP splits over the ranks"),
        'resume_other_optimizer': ('train.py', resume + ['--optimizer=adamw'],
                                   f"--optimizer=adamw but the run in {out_dir}/ckpt.pt was trained with "
                                   f"optimizer=muon"),
        'resume_other_pos': ('train.py', resume + ['--pos=learned'],
                             f"--pos='learned' but the checkpoint {out_dir}/ckpt.pt has pos='rope'"),
        'rope_odd_head_size': ('train.py', tiny + ['--pos=rope', '--n_embd=30', '--n_head=2'],
                               "pos='rope' turns pairs of each head's 15 dimensions, an odd number"),
    }[case]


@pytest.mark.parametrize('case', ['muon_fsdp', 'resume_other_optimizer', 'resume_other_pos',
                                  'rope_odd_head_size'])
def test_refusals_are_one_line(case, modern_ckpt, tiny_dataset):
    script, args, message = refusal_args(case, modern_ckpt, tiny_dataset)
    before = (modern_ckpt / 'ckpt.pt').read_bytes()
    r = run_cli(script, *args)
    assert r.returncode == 2, r.stderr[-3000:]
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and r.stderr.startswith(f"error: {message}"), r.stderr
    assert (modern_ckpt / 'ckpt.pt').read_bytes() == before  # nothing written over the run
    assert not os.path.exists(modern_ckpt / 'new')


def test_a_modern_run_exports_to_transformers_and_samples_from_there(modern_ckpt, tmp_path):
    """ export_hf.py on the run with every option: transformers computes its logits (our code, trust_remote_code),
    and sample.py samples from the export as from the checkpoint. """
    from transformers import AutoModelForCausalLM
    hf_dir = str(tmp_path / 'hf')
    r = run_cli('export_hf.py', f'--out_dir={modern_ckpt}', f'--hf_dir={hf_dir}')
    assert r.returncode == 0, r.stderr[-3000:]
    assert {'model.py', 'modeling_nanogpt.py', 'config.json', 'model.safetensors'} <= set(os.listdir(hf_dir))
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True).eval()
    model, _, _ = init_model(str(modern_ckpt))
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_close(hf(idx).logits, model.eval()(idx, all_positions=True)[0], rtol=1e-5, atol=1e-5)
    samples = [run_cli('sample.py', f'--init_from={source}', '--num_samples=1', '--max_new_tokens=20', '--seed=3',
                       '--device=cpu', '--start=ab') for source in (str(modern_ckpt), hf_dir)]
    assert all(s.returncode == 0 for s in samples), samples[1].stderr[-2000:]
    # the same text: the same weights, tokenizer and sampler
    texts = [s.stdout[s.stdout.index('number of parameters'):] for s in samples]
    assert texts[0] == texts[1] and len(texts[0]) > 20


def test_eval_loss_on_a_modern_checkpoint(modern_ckpt, tiny_dataset, monkeypatch, capsys):
    run_script(eval_script, monkeypatch, f'--out_dir={modern_ckpt}', '--task=loss', '--device=cpu')
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # by hand: the mean cross-entropy of every val token after the first, in non-overlapping 16-token windows
    model, _, _ = init_model(str(modern_ckpt))
    model.eval()
    ids = torch.from_numpy(np.fromfile(os.path.join(tiny_dataset, 'val.bin'), dtype=np.uint16).astype(np.int64))
    total = 0.0
    with torch.no_grad():
        for s in range(0, len(ids) - 1, 16):
            x = ids[s:min(s + 16, len(ids) - 1)]
            logits = model(x[None], all_positions=True)[0][0].double()
            total += F.cross_entropy(logits, ids[s + 1:s + 1 + len(x)], reduction='sum').item()
    assert result['metrics']['tokens'] == len(ids) - 1
    assert result['metrics']['loss'] == pytest.approx(total / (len(ids) - 1), rel=1e-5)
    assert result['metrics']['loss'] < 1.5  # the run learnt the pattern (uniform: ln 20 = 3.0)


@pytest.mark.parametrize('mode', ['exact', 'fast'])
def test_sample_from_a_modern_checkpoint(mode, modern_ckpt, monkeypatch, capsys):
    """ sample.py (packed float32 weights, KV cache) continues the prompt as the model's own full forwards do. """
    run_script(sample, monkeypatch, f'--out_dir={modern_ckpt}', '--device=cpu', '--num_samples=1',
               '--max_new_tokens=30', '--temperature=0', '--start=abc', f'--mode={mode}')
    text = capsys.readouterr().out.split(sample.SEPARATOR)[0]
    model, meta, _ = init_model(str(modern_ckpt))
    model.eval()
    tok = CharTokenizer(meta['stoi'])
    prompt = torch.tensor([tok.encode('abc')])
    reference = model.generate(prompt, 30, top_k=1) if mode == 'exact' else reference_fast_greedy(model, prompt, 30)
    assert text.endswith(tok.decode(reference[0].tolist()) + '\n'), text
    # the run learnt the dataset's repeating pattern, so the greedy choices are clear ones (no near-ties that
    # another CPU's rounding could flip)
    assert tok.decode(reference[0].tolist()) == ('abcdefghijklmnopqrst' * 2)[:33]


def test_finetune_from_a_rope_untied_checkpoint(tmp_path):
    """ finetune.py adds its special tokens to both untied matrices and trains through the rotary model; its LM
    loss is that of the soft-capped head. """
    letters = 'abcdefghijklmnopqrstuvwxyz '
    tok = CharTokenizer.from_text(letters)
    torch.manual_seed(0)
    # random weights with O(1) logits, which the soft cap of 1.5 bends visibly
    gpt = randomized(GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=32, vocab_size=tok.vocab_size,
                                   bias=False, **ALL_OPTIONS)))
    src = save_test_checkpoint(gpt, tok.meta(), tmp_path / 'src.pt')
    rows = [{'text': f"{w} {'xyz' if i % 2 else 'wvu'}", 'label': ['pos', 'neg'][i % 2]}
            for i, w in enumerate(['ab', 'cde', 'fg', 'hij', 'kl', 'mno', 'pq', 'rst'] * 4)]
    for split, part in (('train', rows), ('val', rows[:8])):
        (tmp_path / f'{split}.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in part))
    cfg = Settings(dict(finetune.DEFAULTS, task='classification', init_from=src, out_dir=str(tmp_path / 'out'),
               train_file=str(tmp_path / 'train.jsonl'), val_file=str(tmp_path / 'val.jsonl'), device='cpu',
               dropout=0.0, batch_size=8, epochs=1, learning_rate=1e-3, log_interval=1000))
    res = finetune.finetune(cfg, DistInfo(False, 0, 0, 1, 'cpu'))
    assert res['steps'] == 4 and res['epochs'] == 1 and 0 <= res['val_acc'] <= 1
    ckpt = load_checkpoint(str(tmp_path / 'out' / 'ckpt.pt'))
    assert ckpt['model_args']['vocab_size'] == tok.vocab_size + 3
    assert ckpt['model_args'].items() >= ALL_OPTIONS.items()
    tuned = model_from_finetune_checkpoint(ckpt).eval()
    wte = tuned.gpt.transformer.wte.weight
    head = tuned.gpt.lm_head.weight
    assert wte is not head and wte.shape == head.shape == (tok.vocab_size + 3, 32)
    assert not torch.equal(wte[-3:], head[-3:])  # each matrix grew rows of its own
    name = 'transformer.h.0.attn.c_attn.weight'
    # the fine-tune trained it
    assert not torch.equal(tuned.gpt.state_dict()[name], gpt.state_dict()[name])
    # the auxiliary LM loss goes through GPT.head (the soft cap), as the language model's own loss does
    special = ckpt['special_tokens']
    seq = [special['start'], *tok.encode('ab xyz'), special['extract']]
    batch = make_batch([[seq]], [0], special, 'cpu')
    model = FinetuneModel(tuned.gpt, tuned.head, 'classification').eval()
    with torch.no_grad():
        _, lm_sum = model(batch['idx'], batch['extract_pos'], batch['choice_mask'], batch['lm_targets'])
        logits = tuned.gpt(torch.tensor([seq]), all_positions=True)[0][0]
    targets = batch['lm_targets'][0]
    expected = F.cross_entropy(logits[targets >= 0], targets[targets >= 0], reduction='sum')
    assert lm_sum.item() == pytest.approx(expected.item(), rel=1e-5)


def test_bench_with_an_untied_rotary_model_counts_its_flops(capsys, monkeypatch):
    peak = 1e10
    monkeypatch.setenv('NANOGPT_PEAK_FLOPS', str(peak))
    bench.main(['--device=cpu', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=4',
                '--burnin=1', '--steps=3', '--num_threads=1', '--real_data=False', '--pos=rope',
                '--tie_embeddings=False', '--optimizer=muon'])
    out = capsys.readouterr().out
    assert "muon: 8 matrices" in out and "'pos': 'rope'" in out and "'tie_embeddings': False" in out
    m = re.search(r"^time per iteration: ([\d.]+)ms, MFU: ([\d.]+)%$", out, re.M)
    dt = float(m.group(1)) / 1000
    mfu = float(m.group(2)) / 100
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50304, bias=False, pos='rope',
                          tie_embeddings=False))
    N = model.get_num_params()
    # wte, only looked up, left out
    assert N == sum(p.numel() for p in model.parameters()) - 50304 * 32
    flops_per_iter = (6 * N + 12 * 2 * 2 * 16 * 16) * 16 * 4  # PaLM's estimate, batch 4 x 16 tokens
    assert mfu == pytest.approx(flops_per_iter / dt / peak, rel=0.02)


# -----------------------------------------------------------------------------
# 2 gloo processes on the CPU: DDP with Muon, FSDP with the options

def test_ddp_with_muon_and_the_options_equals_one_process(dataset, tmp_path):
    args = modern_args(dataset, tmp_path, gradient_accumulation_steps=4, max_iters=3, eval_interval=3,
                       lr_decay_iters=3, dropout=0.0)
    one, two = train_one_and_two_ranks(args, tmp_path, steps=4)
    assert "muon: 8 matrices" in two.stdout
    a, b = (load_checkpoint(str(tmp_path / d / 'ckpt.pt')) for d in ('one', 'two'))
    assert set(b['optimizer']) == {'muon', 'adamw'} and b['model_args'] == a['model_args']
    for k in a['model']:
        # the ranks sum in another order
        assert_close(a['model'][k], b['model'][k], atol=3e-4, rtol=1e-3)


def test_fsdp_with_the_options_equals_one_process(dataset, tmp_path):
    args = train_args(dataset, tmp_path, gradient_accumulation_steps=4, max_iters=3, eval_interval=3,
                      lr_decay_iters=3, dropout=0.0, num_threads=1, parallelism='fsdp', pos='rope', norm='rmsnorm',
                      tie_embeddings=False)
    one, two = train_one_and_two_ranks(args, tmp_path, steps=4)
    assert "fsdp: this rank holds" in two.stdout
    a, b = (load_checkpoint(str(tmp_path / d / 'ckpt.pt')) for d in ('one', 'two'))
    model = model_from_checkpoint(b)  # the gathered checkpoint loads strictly: two matrices, no wpe
    assert model.lm_head.weight is not model.transformer.wte.weight and model.config.pos == 'rope'
    assert b['model'].keys() == a['model'].keys()
    for k in a['model']:
        assert_close(a['model'][k], b['model'][k], atol=3e-4, rtol=1e-3)


def test_compile_on_cpu_with_the_options(dataset, tmp_path):
    """ torch.compile of a model with every option (and Muon): the same losses as the eager run, to float32 noise. """
    pytest.importorskip("torch._inductor")
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        pytest.skip("torch.compile's CPU code does not build under ATEN_CPU_CAPABILITY=default (see test_train.py)")
    settings = dict(max_iters=3, eval_interval=3, lr_decay_iters=3, dropout=0.0)
    eager = iter_losses(run_train(modern_args(dataset, tmp_path / 'eager', **settings)))
    out = run_train(modern_args(dataset, tmp_path / 'compiled', **COMPILE, **settings))
    assert "compiling the model" in out
    compiled = iter_losses(out)
    assert compiled.keys() == eager.keys() and len(eager) == 4
    # inductor fuses the rotary, norm and activation arithmetic differently: equal to ~1e-5, not bitwise
    assert all(abs(compiled[i] - eager[i]) < 1e-3 for i in eager), (eager, compiled)
    assert not any('_orig_mod' in k for k in load_checkpoint(str(tmp_path / 'compiled' / 'ckpt.pt'))['model'])


def test_bench_recipes_profiles_the_step_part_by_part(monkeypatch, capsys):
    """ scripts/bench_recipes.py --mode=muon: every part of the laptop model's step, each a positive time. """
    monkeypatch.syspath_prepend(os.path.join(REPO, 'scripts'))
    import bench_recipes
    bench_recipes.main(['--mode=muon', '--profile_steps=3', '--num_threads=1'])
    rows = dict(re.findall(r'^(\S.*?|  \S.*?)\s+(\d+\.\d)$', capsys.readouterr().out, re.M))
    parts = ['forward+backward', '  with pos=rope', '  with qk_norm=True', '  with both (the fast recipe)',
             'adamw step', 'muon step', '  of which Newton-Schulz, 16 matrices batched',
             '  the same without the Gram-matrix steps', 'muon step, one matrix at a time (before)',
             '  of which Newton-Schulz, 16 matrices one by one']
    assert list(rows) == parts and all(float(v) > 0 for v in rows.values())


def test_bench_recipes_whole_runs_give_the_ratio_of_each_rounds_pair(monkeypatch, capsys):
    """ --mode=bpe / fineweb: the wall-time ratio is the median of each round's pair, not of separate medians
    (with a machine that slows down in round 2, those would give 0.4x here instead of 0.35x). """
    monkeypatch.syspath_prepend(os.path.join(REPO, 'scripts'))
    import bench_recipes
    runs = iter([(5.6, 100.0, 601), (5.5, 30.0, 166), (5.6, 200.0, 601), (5.5, 70.0, 166),
                 (5.6, 100.0, 601), (5.5, 40.0, 166)])
    calls = []

    def whole_run(work, name, config, args, num_threads):
        calls.append(name)
        return next(runs)
    monkeypatch.setattr(bench_recipes, 'whole_run', whole_run)
    bench_recipes.compare_whole('work', Settings({'rounds': 3, 'num_threads': 1}),
                                {'nanogpt': ('a.py', []), 'fast': ('b.py', [])})
    out = capsys.readouterr().out
    assert calls == ['nanogpt_0', 'fast_0', 'nanogpt_1', 'fast_1', 'nanogpt_2', 'fast_2']
    assert "wall-time ratio per round: 0.300, 0.350, 0.400" in out
    assert "the fast recipe reaches nanoGPT's final val loss (5.5000 vs 5.6000) in 0.350x its wall time and " \
           "0.276x its steps" in out
