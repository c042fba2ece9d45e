"""
Weight formats for inference: how a trained GPT's matrices are stored and read while it samples or
is evaluated, independent of the compute dtype (--dtype, autocast). Decoding one token reads every
weight once, so on a CPU the tokens/s of sampling is set by the bytes per weight:

  float32   the checkpoint's weights as they are (the default, exact). sample.py on a CPU also packs them
            for oneDNN's float32 kernel (torch.ops.mkldnn._linear_pointwise): the same float32 arithmetic,
            summed in another order, so logits differ from the plain matmul's in the last bits only.
  bfloat16  every matrix rounded to bfloat16: half the bytes. The matmul multiplies bfloat16 weights with the
            activations rounded to bfloat16 and sums in float32; LayerNorm, attention, softmax and the
            residual stream stay in the compute dtype.
  int8      every output row of every matrix scaled to int8 (symmetric, per channel: scale = max|w| / 127,
            kept in bfloat16): a quarter of the bytes. PyTorch's own weight-only kernel
            (torch._weight_int8pack_mm) multiplies them with the activations rounded to bfloat16, sums in
            float32, applies the scales and rounds the result to bfloat16; the bias is added in float32.

The matrices are the four Linears of each Block and the output head. The token embedding is the
head's matrix (tied), so it is looked up in the same rounded weights; the position embedding and the
LayerNorms, ~0.7% of the bytes, stay as they are. set_weights converts a model in place, for
inference only: the converted model has no gradients and is never saved.

Usage:
    from nanogpt_plus.weight_formats import set_weights
    model.eval()
    set_weights(model, 'int8', vocab_size=50257)   # vocab_size: score only the tokenizer's real ids
"""

import functools

import torch
import torch.nn as nn
from torch.nn import functional as F

# the weights setting's choices (sample.py, eval.py, finetune.py's predictions): how the matrices
# are stored and read; set_weights acts on them
WEIGHTS = ('float32', 'bfloat16', 'int8')

# On a CPU without AVX-512, PyTorch's bfloat16 and int8 matmuls are fast for a few rows only (a
# decoding step of a few samples) and get slower per row than float32 as rows are added; above these
# row counts the half- or quarter-width weights are widened to the compute dtype for the call and
# the ordinary matmul runs (the same products: a bfloat16 or int8 value is exact in float32). For
# bfloat16, GPUs and AVX-512 CPUs use the narrow kernel always; the int8 kernel is CPU-only, so a
# GPU always widens.
BF16_MAX_ROWS = 2
INT8_MAX_ROWS = 16


@functools.lru_cache(maxsize=None)
def _cpu_has_bf16_kernels():
    return torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _bf16_fast(device):
    """
    Whether bfloat16 matmuls run at full width on device: CUDA, or a CPU whose oneDNN has bf16
    kernels.
    """
    return device.type != 'cpu' or _cpu_has_bf16_kernels()


def _widened_linear(x, weight, bias):
    """
    x @ weight.T + bias as a float32 matmul of the widened operands, with autocast off: under
    --dtype=bfloat16 it would narrow them back to bfloat16 and run the slow kernel (and, for int8,
    round weight * scale).
    """
    with torch.autocast(x.device.type, enabled=False):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float())


class PackedLinear(nn.Module):
    """ A float32 Linear whose weight is reordered once into oneDNN's blocked layout (CPU only). """

    def __init__(self, linear, rows=None):
        super().__init__()
        weight = linear.weight.detach()[:rows]
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        # packed for 1-row inputs: decoding
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.bias = None if linear.bias is None else linear.bias.detach()[:rows].clone()

    def forward(self, x):
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class BF16Linear(nn.Module):
    """ A Linear with its weight and bias stored in bfloat16; returns the input's dtype. """

    def __init__(self, linear, rows=None):
        super().__init__()
        self.register_buffer('weight', linear.weight.detach()[:rows].to(torch.bfloat16))
        bias = None if linear.bias is None else linear.bias.detach()[:rows].to(torch.bfloat16)
        self.register_buffer('bias', bias)

    def forward(self, x):
        xb = x.to(torch.bfloat16)
        if x.numel() // x.size(-1) <= BF16_MAX_ROWS or _bf16_fast(x.device):
            return F.linear(xb, self.weight, self.bias).to(x.dtype)
        # many rows on a CPU without bf16 kernels: the same products and float32 sums in a float32
        # matmul, rounded to bfloat16 as the bf16 kernel's output is
        return _widened_linear(xb, self.weight, self.bias).to(torch.bfloat16).to(x.dtype)

    def lookup(self, idx):
        """
        Rows idx of the weight, as an embedding table (the tied token embedding): (...,
        in_features).
        """
        return self.weight[idx]


