"""
Full definition of a GPT Language Model, all of it in this single file.

References:
1) the official GPT-2 TensorFlow implementation released by OpenAI:
   https://github.com/openai/gpt-2/blob/master/src/model.py
2) huggingface/transformers PyTorch implementation:
   https://github.com/huggingface/transformers/blob/main/src/transformers/models/gpt2/modeling_gpt2.py

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

# the keys of GPTConfig that nanoGPT's own GPTConfig knows; checkpoints store exactly these as
# 'model_args' so that nanoGPT's sample.py can still build the model from our checkpoints
NANOGPT_MODEL_ARGS = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'vocab_size', 'dropout')
GPT2_NAMES = ('gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl')  # the OpenAI checkpoints from_pretrained knows


class LayerNorm(nn.Module):
    """ LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False """

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):

    def __init__(self, config, layer_idx=0):
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
        self.layer_idx = layer_idx  # which slot of a KV cache this layer writes to
        # key, query, value projections for all heads, but in a batch
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        # output projection
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        # regularization
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # flash attention makes GPU go brrrrr; the manual path is kept as the readable reference and
        # both can be selected at run time (GPT.set_attention), so tests can check that they agree
        self.flash = hasattr(F, 'scaled_dot_product_attention')
        # causal mask to ensure that attention is only applied to the left in the input sequence.
        # Not persistent: it is derived from block_size, so it never needs to live in a checkpoint.
        mask = torch.tril(torch.ones(config.block_size, config.block_size, dtype=torch.bool))
        self.register_buffer("bias", mask.view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(self, x, kv_cache=None):
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)

        # calculate query, key, values for all heads in batch and move head forward to be the batch dim
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)

        # with a KV cache, the T new tokens sit at positions pos..pos+T-1 and attend to everything
        # cached before them as well: k, v become (B, nh, pos+T, hs)
        pos = 0
        if kv_cache is not None:
            pos = kv_cache.pos
            k, v = kv_cache.update(self.layer_idx, k, v)
        Tk = k.size(2)

        # causal self-attention; Self-attend: (B, nh, T, hs) x (B, nh, hs, Tk) -> (B, nh, T, Tk)
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
            # manual implementation of attention
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(~self.bias[:, :, pos:pos + T, :Tk], float('-inf'))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (B, nh, T, Tk) x (B, nh, Tk, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side

        # output projection
        y = self.resid_dropout(self.c_proj(y))
        return y


class MLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        # GPT-2's released weights were trained with the tanh approximation of GELU ('gelu_new' in
        # transformers); nanoGPT uses the exact erf form. GPTConfig.gelu picks one.
        self.gelu = nn.GELU(approximate=config.gelu)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        x = self.c_fc(x)
        x = self.gelu(x)
        x = self.c_proj(x)
        x = self.dropout(x)
        return x


class Block(nn.Module):
    """ A pre-norm Transformer block (GPT-2): x + attn(ln(x)), then x + mlp(ln(x)) """

    def __init__(self, config, layer_idx=0):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x, kv_cache=None):
        x = x + self.attn(self.ln_1(x), kv_cache=kv_cache)
        x = x + self.mlp(self.ln_2(x))
        return x


@dataclass
class GPTConfig:
    block_size: int = 1024
    vocab_size: int = 50304  # GPT-2 vocab_size of 50257, padded up to nearest multiple of 64 for efficiency
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # True: bias in Linears and LayerNorms, like GPT-2. False: a bit better and faster
    # 'none' = exact GELU (nanoGPT), 'tanh' = GPT-2's original approximation. Not part of nanoGPT's
    # model_args; checkpoints keep it under their own key (see model_extra_args below).
    gelu: str = 'none'

    def model_args(self):
        """ The nanoGPT-compatible dict a checkpoint stores under 'model_args'. """
        return {k: getattr(self, k) for k in NANOGPT_MODEL_ARGS}

    def model_extra_args(self):
        """ Settings beyond nanoGPT's; stored under 'model_extra_args' in a checkpoint. """
        names = [f.name for f in fields(self) if f.name not in NANOGPT_MODEL_ARGS]
        return {k: getattr(self, k) for k in names}


