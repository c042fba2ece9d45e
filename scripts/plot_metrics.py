"""
Plot a training run's metrics.jsonl (written by train.py into its out_dir) to a PNG: training loss per
iteration, train/val loss at each evaluation, the in-loop HellaSwag acc_norm (hellaswag_interval > 0: on a
second axis beside the losses), and the learning rate. --bpb draws bits per byte instead of nats per token,
which doesn't depend on the tokenizer, so runs with different ones (a character model, a GPT-2 BPE one)
share the axis; --compare adds other runs to the same axes, each run in one colour on every panel, named by
its out_dir's name (or as much of its path as tells it from the others). --x chooses the horizontal axis:
iterations, the run's wall time, or the tokens trained on. Where the run matched a reference curve
(config/reference/), its band is shaded under the val curve.

Usage:
$ python scripts/plot_metrics.py --out_dir=out-shakespeare-char-cpu   # writes its metrics.png
$ python scripts/plot_metrics.py --out_dir=out --output=loss.png
$ python scripts/plot_metrics.py --out_dir=out-shakespeare-char-cpu --compare=out-shakespeare --bpb=True
$ python scripts/plot_metrics.py --out_dir=out-shakespeare-char-cpu --compare=out-shakespeare-char-fast --x=time
"""
# first, before torch is imported (seconds): a signal from here on stops the script in one line
# and exit code 130, a signal during the imports once they are done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import math
import os

from configurator import Group, Schema, Setting, configure
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import check_not_special
from nanogpt_plus.metrics import read_metrics
from nanogpt_plus.runtime import run_main
from nanogpt_plus.settings import flag

X_AXES = ('iter', 'time', 'tokens')

DEFAULTS = Schema(Group(
    'plot',
    out_dir=Setting('out', "the training run's directory, whose metrics.jsonl is plotted", not_empty=True),
    output=Setting('', "the PNG to write ('' = out_dir/metrics.png)"),
    bpb=flag(False, "bits per byte (loss / ln 2 / the split's bytes per token, as train.py logs it) instead of "
                    "the loss in nats per token: comparable across tokenizers"),
    compare=Setting('', "other runs' out_dirs, comma-separated, drawn on the same axes"),
    x=Setting('iter', "the horizontal axis: 'iter' (iterations), 'time' (the run's wall time: its iterations' "
                      "time_ms summed across resumes) or 'tokens' (tokens trained on)", choices=X_AXES),
))

# how each kind of curve is drawn; the colour says the run, the style the curve
STYLES = {
    'train (per iter)': dict(lw=0.8, alpha=0.4),
    'train (eval)': dict(ls='--', marker='o', ms=4, mfc='white', lw=1.2),
    'val (eval)': dict(ls='-', marker='o', ms=4, lw=1.8),
    'hellaswag acc_norm (right axis)': dict(ls=':', marker='s', ms=4, lw=1.2),
}
# the reference curve's band (train.py logs it beside each val loss when a reference matches), under the curves
BAND = 'reference band (val)'
BAND_STYLE = dict(alpha=0.18, lw=0)


# the records plotted: iterations, evaluations, in-loop HellaSwag scores
KINDS = ('iter', 'eval', 'hellaswag')


def iterations_and_evaluations(path, records=None):
    """ (iteration records, eval records, hellaswag records) of the run's true trajectory (a resume's replace
    what it repeats); records: the file's, where the caller has read them. """
    records = run_records(path) if records is None else records
    return tuple([r for r in records if r.get('type') == kind] for kind in KINDS)


def run_records(path):
    """ The records of a run's metrics file, or one line when there is none. """
    if not os.path.isfile(path):
        raise UserError(f"no metrics file at {path}; train.py writes one (metrics.jsonl) into its out_dir")
    return read_metrics(path)


