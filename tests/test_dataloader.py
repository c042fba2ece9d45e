"""
nanogpt_plus/dataloader.py: token files (nanoGPT's uint16, or the dtype meta.json names) and llm.c shards read in
two orders (random windows that never cross a shard, drawn in proportion; sequential windows covering every
micro-batch once per epoch), exact resume of both, DDP == 1 process on shards, the CUDA branch's pinned windows, and
the files that would train silently wrong refused in one line: ids beyond the vocabulary (a padded one too), an
empty file, a directory, a file replaced or removed while it is read, a dataset not prepared.
"""
import functools
import json
import math
import os
import shutil
import sys

import numpy as np
import pytest
import torch

import bench
import eval as eval_script
import sample
import train
from helpers import (
    SINGLE,
    TINY_VOCAB,
    copy_dataset,
    exit_code,
    iter_losses,
    one_error_line,
    refuse_to_open,
    tiny_args,
    train_args,
    train_here,
    train_one_and_two_ranks,
    train_out,
    write_meta,
)
from nanogpt_plus import dataloader
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.dataloader import TokenSource, TokenWindowLoader, open_token_file, open_tokens
from nanogpt_plus.dataset import split_files
from nanogpt_plus.dataset.shards import write_shard
from nanogpt_plus.errors import UserError

# -----------------------------------------------------------------------------
# the token-window loader

