"""
Benchmark the sampler: tokens/s of nanoGPT's naive GPT.generate (the reference), the KV-cached exact
path, the fast mode, and num_samples drawn as one batch, on the same random weights in one run. Two
models: GPT-2 124M's shape, and the 6-layer/384/256-context character model of
config/train_shakespeare_char.py (vocab 65). Also times nanoGPT's sample.py for the character model
(a Python loop calling GPT.generate for one sample at a time) against `python sample.py`'s defaults.

Usage:
    python scripts/bench_sample.py                          # both models, 500 new tokens, 10 samples
    python scripts/bench_sample.py --which=char --nanogpt_samples=2 --threads=1

nanogpt_samples: how many of nanoGPT's num_samples sequential samples to actually time; every one is
the same computation (same prompt, same length), so the time of the others is extrapolated (and said so).
threads: torch intra-op threads (0: torch's default).
"""
# first, before torch is imported (seconds): a signal from here on stops the script in one line
# and exit code 130, a signal during the imports once they are done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import os
import sys
import time

import torch

from configurator import Group, Schema, Setting, configure
from model import GPT, GPTConfig
from nanogpt_plus.engine import generate
from nanogpt_plus.runtime import run_main

DEFAULTS = Schema(Group(
    'benchmark',
    which=Setting('both', "'both', 'gpt2' (124M shape) or 'char' (shakespeare_char shape)",
                  choices=('both', 'gpt2', 'char')),
    max_new_tokens=Setting(500, "tokens generated per sample", low=1),
    num_samples=Setting(10, "samples in the batched figure (nanoGPT's sample.py default)", low=1),
    nanogpt_samples=Setting(10, "nanoGPT's sequential samples actually timed (the rest extrapolated)", low=1),
    threads=Setting(0, "torch.set_num_threads; 0 = torch's default", low=0),
    seed=Setting(1337, "the random weights and the sampling", low=0),
))

MODELS = {
    'gpt2': GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=1024, vocab_size=50304),
    'char': GPTConfig(n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=65),
}


def timed(fn, warmup=None):
    if warmup is not None:
        # first calls pay one-off costs (allocator, oneDNN kernel selection): keep them out
        warmup()
    t0 = time.perf_counter()
    c0 = time.process_time()
    out = fn()
    # wall-clock seconds and this process's CPU seconds: on a CPU shared with other jobs the wall clock
    # also counts the time other processes ran, the CPU time (with threads=1) only our own work
    return out, (time.perf_counter() - t0, time.process_time() - c0)


def report(rows):
    ref_wall = rows[0][1] / rows[0][2][0]
    ref_cpu = rows[0][1] / rows[0][2][1]
    print(f"  {'path':<42} {'tokens':>6} {'wall s':>8} {'tok/s':>7} {'vs ref':>7} {'CPU s':>8} "
          f"{'tok/CPU-s':>9} {'vs ref':>7}  greedy == ref")
    for name, n, (wall, cpu), same in rows:
        print(f"  {name:<42} {n:>6} {wall:>8.2f} {n / wall:>7.1f} {n / wall / ref_wall:>6.1f}x {cpu:>8.2f} "
              f"{n / cpu:>9.1f} {n / cpu / ref_cpu:>6.1f}x  {same}")
    sys.stdout.flush()


def bench_model(which, cfg):
    N = cfg.max_new_tokens
    S = cfg.num_samples
    torch.manual_seed(cfg.seed)
    model = GPT(MODELS[which]).eval()
    block_size = model.config.block_size
    if which == 'gpt2':
        from nanogpt_plus.tokenizer import GPT2Tokenizer
        prompt = GPT2Tokenizer().encode("Hello, I'm a language model,")
    else:
        prompt = [0]  # sample.py's default start "\n" is id 0 in shakespeare_char's vocabulary
    idx = torch.tensor([prompt], dtype=torch.long)
    print(f"\n== {which}: {model.get_num_params() / 1e6:.1f}M parameters, block_size {block_size}, prompt of "
          f"{len(prompt)} tokens, {N} new tokens, {torch.get_num_threads()} threads ==")
    sys.stdout.flush()

    # one sample, greedy: the naive reference against the cached paths, token for token
    def naive():
        with torch.no_grad():
            return model.generate(idx, N, temperature=1.0, top_k=1)  # top_k=1: greedy
    with torch.no_grad():
        ref, t_ref = timed(naive, warmup=lambda: model.generate(idx, 4, temperature=1.0, top_k=1))
    rows = [("naive GPT.generate (reference), 1 sample", N, t_ref, "-")]
    for mode in ('exact', 'fast'):
        out, times = timed(lambda: generate(model, idx, N, temperature=0, mode=mode),
                        warmup=lambda: generate(model, idx, 4, temperature=0, mode=mode))
        fits = len(prompt) + N <= block_size
        same = torch.equal(out, ref)
        note = "" if fits or mode == 'exact' else " (past the block it may differ, by design)"
        rows.append((f"KV cache, mode={mode}, 1 sample", N, times, f"{same}{note}"))
    # num_samples in one batch, with sample.py's default sampling settings
    batch = idx.repeat(S, 1)
    for mode in ('exact', 'fast'):
        g = torch.Generator().manual_seed(cfg.seed)
        _, times = timed(lambda: generate(model, batch, N, temperature=0.8, top_k=200, generator=g, mode=mode),
                      warmup=lambda: generate(model, batch, 4, temperature=0.8, top_k=200, mode=mode))
        rows.append((f"KV cache, mode={mode}, batch of {S} samples", S * N, times, "-"))
    report(rows)

    if which == 'char':
        # nanoGPT's sample.py: for k in range(num_samples): model.generate(x, ...) with x of batch size 1
        k = max(1, min(cfg.nanogpt_samples, S))

        def nanogpt():
            with torch.no_grad():
                for _ in range(k):
                    model.generate(idx, N, temperature=0.8, top_k=200)
        _, (wall_k, cpu_k) = timed(nanogpt)
        wall_nano = wall_k * S / k
        cpu_nano = cpu_k * S / k
        extrap = "" if k == S else f" (timed {k} of them, x{S / k:g})"
        print(f"\n  nanoGPT's sample.py, {S} samples x {N} tokens one after another{extrap}: wall {wall_nano:.1f} s "
              f"({S * N / wall_nano:.1f} tokens/s), CPU {cpu_nano:.1f} s ({S * N / cpu_nano:.1f} tokens/CPU-s)")
        for name, n, (wall, cpu), _ in rows[-2:]:
            print(f"  our sample.py defaults, {name}: wall {wall:.1f} s ({wall_nano / wall:.1f}x faster), "
                  f"CPU {cpu:.1f} s ({cpu_nano / cpu:.1f}x faster)")
        sys.stdout.flush()


def main():
    cfg = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(cfg)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, float32, "
          f"attention=flash (scaled_dot_product_attention)")
    for which in (('gpt2', 'char') if cfg.which == 'both' else (cfg.which,)):
        bench_model(which, cfg)


if __name__ == "__main__":
    run_main(main)
