"""
Making a GPT, the one place for each way: a new random model from the settings (its vocabulary from the
dataset), the architecture alone on the meta device (no memory, no random draws), a model holding given
weights (a checkpoint's or a Hugging Face directory's), OpenAI's gpt2* weights, and cropping a model to a
shorter context. checkpoint.init_model picks among them for an init_from.

Usage:
    from nanogpt_plus.build import loaded_model, meta_model, scratch_model
    model = scratch_model(cfg, data_meta, data_dir)         # cfg: n_layer, n_head, n_embd, block_size, ...
    model = loaded_model(config, state_dict, "the weights of x don't fit its config")
"""

import torch
from torch.overrides import TorchFunctionMode

from model import GPT, MODERN, GPTConfig
from nanogpt_plus.errors import UserError
from nanogpt_plus.pretrained import hf_config, hf_config_and_weights


def _view(t):
    """
    What makes two tensors the same view of the same data: torch.load gives the tied wte/lm_head, saved once, as
    two tensor objects over one storage.
    """
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def fp32_copies(state_dict, source='the weights'):
    """
    Every tensor of state_dict copied into fresh memory, floating-point ones as float32 (what copy_ into a float32
    model did to an fp16/bf16 file). Entries that are the same view of the same data (the tied wte/lm_head, saved
    once) get one copy: copying GPT-2's 38.6M-value (154 MB) embedding twice would cost time and memory for nothing.
    A NaN or inf in a copy is refused in one line naming source (the file) and the first tensor holding one.
    """
    copies, out = {}, {}
    for name, t in state_dict.items():
        same = _view(t)
        if same not in copies:
            # contiguous: a transposed view (Hugging Face's Conv1D weights) is copied into nn.Linear's layout
            dtype = torch.float32 if t.is_floating_point() else t.dtype
            copies[same] = t.to(dtype, memory_format=torch.contiguous_format, copy=True)
            if dtype == torch.float32 and not finite(copies[same]):
                raise UserError(f"{source} holds NaN or infinite values (the first in {name}): a model with them "
                                f"computes nothing but NaN; use another copy, or an earlier checkpoint of the run")
        out[name] = copies[same]
    return out


def finite(t):
    """
    Whether every value of a float32 tensor is finite. Its sum is one read of it, without isfinite's bool tensor:
    a GPT-2 124M's weights take ~30 ms on 2 CPU threads, ~50 ms on one (isfinite().all(): ~460 / ~720 ms), beside
    ~310 ms for the copies themselves. A NaN or inf anywhere makes the sum non-finite; only then, as finite values
    can overflow a sum too, is every value looked at.
    """
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def _misfit_detail(error):
    """ What load_state_dict's error says after its header line (the missing keys, the first wrong shape), cut. """
    lines = [ln.strip() for ln in str(error).strip().splitlines()]
    return '; '.join(lines[1:] or lines)[:300]


def one_head(state_dict, misfit):
    """
    Our GPT's head is its token embedding, one matrix: a file whose lm_head.weight and transformer.wte.weight
    differ holds an untied head, which loading would silently replace with one of the two. Refused instead; a
    head saved as an equal copy (a Hugging Face file may hold one) is replaced by wte, so it is copied only once.
    """
    wte, head = state_dict.get('transformer.wte.weight'), state_dict.get('lm_head.weight')
    if wte is None or head is None or _view(wte) == _view(head):
        return state_dict  # saved once (the usual case: not compared, 60 ms for GPT-2), or missing (reported later)
    if wte.shape != head.shape or not torch.equal(wte, head):  # torch.equal: an fp16 file's tensors compare exactly
        raise UserError(f"{misfit} (its lm_head.weight differs from transformer.wte.weight: an untied output head, "
                        f"which this GPT can't hold)")
    return dict(state_dict, **{'lm_head.weight': wte})


def loaded_model(config, state_dict, misfit, source='the checkpoint'):
    """
    A GPT of config holding state_dict's weights, built without drawing the random weights that the load would
    overwrite: the model is made on the meta device (shapes only), then takes fp32 copies of the tensors
    (fresh memory, not pages of the memory-mapped file, which another process truncating it would turn into a
    SIGBUS mid-sample; each checked for NaN and inf), then gets back the tie and the masks that a meta build can't
    hold. misfit: the words for a state_dict that doesn't fit config (missing or unexpected keys, other shapes),
    said before load_state_dict's; source: where the tensors come from (the file), for the NaN/inf refusal.
    """
    try:
        model = meta_model(config)
    except ValueError as e:  # e.g. n_embd not divisible by n_head
        raise UserError(f"{misfit} ({e})") from None
    copies = fp32_copies(one_head(state_dict, misfit) if config.tie_embeddings else state_dict, source)
    try:
        model.load_state_dict(copies, assign=True)
    except RuntimeError as e:
        raise UserError(f"{misfit} ({_misfit_detail(e)})") from None
    if config.tie_embeddings:
        # assign=True gave wte and lm_head a Parameter each (one tensor, one_head made sure): tie them again
        model.transformer.wte.weight = model.lm_head.weight
    model.init_buffers('cpu')  # the causal masks (and rotary tables) are no state_dict entries: built for block_size
    print("number of parameters: %.2fM" % (model.get_num_params() / 1e6,))  # GPT() on meta stays quiet
    return model


