"""
Benchmark the tokenizer choice, two parts (a benchmark, not a test: it prints figures):

  train   byte-level BPE training time and encoding speed (tokens/s) on a ~50 MB corpus of Shakespeare
          excerpts, beside tiktoken's GPT-2 encoding, and data/text/prepare.py on it as a whole process
  bpb     bits per byte on the held-out last 10% of the Shakespeare text for --tokenizers (char, gpt2, bpe at
          1k/4k/16k), each prepared by data/text/prepare.py and trained with the same small model and the same
          budget (iterations x batch x block_size tokens) by train.py, then scored by eval.py --task=loss

Usage:
    python scripts/bench_tokenizer.py                       # both parts (~20 min on 2 CPU cores)
    python scripts/bench_tokenizer.py --part=bpb --max_iters=500 --tokenizers=char,bpe:4096
"""
# first, before torch is imported (seconds): a signal from here on stops the script in one line
# and exit code 130, a signal during the imports once they are done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import json
import os
import sys
import time

import numpy as np

from benchtools import cpu_model, parse_ints, run_checked, work_directory, write_jsonl_corpus
from configurator import Group, Schema, Setting, configure
from nanogpt_plus.bpe import train_bpe
from nanogpt_plus.checkpoint import CHECKPOINT, sidecar_of
from nanogpt_plus.prepare.plays import benchmark_documents
from nanogpt_plus.prepare.shakespeare import shakespeare_text
from nanogpt_plus.runtime import run_main
from nanogpt_plus.tokenizer import get_gpt2_encoding

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULTS = Schema(Group(
    'benchmark',
    part=Setting('all', "'train', 'bpb' or 'all'", choices=('train', 'bpb', 'all')),
    size_mb=Setting(50, "train: size of the generated corpus, in MB", low=1),
    vocab_sizes=Setting('4096,16384', "train: the BPE sizes to time, comma separated"),
    tokenizers=Setting('char,gpt2,bpe:1024,bpe:4096,bpe:16384', "bpb: what to compare, comma separated"),
    max_iters=Setting(1000, "bpb: training iterations per tokenizer (the same budget for each)", low=1),
    seed=Setting(1337, "the generated corpus is the same for a given seed", low=0),
    work_dir=Setting('', "where corpora, datasets and runs go ('' = a temporary directory, removed after)"),
))

# the small model and budget every tokenizer gets (config/train_shakespeare_char_cpu.py's shape)
MODEL = ['--n_layer=4', '--n_head=4', '--n_embd=128', '--block_size=64', '--batch_size=12',
         '--gradient_accumulation_steps=1', '--dropout=0.0', '--learning_rate=1e-3', '--min_lr=1e-4', '--beta2=0.99',
         '--warmup_iters=100', '--device=cpu', '--compile=False', '--eval_iters=20', '--log_interval=100']


def run(args, what):
    """ A script of this repository as a process; its stdout, or one line naming what failed. """
    return run_checked([sys.executable, *args], what, cwd=REPO)


# -----------------------------------------------------------------------------
# part 1: training and encoding speed

def bench_training(work, size_mb, vocab_sizes, seed):
    corpus = os.path.join(work, "corpus.jsonl")
    documents = list(benchmark_documents(size_mb, seed))
    size = write_jsonl_corpus(corpus, documents)
    print(f"corpus: {len(documents):,} documents, {size / 1e6:.1f} MB (Shakespeare excerpts)")
    tok = None
    for vocab_size in vocab_sizes:
        t0 = time.perf_counter()
        tok = train_bpe(iter(documents), vocab_size, length=len(documents), show_progress=False)
        dt = time.perf_counter() - t0
        print(f"train_bpe vocab {vocab_size:>6,}: {dt:6.1f} s ({size / 1e6 / dt:5.1f} MB/s)")
    encode_speed("bpe", lambda docs: tok.encode_ordinary_batch(docs), documents)
    enc = get_gpt2_encoding()
    encode_speed("gpt2 (tiktoken)", lambda docs: enc.encode_ordinary_batch(docs), documents)
    out = os.path.join(work, "prepared")
    t0 = time.perf_counter()
    run(["data/text/prepare.py", f"--input={corpus}", "--tokenizer=bpe", f"--vocab_size={vocab_sizes[-1]}",
         "--val_fraction=0.01", "--num_proc=2", f"--out_dir={out}", f"--cache_dir={os.path.join(work, 'cache')}"],
        "data/text/prepare.py")
    print(f"data/text/prepare.py --tokenizer=bpe --vocab_size={vocab_sizes[-1]} --num_proc=2, whole process: "
          f"{time.perf_counter() - t0:.1f} s")


