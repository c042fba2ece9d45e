"""
nanogpt_plus/engine.py: the KV-cached, batched sampler against nanoGPT's naive GPT.generate (the reference), against
transformers' greedy generate, and the sampling distributions (temperature, top_k, top_p) exactly.
"""
import pytest
import torch
from torch.nn import functional as F

from model import GPT, GPTConfig
from nanogpt_plus.engine import (
    KVCache,
    generate,
    generate_stream,
    last_position_logits,
    next_token_probs,
    sample_next_token,
    typical_step,
)
from nanogpt_plus.weight_formats import can_pack, set_weights

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def peaky_model(block_size=16, vocab_size=50, n_layer=2, n_head=2, n_embd=32, seed=0, attention='flash',
                weights='float32'):
    """
    A small random GPT whose logits are well separated, so greedy decoding has no near-ties. weights: its
    matrices' format (nanogpt_plus/weight_formats.py); 'packed' is float32 packed for oneDNN, as sample.py
    runs on a CPU.
    """
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size,
                          vocab_size=vocab_size))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.mul_(5.0)
    model.set_attention(attention)
    model.eval()
    if weights == 'packed':
        return set_weights(model, 'float32', pack=can_pack('cpu', torch.float32))
    return set_weights(model, weights)


# the KV-cache tests run for every weight format
WEIGHTS = ['float32', 'packed', 'bfloat16', 'int8']


def reference_greedy(model, idx, n):
    """ nanoGPT's naive generate, greedy: top_k=1 leaves one token with probability 1. """
    return model.generate(idx, n, temperature=1.0, top_k=1)


