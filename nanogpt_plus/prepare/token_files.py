"""
Token files and meta: nanoGPT's format, a flat array of uint16 token ids per split (train.bin, val.bin),
plus the tokenizer's description (meta.json, and nanoGPT's meta.pkl for character vocabularies).
Every id is checked before it is stored, since numpy would silently wrap 65536 to 0.

Usage (inside nanogpt_plus.files.atomic_outputs, so the files appear only when all are complete):
    from nanogpt_plus.prepare.token_files import write_meta, write_token_batches, write_tokens
    write_tokens(out.path('train.bin'), ids)                          # a small split at once
    write_token_batches(out.path('train.bin'), total, batches)        # a large one, batch by batch
    write_meta(out, {'kind': 'gpt2', 'vocab_size': 50257}, pickle_too=False)
"""

import errno
import json
import os
import pickle

import numpy as np
from tqdm import tqdm

from nanogpt_plus.runtime import UserError
from nanogpt_plus.shards import as_token_array

UINT16_LIMIT = 2 ** 16  # token ids must be < 65536 to be stored as uint16


def check_vocab_fits(vocab_size, what="the tokenizer"):
    """ Refuse a tokenizer up front, before any tokenizing, when its ids can't all be stored as uint16. """
    if vocab_size > UINT16_LIMIT:
        raise UserError(f"{what} has {vocab_size:,} tokens, more than uint16 token files can hold (65,536); "
                        f"use a tokenizer with a smaller vocabulary")


def to_uint16(ids):
    """ ids as a uint16 array, refusing (instead of silently wrapping) any id that doesn't fit. """
    return as_token_array(ids, np.uint16)


def write_tokens(path, ids):
    """ A whole (small) split at once: ids -> uint16 -> path (nanoGPT's tofile format). """
    # through a Python file, not ndarray.tofile: on a full disk tofile says only how many bytes it wrote, this
    # raises the OS's own error (ENOSPC, EFBIG, ...), which atomic_outputs reports
    with open(path, "wb") as f:
        f.write(np.ascontiguousarray(to_uint16(ids)).data)


def write_token_batches(path, total, batches, desc=None, num_batches=None):
    """
    A large split batch by batch into a uint16 memmap of `total` tokens (nanoGPT's openwebtext writer):
    memory is bounded by one batch. Checks every batch's ids and that exactly `total` tokens arrived.
    """
    shape = (max(total, 1),)  # a memmap can't be empty
    reserve_disk_space(path, shape[0] * np.dtype(np.uint16).itemsize)
    arr = np.memmap(path, dtype=np.uint16, mode="r+", shape=shape)
    idx = 0
    for batch in tqdm(batches, desc=desc, total=num_batches, disable=desc is None):
        batch = to_uint16(batch)
        if idx + len(batch) > total:
            raise RuntimeError(f"more tokens than the {total:,} expected for {path}")
        arr[idx: idx + len(batch)] = batch
        idx += len(batch)
    if idx != total:
        raise RuntimeError(f"{path} got {idx:,} tokens, expected {total:,}")
    arr.flush()
    del arr
    if total == 0:
        open(path, "wb").close()  # drop the one placeholder token again


def reserve_disk_space(path, nbytes):
    """
    Create path with nbytes allocated on the disk, before a memmap writes into it. A memmap of a sparse file
    (what mode='w+' makes) meets a full disk only when the kernel writes a page back, as a SIGBUS that kills
    the process; allocating first makes it an OSError (ENOSPC) now, which atomic_outputs reports in one line.
    """
    with open(path, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, nbytes)
        except (AttributeError, OSError) as e:  # no posix_fallocate (macOS, Windows), or not on this filesystem
            if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise  # ENOSPC, EDQUOT, EFBIG: the disk can't hold the file
            f.truncate(nbytes)  # sparse: the space is found while writing


def write_meta(out, meta, pickle_too):
    """ meta.json (safe to read; read_dataset_meta reads it first) and optionally nanoGPT's meta.pkl. """
    json_meta = dict(meta)
    if "itos" in json_meta:
        json_meta["itos"] = {str(i): ch for i, ch in json_meta["itos"].items()}  # JSON keys are strings
    with open(out.path("meta.json"), "w", encoding="utf-8") as f:
        json.dump(json_meta, f, ensure_ascii=False, indent=1)
    if pickle_too:
        # exactly nanoGPT's keys, so its sample.py reads this file
        nano = {"vocab_size": meta["vocab_size"], "itos": meta["itos"], "stoi": meta["stoi"]}
        with open(out.path("meta.pkl"), "wb") as f:
            pickle.dump(nano, f)
