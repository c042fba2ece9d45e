"""
Time to quality: nanoGPT's recipe against the faster one (or each modern option alone), as the exact loss on
the whole val split (eval.py --task=loss) against training time, all runs in one process of this script.

Each run is `python train.py <config> <overrides>` saving a snapshot every snapshot_every iterations
(checkpoint_interval + keep_checkpoints) and logging every iteration; then eval.py scores every snapshot. A
snapshot's time is the training time up to it: the sum of its iterations' time_ms from metrics.jsonl, where
an iteration that also evaluated or saved counts at the run's median (evaluation and saving follow the cadence
we chose for the measurement, not the recipe). The runs alternate (A, B, A, B, ...) for `rounds` rounds, so
machine load hits them alike, and the figures are medians over the rounds (the whole-process modes' wall-time
ratio: the median of each round's pair).

Modes:
  laptop    the laptop speedrun, the default: nanoGPT's laptop run against config/train_shakespeare_char_fast.py
            (char) and, at GPT-2's vocabulary, nanoGPT's laptop run for 600 iterations against
            config/train_shakespeare_fast.py (bpe), as whole processes on the text of --text, with 0, 1 and 2
            other processes keeping cores busy (--busy_loops: a Python busy loop each). Every process picks
            its own thread count, as a user's would (nanoGPT: torch's default, a thread per core; ours:
            train.py's num_threads=0). For each load the two alternate for `rounds` rounds; each final
            checkpoint is scored by eval.py --task=loss on the whole val split, with the loops stopped.
            Prints each one's wall time and loss, the ratio (ours / nanoGPT's, the median of each round's
            pair) and whether ours reached nanoGPT's loss. nanoGPT itself runs from --nanogpt_dir (a checkout
            of karpathy/nanoGPT: its train.py, model.py, configurator.py and config/, on datasets this script
            prepares); without one, this project's train.py runs nanoGPT's recipe
            (config/train_shakespeare_char_cpu.py) on a thread per core, number for number the same training
            but not nanoGPT's own code.
  compare   nanoGPT's laptop run (config/train_shakespeare_char_cpu.py) vs config/train_shakespeare_char_fast.py:
            the curve of each, the baseline's final loss, when the fast recipe first reaches it, and the ratio
            of that time to the baseline's whole run (the issue's goal: <= 0.5).
  ablation  the baseline with one option at a time, at the baseline's 2000 iterations: final loss, median
            ms/iter, and the time it first reaches the baseline's final loss.
  fineweb   bpe's comparison (whole processes) on a FineWeb-like corpus in llm.c shards, made with
            data/fineweb/prepare.py --files from text already on this machine (the long descriptions of the
            installed Python packages and Python's pydoc topics: English prose and markdown, 1.5-2.5 MB, so it
            depends on what is installed), at a 4 x 128 GPT with GPT-2's vocabulary: nanoGPT's recipe for 400
            steps against the fast recipe's options for 115.
  bpe       GPT-2 tokens at the laptop size: nanoGPT's laptop recipe on the GPT-2-BPE Shakespeare of
            data/shakespeare/prepare.py (config/train_shakespeare_char_cpu.py with dataset='shakespeare', 600
            iterations) against config/train_shakespeare_fast.py, each as one whole process: its final
            checkpoint's loss on the whole val split, its wall time and steps, and the ratios (the goal: the
            fast run's final loss at or below the baseline's in <= 0.35x its wall time and <= 1/3 of its steps).
  muon      where a step's time goes at the laptop size (config/train_shakespeare_char_cpu.py's model and
            batch, in this process): forward+backward with and without rope and QK-norm, AdamW's step, and
            Muon's step split into its Newton-Schulz orthogonalisations and the rest (momentum, the update,
            the loop over the matrices, AdamW for the rest); medians of `profile_steps` steps.
  speedrun  for a GPU: GPT-2 124M on that corpus, config/train_gpt2_fineweb.py for speedrun_iters steps of
            16 x 1024 tokens against config/train_gpt2_speedrun.py for a third of them (each schedule shortened
            to its run): median ms/iter, median MFU, wall time and the final loss on the whole val shard.

Usage:
$ python scripts/bench_recipes.py --nanogpt_dir=../nanoGPT --text=input.txt   # laptop: hours on 2 cores
$ python scripts/bench_recipes.py --recipes=char --busy_loops=0            # the character model, quiet only
$ python scripts/bench_recipes.py --mode=compare                          # curves of nanoGPT's recipe vs ours
$ python scripts/bench_recipes.py --mode=ablation
$ python scripts/bench_recipes.py --mode=fineweb --rounds=1
$ python data/shakespeare/prepare.py && python scripts/bench_recipes.py --mode=bpe
$ python scripts/bench_recipes.py --mode=muon
$ python scripts/bench_recipes.py --mode=speedrun --device=cuda --speedrun_iters=900     # ~10 minutes on one H200
$ python scripts/bench_recipes.py --mode=speedrun --device=cuda --dataset=fineweb --speedrun_iters=3000
"""
# first, before torch is imported (seconds): a signal from here on stops the script in one line
# and exit code 130, a signal during the imports once they are done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import contextlib
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import sysconfig
import time

