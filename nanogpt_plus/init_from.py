"""
Where a model comes from: every init_from, turned into (model on the CPU, tokenizer description, checkpoint or
None) by one function, with the model construction each one needs and the rules a resumed or fine-tuned run keeps.
  'scratch'   a new random GPT from the model settings, its vocabulary from the dataset's tokenizer
  'resume'    the run in out_dir: its checkpoint's architecture, weights and training state
  a path      a ckpt.pt, or a training out_dir holding one: its weights (training starts at iter 0)
  gpt2*       OpenAI's GPT-2 weights, or a local Hugging Face GPT-2 directory (read by pretrained.py)
A model that is about to receive weights is built on the meta device (shapes only, no random draws) and then
takes float32 copies of them, each checked finite; nothing is cropped or rebuilt on resume.

Usage:
    from nanogpt_plus.init_from import init_model
    model, tokenizer_meta, ckpt = init_model('resume', out_dir='out')   # or 'scratch', 'gpt2', a path
"""

import os

import torch
from torch.overrides import TorchFunctionMode

from configurator import Settings
from model import GPT, GPT2_NAMES, MODERN, GPTConfig
from nanogpt_plus.checkpoint import (
    checkpoint_tokenizer_meta,
    clean_state_dict,
    file_digest,
    load_checkpoint,
    model_config_from_checkpoint,
    tokenizer_known,
)
from nanogpt_plus.dataset import check_dataset_tokenizer, find_dataset
from nanogpt_plus.device import check_model_memory, resolve_device
from nanogpt_plus.errors import UserError
from nanogpt_plus.out_dir import resume_point
from nanogpt_plus.runtime import git_commit


def init_model(init_from, out_dir='out', dataset=None, model_settings=None, dropout=None, resume_file='ckpt.pt',
               on_meta=False):
    """
    The one place that turns init_from into (model on the CPU, tokenizer description, checkpoint or None):
      'scratch'        a new GPT from model_settings (n_layer, n_head, ..., gelu, and the modern options),
                       with the vocabulary and tokenizer of `dataset` (a dataset.Dataset; GPT-2's when it has
                       no meta, or when dataset is None)
      'resume'         out_dir/resume_file (train.py: ckpt.pt; finetune.py: its ckpt_last.pt)
      a path           a ckpt.pt, or a training out_dir holding one
      gpt2*, a path    OpenAI's GPT-2 weights, or a local Hugging Face GPT-2 directory (export_hf.py's too)
    dropout overrides the saved dropout (architecture settings always come from the weights).
    on_meta=True (FSDP's ranks other than 0, which are sent their shards by rank 0): the same architecture on the
    meta device, without initialising or loading weights; the checkpoint (memory-mapped) is still returned, for
    the optimizer, loader and RNG states, its 'model' tensors untouched; gpt2* and Hugging Face directories
    give their config.json's architecture without reading (or downloading) the weights.
    """
    if init_from == 'scratch':
        if model_settings is None:  # sample.py, eval.py, export_hf.py: a script that reads weights
            raise UserError("init_from=scratch makes a new, untrained model, which only train.py and finetune.py "
                            "do; pass resume (with --out_dir), a ckpt.pt or out_dir, gpt2* or a Hugging Face "
                            "directory")
        data_meta, data_dir = (dataset.meta, dataset.directory) if dataset is not None else (None, None)
        return scratch_model(model_settings, data_meta, data_dir, on_meta), data_meta or {'kind': 'gpt2'}, None
    ckpt_path = checkpoint_path(init_from, out_dir, resume_file)
    if ckpt_path is not None:
        ckpt = load_checkpoint(ckpt_path, map_location='cpu')
        return model_from_checkpoint(ckpt, dropout, on_meta, ckpt_path), checkpoint_tokenizer_meta(ckpt), ckpt
    if init_from in GPT2_NAMES or is_hf_dir(init_from):
        # only for Hugging Face weights
        from nanogpt_plus.pretrained import pretrained_tokenizer_meta
        return pretrained_model(init_from, dropout, on_meta), pretrained_tokenizer_meta(init_from), None
    raise unknown_source(init_from)


def unknown_source(init_from):
    """ The one line for an init_from that names nothing here: a path that is not on this machine, or a typo. """
    if not os.path.exists(init_from):
        return UserError(f"init_from={init_from}: there is nothing at that path on this machine, and it is none of "
                         f"scratch, resume, gpt2/gpt2-medium/gpt2-large/gpt2-xl; check the path (every node of a "
                         f"run must see it)")
    return UserError(f"init_from={init_from}: there is no ckpt.pt, training out_dir or Hugging Face GPT-2 directory "
                     f"at that path; pass one of those, scratch, resume (with --out_dir) or gpt2*")


