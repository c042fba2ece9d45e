"""
Benchmark the training loader (nanogpt_plus.dataloader): milliseconds per next_batch at B=64, T=1024 (a
GPT-2 124M micro-batch) on the CPU, for nanoGPT's raw train.bin and for a directory of llm.c shards holding
the same tokens, in both data orders. A benchmark, not a test: it prints figures, and checks only that the
first sequential batches of both are the same (the first shard is the start of train.bin).

The files are generated (random GPT-2 ids) and then read from the page cache: the figures are the loader's
own cost (the memmaps, the index arithmetic, the copy into an int64 tensor), not the disk's.

Usage:
    python scripts/bench_loader.py
    python scripts/bench_loader.py --tokens=1000000000 --shard_tokens=100000000 --batches=1000
"""
# first, before torch is imported (seconds): a signal from here on stops the script in one line
# and exit code 130, a signal during the imports once they are done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import os
import statistics
import time

import numpy as np

# (scripts/ is on sys.path when a script in it runs)
from benchtools import cpu_model, work_directory
from configurator import Group, Schema, Setting, configure
from nanogpt_plus.dataloader import TokenWindowLoader
from nanogpt_plus.dataset import split_files
from nanogpt_plus.dataset.shards import write_shard
from nanogpt_plus.runtime import run_main

DEFAULTS = Schema(Group(
    'benchmark',
    tokens=Setting(100_000_000, "tokens in train.bin (and in all the shards together)", low=1),
    shard_tokens=Setting(10_000_000, "tokens per shard", low=1, high=2 ** 31 - 1),
    batch_size=Setting(64, "sequences per batch (B)", low=1),
    block_size=Setting(1024, "tokens per sequence (T)", low=1),
    batches=Setting(300, "timed next_batch calls per configuration (after 10 untimed ones)", low=1),
    seed=Setting(1337, "the random token ids and the loaders' data order", low=0),
    work_dir=Setting('', "where the files go ('' = a temporary directory, removed after)"),
))


def write_files(work, tokens, shard_tokens, seed):
    """ work/raw/train.bin and work/shards/bench_train_NNNNNN.bin, the same random uint16 ids (GPT-2's range). """
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 50257, tokens, dtype=np.uint16)
    os.makedirs(os.path.join(work, 'raw'), exist_ok=True)
    ids.tofile(os.path.join(work, 'raw', 'train.bin'))
    for i, start in enumerate(range(0, tokens, shard_tokens)):
        write_shard(os.path.join(work, 'shards', f'bench_train_{i + 1:06d}.bin'), ids[start:start + shard_tokens])
    return os.path.join(work, 'raw'), os.path.join(work, 'shards')


def time_loader(loader, batches):
    """
    (min, median, mean) milliseconds per next_batch, after 10 untimed calls. The minimum is the loader's own
    cost; the median and mean add what other processes on a busy machine take from it (a time slice is ~4-16 ms).
    """
    for _ in range(10):
        loader.next_batch()
    times = []
    for _ in range(batches):
        t0 = time.perf_counter()
        loader.next_batch()
        times.append((time.perf_counter() - t0) * 1000)
    return min(times), statistics.median(times), statistics.mean(times)


def main():
    config = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(config)
    B = config.batch_size
    T = config.block_size
    with work_directory(config.work_dir, 'bench_loader_') as work:
        raw, shards = write_files(work, config.tokens, config.shard_tokens, config.seed)
        print(f"cpu: {cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
        print(f"{config.tokens:,} tokens: one train.bin, and {len(split_files(shards, 'train'))} shards; "
              f"B={B}, T={T}, {config.batches} batches each\n")
        print(f"{'files':>10} {'order':>10} {'min ms':>7} {'median ms':>10} {'mean ms':>8} {'tokens/s (mean)':>16}")
        for name, data_dir in (('train.bin', raw), ('shards', shards)):
            for order in ('random', 'sequential'):
                loader = TokenWindowLoader(split_files(data_dir, 'train'), B, T, seed=config.seed, order=order)
                fastest, median, mean = time_loader(loader, config.batches)
                print(f"{name:>10} {order:>10} {fastest:>7.2f} {median:>10.2f} {mean:>8.2f} "
                      f"{B * T / mean * 1000:>16,.0f}")
        same = [TokenWindowLoader(split_files(d, 'train'), B, T, order='sequential') for d in (raw, shards)]
        n = min(20, (config.shard_tokens - 1) // (B * T))  # the micro-batches of the first shard
        print(f"\nthe first {n} sequential batches of train.bin and of the shards agree:",
              all((same[0].next_batch()[0] == same[1].next_batch()[0]).all().item() for _ in range(n)))


if __name__ == "__main__":
    run_main(main)
