"""
Fast inference for GPT: a preallocated KV cache, a pure sampling function, and generation that
streams one token per step for a whole batch of samples. It is split from model.py (like nanochat's
engine.py); GPT.generate in model.py stays the naive reference that this module is tested against.

Usage:
    from nanogpt_plus.engine import generate, generate_stream
    g = torch.Generator().manual_seed(1337)
    out = generate(model, idx, max_new_tokens=500, temperature=0.8, top_k=200, generator=g)  # (B, T+500)
    for tokens in generate_stream(model, idx, 500, temperature=0.8, generator=g):  # tokens: (B,) per step
        ...

What is computed is nanoGPT's: every new token is predicted from the last block_size tokens of the
sequence, at positions 0..T-1. While the sequence fits in block_size the KV cache makes that exact
and cheap (the prompt is forwarded once, then one token per step). Past block_size, GPT-2's learned
absolute position embeddings mean every cached key/value would be at the wrong position, so there
are two modes:
  'exact' (default): from then on, forward the whole last-block_size window for every new token, like
          nanoGPT does (but for all samples in one batch); identical results, ~block_size times the cost
          of a cached step.
  'fast':  when the cache is full, keep the most recent block_size//2 tokens, re-prefill them at
          positions 0.. and continue with the cache. Each token then sees between block_size/2 and
          block_size tokens of context (not always the full window), at ~2 token-forwards per new token.
"""

from contextlib import nullcontext

import torch
from torch.nn import functional as F

# sample.py's mode setting: 'exact' (nanoGPT's results: no cache, float32 where asked) or 'fast' (a
# KV cache in the model's dtype); generate_stream acts on it
MODES = ('exact', 'fast')


class KVCache:
    """
    Keys and values of every layer for a batch of sequences, preallocated for max_len positions so
    that a decoding step writes one slot instead of concatenating. Implements the protocol model.py
    expects: .pos, .update(layer_idx, k, v) -> (k_all, v_all), .advance(T).
    """

    def __init__(self, n_layer, max_len):
        self.n_layer = n_layer
        self.max_len = max_len
        self.pos = 0  # number of positions cached so far (the same for every layer after a forward)
        # (n_layer, B, nh, max_len, hs); allocated by the first update, which knows B, nh, hs, the
        # dtype (autocast may make k and v bfloat16) and the device
        self.k = None
        self.v = None

    def reset(self):
        """ Forget everything cached; the storage is kept and overwritten by the next prefill. """
        self.pos = 0

    def update(self, layer_idx, k, v):
        B, nh, T, hs = k.shape
        if self.k is None or self.k.shape[1:3] != (B, nh) or self.k.shape[4] != hs or self.k.dtype != k.dtype \
                or self.k.device != k.device:
            if self.pos != 0:
                raise ValueError(
                    "the KV cache holds sequences of another shape/dtype; reset() it first")
            shape = (self.n_layer, B, nh, self.max_len, hs)
            self.k = torch.empty(shape, dtype=k.dtype, device=k.device)
            self.v = torch.empty(shape, dtype=v.dtype, device=v.device)
        end = self.pos + T
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} positions, room for {self.max_len}")
        self.k[layer_idx, :, :, self.pos:end] = k
        self.v[layer_idx, :, :, self.pos:end] = v
        return self.k[layer_idx, :, :, :end], self.v[layer_idx, :, :, :end]

    def advance(self, T):
        self.pos += T