def init_training_model(cfg, data, on_meta=False):
    """
    train.py's init_model: (the plain GPT on the CPU, its tokenizer description, the checkpoint read or None)
    for cfg's init_from, said in one line, checked against the dataset the run trains on (a dataset.Dataset):
    weights with their own tokenizer must have the dataset's, and the dataset's vocabulary must fit the model.
    Weights trained on longer windows may train on shorter ones (a resume has the checkpoint's block_size).
    on_meta: FSDP's ranks other than 0, which get their shards of rank 0's weights (see init_model).
    """
    init_from = cfg['init_from']
    out_dir = cfg['out_dir']
    source = checkpoint_path(init_from, out_dir)
    if init_from == 'resume':
        print(f"Resuming training from {out_dir}")
    elif init_from != 'scratch' and source is not None:
        print(f"Initializing from the weights in {source} (training starts at iter 0)")
    elif init_from in GPT2_NAMES or is_hf_dir(init_from):
        print(f"Initializing from OpenAI GPT-2 weights: {init_from}")
    # the architecture comes from the weights (a new model: from the settings); dropout from the settings always
    model, tokenizer_meta, ckpt = init_model(init_from, out_dir, dataset=data, model_settings=cfg,
                                             dropout=cfg['dropout'], on_meta=on_meta)
    # a new model has the dataset's tokenizer; weights come with their own (unless nanoGPT's left it unknown)
    if init_from != 'scratch' and tokenizer_known(ckpt):
        check_dataset_tokenizer(data.directory, data.meta, tokenizer_meta, describe_source(init_from, out_dir))
    fit_block_size(model, cfg['block_size'])
    if data.vocab_size and data.vocab_size > model.config.vocab_size:
        raise UserError(f"the dataset's vocabulary ({data.vocab_size}) is larger than the model's "
                        f"({model.config.vocab_size}); train from scratch on this dataset")
    return model, tokenizer_meta, ckpt


def check_new_model_fits(cfg):
    """
    train.py's check before any work: a new model (init_from='scratch') whose first step can't fit in memory is
    refused in one line (device.check_model_memory), counted at the dataset's vocabulary (its meta alone is read).
    Weights that trained before have a size that fitted.
    """
    if cfg['init_from'] != 'scratch':
        return
    try:
        vocab_size = find_dataset(cfg['dataset'], splits=()).vocab_size or 50304
    except UserError:
        # a meta file that can't be read: said later, by every rank with one verdict (this runs before they meet)
        vocab_size = 50304
    check_model_memory(cfg, vocab_size, on_cpu=resolve_device(cfg['device']) == 'cpu')


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


def describe_source(init_from, out_dir='out', resume_file='ckpt.pt'):
    """ What init_model(init_from, out_dir) reads, for messages: the checkpoint's path, else init_from. """
    return checkpoint_path(init_from, out_dir, resume_file) or init_from


# -----------------------------------------------------------------------------
# making a GPT: a new one, its architecture alone, one holding given weights, cropped to a shorter context

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


