"""
scripts/finetune_demo.py: its 'scrambled' spelling class moves only the inside letters of each word; --task_only=True
writes the task's JSONL files, which finetune.py reads, and stops there.
"""
import json
import os
import random
import runpy
import string
import sys

import pytest

from helpers import REPO
from nanogpt_plus.finetuning import read_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_demo_spelling_task_changes_only_the_spelling():
    """ scripts/finetune_demo.py's 'scrambled' class: the same letters in each word, only their inside order moved. """
    demo = runpy.run_path(os.path.join(REPO, 'scripts', 'finetune_demo.py'))
    line = "Hereafter, the rest is silence; Antonio's wit"
    out = demo['scrambled'](line, random.Random(0))
    assert out != line and len(out) == len(line)
    for a, b in zip(line.split(' '), out.split(' ')):
        # case and punctuation stay put
        assert sorted(a) == sorted(b) and (a[0], a[-1]) == (b[0], b[-1])
        if sum(c.isalpha() for c in a) < 4:
            assert a == b  # "the", "is": nothing to shuffle
    # no other order: the caller skips it
    assert demo['scrambled']("seen a bee", random.Random(0)) == "seen a bee"


def test_task_only_writes_a_task_finetune_reads_and_stops(tmp_path, monkeypatch, capsys):
    # a prepared char dataset: only its meta.json's vocabulary is read (the task keeps to its characters)
    data = tmp_path / 'chars'
    data.mkdir()
    chars = sorted(set(string.printable))
    (data / 'meta.json').write_text(json.dumps({'kind': 'char', 'vocab_size': len(chars),
                                                'stoi': {c: i for i, c in enumerate(chars)},
                                                'itos': {i: c for i, c in enumerate(chars)}}))
    out = tmp_path / 'ft-task'
    monkeypatch.setattr(sys, 'argv', ['finetune_demo.py', '--task_only=True', f'--out_dir={out}',
                                      f'--dataset={data}', '--per_play=10'])
    demo = runpy.run_path(os.path.join(REPO, 'scripts', 'finetune_demo.py'))
    demo['main']()
    # no pretraining, no fine-tune
    assert sorted(os.listdir(out)) == ['spelling_train.jsonl', 'spelling_val.jsonl']
    train = read_jsonl(str(out / 'spelling_train.jsonl'), 'classification')
    val = read_jsonl(str(out / 'spelling_val.jsonl'), 'classification')
    assert (len(train), len(val)) == (48, 12)  # 10 from each of 6 plays, a fifth val
    assert {ex['label'] for ex in train} == {ex['label'] for ex in val} == {'real', 'scrambled'}
    printed = capsys.readouterr().out.splitlines()
    assert printed[-1] == ("python finetune.py --task=classification --init_from=out-shakespeare-char-cpu "
                           f"--out_dir=out-ft --train_file={out / 'spelling_train.jsonl'} "
                           f"--val_file={out / 'spelling_val.jsonl'}")
