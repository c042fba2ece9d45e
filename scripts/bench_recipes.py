"""
Time to quality: nanoGPT's recipe against the faster one (or each modern option alone), as the exact loss on
the whole val split (eval.py --task=loss) against training time, all runs in one process of this script.

Each run is `python train.py <config> <overrides>` saving a snapshot every snapshot_every iterations
(checkpoint_interval + keep_checkpoints) and logging every iteration; then eval.py scores every snapshot. A
snapshot's time is the training time up to it: the sum of its iterations' time_ms from metrics.jsonl, where
an iteration that also evaluated or saved counts at the run's median (evaluation and saving follow the cadence
we chose for the measurement, not the recipe). The runs alternate (A, B, A, B, ...) for `rounds` rounds, so
machine load hits them alike, and the figures are medians over the rounds.

Modes:
  compare   nanoGPT's laptop run (config/train_shakespeare_char_cpu.py) vs config/train_shakespeare_char_fast.py:
            the curve of each, the baseline's final loss, when the fast recipe first reaches it, and the ratio
            of that time to the baseline's whole run (the issue's goal: <= 0.5).
  ablation  the baseline with one option at a time, at the baseline's 2000 iterations: final loss, median
            ms/iter, and the time it first reaches the baseline's final loss.
  fineweb   the same comparison on a FineWeb-like corpus in llm.c shards, made with data/fineweb/prepare.py
            --files from text already on this machine (the long descriptions of the installed Python packages
            and Python's pydoc topics: English prose and markdown, ~2.4 MB), at a model a CPU trains in minutes.
  speedrun  for a GPU: GPT-2 124M on that corpus, config/train_gpt2_fineweb.py against
            config/train_gpt2_speedrun.py for speedrun_iters steps of 16 x 1024 tokens each (both schedules
            shortened to that): median ms/iter, median MFU and the val loss at the same last step.

Usage:
$ python scripts/bench_recipes.py                                  # compare, 1 round
$ python scripts/bench_recipes.py --mode=ablation
$ python scripts/bench_recipes.py --mode=fineweb --rounds=1
$ python scripts/bench_recipes.py --mode=speedrun --device=cuda --speedrun_iters=300     # ~5 minutes on one H200
"""

import glob
import json
import os
import statistics
import sys
import sysconfig