def in_bits_per_byte(path, iters, evals):
    """
    The run's curves in bits per byte: its eval records' train_bpb/val_bpb as train/val_loss, and the
    per-iteration losses divided by ln 2 and the train split's bytes per token (its 'bytes_per_token' record).
    """
    records = run_records(path)
    if not evals or any('val_bpb' not in r for r in evals):
        raise UserError(f"{path} has evaluations without val_bpb (a run from before train.py logged bits per "
                        f"byte, or a tokenizer whose bytes are unknown); plot it without --bpb")
    per_token = [r for r in records if r.get('type') == 'bytes_per_token' and r.get('train')]
    divisor = math.log(2) * per_token[-1]['train'] if per_token else None
    iters = [dict(r, loss=r['loss'] / divisor) for r in iters] if divisor else []
    evals = [dict(r, train_loss=r.get('train_bpb', math.nan), val_loss=r['val_bpb'], **band_in_bits(r))
             for r in evals]
    return iters, evals


def band_in_bits(record):
    """ An eval record's reference band in bits per byte (the val loss's own factor), or {} without one. """
    if 'ref_val_low' not in record:
        return {}
    factor = record['val_bpb'] / record['val_loss']
    return {k: record[k] * factor for k in ('ref_val_low', 'ref_val_high', 'ref_val_mean')}


def run_names(paths):
    """
    A short name per metrics file: its directory's name, or as many of the directory's last path parts as
    tell it from every other run's (runs/a/out and runs/b/out: 'a/out', 'b/out'). The same directory given
    twice is numbered.
    """
    dirs = [os.path.dirname(os.path.abspath(p)) for p in paths]
    parts = [[s for s in d.split(os.sep) if s] or [d] for d in dirs]
    names = []
    for i, mine in enumerate(parts):
        others = [p for j, p in enumerate(parts) if j != i and p != mine]
        k = 1
        while k < len(mine) and any(p[-k:] == mine[-k:] for p in others):
            k += 1
        names.append('/'.join(mine[-k:]))
    # a directory listed twice: '(2)', '(3)' after its later appearances
    seen = {}
    for i, name in enumerate(names):
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > 1:
            names[i] = f"{name} ({seen[name]})"
    return names


def placed_records(path, axis):
    """
    The run's (iteration, evaluation, HellaSwag) records as iterations_and_evaluations gives them, each
    with its place on the x axis as 'x': 'iter': its iteration; 'tokens': the tokens trained on before that
    iteration (tokens_before); 'time': the seconds of training when it was written (seconds_written).
    """
    records = run_records(path)
    groups = iterations_and_evaluations(path, records)
    if axis == 'iter':
        return [[dict(r, x=r['iter']) for r in group] for group in groups]
    needed = ('time_ms', 'wall_time') if axis == 'time' else ('time_ms', 'tokens_per_sec')
    if not groups[0] or any(not isinstance(r.get(k), (int, float)) for r in groups[0] for k in needed):
        raise UserError(f"{path} has no iteration records with {' and '.join(needed)} (written by finetune.py, "
                        f"or by an older train.py); plot it with --x=iter")
    if axis == 'tokens':
        at = tokens_before(groups[0])
        return [[dict(r, x=at(r['iter'])) for r in group] for group in groups]
    kept = [r for r in records if r.get('type') in ('start', 'iter') or
            r.get('type') in KINDS and isinstance(r.get('wall_time'), (int, float))]
    seconds = seconds_written(kept)
    return [[dict(r, x=x) for r, x in zip(kept, seconds) if r.get('type') == kind] for kind in KINDS]


def tokens_before(iters):
    """
    The function from an iteration to the tokens trained on before it: each iteration's tokens are its
    record's tokens_per_sec * time_ms (the tokens over the time); the iterations between records (only
    every log_interval-th is recorded) count as the next recorded one, which trained on as many.
    """
    import numpy as np
    known, before = [0], [0]
    for r in sorted(iters, key=lambda r: r['iter']):
        each = round(r['tokens_per_sec'] * r['time_ms'] / 1000)
        # the iterations known[-1] .. r['iter'] - 1
        before.append(before[-1] + (r['iter'] - known[-1]) * each)
        known.append(r['iter'])
    return lambda it: float(np.interp(it, known, before))


