"""
Checkpoints: atomic save, safe load (weights_only=True), and building a model from any source
('resume' / a training out_dir / a ckpt.pt file / gpt2* / a local Hugging Face GPT-2 directory).

A ckpt.pt is nanoGPT's dict ('model', 'optimizer', 'model_args', 'iter_num', 'best_val_loss', 'config')
plus our own keys ('model_extra_args', 'tokenizer', 'rng', 'loader', 'scaler', 'provenance', ...), all
tensors and plain Python values, so torch.load(weights_only=True) reads it and nanoGPT's sample.py can
too. A readable JSON sidecar (ckpt.json) describes it.

Usage:
    from nanogpt_plus.checkpoint import init_model, save_checkpoint
    model, tokenizer_meta, ckpt = init_model('resume', out_dir='out')   # or 'scratch', 'gpt2', a path
    save_checkpoint(ckpt, 'out/ckpt.pt')
"""

import json
import os
import re
import zipfile

import torch
from torch.overrides import TorchFunctionMode

from model import GPT, GPT2_NAMES, GPTConfig
from nanogpt_plus.dataloader import dataset_dir
from nanogpt_plus.files import atomic_write
from nanogpt_plus.runtime import UserError, error_line
from nanogpt_plus.tokenizer import read_dataset_meta, read_named_tokenizer, tokenizer_fingerprint, tokenizer_kind

HF_TOKENIZER_META = 'nanogpt_tokenizer.json'  # export_hf.py writes it for char and bpe models


def _json_summary(ckpt):
    """ The human-readable part of a checkpoint (no tensors), for ckpt.json. """
    keep = ('model_args', 'model_extra_args', 'iter_num', 'best_val_loss', 'config', 'provenance', 'task')
    summary = {k: ckpt[k] for k in keep if k in ckpt}
    tok = ckpt.get('tokenizer')
    if tok is not None:
        summary['tokenizer'] = {k: v for k, v in tok.items() if k in ('kind', 'vocab_size')}
    return summary


def save_checkpoint(ckpt, path, sidecar=True):
    """
    Atomically write ckpt (a dict of tensors and plain values) to path, plus path's .json sidecar. A failed
    write (a full disk, say) raises files.WriteFailed, a UserError that is also an OSError; the file that was
    at path stays as it was.
    """
    atomic_write(path, lambda f: _torch_save(ckpt, f))
    if sidecar:
        text = json.dumps(_json_summary(ckpt), indent=2, default=str)
        atomic_write(os.path.splitext(path)[0] + '.json', lambda f: f.write(text), binary=False)


def _torch_save(obj, f):
    """
    torch.save into the file object f. When f.write fails (a full disk) torch reports a RuntimeError of its
    own ('unexpected pos ...', 'file write failed') with the OSError only as its context: raise the OSError,
    which says what went wrong, so the atomic writer turns it into one line.
    """
    try:
        torch.save(obj, f)
    except RuntimeError as e:
        cause = e.__cause__ or e.__context__
        if isinstance(cause, OSError):
            raise cause from None
        if 'file write failed' in str(e):
            raise OSError(f"torch.save could not write the file ({error_line(e)})") from None
        raise


def _load_error(path, error):
    """
    The one line for a file torch.load refused: a pickled Python object (unsafe), else corrupt. Never torch's
    own text around it, which advises loading with weights_only=False, i.e. running the file's code.
    """
    text = str(error)
    # torch names the global it refused: 'Unsupported global: GLOBAL x.y' or 'unsupported GLOBAL x.y whose ...'
    found = re.search(r"unsupported (?:global: )?GLOBAL (\S+)", text, re.IGNORECASE)
    if found:
        return UserError(f"checkpoint {path} holds a pickled Python object ({found.group(1)}) that loading could "
                         f"run as code; this project loads only tensors and plain values. Use a checkpoint written "
                         f"by this project, or re-save the file's tensors with torch.save in a trusted session")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and 'weights_only' not in ln]
    detail = next((ln for ln in lines if not ln.startswith(('Please file', 'Check the documentation'))), '')
    detail = detail.split('. ')[0].rstrip('.')[:200]  # its first sentence: what failed, not torch's guesses why
    return UserError(f"checkpoint {path} is corrupt or truncated ({type(error).__name__}: {detail}); "
                     f"use another checkpoint")