# scripts/ is on sys.path
from benchtools import cpu_model, run_checked, work_directory, write_jsonl_corpus
from configurator import Group, Schema, Setting, configure
from nanogpt_plus.metrics import read_metrics
from nanogpt_plus.out_dir import snapshots
from nanogpt_plus.runtime import run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULTS = Schema(Group(
    'benchmark',
    mode=Setting('compare', "'compare', 'ablation', 'fineweb' or 'speedrun' (see above)",
                 choices=('compare', 'ablation', 'fineweb', 'speedrun')),
    speedrun_iters=Setting(300, "speedrun: the steps of each run", low=2),
    device=Setting('cuda', "speedrun: the device of both runs", not_empty=True),
    rounds=Setting(1, "how many times the runs alternate", low=1),
    snapshot_every=Setting(100, "iterations between scored snapshots (the fast recipe: half of it)", low=1),
    num_threads=Setting(2, "torch threads of every run (fixed, so the runs are comparable)", low=1),
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
# the FineWeb-like comparison: a 4 x 128 GPT with GPT-2's vocabulary, 1,024 tokens per step
FINEWEB_MODEL = ['--n_layer=4', '--n_head=4', '--n_embd=128', '--block_size=128', '--batch_size=8',
                 '--gradient_accumulation_steps=1', '--dropout=0.0', '--data_order=sequential', '--device=cpu',
                 '--compile=False', '--dtype=float32', '--eval_iters=10', '--eval_interval=100', '--warmup_iters=30',
                 '--beta2=0.99', '--hellaswag_interval=0', '--sample_interval=0']
FINEWEB_RECIPES = {
    'nanogpt': ['--max_iters=400', '--lr_decay_iters=400', '--learning_rate=1e-3', '--min_lr=1e-4'],
    'fast': ['--max_iters=200', '--lr_decay_iters=200', '--learning_rate=1e-3', '--min_lr=1e-4', '--optimizer=muon',
             # the laptop recipe's
             '--pos=rope', '--qk_norm=True', '--lr_schedule=wsd', '--cooldown_frac=0.4'],
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
    for r in range(cfg['rounds']):
        results = {}
        for name, args in recipes.items():
            every = cfg['snapshot_every'] if name == 'nanogpt' else max(1, cfg['snapshot_every'] // 2)
            out_dir = train(work, f"{name}_{r}", config_of(name), args, every, cfg['num_threads'])
            results[name] = curve(out_dir, cfg['num_threads'])
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


def ablation(work, cfg):
    """ The baseline, then the baseline with each option alone (per round, in that order). """
    rows = {name: [] for name in ['baseline', *OPTIONS]}
    for r in range(cfg['rounds']):
        base = None
        for name in rows:
            out_dir = train(work, f"{name}_{r}", BASELINE, OPTIONS.get(name, []), cfg['snapshot_every'],
                            cfg['num_threads'])
            points, median = curve(out_dir, cfg['num_threads'])
            base = base or points
            reached = first_reaching(points, base[-1][2])
            rows[name].append((points[-1][2], median, reached / base[-1][1] if reached else float('nan')))
    print(f"{'option':10s} {'final val':>9s} {'ms/iter':>8s} {'time to baseline loss':>22s}")
    for name, values in rows.items():
        loss, ms, ratio = (statistics.median(v[i] for v in values) for i in range(3))
        print(f"{name:10s} {loss:9.4f} {ms:8.1f} {ratio:21.2f}x")


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
    """ GPT-2 124M, the GPT-2 recipe vs the speedrun's, the same short run of each on the local corpus. """
    steps = cfg['speedrun_iters']
    short = [f'--dataset={data}', f'--device={cfg["device"]}', f'--max_iters={steps}', f'--lr_decay_iters={steps}',
             f'--warmup_iters={max(1, steps // 10)}', '--batch_size=16', '--gradient_accumulation_steps=1',
             f'--eval_interval={steps}', '--eval_iters=20', '--hellaswag_interval=0', '--keep_checkpoints=0',
             '--log_interval=1']
    print(f"{'recipe':10s} {'ms/iter':>8s} {'MFU':>6s} {'val loss at ' + str(steps):>16s}")
    for name, config in (('gpt2', 'config/train_gpt2_fineweb.py'), ('speedrun', 'config/train_gpt2_speedrun.py')):
        out_dir = os.path.join(work, name)
        cmd = [sys.executable, 'train.py', config, f'--out_dir={out_dir}', '--overwrite=True', *short]
        run_checked(cmd, f"train.py {config}", cwd=REPO)
        records = read_metrics(os.path.join(out_dir, 'metrics.jsonl'))
        iters = [r for r in records if r['type'] == 'iter' and r['iter'] >= 10]  # after compiling
        ms = statistics.median(r['time_ms'] for r in iters)
        mfu = statistics.median(r['mfu'] for r in iters if r['mfu'] is not None)
        val = [r['val_loss'] for r in records if r['type'] == 'eval' and r['iter'] == steps][-1]
        print(f"{name:10s} {ms:8.1f} {100 * mfu:5.1f}% {val:16.4f}", flush=True)


def main(argv=None):
    cfg = configure(DEFAULTS, argv, doc=__doc__)
    DEFAULTS.check(cfg)
    print(f"cpu: {cpu_model()}, {cfg['num_threads']} threads")
    with work_directory(cfg['out_dir'], 'bench_recipes_') as work:
        if cfg['mode'] == 'compare':
            compare(work, cfg, {'nanogpt': [], 'fast': []}, {'nanogpt': BASELINE, 'fast': FAST}.get)
        elif cfg['mode'] == 'ablation':
            ablation(work, cfg)
        elif cfg['mode'] == 'speedrun':
            speedrun(work, cfg, fineweb_corpus(work))
        else:
            data = fineweb_corpus(work)
            recipes = {name: [f'--dataset={data}', *FINEWEB_MODEL, *args] for name, args in FINEWEB_RECIPES.items()}
            compare(work, cfg, recipes, lambda name: 'config/train_gpt2_fineweb.py')


if __name__ == '__main__':
    run_main(main)