# scripts/ is on sys.path
from benchtools import cpu_model, run_checked, work_directory, write_jsonl_corpus
from configurator import Group, Schema, Setting, configure
from nanogpt_plus.checkpoint import CHECKPOINT, sidecar_of, snapshots
from nanogpt_plus.errors import UserError
from nanogpt_plus.metrics import read_metrics
from nanogpt_plus.runtime import run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULTS = Schema(Group(
    'benchmark',
    mode=Setting('laptop', "'laptop', 'compare', 'ablation', 'bpe', 'fineweb', 'muon' or 'speedrun' (see above)",
                 choices=('laptop', 'compare', 'ablation', 'bpe', 'fineweb', 'muon', 'speedrun')),
    nanogpt_dir=Setting('', "laptop: a checkout of karpathy/nanoGPT to run as the baseline; '' = its recipe "
                            "in this project's train.py"),
    text=Setting('', "laptop: the text to train on, prepared for both recipes ('' = data/shakespeare_char's "
                     "input.txt, as data/shakespeare_char/prepare.py fetched or made it)"),
    recipes=Setting('char,bpe', "laptop: which of 'char' and 'bpe' to run, comma-separated", not_empty=True),
    busy_loops=Setting('0,1,2', "laptop: the loads, as how many busy loops run beside the training, "
                                "comma-separated", not_empty=True),
    profile_steps=Setting(30, "muon: the timed steps of each part", low=3),
    speedrun_iters=Setting(900, "speedrun: the GPT-2 recipe's steps (the speedrun's: a third)", low=6),
    device=Setting('cuda', "speedrun: the device of both runs", not_empty=True),
    dataset=Setting('', "speedrun: the shards to train on, e.g. fineweb (data/fineweb/prepare.py's); "
                        "'' = the local corpus (small: a few passes over it)"),
    rounds=Setting(1, "how many times the runs alternate", low=1),
    snapshot_every=Setting(100, "iterations between scored snapshots (the fast recipe: half of it)", low=1),
    num_threads=Setting(2, "torch threads of every run (fixed, so the runs are comparable); laptop: of the "
                           "scoring only", low=1),
    out_dir=Setting('', "where the runs go ('' = a temporary directory)"),
))

BASELINE = 'config/train_shakespeare_char_cpu.py'
FAST = 'config/train_shakespeare_char_fast.py'
# what each modern option is set to when it is tried alone on the baseline
OPTIONS = {
    'muon': ['--optimizer=muon'],
    'rope': ['--pos=rope'],
    'rmsnorm': ['--norm=rmsnorm'],
    'qk_norm': ['--qk_norm=True'],
    'relu2': ['--mlp_act=relu2'],
    'softcap': ['--logit_softcap=15.0'],
    'untied': ['--tie_embeddings=False'],
    'wsd': ['--lr_schedule=wsd'],
}
# GPT-2 tokens at the laptop size: nanoGPT's laptop recipe, 600 iterations, on the GPT-2-BPE Shakespeare
BPE_RECIPES = {
    'nanogpt': (BASELINE, ['--dataset=shakespeare', '--max_iters=600', '--lr_decay_iters=600']),
    'fast': ('config/train_shakespeare_fast.py', []),
}
# the FineWeb-like comparison: a 4 x 128 GPT with GPT-2's vocabulary, 1,024 tokens per step
FINEWEB_MODEL = ['--n_layer=4', '--n_head=4', '--n_embd=128', '--block_size=128', '--batch_size=8',
                 '--gradient_accumulation_steps=1', '--dropout=0.0', '--data_order=sequential', '--device=cpu',
                 '--compile=False', '--dtype=float32', '--eval_iters=10', '--beta2=0.99', '--hellaswag_interval=0',
                 '--sample_interval=0', '--keep_checkpoints=0', '--log_interval=10']
