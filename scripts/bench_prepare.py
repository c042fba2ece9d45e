"""
Benchmark the corpus path of data/openwebtext/prepare.py: GPT-2 tokenization throughput (tokens/s) with
num_proc=1 vs num_proc=2 (or any list) on a generated ~50 MB .jsonl corpus of Shakespeare excerpts.
A benchmark, not a test: it prints figures and checks only that every num_proc writes identical files.

Usage:
    python scripts/bench_prepare.py
    python scripts/bench_prepare.py --size_mb=200 --num_procs=1,2,4,8
"""
# first, before torch is imported (seconds): a signal from here on stops the script in one line
# and exit code 130, a signal during the imports once they are done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import os
import time

from benchtools import cpu_seconds, parse_num_procs, work_directory, write_jsonl_corpus
from configurator import Group, Schema, Setting, configure
from nanogpt_plus.prepare.corpus import prepare_corpus
from nanogpt_plus.prepare.plays import benchmark_documents
from nanogpt_plus.runtime import run_main
from nanogpt_plus.tokenizer import get_gpt2_encoding

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULTS = Schema(Group(
    'benchmark',
    size_mb=Setting(50, "size of the generated corpus, in MB", low=1),
    num_procs=Setting('1,2', "the num_proc values to compare, comma separated"),
    seed=Setting(1337, "the generated corpus is the same for a given seed", low=0),
    work_dir=Setting('', "where the corpus, caches and outputs go ('' = a temporary directory, removed after)"),
))


def main():
    config = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(config)
    num_procs = parse_num_procs(config.num_procs)
    with work_directory(config.work_dir, "bench_prepare_") as work:
        corpus = os.path.join(work, "corpus.jsonl")
        t0 = time.time()
        size = write_jsonl_corpus(corpus, benchmark_documents(config.size_mb, config.seed))
        print(f"generated {size / 1e6:.1f} MB corpus in {time.time() - t0:.1f} s; cpu cores: {os.cpu_count()}, "
              f"load average: {os.getloadavg()[0]:.1f}")
        # build the tokenizer once, outside the timings (forked workers inherit it)
        get_gpt2_encoding()
        results = []
        outputs = []
        for num_proc in num_procs:
            out = os.path.join(work, f"out_{num_proc}")
            cpu0 = cpu_seconds()
            r = prepare_corpus(out, files=corpus, num_proc=num_proc, cache_dir=os.path.join(work, f"cache_{num_proc}"),
                                  load_from_cache_file=False, progress=False)
            r["cpu_seconds"] = cpu_seconds() - cpu0  # this process and its (finished) workers
            results.append((num_proc, r))
            with open(os.path.join(out, "train.bin"), "rb") as f:
                outputs.append(hash(f.read()))
        print(f"\n{'num_proc':>8} {'tokens':>12} {'tokenize s':>10} {'tokens/s':>12} {'MB/s':>7} {'speed-up':>8} "
              f"{'cpu s':>6} {'tokens/cpu-s':>12}")
        base = results[0][1]["tokens_per_second"]
        for num_proc, r in results:
            tokens = r["train_tokens"] + r["val_tokens"]
            print(f"{num_proc:>8} {tokens:>12,} {r['tokenize_seconds']:>10.1f} {r['tokens_per_second']:>12,.0f} "
                  f"{size / 1e6 / r['tokenize_seconds']:>7.2f} {r['tokens_per_second'] / base:>7.2f}x "
                  f"{r['cpu_seconds']:>6.1f} {tokens / r['cpu_seconds']:>12,.0f}")
        print(f"load average now: {os.getloadavg()[0]:.1f} (figures are only comparable on an otherwise idle machine)")
        print("identical train.bin for every num_proc:", len(set(outputs)) == 1)


if __name__ == "__main__":
    run_main(main)
