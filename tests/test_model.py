"""
model.py: parity with transformers' GPT2LMHeadModel, the two attention paths (with and without a KV cache), weight
tying, parameter counts, block-size surgery, init, optimizer groups, MFU, activation checkpointing; the modern
options of GPTConfig (rotary positions, RMSNorm, QK-norm, ReLU^2, a logit soft cap, an untied head), each forward
against a reference written out here from the state dict, the defaults left as GPT-2's (and nanoGPT's model_args),
the KV cache and the sampler with rotary positions; and train.py with the options and Muon: a bitwise resume, the
one-line refusals, and the scripts (eval, sample, finetune, bench, export; DDP, FSDP, compile) on its checkpoint.
"""
import contextlib
import copy
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
    ALL_OPTIONS,
    COMPILE,
    iter_losses,
    modern_config,
    modern_model,
    randomized,
    run_python,
    run_script,
    save_test_checkpoint,
    train_args,
    train_one_and_two_ranks,
)
from model import GPT, MODERN, NANOGPT_MODEL_ARGS, GPTConfig, apply_rotary, fused_adamw_available, rotary_tables
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.distributed import DistInfo
from nanogpt_plus.engine import KVCache, generate, last_position_logits
from nanogpt_plus.finetuning import FinetuneModel, make_batch, model_from_finetune_checkpoint
from nanogpt_plus.init_from import init_model, model_from_checkpoint
from nanogpt_plus.tokenizer import CharTokenizer
from nanogpt_plus.weight_formats import set_weights


def tiny_config(**kw):
    args = dict(n_layer=2, n_head=4, n_embd=64, block_size=64, vocab_size=101, dropout=0.0, bias=True)
    args.update(kw)
    return GPTConfig(**args)


def make_hf(tmp_path, activation_function='gelu_new', vocab_size=101):
    """ A small random transformers GPT-2, saved to tmp_path/hf, returned in eval mode with its dir. """
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=64, n_positions=64, vocab_size=vocab_size,
                     activation_function=activation_function,
                     bos_token_id=vocab_size - 1, eos_token_id=vocab_size - 1)
    hf = GPT2LMHeadModel(cfg)
    # HF initialises biases and LayerNorms to 0/1; randomise everything so a swapped or untransposed
    # tensor can't hide behind a constant
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
    d = tmp_path / "hf"
    hf.save_pretrained(d)
    return hf.eval(), str(d)


class TinyKVCache:
    """ The smallest object implementing the model's KV-cache protocol: .pos, .update, .advance. """

    def __init__(self, n_layer):
        self.k = [None] * n_layer
        self.v = [None] * n_layer
        self.pos = 0

    def update(self, layer_idx, k, v):
        if self.k[layer_idx] is None:
            self.k[layer_idx] = k
            self.v[layer_idx] = v
        else:
            # the model promises to write at pos..pos+T, i.e. right after what is cached for this layer
            assert self.k[layer_idx].size(2) == self.pos
            self.k[layer_idx] = torch.cat([self.k[layer_idx], k], dim=2)
            self.v[layer_idx] = torch.cat([self.v[layer_idx], v], dim=2)
        return self.k[layer_idx], self.v[layer_idx]

    def advance(self, T):
        self.pos += T


# -----------------------------------------------------------------------------
# parity with transformers

@pytest.mark.parametrize("activation, gelu", [('gelu_new', 'tanh'), ('gelu', 'none')])
def test_hf_parity_logits_loss(tmp_path, activation, gelu):
    hf, d = make_hf(tmp_path, activation)
    model = GPT.from_pretrained(d).eval()
    assert model.config.gelu == gelu
    assert (model.config.n_layer, model.config.n_head, model.config.n_embd,
            model.config.block_size, model.config.vocab_size) == (2, 4, 64, 64, 101)
    torch.manual_seed(1)
    idx = torch.randint(0, 101, (3, 17))
    targets = torch.randint(0, 101, (3, 17))
    with torch.no_grad():
        logits, loss = model(idx, targets)
        out = hf(idx)
        ref_logits = out.logits
        ref_loss = torch.nn.functional.cross_entropy(ref_logits.view(-1, 101), targets.view(-1))
        last, no_loss = model(idx)
    assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    # HF's own shifted loss equals ours when our targets are the shifted inputs
    with torch.no_grad():
        _, shifted_loss = model(idx[:, :-1], idx[:, 1:])
        hf_loss = hf(idx, labels=idx).loss
    assert_close(shifted_loss, hf_loss, atol=1e-5, rtol=1e-5)
    # without targets: only the last position, time dim kept
    assert no_loss is None
    assert last.shape == (3, 1, 101)
    assert_close(last, ref_logits[:, [-1], :], atol=1e-5, rtol=1e-5)


