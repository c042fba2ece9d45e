"""
The settings several data/<name>/prepare.py scripts take, declared once with their help (as
nanogpt_plus/settings.py declares the training entry points'). Where a prepare script may write (another
kind of dataset, another dataset, a training run's out_dir) is nanogpt_plus/outputs.py's rule
(check_out_dir, check_same_dataset).

Usage (in a prepare script):
    from nanogpt_plus.outputs import RAW, check_out_dir
    from nanogpt_plus.prepare.settings import CACHE_DIR, NUM_PROC, OVERWRITE
    DEFAULTS = Schema(Group('the text', ...), Group('output', out_dir=..., overwrite=OVERWRITE, ...))
    config = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(config)                          # a type, choice or range: one line naming the setting
    check_out_dir(config['out_dir'], RAW, config['overwrite'])   # before any work
"""

import os

from configurator import Setting

# how a .txt file is cut into documents (datasets' text builder)
SAMPLE_BY = ("line", "paragraph", "document")


def default_num_proc():
    """ Half the CPU threads, 1 to 8: cpu_count() counts hyperthreads, and BPE encoding gains little from a
    core's second. """
    return max(1, min(8, (os.cpu_count() or 2) // 2))


NUM_PROC = Setting(default_num_proc(),
                   "tokenizer worker processes (default: half the CPU threads, 1 to 8)",
                   low=1)
TEXT_COLUMN = Setting('text',
                      "the column holding the documents (.jsonl / .json / .parquet / Hub datasets)",
                      not_empty=True)
CACHE_DIR = Setting(
    '', "Hugging Face datasets cache ('' = its default, ~/.cache/huggingface/datasets)")
SEED = Setting(2357, "the shuffle that picks the val documents (nanoGPT's seed)", low=0)
OVERWRITE = Setting(
    False, "True: write even where out_dir holds another dataset (which is replaced) or a "
    "training run's files (never a live run's)",
    kind=bool)


def out_dir_setting(default, outputs):
    """ A script's out_dir: its own default, and the files it writes there. """
    return Setting(default, f"where {outputs} go", not_empty=True)
