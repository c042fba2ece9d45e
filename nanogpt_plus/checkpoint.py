"""
The ckpt.pt format: one file holding a dict of tensors and plain Python values, written atomically and read
safely. Its keys are nanoGPT's ('model', 'optimizer', 'model_args', 'iter_num', 'best_val_loss', 'config'),
then ours ('model_extra_args', 'tokenizer', 'provenance'; a training checkpoint's 'loader', 'rng', 'scaler',
'spike_guard'; a fine-tune's 'head', 'task', ...): train.py spells out what its checkpoints hold where it saves
them. Nothing in it is a pickled object, so torch.load(weights_only=True) reads it, and nanoGPT's sample.py too.

A save writes a temp file, fsyncs it and renames it over the old one (files.atomic_write), then a readable JSON
sidecar (ckpt.json: everything but the tensors). A load memory-maps the tensors and refuses, in one line, a
file that is missing, truncated or holds a pickled Python object.

Usage:
    from nanogpt_plus.checkpoint import load_checkpoint, save_checkpoint
    save_checkpoint(ckpt, 'out/ckpt.pt')          # and out/ckpt.json
    ckpt = load_checkpoint('out/ckpt.pt')         # tensors memory-mapped, weights_only=True
"""

import json
import os
import re
import zipfile

import torch

from model import GPTConfig
from nanogpt_plus.dataset import read_dataset_meta
from nanogpt_plus.errors import UserError, error_line
from nanogpt_plus.files import atomic_write

# -----------------------------------------------------------------------------
# writing

def save_checkpoint(ckpt, path, sidecar=True):
    """
    Atomically write ckpt (a dict of tensors and plain values) to path, plus path's .json sidecar. A failed
    write (a full disk, say) raises files.WriteFailed, a UserError that is also an OSError; the file that was
    at path stays as it was.
    """
    atomic_write(path, lambda f: _torch_save(ckpt, f))
    if sidecar:
        text = json.dumps(_json_summary(ckpt), indent=2, default=str)
        atomic_write(sidecar_of(path), lambda f: f.write(text), binary=False)


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


def sidecar_of(path):
    """ The readable JSON beside a checkpoint: ckpt.pt -> ckpt.json. """
    return os.path.splitext(path)[0] + '.json'


def _json_summary(ckpt):
    """ The human-readable part of a checkpoint (no tensors), for ckpt.json. """
    keep = ('model_args', 'model_extra_args', 'iter_num', 'best_val_loss', 'config', 'provenance', 'task')
    summary = {k: ckpt[k] for k in keep if k in ckpt}
    tok = ckpt.get('tokenizer')
    if tok is not None:
        summary['tokenizer'] = {k: v for k, v in tok.items() if k in ('kind', 'vocab_size')}
    return summary


def build_checkpoint(model, iter_num, best_val_loss, config, tokenizer, provenance, model_state=None, **extra):
    """
    A checkpoint of a model's weights in this format: nanoGPT's keys ('model', 'model_args', 'iter_num',
    'best_val_loss', 'config'), the model settings beyond nanoGPT's, the tokenizer and provenance, then whatever
    the caller adds (finetune.py: the task head and its labels, its training state). train.py writes its own dict,
    with the whole training state, where it saves. model_state replaces model.state_dict() where the caller
    already holds the full state (FSDP).
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


# -----------------------------------------------------------------------------
# reading

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


def load_error(path, error):
    """
    The one line for a file torch.load refused (a ckpt.pt, a Hugging Face pytorch_model.bin): a pickled Python
    object (unsafe), else corrupt. Never torch's own text around it, which advises loading with
    weights_only=False, i.e. running the file's code.
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
    # its first sentence: what failed, not torch's guesses why
    detail = detail.split('. ')[0].rstrip('.')[:200]
    return UserError(f"checkpoint {path} is corrupt or truncated ({type(error).__name__}: {detail}); "
                     f"use another checkpoint")


def file_digest(path, span=1 << 20):
    """
    What tells two checkpoint files apart, cheaply (two nodes' copies of out_dir/ckpt.pt): its size and the
    sha256 of its first and last MiB (torch.save's zip holds the tensors' data in between, its directory at the
    end), not a read of gigabytes.
    """
    import hashlib
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        digest.update(f.read(span))
        f.seek(max(size - span, 0))
        digest.update(f.read(span))
    return f"{size}:{digest.hexdigest()[:16]}"


def saved_iter(path):
    """ The iter_num of a checkpoint file, read from the file itself (memory-mapped: its tensors aren't read). """
    # not the .json sidecar: a file copied by hand may lack its own
    return int(load_checkpoint(path)['iter_num'])


def clean_state_dict(state_dict):
    """ Strip the '_orig_mod.' prefix nanoGPT's compiled checkpoints have and drop non-weight buffers. """
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
    args = dict(ckpt['model_args'])
    args.update(ckpt.get('model_extra_args') or {})
    if dropout is not None:
        args['dropout'] = dropout
    try:
        return GPTConfig(**args)
    except TypeError as e:
        raise UserError(f"the checkpoint's model_args don't describe a GPT ({e})") from None


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
