"""
Where a model comes from: every init_from, turned into (model on the CPU, tokenizer description,
checkpoint or None) by one function, with the model construction each one needs and the rules a
resumed or fine-tuned run keeps.
  'scratch'   a new random GPT from the model settings, its vocabulary from the dataset's tokenizer
  'resume'    the run in out_dir: its checkpoint's architecture, weights and training state
  a path      a ckpt.pt, or a training out_dir holding one: its weights (training starts at iter 0)
  gpt2*       OpenAI's GPT-2 weights, or a local Hugging Face GPT-2 directory (read by hf_import.py)
A model that is about to receive weights is built on the meta device (shapes only, no random draws)
and then takes float32 copies of them, each checked finite; nothing is cropped or rebuilt on resume.

Usage:
    from nanogpt_plus.init_from import init_model
    model, tokenizer_meta, ckpt = init_model('resume', out_dir='out')   # or 'scratch', 'gpt2', a path
"""

import dataclasses
import os
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from model import GPT, GPT2_NAMES, MODERN, GPTConfig
from nanogpt_plus.checkpoint import (
    CHECKPOINT,
    checkpoint_path,
    load_checkpoint,
    require_entries,
    resume_point,
    saved_count,
)
from nanogpt_plus.dataset import check_dataset_tokenizer, find_dataset, is_prepared, read_dataset_meta, tokenizer_size
from nanogpt_plus.errors import NothingToDo, UserError
from nanogpt_plus.machine import check_model_memory

# The settings a new GPT is built from: GPTConfig's fields but vocab_size, which the dataset gives
# (a frozen dataclass, so that a script hands them over with cfg.select(ModelSpec)). A loaded model
# takes its dropout and (a shorter) block_size.
ModelSpec = dataclasses.make_dataclass('ModelSpec', frozen=True, fields=[
    (f.name, f.type) for f in dataclasses.fields(GPTConfig) if f.name != 'vocab_size'])


def init_model(init_from, out_dir='out', dataset=None, spec=None, dropout=None,
               resume_file=CHECKPOINT, on_meta=False):
    """
    The one place that turns init_from into (model on the CPU, tokenizer description, checkpoint or
    None):
      'scratch'        a new GPT of spec (a ModelSpec: n_layer, n_head, ..., gelu, the modern ones),
                       with the vocabulary and tokenizer of `dataset` (a dataset.Dataset; GPT-2's when it has
                       no meta, or when dataset is None)
      'resume'         out_dir/resume_file (train.py: ckpt.pt; finetune.py: its ckpt_last.pt)
      a path           a ckpt.pt, or a training out_dir holding one
      gpt2*, a path    OpenAI's GPT-2 weights, or a local Hugging Face GPT-2 directory (export_hf.py's too)
    dropout overrides the saved dropout (architecture settings always come from the weights).
    on_meta=True (FSDP's ranks other than 0, which are sent their shards by rank 0): the same
    architecture on the meta device, without initialising or loading weights; the checkpoint
    (memory-mapped) is still returned, for the optimizer, loader and RNG states, its 'model' tensors
    untouched; gpt2* and Hugging Face directories give their config.json's architecture without
    reading (or downloading) the weights.
    """
    if init_from == 'scratch':
        if spec is None:  # sample.py, eval.py, export_hf.py: a script that reads weights
            raise UserError(
                "init_from=scratch makes a new, untrained model, which only train.py and finetune.py "
                "do; pass resume (with --out_dir), a ckpt.pt or out_dir, gpt2* or a Hugging Face "
                "directory")
        data_meta, data_dir = (dataset.meta, dataset.directory) if dataset is not None else (None,
                                                                                             None)
        model = scratch_model(spec, data_meta, data_dir, on_meta)
        return model, data_meta or {'kind': 'gpt2'}, None
    ckpt_path = checkpoint_path(init_from, out_dir, resume_file)
    if ckpt_path is not None:
        ckpt = load_checkpoint(ckpt_path, map_location='cpu')
        return model_from_checkpoint(ckpt, dropout, on_meta,
                                     ckpt_path), checkpoint_tokenizer_meta(ckpt, path=ckpt_path), ckpt
    if init_from in GPT2_NAMES or is_hf_dir(init_from):
        # only for Hugging Face weights
        from nanogpt_plus.hf_import import pretrained_tokenizer_meta
        return pretrained_model(init_from, dropout,
                                on_meta), pretrained_tokenizer_meta(init_from), None
    raise unknown_source(init_from)


