"""
GPT-2 as one PyTorch module, meant to be read top to bottom: token and position embeddings, n_layer
pre-norm Transformer blocks (causal self-attention, then a 4x wide GELU MLP), a final LayerNorm, and
an output head that is the token embedding matrix again. GPTConfig's modern options (rotary
positions, RMSNorm, QK-norm, ReLU^2, a logit soft cap, an untied head; all off by default) each
change a few lines where they act.

Parameters carry GPT-2's own names (wte, wpe, h.<i>.ln_1, attn.c_attn, mlp.c_fc, ln_f, ...), so
OpenAI's released weights load through a name-for-name table (hf_key_map, at the end of this file),
and nanoGPT's checkpoints fit it key for key. Those weights fix what each layer computes;
tests/test_model.py checks our logits against transformers' GPT2LMHeadModel. The originals: OpenAI's
TensorFlow code (src/model.py of github.com/openai/gpt-2) and its port in transformers
(src/transformers/models/gpt2/modeling_gpt2.py). Nothing here reads or writes files, except that
from_pretrained asks transformers for the weights.

Usage:
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=65))
    logits, loss = model(idx, targets)          # idx, targets: (B, T) int64
    model = GPT.from_pretrained('gpt2')         # or a local Hugging Face GPT-2 directory
"""

import math
import os
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

# the keys of GPTConfig that nanoGPT's own GPTConfig knows; checkpoints store exactly these as
# 'model_args' so that nanoGPT's sample.py can still build the model from our checkpoints
NANOGPT_MODEL_ARGS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size', 'dropout')
# the OpenAI checkpoints from_pretrained knows
GPT2_NAMES = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')


class CausalSelfAttention(nn.Module):
    """
    Multi-head self-attention in which each position sees itself and the positions before it only.
    """

    def __init__(self, config, layer_idx=0):
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(
                f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
        self.layer_idx = layer_idx  # which slot of a KV cache this layer writes to
        # c_attn makes the queries, keys and values of every head in one (C -> 3C) matmul; c_proj
        # mixes the heads' outputs back into the residual stream
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # dropout on the attention weights (manual path; the flash path gets dropout_p) and on the
        # output
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # RMS-normalise each head's queries and keys (no gains): bounded scores
        self.qk_norm = config.qk_norm
        # True: F.scaled_dot_product_attention, which runs a fused kernel where the device has one.
        # False: the same softmax(q k^T / sqrt(hs)) v written out below, the readable reference.
        # GPT.set_attention switches; tests/test_model.py checks that both give the same results.
        self.flash = True
        # mask[i, j] is True where query i may look at key j (j <= i). A buffer, so it moves with
        # the model; not persistent, because block_size determines it and checkpoints never need it.
        # The name 'bias' is nanoGPT's (crop_block_size slices it); it holds no learned values.
        self.register_buffer("bias", None, persistent=False)
        self.reset_mask(config.block_size)

    def reset_mask(self, block_size, device=None):
        """
        (Re)build the causal mask for block_size positions, on `device` (default: where the mask is
        now). The one place the mask is made: __init__, and FSDP's meta-device ranks, whose buffers
        to_empty leaves uninitialised.
        """
        if device is None and self.bias is not None:
            device = self.bias.device
        # tril_ in place: one (T, T) tensor at a time, not two (a long context's mask is T^2 bytes)
        mask = torch.ones(block_size, block_size, dtype=torch.bool, device=device).tril_()
        self.bias = mask.view(1, 1, block_size, block_size)

    def forward(self, x, kv_cache=None, rope=None):
        B, T, C = x.size()  # batch, new tokens, n_embd
        hs = C // self.n_head  # head size

        # (B, T, 3C) -> q, k, v of (B, T, C) each -> (B, nh, T, hs): the heads become a batch
        # dimension
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)
        if self.qk_norm:
            q = F.rms_norm(q, (hs,), eps=1e-5)
            k = F.rms_norm(k, (hs,), eps=1e-5)
        # rotary positions: turn q and k by angles of their positions (cached k already are)
        if rope is not None:
            q = apply_rotary(q, *rope)
            k = apply_rotary(k, *rope)

        # with a KV cache, the T new tokens sit at positions pos..pos+T-1 and attend to everything
        # cached before them as well: k, v become (B, nh, pos+T, hs)
        pos = 0
        if kv_cache is not None:
            pos = kv_cache.pos
            k, v = kv_cache.update(self.layer_idx, k, v)
        Tk = k.size(2)

        # scores (B, nh, T, hs) x (B, nh, hs, Tk) -> (B, nh, T, Tk); softmax over the keys; then the
        # weighted sum of values (B, nh, T, Tk) x (B, nh, Tk, hs) -> (B, nh, T, hs)
        dropout_p = self.dropout if self.training else 0
        if self.flash:
            if Tk == T:
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
            elif T == 1:
                # a single new token may look at every cached position: no mask needed
                y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
            else:
                # several new tokens after a cached prefix: is_causal would align the mask top-left,
                # so pass the bottom-right aligned slice of the causal mask explicitly
                mask = self.bias[:, :, pos:pos + T, :Tk]
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)
        else:
            scores = (q @ k.mT) * (1.0 / math.sqrt(hs))
            # no peeking ahead
            scores = scores.masked_fill(~self.bias[:, :, pos:pos + T, :Tk], float('-inf'))
            weights = self.attn_dropout(F.softmax(scores, dim=-1))
            y = weights @ v
        # (B, nh, T, hs) -> (B, T, nh, hs) -> (B, T, C): each token's head outputs concatenated
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