def test_hf_parity_greedy_generate(tmp_path):
    hf, d = make_hf(tmp_path)
    model = GPT.from_pretrained(d).eval()
    idx = torch.tensor([[5, 17, 42, 3, 99]])
    ours = model.generate(idx, max_new_tokens=20, top_k=1)
    theirs = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=20, min_new_tokens=20,
                         do_sample=False, pad_token_id=0)
    assert ours.shape == (1, 25)
    assert torch.equal(ours, theirs)


def test_from_pretrained_overrides(tmp_path):
    _, d = make_hf(tmp_path)
    model = GPT.from_pretrained(d, override_args={'dropout': 0.1})
    assert model.config.dropout == 0.1
    assert model.transformer.h[0].attn.attn_dropout.p == 0.1
    with pytest.raises(ValueError, match="dropout"):
        GPT.from_pretrained(d, override_args={'n_layer': 3})
    with pytest.raises(ValueError, match="unknown model"):
        GPT.from_pretrained('gpt3-davinci')


def test_from_pretrained_hub_offline_points_to_local_dir(monkeypatch, tmp_path):
    # conftest sets HF_HUB_OFFLINE=1; an empty hub cache (read by huggingface_hub at call time) makes sure
    # a copy cached on this machine can't satisfy the name
    import huggingface_hub.constants
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    with pytest.raises(OSError) as e:
        GPT.from_pretrained('gpt2-xl')
    msg = str(e.value)
    assert "local directory" in msg and "init_from=DIR" in msg
    # a local path that isn't a HF model is reported as such
    (tmp_path / "not_a_model").mkdir()
    with pytest.raises(OSError, match="could not load"):
        GPT.from_pretrained(str(tmp_path / "not_a_model"))


# -----------------------------------------------------------------------------
# attention paths and the KV cache

def _both_paths(model):
    for path in ('flash', 'manual'):
        model.set_attention(path)
        assert all(block.attn.flash is (path == 'flash') for block in model.transformer.h)
        yield path


def _count_sdpa_calls(monkeypatch):
    """ Count the calls of F.scaled_dot_product_attention made by model.py from now on. """
    import model as model_module
    calls = []
    real = F.scaled_dot_product_attention

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(model_module.F, 'scaled_dot_product_attention', counting)
    return calls


def test_flash_matches_manual(monkeypatch):
    torch.manual_seed(0)
    model = GPT(tiny_config())
    idx = torch.randint(0, 101, (2, 40))
    targets = torch.randint(0, 101, (2, 40))
    calls = _count_sdpa_calls(monkeypatch)
    for mode in ('eval', 'train'):  # dropout=0, so train mode must agree too (and its grads)
        getattr(model, mode)()
        res = {}
        for path in _both_paths(model):
            model.zero_grad()
            before = len(calls)
            logits, loss = model(idx, targets)
            loss.backward()
            # the two paths are really two computations: only flash calls the fused kernel, once per layer
            assert len(calls) - before == (model.config.n_layer if path == 'flash' else 0)
            res[path] = (logits.detach(), loss.detach(), model.lm_head.weight.grad.clone())
        for a, b in zip(res['flash'], res['manual']):
            assert_close(a, b, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError):
        model.set_attention('xformers')