# both evaluate at their first and last step only (eval_interval = max_iters), so the wall times compare steps
FINEWEB_RECIPES = {
    'nanogpt': ['--max_iters=400', '--lr_decay_iters=400', '--eval_interval=400', '--warmup_iters=30',
                '--learning_rate=1e-3', '--min_lr=1e-4'],
    # config/train_shakespeare_fast.py's options, with a 2.5x higher AdamW rate (8e-3: 6.310 at 130 steps, 2e-2:
    # 6.171), for 115 steps
    'fast': ['--max_iters=114', '--lr_decay_iters=114', '--eval_interval=114', '--warmup_iters=10',
             '--optimizer=muon', '--learning_rate=2e-2', '--min_lr=1e-4', '--beta1=0.8', '--pos=rope',
             '--qk_norm=True', '--lr_schedule=wsd', '--cooldown_frac=0.5'],
}


def train(work, name, config, args, snapshot_every, num_threads):
    """ One train.py run into work/name, a snapshot every snapshot_every iterations; its out_dir. """
    out_dir = os.path.join(work, name)
    cmd = [sys.executable, 'train.py', config, f'--out_dir={out_dir}', '--overwrite=True', '--log_interval=1',
           f'--checkpoint_interval={snapshot_every}', '--keep_checkpoints=1000', f'--num_threads={num_threads}',
           '--wandb_log=False', *args]
    env = dict(os.environ, OMP_NUM_THREADS=str(num_threads))
    print(f"  {name}: {' '.join(cmd[2:])}", flush=True)
    run_checked(cmd, f"train.py for {name}", cwd=REPO, env=env)
    return out_dir


def training_times(out_dir):
    """ {iteration: seconds of training up to and including it}, eval/save iterations at the median. """
    records = read_metrics(os.path.join(out_dir, 'metrics.jsonl'))  # the run's own trajectory
    busy = {r['iter'] for r in records if r['type'] == 'eval'}  # the iterations that also evaluated
    steps = {r['iter']: r['time_ms'] for r in records if r['type'] == 'iter'}
    median = statistics.median(steps.values())
    total = 0.0
    out = {}
    for it in sorted(steps):
        # a save lands in the step after the eval
        plain = it not in busy and it - 1 not in busy and it > 0
        total += (steps[it] if plain else median) / 1000
        out[it] = total
    return out, median


def full_val_loss(path, num_threads):
    """ eval.py --task=loss on one checkpoint: the mean loss over every val token. """
    env = dict(os.environ, OMP_NUM_THREADS=str(num_threads))
    out = run_checked([sys.executable, 'eval.py', f'--init_from={path}', '--task=loss'], f"eval.py on {path}",
                      cwd=REPO, env=env)
    return json.loads(out.strip().splitlines()[-1])['metrics']['loss']


def curve(out_dir, num_threads):
    """ [(iteration, training seconds, full-val loss)] of a run's snapshots, and its median ms/iter. """
    times, median = training_times(out_dir)
    points = []
    for it, name in sorted(snapshots(out_dir).items()):
        # ckpt_<n>.pt holds the weights after iterations 0..n-1 (iter_num n, the next to run)
        points.append((it, times.get(it - 1, max(times.values())),
                       full_val_loss(os.path.join(out_dir, name), num_threads)))
    return points, median


def first_reaching(points, target):
    """ The training seconds of the first snapshot at or below target, or None. """
    return next((t for _, t, loss in points if loss <= target), None)


def show(name, points, median):
    print(f"{name}: median {median:.1f} ms/iter")
    for it, t, loss in points:
        print(f"  iter {it:5d}  {t:7.1f} s  val {loss:.4f}")