def reference_fast_greedy(model, idx, n):
    """
    The documented semantics of mode='fast', computed naively: the context is the tokens since the last
    restart; when it would exceed block_size, it restarts from the most recent block_size//2 tokens.
    """
    bs = model.config.block_size
    seq = idx[:, -bs:]
    out = idx
    with torch.no_grad():
        for _ in range(n):
            logits, _ = model(seq)
            nxt = logits[:, -1, :].argmax(dim=-1, keepdim=True)
            out = torch.cat((out, nxt), dim=1)
            seq = torch.cat((seq, nxt), dim=1)
            if seq.size(1) > bs:
                seq = seq[:, -(bs // 2):]
    return out


# -----------------------------------------------------------------------------
# KV cache

def test_kv_cache_writes_in_place_and_refuses_overflow():
    cache = KVCache(n_layer=2, max_len=5)
    k = torch.randn(3, 2, 4, 8)
    v = torch.randn(3, 2, 4, 8)
    k_all, v_all = cache.update(0, k, v)
    assert k_all.shape == (3, 2, 4, 8) and torch.equal(k_all, k) and torch.equal(v_all, v)
    cache.update(1, k, v)
    cache.advance(4)
    k1 = torch.randn(3, 2, 1, 8)
    v1 = torch.randn(3, 2, 1, 8)
    k_all, _ = cache.update(0, k1, v1)
    assert torch.equal(k_all, torch.cat((k, k1), dim=2))
    storage = cache.k.data_ptr()
    cache.advance(1)
    with pytest.raises(ValueError, match="overflow"):
        cache.update(0, k1, v1)
    cache.reset()
    cache.update(0, k1, v1)
    assert cache.k.data_ptr() == storage  # reset reuses the preallocated storage


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("attention", ["flash", "manual"])
@pytest.mark.parametrize("T", [1, 2, 9, 16])
def test_last_position_logits_equal_the_full_forward(attention, T, weights):
    model = peaky_model(block_size=16, n_layer=3, attention=attention, weights=weights)
    idx = torch.randint(0, 50, (3, T), generator=torch.Generator().manual_seed(T))
    # bf16 and int8 round each matmul's result to bfloat16: a last-bit difference may flip one rounding
    rtol, atol = (1e-5, 1e-4) if weights in ('float32', 'packed') else (2e-2, 5e-2)
    with torch.no_grad():
        expected, _ = model(idx)
        torch.testing.assert_close(last_position_logits(model, idx), expected, rtol=rtol, atol=atol)


# -----------------------------------------------------------------------------
# greedy: cached == naive reference, token for token

@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("attention", ["flash", "manual"])
@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("prompt_len,n", [(1, 15), (5, 11), (16, 0), (10, 6)])
def test_cached_greedy_equals_reference_inside_block(attention, mode, prompt_len, n, weights):
    model = peaky_model(block_size=16, attention=attention, weights=weights)
    idx = torch.randint(0, 50, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    ref = reference_greedy(model, idx, n)
    out = generate(model, idx, n, temperature=0, mode=mode)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("attention", ["flash", "manual"])
@pytest.mark.parametrize("prompt_len,n", [(1, 40), (5, 30), (16, 5), (25, 20)])
def test_exact_mode_equals_reference_past_block(attention, prompt_len, n, weights):
    # (25, 20): a prompt longer than the block, which both crop to its last block_size tokens
    model = peaky_model(block_size=16, attention=attention, weights=weights)
    idx = torch.randint(0, 50, (2, prompt_len), generator=torch.Generator().manual_seed(2))
    ref = reference_greedy(model, idx, n)
    out = generate(model, idx, n, temperature=0, mode='exact')
    assert out.shape == (2, prompt_len + n)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("weights", WEIGHTS)
def test_fast_mode_past_block_restarts_from_half_window(weights):
    model = peaky_model(block_size=16, weights=weights)
    idx = torch.randint(0, 50, (2, 3), generator=torch.Generator().manual_seed(3))
    out = generate(model, idx, 45, temperature=0, mode='fast')
    assert torch.equal(out, reference_fast_greedy(model, idx, 45))
    # and past the block it is genuinely a different computation from the exact one
    assert not torch.equal(out, reference_greedy(model, idx, 45))


def test_sampling_with_cache_reproduces_reference_draws():
    # same seed, same RNG order: inside the block the cached sampler draws exactly nanoGPT's tokens
    model = peaky_model(block_size=32)
    idx = torch.randint(0, 50, (1, 4), generator=torch.Generator().manual_seed(4))
    torch.manual_seed(123)
    ref = model.generate(idx, 25, temperature=0.8, top_k=10)
    out = generate(model, idx, 25, temperature=0.8, top_k=10, generator=torch.Generator().manual_seed(123))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("weights", WEIGHTS)
def test_batched_greedy_equals_unbatched(weights):
    model = peaky_model(block_size=16, weights=weights)
    idx = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(5))
    for mode in ("exact", "fast"):
        batched = generate(model, idx, 30, temperature=0, mode=mode)
        for i in range(idx.size(0)):
            assert torch.equal(batched[i:i + 1], generate(model, idx[i:i + 1], 30, temperature=0, mode=mode))


def test_batched_samples_are_independent_and_seeded():
    model = peaky_model(block_size=32, vocab_size=50)
    with torch.no_grad():
        model.lm_head.weight.mul_(0.05)  # flatter distribution: samples should visibly differ
    idx = torch.zeros((6, 1), dtype=torch.long)
    a = generate(model, idx, 20, temperature=1.0, generator=torch.Generator().manual_seed(7))
    b = generate(model, idx, 20, temperature=1.0, generator=torch.Generator().manual_seed(7))
    c = generate(model, idx, 20, temperature=1.0, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b)  # a fixed seed reproduces
    assert not torch.equal(a, c)
    assert len({tuple(row.tolist()) for row in a}) == 6  # rows of one batch are different samples


def test_stop_token_and_vocab_limit():
    model = peaky_model(block_size=16, vocab_size=50)
    idx = torch.zeros((3, 2), dtype=torch.long)
    free = generate(model, idx, 12, temperature=0)
    assert free.shape == (3, 14)
    stop = int(free[0, 4])  # a token row 0 produces at its third step
    first = free[0, 2:].tolist().index(stop)  # its first appearance (at the third step or before)
    out = generate(model, idx, 12, temperature=0, stop_token=stop)
    # the rows are the same greedy sample, so all stop together: generation ends at the first stop token
    assert torch.equal(out, free[:, :2 + first + 1])
    # rows that stop at different steps: a finished row repeats the stop token until all are finished
    idx2 = torch.stack([free[0, :2], free[0, 1:3]])  # row 1 is row 0 one step ahead
    out2 = generate(model, idx2, 12, temperature=0, stop_token=stop)
    assert out2.size(1) < 2 + 12
    for row in out2.tolist():
        new = row[2:]
        assert stop in new and all(t == stop for t in new[new.index(stop):])
    assert out2[:, -1].tolist() == [stop, stop]
    # limited vocabulary: padded ids are never drawn, greedy or sampled
    for temperature in (0, 1.5):
        out = generate(model, torch.zeros((8, 1), dtype=torch.long), 30, temperature=temperature, vocab_size=7,
                       generator=torch.Generator().manual_seed(0))
        assert int(out[:, 1:].max()) < 7


def test_stream_yields_one_step_at_a_time():
    model = peaky_model(block_size=16)
    idx = torch.zeros((2, 1), dtype=torch.long)
    steps = list(generate_stream(model, idx, 20, temperature=0, mode='exact'))
    assert len(steps) == 20 and all(s.shape == (2,) for s in steps)
    assert torch.equal(torch.stack(steps, dim=1), reference_greedy(model, idx, 20)[:, 1:])


# -----------------------------------------------------------------------------
# parity with transformers' greedy generate on a small random GPT-2 loaded through from_pretrained

def test_greedy_equals_transformers_generate(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf_config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=101,
                           initializer_range=0.2, bos_token_id=100, eos_token_id=100)
    GPT2LMHeadModel(hf_config).save_pretrained(tmp_path)
    hf = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    model = GPT.from_pretrained(str(tmp_path)).eval()
    idx = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        expected = hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=40, min_new_tokens=40,
                               do_sample=False, pad_token_id=100)
    assert expected.shape == (2, 47)
    assert torch.equal(generate(model, idx, 40, temperature=0), expected)


# -----------------------------------------------------------------------------
# the sampling distribution itself

def test_temperature_scales_logits_and_zero_is_greedy():
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.5]])
    torch.testing.assert_close(next_token_probs(logits, temperature=1.0), F.softmax(logits, dim=-1))
    torch.testing.assert_close(next_token_probs(logits, temperature=2.0), F.softmax(logits / 2.0, dim=-1))
    torch.testing.assert_close(next_token_probs(logits, temperature=0.5), F.softmax(logits * 2.0, dim=-1))
    greedy = next_token_probs(logits, temperature=0)
    assert torch.equal(greedy, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))  # no division by zero, no NaN
    assert sample_next_token(logits, temperature=0).tolist() == [[2]]
    # the caller's logits are untouched
    assert torch.equal(logits, torch.tensor([[1.0, 2.0, 3.0, 0.5]]))


