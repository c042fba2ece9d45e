"""
llm.c's token shards: the .bin files of llm.c, build-nanogpt and modded-nanogpt (their pre-tokenized
FineWeb shards too), written by data/fineweb/prepare.py. Imported only where a dataset directory holds
shards (the loader opening one, the FineWeb preparation): a run on nanoGPT's train.bin/val.bin never
loads it. Which files of a directory are shards is the dataset's naming rule (dataset.find_shards).

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
    from nanogpt_plus.dataset.shards import open_shard, read_header, write_shard
    write_shard('data/mine/mine_train_000001.bin', tokens)    # tokens: a uint16 or uint32 array; atomic
    header = read_header(path)                                 # validated: .num_tokens, .dtype, ...
    tokens = open_shard(path)                                  # read-only np.memmap of the tokens
"""

import os
from dataclasses import dataclass

import numpy as np

from nanogpt_plus.errors import UserError
from nanogpt_plus.files import atomic_write, refuse_special_file

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4  # 1024: the tokens start here
MAX_TOKENS = 2 ** 31 - 1  # the count is an int32 (llm.c asserts fewer than 2**31 tokens per shard)
# magic -> (version, token dtype): llm.c's two kinds of token shard
FORMATS = {20240520: (1, np.dtype(np.uint16)), 20240801: (7, np.dtype(np.uint32))}


@dataclass(frozen=True)
class ShardHeader:
    path: str
    magic: int
    version: int
    num_tokens: int
    dtype: np.dtype


def _format_of(dtype):
    """ (magic, version) of the shard kind that stores dtype tokens. """
    for magic, (version, kind) in FORMATS.items():
        if np.dtype(dtype) == kind:
            return magic, version
    raise ValueError(f"llm.c shards hold uint16 or uint32 tokens, not {np.dtype(dtype)}")


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
    refuse_special_file(path, "token shard")
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