def compare(work, cfg, recipes, config_of):
    """ Alternate the recipes for `rounds` rounds; per round the target is the baseline's final loss. """
    ratios = []
    finals = {name: [] for name in recipes}
    for r in range(cfg.rounds):
        results = {}
        for name, args in recipes.items():
            every = cfg.snapshot_every if name == 'nanogpt' else max(1, cfg.snapshot_every // 2)
            out_dir = train(work, f"{name}_{r}", config_of(name), args, every, cfg.num_threads)
            results[name] = curve(out_dir, cfg.num_threads)
        base_points, _ = results['nanogpt']
        target = base_points[-1][2]
        base_time = base_points[-1][1]
        for name, (points, median) in results.items():
            show(f"round {r} {name}", points, median)
            finals[name].append((points[-1][2], points[-1][1], median))
        reached = first_reaching(results['fast'][0], target)
        ratio = reached / base_time if reached is not None else float('nan')
        ratios.append(ratio)
        print(f"round {r}: nanoGPT's final val loss {target:.4f} after {base_time:.1f} s; the fast recipe reaches "
              f"it after {reached if reached is None else round(reached, 1)} s: ratio {ratio:.3f}")
    for name, rows in finals.items():
        print(f"{name}: final val {statistics.median(x[0] for x in rows):.4f} in "
              f"{statistics.median(x[1] for x in rows):.1f} s, {statistics.median(x[2] for x in rows):.1f} ms/iter")
    print(f"time-to-quality ratio (fast / nanoGPT), median of {len(ratios)}: {statistics.median(ratios):.3f}")


def whole_run(work, name, config, args, num_threads):
    """ One train.py process, timed from start to exit; (its final loss on the whole val split, seconds, steps). """
    out_dir = os.path.join(work, name)
    cmd = [sys.executable, 'train.py', config, f'--out_dir={out_dir}', '--overwrite=True',
           f'--num_threads={num_threads}', '--wandb_log=False', *args]
    env = dict(os.environ, OMP_NUM_THREADS=str(num_threads))
    print(f"  {name}: {' '.join(cmd[2:])}", flush=True)
    start = time.perf_counter()
    run_checked(cmd, f"train.py for {name}", cwd=REPO, env=env)
    seconds = time.perf_counter() - start
    # the final checkpoint's iter_num (its .json beside it) is the number of optimizer steps taken
    final = os.path.join(out_dir, CHECKPOINT)
    with open(sidecar_of(final)) as f:
        steps = json.load(f)['iter_num']
    return full_val_loss(final, num_threads), seconds, steps


def compare_whole(work, cfg, recipes):
    """
    nanoGPT's recipe against the fast one as whole processes (startup, evaluation and saving included),
    alternating for `rounds` rounds; medians of the final losses, wall times and steps, and their ratios.
    """
    rows = {name: [] for name in recipes}
    for r in range(cfg.rounds):
        for name, (config, args) in recipes.items():
            rows[name].append(whole_run(work, f"{name}_{r}", config, args, cfg.num_threads))
            loss, seconds, steps = rows[name][-1]
            print(f"round {r} {name}: final val loss {loss:.4f}, {seconds:.1f} s, {steps} steps", flush=True)
    med = {name: [statistics.median(v[i] for v in values) for i in range(3)] for name, values in rows.items()}
    print(f"{'recipe':8s} {'final val loss':>14s} {'wall s':>8s} {'steps':>6s}")
    for name, (loss, seconds, steps) in med.items():
        print(f"{name:8s} {loss:14.4f} {seconds:8.1f} {steps:6.0f}")
    (base_loss, _, base_steps), (loss, _, steps) = med['nanogpt'], med['fast']
    # the wall-time ratio of each round's pair (run back to back, so a machine whose speed drifts over the
    # rounds moves both), and their median
    ratios = [fast[1] / base[1] for base, fast in zip(rows['nanogpt'], rows['fast'])]
    if len(ratios) > 1:
        print("wall-time ratio per round: " + ", ".join(f"{r:.3f}" for r in ratios))
    verdict = "reaches" if loss <= base_loss else "does not reach"
    print(f"the fast recipe {verdict} nanoGPT's final val loss ({loss:.4f} vs {base_loss:.4f}) in "
          f"{statistics.median(ratios):.3f}x its wall time and {steps / base_steps:.3f}x its steps")


def ablation(work, cfg):
    """ The baseline, then the baseline with each option alone (per round, in that order). """
    rows = {name: [] for name in ['baseline', *OPTIONS]}
    for r in range(cfg.rounds):
        base = None
        for name in rows:
            out_dir = train(work, f"{name}_{r}", BASELINE, OPTIONS.get(name, []), cfg.snapshot_every,
                            cfg.num_threads)
            points, median = curve(out_dir, cfg.num_threads)
            base = base or points
            reached = first_reaching(points, base[-1][2])
            rows[name].append((points[-1][2], median, reached / base[-1][1] if reached else float('nan')))
    print(f"{'option':10s} {'final val':>9s} {'ms/iter':>8s} {'time to baseline loss':>22s}")
    for name, values in rows.items():
        loss, ms, ratio = (statistics.median(v[i] for v in values) for i in range(3))
        print(f"{name:10s} {loss:9.4f} {ms:8.1f} {ratio:21.2f}x")


def median_ms(fn, steps):
    """ fn() timed `steps` times after 3 untimed calls; the median in milliseconds. """
    for _ in range(3):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def muon_profile(cfg):
    """ The laptop model's step, part by part (the module docstring's 'muon' mode). """
    import torch

    from model import GPT, GPTConfig
    from nanogpt_plus import muon as muon_code
    from nanogpt_plus import optimizer as opt
    torch.set_num_threads(cfg.num_threads)
    torch.manual_seed(0)
    size = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65, dropout=0.0)
    x, y = torch.randint(0, 65, (2, 12, 64))
    adamw = opt.AdamWSpec(learning_rate=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.99)
    muon_spec = opt.MuonSpec(muon_lr=0.02, muon_momentum=0.95, muon_weight_decay=0.0)

    def forward_backward(model):
        model(x, y)[1].backward()

    print(f"{'part of a step':52s} {'ms':>7s}")
    for name, extra in (('forward+backward', {}), ('  with pos=rope', {'pos': 'rope'}),
                        ('  with qk_norm=True', {'qk_norm': True}),
                        ('  with both (the fast recipe)', {'pos': 'rope', 'qk_norm': True})):
        model = GPT(GPTConfig(**size, **extra))
        print(f"{name:52s} {median_ms(lambda: forward_backward(model), cfg.profile_steps):7.1f}", flush=True)
    model = GPT(GPTConfig(**size))
    forward_backward(model)
    grads = [p.grad.clone() for p in model.parameters()]

    def step(take):
        # the same gradients every time: the step's cost, not the model's
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        take()
    def one_by_one(optimizer):
        # what the step was before the batching: PyTorch's loop, each matrix orthogonalised alone (in float32)
        with muon_code.float32_newton_schulz():
            optimizer.muon.step()
        optimizer.adamw.step()
    muon = opt.make_optimizer(model, adamw, 'cpu', muon=muon_spec)
    hidden = [p.grad for n, p in model.named_parameters() if p.dim() == 2 and n.startswith('transformer.h.')]
    rows = [('adamw step', opt.make_optimizer(model, adamw, 'cpu').step),
            ('muon step', muon.step),
            (f'  of which Newton-Schulz, {len(hidden)} matrices batched',
             lambda: muon_code.orthogonalise(hidden)),
            ('  the same without the Gram-matrix steps', lambda: muon_code.orthogonalise(hidden, gram=False)),
            ('muon step, one matrix at a time (before)', lambda: one_by_one(muon)),
            (f'  of which Newton-Schulz, {len(hidden)} matrices one by one',
             lambda: [muon_code.newton_schulz_float32(g, (3.4445, -4.7750, 2.0315), 5, 1e-7) for g in hidden])]
    for name, fn in rows:
        timed = (lambda: step(fn)) if name.endswith(('step', '(before)')) else fn
        print(f"{name:52s} {median_ms(timed, cfg.profile_steps):7.1f}", flush=True)