def encode_speed(name, encode_batch, documents):
    t0 = time.perf_counter()
    n = sum(len(ids) for ids in encode_batch(documents))
    dt = time.perf_counter() - t0
    print(f"encode {name:>16}: {n:,} tokens in {dt:5.1f} s, {n / dt:12,.0f} tokens/s")


# -----------------------------------------------------------------------------
# part 2: bits per byte on held-out Shakespeare

def bench_bits_per_byte(work, tokenizers, max_iters):
    text_dir = os.path.join(work, "shakespeare")
    os.makedirs(text_dir, exist_ok=True)
    _, source = shakespeare_text(text_dir)
    text_path = os.path.join(text_dir, "input.txt")
    print(f"text: {source}")
    rows = [bits_per_byte_of(work, spec, text_path, max_iters) for spec in tokenizers]
    print(f"\nsame model (4 layers, 128 wide, 64-token context) and budget ({max_iters} iterations x 12 x 64 tokens)")
    print("| tokenizer | vocab (model) | train tokens | bytes/token | val bits/byte | ms/iter |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['vocab']:,} ({r['model_vocab']:,}) | {r['train_tokens']:,} | "
              f"{r['bytes_per_token']:.2f} | {r['bpb']:.3f} | {r['ms_per_iter']:.0f} |")


def bits_per_byte_of(work, spec, text_path, max_iters):
    kind, _, vocab = spec.partition(":")
    # 4096 -> 4k
    label = f"{int(vocab) // 1024}k" if vocab.isdigit() and int(vocab) % 1024 == 0 else vocab
    name = f"{kind} {label}" if vocab else kind
    data = os.path.join(work, "data_" + spec.replace(":", "_"))
    out = os.path.join(work, "out_" + spec.replace(":", "_"))
    run(["data/text/prepare.py", f"--input={text_path}", f"--tokenizer={kind}", f"--out_dir={data}"]
        + ([f"--vocab_size={vocab}"] if vocab else []), f"prepare {spec}")
    t0 = time.perf_counter()
    log = run(["train.py", f"--dataset={data}", f"--out_dir={out}", f"--max_iters={max_iters}",
               f"--lr_decay_iters={max_iters}", f"--eval_interval={max_iters}", *MODEL], f"train {spec}")
    train_seconds = time.perf_counter() - t0
    result = json.loads(run(["eval.py", f"--init_from={out}", "--task=loss", f"--dataset={data}",
                             "--device=cpu"], f"eval {spec}").strip().splitlines()[-1])
    with open(os.path.join(data, "meta.json"), encoding="utf-8") as f:
        meta = json.load(f)
    with open(sidecar_of(os.path.join(out, CHECKPOINT)), encoding="utf-8") as f:
        model_vocab = json.load(f)["model_args"]["vocab_size"]
    # the dtype prepare.py wrote
    vocab_size = meta["vocab_size"]
    itemsize = np.dtype(meta["dtype"]).itemsize
    train_tokens = os.path.getsize(os.path.join(data, "train.bin")) // itemsize
    metrics = result["metrics"]
    times = [float(line.split("time ")[1].split("ms")[0]) for line in log.splitlines() if line.startswith("iter ")]
    row = {"name": name, "vocab": vocab_size, "model_vocab": model_vocab, "train_tokens": train_tokens,
           "bytes_per_token": metrics["bytes"] / metrics["tokens"], "bpb": metrics["bits_per_byte"],
           "ms_per_iter": sorted(times)[len(times) // 2] if times else train_seconds * 1000 / max_iters}
    print(f"{name}: val bits/byte {row['bpb']:.3f}, val loss {metrics['loss']:.3f} per token, "
          f"{train_seconds:.0f} s of training")
    return row


def main():
    config = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(config)
    print(f"cpu: {cpu_model()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    with work_directory(config.work_dir, "bench_tokenizer_") as work:
        if config.part in ('train', 'all'):
            vocab_sizes = parse_ints(str(config.vocab_sizes), 'vocab_sizes')
            bench_training(work, config.size_mb, vocab_sizes, config.seed)
        if config.part in ('bpb', 'all'):
            bench_bits_per_byte(work, config.tokenizers.split(","), config.max_iters)


if __name__ == "__main__":
    run_main(main)