def seconds_written(records):
    """
    The seconds of training when each of a run's records (in the file's order, its start records among
    them) was written: its wall_time (the seconds since its process began logging) counted from the moment
    that process's training loop began, which is its first iteration record's wall_time less that
    iteration's time_ms (time_ms counts from the end of the iteration before, the first one's from the
    loop's start); plus the seconds of the trajectory before the process's start (a resume), so that the
    processes' times add up and their start-ups (building the model, opening the data) are left out.
    Evaluations and checkpoint saves count: they happen inside iterations. Iterations no record gives
    (log_interval > 1) at a resume count as their nearest recorded neighbour's time_ms.
    """
    processes, out = [], []  # the records of each process (a start record opens one)
    for r in records:
        if r.get('type') == 'start' or not processes:
            processes.append([])
        processes[-1].append(r)
    # the seconds at the end of the last iteration record so far, and that record
    elapsed, last = 0.0, None
    for process in processes:
        start = process[0]['iter'] if process[0].get('type') == 'start' else 0
        if last is not None:  # iterations between the last record kept and the resume point
            elapsed += max(0, start - 1 - last['iter']) * last['time_ms'] / 1000
        first = next((r for r in process if r.get('type') == 'iter'), None)
        if first is not None:
            begin = first['wall_time'] - max(1, first['iter'] - start + 1) * first['time_ms'] / 1000
        else:  # a process that logged no iteration: from its first record
            begin = next((r['wall_time'] for r in process if r.get('type') != 'start'), 0.0)
        base = elapsed
        for r in process:
            out.append(None if r.get('type') == 'start' else base + r['wall_time'] - begin)
            if r.get('type') == 'iter':
                elapsed, last = out[-1], r
    return out


def time_unit(seconds):
    """ (divisor, label) that keeps the wall-time axis' numbers readable: seconds, minutes or hours. """
    if seconds <= 300:
        return 1, 's'
    if seconds <= 300 * 60:
        return 60, 'min'
    return 3600, 'h'


def tokens_label(value, _position=None):
    """ A token count as a tick label: 750, 12K, 1.5M, 2B. """
    for size, suffix in ((1e9, 'B'), (1e6, 'M'), (1e3, 'K')):
        if abs(value) >= size:
            return f"{value / size:.4g}{suffix}"
    return f"{value:.4g}"


def plot_run(axes, run, color, scale):
    """ One run's curves in its colour: losses and HellaSwag on the top panel, the learning rate below. """
    ax_loss, ax_lr, ax_hellaswag = axes
    name, iters, evals, scores = run

    def draw(ax, records, key, kind):
        ax.plot([r['x'] / scale for r in records], [r[key] for r in records], color=color, label=f"{name}: {kind}",
                **STYLES.get(kind, {}))
    if iters:
        draw(ax_loss, iters, 'loss', 'train (per iter)')
        draw(ax_lr, iters, 'lr', 'learning rate')
    banded = [r for r in evals if 'ref_val_low' in r]
    if banded:
        # under the curves: the band of the reference curve the run matched, at its evaluations
        ax_loss.fill_between([r['x'] / scale for r in banded], [r['ref_val_low'] for r in banded],
                             [r['ref_val_high'] for r in banded], color=color, zorder=0, **BAND_STYLE)
    if evals:
        draw(ax_loss, evals, 'train_loss', 'train (eval)')
        draw(ax_loss, evals, 'val_loss', 'val (eval)')
    if scores:
        draw(ax_hellaswag, scores, 'acc_norm', 'hellaswag acc_norm (right axis)')


