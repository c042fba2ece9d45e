"""
Checkpoints: atomic save, safe load (weights_only=True), and building a model from any source
('resume' / a training out_dir / a ckpt.pt file / gpt2* / a local Hugging Face GPT-2 directory).

A ckpt.pt is nanoGPT's dict ('model', 'optimizer', 'model_args', 'iter_num', 'best_val_loss', 'config')
plus our own keys ('model_extra_args', 'tokenizer', 'rng', 'loader', 'scaler', 'provenance', ...), all
tensors and plain Python values, so torch.load(weights_only=True) reads it and nanoGPT's sample.py can
too. A readable JSON sidecar (ckpt.json) describes it.

Usage:
    from checkpoint import save_checkpoint, load_checkpoint, load_model
    save_checkpoint(ckpt_dict, 'out/ckpt.pt')
    model, info = load_model('resume', out_dir='out', device='cpu')   # info['tokenizer'], info['checkpoint']
"""

import json
import os

import torch

from model import GPT, GPT2_NAMES, GPTConfig
from runtime import UserError
from tokenizer import read_dataset_meta

HF_TOKENIZER_META = 'nanogpt_tokenizer.json'  # export_hf.py writes it for character-level models


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not possible on every platform (e.g. Windows); the rename is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path, write_fn, binary=True):
    """
    Write a file so that a crash at any moment leaves either the old complete file or the new one:
    write_fn(f) fills a temp file in the same directory, which is flushed, fsynced and renamed over path.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp.{os.getpid()}")
    try:
        with open(tmp, 'wb' if binary else 'w', **({} if binary else {'encoding': 'utf-8'})) as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _fsync_dir(directory)


def _json_summary(ckpt):
    """ The human-readable part of a checkpoint (no tensors), for ckpt.json. """
    keep = ('model_args', 'model_extra_args', 'iter_num', 'best_val_loss', 'config', 'provenance', 'task')
    summary = {k: ckpt[k] for k in keep if k in ckpt}
    tok = ckpt.get('tokenizer')
    if tok is not None:
        summary['tokenizer'] = {k: v for k, v in tok.items() if k in ('kind', 'vocab_size')}
    return summary


def save_checkpoint(ckpt, path, sidecar=True):
    """ Atomically write ckpt (a dict of tensors and plain values) to path, plus path's .json sidecar. """
    atomic_write(path, lambda f: torch.save(ckpt, f))
    if sidecar:
        text = json.dumps(_json_summary(ckpt), indent=2, default=str)
        atomic_write(os.path.splitext(path)[0] + '.json', lambda f: f.write(text), binary=False)


def load_checkpoint(path, map_location='cpu'):
    """ torch.load with weights_only=True and one clear error for a missing or corrupt file. """
    if not os.path.exists(path):
        raise UserError(f"no checkpoint at {path}; train a model first (python train.py ...) or check --out_dir")
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # truncated zip, foreign pickle, ... all mean the file can't be used
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()] or ['']
        detail = next((ln for ln in lines if 'Unsupported global' in ln), lines[0])[:200]
        raise UserError(f"checkpoint {path} is corrupt or not a safe checkpoint ({type(e).__name__}: {detail}); "
                        f"use another checkpoint") from None
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


def model_from_checkpoint(ckpt, dropout=None):
    """ A GPT with the checkpoint's architecture and weights (on the CPU; move it yourself). """
    model = GPT(model_config_from_checkpoint(ckpt, dropout))
    state_dict = clean_state_dict(ckpt['model'])
    try:
        model.load_state_dict(state_dict)
    except RuntimeError as e:
        raise UserError(f"the checkpoint's weights don't fit its model_args: {str(e).splitlines()[0]}") from None
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


def resolve_checkpoint_path(init_from, out_dir):
    """ The ckpt.pt that init_from names: 'resume' (in out_dir), a directory holding ckpt.pt, or a file. """
    if init_from == 'resume':
        return os.path.join(out_dir, 'ckpt.pt')
    if os.path.isfile(init_from):
        return init_from
    if os.path.isdir(init_from) and os.path.exists(os.path.join(init_from, 'ckpt.pt')):
        return os.path.join(init_from, 'ckpt.pt')
    return None


def is_hf_dir(path):
    return os.path.isdir(path) and os.path.exists(os.path.join(path, 'config.json'))


def pretrained_model(init_from, dropout=None):
    """ GPT.from_pretrained (gpt2* or a local Hugging Face directory), its errors as one UserError. """
    override = {} if dropout is None else {'dropout': dropout}
    try:
        return GPT.from_pretrained(init_from, override)
    except (OSError, ValueError) as e:
        raise UserError(str(e)) from None


def pretrained_tokenizer_meta(init_from):
    """ The tokenizer of a pretrained model: GPT-2's, unless export_hf.py left a nanogpt_tokenizer.json. """
    meta_path = os.path.join(init_from, HF_TOKENIZER_META)
    if not (os.path.isdir(init_from) and os.path.exists(meta_path)):
        return {'kind': 'gpt2'}
    try:
        with open(meta_path, encoding='utf-8') as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{meta_path} is unreadable ({e}); re-export the model with export_hf.py") from None


def load_model(init_from, out_dir='out', device='cpu', dropout=None):
    """
    Build a model from any source. Returns (model on device, info) with info['tokenizer'] (a description
    for tokenizer.load_tokenizer), info['checkpoint'] (the ckpt dict, or None) and info['source'].
    """
    ckpt_path = resolve_checkpoint_path(init_from, out_dir)
    if ckpt_path is not None:
        ckpt = load_checkpoint(ckpt_path, map_location='cpu')
        model = model_from_checkpoint(ckpt, dropout)
        info = {'tokenizer': checkpoint_tokenizer_meta(ckpt), 'checkpoint': ckpt, 'source': ckpt_path}
    elif init_from in GPT2_NAMES or is_hf_dir(init_from):
        model = pretrained_model(init_from, dropout)
        info = {'tokenizer': pretrained_tokenizer_meta(init_from), 'checkpoint': None, 'source': init_from}
    else:
        raise UserError(f"don't know how to load init_from='{init_from}': use resume (with --out_dir), a "
                        f"training out_dir or ckpt.pt, gpt2/gpt2-medium/gpt2-large/gpt2-xl, or a local "
                        f"Hugging Face GPT-2 directory")
    return model.to(device), info