def unknown_source(init_from):
    """
    The one line for an init_from that names nothing here: a path that is not on this machine, or a
    typo.
    """
    if not os.path.exists(init_from):
        return UserError(
            f"init_from={init_from}: there is nothing at that path on this machine, and it is none of "
            f"scratch, resume, gpt2/gpt2-medium/gpt2-large/gpt2-xl; check the path (every node of a "
            f"run must see it)")
    return UserError(
        f"init_from={init_from}: there is no ckpt.pt, training out_dir or Hugging Face GPT-2 directory "
        f"at that path; pass one of those, scratch, resume (with --out_dir) or gpt2*")


def init_training_model(source, spec, data, on_meta=False):
    """
    train.py's init_model: (the plain GPT on the CPU, its tokenizer description, the checkpoint read
    or None) for source (a ModelSource: its init_from and out_dir), said in one line, checked
    against the dataset the run trains on (a dataset.Dataset): weights with their own tokenizer must
    have the dataset's, and the dataset's vocabulary must fit the model. spec (a ModelSpec): a new
    model's settings; loaded weights take its dropout and may train on shorter windows (its
    block_size: a resume has the checkpoint's).
    on_meta: FSDP's ranks other than 0, which get their shards of rank 0's weights (see init_model).
    """
    init_from, out_dir = source.init_from, source.out_dir
    if init_from == 'resume':
        print(f"Resuming training from {out_dir}")
    elif init_from != 'scratch':
        path = checkpoint_path(init_from, out_dir)
        if path is not None:
            print(f"Initializing from the weights in {path} (training starts at iter 0)")
        elif init_from in GPT2_NAMES or is_hf_dir(init_from):
            print(f"Initializing from OpenAI GPT-2 weights: {init_from}")
    # the architecture comes from the weights (a new model: from the settings); dropout from the
    # settings always
    model, tokenizer_meta, ckpt = init_model(init_from, out_dir, dataset=data, spec=spec,
                                             dropout=spec.dropout, on_meta=on_meta)
    # a new model has the dataset's tokenizer; weights come with their own (unless nanoGPT's left it
    # unknown)
    if init_from != 'scratch' and tokenizer_known(ckpt):
        check_dataset_tokenizer(data.directory, data.meta, tokenizer_meta,
                                describe_source(init_from, out_dir))
    fit_block_size(model, spec.block_size)
    if data.vocab_size and data.vocab_size > model.config.vocab_size:
        raise UserError(f"the dataset's vocabulary ({data.vocab_size}) is larger than the model's "
                        f"({model.config.vocab_size}); train from scratch on this dataset")
    return model, tokenizer_meta, ckpt


def check_new_model_fits(spec, dataset, batch_size, attention, on_cpu):
    """
    train.py's check before any work, for a new model (init_from='scratch'; weights that trained
    before have a size that fitted): one of spec (a ModelSpec) whose first step can't fit in memory
    is refused in one line (check_model_memory), counted at the vocabulary of dataset (its name; its
    meta alone is read). A dataset not prepared yet is not judged here: a memory figure of a
    guessed vocabulary would hide the thing to fix, which opening the data says (with the
    prepare.py to run).
    """
    if dataset is not None and not is_prepared(dataset):  # (None: bench.py's random tokens)
        return
    try:
        # (no dataset: random tokens, GPT-2's padded vocabulary)
        vocab_size = (dataset and find_dataset(dataset, splits=()).vocab_size) or 50304
    except UserError:
        # a meta file that can't be read: said later, by every rank with one verdict (this runs
        # before they meet)
        vocab_size = 50304
    # (settings.check_model_shape refused the shapes GPTConfig would)
    config = GPTConfig(vocab_size=vocab_size, **dataclasses.asdict(spec))
    check_model_memory(config, batch_size, attention, on_cpu)


def is_hf_dir(path):
    return os.path.isdir(path) and os.path.exists(os.path.join(path, 'config.json'))


def describe_source(init_from, out_dir='out', resume_file=CHECKPOINT):
    """
    What init_model(init_from, out_dir) reads, for messages: the checkpoint's path, else init_from.
    """
    return checkpoint_path(init_from, out_dir, resume_file) or init_from


# -----------------------------------------------------------------------------
# what a checkpoint says of its model: its architecture, its weights without the wrappers' prefixes, its
# tokenizer

def clean_state_dict(state_dict):
    """
    Strip the '_orig_mod.' prefix nanoGPT's compiled checkpoints have and drop non-weight buffers.
    """
    out = {}
    for k, v in state_dict.items():
        for prefix in ('_orig_mod.', 'module.'):
            while k.startswith(prefix):
                k = k[len(prefix):]
        if k.endswith('.attn.bias') and v.dim() == 4:
            # the causal-mask buffer nanoGPT's manual path saved; we rebuild it from block_size
            continue
        out[k] = v
    return out