@pytest.mark.parametrize("path", ['flash', 'manual'])
def test_kv_cache_matches_full_forward(path):
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    model.set_attention(path)
    idx = torch.randint(0, 101, (2, 20))
    with torch.no_grad():
        full = model.hidden_states(idx)  # (B, T, C) without a cache
        full_last, _ = model(idx)

        # prefill 8 tokens, then decode the rest one by one
        cache = TinyKVCache(model.config.n_layer)
        model(idx[:, :8], kv_cache=cache)
        assert cache.pos == 8
        for t in range(8, 20):
            last, _ = model(idx[:, t:t + 1], kv_cache=cache)
        assert cache.pos == 20
        assert_close(last, full_last, atol=1e-5, rtol=1e-5)

        # prefill 5, then a 6-token chunk: each chunk position must see the whole prefix and the chunk
        # positions up to itself (bottom-right aligned causal mask); checked at every position
        cache = TinyKVCache(model.config.n_layer)
        h0 = model.hidden_states(idx[:, :5], kv_cache=cache)
        h1 = model.hidden_states(idx[:, 5:11], kv_cache=cache)
        h2 = model.hidden_states(idx[:, 11:12], kv_cache=cache)
        assert_close(torch.cat([h0, h1, h2], dim=1), full[:, :12], atol=1e-5, rtol=1e-5)

        # the cache counts toward the block size
        cache = TinyKVCache(model.config.n_layer)
        model(torch.zeros(1, 60, dtype=torch.long), kv_cache=cache)
        with pytest.raises(ValueError, match="block size"):
            model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)


# -----------------------------------------------------------------------------
# weight tying and vocabulary growth

def test_weight_tying_and_resize():
    torch.manual_seed(0)
    model = GPT(tiny_config())
    wte = model.transformer.wte.weight
    head = model.lm_head.weight
    assert wte is head
    # one tensor for parameters() (so the optimizer updates it once), two names sharing it in the state_dict
    assert sum(p is wte for p in model.parameters()) == 1
    sd = model.state_dict()
    assert sd['lm_head.weight'].data_ptr() == sd['transformer.wte.weight'].data_ptr()
    # its gradient is the sum of what the embedding and the head would get as separate matrices
    untied = copy.deepcopy(model)
    untied.lm_head.weight = torch.nn.Parameter(wte.detach().clone())
    idx = torch.tensor([[1, 5, 9, 5, 100]])
    for m in (model, untied):
        m.zero_grad()
        m(idx, idx)[1].backward()
    assert untied.transformer.wte.weight.grad.abs().sum() > 0 and untied.lm_head.weight.grad.abs().sum() > 0
    assert_close(wte.grad, untied.transformer.wte.weight.grad + untied.lm_head.weight.grad, atol=1e-7, rtol=1e-5)
    model.zero_grad(set_to_none=True)

    old = wte.detach().clone()
    model.resize_token_embeddings(110)
    wte = model.transformer.wte.weight
    head = model.lm_head.weight
    assert wte is head
    assert model.transformer.wte.num_embeddings == 110 and model.lm_head.out_features == 110
    assert wte.shape == (110, 64)
    assert model.config.vocab_size == 110
    assert_close(wte[:101].detach(), old, atol=0, rtol=0)  # old rows untouched
    new_rows = wte[101:].detach()
    assert torch.isfinite(new_rows).all() and new_rows.abs().sum() > 0 and new_rows.std() < 0.1
    # new ids embed and the logits cover the new vocab
    idx = torch.tensor([[1, 105, 109, 3]])
    logits, loss = model(idx, idx)
    assert logits.shape == (1, 4, 110)
    assert_close(loss, F.cross_entropy(logits.view(-1, 110), idx.view(-1)))
    loss.backward()
    assert wte.grad is not None and wte.grad[105].abs().sum() > 0
    # still a single tensor after growing: an update to the embedding is an update to the head
    with torch.no_grad():
        model.transformer.wte.weight[109].zero_()
    assert model.lm_head.weight[109].abs().sum() == 0
    with pytest.raises(ValueError):
        model.resize_token_embeddings(50)


# -----------------------------------------------------------------------------
# parameter counts of the released GPT-2 sizes (on the meta device: nothing is allocated)