class GPT(nn.Module):

    def __init__(self, config):
        super().__init__()
        if config.vocab_size is None or config.block_size is None:
            raise ValueError("GPTConfig needs a vocab_size and a block_size")
        if config.gelu not in ('none', 'tanh'):
            raise ValueError(f"GPTConfig.gelu must be 'none' or 'tanh', got {config.gelu!r}")
        self.config = config

        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # with weight tying when using torch.compile() some warnings get generated:
        # "UserWarning: functional_call was passed multiple values for tied weights.
        # This behavior is deprecated and will be an error in future versions"
        # not 100% sure what this is, so far seems to be harmless.
        self.transformer.wte.weight = self.lm_head.weight  # https://paperswithcode.com/method/weight-tying

        # init all weights
        self.apply(self._init_weights)
        # apply special scaled init to the residual projections, per GPT-2 paper
        for pn, p in self.named_parameters():
            if pn.endswith('c_proj.weight'):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

        # report number of parameters (meta-device models are built only to count, stay quiet)
        if self.lm_head.weight.device.type != 'meta':
            print("number of parameters: %.2fM" % (self.get_num_params() / 1e6,))

    def get_num_params(self, non_embedding=True):
        """
        Return the number of parameters in the model.
        For non-embedding count (default), the position embeddings get subtracted.
        The token embeddings would too, except due to the parameter sharing these
        params are actually used as weights in the final layer, so we include them.
        """
        n_params = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n_params -= self.transformer.wpe.weight.numel()
        return n_params

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def set_attention(self, path):
        """ Select the attention implementation: 'flash' (scaled_dot_product_attention) or 'manual'. """
        if path not in ('flash', 'manual'):
            raise ValueError(f"attention path must be 'flash' or 'manual', got {path!r}")
        for block in self.transformer.h:
            block.attn.flash = path == 'flash'

    def embed(self, idx, pos0=0):
        """ Token + position embeddings (after dropout) of the tokens idx (B, T) at positions pos0..pos0+T-1. """
        t = idx.size(1)
        if pos0 + t > self.config.block_size:
            raise ValueError(f"Cannot forward sequence of length {pos0 + t}, "
                             f"block size is only {self.config.block_size}")
        pos = torch.arange(pos0, pos0 + t, dtype=torch.long, device=idx.device)  # shape (t)
        tok_emb = self.transformer.wte(idx)  # token embeddings of shape (b, t, n_embd)
        pos_emb = self.transformer.wpe(pos)  # position embeddings of shape (t, n_embd)
        return self.transformer.drop(tok_emb + pos_emb)

    def hidden_states(self, idx, kv_cache=None):
        """ The final (post ln_f) hidden states, (B, T, n_embd), for the tokens idx (B, T). """
        t = idx.size(1)
        # forward the GPT model itself
        x = self.embed(idx, pos0=kv_cache.pos if kv_cache is not None else 0)
        for block in self.transformer.h:
            x = block(x, kv_cache=kv_cache)
        if kv_cache is not None:
            kv_cache.advance(t)  # every layer has written its keys/values for these t positions
        return self.transformer.ln_f(x)

    def forward(self, idx, targets=None, kv_cache=None, all_positions=False):
        x = self.hidden_states(idx, kv_cache=kv_cache)
        if targets is not None or all_positions:
            # the logits of every position; if we are given some desired targets also calculate the loss
            logits = self.lm_head(x)
            loss = None
            if targets is not None:
                # reshape, not view: targets may be a non-contiguous slice such as idx[:, 1:]
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        else:
            # inference-time mini-optimization: only forward the lm_head on the very last position
            logits = self.lm_head(x[:, [-1], :])  # note: using list [-1] to preserve the time dim
            loss = None
        return logits, loss

    def crop_block_size(self, block_size):
        # model surgery to decrease the block size if necessary
        # e.g. we may load the GPT2 pretrained model checkpoint (block size 1024)
        # but want to use a smaller block size for some smaller, simpler model
        if block_size > self.config.block_size:
            raise ValueError(f"can only crop the block size down: {block_size} > {self.config.block_size}")
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])
        for block in self.transformer.h:
            block.attn.bias = block.attn.bias[:, :, :block_size, :block_size]

    def resize_token_embeddings(self, vocab_size):
        """
        Grow the (tied) token embedding table to vocab_size rows, e.g. to add GPT-1's Start / Delim /
        Extract tokens for fine-tuning. Existing rows are kept; new rows get the usual N(0, 0.02) init.
        """
        old = self.transformer.wte.weight
        if vocab_size < old.size(0):
            raise ValueError(f"can only grow the vocabulary: {vocab_size} < {old.size(0)}")
        new = torch.empty(vocab_size, old.size(1), dtype=old.dtype, device=old.device)
        with torch.no_grad():
            new[:old.size(0)] = old
            torch.nn.init.normal_(new[old.size(0):], mean=0.0, std=0.02)
        self.lm_head.weight = nn.Parameter(new)
        self.transformer.wte.weight = self.lm_head.weight  # keep the tie
        self.transformer.wte.num_embeddings = vocab_size
        self.lm_head.out_features = vocab_size
        self.config.vocab_size = vocab_size

    @classmethod
    def from_pretrained(cls, model_type, override_args=None):
        """
        Load GPT-2 weights: model_type is 'gpt2', 'gpt2-medium', 'gpt2-large', 'gpt2-xl' (downloaded by
        transformers, or taken from its cache) or the path of a local Hugging Face GPT-2 directory
        (config.json plus model.safetensors or pytorch_model.bin).
        """
        override_args = override_args or {}
        # only dropout can be overridden see more notes below
        unknown = set(override_args) - {'dropout'}
        if unknown:
            raise ValueError(f"only 'dropout' can be overridden when loading GPT-2 weights, got {sorted(unknown)}")
        is_local = os.path.isdir(model_type)
        if not is_local and model_type not in GPT2_NAMES:
            raise ValueError(f"unknown model {model_type!r}: use gpt2, gpt2-medium, gpt2-large, gpt2-xl "
                             "or the path of a local Hugging Face GPT-2 directory")
        from transformers import GPT2LMHeadModel
        print("loading weights from pretrained gpt: %s" % model_type)
        try:
            model_hf = GPT2LMHeadModel.from_pretrained(model_type)
        except OSError as e:
            if is_local:
                raise OSError(f"could not load a Hugging Face GPT-2 model from {model_type}: {e}") from None
            raise OSError(f"could not download '{model_type}' from the Hugging Face hub (offline?). Download it "
                          f"elsewhere (GPT2LMHeadModel.from_pretrained('{model_type}').save_pretrained(DIR)) "
                          f"and pass the local directory instead: init_from=DIR") from None
        return cls.from_hf_model(model_hf, override_args)

    @classmethod
    def from_hf_model(cls, model_hf, override_args=None):
        """ Build a GPT from an in-memory transformers GPT2LMHeadModel. """
        hf = model_hf.config
        gelu = HF_ACTIVATIONS.get(hf.activation_function)
        if gelu is None:
            raise ValueError(f"unsupported activation_function {hf.activation_function!r} in the Hugging Face config")
        config_args = dict(n_layer=hf.n_layer, n_head=hf.n_head, n_embd=hf.n_embd, block_size=hf.n_positions,
                           vocab_size=hf.vocab_size, bias=True, gelu=gelu)  # GPT-2 checkpoints always have biases
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
                    raise ValueError(f"shape mismatch for {theirs}: {tuple(src.shape)} vs {tuple(sd[ours].shape)}")
                sd[ours].copy_(src)
        return model

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type, fused=None):
        # fused=None: the fused AdamW kernel wherever this PyTorch has one (CUDA; CPU since 2.4), which
        # is the same math in one kernel per step; False: PyTorch's default AdamW for the device
        # start with all of the candidate parameters that require grad
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        # create optim groups. Any parameters that is 2D will be weight decayed, otherwise no.
        # i.e. all weight tensors in matmuls + embeddings decay, all biases and layernorms don't.
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {'params': decay_params, 'weight_decay': weight_decay},
            {'params': nodecay_params, 'weight_decay': 0.0}
        ]
        num_decay_params = sum(p.numel() for p in decay_params)
        num_nodecay_params = sum(p.numel() for p in nodecay_params)
        print(f"num decayed parameter tensors: {len(decay_params)}, with {num_decay_params:,} parameters")
        print(f"num non-decayed parameter tensors: {len(nodecay_params)}, with {num_nodecay_params:,} parameters")
        use_fused = fused_adamw_available(device_type) if fused is None else bool(fused)
        extra_args = dict(fused=True) if use_fused else dict()
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)
        print(f"using fused AdamW: {use_fused}")
        return optimizer

    def estimate_mfu(self, fwdbwd_per_iter, dt, peak_flops=312e12):
        """
        Model FLOPs utilization: the FLOP/s that fwdbwd_per_iter forward+backward passes of block_size
        tokens in dt seconds imply, as a fraction of peak_flops. The default is an A100's bf16 peak;
        nanogpt_plus.hardware.device_peak_flops gives the peak of the device actually in use.
        """
        # first estimate the number of flops we do per iteration.
        # see PaLM paper Appendix B as ref: https://arxiv.org/abs/2204.02311
        N = self.get_num_params()
        cfg = self.config
        L, H, Q, T = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.block_size
        flops_per_token = 6 * N + 12 * L * H * Q * T
        flops_per_fwdbwd = flops_per_token * T
        flops_per_iter = flops_per_fwdbwd * fwdbwd_per_iter
        # express our flops throughput as ratio of the device's peak flops
        flops_achieved = flops_per_iter * (1.0 / dt)  # per second
        return flops_achieved / peak_flops

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """
        Take a conditioning sequence of indices idx (LongTensor of shape (b,t)) and complete
        the sequence max_new_tokens times, feeding the predictions back into the model each time.
        Most likely you'll want to make sure to be in model.eval() mode of operation for this.
        This is the simple reference; the KV-cached sampler in engine.py is tested against it.
        """
        for _ in range(max_new_tokens):
            # if the sequence context is growing too long we must crop it at block_size
            idx_cond = idx if idx.size(1) <= self.config.block_size else idx[:, -self.config.block_size:]
            # forward the model to get the logits for the index in the sequence
            logits, _ = self(idx_cond)
            # pluck the logits at the final step and scale by desired temperature
            logits = logits[:, -1, :] / temperature
            # optionally crop the logits to only the top k options
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float('Inf')
            # apply softmax to convert logits to (normalized) probabilities
            probs = F.softmax(logits, dim=-1)
            # sample from the distribution
            idx_next = torch.multinomial(probs, num_samples=1)
            # append sampled index to the running sequence and continue
            idx = torch.cat((idx, idx_next), dim=1)

        return idx