def model_config_from_checkpoint(ckpt, dropout=None):
    """ The GPTConfig of a checkpoint's model_args and model_extra_args; dropout replaces the saved one. """
    args = dict(ckpt['model_args'])
    args.update(ckpt.get('model_extra_args') or {})
    if dropout is not None:
        args['dropout'] = dropout
    try:
        return GPTConfig(**args)
    except TypeError as e:
        raise UserError(f"the checkpoint's model_args don't describe a GPT ({e})") from None


def checkpoint_tokenizer_meta(ckpt, data_root='data', path='the checkpoint'):
    """
    The tokenizer description for a checkpoint (at path, for messages): our 'tokenizer' key; for
    nanoGPT's checkpoints, the meta of the dataset they were trained on (data/<dataset>/meta.pkl,
    as nanoGPT's sample.py looks), else GPT-2.
    """
    if ckpt.get('tokenizer'):
        return ckpt['tokenizer']
    if 'provenance' in ckpt:
        # ours (nanoGPT's have no provenance) always hold their tokenizer: guessing GPT-2's would
        # blame a missing meta.pkl
        raise UserError(f"{path} has no 'tokenizer' entry, which every checkpoint of this project "
                        f"holds: it was edited or written by other code; use another checkpoint")
    dataset = (ckpt.get('config') or {}).get('dataset')
    if dataset:
        meta = read_dataset_meta(os.path.join(data_root, dataset))
        if meta is not None:
            return meta
    return {'kind': 'gpt2'}


def tokenizer_known(ckpt, data_root='data'):
    """
    Whether checkpoint_tokenizer_meta(ckpt) describes the tokenizer the model was trained with,
    rather than guessing GPT-2's (a nanoGPT checkpoint whose dataset has no meta file here). None
    (gpt2*, a Hugging Face directory): known.
    """
    if ckpt is None or ckpt.get('tokenizer'):
        return True
    dataset = (ckpt.get('config') or {}).get('dataset')
    return bool(dataset) and read_dataset_meta(os.path.join(data_root, dataset)) is not None


# -----------------------------------------------------------------------------
# making a GPT: a new one, its architecture alone, one holding given weights, cropped to a shorter
# context

def scratch_model(spec, data_meta, data_dir, on_meta=False):
    """ A new random GPT of spec (a ModelSpec), its vocab_size the dataset's (model_vocab_size). """
    print("Initializing a new model from scratch")
    vocab_size = model_vocab_size(data_meta, data_dir)
    try:
        config = GPTConfig(vocab_size=vocab_size, **dataclasses.asdict(spec))
        return meta_model(config) if on_meta else GPT(config)
    except ValueError as e:  # e.g. n_embd not divisible by n_head
        raise UserError(f"{e}; change the model settings") from None


# vocabulary padding, in one place: a byte-level vocabulary (of the PADDED_KINDS of tokenizer) is padded
# up to a multiple of PAD_MULTIPLE, as matmul kernels like the shape (model_vocab_size); the ids past the
# tokenizer's are padding (padded_tokenizer_size)
PAD_MULTIPLE = 64
PADDED_KINDS = ('gpt2', 'bpe')