def figure(paths, bpb=False, x='iter'):
    """
    The figure of the runs whose metrics files are paths (the first one's title when alone), and the first
    run's (iterations, evaluations, HellaSwag scores) counts. One legend, right of the panels: a line per
    run in its colour, and a line per kind of curve.
    """
    import matplotlib
    matplotlib.use('Agg')  # no display needed
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter
    names = run_names(paths)
    runs, counts = [], None
    for path, name in zip(paths, names):
        iters, evals, scores = placed_records(path, x)
        counts = counts or (len(iters), len(evals), len(scores))
        if bpb:
            iters, evals = in_bits_per_byte(path, iters, evals)
        runs.append((name, iters, evals, scores))
    scale, x_label = 1, {'iter': 'iteration', 'tokens': 'tokens trained on'}.get(x)
    if x == 'time':
        scale, unit = time_unit(max((r['x'] for _, *groups in runs for group in groups for r in group), default=0))
        x_label = f'wall time ({unit}), evaluations included'

    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(10, 7), sharex=True, layout='constrained',
                                         gridspec_kw={'height_ratios': [3, 1]})
    ax_hellaswag = ax_loss.twinx() if any(scores for *_, scores in runs) else None
    colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
    for i, run in enumerate(runs):
        plot_run((ax_loss, ax_lr, ax_hellaswag), run, colors[i % len(colors)], scale)

    ax_loss.set_ylabel('bits per byte' if bpb else 'loss (nats per token)')
    ax_loss.grid(alpha=0.3)
    if ax_hellaswag is not None:
        ax_hellaswag.set_ylabel('hellaswag acc_norm')
    ax_lr.set_ylabel('learning rate')
    # 0.001, not 0.00100
    ax_lr.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:.3g}"))
    ax_lr.set_xlabel(x_label)
    ax_lr.grid(alpha=0.3)
    if x == 'tokens':
        ax_lr.xaxis.set_major_formatter(FuncFormatter(tokens_label))
    fig.suptitle(' vs '.join(names) if len(names) <= 3 else f"{len(names)} runs: {', '.join(names)}", wrap=True)

    # the legend: the runs by colour (when there are several), then the curves by style, in grey
    handles = [Line2D([], [], color=colors[i % len(colors)], lw=3, label=name) for i, name in enumerate(names)]
    handles = handles if len(names) > 1 else []
    kinds = [k for k in STYLES if ax_hellaswag is not None or not k.startswith('hellaswag')]
    handles += [Line2D([], [], color='0.3', label=f"{k.replace(' (per iter)', ' loss (per iter)')}",
                       **{**STYLES[k], 'alpha': 1}) for k in kinds]
    if any('ref_val_low' in r for _, _, evals, _ in runs for r in evals):
        handles.append(Patch(color='0.3', label=BAND, **BAND_STYLE))
    fig.legend(handles=handles, loc='outside right upper', frameon=False)
    return fig, counts


def plot(metrics_path, png_path, bpb=False, others=(), x='iter'):
    """ Draw the run of metrics_path (and the runs of the metrics files others) to png_path; returns the
    first run's (iterations, evaluations, HellaSwag scores) drawn. """
    import matplotlib.pyplot as plt
    fig, counts = figure([metrics_path, *others], bpb=bpb, x=x)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return counts


def main():
    cfg = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(cfg)
    png = cfg.output or os.path.join(cfg.out_dir, 'metrics.png')
    check_not_special(png, 'output')  # a FIFO would hang the plot, a device swallow it
    others = [os.path.join(d, 'metrics.jsonl') for d in cfg.compare.split(',') if d]
    n_iter, n_eval, n_hellaswag = plot(os.path.join(cfg.out_dir, 'metrics.jsonl'), png, cfg.bpb, others, cfg.x)
    scores = f" (and {n_hellaswag} HellaSwag scores)" if n_hellaswag else ""
    compared = f", with {len(others)} other run(s)," if others else ""
    unit = " in bits per byte" if cfg.bpb else ""
    axis = {'time': " against wall time", 'tokens': " against tokens"}.get(cfg.x, "")
    print(f"plotted {n_iter} iterations and {n_eval} evaluations{scores}{compared}{unit}{axis} to {png}")


if __name__ == '__main__':
    run_main(main)
