"""
Benchmark data/fineweb/prepare.py: end-to-end GPT-2 tokenization throughput into llm.c shards (reading the
dataset, tokenizing, filling and writing shards), tokens/s at num_proc=1 vs 2 (or any list; the fastest of
--repeats runs each), on a generated ~30 MB local parquet corpus of Shakespeare excerpts (FineWeb-like rows:
id, text). A benchmark, not a test: it prints figures and checks only that every num_proc writes identical
shards.

Usage:
    python scripts/bench_fineweb_prepare.py
    python scripts/bench_fineweb_prepare.py --size_mb=200 --num_procs=1,2,4,8 --shard_size=10000000
"""
# first, before torch is imported (seconds): a signal from here on stops the script in one line
# and exit code 130, a signal during the imports once they are done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import os
import shutil
import time

# scripts/ is on sys.path
from benchtools import cpu_model, cpu_seconds, parse_num_procs, work_directory
from configurator import Group, Schema, Setting, configure
from nanogpt_plus.prepare.fineweb import prepare_fineweb
from nanogpt_plus.prepare.plays import benchmark_documents
from nanogpt_plus.runtime import run_main
from nanogpt_plus.tokenizer import get_gpt2_encoding

DEFAULTS = Schema(Group(
    'benchmark',
    size_mb=Setting(30, "size of the generated corpus (its text), in MB", low=1),
    num_procs=Setting('1,2', "the num_proc values to compare, comma separated"),
    shard_size=Setting(10 ** 6, "tokens per shard (a 30 MB corpus makes ~10 shards)", low=1, high=2 ** 31 - 1),
    repeats=Setting(3, "runs per num_proc; the fastest is reported (other load on the machine only slows)", low=1),
    seed=Setting(1337, "the generated corpus is the same for a given seed", low=0),
    work_dir=Setting('', "where the corpus, caches and outputs go ('' = a temporary directory, removed after)"),
))


def generate_parquet(path, size_mb, seed):
    """ A parquet corpus of benchmark_documents: returns (its text's size in bytes, documents). """
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = list(benchmark_documents(size_mb, seed))
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path)
    return sum(len(d.encode()) for d in docs), len(docs)


def run_one(work, corpus, num_proc, shard_size):
    """ One fresh prepare_fineweb run; its summary with cpu seconds, and the bytes of its shards. """
    out = os.path.join(work, f"out_{num_proc}")
    shutil.rmtree(out, ignore_errors=True)
    cpu0 = cpu_seconds()
    r = prepare_fineweb(out, files=corpus, num_proc=num_proc, shard_size=shard_size, progress=False,
                        cache_dir=os.path.join(work, "cache"))
    r["cpu_seconds"] = cpu_seconds() - cpu0  # this process and its (finished) workers
    shards = {}
    for name in r["files"]:
        with open(os.path.join(out, name), "rb") as f:
            shards[name] = hash(f.read())
    return r, shards


def fastest(work, corpus, num_proc, shard_size, repeats):
    runs = [run_one(work, corpus, num_proc, shard_size) for _ in range(max(1, repeats))]
    return min(runs, key=lambda run: run[0]["seconds"])


def main():
    config = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(config)
    num_procs = parse_num_procs(config.num_procs)
    with work_directory(config.work_dir, "bench_fineweb_") as work:
        corpus = os.path.join(work, "corpus.parquet")
        t0 = time.time()
        size, n_docs = generate_parquet(corpus, config.size_mb, config.seed)
        print(f"generated a {size / 1e6:.1f} MB parquet corpus of {n_docs:,} documents in {time.time() - t0:.1f} s")
        print(f"cpu: {cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
        # build the tokenizer once, outside the timings (forked workers inherit it)
        get_gpt2_encoding()
        # warm-up: datasets' Arrow cache of the corpus
        run_one(work, corpus, 1, config.shard_size)
        results = [(p, *fastest(work, corpus, p, config.shard_size, config.repeats)) for p in num_procs]
        print_table(results, size)
        print(f"load average now: {os.getloadavg()[0]:.1f} (figures are only comparable on an otherwise idle machine)")
        print("identical shards for every num_proc:", len({tuple(s.items()) for _, _, s in results}) == 1)


def print_table(results, size):
    print(f"\n{'num_proc':>8} {'tokens':>12} {'shards':>6} {'seconds':>8} {'tokens/s':>12} {'MB/s':>7} "
          f"{'speed-up':>8} {'cpu s':>6} {'tokens/cpu-s':>12}")
    base = results[0][1]["tokens_per_second"]
    for num_proc, r, _ in results:
        print(f"{num_proc:>8} {r['tokens']:>12,} {r['shards']:>6} {r['seconds']:>8.1f} "
              f"{r['tokens_per_second']:>12,.0f} {size / 1e6 / r['seconds']:>7.2f} "
              f"{r['tokens_per_second'] / base:>7.2f}x {r['cpu_seconds']:>6.1f} "
              f"{r['tokens'] / r['cpu_seconds']:>12,.0f}")


if __name__ == "__main__":
    run_main(main)