def rotary_tables(block_size, head_size, base=10000.0, device=None):
    """
    Rotary position embedding (RoPE, Su et al., arXiv:2104.09864): the cos and sin, (block_size,
    head_size/2), of the angle pos * base^(-2i/head_size) by which pair i of a query or key at
    position pos is turned.
    """
    inv_freq = base**(-torch.arange(0, head_size, 2, dtype=torch.float32, device=device) /
                      head_size)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32, device=device), inv_freq)
    return angles.cos(), angles.sin()


def apply_rotary(x, cos, sin):
    """
    Turn x (B, nh, T, hs) position by position: the pairs are (x[..., i], x[..., i + hs/2]) (the
    half-split layout of GPT-NeoX and Llama), each turned by its angle. q.k then depends on the
    positions' difference only.
    """
    x1, x2 = x.chunk(2, dim=-1)
    # (T, hs/2) float32 tables; keep autocast's bf16 in bf16
    cos = cos.to(x.dtype)
    sin = sin.to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class MLP(nn.Module):
    """ Position-wise feed-forward layer: C -> 4C, GELU (or ReLU squared), 4C -> C. """

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # GPT-2's released weights were trained with the tanh approximation of GELU ('gelu_new' in
        # transformers); nanoGPT uses the exact erf form. GPTConfig.gelu picks one.
        self.gelu = nn.GELU(approximate=config.gelu)
        # mlp_act='relu2': relu(x)^2 (So et al., Primer, arXiv:2109.08668), cheaper than GELU and
        # sparse
        self.relu2 = config.mlp_act == 'relu2'
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = F.relu(x).square() if self.relu2 else self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


def make_norm(config):
    """
    nn.LayerNorm: eps=1e-5 as in GPT-2; bias=False (PyTorch >= 2.1) leaves out the bias parameter.
    norm='rmsnorm': nn.RMSNorm (Zhang & Sennrich, arXiv:1910.07467), x / rms(x) * weight: no mean,
    no bias.
    """
    if config.norm == 'rmsnorm':
        return nn.RMSNorm(config.n_embd, eps=1e-5)
    return nn.LayerNorm(config.n_embd, bias=config.bias)