def load_checkpoint(path, map_location='cpu'):
    """
    torch.load with weights_only=True and one clear error for a missing or corrupt file. The tensors are
    memory-mapped from the file (torch.save's zip format), not read into RAM: a tensor's pages come from disk
    when it is used, and the processes of one machine share them through the page cache, so resuming a large
    model under torchrun doesn't hold one copy of the whole file per rank.
    """
    if not os.path.exists(path):
        raise UserError(f"no checkpoint at {path}; train a model first (python train.py ...) or check --out_dir")
    # mmap needs the zip format; an old or damaged file is read the ordinary way (and its error reported below)
    mmap = zipfile.is_zipfile(path)
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # truncated zip, foreign pickle, ... all mean the file can't be used
        raise _load_error(path, e) from None
    if not isinstance(ckpt, dict) or 'model' not in ckpt or 'model_args' not in ckpt:
        raise UserError(f"checkpoint {path} has no 'model'/'model_args' entries; is it a nanoGPT checkpoint?")
    return ckpt


def clean_state_dict(state_dict):
    """ Strip the '_orig_mod.' prefix nanoGPT's compiled checkpoints have and drop non-weight buffers. """
    out = {}
    for k, v in state_dict.items():
        for prefix in ('_orig_mod.', 'module.'):
            while k.startswith(prefix):
                k = k[len(prefix):]
        if k.endswith('.attn.bias') and v.dim() == 4:
            continue  # the causal-mask buffer nanoGPT's manual path saved; we rebuild it from block_size
        out[k] = v
    return out


def model_config_from_checkpoint(ckpt, dropout=None):
    args = dict(ckpt['model_args'])
    args.update(ckpt.get('model_extra_args') or {})
    if dropout is not None:
        args['dropout'] = dropout
    try:
        return GPTConfig(**args)
    except TypeError as e:
        raise UserError(f"the checkpoint's model_args don't describe a GPT ({e})") from None


def model_from_checkpoint(ckpt, dropout=None, on_meta=False):
    """
    A GPT with the checkpoint's architecture and weights (on the CPU; move it yourself). on_meta=True: the
    architecture only, on the meta device, and the checkpoint's 'model' tensors are never read (so none of their
    memory-mapped pages are loaded); FSDP's ranks other than 0 get their shards from rank 0 instead.
    """
    config = model_config_from_checkpoint(ckpt, dropout)
    if on_meta:
        return meta_model(config)
    return loaded_model(config, clean_state_dict(ckpt['model']), "the checkpoint's weights don't fit its model_args")


def _view(t):
    """
    What makes two tensors the same view of the same data: torch.load gives the tied wte/lm_head, saved once, as
    two tensor objects over one storage.
    """
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def fp32_copies(state_dict):
    """
    Every tensor of state_dict copied into fresh memory, floating-point ones as float32 (what copy_ into a float32
    model did to an fp16/bf16 file). Entries that are the same view of the same data (the tied wte/lm_head, saved
    once) get one copy: copying GPT-2's 38.6M-value (154 MB) embedding twice would cost time and memory for nothing.
    """
    copies, out = {}, {}
    for name, t in state_dict.items():
        same = _view(t)
        if same not in copies:
            # contiguous: a transposed view (Hugging Face's Conv1D weights) is copied into nn.Linear's layout
            dtype = torch.float32 if t.is_floating_point() else t.dtype
            copies[same] = t.to(dtype, memory_format=torch.contiguous_format, copy=True)
        out[name] = copies[same]
    return out


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


