"""
Token files and meta: nanoGPT's format, a flat array of token ids per split (train.bin, val.bin),
uint16 while the vocabulary fits (nanoGPT's) and uint32 past 65,536 tokens, plus the tokenizer's
description (meta.json, recording the dtype and each split's tokens and UTF-8 bytes; nanoGPT's
meta.pkl for character vocabularies; tokenizer.json for bpe). Every id is checked before it is
stored, since numpy would silently wrap 65536 to 0 in a uint16 file.

Usage (inside nanogpt_plus.files.atomic_outputs, so the files appear only when all are complete):
    from nanogpt_plus.prepare.token_files import ByteCounter, check_vocab_fits, write_dataset_meta, write_tokens
    dtype = check_vocab_fits(tok.vocab_size)                          # uint16 or uint32
    counter = ByteCounter(token_byte_lengths(tok))                    # each split's bytes, for bits per byte
    write_tokens(out.path('train.bin'), counter.add('train', ids), dtype)   # a small split at once
    write_token_batches(out.path('train.bin'), total, batches, dtype) # a large one, batch by batch
    write_dataset_meta(out, tok, dtype, split_bytes=counter.record()) # meta.json (+ meta.pkl / tokenizer.json)
"""

import errno
import json
import os
import pickle

import numpy as np
from tqdm import tqdm

from nanogpt_plus.bpe import TOKENIZER_FILE
from nanogpt_plus.dataset import as_token_array, split_bytes_record, token_dtype
from nanogpt_plus.errors import UserError

UINT32_LIMIT = 2 ** 32  # the largest token files hold uint32 ids


def check_vocab_fits(vocab_size, what="the tokenizer"):
    """
    The token files' dtype for a vocabulary (uint16, or uint32 past 65,536), refusing one past
    uint32.
    """
    if vocab_size > UINT32_LIMIT:
        raise UserError(f"{what} has {vocab_size:,} tokens, more than uint32 token files can hold "
                        f"({UINT32_LIMIT:,}); use a tokenizer with a smaller vocabulary")
    return token_dtype(vocab_size)


def write_tokens(path, ids, dtype=np.uint16):
    """ A whole (small) split at once: ids -> dtype (checked) -> path (nanoGPT's tofile format). """
    # through a Python file, not ndarray.tofile: on a full disk tofile says only how many bytes it
    # wrote, this raises the OS's own error (ENOSPC, EFBIG, ...), which atomic_outputs reports
    with open(path, "wb") as f:
        f.write(np.ascontiguousarray(as_token_array(ids, dtype)).data)


def write_token_batches(path, total, batches, dtype=np.uint16, desc=None, num_batches=None):
    """
    A large split batch by batch into a dtype memmap of `total` tokens (nanoGPT's openwebtext
    writer): memory is bounded by one batch. Checks every batch's ids and that exactly `total`
    tokens arrived.
    """
    shape = (max(total, 1),)  # a memmap can't be empty
    reserve_disk_space(path, shape[0] * np.dtype(dtype).itemsize)
    arr = np.memmap(path, dtype=dtype, mode="r+", shape=shape)
    idx = 0
    for batch in tqdm(batches, desc=desc, total=num_batches, disable=desc is None):
        batch = as_token_array(batch, dtype)
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
    Create path with nbytes allocated on the disk, before a memmap writes into it. A memmap of a
    sparse file (what mode='w+' makes) meets a full disk only when the kernel writes a page back, as
    a SIGBUS that kills the process; allocating first makes it an OSError (ENOSPC) now, which
    atomic_outputs reports in one line.
    """
    with open(path, "wb") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, nbytes)
        # no posix_fallocate (macOS, Windows), or not on this filesystem
        except (AttributeError, OSError) as e:
            if isinstance(e, OSError) and e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise  # ENOSPC, EDQUOT, EFBIG: the disk can't hold the file
            f.truncate(nbytes)  # sparse: the space is found while writing


class ByteCounter:
    """
    Each split's tokens and the UTF-8 bytes they decode to, counted as the split is written, with
    the byte length of every id that tokenizer.token_byte_lengths gives (lengths: so exactly what
    tokenizer.split_bytes_per_token would count over the whole split): meta.json's "split_bytes",
    from which train.py's bits per byte come without loading a tokenizer.
    """

    def __init__(self, lengths):
        self.lengths = lengths
        self.counts = {}

    def add(self, split, ids):
        """ Count ids (a split's tokens, or the next batch of them) in; returns ids. """
        tokens, num_bytes = self.counts.get(split, (0, 0))
        # int64: a uint16 id array indexes alike, a list of ids becomes an index array
        self.counts[split] = (tokens + len(ids),
                              num_bytes + int(self.lengths[np.asarray(ids, dtype=np.int64)].sum()))
        return ids

    def record(self):
        return split_bytes_record(self.counts)


def write_dataset_meta(out, tokenizer, dtype, preparation=None, split_bytes=None):
    """
    The meta files of a dataset in tokenizer's ids stored as dtype: meta.json (the tokenizer's
    description and the dtype), plus nanoGPT's meta.pkl for a character vocabulary, or
    tokenizer.json for a bpe one (meta.json names it with its sha256 instead of holding it).
    preparation (outputs.check_same_dataset's record: corpus, tokenizer, vocabulary) goes into
    meta.json too, so that the next preparation there can tell a re-run from another dataset, and so
    does split_bytes (ByteCounter.record: each split's tokens and UTF-8 bytes, for bits per byte).
    """
    dtype = np.dtype(dtype).name
    if tokenizer.kind == "bpe":
        with open(out.path(TOKENIZER_FILE), "wb") as f:
            f.write(tokenizer.json.encode("utf-8"))  # bytes: exactly the text the sha256 is of
        meta = bpe_meta(tokenizer, dtype)
    elif tokenizer.kind == "char":
        meta = dict(tokenizer.meta(), dtype=dtype)
    else:
        meta = {"kind": tokenizer.kind, "vocab_size": tokenizer.vocab_size, "dtype": dtype}
    if preparation is not None:
        meta = dict(meta, preparation=preparation)
    if split_bytes is not None:
        meta = dict(meta, split_bytes=split_bytes)
    write_meta(out, meta, pickle_too=tokenizer.kind == "char")
    # an earlier preparation of this directory with another tokenizer left files this one has not
    if tokenizer.kind != "bpe":
        out.remove_at_commit(TOKENIZER_FILE)
    if tokenizer.kind != "char":
        out.remove_at_commit("meta.pkl")
    return meta


def bpe_meta(tokenizer, dtype):
    """
    A bpe dataset's meta.json entries for its tokenizer (read back by dataset.read_dataset_meta).
    """
    return dict(tokenizer.file_meta(), dtype=np.dtype(dtype).name)


def write_meta(out, meta, pickle_too):
    """
    meta.json (safe to read; read_dataset_meta reads it first) and optionally nanoGPT's meta.pkl.
    """
    json_meta = dict(meta)
    if "itos" in json_meta:
        # JSON keys are strings
        json_meta["itos"] = {str(i): ch for i, ch in json_meta["itos"].items()}
    with open(out.path("meta.json"), "w", encoding="utf-8") as f:
        json.dump(json_meta, f, ensure_ascii=False, indent=1)
    if pickle_too:
        # exactly nanoGPT's keys, so its sample.py reads this file
        nano = {"vocab_size": meta["vocab_size"], "itos": meta["itos"], "stoi": meta["stoi"]}
        with open(out.path("meta.pkl"), "wb") as f:
            pickle.dump(nano, f)