class Block(nn.Module):
    """ A pre-norm Transformer block (GPT-2): x + attn(ln_1(x)), then x + mlp(ln_2(x)). """

    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = make_norm(config)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None, rope=None):
        x = x + self.attn(self.ln_1(x), kv_cache=kv_cache, rope=rope)
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 1024
    # GPT-2's 50257 tokens rounded up to a multiple of 64, which matmul kernels like
    vocab_size: int = 50304
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    # biases in every Linear and LayerNorm, as GPT-2 has (its weights need them); False: none
    bias: bool = True
    # 'none' = exact GELU (nanoGPT), 'tanh' = GPT-2's original approximation. Not part of nanoGPT's
    # model_args; checkpoints keep it under their own key (see model_extra_args below).
    gelu: str = 'none'
    # the modern options (modded-nanogpt's speedrun, Llama): the defaults are GPT-2 (see MODERN
    # below) 'learned' = GPT-2's wpe table; 'rope' = rotary positions on q and k, no wpe
    pos: str = 'learned'
    norm: str = 'layernorm'  # or 'rmsnorm'
    qk_norm: bool = False  # True: RMS-normalise queries and keys per head before the scores
    mlp_act: str = 'gelu'  # or 'relu2': relu(x)^2
    logit_softcap: float = 0.0  # C > 0: logits = C * tanh(logits / C), bounded to (-C, C); 0 = off
    tie_embeddings: bool = True  # False: lm_head is a matrix of its own, not wte

    def __post_init__(self):
        for name, allowed in MODERN_CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"GPTConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.pos == 'rope' and (self.n_embd // self.n_head) % 2:
            raise ValueError(
                f"pos='rope' needs an even head size, got n_embd / n_head = {self.n_embd // self.n_head}"
            )
        if self.logit_softcap < 0:
            raise ValueError(
                f"GPTConfig.logit_softcap must be 0 (off) or positive, got {self.logit_softcap}")

    def modern(self):
        """
        The options set away from GPT-2's, {name: value}: what GPT-2's and nanoGPT's formats can't
        hold.
        """
        return {k: getattr(self, k) for k, default in MODERN.items() if getattr(self, k) != default}

    def model_args(self):
        """
        The dict a checkpoint stores under 'model_args': nanoGPT's keys, so that nanoGPT's sample.py
        builds the model, plus every modern option that is on, so that it refuses a model it would
        compute wrongly (its GPTConfig raises "unexpected keyword argument 'pos'") instead of
        loading part of it.
        """
        return {**{k: getattr(self, k) for k in NANOGPT_MODEL_ARGS}, **self.modern()}

    def model_extra_args(self):
        """ Settings beyond nanoGPT's; stored under 'model_extra_args' in a checkpoint. """
        names = [f.name for f in fields(self) if f.name not in NANOGPT_MODEL_ARGS]
        return {k: getattr(self, k) for k in names}