def quantize_int8(weight):
    """
    weight (N, K) -> (int8 (N, K), bfloat16 scales (N,)): symmetric, one scale per output row, so
    that
    |weight - q * scale| <= scale / 2 everywhere. The scale is max|w| / 127 rounded up to a bfloat16 (the
    kernel's dtype for it): rounded down, the largest weights would need |q| > 127.
    """
    weight = weight.detach().float()
    exact = weight.abs().amax(dim=1).clamp(min=1e-30) / 127
    scale = exact.to(torch.bfloat16)
    # positive bfloat16s: the bit pattern + 1
    next_up = (scale.view(torch.int16) + 1).view(torch.bfloat16)
    scale = torch.where(scale.float() < exact, next_up, scale)
    q = torch.round(weight / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


class Int8Linear(nn.Module):
    """
    A Linear with an int8 weight and one bfloat16 scale per output row (weight-only quantization).
    """

    def __init__(self, linear, rows=None):
        super().__init__()
        q, scale = quantize_int8(linear.weight[:rows])
        self.register_buffer('weight', q)
        # bfloat16: the kernel takes them in the activations' dtype
        self.register_buffer('scale', scale)
        self.register_buffer('bias',
                             None if linear.bias is None else linear.bias.detach()[:rows].clone())

    def forward(self, x):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(torch.bfloat16)
        if x2.device.type == 'cpu' and x2.size(0) <= INT8_MAX_ROWS:
            # (rows, N) bfloat16
            y = torch._weight_int8pack_mm(x2.contiguous(), self.weight, self.scale)
        else:  # many rows, or a GPU (the kernel is CPU-only): the same products in a float32 matmul
            y = _widened_linear(x2,
                                self.weight.float() * self.scale.float()[:, None],
                                None).to(torch.bfloat16)
        y = y.float() if self.bias is None else y.float() + self.bias
        return y.view(*shape[:-1], y.size(-1)).to(x.dtype)

    def lookup(self, idx):
        """
        Rows idx of the dequantized weight, as an embedding table: (..., in_features), float32.
        """
        return self.weight[idx].float() * self.scale[idx, None].float()


class TiedLookup(nn.Module):
    """ The token embedding read from the converted output head (the weights are tied in GPT-2). """

    def __init__(self, head):
        super().__init__()
        self.head = [head]  # a list, so the head is not registered twice as a submodule

    def forward(self, idx):
        return self.head[0].lookup(idx)


def block_matrices(model):
    """
    (module, attribute name) of the four Linears of every Block, in model order: what set_weights
    converts.
    """
    return [(parent, name) for block in model.transformer.h
            for parent, name in ((block.attn, 'c_attn'), (block.attn, 'c_proj'),
                                 (block.mlp, 'c_fc'), (block.mlp, 'c_proj'))]


def convert_linear(linear, weights, pack, rows=None):
    """ The inference module for one nn.Linear (rows: keep only the first `rows` outputs). """
    if weights == 'bfloat16':
        return BF16Linear(linear, rows)
    if weights == 'int8':
        return Int8Linear(linear, rows)
    if pack:
        return PackedLinear(linear, rows)
    return linear


def can_pack(device, dtype):
    """
    oneDNN's packed float32 Linear applies to float32 compute on a CPU whose PyTorch has oneDNN.
    """
    return (torch.device(device).type == 'cpu' and dtype == torch.float32 and
            torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, '_linear_pointwise'))


@torch.no_grad()
def set_weights(model, weights, pack=False, vocab_size=None):
    """
    Convert model's matrices in place to the weight format `weights` (one of WEIGHTS) for inference;
    call after model.to(device) and model.eval(). pack=True: float32 matrices are packed for oneDNN
    (a CPU with float32 compute: see can_pack). vocab_size: the head scores only ids below it (a
    padded vocabulary's last rows are never sampled), so the logits have vocab_size columns; None
    keeps every row (a loss needs them all). Returns the model.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights == 'float32' and not pack:
        return model  # nothing to do: the checkpoint's own float32 weights and matmul
    for parent, name in block_matrices(model):
        setattr(parent, name, convert_linear(getattr(parent, name), weights, pack))
    rows = vocab_size if vocab_size is not None and vocab_size < model.config.vocab_size else None
    head = convert_linear(model.lm_head, weights, pack, rows)
    # the embedding reads the head's rounded matrix
    if weights != 'float32' and model.config.tie_embeddings:
        model.transformer.wte = TiedLookup(head)
    model.lm_head = head
    return model