# a byte-level vocabulary (of the PADDED_KINDS of tokenizer) is padded up to a multiple of PAD_MULTIPLE:
# matmul kernels like the shape
PAD_MULTIPLE = 64
PADDED_KINDS = ('gpt2', 'bpe')


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
    # a character vocabulary (or a meta.json naming no kind)
    if data_meta.get('kind') not in PADDED_KINDS:
        return vocab_size
    padded = -(-vocab_size // PAD_MULTIPLE) * PAD_MULTIPLE
    if padded != vocab_size:
        print(f"padded vocab_size to {padded:,} (a multiple of {PAD_MULTIPLE}, for speed; ids from {vocab_size:,} "
              f"up are never sampled)")
    return padded


class _ShapesOnly(TorchFunctionMode):
    """
    While a model is built on the meta device, the calls that only fill in values (nn.init's normal_, the causal
    mask's tril) return their tensor unchanged: on meta they compute nothing anyway, but PyTorch runs them through
    its Python reference kernels, whose first call imports torch._dynamo, ~2 s of a sampling run's start-up.
    A tensor that isn't on meta (one made with an explicit device) is computed as usual: it would be used.
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
    """ A GPT of this config on the meta device: shapes only, no storage, no random draws (the RNG is untouched). """
    with torch.device('meta'), _ShapesOnly():
        return GPT(config)


def model_from_checkpoint(ckpt, dropout=None, on_meta=False, source='the checkpoint'):
    """
    A GPT with the checkpoint's architecture and weights (on the CPU; move it yourself). on_meta=True: the
    architecture only, on the meta device, and the checkpoint's 'model' tensors are never read (so none of their
    memory-mapped pages are loaded); FSDP's ranks other than 0 get their shards from rank 0 instead. source: the
    file, for messages (a NaN in its weights names it).
    """
    config = model_config_from_checkpoint(ckpt, dropout)
    if on_meta:
        return meta_model(config)
    return loaded_model(config, clean_state_dict(ckpt['model']), "the checkpoint's weights don't fit its model_args",
                        source)


def pretrained_model(init_from, dropout=None, on_meta=False):
    """
    A GPT with the weights of gpt2* or a local Hugging Face GPT-2 directory, read without transformers
    (nanogpt_plus.pretrained; GPT.from_pretrained is the reference it is tested against). on_meta=True: its
    architecture only, on the meta device, from config.json alone (FSDP's ranks other than 0: gpt2-xl's 6 GB of
    float32 weights are read by rank 0 only, which sends every rank its shards).
    """
    # imported here: only a run that starts from Hugging Face weights reads them
    from nanogpt_plus.pretrained import hf_config, hf_config_and_weights
    if on_meta:
        return meta_model(hf_config(init_from, dropout))
    print(f"loading weights from pretrained gpt: {init_from}")
    config, state_dict, path = hf_config_and_weights(init_from, dropout)
    return loaded_model(config, state_dict, f"the weights of {init_from} don't fit its config.json", path)


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
    # the causal masks (and rotary tables) are no state_dict entries: built for block_size
    model.init_buffers('cpu')
    # GPT() on meta stays quiet
    print("number of parameters: %.2fM" % (model.get_num_params() / 1e6,))
    return model


def fp32_copies(state_dict, source='the weights'):
    """
    Every tensor of state_dict copied into fresh memory, floating-point ones as float32 (what copy_ into a float32
    model did to an fp16/bf16 file). Entries that are the same view of the same data (the tied wte/lm_head, saved
    once) get one copy: copying GPT-2's 38.6M-value (154 MB) embedding twice would cost time and memory for nothing.
    A NaN or inf in a copy is refused in one line naming source (the file) and the first tensor holding one.
    """
    copies = {}
    out = {}
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


def _view(t):
    """
    What makes two tensors the same view of the same data: torch.load gives the tied wte/lm_head, saved once, as
    two tensor objects over one storage.
    """
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()


def finite(t):
    """
    Whether every value of a float32 tensor is finite. Its sum is one read of it, without isfinite's bool tensor:
    a GPT-2 124M's weights take ~30 ms on 2 CPU threads, ~50 ms on one (isfinite().all(): ~460 / ~720 ms), beside
    ~310 ms for the copies themselves. A NaN or inf anywhere makes the sum non-finite; only then, as finite values
    can overflow a sum too, is every value looked at.
    """
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def one_head(state_dict, misfit):
    """
    Our GPT's head is its token embedding, one matrix: a file whose lm_head.weight and transformer.wte.weight
    differ holds an untied head, which loading would silently replace with one of the two. Refused instead; a
    head saved as an equal copy (a Hugging Face file may hold one) is replaced by wte, so it is copied only once.
    """
    wte = state_dict.get('transformer.wte.weight')
    head = state_dict.get('lm_head.weight')
    if wte is None or head is None or _view(wte) == _view(head):
        # saved once (the usual case: not compared, 60 ms for GPT-2), or missing (reported later)
        return state_dict
    # torch.equal: an fp16 file's tensors compare exactly
    if wte.shape != head.shape or not torch.equal(wte, head):
        raise UserError(f"{misfit} (its lm_head.weight differs from transformer.wte.weight: an untied output head, "
                        f"which this GPT can't hold)")
    return dict(state_dict, **{'lm_head.weight': wte})


def _misfit_detail(error):
    """ What load_state_dict's error says after its header line (the missing keys, the first wrong shape), cut. """
    lines = [ln.strip() for ln in str(error).strip().splitlines()]
    return '; '.join(lines[1:] or lines)[:300]


def fit_block_size(model, block_size):
    """ Crop the model to block_size (model surgery) when it is smaller; a larger one is an error. 0 = keep. """
    if block_size and block_size < model.config.block_size:
        # model surgery: keeps the first block_size positions of wpe
        model.crop_block_size(block_size)
    elif block_size > model.config.block_size:
        raise UserError(f"block_size {block_size} is larger than the model's {model.config.block_size}; "
                        f"use --block_size={model.config.block_size} or less")