# GPTConfig's modern options and their GPT-2 values; the ones with a choice of names, and those
# names
MODERN = {
    'pos': 'learned',
    'norm': 'layernorm',
    'qk_norm': False,
    'mlp_act': 'gelu',
    'logit_softcap': 0.0,
    'tie_embeddings': True
}
MODERN_CHOICES = {
    'gelu': ('none', 'tanh'),
    'pos': ('learned', 'rope'),
    'norm': ('layernorm', 'rmsnorm'),
    'mlp_act': ('gelu', 'relu2')
}
# the attention implementations GPT.set_attention selects: scaled_dot_product_attention or the
# explicit softmax(QK^T)V
ATTENTIONS = ('flash', 'manual')


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        if config.vocab_size is None or config.block_size is None:
            raise ValueError("GPTConfig needs a vocab_size and a block_size")
        self.config = config

        # token embeddings (and the output head)
        layers = dict(wte=nn.Embedding(config.vocab_size, config.n_embd))
        if config.pos == 'learned':
            # learned absolute position embeddings
            layers['wpe'] = nn.Embedding(config.block_size, config.n_embd)
        self.transformer = nn.ModuleDict(dict(
            **layers,
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=make_norm(config),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            # weight tying, as in GPT-2 (Press & Wolf, arXiv:1608.05859): the head and the token
            # embedding are one Parameter, so parameters() and the optimizer see it once; state_dict
            # lists it under both names
            self.transformer.wte.weight = self.lm_head.weight
        # pos='rope': the rotary cos/sin tables, like the masks rebuilt from block_size, never saved
        self.register_buffer('rope_cos', None, persistent=False)
        self.register_buffer('rope_sin', None, persistent=False)
        self.reset_rotary()
        self.init_weights()
        # recompute the Blocks in the backward pass: set_activation_checkpointing
        self.activation_checkpointing = False
        self.loss_chunk = 0  # set_chunked_loss

        # report number of parameters (meta-device models are built only to count, stay quiet)
        if self.lm_head.weight.device.type != 'meta':
            print("number of parameters: %.2fM" % (self.get_num_params() / 1e6,))

    def init_weights(self):
        """
        GPT-2's initialisation, drawn in a fixed order so that a seed always gives the same model:
          - every Linear weight and both embedding tables ~ N(0, 0.02), in module order; Linear biases = 0.
            lm_head comes last, so its draw (it is the same tensor as wte) is the embedding's final value.
          - then the two projections that add into the residual stream, attn.c_proj and mlp.c_proj, are
            drawn again with std 0.02 / sqrt(2 * n_layer): the stream is a sum of 2 * n_layer such terms,
            and GPT-2 scales them by 1/sqrt(that count) so its variance does not grow with depth.
          - LayerNorms keep the weight 1, bias 0 that nn.LayerNorm starts with.
        """
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.transformer.h:
            nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.c_proj.weight, mean=0.0, std=residual_std)

    def get_num_params(self, non_embedding=True):
        """
        The number of parameter values, the tied wte/lm_head matrix counted once. non_embedding=True
        (the default: the figure printed at start-up and used for MFU) leaves out the tables that
        are only looked up: the position table wpe, and wte when the head is a matrix of its own
        (tied, wte stays in, because as lm_head it is multiplied with every position).
        """
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            if 'wpe' in self.transformer:
                n -= self.transformer.wpe.weight.numel()
            if not self.config.tie_embeddings:
                n -= self.transformer.wte.weight.numel()
        return n

    def reset_rotary(self, device=None):
        """
        pos='rope': (re)build the cos/sin tables for block_size positions on `device` (default:
        where they are).
        """
        if self.config.pos != 'rope':
            return
        if device is None and self.rope_cos is not None:
            device = self.rope_cos.device
        self.rope_cos, self.rope_sin = rotary_tables(self.config.block_size,
                                                     self.config.n_embd // self.config.n_head,
                                                     device=device)

    def rotary(self, pos0, t):
        """
        The (cos, sin) rows of positions pos0..pos0+t-1 for the attention layers; None without rope.
        """
        if self.rope_cos is None:
            return None
        return self.rope_cos[pos0:pos0 + t], self.rope_sin[pos0:pos0 + t]

    def init_buffers(self, device=None):
        """
        Rebuild every Block's causal mask and the rotary tables (non-persistent, so no state dict
        restores them) for the current block_size.
        """
        for block in self.transformer.h:
            block.attn.reset_mask(self.config.block_size, device)
        self.reset_rotary(device)

    def set_attention(self, path):
        """
        Select the attention implementation: 'flash' (scaled_dot_product_attention) or 'manual'.
        """
        if path not in ATTENTIONS:
            raise ValueError(f"attention path must be one of {ATTENTIONS}, got {path!r}")
        for block in self.transformer.h:
            block.attn.flash = path == 'flash'

    def set_activation_checkpointing(self, enabled):
        """
        True: while training, keep only each Block's input and recompute the Block in the backward
        pass (torch.utils.checkpoint): activation memory drops from every Block's intermediates to
        one Block's, for about one more forward pass of compute. The dropout masks are drawn again
        from the same RNG state, so the gradients are those of the plain model. A run-time switch
        like set_attention, not a GPTConfig field: it changes no result, so checkpoints never carry
        it.
        """
        self.activation_checkpointing = bool(enabled)

    def set_chunked_loss(self, rows):
        """
        rows > 0: a forward with targets computes the head and the loss `rows` positions at a time
        (chunked_cross_entropy), so the (positions, vocab_size) logits are never made whole, and
        returns no logits (None). 0: the logits, then F.cross_entropy. The same loss and gradients up
        to float rounding. A run-time switch like set_attention: with GPT-2's 50,304 tokens on a CPU
        the whole logits' memory traffic is a third of a small model's step (train.py turns it on).
        A model with a soft cap keeps the plain path.
        """
        self.loss_chunk = int(rows)

    def embed(self, idx, pos0=0):
        """
        Token + position embeddings (after dropout) of the tokens idx (B, T) at positions
        pos0..pos0+T-1.
        """
        t = idx.size(1)
        if pos0 + t > self.config.block_size:
            raise ValueError(f"Cannot forward sequence of length {pos0 + t}, "
                             f"block size is only {self.config.block_size}")
        x = self.transformer.wte(idx)  # (B, T, C)
        if 'wpe' in self.transformer:  # rotary positions act in the attention instead
            pos = torch.arange(pos0, pos0 + t, dtype=torch.long, device=idx.device)  # (T,)
            x = x + self.transformer.wpe(pos)  # (T, C), the same for every row of the batch
        return self.transformer.drop(x)

    def hidden_states(self, idx, kv_cache=None):
        """ The final (post ln_f) hidden states, (B, T, n_embd), for the tokens idx (B, T). """
        t = idx.size(1)
        pos0 = kv_cache.pos if kv_cache is not None else 0
        x = self.embed(idx, pos0)
        rope = self.rotary(pos0, t)
        # only a training forward that will run backward needs the recomputation (never with a KV
        # cache)
        recompute = self.activation_checkpointing and self.training and torch.is_grad_enabled(
        ) and kv_cache is None
        for block in self.transformer.h:
            if recompute:
                # use_reentrant=False: the variant PyTorch recommends; works with DDP, FSDP2 and
                # torch.compile
                x = checkpoint(block, x, None, rope, use_reentrant=False)
            else:
                x = block(x, kv_cache=kv_cache, rope=rope)
        if kv_cache is not None:
            kv_cache.advance(t)  # every layer has written its keys/values for these t positions
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None, kv_cache=None, all_positions=False):
        """
        Tokens idx (B, T) -> (logits, loss). With targets (B, T) (-1 = ignored) or
        all_positions=True, the logits of every position, (B, T, vocab_size), and with targets their
        mean cross-entropy. Without either, only the last position's logits, (B, 1, vocab_size), and
        loss None: all that sampling needs.
        """
        x = self.hidden_states(idx, kv_cache=kv_cache)
        if targets is None and not all_positions:
            # indexing with the list [-1] keeps the time dimension; lm_head runs for one position
            # only
            return self.head(x[:, [-1], :]), None
        if targets is not None and self.loss_chunk and not self.config.logit_softcap:
            loss = chunked_cross_entropy(x.reshape(-1, x.size(-1)), self.lm_head.weight,
                                         targets.reshape(-1), self.loss_chunk)
            return None, loss
        logits = self.head(x)
        if targets is None:
            return logits, None
        # reshape, not view: targets may be a non-contiguous slice such as idx[:, 1:]
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)),
                               targets.reshape(-1),
                               ignore_index=-1)
        return logits, loss

    def head(self, x):
        """
        Hidden states (..., n_embd) -> logits (..., vocab_size): lm_head, then the soft cap if there
        is one.
        """
        logits = self.lm_head(x)
        cap = self.config.logit_softcap
        # Gemma 2's soft cap: near x for small logits, never beyond +-cap, so no logit runs away
        if cap:
            logits = cap * torch.tanh(logits / cap)
        return logits

    def crop_block_size(self, block_size):
        """
        Shorten the context to block_size positions, e.g. to fine-tune GPT-2 (trained at 1024) at
        256: wpe keeps its first block_size rows and every attention mask its top-left corner, so
        positions 0..block_size-1 compute exactly what they did before.
        """
        if block_size > self.config.block_size:
            raise ValueError(
                f"can only crop the block size down: {block_size} > {self.config.block_size}")
        if 'wpe' in self.transformer:
            wpe = self.transformer.wpe
            wpe.weight = nn.Parameter(wpe.weight[:block_size])
            wpe.num_embeddings = block_size
        self.config.block_size = block_size
        for block in self.transformer.h:
            block.attn.bias = block.attn.bias[:, :, :block_size, :block_size]
        if self.rope_cos is not None:
            self.rope_cos = self.rope_cos[:block_size]
            self.rope_sin = self.rope_sin[:block_size]

    def resize_token_embeddings(self, vocab_size):
        """
        Grow the token embedding table (and the head: the same matrix when tied) to vocab_size rows,
        e.g. to add GPT-1's Start / Delim / Extract tokens for fine-tuning. Existing rows are kept;
        new rows get the usual N(0, 0.02) init.
        """
        def grown(old):
            if vocab_size < old.size(0):
                raise ValueError(f"can only grow the vocabulary: {vocab_size} < {old.size(0)}")
            new = torch.empty(vocab_size, old.size(1), dtype=old.dtype, device=old.device)
            with torch.no_grad():
                new[:old.size(0)] = old
                torch.nn.init.normal_(new[old.size(0):], mean=0.0, std=0.02)
            return nn.Parameter(new)

        untied = not self.config.tie_embeddings
        self.lm_head.weight = grown(self.lm_head.weight)
        self.transformer.wte.weight = grown(
            self.transformer.wte.weight) if untied else self.lm_head.weight
        self.transformer.wte.num_embeddings = vocab_size
        self.lm_head.out_features = vocab_size
        self.config.vocab_size = vocab_size

    @classmethod
    def from_pretrained(cls, model_type, override_args=None):
        """
        Load GPT-2 weights: model_type is 'gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl' (downloaded
        by transformers, or taken from its cache) or the path of a local Hugging Face GPT-2
        directory (config.json plus model.safetensors or pytorch_model.bin). The reference: the
        scripts read the same files without transformers (nanogpt_plus/hf_import.py), tested against
        this.
        """
        override_args = override_args or {}
        # the checkpoint fixes the architecture; dropout, a training setting, is the one thing to
        # choose
        unknown = set(override_args) - {'dropout'}
        if unknown:
            raise ValueError(
                f"only 'dropout' can be overridden when loading GPT-2 weights, got {sorted(unknown)}"
            )
        is_local = os.path.isdir(model_type)
        if not is_local and model_type not in GPT2_NAMES:
            raise ValueError(
                f"unknown model {model_type!r}: use gpt2, gpt2-medium, gpt2-large, gpt2-xl "
                "or the path of a local Hugging Face GPT-2 directory")
        from transformers import GPT2LMHeadModel
        print("loading weights from pretrained gpt: %s" % model_type)
        try:
            hf_model = GPT2LMHeadModel.from_pretrained(model_type)
        except OSError as e:
            if is_local:
                raise OSError(
                    f"could not load a Hugging Face GPT-2 model from {model_type}: {e}") from None
            raise OSError(
                f"could not download '{model_type}' from the Hugging Face hub (offline?). Download it "
                f"elsewhere (GPT2LMHeadModel.from_pretrained('{model_type}').save_pretrained(DIR)) "
                f"and pass the local directory instead: init_from=DIR") from None
        return cls.from_hf_model(hf_model, override_args)

    @classmethod
    def from_hf_model(cls, model_hf, override_args=None):
        """ Build a GPT from an in-memory transformers GPT2LMHeadModel. """
        hf = model_hf.config
        if hf.activation_function not in HF_ACTIVATIONS:
            raise ValueError(
                f"unsupported activation_function {hf.activation_function!r} in the Hugging Face config"
            )
        config_args = dict(
            n_layer=hf.n_layer,
            n_head=hf.n_head,
            n_embd=hf.n_embd,
            block_size=hf.n_positions,
            # GPT-2 checkpoints always have biases
            vocab_size=hf.vocab_size,
            bias=True,
            **HF_ACTIVATIONS[hf.activation_function],
            tie_embeddings=hf.tie_word_embeddings)
        config_args['dropout'] = 0.0
        config_args.update(override_args or {})
        model = cls(GPTConfig(**config_args))
        sd = model.state_dict()
        sd_hf = model_hf.state_dict()
        with torch.no_grad():
            for ours, theirs, transpose in hf_key_map(model.config):
                src = sd_hf[theirs]
                src = src.t() if transpose else src
                if src.shape != sd[ours].shape:
                    raise ValueError(
                        f"shape mismatch for {theirs}: {tuple(src.shape)} vs {tuple(sd[ours].shape)}"
                    )
                sd[ours].copy_(src)
        return model

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type, fused=None,
                             params=None):
        """
        AdamW in two groups: weight_decay for every parameter with 2 or more dimensions (the Linear
        weights and the embedding tables: the tensors that multiply or look up activations), none
        for the vectors (biases and LayerNorm weights, which only shift and scale them). fused=None:
        the fused AdamW kernel wherever this PyTorch has one (CUDA; CPU since 2.4), the same update
        in one kernel per step; False: PyTorch's default AdamW for the device. params: the
        parameters AdamW takes (default: all of them; Muon's runs give it those Muon doesn't take).
        """
        trainable = [
            p for p in (self.parameters() if params is None else params) if p.requires_grad
        ]
        decay = [p for p in trainable if p.dim() >= 2]
        no_decay = [p for p in trainable if p.dim() < 2]
        groups = [{
            'params': decay,
            'weight_decay': weight_decay
        }, {
            'params': no_decay,
            'weight_decay': 0.0
        }]
        n_decay = sum(p.numel() for p in decay)
        n_no_decay = sum(p.numel() for p in no_decay)
        print(f"num decayed parameter tensors: {len(decay)}, with {n_decay:,} parameters")
        print(f"num non-decayed parameter tensors: {len(no_decay)}, with {n_no_decay:,} parameters")
        use_fused = fused_adamw_available(device_type) if fused is None else bool(fused)
        # nothing: let PyTorch choose (foreach or for-loop)
        kernel = {'fused': True} if use_fused else {}
        optimizer = torch.optim.AdamW(groups, lr=learning_rate, betas=betas, **kernel)
        print(f"using fused AdamW: {use_fused}")
        return optimizer

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak_flops=312e12):
        """
        Model FLOPs utilization: the FLOP/s that fwdbwd_per_iter forward+backward passes of
        block_size tokens in dt seconds imply, as a fraction of peak_flops. The default is an A100's
        bf16 peak; nanogpt_plus.machine.device_peak_flops gives the peak of the device actually in
        use.
        """
        # FLOPs per token of a forward+backward pass, as counted in the PaLM paper
        # (arXiv:2204.02311, appendix B): 6 per parameter (2 forward, 4 backward) for the weight
        # matmuls, plus attention's q k^T and weights x v products, 12 * n_layer * n_head *
        # head_size * T (T = block_size)
        N = self.get_num_params()
        cfg = self.config
        L = cfg.n_layer
        H = cfg.n_head
        Q = cfg.n_embd // cfg.n_head
        T = cfg.block_size
        flops_per_token = 6 * N + 12 * L * H * Q * T
        flops_per_iter = flops_per_token * T * fwdbwd_per_iter  # T tokens per pass
        flops_per_second = flops_per_iter * (1.0 / dt)
        return flops_per_second / peak_flops

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """
        Extend the token sequences idx (B, T) by max_new_tokens sampled tokens, one full forward
        pass per token, and return them (B, T + max_new_tokens). Each token is drawn with
        torch.multinomial (the global RNG) from the softmax of the last position's logits /
        temperature, limited to the top_k most likely tokens if top_k is given (ties with the k-th
        stay). Call model.eval() first: dropout would otherwise stay on. This is the plain reference
        that the KV-cached sampler in engine.py is tested against.
        """
        for _ in range(max_new_tokens):
            # only the last block_size tokens fit the model
            context = idx[:, -self.config.block_size:]
            logits, _ = self(context)
            logits = logits[:, -1] / temperature  # (B, vocab_size) for the next token
            if top_k is not None:
                # (B, 1)
                kth_largest = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth_largest, float('-inf'))
            probs = logits.softmax(dim=-1)
            next_token = torch.multinomial(probs, num_samples=1)  # (B, 1)
            idx = torch.cat((idx, next_token), dim=1)
        return idx