def loaded_model(config, state_dict, misfit):
    """
    A GPT of config holding state_dict's weights, built without drawing the random weights that the load would
    overwrite: the model is made on the meta device (shapes only), then takes fp32 copies of the tensors
    (fresh memory, not pages of the memory-mapped file, which another process truncating it would turn into a
    SIGBUS mid-sample), then gets back the tie and the masks that a meta build can't hold. misfit: the words for
    a state_dict that doesn't fit config (missing or unexpected keys, other shapes), said before load_state_dict's.
    """
    try:
        model = meta_model(config)
    except ValueError as e:  # e.g. n_embd not divisible by n_head
        raise UserError(f"{misfit} ({e})") from None
    copies = fp32_copies(one_head(state_dict, misfit))
    try:
        model.load_state_dict(copies, assign=True)
    except RuntimeError as e:
        raise UserError(f"{misfit} ({_misfit_detail(e)})") from None
    # assign=True gave wte and lm_head a Parameter each (one tensor, one_head made sure): tie them again
    model.transformer.wte.weight = model.lm_head.weight
    model.init_buffers('cpu')  # the causal masks are no state_dict entries: built here for block_size
    print("number of parameters: %.2fM" % (model.get_num_params() / 1e6,))  # GPT() on meta stays quiet
    return model


def checkpoint_tokenizer_meta(ckpt, data_root='data'):
    """
    The tokenizer description for a checkpoint: our 'tokenizer' key; for nanoGPT's checkpoints, the meta of
    the dataset they were trained on (data/<dataset>/meta.pkl, as nanoGPT's sample.py looks), else GPT-2.
    """
    if ckpt.get('tokenizer'):
        return ckpt['tokenizer']
    dataset = (ckpt.get('config') or {}).get('dataset')
    if dataset:
        meta = read_dataset_meta(os.path.join(data_root, dataset))
        if meta is not None:
            return meta
    return {'kind': 'gpt2'}


def tokenizer_known(ckpt, data_root='data'):
    """
    Whether checkpoint_tokenizer_meta(ckpt) describes the tokenizer the model was trained with, rather than
    guessing GPT-2's (a nanoGPT checkpoint whose dataset has no meta file here). None (gpt2*, a Hugging Face
    directory): known.
    """
    if ckpt is None or ckpt.get('tokenizer'):
        return True
    dataset = (ckpt.get('config') or {}).get('dataset')
    return bool(dataset) and read_dataset_meta(os.path.join(data_root, dataset)) is not None


def tokenizer_identity(meta):
    """
    What makes two tokenizer descriptions the same: ('gpt2',), ('char', its {character: id} vocabulary) or
    ('bpe', the fingerprint of its tokenizer.json: the content, whatever its formatting).
    """
    kind = tokenizer_kind(meta)
    if kind == 'char':
        return kind, {str(ch): int(i) for ch, i in (meta.get('stoi') or {}).items()}
    if kind == 'bpe':
        return kind, tokenizer_fingerprint(meta['tokenizer_json']) if meta.get('tokenizer_json') else None
    return (kind,)


TRAIN_REMEDY = "train on a dataset prepared with the model's tokenizer, or from scratch on this one"


def check_dataset_tokenizer(dataset, tokenizer_meta, source, remedy=TRAIN_REMEDY):
    """
    A model trained with one tokenizer reads another's ids as other tokens and trains on (or is scored) without
    an error: refuse a dataset whose meta describes another tokenizer (another kind, another character vocabulary,
    or another bpe tokenizer.json). A dataset without a meta file says nothing about its tokenizer; its ids are
    checked against the model's vocab_size as they are read (dataloader.check_token_ids). remedy: what to do.
    """
    data_dir = dataset_dir(dataset)
    data_meta = read_dataset_meta(data_dir)
    if data_meta is None or tokenizer_identity(data_meta) == tokenizer_identity(tokenizer_meta):
        return
    raise UserError(f"{_tokenizer_difference(data_dir, data_meta, source, tokenizer_meta)}: its token ids would "
                    f"mean other tokens to the model; {remedy}")


def tokenizer_size(meta):
    """ The number of token ids a tokenizer description uses (GPT-2's name none: 50,257), None if unknown. """
    kind = tokenizer_kind(meta)
    size = meta.get('vocab_size') or (len(meta.get('stoi') or {}) if kind == 'char' else None)
    return GPT2_TOKENS if size is None and kind == 'gpt2' else size