# -----------------------------------------------------------------------------
# resuming: the rules a run that continues from its own checkpoint keeps (train.py and finetune.py alike)

# the settings that shape the model: a resumed run has the checkpoint's, whatever the defaults say
ARCHITECTURE = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'gelu') + tuple(MODERN)
# what a train.py checkpoint must hold to be resumed (finetune.py's and weights-only files lack the training state)
RESUME_KEYS = ('model', 'model_args', 'optimizer', 'iter_num', 'best_val_loss', 'config')


def adopt_architecture(cfg, ckpt, path, keep_zero=()):
    """
    Nothing is cropped or rebuilt on resume, so that the next save can't replace the checkpoint with another
    model: an architecture setting the user gave must be the checkpoint's (one line naming both otherwise), and
    one not given takes the checkpoint's value in cfg (so the saved 'config' agrees with 'model_args').
    keep_zero: settings whose 0 means "the model's" (finetune.py's block_size), which a 0 doesn't contradict.
    """
    keep_model_architecture(cfg, model_config_from_checkpoint(ckpt), f"the checkpoint {path}", keep_zero=keep_zero,
                            rule="a resumed run keeps the checkpoint's architecture")


def keep_model_architecture(cfg, saved, source, rule, keep_zero=(), smaller=(),
                            otherwise="start a new run in another --out_dir"):
    """
    cfg's architecture settings become those of saved (a GPTConfig): one the user gave that differs is refused in
    one line naming source and rule, one not given takes saved's value. keep_zero: settings whose 0 means "the
    model's"; smaller: settings the user may set below the model's (block_size: the model is cropped to it).
    """
    # a plain dict (a test's): every setting counts as chosen
    given = getattr(cfg, 'given', cfg.keys())
    for key in ARCHITECTURE:
        if key not in cfg:
            continue
        value = getattr(saved, key)
        chosen = key in given and not (key in keep_zero and cfg[key] == 0)
        if chosen and key in smaller and cfg[key] < value:
            continue
        if chosen and cfg[key] != value:
            raise UserError(f"--{key}={cfg[key]!r} but {source} has {key}={value!r}; {rule}: drop --{key} (or "
                            f"change it in the config file), or {otherwise}")
        cfg[key] = value


def adopt_source(cfg, keep_zero=(), resume_file=None):
    """
    Before any work, the architecture of the model init_from names becomes cfg's (train.py; finetune.py with
    keep_zero=('block_size',) and its resume_file). auto_resume: init_from becomes 'resume' when out_dir holds
    the run's checkpoint (a requeued job), so one command starts a run and continues it. 'resume':
    adopt_resumed_run's rules (finetune.py: adopt_resumed_finetune's). Given weights (a checkpoint, an out_dir,
    gpt2*, a Hugging Face directory): the weights fix the model, so an architecture setting the user gave that
    differs is refused in one line, and one not given is theirs, so that the saved 'config' agrees with
    'model_args'; dropout may change and block_size may be smaller (the model is cropped to it). Their files are
    read as far as the architecture needs (the checkpoint memory-mapped, config.json alone). Returns what every
    rank must start from alike (SAME_START).
    """
    out_dir = cfg['out_dir']
    if cfg.get('auto_resume') and cfg['init_from'] != 'resume' and \
            os.path.isfile(os.path.join(out_dir, resume_file or 'ckpt.pt')):
        cfg['init_from'] = 'resume'  # a requeued job: its checkpoint is there, so it continues
        if int(os.environ.get('RANK', 0)) == 0:
            print(f"auto_resume=True: {out_dir} holds this run's checkpoint; resuming it")
    init_from = cfg['init_from']
    resumed = None
    if init_from == 'resume':
        resumed = os.path.join(out_dir, resume_file) if resume_file else resume_point(out_dir, cfg['resume_from'])
        if resume_file is not None:
            adopt_resumed_finetune(cfg, resumed)
        else:
            adopt_resumed_run(cfg, resumed)
    else:
        adopt_weights(cfg, keep_zero)
    # what every rank must start from alike (SAME_START): its settings, its code, the checkpoint it resumes
    return {'settings': dict(cfg), 'commit': git_commit(), 'checkpoint': file_digest(resumed) if resumed else None}


# what adopt_source returns that must be the same on every rank (distributed.every_rank's agree), and what to do
SAME_START = {
    'settings': "start every node with the same command line and config files",
    'commit': "check out the same commit of this repository on every node",
    'checkpoint': "every node must resume from the same checkpoint: copy rank 0's node's out_dir/ckpt.pt to every "
                  "node's out_dir, or put out_dir on a shared file system",
}


