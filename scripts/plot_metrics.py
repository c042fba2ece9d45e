"""
Plot a training run's metrics.jsonl (written by train.py into its out_dir) to a PNG: training loss per
iteration, train/val loss at each evaluation, the in-loop HellaSwag acc_norm (hellaswag_interval > 0: on a
second axis beside the losses), and the learning rate.

Usage:
$ python scripts/plot_metrics.py --out_dir=out-shakespeare-char-cpu   # writes its metrics.png
$ python scripts/plot_metrics.py --out_dir=out --output=loss.png
"""

import os

from configurator import Group, Schema, Setting, configure
from nanogpt_plus.errors import UserError
from nanogpt_plus.metrics import read_metrics
from nanogpt_plus.runtime import run_main

DEFAULTS = Schema(Group(
    'plot',
    out_dir=Setting('out', "the training run's directory, whose metrics.jsonl is plotted", not_empty=True),
    output=Setting('', "the PNG to write ('' = out_dir/metrics.png)"),
))


def iterations_and_evaluations(path):
    """ (iteration records, eval records, hellaswag records) of the run's true trajectory (a resume's replace
    what it repeats). """
    if not os.path.isfile(path):
        raise UserError(f"no metrics file at {path}; train.py writes one (metrics.jsonl) into its out_dir")
    records = read_metrics(path)
    return tuple([r for r in records if r.get('type') == kind] for kind in ('iter', 'eval', 'hellaswag'))


def plot_hellaswag(ax_loss, scores):
    """ acc_norm at each in-loop HellaSwag scoring, on its own axis (0-1 scale) to the right of the losses. """
    ax = ax_loss.twinx()
    ax.plot([r['iter'] for r in scores], [r['acc_norm'] for r in scores], 's-', color='tab:red',
            label='hellaswag acc_norm')
    ax.set_ylabel('hellaswag acc_norm')
    ax.legend(loc='upper center')


def plot(metrics_path, png_path):
    import matplotlib
    matplotlib.use('Agg')  # no display needed
    import matplotlib.pyplot as plt
    iters, evals, scores = iterations_and_evaluations(metrics_path)
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(8, 7), sharex=True, gridspec_kw={'height_ratios': [3, 1]})
    if iters:
        ax_loss.plot([r['iter'] for r in iters], [r['loss'] for r in iters], lw=0.8, alpha=0.6,
                     label='train (per iter)')
        ax_lr.plot([r['iter'] for r in iters], [r['lr'] for r in iters], color='tab:gray')
    if evals:
        ax_loss.plot([r['iter'] for r in evals], [r['train_loss'] for r in evals], 'o-', label='train (eval)')
        ax_loss.plot([r['iter'] for r in evals], [r['val_loss'] for r in evals], 'o-', label='val (eval)')
    if scores:
        plot_hellaswag(ax_loss, scores)
    ax_loss.set_ylabel('loss')
    ax_loss.legend()
    ax_loss.grid(alpha=0.3)
    ax_lr.set_ylabel('learning rate')
    ax_lr.set_xlabel('iteration')
    ax_lr.grid(alpha=0.3)
    fig.suptitle(os.path.dirname(os.path.abspath(metrics_path)))
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return len(iters), len(evals), len(scores)


def main():
    cfg = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(cfg)
    png = cfg['output'] or os.path.join(cfg['out_dir'], 'metrics.png')
    n_iter, n_eval, n_hellaswag = plot(os.path.join(cfg['out_dir'], 'metrics.jsonl'), png)
    scores = f" (and {n_hellaswag} HellaSwag scores)" if n_hellaswag else ""
    print(f"plotted {n_iter} iterations and {n_eval} evaluations{scores} to {png}")


if __name__ == '__main__':
    run_main(main)