@pytest.mark.parametrize("n_layer, n_head, n_embd", [(12, 12, 768), (24, 16, 1024), (36, 20, 1280), (48, 25, 1600)])
def test_param_counts_match_hf(n_layer, n_head, n_embd):
    from transformers import GPT2Config, GPT2LMHeadModel
    with torch.device('meta'):
        ours = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=1024, vocab_size=50257))
        hf = GPT2LMHeadModel(GPT2Config(n_layer=n_layer, n_head=n_head, n_embd=n_embd, n_positions=1024,
                                        vocab_size=50257))
    assert ours.lm_head.weight.device.type == 'meta'
    # HF ties lm_head to wte: count each tensor once
    hf_params = {id(p): p.numel() for p in hf.parameters()}
    assert ours.get_num_params(non_embedding=False) == sum(hf_params.values())
    # non_embedding=True leaves out wpe (block_size x n_embd values) and nothing else
    assert ours.get_num_params() == sum(hf_params.values()) - 1024 * n_embd


def test_gpt2_small_param_count_is_124m():
    with torch.device('meta'):
        m = GPT(GPTConfig(block_size=1024, vocab_size=50257))
    assert m.get_num_params(non_embedding=False) == 124_439_808


# -----------------------------------------------------------------------------
# block size

def test_crop_block_size():
    torch.manual_seed(0)
    model = GPT(tiny_config()).eval()
    idx = torch.randint(0, 101, (2, 16))
    with torch.no_grad():
        before, _ = model(idx, idx)
    old_wpe = model.transformer.wpe.weight.detach().clone()
    model.crop_block_size(16)
    assert model.config.block_size == 16
    assert model.transformer.wpe.weight.shape == (16, 64) and model.transformer.wpe.num_embeddings == 16
    # the first 16 rows, unchanged
    assert torch.equal(model.transformer.wpe.weight.detach(), old_wpe[:16])
    assert isinstance(model.transformer.wpe.weight, torch.nn.Parameter)
    # an optimizer built now trains it
    assert model.transformer.wpe.weight in set(model.parameters())
    for block in model.transformer.h:
        assert block.attn.bias.shape == (1, 1, 16, 16)
    assert 'transformer.h.0.attn.bias' not in model.state_dict()  # the mask is derived, never saved
    for path in _both_paths(model):
        with torch.no_grad():
            after, _ = model(idx, idx)
        # cropping doesn't change the first 16 positions
        assert_close(after, before, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="block size"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError):
        model.crop_block_size(32)


def test_forward_longer_than_block_size_raises():
    model = GPT(tiny_config(block_size=8))
    with pytest.raises(ValueError, match="block size"):
        model(torch.zeros(1, 9, dtype=torch.long))
    model(torch.zeros(1, 8, dtype=torch.long))  # exactly block_size is fine


# -----------------------------------------------------------------------------
# init

def test_init_stds():
    torch.manual_seed(0)
    n_layer = 4
    model = GPT(GPTConfig(n_layer=n_layer, n_head=4, n_embd=256, block_size=64, vocab_size=512))
    proj_std = 0.02 / math.sqrt(2 * n_layer)
    n_linear = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            n_linear += 1
            want = proj_std if name.endswith('c_proj') else 0.02
            assert module.weight.std().item() == pytest.approx(want, rel=0.05), name
            assert module.weight.mean().abs().item() < want * 0.05, name
            if module.bias is not None:
                assert torch.count_nonzero(module.bias) == 0, name
    assert n_linear == 4 * n_layer + 1
    assert model.transformer.wpe.weight.std().item() == pytest.approx(0.02, rel=0.05)
    for name, p in model.named_parameters():
        if 'ln_' in name:
            assert torch.all(p == (1.0 if name.endswith('weight') else 0.0)), name