# -----------------------------------------------------------------------------
# Hugging Face GPT-2 <-> this model. One table serves both directions: from_hf_model (import) and
# export_hf.py (export). HF's GPT-2 uses Conv1D modules, whose weights are the transpose of nn.Linear's.

HF_ACTIVATIONS = {'gelu_new': 'tanh', 'gelu_pytorch_tanh': 'tanh', 'gelu_fast': 'tanh', 'gelu': 'none'}
EXPORT_ACTIVATIONS = {'tanh': 'gelu_new', 'none': 'gelu'}  # GPTConfig.gelu -> the name export_hf.py writes
_HF_CONV1D = ('attn.c_attn.weight', 'attn.c_proj.weight', 'mlp.c_fc.weight', 'mlp.c_proj.weight')


def hf_key_map(config):
    """ [(our state_dict key, HF GPT2LMHeadModel state_dict key, transpose?)] for every tensor we own. """
    rows = [('transformer.wte.weight', 'transformer.wte.weight', False),
            ('transformer.wpe.weight', 'transformer.wpe.weight', False)]
    for i in range(config.n_layer):
        for name in ('ln_1.weight', 'ln_1.bias', 'attn.c_attn.weight', 'attn.c_attn.bias',
                     'attn.c_proj.weight', 'attn.c_proj.bias', 'ln_2.weight', 'ln_2.bias',
                     'mlp.c_fc.weight', 'mlp.c_fc.bias', 'mlp.c_proj.weight', 'mlp.c_proj.bias'):
            if name.endswith('.bias') and not config.bias:
                continue  # bias=False models have no biases (export writes zeros for HF)
            rows.append((f'transformer.h.{i}.{name}', f'transformer.h.{i}.{name}', name in _HF_CONV1D))
    rows.append(('transformer.ln_f.weight', 'transformer.ln_f.weight', False))
    if config.bias:
        rows.append(('transformer.ln_f.bias', 'transformer.ln_f.bias', False))
    # lm_head.weight is tied to wte in both models, so it needs no row of its own
    return rows


def fused_adamw_available(device_type):
    """ Fused AdamW exists for CUDA since torch 2.0 and for CPU since torch 2.4 (we require >= 2.6). """
    return device_type in ('cuda', 'cpu')