def reference_batches(tokens_, batch_size, block_size, seed, n, rank=0, world_size=1):
    """ nanoGPT's get_batch with the loader's shared stream: draw world_size offset sets per call, keep rank's. """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        draws = [torch.randint(len(tokens_) - block_size, (batch_size,), generator=g) for _ in range(world_size)]
        ix = draws[rank]
        x = torch.stack([torch.from_numpy(tokens_[i:i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(tokens_[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
        out.append((x, y))
    return out


@pytest.mark.parametrize("rank, world_size", [(0, 1), (1, 2)])
def test_loader_cuda_branch_pins_one_contiguous_window_and_yields_the_same_batches(tmp_path, monkeypatch, rank,
                                                                                   world_size):
    """
    The CUDA branch (pinned memory, non_blocking copy) run on the CPU with pin_memory stubbed: it must pin
    the whole (B, T+1) window once, contiguous (pinning a strided x or y view keeps its strides, and the
    non_blocking copy then goes through a pageable temporary), and yield exactly the CPU branch's batches.
    """
    path = tmp_path / "train.bin"
    data = np.random.default_rng(0).integers(0, 50000, 5000).astype(np.uint16)
    data.tofile(path)
    pinned = []

    def pin_memory(self, *args, **kwargs):
        pinned.append((tuple(self.shape), self.is_contiguous()))
        return self  # no CUDA here: stand in for the page-locked copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    B = 4
    T = 16
    loaders = {}
    for pin in (False, True):
        loaders[pin] = TokenWindowLoader(str(path), B, T, seed=7, rank=rank, world_size=world_size, device='cpu')
        loaders[pin]._pin = pin  # what device='cuda' sets
    expected = reference_batches(data, B, T, 7, 3, rank, world_size)
    for k in range(3):
        (x_cpu, y_cpu) = loaders[False].next_batch()
        (x_pin, y_pin) = loaders[True].next_batch()
        for x, y in ((x_cpu, y_cpu), (x_pin, y_pin)):
            assert x.dtype == y.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()
            assert torch.equal(x, expected[k][0]) and torch.equal(y, expected[k][1])
    assert pinned == [((B, T + 1), True)] * 3  # one contiguous window per batch, not x and y apart
    # the state resumes the stream exactly, whichever branch
    state = loaders[True].state_dict()
    resumed = TokenWindowLoader(str(path), B, T, seed=7, rank=rank, world_size=world_size, device='cpu')
    resumed.load_state_dict(state)
    for a, b in zip(resumed.next_batch(), loaders[True].next_batch()):
        assert torch.equal(a, b)


@pytest.mark.usefixtures('one_thread')
def test_raw_token_files_take_their_dtype_from_meta_json(tmp_path):
    ids = np.array([0, 65535, 65536, 123456], dtype=np.uint32)
    ids.tofile(tmp_path / "train.bin")
    # no meta.json: nanoGPT's uint16
    assert open_token_file(str(tmp_path / "train.bin")).dtype == np.uint16
    assert len(open_token_file(str(tmp_path / "train.bin"))) == 8
    # a bpe meta.json: only its "dtype" is read (the tokenizer.json it names is not even opened)
    meta = {"kind": "bpe", "vocab_size": 200000, "dtype": "uint32", "tokenizer_file": "missing.json"}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    tokens = open_token_file(str(tmp_path / "train.bin"))
    assert tokens.dtype == np.uint32 and tokens.tolist() == ids.tolist()
    assert TokenSource([str(tmp_path / "train.bin")]).read(np.array([0]), np.array([1]), 3).tolist() == \
        [[65535, 65536, 123456]]
    with open(tmp_path / "train.bin", "ab") as f:
        f.write(b"\0\0")  # half a uint32 token more
    with pytest.raises(UserError, match=r"is 18 bytes, not a whole number of uint32 tokens \(4 bytes each\)"):
        open_token_file(str(tmp_path / "train.bin"))
    (tmp_path / "meta.json").write_text(json.dumps(dict(meta, dtype="int64")))
    with pytest.raises(UserError, match="says the token files are 'int64', not one of uint16, uint32"):
        open_token_file(str(tmp_path / "train.bin"))
    # uint16 (or no dtype: nanoGPT's) for a vocabulary past 65,536: the ids were cut, or the file is uint32
    for stated in ({"dtype": "uint16"}, {}):
        (tmp_path / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "dtype"} | stated))
        with pytest.raises(UserError, match="are uint16, but its vocabulary of 200,000 tokens needs uint32"):
            open_token_file(str(tmp_path / "train.bin"))


# -----------------------------------------------------------------------------
# token files

@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize("scan_tokens", [dataloader.SCAN_TOKENS, 0], ids=["whole-file", "per-batch"])
def test_token_id_beyond_the_vocabulary_is_one_line(dataset, tmp_path, monkeypatch, scan_tokens):
    tokens = np.tile(np.arange(TINY_VOCAB), 300)
    tokens[::7] = TINY_VOCAB + 5  # a meta of 20 characters, a file with id 25 (in every window)
    bad = copy_dataset(dataset, tmp_path / "bad", train_tokens=tokens)
    # 0: every file is checked batch by batch
    monkeypatch.setattr(dataloader, "SCAN_TOKENS", scan_tokens)
    message = rf"train.bin holds token ids up to {TINY_VOCAB + 5}, beyond the model's vocab_size \({TINY_VOCAB}\)"
    with pytest.raises(UserError, match=message):
        train.main(train_args(bad, tmp_path / "out", num_threads=1))
    with pytest.raises(UserError, match=message):
        bench.main(["--device=cpu", "--n_layer=1", "--n_head=1", "--n_embd=8", "--block_size=16",
                    "--batch_size=64", "--burnin=0", "--steps=3", "--num_threads=1", f"--dataset={bad}"])


@pytest.mark.usefixtures('one_thread')
def test_empty_token_file_is_one_line(dataset, tmp_path):
    empty = copy_dataset(dataset, tmp_path / "empty", train_tokens=[])
    with pytest.raises(UserError, match=r"train.bin is empty \(0 tokens\); re-run"):
        train.main(train_args(empty, tmp_path / "out"))


@pytest.mark.usefixtures('one_thread')
def test_ids_in_a_padded_vocabulary_are_refused(tmp_path):
    d = tmp_path / 'gpt2ids'
    d.mkdir()
    # 50260: padding, no text
    np.array([1, 2, 50256, 50260] * 100, dtype=np.uint16).tofile(d / 'train.bin')
    np.array([1, 2, 3] * 100, dtype=np.uint16).tofile(d / 'val.bin')
    (d / 'meta.json').write_text(json.dumps({'kind': 'gpt2', 'vocab_size': 50257}))
    with pytest.raises(UserError, match=r"train.bin holds token ids up to 50260, beyond the tokenizer's vocabulary "
                                        r"\(50,257 tokens; the model's ids from 50,257 to 50,304 are padding"):
        train_here(str(d), tmp_path / 'out', n_embd=8, n_head=1, n_layer=1)


@pytest.mark.usefixtures('one_thread')
def test_a_dataset_replaced_or_removed_while_read_stops_in_one_line(tmp_path):
    path = tmp_path / 'train.bin'
    np.arange(1000, dtype=np.uint16).tofile(path)
    source = TokenSource([str(path)])
    source.tokens(0)
    np.arange(500, dtype=np.uint16).tofile(tmp_path / 'new.bin')
    os.replace(tmp_path / 'new.bin', path)  # prepared again: another file, shorter
    with pytest.raises(UserError, match="train.bin changed while the run was reading it"):
        source.tokens(0)
    os.remove(path)
    with pytest.raises(UserError, match="changed while the run was reading it"):
        source.tokens(0)


@pytest.mark.usefixtures('one_thread')
def test_a_train_bin_that_is_a_directory_is_one_line(tiny_dataset, tmp_path):
    data = tmp_path / 'data'
    shutil.copytree(tiny_dataset, data)
    os.remove(data / 'train.bin')
    os.mkdir(data / 'train.bin')
    with pytest.raises(
        UserError, match=rf"^{data}/train.bin is a directory, not a token file; move it away"
    ):
        train.main(train_args(str(data), tmp_path / 'out'))


@pytest.mark.usefixtures('one_thread')
def test_an_unreadable_train_bin_is_one_line(tiny_dataset, tmp_path, monkeypatch, capsys):
    data = tmp_path / 'data'
    shutil.copytree(tiny_dataset, data)
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    refuse_to_open(monkeypatch, data / 'train.bin')  # as chmod 000 does for a user other than root
    assert exit_code(lambda: train.main(train_args(str(data), tmp_path / 'out'))) == 2
    assert one_error_line(capsys) == (f"error: could not read {data}/train.bin (Permission denied); make it readable "
                                      f"by this user, or pass another --dataset")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before


@pytest.mark.usefixtures('one_thread')
def test_a_missing_dataset_given_as_a_path_hints_no_prepare_script(tmp_path):
    with pytest.raises(UserError, match=r"no token file at .*train.bin; prepare the dataset first$"):
        open_tokens(str(tmp_path / 'train.bin'), dataset=str(tmp_path))
    with pytest.raises(UserError, match=r"run python data/mine/prepare.py first"):
        open_tokens(str(tmp_path / 'train.bin'), dataset='mine')


TRAIN_SIZES = (700, 500, 300)  # 10 + 7 + 4 = 21 sequential micro-batches of 4 x 16 tokens per epoch


@pytest.fixture(scope="module")
def shard_dataset(tmp_path_factory):
    """ conftest's learnable pattern as llm.c shards: a val shard of 6,000 tokens and 3 small train shards. """
    d = tmp_path_factory.mktemp("shards")
    rng = np.random.default_rng(0)
    tokens = np.tile(np.arange(TINY_VOCAB), 400)
    noise = rng.random(tokens.size) < 0.05
    tokens[noise] = rng.integers(0, TINY_VOCAB, noise.sum())
    tokens = tokens.astype(np.uint16)
    write_shard(str(d / "tiny_val_000000.bin"), tokens[:6000])
    start = 6000
    for i, n in enumerate(TRAIN_SIZES, 1):
        write_shard(str(d / f"tiny_train_{i:06d}.bin"), tokens[start:start + n])
        start += n
    write_meta(d)
    return str(d)


def labelled_shards(d, sizes, dtype=np.uint16):
    """ Train shards whose token at position p of shard i is 10,000 * i + p: a window says where it came from. """
    d.mkdir(exist_ok=True)
    for i, n in enumerate(sizes):
        write_shard(str(d / f"lab_train_{i:06d}.bin"), (10_000 * i + np.arange(n)).astype(dtype))
    return split_files(str(d), "train")


# -----------------------------------------------------------------------------
# the two orders, on the loader itself

def test_random_order_stays_inside_a_shard_and_draws_shards_in_proportion(tmp_path):
    sizes = (1000, 3000, 216)
    T = 16
    loader = TokenWindowLoader(labelled_shards(tmp_path / "d", sizes), 64, T, seed=3)
    shards = []
    for _ in range(150):
        x, y = loader.next_batch()
        shard = x // 10_000
        pos = x % 10_000
        # one shard, consecutive tokens
        assert (shard == shard[:, :1]).all() and (pos.diff(dim=1) == 1).all()
        assert torch.equal(y[:, :-1], x[:, 1:]) and (y[:, -1] == x[:, -1] + 1).all()
        # y's last token is inside the shard
        assert (pos[:, -1] + 1 < torch.tensor(sizes)[shard[:, 0]]).all()
        shards += shard[:, 0].tolist()
    windows = np.array(sizes) - T
    expected = windows / windows.sum()  # 0.234, 0.714, 0.048
    observed = np.bincount(shards, minlength=3) / len(shards)
    assert np.abs(observed - expected).max() < 0.025, (observed, expected)  # 9,600 draws: ~4 sigma


@pytest.mark.parametrize("world_size", [1, 2])
def test_sequential_order_covers_every_micro_batch_once_per_epoch_and_wraps(tmp_path, world_size):
    # a micro-batch reads 33 tokens and moves on by 32
    B = 4
    T = 8
    sizes = (101, 33, 29, 65)  # 3, 1, 0 (too short: skipped) and 2 micro-batches: 6 per epoch
    files = labelled_shards(tmp_path / "d", sizes)
    # (shard, first token): two epochs
    expected = [(0, 0), (0, 32), (0, 64), (1, 0), (3, 0), (3, 32)] * 2
    loaders = [TokenWindowLoader(files, B, T, rank=r, world_size=world_size, order='sequential')
               for r in range(world_size)]
    seen = []
    for _ in range(len(expected) // world_size):
        for loader in loaders:  # micro-batch k of the shared stream is rank k % world_size's
            x, y = loader.next_batch()
            assert torch.equal(x.flatten()[1:], y.flatten()[:-1])  # B*T+1 consecutive tokens
            assert torch.equal(x[:, 0] % 10_000, x[0, 0] % 10_000 + torch.arange(B) * T)
            seen.append((int(x[0, 0]) // 10_000, int(x[0, 0]) % 10_000))
    assert seen == expected
    assert loaders[0].epoch == 1 and loaders[0].state_dict()['epoch'] == 1
    # the state resumes mid-stream, on any rank's loader
    state = loaders[0].state_dict()
    resumed = TokenWindowLoader(files, B, T, rank=0, world_size=world_size, order='sequential')
    resumed.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(), loaders[0].next_batch()))


def test_loader_states_across_versions_and_orders(tmp_path):
    files = labelled_shards(tmp_path / "d", (500, 300))
    random = TokenWindowLoader(files, 4, 8, seed=5)
    random.next_batch()
    # a checkpoint from before data_order
    old = {k: v for k, v in random.state_dict().items() if k != 'order'}
    resumed = TokenWindowLoader(files, 4, 8, seed=5)
    resumed.load_state_dict(old)
    assert all(torch.equal(a, b) for a, b in zip(resumed.next_batch(), random.next_batch()))
    with pytest.raises(UserError, match=r"read the random order, but data_order is 'sequential'; resume with "
                                        r"--data_order=random"):
        TokenWindowLoader(files, 4, 8, order='sequential').load_state_dict(old)
    sequential = TokenWindowLoader(files, 4, 8, order='sequential').state_dict()
    other = labelled_shards(tmp_path / "other", (500,))
    with pytest.raises(UserError, match="resume on the dataset the run was started on"):
        TokenWindowLoader(other, 4, 8, order='sequential').load_state_dict(dict(sequential, file_name='x.bin'))
    with pytest.raises(UserError, match=r"holds batch_size\*block_size\+1 \(33\) tokens.*the largest has 29"):
        TokenWindowLoader(labelled_shards(tmp_path / "short", (29,)), 4, 8, order='sequential')


@pytest.mark.parametrize("scan", [True, False])
def test_token_ids_beyond_the_vocabulary_are_refused_in_uint32_shards(tmp_path, monkeypatch, scan):
    # ids up to 10,399 in the second
    files = labelled_shards(tmp_path / "d", (300, 400), dtype=np.uint32)
    if not scan:  # a split too large to scan at start-up: each window is checked as it is read
        monkeypatch.setattr("nanogpt_plus.dataloader.SCAN_TOKENS", 10)
    loader = TokenWindowLoader(files, 8, 16, order='sequential')
    loader.check_vocab(20_000)  # every id fits
    loader.next_batch()
    loader = TokenWindowLoader(files, 8, 16, order='sequential')
    with pytest.raises(UserError, match=r"lab_train_000001.bin holds token ids up to 10\d{3}, beyond the "
                                        r"model's vocab_size \(10000\)"):
        loader.check_vocab(10_000)
        for _ in range(4):  # shard 0's 2 micro-batches pass; shard 1's first is refused
            loader.next_batch()


@pytest.mark.parametrize("script", [train, bench])
def test_data_order_is_checked_before_any_work(script):
    with pytest.raises(UserError, match="data_order must be 'random' or 'sequential', got 'shuffled'"):
        script.check_settings(dict(script.DEFAULTS, data_order='shuffled'))


def test_shard_directory_trains_then_samples_and_evaluates(shard_dataset, tmp_path, capsys, monkeypatch):
    out_dir = tmp_path / "out"
    out = train_out(capsys, tiny_args(shard_dataset, out_dir, max_iters=24, eval_interval=12, lr_decay_iters=24))
    evals = [line for line in out.splitlines() if line.startswith("step ")]
    val = [float(line.rsplit(" ", 1)[1]) for line in evals]
    assert len(val) == 3 and val[-1] < val[0] - 1.0, evals  # it learnt the pattern
    monkeypatch.setattr(sys, "argv", ["sample.py", f"--out_dir={out_dir}", "--device=cpu", "--num_samples=1",
                                      "--max_new_tokens=8", "--temperature=0", "--start=abc"])
    sample.main()
    assert "abcdefghijk" in capsys.readouterr().out.splitlines()  # the pattern, continued
    monkeypatch.setattr(sys, "argv", ["eval.py", f"--out_dir={out_dir}", "--device=cpu", "--task=loss"])
    eval_script.main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["data_file"] == os.path.join(shard_dataset, "tiny_val_000000.bin")
    assert result["metrics"]["tokens"] == 5999 and result["metrics"]["loss"] < math.log(TINY_VOCAB) - 1.0


def test_bench_reads_a_shard_directory(shard_dataset, capsys):
    bench.main(['--device=cpu', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=4',
                '--burnin=1', '--steps=2', '--num_threads=1', f'--dataset={shard_dataset}', '--data_order=sequential'])
    assert "time per iteration:" in capsys.readouterr().out


@pytest.mark.parametrize("order", ["random", "sequential"])
def test_resume_is_exact_for_both_orders(shard_dataset, tmp_path, capsys, order):
    """ Stopped at its final checkpoint and resumed further: the same iteration losses, bitwise. """
    args = functools.partial(tiny_args, shard_dataset, data_order=order)
    full = train_out(capsys, args(tmp_path / "full", max_iters=12))
    part1 = train_out(capsys, args(tmp_path / "split", max_iters=6))
    part2 = train_out(capsys, args(tmp_path / "split", max_iters=12, init_from="resume"))
    assert min(iter_losses(part2)) == 7
    assert {**iter_losses(part1), **iter_losses(part2)} == iter_losses(full)
    loader = load_checkpoint(str(tmp_path / "split" / "ckpt.pt"))["loader"]
    assert loader["order"] == order
    if order == "sequential":  # 13 steps of 2 micro-batches: past the 21 of an epoch
        assert loader["epoch"] == 1 and loader["micro_step"] == 26
    other = "random" if order == "sequential" else "sequential"
    with pytest.raises(UserError, match=f"resume with --data_order={order}"):
        train.main(args(tmp_path / "split", max_iters=14, init_from="resume", data_order=other))


def test_ddp_two_processes_equals_one_on_shards_in_sequential_order(shard_dataset, tmp_path):
    common = tiny_args(shard_dataset, tmp_path, gradient_accumulation_steps=4, max_iters=6, eval_interval=6,
                       dropout=0.0, data_order="sequential")
    train_one_and_two_ranks(common, tmp_path, steps=7)
    states = [load_checkpoint(str(tmp_path / run / "ckpt.pt"))["loader"] for run in ("one", "two")]
    # 7 steps x 4 micro-batches: past one epoch
    assert states[0] == states[1] and states[0]["epoch"] == 1


def test_a_single_process_computes_none_of_the_digests_the_ranks_compare(tiny_dataset, monkeypatch):
    """ training_data's comparisons (the tokenizer's digest, each file's, the token counts) are for ranks to agree
    on: one process opens its data and loaders without reading a file for a digest. """
    def refused(*args):
        raise AssertionError("a digest computed with no rank to compare it with")
    monkeypatch.setattr(dataloader, 'data_digests', refused)
    monkeypatch.setattr(dataloader, 'tokenizer_digest', refused)
    spec = dataloader.DataSpec(dataset=tiny_dataset, data_order='random', batch_size=2, block_size=8, seed=1)
    data, train_loader, eval_loaders = dataloader.training_data(spec, SINGLE)
    assert data.directory and set(eval_loaders) == {'train', 'val'}
    X, Y = train_loader.next_batch()
    assert X.shape == (2, 8) and torch.equal(X[:, 1:], Y[:, :-1])


def test_a_token_file_that_is_not_a_regular_file_is_said_without_opening_it(tmp_path):
    """ A FIFO's size is 0 (not "empty") and reading it waits forever: its kind is said, from os.stat alone. """
    fifo = tmp_path / 'train.bin'
    os.mkfifo(fifo)
    with pytest.raises(UserError) as e:
        open_token_file(str(fifo))
    assert str(e.value) == (f"{fifo} is a FIFO (named pipe), not a regular token file; move it away and re-run the "
                            f"dataset's prepare.py, or pass another --dataset")
    assert os.listdir(tmp_path) == ['train.bin']