def check_sampling_args(temperature, top_k, top_p):
    """
    ValueError unless temperature >= 0, top_k is None or >= 1, and top_p is None or in (0, 1].
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or None (no top-k), got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1] (1.0 = off), got {top_p}")


def next_token_probs(logits, temperature=1.0, top_k=None, top_p=None):
    """
    The distribution the next token is drawn from: logits (B, V) -> probabilities (B, V), float32.
    temperature scales the logits; top_k keeps the k most likely tokens (nanoGPT's rule: everything
    below the k-th largest logit is dropped, so ties with it stay); top_p keeps the smallest set of
    most likely tokens whose probability reaches top_p (nucleus sampling), applied after top_k.
    temperature=0 means greedy: all the mass on the argmax.
    """
    check_sampling_args(temperature, top_k, top_p)
    logits = logits.float()  # under autocast the logits may be bfloat16; sample in float32
    if temperature == 0:
        return F.one_hot(logits.argmax(dim=-1), logits.size(-1)).float()
    logits = logits / temperature  # a new tensor: the caller's logits are never modified
    if top_k is not None:
        kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth_largest, float('-inf'))
    probs = logits.softmax(dim=-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, sorted_idx = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the more likely tokens before it already reach top_p; the first always
        # stays
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop_sorted[:, 0] = False
        drop = drop_sorted.scatter(-1, sorted_idx, drop_sorted)  # back to vocabulary order
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def last_position_logits(model, idx):
    """
    model(idx)[0] for idx (B, T <= block_size) at positions 0..T-1, without a cache: the logits (B,
    1, V) of the last position. It skips the work that position does not need: in the final block
    the other positions only supply keys and values, so their MLP (2/3 of a block's FLOPs) is not
    run. With 6 layers that is ~1/9 of the forward; it is what the exact mode pays for every token
    past block_size.
    """
    if idx.size(1) < 2:
        return model(idx)[0]
    *lower_blocks, last_block = model.transformer.h
    T = idx.size(1)
    x = model.embed(idx)
    rope = model.rotary(0, T)
    for block in lower_blocks:
        x = block(x, rope=rope)
    # the last block: keys/values of positions 0..T-2 (through its attention only), then the last
    # position through the whole block, attending to all of them
    prefix = _PrefixKV()
    last_block.attn(last_block.ln_1(x[:, :-1]), kv_cache=prefix, rope=model.rotary(0, T - 1))
    prefix.advance(T - 1)
    x = last_block(x[:, -1:], kv_cache=prefix, rope=model.rotary(T - 1, 1))
    return model.head(model.transformer.ln_f(x))


class _PrefixKV:
    """
    The KV-cache protocol for a single layer used twice: keep a prefix's keys/values, append one
    step's.
    """

    def __init__(self):
        self.pos = 0
        self.k = self.v = None

    def update(self, layer_idx, k, v):
        if self.k is not None:
            k = torch.cat((self.k, k), dim=2)
            v = torch.cat((self.v, v), dim=2)
        self.k = k
        self.v = v
        return k, v

    def advance(self, T):
        self.pos += T


def sample_next_token(logits, generator=None, temperature=1.0, top_k=None, top_p=None):
    """
    Draw the next token of each row: logits (B, V) -> (B, 1) int64. Pure apart from the generator:
    the same logits and generator state give the same tokens. temperature=0 is greedy (argmax, no
    sampling).
    """
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    probs = next_token_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(probs, num_samples=1, generator=generator)


@torch.inference_mode()
def generate_stream(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None,
                    generator=None, mode='exact', stop_token=None, vocab_size=None, ctx=None):
    """
    Generate max_new_tokens tokens after the prompts idx (B, T), yielding the (B,) new tokens of
    each step as soon as they are drawn. mode: 'exact' or 'fast' (see the module docstring).
    stop_token: a row that draws it is finished (it keeps yielding stop_token) and generation ends
    when every row is finished. vocab_size: only tokens below it are drawn (the model's vocabulary
    may be padded, e.g. 50304 for GPT-2's 50257). ctx: a context manager for the forward passes
    (autocast). model should be in eval() mode.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if max_new_tokens <= 0:
        return
    ctx = ctx if ctx is not None else nullcontext()
    block_size = model.config.block_size
    seq = idx[:, -block_size:]  # only the last block_size tokens can ever condition a prediction
    B = seq.size(0)
    # room for everything while the sequence fits the block; once it doesn't, a full block
    cache = KVCache(model.config.n_layer, min(block_size, seq.size(1) + max_new_tokens))
    done = torch.zeros(B, dtype=torch.bool, device=idx.device)

    with ctx:
        logits, _ = model(seq, kv_cache=cache)  # prefill: the whole prompt in one forward
    for step in range(max_new_tokens):
        logits = logits[:, -1, :]
        if vocab_size is not None:
            logits = logits[:, :vocab_size]
        next_tok = sample_next_token(logits, generator, temperature, top_k, top_p)  # (B, 1)
        if stop_token is not None:
            # finished rows stay finished
            next_tok = next_tok.masked_fill(done[:, None], stop_token)
            done |= next_tok[:, 0] == stop_token
        yield next_tok[:, 0]
        if step == max_new_tokens - 1 or (stop_token is not None and bool(done.all())):
            return  # the last token needs no forward pass
        seq = torch.cat((seq, next_tok), dim=1)
        with ctx:
            if cache.pos < block_size:
                # the sequence still fits in the block: one cached decoding step at position
                # cache.pos
                logits, _ = model(next_tok, kv_cache=cache)
            elif mode == 'fast':
                # cache full: restart it from the most recent half window, re-prefilled at positions
                # 0..
                seq = seq[:, -(block_size // 2):]
                cache.reset()
                logits, _ = model(seq, kv_cache=cache)
            else:
                # exact: the window slid, so every token moved to a new position and no cached
                # key/value is valid; recompute the last block_size tokens (only what the last
                # position needs)
                seq = seq[:, -block_size:]
                logits = last_position_logits(model, seq)


def typical_step(model, idx, max_new_tokens, mode='exact', ctx=None):
    """
    (work, flops): a callable that runs, once per call, the step generate_stream(model, idx,
    max_new_tokens, mode=mode) spends most of its steps on, and that step's forward FLOPs; for
    timing CPU thread counts (machine.AutoThreads) on what sampling really does. The step is a
    decoding step with the KV cache (B tokens against the prompt's cached keys and values), or, in
    the exact mode when most new tokens come past block_size, a forward of the whole window's
    block_size tokens (last_position_logits). It leaves no trace: its cache is its own, and the
    model draws no random numbers.
    """
    ctx = ctx if ctx is not None else nullcontext()
    block_size = model.config.block_size
    seq = idx[:, -block_size:]
    B, T = seq.shape
    cached = max(0, min(max_new_tokens, block_size - T))  # the steps before the window slides
    forward_flops = 2 * sum(p.numel() for p in model.parameters())  # per token, roughly
    if mode == 'exact' and max_new_tokens - cached > cached:
        window = torch.zeros(B, block_size, dtype=torch.long, device=idx.device)

        @torch.inference_mode()
        def window_forward():
            with ctx:
                last_position_logits(model, window)
        return window_forward, forward_flops * B * block_size
    cache = KVCache(model.config.n_layer, T)
    with torch.inference_mode(), ctx:
        if T > 1:
            model(seq[:, :-1], kv_cache=cache)  # the prompt but its last token, cached once

    @torch.inference_mode()
    def decode_step():
        cache.pos = T - 1  # the same slot every time: the last prompt token against the rest
        with ctx:
            model(seq[:, -1:], kv_cache=cache)
    return decode_step, forward_flops * B


def generate(model, idx, max_new_tokens, **kwargs):
    """
    Like GPT.generate, but cached and batched: returns (B, T + n) with the prompts idx (B, T)
    followed by the n <= max_new_tokens generated tokens (fewer only when every row hit stop_token).
    kwargs: generate_stream's.
    """
    out = [idx]
    for tokens in generate_stream(model, idx, max_new_tokens, **kwargs):
        out.append(tokens[:, None])
    return torch.cat(out, dim=1)