def pretrained_model(init_from, dropout=None, on_meta=False):
    """
    A GPT with the weights of gpt2* or a local Hugging Face GPT-2 directory, read without transformers
    (nanogpt_plus.pretrained; GPT.from_pretrained is the reference it is tested against). on_meta=True: its
    architecture only, on the meta device, from config.json alone (FSDP's ranks other than 0: gpt2-xl's 6 GB of
    float32 weights are read by rank 0 only, which sends every rank its shards).
    """
    if on_meta:
        return meta_model(hf_config(init_from, dropout))
    print(f"loading weights from pretrained gpt: {init_from}")
    config, state_dict, path = hf_config_and_weights(init_from, dropout)
    return loaded_model(config, state_dict, f"the weights of {init_from} don't fit its config.json", path)


class _ShapesOnly(TorchFunctionMode):
    """
    While a model is built on the meta device, the calls that only fill in values (nn.init's normal_, the causal
    mask's tril) return their tensor unchanged: on meta they compute nothing anyway, but PyTorch runs them through
    its Python reference kernels, whose first call imports torch._dynamo, ~2 s of a sampling run's start-up.
    A tensor that isn't on meta (one made with an explicit device) is computed as usual: it would be used.
    """
    VALUES_ONLY = {torch.Tensor.normal_, torch.nn.init.normal_, torch.tril}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.VALUES_ONLY:
            tensor = args[0] if args else kwargs['tensor']  # nn.init passes its tensor as tensor=
            if tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def meta_model(config):
    """ A GPT of this config on the meta device: shapes only, no storage, no random draws (the RNG is untouched). """
    with torch.device('meta'), _ShapesOnly():
        return GPT(config)


PAD_MULTIPLE = 64  # a byte-level vocabulary is padded up to a multiple of this: matmul kernels like the shape
PADDED_KINDS = ('gpt2', 'bpe')  # the byte-level tokenizers, whose vocabularies are padded


def model_vocab_size(data_meta, data_dir):
    """
    The vocab_size of a new model for a dataset's tokenizer description, printing how it was found: a
    character vocabulary's exact size (nanoGPT's 65 for Shakespeare), as for a meta that names no kind; a
    byte-level one's (gpt2, bpe) padded up to a multiple of 64 (GPT-2's 50,257 -> 50,304). The padded ids never
    appear in the data and are never sampled (the engine draws only below the tokenizer's vocab_size); they
    only make the matmuls faster.
    """
    if data_meta is None or not data_meta.get('vocab_size'):
        print("defaulting to vocab_size of GPT-2 to 50304 (50257 rounded up for efficiency)")
        return 50304
    vocab_size = int(data_meta['vocab_size'])
    print(f"found vocab_size = {vocab_size} (inside {data_dir})")
    if data_meta.get('kind') not in PADDED_KINDS:  # a character vocabulary (or a meta.json naming no kind)
        return vocab_size
    padded = -(-vocab_size // PAD_MULTIPLE) * PAD_MULTIPLE
    if padded != vocab_size:
        print(f"padded vocab_size to {padded:,} (a multiple of {PAD_MULTIPLE}, for speed; ids from {vocab_size:,} "
              f"up are never sampled)")
    return padded


def scratch_model(model_settings, data_meta, data_dir, on_meta=False):
    """ A new random GPT from the model settings, its vocab_size from the dataset's meta (model_vocab_size). """
    print("Initializing a new model from scratch")
    vocab_size = model_vocab_size(data_meta, data_dir)
    names = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'dropout', 'gelu') + tuple(MODERN)
    args = {k: model_settings[k] for k in names if k in model_settings}
    try:
        config = GPTConfig(vocab_size=vocab_size, **args)
        return meta_model(config) if on_meta else GPT(config)
    except ValueError as e:  # e.g. n_embd not divisible by n_head
        raise UserError(f"{e}; change the model settings") from None


def fit_block_size(model, block_size):
    """ Crop the model to block_size (model surgery) when it is smaller; a larger one is an error. 0 = keep. """
    if block_size and block_size < model.config.block_size:
        model.crop_block_size(block_size)  # model surgery: keeps the first block_size positions of wpe
    elif block_size > model.config.block_size:
        raise UserError(f"block_size {block_size} is larger than the model's {model.config.block_size}; "
                        f"use --block_size={model.config.block_size} or less")

