"""
nanogpt_plus/prepare/token_files.py: the token dtype guard (uint16 or uint32 by vocabulary), the writer's total
checked, and a full disk found before a large split is memory-mapped.
"""
import os

import numpy as np
import pytest

from helpers import tokens
from nanogpt_plus.dataset import as_token_array
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import WriteFailed, atomic_outputs
from nanogpt_plus.prepare.token_files import check_vocab_fits, write_token_batches, write_tokens


def test_token_dtype_guard(tmp_path):
    assert as_token_array([0, 65535], np.uint16).dtype == np.uint16
    with pytest.raises(UserError, match="token id 65536 does not fit in uint16"):
        as_token_array([1, 65536], np.uint16)
    with pytest.raises(UserError, match="token id -1"):
        as_token_array([-1, 3], np.uint16)
    # vocabularies past 65,536 get uint32 files; only one past uint32 is refused, before any tokenizing
    assert check_vocab_fits(65536) == np.uint16 and check_vocab_fits(100277) == np.uint32
    with pytest.raises(UserError, match="4,294,967,297 tokens, more than uint32"):
        check_vocab_fits(2 ** 32 + 1)
    write_tokens(str(tmp_path / "big.bin"), [1, 70000, 2 ** 32 - 1], np.uint32)
    assert np.fromfile(tmp_path / "big.bin", dtype=np.uint32).tolist() == [1, 70000, 2 ** 32 - 1]
    # an out-of-range id in a batch stops the writer: no token file appears
    with pytest.raises(UserError):
        with atomic_outputs(str(tmp_path / "out")) as out:
            write_token_batches(out.path("train.bin"), 4, iter([np.array([1, 2]), np.array([3, 70000])]))
    assert os.listdir(tmp_path / "out") == []


def test_write_token_batches_checks_the_total(tmp_path):
    with pytest.raises(RuntimeError, match="expected 5"):
        write_token_batches(str(tmp_path / "x.bin"), 5, iter([np.arange(3)]))
    write_token_batches(str(tmp_path / "y.bin"), 5, iter([np.arange(3), np.arange(2)]))
    assert tokens(tmp_path / "y.bin").tolist() == [0, 1, 2, 0, 1]


@pytest.mark.usefixtures('one_thread')
def test_full_disk_is_found_before_a_large_split_is_memory_mapped(tmp_path, monkeypatch):
    from nanogpt_plus.files import atomic_outputs
    from nanogpt_plus.prepare.token_files import write_token_batches

    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")
    # as on a full disk: an error, not a SIGBUS later
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(WriteFailed, match=r"could not write .*train.bin \(No space left on device\); no "):
        with atomic_outputs(str(tmp_path)) as out:
            write_token_batches(out.path("train.bin"), 10, iter([np.arange(10)]))
    assert os.listdir(tmp_path) == []
