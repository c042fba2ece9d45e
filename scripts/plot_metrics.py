"""
Plot a training run's metrics.jsonl (written by train.py into its out_dir) to a PNG: training loss per
iteration, train/val loss at each evaluation, the in-loop HellaSwag acc_norm (hellaswag_interval > 0: on a
second axis beside the losses), and the learning rate. --bpb draws bits per byte instead of nats per token,
which doesn't depend on the tokenizer, so runs with different ones (a character model, a GPT-2 BPE one)
share the axis; --compare adds other runs to the same axes.

Usage:
$ python scripts/plot_metrics.py --out_dir=out-shakespeare-char-cpu   # writes its metrics.png
$ python scripts/plot_metrics.py --out_dir=out --output=loss.png
$ python scripts/plot_metrics.py --out_dir=out-shakespeare-char-cpu --compare=out-shakespeare --bpb=True
"""

import math
import os

from configurator import Group, Schema, Setting, configure
from nanogpt_plus.errors import UserError
from nanogpt_plus.metrics import read_metrics
from nanogpt_plus.runtime import run_main
from nanogpt_plus.settings import flag

DEFAULTS = Schema(Group(
    'plot',
    out_dir=Setting('out', "the training run's directory, whose metrics.jsonl is plotted", not_empty=True),
    output=Setting('', "the PNG to write ('' = out_dir/metrics.png)"),
    bpb=flag(False, "bits per byte (loss / ln 2 / the split's bytes per token, as train.py logs it) instead of "
                    "the loss in nats per token: comparable across tokenizers"),
    compare=Setting('', "other runs' out_dirs, comma-separated, drawn on the same axes"),
))


def iterations_and_evaluations(path):
    """ (iteration records, eval records, hellaswag records) of the run's true trajectory (a resume's replace
    what it repeats). """
    return tuple([r for r in run_records(path) if r.get('type') == kind] for kind in ('iter', 'eval', 'hellaswag'))


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
    evals = [dict(r, train_loss=r.get('train_bpb', math.nan), val_loss=r['val_bpb']) for r in evals]
    return iters, evals


def plot_hellaswag(ax_loss, scores):
    """ acc_norm at each in-loop HellaSwag scoring, on its own axis (0-1 scale) to the right of the losses. """
    ax = ax_loss.twinx()
    ax.plot([r['iter'] for r in scores], [r['acc_norm'] for r in scores], 's-', color='tab:red',
            label='hellaswag acc_norm')
    ax.set_ylabel('hellaswag acc_norm')
    ax.legend(loc='upper center')


def plot_run(ax_loss, ax_lr, iters, evals, name):
    """ One run's curves; name prefixes its labels when several runs share the axes. """
    prefix = f"{name}: " if name else ""
    if iters:
        ax_loss.plot([r['iter'] for r in iters], [r['loss'] for r in iters], lw=0.8, alpha=0.6,
                     label=f'{prefix}train (per iter)')
        ax_lr.plot([r['iter'] for r in iters], [r['lr'] for r in iters], label=name or None)
    if evals:
        ax_loss.plot([r['iter'] for r in evals], [r['train_loss'] for r in evals], 'o-', label=f'{prefix}train (eval)')
        ax_loss.plot([r['iter'] for r in evals], [r['val_loss'] for r in evals], 'o-', label=f'{prefix}val (eval)')


def plot(metrics_path, png_path, bpb=False, others=()):
    """ Draw the run of metrics_path (and the runs of the metrics files others) to png_path; returns the
    first run's (iterations, evaluations, HellaSwag scores) drawn. """
    import matplotlib
    matplotlib.use('Agg')  # no display needed
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={'height_ratios': [3, 1]})
    paths = [metrics_path, *others]
    counts = None
    for path in paths:
        iters, evals, scores = iterations_and_evaluations(path)
        if counts is None:
            counts = (len(iters), len(evals), len(scores))
        if bpb:
            iters, evals = in_bits_per_byte(path, iters, evals)
        name = os.path.basename(os.path.dirname(os.path.abspath(path))) if others else ''
        plot_run(ax_loss, ax_lr, iters, evals, name)
        if scores and path == metrics_path:
            plot_hellaswag(ax_loss, scores)
    ax_loss.set_ylabel('bits per byte' if bpb else 'loss')
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_lr.set_ylabel('learning rate')
    ax_lr.set_xlabel('iteration')
    ax_lr.grid(alpha=0.3)
    fig.suptitle(', '.join(os.path.dirname(os.path.abspath(p)) for p in paths))
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return counts


def main():
    cfg = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(cfg)
    png = cfg.output or os.path.join(cfg.out_dir, 'metrics.png')
    others = [os.path.join(d, 'metrics.jsonl') for d in cfg.compare.split(',') if d]
    n_iter, n_eval, n_hellaswag = plot(os.path.join(cfg.out_dir, 'metrics.jsonl'), png, cfg.bpb, others)
    scores = f" (and {n_hellaswag} HellaSwag scores)" if n_hellaswag else ""
    compared = f", with {len(others)} other run(s)," if others else ""
    unit = " in bits per byte" if cfg.bpb else ""
    print(f"plotted {n_iter} iterations and {n_eval} evaluations{scores}{compared}{unit} to {png}")


if __name__ == '__main__':
    run_main(main)
