"""
Checkpoints: the ckpt.pt format (atomic save, safe load with weights_only=True, the one dict builder), and
init_from: from 'resume' / a training out_dir / a ckpt.pt file / gpt2* / a local Hugging Face GPT-2 directory
to (model, tokenizer, checkpoint), with the rules a resumed run must keep (adopt_resumed_run). The models
themselves are made by build.py; when and where a run saves is the Checkpointer's (checkpointer.py).

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
import zipfile

import torch

from model import GPT2_NAMES, MODERN, GPTConfig
from nanogpt_plus.build import fit_block_size, loaded_model, meta_model, pretrained_model, scratch_model
from nanogpt_plus.errors import UserError, error_line
from nanogpt_plus.files import atomic_write, load_error
from nanogpt_plus.tokenizer import check_dataset_tokenizer, read_dataset_meta, read_named_tokenizer

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
        raise load_error(path, e) from None
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
        return pretrained_model(init_from, dropout, on_meta), pretrained_tokenizer_meta(init_from), None
    raise UserError(f"don't know how to load init_from='{init_from}': use scratch, resume (with --out_dir), a "
                    f"training out_dir or ckpt.pt, gpt2/gpt2-medium/gpt2-large/gpt2-xl, or a local Hugging Face "
                    f"GPT-2 directory")


def init_training_model(cfg, data, on_meta=False):
    """
    train.py's init_model: (the plain GPT on the CPU, its tokenizer description, the checkpoint read or None)
    for cfg's init_from, said in one line, checked against the dataset the run trains on (a dataset.Dataset):
    weights with their own tokenizer must have the dataset's, and the dataset's vocabulary must fit the model.
    Weights trained on longer windows may train on shorter ones (a resume has the checkpoint's block_size).
    on_meta: FSDP's ranks other than 0, which get their shards of rank 0's weights (see init_model).
    """
    init_from, out_dir = cfg['init_from'], cfg['out_dir']
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


def describe_source(init_from, out_dir='out', resume_file='ckpt.pt'):
    """ What init_model(init_from, out_dir) reads, for messages: the checkpoint's path, else init_from. """
    return checkpoint_path(init_from, out_dir, resume_file) or init_from


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
    saved = model_config_from_checkpoint(ckpt)
    given = getattr(cfg, 'given', cfg.keys())  # a plain dict (a test's): every setting counts as chosen
    for key in ARCHITECTURE:
        if key not in cfg:
            continue
        chosen = key in given and not (key in keep_zero and cfg[key] == 0)
        if chosen and cfg[key] != getattr(saved, key):
            raise UserError(f"--{key}={cfg[key]!r} but the checkpoint {path} has {key}={getattr(saved, key)!r}; "
                            f"a resumed run keeps the checkpoint's architecture: drop --{key} (or change it in the "
                            f"config file), or start a new run in another --out_dir")
        cfg[key] = getattr(saved, key)


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


def adopt_resumed_finetune(cfg, path):
    """
    finetune.py's --init_from=resume, before any work: its ckpt_last.pt must be there, and the run keeps its
    architecture (adopt_architecture, train.py's rule; finetune's block_size=0 means the model's own).
    """
    if not os.path.exists(path):
        raise UserError(f"init_from=resume but there is no {path}; check --out_dir or start a new fine-tune "
                        f"with --init_from=<pretrained model>")
    adopt_architecture(cfg, load_checkpoint(path), path, keep_zero=('block_size',))