def model_vocab_size(data_meta, data_dir):
    """
    The vocab_size of a new model for a dataset's tokenizer description, printing how it was found:
    a character vocabulary's exact size (nanoGPT's 65 for Shakespeare), as for a meta that names no
    kind; a byte-level one's (gpt2, bpe) padded up to a multiple of 64 (GPT-2's 50,257 -> 50,304).
    The padded ids never appear in the data and are never sampled (the engine draws only below the
    tokenizer's vocab_size); they only make the matmuls faster.
    """
    if data_meta is None or not data_meta.get('vocab_size'):
        print("defaulting to vocab_size of GPT-2 to 50304 (50257 rounded up for efficiency)")
        return 50304
    vocab_size = int(data_meta['vocab_size'])
    print(f"found vocab_size = {vocab_size} (inside {data_dir})")
    # a character vocabulary (or a meta.json naming no kind)
    if data_meta.get('kind') not in PADDED_KINDS:
        return vocab_size
    padded = -(-vocab_size // PAD_MULTIPLE) * PAD_MULTIPLE
    if padded != vocab_size:
        print(
            f"padded vocab_size to {padded:,} (a multiple of {PAD_MULTIPLE}, for speed; ids from {vocab_size:,} "
            f"up are never sampled)")
    return padded


def padded_tokenizer_size(model_vocab, tokenizer_meta):
    """
    The tokenizer's vocabulary size where it is below the model's vocab_size (a byte-level
    vocabulary padded to a multiple of PAD_MULTIPLE), else None: a dataset holding ids in the padding
    was made with another tokenizer.
    """
    size = tokenizer_size(tokenizer_meta or {'kind': 'gpt2'})
    return int(size) if size and int(size) < model_vocab else None


class _ShapesOnly(TorchFunctionMode):
    """
    While a model is built on the meta device, the calls that only fill in values (nn.init's
    normal_, the causal mask's tril) return their tensor unchanged: on meta they compute nothing
    anyway, but PyTorch runs them through its Python reference kernels, whose first call imports
    torch._dynamo, ~2 s of a sampling run's start-up. A tensor that isn't on meta (one made with an
    explicit device) is computed as usual: it would be used.
    """
    VALUES_ONLY = {torch.Tensor.normal_, torch.nn.init.normal_, torch.Tensor.tril_}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.VALUES_ONLY:
            tensor = args[0] if args else kwargs['tensor']  # nn.init passes its tensor as tensor=
            if tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def meta_model(config):
    """
    A GPT of this config on the meta device: shapes only, no storage, no random draws (the RNG is
    untouched).
    """
    with torch.device('meta'), _ShapesOnly():
        return GPT(config)


def model_from_checkpoint(ckpt, dropout=None, on_meta=False, source='the checkpoint'):
    """
    A GPT with the checkpoint's architecture and weights (on the CPU; move it yourself).
    on_meta=True: the architecture only, on the meta device, and the checkpoint's 'model' tensors
    are never read (so none of their memory-mapped pages are loaded); FSDP's ranks other than 0 get
    their shards from rank 0 instead. source: the file, for messages (a NaN in its weights names
    it).
    """
    config = model_config_from_checkpoint(ckpt, dropout)
    if on_meta:
        return meta_model(config)
    return loaded_model(config, clean_state_dict(ckpt['model']),
                        "the checkpoint's weights don't fit its model_args", source)


def pretrained_model(init_from, dropout=None, on_meta=False):
    """
    A GPT with the weights of gpt2* or a local Hugging Face GPT-2 directory, read without
    transformers (nanogpt_plus.hf_import; GPT.from_pretrained is the reference it is tested
    against). on_meta=True: its architecture only, on the meta device, from config.json alone
    (FSDP's ranks other than 0: gpt2-xl's 6 GB of float32 weights are read by rank 0 only, which
    sends every rank its shards).
    """
    # imported here: only a run that starts from Hugging Face weights reads them
    from nanogpt_plus.hf_import import hf_config, hf_config_and_weights
    if on_meta:
        return meta_model(hf_config(init_from, dropout))
    print(f"loading weights from pretrained gpt: {init_from}")
    config, state_dict, path = hf_config_and_weights(init_from, dropout)
    return loaded_model(config, state_dict, f"the weights of {init_from} don't fit its config.json",
                        path)


def loaded_model(config, state_dict, misfit, source='the checkpoint'):
    """
    A GPT of config holding state_dict's weights, built without drawing the random weights that the
    load would overwrite: the model is made on the meta device (shapes only), then takes fp32 copies
    of the tensors (fresh memory, not pages of the memory-mapped file, which another process
    truncating it would turn into a SIGBUS mid-sample; each checked for NaN and inf), then gets back
    the tie and the masks that a meta build can't hold. misfit: the words for a state_dict that
    doesn't fit config (missing or unexpected keys, other shapes), said before load_state_dict's;
    source: where the tensors come from (the file), for the NaN/inf refusal.
    """
    try:
        model = meta_model(config)
    except ValueError as e:  # e.g. n_embd not divisible by n_head
        raise UserError(f"{misfit} ({e})") from None
    check_weight_kinds(config, state_dict, misfit, source)
    copies = fp32_copies(
        one_head(state_dict, misfit) if config.tie_embeddings else state_dict, source)
    try:
        model.load_state_dict(copies, assign=True)
    except RuntimeError as e:
        raise UserError(f"{misfit} ({_misfit_detail(e)})") from None
    if config.tie_embeddings:
        # assign=True gave wte and lm_head a Parameter each (one tensor, one_head made sure): tie
        # them again
        model.transformer.wte.weight = model.lm_head.weight
    # the causal masks (and rotary tables) are no state_dict entries: built for block_size
    model.init_buffers('cpu')
    # GPT() on meta stays quiet
    print("number of parameters: %.2fM" % (model.get_num_params() / 1e6,))
    return model


def check_weight_kinds(config, state_dict, misfit, source):
    """
    What a state_dict could be mistaken for otherwise, said first: integer tensors (a GPT's weights
    are all floating point; copied into the model they fail with torch's words), and an embedding
    or output head of another shape than config's vocab_size x n_embd (else taken for an untied
    head, or a shape error about another tensor).
    """
    for name, t in state_dict.items():
        if not t.is_floating_point():
            raise UserError(f"{source} holds {name} as {str(t.dtype).replace('torch.', '')} values, not "
                            f"floating-point weights: it was edited or written by other code; use "
                            f"another copy")
    table = (config.vocab_size, config.n_embd)
    for name in ('transformer.wte.weight', 'lm_head.weight'):
        t = state_dict.get(name)
        if t is not None and tuple(t.shape) != table:
            raise UserError(f"{misfit} (its {name} is {' x '.join(map(str, t.shape))}, where vocab_size "
                            f"{config.vocab_size} and n_embd {config.n_embd} make {table[0]} x {table[1]})")


def fp32_copies(state_dict, source='the weights'):
    """
    Every tensor of state_dict copied into fresh memory, floating-point ones as float32 (what copy_
    into a float32 model did to an fp16/bf16 file). Entries that are the same view of the same data
    (the tied wte/lm_head, saved once) get one copy: copying GPT-2's 38.6M-value (154 MB) embedding
    twice would cost time and memory for nothing. A NaN or inf in a copy is refused in one line
    naming source (the file) and the first tensor holding one.
    """
    copies = {}
    out = {}
    for name, t in state_dict.items():
        same = _view(t)
        if same not in copies:
            # contiguous: a transposed view (Hugging Face's Conv1D weights) is copied into
            # nn.Linear's layout
            dtype = torch.float32 if t.is_floating_point() else t.dtype
            copies[same] = t.to(dtype, memory_format=torch.contiguous_format, copy=True)
            if dtype == torch.float32 and not finite(copies[same]):
                raise UserError(
                    f"{source} holds NaN or infinite values (the first in {name}): a model with them "
                    f"computes nothing but NaN; use another copy, or an earlier checkpoint of the run"
                )
        out[name] = copies[same]
    return out


def _view(t):
    """
    What makes two tensors the same view of the same data: torch.load gives the tied wte/lm_head,
    saved once, as two tensor objects over one storage.
    """
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def finite(t):
    """
    Whether every value of a float32 tensor is finite. Its sum is one read of it, without isfinite's
    bool tensor: a GPT-2 124M's weights take ~30 ms on 2 CPU threads, ~50 ms on one
    (isfinite().all(): ~460 / ~720 ms), beside ~310 ms for the copies themselves. A NaN or inf
    anywhere makes the sum non-finite; only then, as finite values can overflow a sum too, is every
    value looked at.
    """
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def one_head(state_dict, misfit):
    """
    Our GPT's head is its token embedding, one matrix: a file whose lm_head.weight and
    transformer.wte.weight differ holds an untied head, which loading would silently replace with
    one of the two. Refused instead; a head saved as an equal copy (a Hugging Face file may hold
    one) is replaced by wte, so it is copied only once.
    """
    wte = state_dict.get('transformer.wte.weight')
    head = state_dict.get('lm_head.weight')
    if wte is None or head is None or _view(wte) == _view(head):
        # saved once (the usual case: not compared, 60 ms for GPT-2), or missing (reported later)
        return state_dict
    # torch.equal: an fp16 file's tensors compare exactly
    if wte.shape != head.shape or not torch.equal(wte, head):
        if not (finite(wte) and finite(head)):
            # NaN is never equal to itself: fp32_copies names the tensor holding it
            return state_dict
        raise UserError(
            f"{misfit} (its lm_head.weight differs from transformer.wte.weight: an untied output head, "
            f"which this GPT can't hold)")
    return dict(state_dict, **{'lm_head.weight': wte})


def _misfit_detail(error):
    """
    What load_state_dict's error says after its header line (the missing keys, the first wrong
    shape), cut.
    """
    lines = [ln.strip() for ln in str(error).strip().splitlines()]
    return '; '.join(lines[1:] or lines)[:300]


def fit_block_size(model, block_size):
    """
    Crop the model to block_size (model surgery) when it is smaller; a larger one is an error. 0 =
    keep.
    """
    if block_size and block_size < model.config.block_size:
        # model surgery: keeps the first block_size positions of wpe
        model.crop_block_size(block_size)
    elif block_size > model.config.block_size:
        raise UserError(
            f"block_size {block_size} is larger than the model's {model.config.block_size}; "
            f"use --block_size={model.config.block_size} or less")


# -----------------------------------------------------------------------------
# the settings a model source imposes: a resumed or fine-tuned run keeps its model (train.py and
# finetune.py alike). These functions only read and refuse; they return what the source fixes, and
# the script applies it

# the settings that shape the model: a resumed run has the checkpoint's, whatever the defaults say
ARCHITECTURE = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'gelu') + tuple(MODERN)
# what a source may fix: its architecture, and a resumed run's optimizer (whose state it continues).
# The script passes the user's own values of these (Settings.chosen): a default contradicts nothing
FIXED_BY_SOURCE = ARCHITECTURE + ('optimizer',)
# what a train.py checkpoint must hold to be resumed (finetune.py's and weights-only files lack the
# training state)
RESUME_KEYS = ('model', 'model_args', 'optimizer', 'iter_num', 'best_val_loss', 'config')


