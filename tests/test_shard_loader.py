"""
Training on llm.c token shards: the two data orders (random windows that never cross a shard, drawn in
proportion; sequential windows covering every micro-batch once per epoch, then wrapping), exact resume for
both, DDP == 1 process on shards, token-id checks, and a shard directory through train.py, sample.py, eval.py
and bench.py.
"""
import functools
import json
import math
import os
import sys

import numpy as np
import pytest
import torch

import bench
import train
from helpers import TINY_VOCAB, iter_losses, train_args, train_one_and_two_ranks
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.dataloader import TokenWindowLoader
from nanogpt_plus.dataset import split_files
from nanogpt_plus.dataset.shards import write_shard
from nanogpt_plus.errors import UserError

tiny_args = functools.partial(train_args, dropout=0.1, num_threads=1)  # fixed threads: bitwise runs
TRAIN_SIZES = (700, 500, 300)  # 10 + 7 + 4 = 21 sequential micro-batches of 4 x 16 tokens per epoch


def write_meta(d, vocab_size=TINY_VOCAB):
    stoi = {chr(97 + i): i for i in range(vocab_size)}
    (d / "meta.json").write_text(json.dumps({"kind": "char", "vocab_size": vocab_size, "stoi": stoi,
                                             "itos": {i: c for c, i in stoi.items()}}))


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


def run_train(capsys, args):
    train.main(args)
    return capsys.readouterr().out


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


# -----------------------------------------------------------------------------
# train.py, sample.py, eval.py and bench.py on a shard directory

@pytest.mark.parametrize("script", [train, bench])
def test_data_order_is_checked_before_any_work(script):
    with pytest.raises(UserError, match="data_order must be 'random' or 'sequential', got 'shuffled'"):
        script.check_settings(dict(script.DEFAULTS, data_order='shuffled'))


def test_shard_directory_trains_then_samples_and_evaluates(shard_dataset, tmp_path, capsys, monkeypatch):
    out_dir = tmp_path / "out"
    out = run_train(capsys, tiny_args(shard_dataset, out_dir, max_iters=24, eval_interval=12, lr_decay_iters=24))
    evals = [line for line in out.splitlines() if line.startswith("step ")]
    val = [float(line.rsplit(" ", 1)[1]) for line in evals]
    assert len(val) == 3 and val[-1] < val[0] - 1.0, evals  # it learnt the pattern
    import sample
    monkeypatch.setattr(sys, "argv", ["sample.py", f"--out_dir={out_dir}", "--device=cpu", "--num_samples=1",
                                      "--max_new_tokens=8", "--temperature=0", "--start=abc"])
    sample.main()
    assert "abcdefghijk" in capsys.readouterr().out.splitlines()  # the pattern, continued
    import eval as eval_script
    monkeypatch.setattr(sys, "argv", ["eval.py", f"--out_dir={out_dir}", "--device=cpu", "--task=loss"])
    eval_script.main()
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["data_file"] == os.path.join(shard_dataset, "tiny_val_000000.bin")
    assert result["metrics"]["tokens"] == 5999 and result["metrics"]["loss"] < math.log(TINY_VOCAB) - 1.0


def test_eval_loss_over_several_val_shards_is_their_token_weighted_mean(tmp_path):
    from model import GPT, GPTConfig
    from nanogpt_plus.evaluation import evaluate
    d = tmp_path / "d"
    d.mkdir()
    rng = np.random.default_rng(1)
    for i, n in enumerate((90, 57)):
        write_shard(str(d / f"x_val_{i:06d}.bin"), rng.integers(0, TINY_VOCAB, n).astype(np.uint16))
    write_shard(str(d / "x_train_000002.bin"), np.arange(40, dtype=np.uint16) % TINY_VOCAB)
    write_meta(d)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=TINY_VOCAB)).eval()
    meta = {"kind": "char", "vocab_size": TINY_VOCAB}
    both = evaluate(model, 'loss', meta, dataset=str(d), batch_size=4)
    parts = [evaluate(model, 'loss', meta, data_file=p, batch_size=4)['metrics'] for p in split_files(str(d), 'val')]
    assert both['data_file'] == str(d) and both['metrics']['tokens'] == 89 + 56
    expected = sum(m['loss'] * m['tokens'] for m in parts) / 145
    assert both['metrics']['loss'] == pytest.approx(expected, rel=1e-9)
    assert both['metrics']['bytes'] == sum(m['bytes'] for m in parts)
    assert evaluate(model, 'loss', meta, data_file=str(d), split='train')['metrics']['tokens'] == 39


def test_bench_reads_a_shard_directory(shard_dataset, capsys):
    bench.main(['--device=cpu', '--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=4',
                '--burnin=1', '--steps=2', '--num_threads=1', f'--dataset={shard_dataset}', '--data_order=sequential'])
    assert "time per iteration:" in capsys.readouterr().out


@pytest.mark.parametrize("order", ["random", "sequential"])
def test_resume_is_exact_for_both_orders(shard_dataset, tmp_path, capsys, order):
    """ Stopped at its final checkpoint and resumed further: the same iteration losses, bitwise. """
    args = functools.partial(tiny_args, shard_dataset, data_order=order)
    full = run_train(capsys, args(tmp_path / "full", max_iters=12))
    part1 = run_train(capsys, args(tmp_path / "split", max_iters=6))
    part2 = run_train(capsys, args(tmp_path / "split", max_iters=12, init_from="resume"))
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
