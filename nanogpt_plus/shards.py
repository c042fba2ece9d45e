"""
llm.c's token shards: the .bin files of llm.c, build-nanogpt and modded-nanogpt (their pre-tokenized
FineWeb shards too), written by data/fineweb/prepare.py, and how a dataset directory's token files
are found.

The format, as llm.c writes it (dev/data/data_common.py, write_datafile) and reads it
(llmc/dataloader.h, dataloader_load_shard_; train_gpt2.py, _peek_data_shard / _load_data_shard):
    bytes 0..1023   a header of 256 int32 (little-endian): [0] magic, [1] version, [2] token count, the rest 0
    bytes 1024..    the tokens, token count of them, nothing after
    magic 20240520, version 1: uint16 tokens (GPT-2, vocabularies up to 65,536)
    magic 20240801, version 7: uint32 tokens (llm.c's llama-3 shards, larger vocabularies)
A reader checks magic, version and that the file is exactly 1024 + count * itemsize bytes long
(llm.c checks the same three things), so a truncated shard or a file that isn't a shard is refused,
never half-read.

Usage:
    from nanogpt_plus.shards import find_shards, open_shard, read_header, write_shard
    write_shard('data/mine/mine_train_000001.bin', tokens)    # tokens: a uint16 or uint32 array; atomic
    header = read_header(path)                                 # validated: .num_tokens, .dtype, ...
    tokens = open_shard(path)                                  # read-only np.memmap of the tokens
    train, val = find_shards('data/fineweb')                   # the token files of a dataset, by name
"""

import os
from dataclasses import dataclass

import numpy as np

from nanogpt_plus.errors import UserError
from nanogpt_plus.files import atomic_write

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4  # 1024: the tokens start here
MAX_TOKENS = 2 ** 31 - 1  # the count is an int32 (llm.c asserts fewer than 2**31 tokens per shard)
# magic -> (version, token dtype): llm.c's two kinds of token shard
FORMATS = {20240520: (1, np.dtype(np.uint16)), 20240801: (7, np.dtype(np.uint32))}
RAW_NAMES = ("train.bin", "val.bin")  # nanoGPT's header-less uint16 files


@dataclass(frozen=True)
class ShardHeader:
    path: str
    magic: int
    version: int
    num_tokens: int
    dtype: np.dtype


def token_dtype(vocab_size):
    """
    The shard dtype for a vocabulary: uint16 while every id fits (GPT-2's 50,257), else uint32.
    """
    return np.dtype(np.uint16) if vocab_size <= 2 ** 16 else np.dtype(np.uint32)


def _format_of(dtype):
    """ (magic, version) of the shard kind that stores dtype tokens. """
    for magic, (version, kind) in FORMATS.items():
        if np.dtype(dtype) == kind:
            return magic, version
    raise ValueError(f"llm.c shards hold uint16 or uint32 tokens, not {np.dtype(dtype)}")


def as_token_array(ids, dtype):
    """
    ids as a dtype array, refusing (instead of silently wrapping, as numpy would) an id that doesn't
    fit.
    """
    arr = np.asarray(ids)
    dtype = np.dtype(dtype)
    if arr.dtype == dtype:
        return arr
    limit = np.iinfo(dtype).max
    if arr.size and (arr.min() < 0 or arr.max() > limit):
        bad = int(arr.max()) if arr.max() > limit else int(arr.min())
        raise UserError(
            f"token id {bad} does not fit in {dtype} (0..{limit:,}); the tokenizer's vocabulary is "
            f"too large for {dtype} token files")
    return arr.astype(dtype)


# -----------------------------------------------------------------------------
# writing

def shard_header(num_tokens, dtype):
    """ The 256 int32 header of a shard of num_tokens dtype tokens, as little-endian bytes. """
    magic, version = _format_of(dtype)
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = (magic, version, num_tokens)
    return header.tobytes()