@dataclass(frozen=True)
class ModelSource:
    """ Where a run's model comes from: init_from names it; out_dir holds the run to continue. """
    init_from: str
    out_dir: str
    auto_resume: bool


@dataclass(frozen=True)
class ResumeSpec:
    """ train.py's resume: the snapshot it goes back to ('' = ckpt.pt), the last iteration. """
    resume_from: str
    max_iters: int


def source_settings(source, chosen, keep_zero=(), resume=None, resume_file=None, epochs=None):
    """
    Before any work: the settings the model that source names imposes on the run, {name: value}, and
    the checkpoint it resumes (a path, or None). The script builds its run's settings from the
    user's and these (Settings.replaced) and decides nothing else from them. chosen: {name: value}
    of the FIXED_BY_SOURCE settings the user gave.
    train.py passes resume (a ResumeSpec); finetune.py passes its resume_file,
    keep_zero=('block_size',) (0: the model's own) and, when it trains, its epochs. auto_resume:
    init_from becomes 'resume' when out_dir holds the run's checkpoint (a requeued job), so one
    command starts a run and continues it. 'resume': resumed_run_settings's rules (finetune.py:
    resumed_finetune_settings's). Given weights (a checkpoint, an out_dir, gpt2*, a Hugging Face
    directory): the weights fix the model, so an architecture setting the user gave that differs is
    refused in one line, and the others are theirs, so that the saved 'config' agrees with
    'model_args'; dropout may change and block_size may be smaller (the model is cropped to it).
    Their files are read as far as the architecture needs (the checkpoint memory-mapped, config.json
    alone).
    """
    imposed = {}
    init_from, out_dir = source.init_from, source.out_dir
    # a requeued job: its checkpoint is there, so it continues. auto_resume wins over init_from: a
    # job's command line always carries the init_from that started the run, which must then be the
    # run in out_dir (requeued_run)
    requeued = source.auto_resume and init_from != 'resume' and \
        os.path.isfile(os.path.join(out_dir, resume_file or CHECKPOINT))
    if requeued:
        init_from = imposed['init_from'] = 'resume'
    if init_from != 'resume':
        return dict(imposed, **weights_settings(init_from, out_dir, chosen, keep_zero)), None
    if resume_file is not None:
        path = os.path.join(out_dir, resume_file)
        if requeued:
            requeued_run(source.init_from, out_dir, path)
        imposed.update(resumed_finetune_settings(path, chosen, epochs, requeued=source.auto_resume))
    else:
        path = resume_point(out_dir, resume.resume_from)
        if requeued:
            requeued_run(source.init_from, out_dir, path)
        imposed.update(resumed_run_settings(out_dir, path, chosen, resume.max_iters,
                                            requeued=source.auto_resume))
    if requeued and int(os.environ.get('RANK', 0)) == 0:
        print(f"auto_resume=True: {out_dir} holds this run's checkpoint; resuming it (init_from="
              f"{source.init_from} is how it started)")
    return imposed, path


