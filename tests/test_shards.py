"""
nanogpt_plus/dataset/shards.py, llm.c's token shards: a shard of llm.c's own writer read back and ours the same
bytes, bad shards in one line naming the file, ids that don't fit refused, and the naming rule that finds them.
"""
import os

import numpy as np
import pytest

from helpers import EOT
from nanogpt_plus.dataloader import open_token_file
from nanogpt_plus.dataset import as_token_array, find_shards
from nanogpt_plus.dataset.shards import open_shard, read_header, write_shard
from nanogpt_plus.errors import UserError

# -----------------------------------------------------------------------------
# the format

def hand_written_shard(path, tokens, magic, version, dtype):
    """ An llm.c shard as its own writer makes one (data_common.write_datafile): 256 int32, then the tokens. """
    header = np.zeros(256, dtype=np.int32)
    header[0] = magic
    header[1] = version
    header[2] = len(tokens)
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.array(tokens, dtype=dtype).tobytes())


@pytest.mark.parametrize("magic,version,dtype", [(20240520, 1, np.uint16), (20240801, 7, np.uint32)])
def test_shard_of_an_independent_writer_is_read_and_ours_is_the_same_bytes(tmp_path, magic, version, dtype):
    tokens = [EOT, 0, 1, 65535, 42] + ([70000, 2 ** 32 - 1] if dtype == np.uint32 else [])
    hand_written_shard(tmp_path / "theirs_train_000001.bin", tokens, magic, version, dtype)
    header = read_header(str(tmp_path / "theirs_train_000001.bin"))
    assert (header.magic, header.version, header.num_tokens, header.dtype) == (magic, version, len(tokens), dtype)
    read = open_shard(str(tmp_path / "theirs_train_000001.bin"))
    assert isinstance(read, np.memmap) and read.dtype == dtype and read.tolist() == tokens
    write_shard(str(tmp_path / "ours.bin"), np.array(tokens, dtype=dtype))
    assert (tmp_path / "ours.bin").read_bytes() == (tmp_path / "theirs_train_000001.bin").read_bytes()
    # no temp file left behind
    assert sorted(os.listdir(tmp_path)) == ["ours.bin", "theirs_train_000001.bin"]


def test_bad_shards_each_give_one_clear_error_naming_the_file(tmp_path):
    good = tmp_path / "good.bin"
    hand_written_shard(good, list(range(100)), 20240520, 1, np.uint16)
    raw = good.read_bytes()

    def refused(name, data, message):
        path = tmp_path / name
        path.write_bytes(data)
        with pytest.raises(UserError, match=message) as e:
            open_shard(str(path))
        assert str(path) in str(e.value) and "\n" not in str(e.value)

    refused("truncated.bin", raw[:-2], r"is 1,222 bytes, but its header says 100 uint16 tokens \(1,224 bytes\); "
                                       r"it is truncated or corrupt")
    refused("short.bin", raw[:1000], "shorter than the 1024-byte header")
    wrong_magic = np.frombuffer(raw, dtype=np.uint8).copy()
    # llm.c's HellaSwag magic
    wrong_magic[:4] = np.frombuffer(np.int32(20240522).tobytes(), dtype=np.uint8)
    refused("magic.bin", wrong_magic.tobytes(), "has magic number 20240522, not an llm.c token shard's")
    # a raw file
    refused("numpy.bin", np.arange(600, dtype=np.uint16).tobytes(), "has magic number 65536")
    corrupt = np.frombuffer(raw, dtype=np.int32).copy()
    corrupt[2] = -7  # the token count
    refused("count.bin", corrupt.tobytes(), "its header says -7 uint16 tokens")
    corrupt[2] = 100
    corrupt[1] = 2
    refused("version.bin", corrupt.tobytes(), "has format version 2, but magic 20240520 shards are version 1")
    with pytest.raises(UserError, match="no token shard at"):
        open_shard(str(tmp_path / "missing.bin"))


def test_token_ids_that_dont_fit_are_refused():
    assert as_token_array([0, 65535], np.uint16).dtype == np.uint16
    with pytest.raises(UserError, match="token id 65536 does not fit in uint16"):
        as_token_array([1, 65536], np.uint16)
    with pytest.raises(UserError, match="token id -1 does not fit in uint32"):
        as_token_array([-1], np.uint32)
    assert as_token_array([2 ** 32 - 1], np.uint32).tolist() == [2 ** 32 - 1]


def test_find_shards_naming_rule(tmp_path):
    raw, shards, mixed = (tmp_path / n for n in ("raw", "shards", "mixed"))
    for d in (raw, shards, mixed):
        d.mkdir()
    for n in ("train.bin", "val.bin"):
        np.arange(10, dtype=np.uint16).tofile(raw / n)
    assert find_shards(str(raw)) == ([str(raw / "train.bin")], [str(raw / "val.bin")])
    # nanoGPT's: no header
    assert open_token_file(str(raw / "train.bin")).tolist() == list(range(10))
    for n in ("b_train_000002.bin", "a_val_000000.bin", "b_train_000001.bin", "my_train.bin", "notes.txt",
              ".b_train_000003.bin.tmp.123"):
        hand_written_shard(shards / n, [1, 2, 3], 20240520, 1, np.uint16)
    train, val = find_shards(str(shards))
    assert [os.path.basename(p) for p in train] == ["b_train_000001.bin", "b_train_000002.bin", "my_train.bin"]
    assert [os.path.basename(p) for p in val] == ["a_val_000000.bin"]
    assert open_token_file(train[0]).tolist() == [1, 2, 3]  # a shard: its header is skipped
    np.arange(10, dtype=np.uint16).tofile(mixed / "train.bin")
    hand_written_shard(mixed / "x_val_000000.bin", [1], 20240520, 1, np.uint16)
    with pytest.raises(UserError, match="holds both nanoGPT's train.bin and llm.c shards"):
        find_shards(str(mixed))
    (mixed / "train.bin").unlink()
    hand_written_shard(mixed / "train_val.bin", [1], 20240520, 1, np.uint16)
    with pytest.raises(UserError, match="train_val.bin names both train and val"):
        find_shards(str(mixed))
    with pytest.raises(UserError, match="has no token files"):
        find_shards(str(tmp_path / "raw" / ".."))
