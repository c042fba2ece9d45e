"""
Tests of model.py: parity with transformers' GPT2LMHeadModel, the two attention paths (with and without a
KV cache), weight tying, parameter counts, block-size surgery, init, optimizer groups and MFU peaks.

Usage:
    python -m pytest tests/test_model.py -q
"""
import copy
import math

import pytest
import torch
from torch.nn import functional as F
from torch.testing import assert_close

from model import GPT, GPTConfig, fused_adamw_available
from nanogpt_plus import machine
from nanogpt_plus.machine import cpu_peak_flops, device_peak_flops, gpu_peak_flops


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


# -----------------------------------------------------------------------------
# MFU

def test_gpu_peak_flops_table():
    assert gpu_peak_flops('NVIDIA H100 80GB HBM3', torch.bfloat16) == 989e12
    assert gpu_peak_flops('NVIDIA H100 80GB HBM3', torch.float16) == 989e12
    assert gpu_peak_flops('NVIDIA H100 80GB HBM3', torch.float32) == 494.5e12  # tf32 column
    assert gpu_peak_flops('NVIDIA A100-SXM4-40GB', torch.bfloat16) == 312e12
    assert gpu_peak_flops('NVIDIA A100-SXM4-40GB', torch.float32) == 156e12
    assert gpu_peak_flops('NVIDIA H200', torch.bfloat16) == 989e12
    # name fragments that contain each other resolve to the more specific entry
    assert gpu_peak_flops('NVIDIA H100 PCIe', torch.bfloat16) == 756e12
    assert gpu_peak_flops('NVIDIA H100 PCIe', torch.float32) == 378e12
    assert gpu_peak_flops('NVIDIA H100 NVL', torch.bfloat16) == 835e12
    assert gpu_peak_flops('NVIDIA GH200 480GB', torch.bfloat16) == 989e12
    assert gpu_peak_flops('NVIDIA A10G', torch.bfloat16) == 70e12
    assert gpu_peak_flops('NVIDIA L40S', torch.bfloat16) == 362e12
    assert gpu_peak_flops('NVIDIA L4', torch.bfloat16) == 121e12
    # unknown GPU: nanoGPT's A100 assumption
    assert gpu_peak_flops('Some Future GPU', torch.bfloat16) == 312e12


def test_cpu_peak_flops_and_env_override(monkeypatch):
    assert cpu_peak_flops(num_cores=2, clock_hz=3e9, vector_isa='avx2') == 2 * 3e9 * 32
    assert cpu_peak_flops(num_cores=4, clock_hz=2e9, vector_isa='avx512') == 4 * 2e9 * 64
    monkeypatch.delenv('NANOGPT_PEAK_FLOPS', raising=False)
    from nanogpt_plus.machine import cpu_peak
    peak = device_peak_flops('cpu')
    # the CPU's figure, never below the nominal one
    assert peak == cpu_peak()[0] and peak >= cpu_peak_flops()
    monkeypatch.setenv('NANOGPT_PEAK_FLOPS', '123e12')
    assert device_peak_flops('cpu') == 123e12
    assert device_peak_flops('cuda', torch.bfloat16) == 123e12  # wins before any device lookup


def test_cpu_peak_is_never_below_what_a_matmul_reaches(monkeypatch):
    """ Virtual machines report the base clock; when the cores turbo past it, the nominal peak is too low
    and MFU would exceed 100%, so the peak is the larger of the nominal figure and a measured matmul. """
    monkeypatch.delenv('NANOGPT_PEAK_FLOPS', raising=False)
    nominal = cpu_peak_flops(2)
    monkeypatch.setattr(machine, 'measured_matmul_flops', lambda n: nominal * 1.5)
    peak, how = machine.cpu_peak(2)
    assert peak == nominal * 1.5 and 'measured 1024^3 fp32 matmul' in how and '2 cores' in how
    monkeypatch.setattr(machine, 'measured_matmul_flops', lambda n: nominal * 0.5)
    assert machine.cpu_peak(2)[0] == nominal
    monkeypatch.setattr(machine, 'measured_matmul_flops', lambda n: 7e15)
    assert device_peak_flops('cpu') == 7e15


def test_matmul_probe_leaves_threads_and_rng_alone():
    from nanogpt_plus.machine import measured_matmul_flops
    threads = torch.get_num_threads()
    rng = torch.get_rng_state()
    measured_matmul_flops.cache_clear()
    flops = measured_matmul_flops(1, n=128, repeats=2)
    assert flops > 1e8  # any CPU does more than 0.1 GFLOP/s
    assert torch.get_num_threads() == threads
    assert torch.equal(torch.get_rng_state(), rng)


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