def requeued_run(init_from, out_dir, path):
    """
    auto_resume's check that the checkpoint at path (out_dir's) is of the run that init_from
    started: the weights init_from names fix a run's architecture, so a checkpoint of another one
    (of another run left in out_dir) is refused in one line rather than resumed in its place.
    block_size may be smaller (the run cropped the model). init_from=scratch names no weights: the
    architecture settings given are compared with the checkpoint's as for any resume. Weights that
    can't be read now (a Hub offline) are not compared: the requeued job needs only the checkpoint.
    """
    if init_from == 'scratch' or not os.path.isfile(path):
        return  # a missing file: said by the resume's own check
    ckpt = load_checkpoint(path)
    if 'model_args' not in ckpt:
        return  # not a training checkpoint: said by the resume's own check
    resumed = model_config_from_checkpoint(ckpt)
    source = checkpoint_path(init_from, out_dir)
    try:
        if source is not None:
            started = model_config_from_checkpoint(load_checkpoint(source))
        elif init_from in GPT2_NAMES or is_hf_dir(init_from):
            from nanogpt_plus.hf_import import hf_config  # only for Hugging Face weights
            started = hf_config(init_from)
        else:
            return
    except UserError:
        return
    for key in ARCHITECTURE:
        was, now = getattr(started, key), getattr(resumed, key)
        if now != was and not (key == 'block_size' and now < was):
            raise UserError(
                f"auto_resume=True but {path} is not a run that init_from={init_from} started: it "
                f"has {key}={now!r}, {describe_source(init_from, out_dir)} {key}={was!r}; pass "
                f"another --out_dir for a new run from {init_from}, or --init_from=resume to "
                f"continue the run in {out_dir}")


