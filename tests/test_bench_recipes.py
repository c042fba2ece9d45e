"""
scripts/bench_recipes.py: the Muon step profiled part by part, and the whole-run ratios taken from each round's
pair.
"""
import contextlib
import os
import re

import pytest

from configurator import Settings
from helpers import REPO, slow
from nanogpt_plus.errors import UserError

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


# -----------------------------------------------------------------------------
# --mode=laptop: nanoGPT's laptop run against ours, quiet and beside busy loops

def bench_module(monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(REPO, 'scripts'))
    import bench_recipes
    return bench_recipes


@slow
def spinning(bench_recipes, n):
    """ bench_recipes.busy_loops(n): n real processes, so the tests that use it are in the slow tier. """
    return bench_recipes.busy_loops(n)


def test_busy_loops_spin_while_the_block_runs_and_are_gone_after(monkeypatch):
    bench_recipes = bench_module(monkeypatch)
    with spinning(bench_recipes, 2) as loops:
        assert len(loops) == 2 and all(loop.poll() is None for loop in loops)
    assert all(loop.poll() is not None for loop in loops)
    with pytest.raises(RuntimeError), spinning(bench_recipes, 1) as loops:
        raise RuntimeError("a failed run stops the loops too")
    assert loops[0].poll() is not None


def test_the_laptop_mode_alternates_the_two_under_each_load_and_prints_each_ratio(monkeypatch, capsys, tmp_path):
    """ Per recipe and load, nanoGPT then ours for each round, the loops running around each pair only; the
    ratio is the median of each round's pair; the losses are scored after the loops stopped. """
    bench_recipes = bench_module(monkeypatch)
    events = []

    @contextlib.contextmanager
    def busy_loops(n):
        events.append(f"loops {n}")
        yield []
        events.append("stop")
    # wall seconds per (who, load, round): ours is 25% of nanoGPT's quiet, 20% and 30% beside 2 loops
    seconds = {('nanogpt', 0, 0): 80.0, ('ours', 0, 0): 20.0, ('nanogpt', 0, 1): 100.0, ('ours', 0, 1): 25.0,
               ('nanogpt', 2, 0): 300.0, ('ours', 2, 0): 60.0, ('nanogpt', 2, 1): 200.0, ('ours', 2, 1): 60.0}

    def timed_run(cmd, cwd, what):
        out_dir = next(a for a in cmd if a.startswith('--out_dir=')).split('=', 1)[1]
        who = out_dir.rsplit('_', 1)[1]
        load, round_ = int(out_dir.split('_')[-3][0]), int(out_dir.split('_')[-2])
        events.append(f"{who} {load} {round_}")
        return seconds[(who, load, round_)], (['2', '1'] if who == 'ours' and load else ['2'] if who == 'ours' else [])

    def laptop_loss(work, out_dir, val_file, num_threads):
        events.append("score")
        return 1.88 if out_dir.endswith('nanogpt') else 1.86
    monkeypatch.setattr(bench_recipes, 'busy_loops', busy_loops)
    monkeypatch.setattr(bench_recipes, 'timed_run', timed_run)
    monkeypatch.setattr(bench_recipes, 'laptop_loss', laptop_loss)
    monkeypatch.setattr(bench_recipes, 'laptop_datasets', lambda work, text: None)
    bench_recipes.laptop(str(tmp_path), Settings({'recipes': 'char', 'busy_loops': '0,2', 'rounds': 2,
                                                  'nanogpt_dir': '', 'text': '', 'num_threads': 1}))
    assert events == ["loops 0", "nanogpt 0 0", "ours 0 0", "stop", "loops 0", "nanogpt 0 1", "ours 0 1", "stop",
                      *["score"] * 4,
                      "loops 2", "nanogpt 2 0", "ours 2 0", "stop", "loops 2", "nanogpt 2 1", "ours 2 1", "stop",
                      *["score"] * 4]
    out = capsys.readouterr().out
    assert "char, 2 busy loops, round 0: ours 60.0 s (threads: 2 -> 1)" in out
    # each load's losses and ratio as soon as they are scored
    said = "char, quiet: full-val loss nanoGPT 1.8800, ours 1.8600; ratio 0.250x"
    assert said in out and out.index(said) < out.index("char, 2 busy loops, round 0")
    table = out.split('ratio')[-1]
    assert re.search(r"char\s+quiet\s+90\.0\s+1\.8800\s+22\.5\s+1\.8600\s+0\.250x  nanoGPT's loss reached", table)
    assert re.search(r"char\s+2 busy loops\s+250\.0\s+1\.8800\s+60\.0\s+1\.8600\s+0\.250x", table)


def test_the_laptop_mode_runs_nanogpts_own_laptop_command_from_a_checkout(monkeypatch, tmp_path):
    bench_recipes = bench_module(monkeypatch)
    checkout = tmp_path / 'nanoGPT'
    (checkout / 'config').mkdir(parents=True)
    for name in ('train.py', 'model.py', 'configurator.py', 'config/train_shakespeare_char.py'):
        (checkout / name).write_text('# nanoGPT\n')
    work = tmp_path / 'work'
    here = bench_recipes.nanogpt_checkout(str(work), str(checkout))
    assert sorted(os.listdir(here)) == ['config', 'configurator.py', 'data', 'model.py', 'train.py']
    assert os.path.realpath(os.path.join(here, 'data')) == os.path.realpath(work / 'data')
    commands = bench_recipes.laptop_commands(str(work), 'bpe', here, str(work / 'bpe_0busy_0'))
    cmd, cwd = commands['nanogpt']
    # nanoGPT README's CPU command, at GPT-2's vocabulary for 600 iterations
    assert cwd == here and ' '.join(cmd[1:]) == (
        "train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20 --log_interval=1 "
        "--block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128 --max_iters=2000 "
        "--lr_decay_iters=2000 --dropout=0.0 --dataset=shakespeare --max_iters=600 --lr_decay_iters=600 "
        f"--out_dir={work / 'bpe_0busy_0'}_nanogpt")
    cmd, cwd = commands['ours']
    assert cwd == REPO and cmd[2] == 'config/train_shakespeare_fast.py' and '--num_threads' not in ' '.join(cmd)
    (checkout / 'model.py').unlink()
    with pytest.raises(UserError, match="has no model.py: pass a checkout of karpathy/nanoGPT"):
        bench_recipes.nanogpt_checkout(str(tmp_path / 'work2'), str(checkout))


def test_without_a_checkout_the_baseline_is_nanogpts_recipe_here_on_a_thread_per_core(monkeypatch, tmp_path):
    bench_recipes = bench_module(monkeypatch)
    monkeypatch.setattr(os, 'cpu_count', lambda: 6)
    cmd, cwd = bench_recipes.laptop_commands(str(tmp_path), 'char', None, str(tmp_path / 'x'))['nanogpt']
    assert cwd == REPO and cmd[1:3] == ['train.py', 'config/train_shakespeare_char_cpu.py']
    assert f"--dataset={tmp_path / 'data' / 'shakespeare_char'}" in cmd and '--num_threads=6' in cmd