def adopt_weights(cfg, keep_zero=()):
    """ adopt_source for given weights: their architecture becomes cfg's (see adopt_source). """
    init_from, out_dir = cfg['init_from'], cfg['out_dir']
    path = checkpoint_path(init_from, out_dir)
    if path is not None:
        saved = model_config_from_checkpoint(load_checkpoint(path))
    elif init_from in GPT2_NAMES or is_hf_dir(init_from):
        from nanogpt_plus.pretrained import hf_config  # only for Hugging Face weights
        saved = hf_config(init_from)
    elif init_from == 'scratch':
        return
    else:
        # now, in the verdict of every rank: this node may lack the path
        raise unknown_source(init_from)
    keep_model_architecture(cfg, saved, describe_source(init_from, out_dir), keep_zero=keep_zero,
                            smaller=('block_size',), rule="a model trained from given weights keeps their "
                            "architecture (dropout and a smaller block_size may change)",
                            otherwise="train a new model with --init_from=scratch")


def adopt_optimizer(cfg, ckpt, path):
    """
    A resumed run continues its optimizer's state, so it keeps its optimizer: one given that differs is refused,
    one not given is the checkpoint's (a checkpoint from before the setting existed was trained with AdamW).
    """
    if 'optimizer' not in cfg:
        return
    saved = (ckpt.get('config') or {}).get('optimizer', 'adamw')
    if 'optimizer' in getattr(cfg, 'given', cfg.keys()) and cfg['optimizer'] != saved:
        raise UserError(f"--optimizer={cfg['optimizer']} but the run in {path} was trained with optimizer={saved}, "
                        f"whose state it continues; drop --optimizer, or start a new run in another --out_dir")
    cfg['optimizer'] = saved


def adopt_resumed_run(cfg, path):
    """
    train.py's --init_from=resume, before any work (its block_size is used before the model is built): the
    checkpoint must exist and be a train.py training checkpoint, its architecture becomes cfg's
    (adopt_architecture), and the run must not be over. Its tensors are memory-mapped, not read.
    """
    if not os.path.exists(path):
        raise UserError(f"init_from=resume but there is no checkpoint at {path}; "
                        f"check --out_dir or start with --init_from=scratch")
    ckpt = load_checkpoint(path)
    missing = [k for k in RESUME_KEYS if k not in ckpt]
    if missing or 'task' in ckpt:  # 'task': finetune.py's checkpoint of a model with a task head
        what = f"it has no {', '.join(repr(k) for k in missing)}" if missing else "it is a finetune.py checkpoint"
        raise UserError(f"{path} is not a train.py training checkpoint ({what}: a finetune.py out_dir or a "
                        f"weights-only file?); to train on its weights from iter 0 use --init_from={path} with "
                        f"another --out_dir")
    adopt_architecture(cfg, ckpt, path)
    adopt_optimizer(cfg, ckpt, path)
    # the loop trains iteration max_iters too and then stops, so the final checkpoint of a finished run has
    # iter_num = max_iters + 1; one at iter_num == max_iters still has that last step to run
    if int(ckpt['iter_num']) > cfg['max_iters']:
        raise UserError(f"the run in {cfg['out_dir']} is already complete: its checkpoint is at iter "
                        f"{int(ckpt['iter_num'])}, past max_iters={cfg['max_iters']}; to train further, resume with "
                        f"a larger --max_iters (and --lr_decay_iters to match)")


def resume_refusal(cfg):
    """
    Why `--init_from=resume` with cfg's other settings would be refused (that one line), or None when it would
    run: a refusal that suggests resuming suggests it only where it works (nanoGPT's 6-layer config over the quick
    start's 4-layer run does not).
    """
    trial = Settings(cfg, cfg.given) if isinstance(cfg, Settings) else dict(cfg)
    try:
        adopt_resumed_run(trial, resume_point(cfg['out_dir'], ''))
    except UserError as e:
        return str(e)
    return None


def adopt_resumed_finetune(cfg, path):
    """
    finetune.py's --init_from=resume, before any work: its ckpt_last.pt must be there, and the run keeps its
    architecture (adopt_architecture, train.py's rule; finetune's block_size=0 means the model's own).
    """
    if not os.path.exists(path):
        raise UserError(f"init_from=resume but there is no {path}; check --out_dir or start a new fine-tune "
                        f"with --init_from=<pretrained model>")
    adopt_architecture(cfg, load_checkpoint(path), path, keep_zero=('block_size',))