def _describe_tokenizer(meta):
    """ A description's kind and size for messages, e.g. 'bpe (8,192 tokens)'. """
    size = tokenizer_size(meta)
    return f"{tokenizer_kind(meta)} ({int(size):,} tokens)" if size else tokenizer_kind(meta)


def check_tokenizer_fits(config, tokenizer_meta, source):
    """
    A tokenizer with more ids than the model has embedding rows is not the model's: its ids would index past the
    table (and fine-tuning's special tokens would share ids with text). Usually a nanoGPT checkpoint whose
    dataset meta.pkl is missing here, so that its tokenizer was guessed to be GPT-2's. Checked by the scripts
    that encode or decode text with it (sample.py, finetune.py, export); training and the loss don't need it.
    """
    size = tokenizer_size(tokenizer_meta or {'kind': 'gpt2'})
    if size and int(size) > config.vocab_size:
        raise UserError(f"the tokenizer of {source} has {int(size):,} tokens but its model only "
                        f"{config.vocab_size:,}, so it is not the model's (a nanoGPT checkpoint is GPT-2 BPE unless "
                        f"data/<dataset>/meta.pkl says otherwise): restore its dataset's meta.pkl")


def _tokenizer_difference(data_dir, data_meta, source, model_meta):
    """ The words for how two different tokenizer descriptions differ, naming both. """
    data, model = tokenizer_identity(data_meta), tokenizer_identity(model_meta)
    if data[0] != model[0] or data[0] == 'bpe':
        other = "another tokenizer.json: " if data[0] == model[0] else ""
        return (f"the dataset {data_dir} is tokenized with {other}{_describe_tokenizer(data_meta)}, the model "
                f"{source} with {_describe_tokenizer(model_meta)}")
    if set(data[1]) == set(model[1]):
        return f"the dataset {data_dir} numbers the model's characters ({source}) differently"
    data_chars, model_chars = ''.join(sorted(data[1])), ''.join(sorted(model[1]))
    return (f"the dataset {data_dir} has another character vocabulary ({len(data_chars)} characters "
            f"{data_chars[:40]!r}) than the model {source} ({len(model_chars)} characters {model_chars[:40]!r})")


def checkpoint_path(init_from, out_dir, resume_file='ckpt.pt'):
    """ The checkpoint file init_from names: 'resume' (out_dir/resume_file), a directory holding ckpt.pt, a file. """
    if init_from == 'resume':
        return os.path.join(out_dir, resume_file)
    if os.path.isfile(init_from):
        return init_from
    if os.path.isdir(init_from) and os.path.exists(os.path.join(init_from, 'ckpt.pt')):
        return os.path.join(init_from, 'ckpt.pt')
    return None


def is_hf_dir(path):
    return os.path.isdir(path) and os.path.exists(os.path.join(path, 'config.json'))


def pretrained_model(init_from, dropout=None):
    """
    A GPT with the weights of gpt2* or a local Hugging Face GPT-2 directory, read without transformers
    (nanogpt_plus.pretrained; GPT.from_pretrained is the reference it is tested against).
    """
    from nanogpt_plus.pretrained import hf_config_and_weights  # safetensors, huggingface_hub: only on this path
    print(f"loading weights from pretrained gpt: {init_from}")
    config, state_dict = hf_config_and_weights(init_from, dropout)
    return loaded_model(config, state_dict, f"the weights of {init_from} don't fit its config.json")


def pretrained_tokenizer_meta(init_from):
    """
    The tokenizer of a pretrained model: GPT-2's, unless export_hf.py left a nanogpt_tokenizer.json (a char
    vocabulary, or a bpe description naming the directory's tokenizer.json, which is read in here).
    """
    meta_path = os.path.join(init_from, HF_TOKENIZER_META)
    if not (os.path.isdir(init_from) and os.path.exists(meta_path)):
        return {'kind': 'gpt2'}
    try:
        with open(meta_path, encoding='utf-8') as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{meta_path} is unreadable ({e}); re-export the model with export_hf.py") from None
    if meta.get('kind') == 'bpe' and 'tokenizer_json' not in meta:
        meta['tokenizer_json'] = read_named_tokenizer(init_from, meta, f"{init_from} was exported",
                                                      "re-export the model with export_hf.py")
    return meta


