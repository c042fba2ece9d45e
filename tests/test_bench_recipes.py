"""
scripts/bench_recipes.py: the Muon step profiled part by part, and the whole-run ratios taken from each round's
pair.
"""
import os
import re

import pytest

from configurator import Settings
from helpers import REPO

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_bench_recipes_profiles_the_step_part_by_part(monkeypatch, capsys):
    """ scripts/bench_recipes.py --mode=muon: every part of the laptop model's step, each a positive time. """
    monkeypatch.syspath_prepend(os.path.join(REPO, 'scripts'))
    import bench_recipes
    bench_recipes.main(['--mode=muon', '--profile_steps=3', '--num_threads=1'])
    rows = dict(re.findall(r'^(\S.*?|  \S.*?)\s+(\d+\.\d)$', capsys.readouterr().out, re.M))
    parts = ['forward+backward', '  with pos=rope', '  with qk_norm=True', '  with both (the fast recipe)',
             'adamw step', 'muon step', '  of which Newton-Schulz, 16 matrices batched',
             '  the same without the Gram-matrix steps', 'muon step, one matrix at a time (before)',
             '  of which Newton-Schulz, 16 matrices one by one']
    assert list(rows) == parts and all(float(v) > 0 for v in rows.values())


def test_bench_recipes_whole_runs_give_the_ratio_of_each_rounds_pair(monkeypatch, capsys):
    """ --mode=bpe / fineweb: the wall-time ratio is the median of each round's pair, not of separate medians
    (with a machine that slows down in round 2, those would give 0.4x here instead of 0.35x). """
    monkeypatch.syspath_prepend(os.path.join(REPO, 'scripts'))
    import bench_recipes
    runs = iter([(5.6, 100.0, 601), (5.5, 30.0, 166), (5.6, 200.0, 601), (5.5, 70.0, 166),
                 (5.6, 100.0, 601), (5.5, 40.0, 166)])
    calls = []

    def whole_run(work, name, config, args, num_threads):
        calls.append(name)
        return next(runs)
    monkeypatch.setattr(bench_recipes, 'whole_run', whole_run)
    bench_recipes.compare_whole('work', Settings({'rounds': 3, 'num_threads': 1}),
                                {'nanogpt': ('a.py', []), 'fast': ('b.py', [])})
    out = capsys.readouterr().out
    assert calls == ['nanogpt_0', 'fast_0', 'nanogpt_1', 'fast_1', 'nanogpt_2', 'fast_2']
    assert "wall-time ratio per round: 0.300, 0.350, 0.400" in out
    assert "the fast recipe reaches nanoGPT's final val loss (5.5000 vs 5.6000) in 0.350x its wall time and " \
           "0.276x its steps" in out