def kept_architecture(chosen, saved, source, rule, keep_zero=(), smaller=(),
                      otherwise="start a new run in another --out_dir"):
    """
    The architecture settings of saved (a GPTConfig) that the run takes, {name: value}: one the user
    chose (chosen) that differs is refused in one line naming source and rule. keep_zero: settings
    whose 0 means "the model's"; smaller: settings the user may set below the model's (block_size:
    the model is cropped to it), which then stay the user's.
    """
    kept = {}
    for key in ARCHITECTURE:
        value = getattr(saved, key)
        given = chosen.get(key)
        if key not in chosen or (key in keep_zero and given == 0):
            kept[key] = value
        elif key in smaller and given < value:
            continue
        elif given != value:
            raise UserError(f"--{key}={given!r} but {source} has {key}={value!r}; {rule}: drop "
                            f"--{key} (or change it in the config file), or {otherwise}")
        else:
            kept[key] = value
    return kept


def checkpoint_architecture(ckpt, path, chosen, keep_zero=()):
    """
    Nothing is cropped or rebuilt on resume, so that the next save can't replace the checkpoint with
    another model: an architecture setting the user gave must be the checkpoint's (one line naming
    both otherwise), and the run takes the checkpoint's values (so the saved 'config' agrees with
    'model_args'). keep_zero: settings whose 0 means "the model's" (finetune.py's block_size), which
    a 0 doesn't contradict.
    """
    return kept_architecture(chosen, model_config_from_checkpoint(ckpt), f"the checkpoint {path}",
                             keep_zero=keep_zero,
                             rule="a resumed run keeps the checkpoint's architecture")


def weights_settings(init_from, out_dir, chosen, keep_zero=()):
    """ source_settings for given weights: their architecture (see there); none for scratch. """
    if init_from == 'scratch':  # a new model, as in init_model (even beside a file named scratch)
        return {}
    path = checkpoint_path(init_from, out_dir)
    if path is not None:
        saved = model_config_from_checkpoint(load_checkpoint(path))
    elif init_from in GPT2_NAMES or is_hf_dir(init_from):
        from nanogpt_plus.hf_import import hf_config  # only for Hugging Face weights
        saved = hf_config(init_from)
    else:
        # now, in the verdict of every rank: this node may lack the path
        raise unknown_source(init_from)
    rule = ("a model trained from given weights keeps their architecture (dropout and a smaller "
            "block_size may change)")
    return kept_architecture(chosen, saved, describe_source(init_from, out_dir), rule=rule,
                             keep_zero=keep_zero, smaller=('block_size',),
                             otherwise="train a new model with --init_from=scratch")


def kept_optimizer(ckpt, path, chosen):
    """
    A resumed run continues its optimizer's state, so it keeps its optimizer: one given that differs
    is refused; the run takes the checkpoint's (a checkpoint from before the setting existed was
    trained with AdamW).
    """
    saved = (ckpt.get('config') or {}).get('optimizer', 'adamw')
    if 'optimizer' in chosen and chosen['optimizer'] != saved:
        raise UserError(f"--optimizer={chosen['optimizer']} but the run in {path} was trained with "
                        f"optimizer={saved}, whose state it continues; drop --optimizer, or start "
                        f"a new run in another --out_dir")
    return {'optimizer': saved}