def test_top_k_keeps_exactly_the_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 0.5, 2.0], [0.0, 0.0, 5.0, 1.0, -1.0]])
    probs = next_token_probs(logits, temperature=1.0, top_k=2)
    expected = torch.zeros_like(logits)
    expected[0, [1, 2]] = F.softmax(torch.tensor([4.0, 3.0]), dim=0)
    expected[1, [2, 3]] = F.softmax(torch.tensor([5.0, 1.0]), dim=0)
    torch.testing.assert_close(probs, expected)
    # top_k larger than the vocabulary is no restriction; top_k=1 is greedy
    torch.testing.assert_close(next_token_probs(logits, top_k=100), F.softmax(logits, dim=-1))
    assert torch.equal(next_token_probs(logits, top_k=1).argmax(-1), logits.argmax(-1))
    assert torch.equal((next_token_probs(logits, top_k=1) > 0).sum(-1), torch.tensor([1, 1]))
    # temperature applies before the softmax of the kept tokens
    torch.testing.assert_close(next_token_probs(logits[:1], temperature=0.5, top_k=2)[0, [1, 2]],
                               F.softmax(torch.tensor([8.0, 6.0]), dim=0))


def test_top_k_keeps_ties_with_the_kth_like_nanogpt():
    # nanoGPT's rule drops the logits below the k-th largest, so a token tied with it stays: k=2 keeps 3 here
    logits = torch.tensor([[1.0, 3.0, 2.0, 2.0, 0.0]])
    probs = next_token_probs(logits, top_k=2)
    expected = torch.zeros_like(logits)
    expected[0, [1, 2, 3]] = F.softmax(torch.tensor([3.0, 2.0, 2.0]), dim=0)
    torch.testing.assert_close(probs, expected)
    # GPT.generate (the reference) applies the same rule: with top_k=1 and all logits tied, every token
    # can still be drawn
    model = peaky_model(block_size=8, vocab_size=5)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: all 5 tokens tie
    torch.manual_seed(0)
    out = model.generate(torch.zeros((64, 1), dtype=torch.long), 1, top_k=1)
    assert set(out[:, 1].tolist()) == set(range(5))  # ties survive top_k=1
    engine_probs = next_token_probs(torch.zeros((1, 5)), top_k=1)
    torch.testing.assert_close(engine_probs, torch.full((1, 5), 0.2))