def build_checkpoint(model, iter_num, best_val_loss, config, tokenizer, provenance, model_state=None, **extra):
    """
    The one checkpoint dict: nanoGPT's keys ('model', 'model_args', 'iter_num', 'best_val_loss', 'config'),
    the model settings beyond nanoGPT's, the tokenizer and provenance, then whatever the caller adds
    (train.py: 'optimizer', 'loader', 'rng', 'scaler'; finetune.py: the task head and its labels).
    model_state replaces model.state_dict() where the caller already holds the full state (FSDP).
    """
    ckpt = {
        'model': model.state_dict() if model_state is None else model_state,
        'model_args': model.config.model_args(),
        'model_extra_args': model.config.model_extra_args(),
        'iter_num': iter_num,
        'best_val_loss': best_val_loss,
        'config': dict(config),
        'tokenizer': tokenizer,
        'provenance': provenance,
    }
    ckpt.update(extra)
    return ckpt


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


GPT2_TOKENS = 50257  # GPT-2's BPE, whose descriptions name no size
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
    args = {k: model_settings[k] for k in ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'dropout', 'gelu')}
    try:
        config = GPTConfig(vocab_size=vocab_size, **args)
        return meta_model(config) if on_meta else GPT(config)
    except ValueError as e:  # e.g. n_embd not divisible by n_head
        raise UserError(f"{e}; change the model settings") from None


def init_model(init_from, out_dir='out', dataset=None, model_settings=None, dropout=None, resume_file='ckpt.pt',
               on_meta=False):
    """
    The one place that turns init_from into (model on the CPU, tokenizer description, checkpoint or None):
      'scratch'        a new GPT from model_settings (n_layer, n_head, n_embd, block_size, bias, dropout, gelu),
                       with the vocabulary and tokenizer of `dataset` (GPT-2's when it has no meta)
      'resume'         out_dir/resume_file (train.py: ckpt.pt; finetune.py: its ckpt_last.pt)
      a path           a ckpt.pt, or a training out_dir holding one
      gpt2*, a path    OpenAI's GPT-2 weights, or a local Hugging Face GPT-2 directory (export_hf.py's too)
    dropout overrides the saved dropout (architecture settings always come from the weights).
    on_meta=True (FSDP's ranks other than 0, which are sent their shards by rank 0): the same architecture on the
    meta device, without initialising or loading weights; the checkpoint (memory-mapped) is still returned, for
    the optimizer, loader and RNG states, its 'model' tensors untouched. gpt2* and Hugging Face directories
    still load real weights (pretrained_model).
    """
    if init_from == 'scratch':
        data_dir = dataset_dir(dataset)
        data_meta = read_dataset_meta(data_dir)
        return scratch_model(model_settings, data_meta, data_dir, on_meta), data_meta or {'kind': 'gpt2'}, None
    ckpt_path = checkpoint_path(init_from, out_dir, resume_file)
    if ckpt_path is not None:
        ckpt = load_checkpoint(ckpt_path, map_location='cpu')
        return model_from_checkpoint(ckpt, dropout, on_meta), checkpoint_tokenizer_meta(ckpt), ckpt
    if init_from in GPT2_NAMES or is_hf_dir(init_from):
        return pretrained_model(init_from, dropout), pretrained_tokenizer_meta(init_from), None
    raise UserError(f"don't know how to load init_from='{init_from}': use scratch, resume (with --out_dir), a "
                    f"training out_dir or ckpt.pt, gpt2/gpt2-medium/gpt2-large/gpt2-xl, or a local Hugging Face "
                    f"GPT-2 directory")


def describe_source(init_from, out_dir='out', resume_file='ckpt.pt'):
    """ What init_model(init_from, out_dir) reads, for messages: the checkpoint's path, else init_from. """
    return checkpoint_path(init_from, out_dir, resume_file) or init_from