def fineweb_corpus(work):
    """ llm.c shards of the local text corpus (see the module docstring); the dataset directory. """
    docs = []
    for path in sorted(glob.glob(os.path.join(sysconfig.get_paths()['purelib'], '*.dist-info', 'METADATA'))):
        text = open(path, encoding='utf-8', errors='replace').read()
        # the long description, after the headers
        body = text.split('\n\n', 1)[1] if '\n\n' in text else ''
        if len(body) > 200:
            docs.append(body)
    import pydoc_data.topics
    docs += [text for _, text in sorted(pydoc_data.topics.topics.items())]
    corpus = os.path.join(work, 'corpus.jsonl')
    size = write_jsonl_corpus(corpus, docs)
    data_dir = os.path.join(work, 'fineweb_local')
    run_checked([sys.executable, 'data/fineweb/prepare.py', f'--files={corpus}', f'--out_dir={data_dir}',
                 '--shard_size=50000', '--num_proc=2', '--overwrite=True'], "data/fineweb/prepare.py", cwd=REPO)
    print(f"corpus: {len(docs)} documents, {size / 1e6:.1f} MB of JSONL -> {data_dir}")
    return data_dir


def speedrun(work, cfg, data):
    """
    GPT-2 124M on the local corpus: the GPT-2 recipe for speedrun_iters steps against the speedrun's for a third
    of them (the CPU proxies' ratio; each schedule shortened to its run): the claim that
    config/train_gpt2_speedrun.py makes, at a size a GPU runs in minutes.
    """
    steps = cfg.speedrun_iters
    print(f"{'recipe':10s} {'steps':>6s} {'ms/iter':>8s} {'MFU':>6s} {'wall s':>7s} {'final val loss':>15s}")
    finals = {}
    for name, config, n in (('gpt2', 'config/train_gpt2_fineweb.py', steps),
                            ('speedrun', 'config/train_gpt2_speedrun.py', max(2, steps // 3))):
        args = [f'--dataset={data}', f'--device={cfg.device}', f'--max_iters={n}', f'--lr_decay_iters={n}',
                f'--warmup_iters={max(1, n // 18)}', '--batch_size=16', '--gradient_accumulation_steps=1',
                f'--eval_interval={n}', '--eval_iters=20', '--hellaswag_interval=0', '--keep_checkpoints=0',
                '--log_interval=1']
        finals[name], seconds, taken = whole_run(work, name, config, args, cfg.num_threads)
        records = read_metrics(os.path.join(work, name, 'metrics.jsonl'))
        # the steps after compiling
        iters = [r for r in records if r['type'] == 'iter' and r['iter'] >= min(10, n // 2)]
        ms = statistics.median(r['time_ms'] for r in iters)
        mfu = statistics.median([r['mfu'] for r in iters if r['mfu'] is not None] or [0.0])
        print(f"{name:10s} {taken:6d} {ms:8.1f} {100 * mfu:5.1f}% {seconds:7.1f} {finals[name]:15.4f}", flush=True)
    verdict = "reaches" if finals['speedrun'] <= finals['gpt2'] else "does not reach"
    print(f"the speedrun recipe {verdict} the GPT-2 recipe's final val loss in a third of its steps "
          f"({finals['speedrun']:.4f} vs {finals['gpt2']:.4f})")


# nanoGPT's laptop command (its README's CPU line), and the same at GPT-2's vocabulary for 600 iterations; the
# stand-in without a checkout: that recipe in this train.py (config/train_shakespeare_char_cpu.py)
NANOGPT_LAPTOP = ['config/train_shakespeare_char.py', '--device=cpu', '--compile=False', '--eval_iters=20',
                  '--log_interval=1', '--block_size=64', '--batch_size=12', '--n_layer=4', '--n_head=4',
                  '--n_embd=128', '--max_iters=2000', '--lr_decay_iters=2000', '--dropout=0.0']
NANOGPT_BPE = ['--dataset=shakespeare', '--max_iters=600', '--lr_decay_iters=600']
# recipe: (the dataset's name under data/, its prepare.py, our config, nanoGPT's extra arguments)
LAPTOP = {
    'char': ('shakespeare_char', 'data/shakespeare_char/prepare.py', FAST, []),
    'bpe': ('shakespeare', 'data/shakespeare/prepare.py', 'config/train_shakespeare_fast.py', NANOGPT_BPE),
}
BUSY_LOOP = 'while True: pass'


@contextlib.contextmanager
def busy_loops(n):
    """ n Python processes spinning for as long as the block runs: the load of the 'laptop' mode. """
    loops = [subprocess.Popen([sys.executable, '-c', BUSY_LOOP]) for _ in range(n)]
    try:
        yield loops
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def laptop_datasets(work, text):
    """ Both recipes' datasets of the text, in work/data/<name> (nanoGPT's layout), by our prepare.py scripts. """
    text = text or os.path.join(REPO, 'data', 'shakespeare_char', 'input.txt')
    if not os.path.isfile(text):
        raise UserError(f"no text at {text}: run python data/shakespeare_char/prepare.py first, or pass --text")
    for name, prepare, _, _ in LAPTOP.values():
        run_checked([sys.executable, prepare, f'--input={os.path.abspath(text)}',
                     f'--out_dir={os.path.join(work, "data", name)}', '--overwrite=True'], prepare, cwd=REPO)
    print(f"text: {text}, prepared for both recipes in {os.path.join(work, 'data')}", flush=True)


def nanogpt_checkout(work, nanogpt_dir):
    """ nanoGPT's training code in work/nanogpt, its data/ the prepared datasets; the directory, or None. """
    if not nanogpt_dir:
        return None
    here = os.path.join(work, 'nanogpt')
    os.makedirs(here, exist_ok=True)
    for name in ('train.py', 'model.py', 'configurator.py', 'config'):
        source = os.path.join(nanogpt_dir, name)
        if not os.path.exists(source):
            raise UserError(f"--nanogpt_dir={nanogpt_dir} has no {name}: pass a checkout of karpathy/nanoGPT")
        target = os.path.join(here, name)
        if os.path.isdir(source):
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            shutil.copy(source, target)
    if not os.path.exists(os.path.join(here, 'data')):
        os.symlink(os.path.join(work, 'data'), os.path.join(here, 'data'))
    return here


def laptop_commands(work, recipe, nanogpt, out):
    """ {'nanogpt': (cmd, cwd), 'ours': (cmd, cwd)} of one recipe, each writing into out + its name. """
    name, _, config, extra = LAPTOP[recipe]
    data = os.path.join(work, 'data', name)
    if nanogpt:
        base = ([sys.executable, 'train.py', *NANOGPT_LAPTOP, *extra, f'--out_dir={out}_nanogpt'], nanogpt)
    else:  # nanoGPT's recipe in this train.py, on a thread per core as nanoGPT's (torch's default)
        base = ([sys.executable, 'train.py', BASELINE, *extra, f'--dataset={data}', f'--out_dir={out}_nanogpt',
                 '--overwrite=True', f'--num_threads={os.cpu_count()}'], REPO)
    ours = ([sys.executable, 'train.py', config, f'--dataset={data}', f'--out_dir={out}_ours', '--overwrite=True'],
            REPO)
    return {'nanogpt': base, 'ours': ours}


def timed_run(cmd, cwd, what):
    """ One whole training process; (seconds, the thread-count lines it printed). """
    # no thread count from this process's environment: each picks its own, as a user's run would
    env = {k: v for k, v in os.environ.items() if k not in ('OMP_NUM_THREADS', 'MKL_NUM_THREADS')}
    start = time.perf_counter()
    out = run_checked(cmd, what, cwd=cwd, env=env)
    seconds = time.perf_counter() - start
    # the choice at start, then each change of the re-checks ('at iter N, using ...')
    return seconds, re.findall(r'^(?:at iter \d+, )?using (\d+) CPU threads', out, re.M)


def laptop_loss(work, out_dir, val_file, num_threads):
    """
    The final checkpoint's loss on the whole val split. Run in work, whose data/ holds the datasets: a nanoGPT
    checkpoint names its dataset only by name (its vocabulary is read from data/<name>/meta.pkl, as nanoGPT's
    sample.py reads it).
    """
    env = dict(os.environ, OMP_NUM_THREADS=str(num_threads))
    checkpoint = os.path.join(out_dir, CHECKPOINT)
    out = run_checked([sys.executable, os.path.join(REPO, 'eval.py'), f'--init_from={checkpoint}', '--task=loss',
                       f'--data_file={val_file}', f'--num_threads={num_threads}'], f"eval.py on {out_dir}",
                      cwd=work, env=env)
    return json.loads(out.strip().splitlines()[-1])['metrics']['loss']


def load_name(n):
    return 'quiet' if n == 0 else f"{n} busy loop{'s' if n > 1 else ''}"


def laptop(work, cfg):
    """ The 'laptop' mode (the module docstring): per recipe and load, nanoGPT and ours alternating. """
    recipes = [r.strip() for r in cfg.recipes.split(',')]
    loads = [int(n) for n in cfg.busy_loops.split(',')]
    if not set(recipes) <= set(LAPTOP) or min(loads) < 0:
        raise UserError(f"--recipes takes 'char' and/or 'bpe', --busy_loops counts >= 0; got "
                        f"--recipes={cfg.recipes} --busy_loops={cfg.busy_loops}")
    laptop_datasets(work, cfg.text)
    nanogpt = nanogpt_checkout(work, cfg.nanogpt_dir)
    print(f"baseline: {'nanoGPT from ' + cfg.nanogpt_dir if nanogpt else 'nanoGPT recipe in this train.py'}")
    rows = []
    for recipe in recipes:
        val_file = os.path.join(work, 'data', LAPTOP[recipe][0], 'val.bin')
        for n in loads:
            runs = {'nanogpt': [], 'ours': []}
            for r in range(cfg.rounds):
                out = os.path.join(work, f"{recipe}_{n}busy_{r}")
                commands = laptop_commands(work, recipe, nanogpt, out)
                with busy_loops(n):
                    for who, (cmd, cwd) in commands.items():
                        seconds, threads = timed_run(cmd, cwd, f"{who}'s {recipe} run")
                        runs[who].append((seconds, f"{out}_{who}", threads))
                        print(f"  {recipe}, {load_name(n)}, round {r}: {who} {seconds:.1f} s"
                              + (f" (threads: {' -> '.join(threads)})" if threads else ""), flush=True)
            # scored with the loops stopped: the loss doesn't depend on the load
            losses = {who: [laptop_loss(work, out_dir, val_file, cfg.num_threads) for _, out_dir, _ in done]
                      for who, done in runs.items()}
            ratios = [b[0] / a[0] for a, b in zip(runs['nanogpt'], runs['ours'])]
            rows.append((recipe, load_name(n), *(statistics.median(s for s, _, _ in runs[w]) for w in runs),
                         *(statistics.median(losses[w]) for w in runs), statistics.median(ratios)))
            # said as each load ends: a long benchmark stopped part-way keeps what it measured
            print(f"  {recipe}, {load_name(n)}: full-val loss nanoGPT {rows[-1][4]:.4f}, ours {rows[-1][5]:.4f}; "
                  f"ratio {rows[-1][6]:.3f}x", flush=True)
    print(f"\n{'recipe':6s} {'load':14s} {'nanoGPT s':>9s} {'loss':>7s} {'ours s':>7s} {'loss':>7s} {'ratio':>7s}")
    for recipe, load, base_s, ours_s, base_loss, ours_loss, ratio in rows:
        reached = "reached" if ours_loss <= base_loss else "NOT reached"
        print(f"{recipe:6s} {load:14s} {base_s:9.1f} {base_loss:7.4f} {ours_s:7.1f} {ours_loss:7.4f} "
              f"{ratio:6.3f}x  nanoGPT's loss {reached}")


def main(argv=None):
    cfg = configure(DEFAULTS, argv, doc=__doc__)
    DEFAULTS.check(cfg)
    if cfg.mode == 'laptop':  # every training process picks its own thread count
        print(f"cpu: {cpu_model()}, {os.cpu_count()} cores; scoring with {cfg.num_threads} threads")
    else:
        print(f"cpu: {cpu_model()}, {cfg.num_threads} threads")
    if cfg.mode == 'muon':
        return muon_profile(cfg)
    with work_directory(cfg.out_dir, 'bench_recipes_') as work:
        if cfg.mode == 'laptop':
            laptop(work, cfg)
        elif cfg.mode == 'compare':
            compare(work, cfg, {'nanogpt': [], 'fast': []}, {'nanogpt': BASELINE, 'fast': FAST}.get)
        elif cfg.mode == 'ablation':
            ablation(work, cfg)
        elif cfg.mode == 'bpe':
            compare_whole(work, cfg, BPE_RECIPES)
        elif cfg.mode == 'speedrun':
            speedrun(work, cfg, cfg.dataset or fineweb_corpus(work))
        else:
            data = fineweb_corpus(work)
            compare_whole(work, cfg, {name: ('config/train_gpt2_fineweb.py', [f'--dataset={data}', *FINEWEB_MODEL,
                                                                              *args])
                                      for name, args in FINEWEB_RECIPES.items()})


if __name__ == '__main__':
    run_main(main)
