"""
scripts/plot_metrics.py: a run's losses drawn, and a character and a BPE run on one bits-per-byte axis.
"""
import json
import math
import os
import runpy

import pytest

import train
from helpers import REPO, run_python, tiny_args, train_args, train_out
from nanogpt_plus.errors import UserError
from nanogpt_plus.metrics import read_metrics


def test_plot_metrics(dataset, tmp_path, capsys):
    train_out(capsys, tiny_args(dataset, tmp_path, max_iters=4, eval_interval=2))
    r = run_python(["scripts/plot_metrics.py", f"--out_dir={tmp_path}"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "plotted 5 iterations and 3 evaluations" in r.stdout
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_a_char_and_a_bpe_run_on_one_bpb_axis(two_datasets, tmp_path, capsys):
    for kind in ('char', 'gpt2'):
        train.main(train_args(two_datasets[kind][0], tmp_path / kind, max_iters=4, eval_interval=2,
                              lr_decay_iters=4, n_embd=16, block_size=16))
    capsys.readouterr()
    main = runpy.run_path(os.path.join(REPO, 'scripts', 'plot_metrics.py'))
    png = tmp_path / 'both.png'
    counts = main['plot'](str(tmp_path / 'char' / 'metrics.jsonl'), str(png), bpb=True,
                          others=[str(tmp_path / 'gpt2' / 'metrics.jsonl')])
    assert counts == (5, 3, 0) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the curves drawn are the bits per byte: the per-iteration losses over the train split's bytes
    records = read_metrics(str(tmp_path / 'gpt2' / 'metrics.jsonl'))
    iters, evals, _ = main['iterations_and_evaluations'](str(tmp_path / 'gpt2' / 'metrics.jsonl'))
    drawn_iters, drawn_evals = main['in_bits_per_byte'](str(tmp_path / 'gpt2' / 'metrics.jsonl'), iters, evals)
    per_token = next(r['train'] for r in records if r['type'] == 'bytes_per_token')
    assert [r['loss'] for r in drawn_iters] == pytest.approx([r['loss'] / math.log(2) / per_token for r in iters])
    assert [r['val_loss'] for r in drawn_evals] == [r['val_bpb'] for r in evals]
    # a run logged before bits per byte existed: one line
    old = tmp_path / 'old' / 'metrics.jsonl'
    os.makedirs(old.parent)
    old.write_text(json.dumps({'type': 'eval', 'iter': 0, 'train_loss': 1.0, 'val_loss': 1.0, 'lr': 0.1}) + '\n')
    with pytest.raises(UserError, match='without val_bpb.*plot it without --bpb'):
        main['plot'](str(old), str(tmp_path / 'x.png'), bpb=True)


# --- what a person reads: short run names, one colour per run on every panel, the legend off the curves, and
# iterations, wall time or tokens on the x axis, from a small metrics.jsonl of known numbers

def write_records(path, records):
    os.makedirs(path.parent, exist_ok=True)
    path.write_text(''.join(json.dumps(r) + '\n' for r in records))


def iteration(it, time_ms, wall_time, tokens, run, loss=2.0, lr=1e-3):
    """ An 'iter' record as train.py's log_iteration writes it (tokens: the iteration's tokens). """
    return {'type': 'iter', 'iter': it, 'loss': loss, 'lr': lr, 'grad_norm': 1.0, 'time_ms': time_ms,
            'tokens_per_sec': tokens / (time_ms / 1000), 'mfu': None, 'run': run, 'wall_time': wall_time}


def evaluation(it, wall_time, run, loss=2.5):
    return {'type': 'eval', 'iter': it, 'train_loss': loss, 'val_loss': loss + 0.1, 'lr': 1e-3, 'run': run,
            'wall_time': wall_time}


def start(it, run):
    return {'type': 'start', 'iter': it, 'init_from': 'resume' if it else 'scratch', 'run': run, 'wall_time': 0.0}


@pytest.fixture
def three_runs(tmp_path):
    """
    x/out: 100 tokens an iteration, stopped after iteration 3 and resumed from 3 (the first process's
    iteration 3 is replaced); its processes' loops begin at wall_time 0.0 and 4.0. y/out: log_interval=2,
    200 tokens an iteration. fast: one iteration. Returns their metrics files.
    """
    x = tmp_path / 'x' / 'out' / 'metrics.jsonl'
    write_records(x, [
        start(0, 1), evaluation(0, 1.0, 1), iteration(0, 1500, 1.5, 100, 1), iteration(1, 500, 2.0, 100, 1),
        evaluation(2, 2.3, 1), iteration(2, 500, 2.5, 100, 1), iteration(3, 500, 3.0, 100, 1, loss=9.0),
        start(3, 2), iteration(3, 1000, 5.0, 100, 2), evaluation(4, 5.1, 2), iteration(4, 250, 5.25, 100, 2)])
    y = tmp_path / 'y' / 'out' / 'metrics.jsonl'
    write_records(y, [
        start(0, 1), iteration(0, 1000, 1.0, 200, 1), iteration(2, 100, 1.25, 200, 1), evaluation(3, 1.4, 1),
        iteration(4, 100, 1.5, 200, 1)])
    fast = tmp_path / 'fast' / 'metrics.jsonl'
    write_records(fast, [start(0, 1), evaluation(0, 0.5, 1), iteration(0, 800, 0.8, 50, 1)])
    return [str(x), str(y), str(fast)]


def lines_by_run(fig, names):
    """ {name: [(panel index, curve kind, line)]} of the figure's curves (their labels: 'name: kind'). """
    found = {name: [] for name in names}
    for i, ax in enumerate(fig.axes):
        for line in ax.get_lines():
            name, _, kind = line.get_label().partition(': ')
            found[name].append((i, kind, line))
    return found


@pytest.mark.parametrize('axis, label, val_x', [
    # x/out's evaluations at iterations 0, 2 and 4; y/out's at 3
    ('iter', 'iteration', ([0, 2, 4], [3])),
    # the seconds of training when each was written: x/out's second process adds its time to the first's 2.5 s
    # (iteration 3 ends at 5.0 in a loop that began at 4.0: 2.5 + 1.0), its start-up left out
    ('time', 'wall time (s), evaluations included', ([1.0, 2.3, 2.5 + 1.1], [1.4])),
    # the tokens trained on before the evaluation; y/out logged every other iteration
    ('tokens', 'tokens trained on', ([0, 200, 400], [600])),
])
def test_plot_names_colours_and_x_axis(three_runs, axis, label, val_x):
    import matplotlib.colors
    import matplotlib.pyplot
    plot_metrics = runpy.run_path(os.path.join(REPO, 'scripts', 'plot_metrics.py'))
    fig, counts = plot_metrics['figure'](three_runs, x=axis)
    names = ['x/out', 'y/out', 'fast']
    # x/out's iteration 3 of the first process is replaced by the resume's
    assert counts == (5, 3, 0)
    # the title and the legend name the runs by the shortest tail of their directories that tells them apart
    assert fig._suptitle.get_text() == 'x/out vs y/out vs fast'
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()][:3] == names
    # one colour per run, on the loss and the learning-rate panels alike, and the legend's line in it
    found = lines_by_run(fig, names)
    colours = {}
    for name, lines in found.items():
        assert {panel for panel, _, _ in lines} == {0, 1}, name
        assert len({matplotlib.colors.to_hex(line.get_color()) for _, _, line in lines}) == 1, name
        colours[name] = matplotlib.colors.to_hex(lines[0][2].get_color())
    assert len(set(colours.values())) == 3
    assert [matplotlib.colors.to_hex(h.get_color()) for h in legend.legend_handles[:3]] == list(colours.values())
    # the legend lies beside the panels, over none of them
    fig.canvas.draw()
    box = legend.get_window_extent()
    assert all(not box.overlaps(ax.get_window_extent()) for ax in fig.axes)
    # the x axis says what it is, and each curve's points lie where their iterations put them
    assert fig.axes[1].get_xlabel() == label
    val = {name: next(line for _, kind, line in found[name] if kind == 'val (eval)') for name in names}
    assert list(val['x/out'].get_xdata()) == pytest.approx(val_x[0])
    assert list(val['y/out'].get_xdata()) == pytest.approx(val_x[1])
    per_iter = next(line for _, kind, line in found['x/out'] if kind == 'train (per iter)')
    assert list(per_iter.get_ydata()) == [2.0] * 5  # the replaced iteration's 9.0 isn't drawn
    if axis == 'time':
        assert list(per_iter.get_xdata()) == pytest.approx([1.5, 2.0, 2.5, 3.5, 3.75])
    if axis == 'tokens':
        y_iters = next(line for _, kind, line in found['y/out'] if kind == 'learning rate')
        assert list(y_iters.get_xdata()) == [0, 400, 800]
    matplotlib.pyplot.close(fig)


def test_run_names_are_the_shortest_distinguishing_tails():
    names = runpy.run_path(os.path.join(REPO, 'scripts', 'plot_metrics.py'))['run_names']
    m = 'metrics.jsonl'
    assert names([f'/w/out-a/{m}', f'/w/out-b/{m}']) == ['out-a', 'out-b']
    assert names([f'/w/runs/a/out/{m}', f'/w/runs/b/out/{m}', f'/w/fast/{m}']) == ['a/out', 'b/out', 'fast']
    assert names([f'/w/out/{m}']) == ['out']
    assert names([f'/w/out/{m}', f'/w/out/{m}']) == ['out', 'out (2)']


def test_time_axis_units_and_tokens_ticks():
    plot_metrics = runpy.run_path(os.path.join(REPO, 'scripts', 'plot_metrics.py'))
    assert [plot_metrics['time_unit'](s) for s in (90, 1800, 7 * 3600)] == [(1, 's'), (60, 'min'), (3600, 'h')]
    assert [plot_metrics['tokens_label'](t) for t in (0, 750, 12_000, 1_500_000, 2e9)] == \
        ['0', '750', '12K', '1.5M', '2B']


def test_plot_time_of_a_run_without_times_is_one_line(tmp_path, monkeypatch, capsys):
    # finetune.py's iteration records carry no time_ms
    write_records(tmp_path / 'ft' / 'metrics.jsonl',
                  [start(0, 1), {'type': 'iter', 'iter': 0, 'loss': 1.0, 'lr': 1e-4, 'run': 1, 'wall_time': 1.0}])
    for axis, said in (('time', 'time_ms and wall_time'), ('tokens', 'time_ms and tokens_per_sec')):
        monkeypatch.setattr('sys.argv', ['plot_metrics.py', f'--out_dir={tmp_path / "ft"}', f'--x={axis}'])
        with pytest.raises(SystemExit) as e:
            runpy.run_path(os.path.join(REPO, 'scripts', 'plot_metrics.py'), run_name='__main__')
        assert e.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"no iteration records with {said}" in err[0] and '--x=iter' in err[0], err
    monkeypatch.setattr('sys.argv', ['plot_metrics.py', f'--out_dir={tmp_path / "ft"}', '--x=days'])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(os.path.join(REPO, 'scripts', 'plot_metrics.py'), run_name='__main__')
    assert e.value.code == 2 and "x must be 'iter', 'time' or 'tokens', got 'days'" in capsys.readouterr().err


# --- the reference curve's band (train.py logs it beside each val loss when a reference matches)

def png_size(path):
    """ (width, height) from a PNG's IHDR chunk. """
    data = open(path, 'rb').read(24)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b'IHDR'
    return int.from_bytes(data[16:20], 'big'), int.from_bytes(data[20:24], 'big')


def test_plot_draws_the_reference_band_under_the_val_curve(tmp_path):
    path = tmp_path / 'banded' / 'metrics.jsonl'
    banded = [dict(evaluation(it, it, 1, loss=4.0 - it / 100), ref_val_mean=4.1 - it / 100,
                   ref_val_low=4.0 - it / 100, ref_val_high=4.2 - it / 100, val_bpb=1.0, train_bpb=1.0)
              for it in (0, 100, 200)]
    write_records(path, [start(0, 1), iteration(0, 100, 0.1, 100, 1), *banded])
    main = runpy.run_path(os.path.join(REPO, 'scripts', 'plot_metrics.py'))
    png = tmp_path / 'band.png'
    assert main['plot'](str(path), str(png)) == (1, 3, 0)
    assert png_size(png) == (1000, 700)  # figsize 10 x 7 at 100 dpi
    fig, _ = main['figure']([str(path)])
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert 'val (eval)' in labels and labels[-1] == 'reference band (val)'
    # the band: one shaded area on the loss panel, from the low to the high edge at each evaluation, under the curves
    (band,) = fig.axes[0].collections
    ys = band.get_paths()[0].vertices[:, 1]
    assert min(ys) == pytest.approx(2.0) and max(ys) == pytest.approx(4.2)
    assert band.get_zorder() < min(line.get_zorder() for line in fig.axes[0].get_lines())
    # in bits per byte the band takes the val loss's own factor (here 1 / val_loss)
    fig, _ = main['figure']([str(path)], bpb=True)
    ys = fig.axes[0].collections[0].get_paths()[0].vertices[:, 1]
    assert max(ys) == pytest.approx(max((4.2 - d) / (4.1 - d) for d in (0, 1, 2)))
    # a run without a band: no shaded area, no legend entry
    plain = tmp_path / 'plain' / 'metrics.jsonl'
    write_records(plain, [start(0, 1), iteration(0, 100, 0.1, 100, 1), evaluation(0, 0.2, 1)])
    fig, _ = main['figure']([str(plain)])
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert not fig.axes[0].collections and 'reference band (val)' not in labels