def test_init_draws_in_nanogpt_order():
    """ init_weights consumes the RNG exactly like nanoGPT's apply(_init_weights) followed by its c_proj
    re-draw, so a seed gives the same initial weights as nanoGPT's model.py (and as before). """
    cfg = tiny_config(n_layer=3)
    ours = GPT(cfg)
    ref = GPT(cfg)

    @torch.no_grad()
    def nanogpt_init(module):  # nanoGPT's GPT._init_weights: N(0, 0.02) weights, zero Linear biases
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            module.weight.normal_(0.0, 0.02)
        if isinstance(module, torch.nn.Linear) and module.bias is not None:
            module.bias.zero_()
    torch.manual_seed(42)
    ref.apply(nanogpt_init)  # children before parents, lm_head (registered last) last
    # then nanoGPT redraws every '...c_proj.weight' in named_parameters() order
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith('c_proj.weight'):
                p.normal_(0.0, 0.02 / math.sqrt(2 * cfg.n_layer))
    torch.manual_seed(42)
    ours.init_weights()
    assert ours.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v), k
    assert ours.lm_head.weight is ours.transformer.wte.weight


@pytest.mark.parametrize("bias", [True, False])
def test_state_dict_names_and_layernorm(bias):
    """ The checkpoint keys are GPT-2's (nanoGPT's), a bias=False model has no bias tensors at all, and the
    LayerNorms compute (x - mean) / sqrt(var + 1e-5) * weight (+ bias), GPT-2's eps. """
    torch.manual_seed(0)
    model = GPT(tiny_config(n_layer=1, bias=bias))
    per_layer = ['ln_1.weight', 'ln_1.bias', 'attn.c_attn.weight', 'attn.c_attn.bias', 'attn.c_proj.weight',
                 'attn.c_proj.bias', 'ln_2.weight', 'ln_2.bias', 'mlp.c_fc.weight', 'mlp.c_fc.bias',
                 'mlp.c_proj.weight', 'mlp.c_proj.bias']
    want = (['transformer.wte.weight', 'transformer.wpe.weight'] + ['transformer.h.0.' + n for n in per_layer]
            + ['transformer.ln_f.weight', 'transformer.ln_f.bias', 'lm_head.weight'])
    if not bias:
        want = [k for k in want if not k.endswith('.bias')]
    assert list(model.state_dict()) == want
    # a state dict with exactly these keys loads strictly into a fresh model
    GPT(tiny_config(n_layer=1, bias=bias)).load_state_dict(model.state_dict(), strict=True)
    ln = model.transformer.h[0].ln_1
    with torch.no_grad():
        ln.weight.normal_()
        if bias:
            ln.bias.normal_()
    x = 0.01 * torch.randn(3, 5, 64)  # variance 1e-4: an eps other than 1e-5 would show
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * ln.weight + (ln.bias if bias else 0)
    assert_close(ln(x), expected, atol=1e-5, rtol=1e-5)


# -----------------------------------------------------------------------------
# optimizer

def test_configure_optimizers_groups(capsys):
    model = GPT(tiny_config())
    opt = model.configure_optimizers(weight_decay=0.1, learning_rate=6e-4, betas=(0.9, 0.95), device_type='cpu')
    decay, nodecay = opt.param_groups
    assert decay['weight_decay'] == 0.1 and nodecay['weight_decay'] == 0.0
    assert decay['lr'] == 6e-4 and decay['betas'] == (0.9, 0.95)
    params = dict(model.named_parameters())
    # in named_parameters() order, which the optimizer's state_dict indices (and so resuming) depend on
    want_decay = [id(p) for p in params.values() if p.dim() >= 2]
    want_nodecay = [id(p) for p in params.values() if p.dim() < 2]
    assert [id(p) for p in decay['params']] == want_decay
    assert [id(p) for p in nodecay['params']] == want_nodecay
    # every tensor exactly once (tied wte too)
    assert len(want_decay) + len(want_nodecay) == len(params)
    assert id(model.lm_head.weight) in want_decay
    # by name: no decay for exactly the biases and the LayerNorm weights
    names_nodecay = {n for n, p in params.items() if p.dim() < 2}
    assert names_nodecay == {n for n in params if n.endswith('.bias') or '.ln_' in n or '.ln_f.' in n}
    # 2 embeddings + 4 matrices per layer; 8 vectors per layer + ln_f's 2 (the counts nanoGPT prints too)
    out = capsys.readouterr().out
    assert "num decayed parameter tensors: 10, with 108,864 parameters" in out
    assert "num non-decayed parameter tensors: 18, with 1,792 parameters" in out
    assert "using fused AdamW: True" in out
    assert fused_adamw_available('cpu') and fused_adamw_available('cuda') and not fused_adamw_available('mps')
    assert opt.defaults['fused'] is True
    plain = model.configure_optimizers(0.1, 6e-4, (0.9, 0.95), 'cpu', fused=False)
    assert plain.defaults['fused'] is None  # PyTorch's own choice for the device
    assert "using fused AdamW: False" in capsys.readouterr().out
    # and it actually steps
    idx = torch.randint(0, 101, (2, 8))
    _, loss = model(idx, idx)
    loss.backward()
    before = model.lm_head.weight.detach().clone()
    opt.step()
    assert not torch.equal(before, model.lm_head.weight)