def resumed_run_settings(out_dir, path, chosen, max_iters, requeued=False):
    """
    train.py's --init_from=resume of the run in out_dir, before any work (its block_size is used
    before the model is built): the checkpoint at path must exist and be a train.py training
    checkpoint, the run takes its architecture and optimizer (checkpoint_architecture,
    kept_optimizer), and the run must not be over: a user error, but for a requeued job
    (auto_resume, requeued=True) NothingToDo: the job had finished, exit 0. Its tensors are
    memory-mapped, not read.
    """
    if not os.path.exists(path):
        raise UserError(f"init_from=resume but there is no checkpoint at {path}; "
                        f"check --out_dir or start with --init_from=scratch")
    ckpt = load_checkpoint(path)
    missing = [k for k in RESUME_KEYS if k not in ckpt]
    if missing or 'task' in ckpt:  # 'task': finetune.py's checkpoint of a model with a task head
        what = f"it has no {', '.join(repr(k) for k in missing)}" if missing else "it is a finetune.py checkpoint"
        raise UserError(
            f"{path} is not a train.py training checkpoint ({what}: a finetune.py out_dir or a "
            f"weights-only file?); to train on its weights from iter 0 use --init_from={path} with "
            f"another --out_dir")
    imposed = checkpoint_architecture(ckpt, path, chosen)
    imposed.update(kept_optimizer(ckpt, path, chosen))
    # the loop trains iteration max_iters too and then stops, so the final checkpoint of a finished
    # run has iter_num = max_iters + 1; one at iter_num == max_iters still has that last step to run
    iter_num = saved_count(ckpt, path)
    try:
        float(ckpt['best_val_loss'])  # nanoGPT's is a 0-d tensor
    except (TypeError, ValueError, RuntimeError):
        raise UserError(f"checkpoint {path} holds best_val_loss={ckpt['best_val_loss']!r}, not a "
                        f"loss: it was edited or written by other code; use another "
                        f"checkpoint") from None
    if iter_num > max_iters and requeued:
        raise NothingToDo(f"auto_resume=True: the run in {out_dir} is already complete (its "
                          f"checkpoint is at iter {iter_num}, past max_iters={max_iters}); "
                          f"nothing to do")
    if iter_num > max_iters:
        raise UserError(f"the run in {out_dir} is already complete: its checkpoint is at iter "
                        f"{iter_num}, past max_iters={max_iters}; to train further, "
                        f"resume with a larger --max_iters (and --lr_decay_iters to match)")
    return imposed


def resume_refusal(out_dir, chosen, max_iters):
    """
    Why `--init_from=resume` of the run in out_dir would be refused with the settings the user chose
    (that one line), or None when it would run: a refusal that suggests resuming suggests it only
    where it works (nanoGPT's 6-layer config over the quick start's 4-layer run does not).
    """
    try:
        resumed_run_settings(out_dir, resume_point(out_dir, ''), chosen, max_iters)
    except UserError as e:
        return str(e)
    return None


def resumed_finetune_settings(path, chosen, epochs=None, requeued=False):
    """
    finetune.py's --init_from=resume, before any work: its ckpt_last.pt must be there, and the run
    keeps its architecture (checkpoint_architecture, train.py's rule; finetune's block_size=0 means
    the model's own). A fine-tune that already ran its `epochs` (None: not training) has nothing
    left to do, as train.py's complete run: a user error, but for a requeued job (auto_resume) one
    line and exit 0 (NothingToDo), with nothing written.
    """
    if not os.path.exists(path):
        raise UserError(
            f"init_from=resume but there is no {path}; check --out_dir or start a new fine-tune "
            f"with --init_from=<pretrained model>")
    ckpt = load_checkpoint(path)
    # what the resume reads: the training state, and the task model with its tokens
    require_entries(ckpt, path, ('optimizer', 'tokenizer', 'task', 'head', 'label_map', 'special_tokens'))
    for key in ('iter_num', 'epoch', 'step_in_epoch'):  # where the fine-tune goes on
        saved_count(ckpt, path, key)
    done = ckpt['epoch']  # epochs finished: the next one starts at step_in_epoch
    if epochs is not None and done >= epochs:
        complete = (f"the fine-tune in {os.path.dirname(path) or '.'} is already complete (its "
                    f"{os.path.basename(path)} has finished {done} epoch(s); epochs={epochs})")
        if requeued:
            raise NothingToDo(f"auto_resume=True: {complete}; nothing to do")
        raise UserError(f"{complete}; to train further, resume with a larger --epochs")
    return checkpoint_architecture(ckpt, path, chosen, keep_zero=('block_size',))
