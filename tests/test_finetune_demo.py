"""
scripts/finetune_demo.py: its 'scrambled' spelling class moves only the inside letters of each word.
"""
import os
import random
import runpy

import pytest

from helpers import REPO

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