def test_estimate_mfu(monkeypatch):
    cfg = tiny_config()
    model = GPT(cfg)
    N = model.get_num_params()
    L = cfg.n_layer
    H = cfg.n_head
    Q = cfg.n_embd // cfg.n_head
    T = cfg.block_size
    flops_per_iter = (6 * N + 12 * L * H * Q * T) * T * 5  # 5 fwd/bwd per iter
    want = flops_per_iter / 0.25 / 1e12
    assert model.estimate_mfu(5, 0.25, peak_flops=1e12) == pytest.approx(want, rel=1e-12)
    # without a peak, nanoGPT's: an A100's bf16 312 TFLOP/s
    assert model.estimate_mfu(5, 0.25) == pytest.approx(want / 312, rel=1e-12)


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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
def test_each_option_has_the_parameters_it_should():
    plain = GPT(modern_config())
    keys = list(plain.state_dict())
    assert 'transformer.wpe.weight' in keys and plain.rope_cos is None
    # rope: no position table; the cos/sin tables are buffers built from block_size, never saved
    rope = GPT(modern_config(pos='rope'))
    assert list(rope.state_dict()) == [k for k in keys if k != 'transformer.wpe.weight']
    assert rope.rope_cos.shape == rope.rope_sin.shape == (16, 8)
    assert_close(rope.rope_cos, rotary_tables(16, 16)[0], rtol=0, atol=0)
    # rmsnorm: a gain, no bias, even in a model with biases elsewhere
    rms = GPT(modern_config(norm='rmsnorm'))
    assert all(isinstance(m, torch.nn.RMSNorm) and m.eps == 1e-5 for n, m in rms.named_modules() if 'ln_' in n)
    assert list(rms.state_dict()) == [k for k in keys if not ('ln_' in k and k.endswith('.bias'))]
    # qk_norm, relu2 and the soft cap have no parameters
    for options in (dict(qk_norm=True), dict(mlp_act='relu2'), dict(logit_softcap=30.0)):
        assert list(GPT(modern_config(**options)).state_dict()) == keys, options


@pytest.mark.usefixtures('one_thread')
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
    rope = GPT(modern_config(pos='rope', tie_embeddings=False))
    assert rope.get_num_params() == sum(p.numel() for p in rope.parameters()) - 50 * 32
    tied = GPT(modern_config(pos='rope'))
    # tied: wte is the head, it counts
    assert tied.get_num_params() == sum(p.numel() for p in tied.parameters())
    # each matrix gets its own gradient, and AdamW decays both
    idx = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    model(idx, idx)[1].backward()
    assert wte.grad.abs().sum() > 0 and head.grad.abs().sum() > 0 and not torch.equal(wte.grad, head.grad)
    decay, _ = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu').param_groups
    assert {id(wte), id(head)} <= {id(p) for p in decay['params']}


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
def test_defaults_are_gpt2_and_nanogpt_refuses_modern_model_args():
    default = GPTConfig()
    assert default.modern() == {}
    assert dataclasses.asdict(default).items() >= MODERN.items()
    assert set(default.model_args()) == set(NANOGPT_MODEL_ARGS) and len(default.model_args()) == 7
    NanoGPTConfig(**default.model_args())  # nanoGPT builds a default model's config
    for name, value in ALL_OPTIONS.items():
        config = modern_config(**{name: value})
        assert config.modern() == {name: value}
        assert config.model_args() == dict({k: getattr(config, k) for k in NANOGPT_MODEL_ARGS}, **{name: value})
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            NanoGPTConfig(**config.model_args())
    everything = modern_config(**ALL_OPTIONS)
    assert everything.modern() == ALL_OPTIONS and set(everything.model_args()) == set(NANOGPT_MODEL_ARGS) | set(MODERN)
    # an option at GPT-2's value is no option: nothing extra in model_args
    assert set(modern_config(**MODERN).model_args()) == set(NANOGPT_MODEL_ARGS)