def write_shard(path, tokens):
    """
    One shard at path: the header, then the tokens (a uint16 or uint32 array; the dtype picks the
    kind). Written under a temp name and renamed when complete (nanogpt_plus.files), so path is
    never half a shard.
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not 0 < len(tokens) <= MAX_TOKENS:
        raise ValueError(
            f"a shard holds 1 to {MAX_TOKENS:,} tokens in a flat array, got shape {tokens.shape}")
    header = shard_header(len(tokens), tokens.dtype)
    # little-endian, as llm.c's files are
    data = tokens.astype(tokens.dtype.newbyteorder("<"), copy=False)

    def write(f):
        f.write(header)
        f.write(memoryview(np.ascontiguousarray(data)).cast("B"))
    atomic_write(path, write)


# -----------------------------------------------------------------------------
# reading

def read_header(path):
    """
    The validated header of the shard at path; anything else is one UserError naming the file.
    """
    if not os.path.isfile(path):
        raise UserError(f"no token shard at {path}; prepare the dataset first")
    size = os.path.getsize(path)
    if size < HEADER_BYTES:
        raise UserError(
            f"{path} is {size} bytes, shorter than the 1024-byte header of an llm.c token shard; "
            f"it is truncated or not a shard: prepare it again")
    with open(path, "rb") as f:
        magic, version, num_tokens = (int(v) for v in np.frombuffer(f.read(12), dtype="<i4"))
    if magic not in FORMATS:
        known = " or ".join(f"{m} ({d})" for m, (_, d) in FORMATS.items())
        raise UserError(f"{path} has magic number {magic}, not an llm.c token shard's {known}; "
                        f"pass a directory of token shards (or nanoGPT's train.bin/val.bin)")
    expected_version, dtype = FORMATS[magic]
    if version != expected_version:
        raise UserError(
            f"{path} has format version {version}, but magic {magic} shards are version "
            f"{expected_version}; this reader doesn't know that format: prepare the shard again")
    expected = HEADER_BYTES + num_tokens * dtype.itemsize
    if num_tokens <= 0 or size != expected:
        raise UserError(
            f"{path} is {size:,} bytes, but its header says {num_tokens:,} {dtype} tokens "
            f"({max(expected, 0):,} bytes); it is truncated or corrupt: prepare it again")
    return ShardHeader(path, magic, version, num_tokens, dtype)


def open_shard(path):
    """ The tokens of a validated shard as a read-only np.memmap (the file is never read whole). """
    header = read_header(path)
    return np.memmap(path, dtype=header.dtype.newbyteorder("<"), mode="r", offset=HEADER_BYTES,
                     shape=(header.num_tokens,))


def has_header(path):
    """
    Whether a token file is an llm.c shard; train.bin and val.bin (exactly) are nanoGPT's raw files.
    """
    return os.path.basename(path) not in RAW_NAMES


# -----------------------------------------------------------------------------
# finding a dataset's token files

def is_shard_name(name):
    """
    Whether a file name is a shard's by find_shards' rule: a *train*.bin or *val*.bin other than
    nanoGPT's.
    """
    if not name.endswith(".bin") or name.startswith(".") or name in RAW_NAMES:
        return False
    return "train" in name or "val" in name


def find_shards(data_dir):
    """
    (train files, val files) of a dataset directory, by name: files called exactly train.bin /
    val.bin are nanoGPT's raw uint16 files; otherwise every *train*.bin (sorted by name) is a
    training shard and every
    *val*.bin a validation shard, with llm.c's header. Either list may be empty (one split, say); a directory
    with no token files at all, or with both kinds, is a UserError. Names only: opening validates
    (open_shard; dataloader.open_token_file for either kind).
    """
    if not os.path.isdir(data_dir):
        raise UserError(f"no dataset directory at {data_dir}; prepare the dataset first")
    names = sorted(n for n in os.listdir(data_dir) if n.endswith(".bin") and not n.startswith("."))
    raw = [n for n in RAW_NAMES if n in names]
    shards = [n for n in names if is_shard_name(n)]
    train = [n for n in shards if "train" in n]
    val = [n for n in shards if "val" in n]
    both = sorted(set(train) & set(val))
    if both:
        raise UserError(
            f"{os.path.join(data_dir, both[0])} names both train and val, so its split is unclear; "
            f"rename it to *train*.bin or *val*.bin")
    if raw and (train or val):
        raise UserError(
            f"{data_dir} holds both nanoGPT's {'/'.join(raw)} and llm.c shards ({(train + val)[0]}, "
            f"...); keep one kind of token file per directory")
    if raw:
        train = [n for n in raw if n == "train.bin"]
        val = [n for n in raw if n == "val.bin"]
    if not (train or val):
        raise UserError(
            f"{data_dir} has no token files (train.bin/val.bin, or *train*.bin / *val*.bin shards); "
            f"prepare the dataset first")
    return [os.path.join(data_dir, n) for n in train], [os.path.join(data_dir, n) for n in val]