def test_top_p_keeps_the_smallest_nucleus():
    p = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = p.log()
    # 0.5 < 0.7 -> add 0.3 (mass 0.8 >= 0.7): nucleus {1, 3}
    torch.testing.assert_close(next_token_probs(logits, top_p=0.7), torch.tensor([[0.0, 0.625, 0.0, 0.375]]))
    # 0.85: needs 0.5 + 0.3 + 0.15
    torch.testing.assert_close(next_token_probs(logits, top_p=0.85),
                               torch.tensor([[0.0, 0.5, 0.15, 0.3]]) / 0.95)
    # a tiny top_p still keeps the most likely token; 1.0 keeps everything
    torch.testing.assert_close(next_token_probs(logits, top_p=0.01), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
    torch.testing.assert_close(next_token_probs(logits, top_p=1.0), p)
    # combined with top_k (applied first) and temperature
    # renormalised over {1, 3, 2}: 0.526, 0.316, 0.158
    probs = next_token_probs(logits, top_k=3, top_p=0.6)
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.5, 0.0, 0.3]]) / 0.8)


def test_sampled_frequencies_follow_the_distribution():
    logits = torch.tensor([0.1, 2.0, 1.5, -1.0, 1.0, 0.0])
    n = 20000
    g = torch.Generator().manual_seed(0)
    for kwargs in (dict(temperature=1.0), dict(temperature=0.7, top_k=3), dict(temperature=1.3, top_p=0.8)):
        expected = next_token_probs(logits[None], **kwargs)[0]
        draws = sample_next_token(logits.expand(n, -1), generator=g, **kwargs)[:, 0]
        freq = torch.bincount(draws, minlength=6).float() / n
        assert torch.all(freq[expected == 0] == 0)  # masked tokens are never drawn
        torch.testing.assert_close(freq, expected, atol=0.015, rtol=0)


def test_bad_sampling_arguments_are_rejected():
    logits = torch.zeros((1, 4))
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        next_token_probs(logits, temperature=-1)
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        next_token_probs(logits, top_k=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        next_token_probs(logits, top_p=0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        next_token_probs(logits, top_p=1.5)
    with pytest.raises(ValueError, match="mode must be one of"):
        list(generate_stream(peaky_model(), torch.zeros((1, 1), dtype=torch.long), 3, mode='fastest'))


def test_the_thread_timing_step_is_what_sampling_does_most():
    """ typical_step, what sample.py times CPU thread counts on: a cached decoding step of the batch, or the
    whole window's forward where the exact mode spends most steps past block_size; it leaves the RNG alone. """
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=11)).eval()
    shapes = []
    model.transformer.wte.register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape)))
    prompts = torch.randint(11, (3, 5))
    rng = torch.get_rng_state()
    for mode, new_tokens, step in (('exact', 8, (3, 1)), ('fast', 100, (3, 1)), ('exact', 100, (3, 16))):
        work, flops = typical_step(model, prompts, new_tokens, mode)
        shapes.clear()
        work()
        work()
        assert shapes == [step, step], mode
        assert flops == 2 * sum(p.numel() for p in model.parameters()) * step[0] * step[1]
    assert torch.equal(torch.get_rng_state(), rng)