# -----------------------------------------------------------------------------
# Hugging Face GPT-2 <-> this model. One table serves both directions: from_hf_model (import) and
# export_hf.py (export). HF's GPT-2 uses Conv1D modules, whose weights are the transpose of
# nn.Linear's.

# transformers' activation_function -> GPTConfig's gelu and mlp_act; GPT2LMHeadModel computes relu2
# as we do
HF_ACTIVATIONS = {
    'gelu_new': {
        'gelu': 'tanh'
    },
    'gelu_pytorch_tanh': {
        'gelu': 'tanh'
    },
    'gelu_fast': {
        'gelu': 'tanh'
    },
    'gelu': {
        'gelu': 'none'
    },
    'relu2': {
        'mlp_act': 'relu2'
    }
}
_HF_CONV1D = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')
# the modern options GPT2LMHeadModel computes too (ReLU^2 as its activation, an untied head); the
# others need our own code in an export (nanogpt_plus/hf_modeling.py)
GPT2_HOLDS = ('mlp_act', 'tie_embeddings')


class ChunkedCrossEntropy(torch.autograd.Function):
    """
    F.cross_entropy(x @ weight.T, targets, ignore_index=-1), mean over the targets that aren't -1,
    computed `chunk` rows at a time. The gradients are taken in the forward, while a chunk's logits
    are in cache: d loss / d logits = (softmax - one_hot) / count, made in place of the logits,
    then multiplied out into the gradients of x and weight; backward only scales them.
    """

    @staticmethod
    def forward(ctx, x, weight, targets, chunk):
        valid = targets != -1
        count = valid.sum()
        safe_targets = targets.clamp(min=0)[:, None]  # -1 rows: any index, their terms are zeroed
        grad_x = torch.empty_like(x)
        grad_weight = torch.zeros_like(weight)
        total = x.new_zeros(())
        for start in range(0, x.size(0), chunk):
            rows = slice(start, start + chunk)
            logits = x[rows] @ weight.T
            picked = logits.gather(1, safe_targets[rows])[:, 0]
            # the softmax in place of the logits, one pass for the exponentials (logsumexp would
            # make its own)
            top = logits.amax(dim=1, keepdim=True)
            grad = logits.sub_(top).exp_()
            sums = grad.sum(dim=1)
            lse = top[:, 0] + sums.log()
            total += ((lse - picked) * valid[rows]).sum()
            # softmax - one_hot, each row scaled by 1/count (0 for an ignored row)
            grad.mul_((valid[rows] / count / sums)[:, None])
            scale = (valid[rows] / count)[:, None]
            grad.scatter_add_(1, safe_targets[rows], -scale)
            grad_x[rows] = grad @ weight
            grad_weight.addmm_(grad.T, x[rows])
        ctx.save_for_backward(grad_x, grad_weight)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss):
        grad_x, grad_weight = ctx.saved_tensors
        return grad_x * grad_loss, grad_weight * grad_loss, None, None