@pytest.mark.usefixtures('one_thread')
def test_bad_options_are_refused_by_the_config():
    for options, message in ((dict(pos='alibi'), "pos must be one of"), (dict(norm='batchnorm'), "norm must be one"),
                             (dict(mlp_act='swiglu'), "mlp_act must be one of"),
                             (dict(logit_softcap=-1.0), "logit_softcap must be 0"),
                             (dict(pos='rope', n_embd=30, n_head=2), "even head size, got n_embd / n_head = 15")):
        with pytest.raises(ValueError, match=message):
            modern_config(**options)
    # an odd head size is fine without rotary positions
    modern_config(pos='learned', n_embd=30, n_head=2)


# -----------------------------------------------------------------------------
# KV cache and sampling with rotary positions

def cache_model(attention='flash', seed=0):
    model = modern_model(seed, **CACHE_OPTIONS)
    model.set_attention(attention)
    return model


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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
    tied = GPT(modern_config(pos='rope'))
    tied.resize_token_embeddings(53)
    assert tied.transformer.wte.weight is tied.lm_head.weight


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


# -----------------------------------------------------------------------------
# the loss a chunk of positions at a time (GPT.set_chunked_loss): train.py's path for a large vocabulary on the CPU

@pytest.mark.parametrize('chunk', [1, 7, 64, 1000])
def test_the_chunked_loss_gives_the_plain_loss_and_gradients(chunk):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=1000, dropout=0.0))
    x, y = torch.randint(0, 1000, (2, 3, 16))
    y[0, :5] = -1  # ignored targets, as finetune.py's prompts
    _, plain = model(x, y)
    plain.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    model.set_chunked_loss(chunk)
    logits, loss = model(x, y)
    loss.backward()
    assert logits is None
    assert_close(loss, plain, rtol=1e-6, atol=1e-6)
    for name, p in model.named_parameters():  # the tied wte/lm_head included
        assert_close(p.grad, expected[name], rtol=1e-5, atol=1e-7, msg=name)
    with torch.no_grad():  # an evaluation: only the log-sum-exp of each chunk
        assert_close(model(x, y)[1], plain, rtol=1e-6, atol=1e-6)


def test_a_soft_capped_model_keeps_the_plain_loss_when_chunked():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=1000, logit_softcap=15.0))
    x, y = torch.randint(0, 1000, (2, 2, 16))
    model.set_chunked_loss(8)
    logits, loss = model(x, y)
    assert logits.shape == (2, 16, 1000)
    assert_close(loss, F.cross_entropy(logits.view(-1, 1000), y.view(-1)))


@pytest.mark.parametrize('vocab_size, device_type, dtype, compiled, fsdp, chunked', [
    (50304, 'cpu', 'float32', False, False, True),
    (8192, 'cpu', 'float32', False, False, True),
    (65, 'cpu', 'float32', False, False, False),  # the character model: nothing to gain
    (50304, 'cuda', 'float32', False, False, False),
    (50304, 'cpu', 'bfloat16', False, False, False),
    (50304, 'cpu', 'float32', True, False, False),
    (50304, 'cpu', 'float32', False, True, False),
])
def test_train_chunks_the_loss_of_a_large_vocabulary_on_the_cpu_only(vocab_size, device_type, dtype, compiled, fsdp,
                                                                     chunked):
    config = GPTConfig(vocab_size=vocab_size)
    assert train.chunk_the_loss(config, device_type, dtype, compiled, fsdp) is chunked