def chunked_cross_entropy(x, weight, targets, chunk):
    """
    The mean cross-entropy of the logits x @ weight.T (x: (N, n_embd), targets: (N,), -1 ignored)
    without making the (N, vocab) logits whole: ChunkedCrossEntropy where a gradient is needed,
    else only each chunk's log-sum-exp.
    """
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return ChunkedCrossEntropy.apply(x, weight, targets, chunk)
    valid = targets != -1
    total = x.new_zeros(())
    for start in range(0, x.size(0), chunk):
        rows = slice(start, start + chunk)
        logits = x[rows] @ weight.T
        picked = logits.gather(1, targets[rows].clamp(min=0)[:, None])[:, 0]
        total += ((torch.logsumexp(logits, dim=1) - picked) * valid[rows]).sum()
    return total / valid.sum()


def hf_activation(config):
    """
    transformers' activation_function for our MLP: GPT-2's tanh GELU, the exact GELU, or ReLU^2.
    """
    if config.mlp_act == 'relu2':
        return 'relu2'
    return {'tanh': 'gelu_new', 'none': 'gelu'}[config.gelu]


def hf_key_map(config):
    """
    [(our state_dict key, HF GPT2LMHeadModel state_dict key, transpose?)] for every tensor we own.
    """
    # GPT-2's layout has no place for them (rotary, RMSNorm, ...)
    for name, value in config.modern().items():
        if name not in GPT2_HOLDS:
            raise ValueError(f"{name}={value!r}, which a Hugging Face GPT-2 can't hold (GPT-2 has "
                             f"{name}={MODERN[name]!r})")
    rows = [('transformer.wte.weight', 'transformer.wte.weight', False),
            ('transformer.wpe.weight', 'transformer.wpe.weight', False)]
    for i in range(config.n_layer):
        for name in ('ln_1.weight', 'ln_1.bias', 'attn.c_attn.weight', 'attn.c_attn.bias',
                     'attn.c_proj.weight', 'attn.c_proj.bias', 'ln_2.weight', 'ln_2.bias',
                     'mlp.c_fc.weight', 'mlp.c_fc.bias', 'mlp.c_proj.weight', 'mlp.c_proj.bias'):
            if name.endswith('.bias') and not config.bias:
                continue  # bias=False models have no biases (export writes zeros for HF)
            rows.append((f'transformer.h.{i}.{name}', f'transformer.h.{i}.{name}', name
                         in _HF_CONV1D))
    rows.append(('transformer.ln_f.weight', 'transformer.ln_f.weight', False))
    if config.bias:
        rows.append(('transformer.ln_f.bias', 'transformer.ln_f.bias', False))
    # a tied lm_head.weight is wte in both models, so it needs a row of its own only when untied
    if not config.tie_embeddings:
        rows.append(('lm_head.weight', 'lm_head.weight', False))
    return rows


def fused_adamw_available(device_type):
    """
    Fused AdamW exists for CUDA since torch 2.0 and for CPU since torch 2.4 (we require >= 2.6).
    """
    return device_type in ('cuda', 'cpu')
