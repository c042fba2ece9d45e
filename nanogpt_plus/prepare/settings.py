"""
What the data/<name>/prepare.py scripts share around their work: the settings several of them take,
declared once with their help (as nanogpt_plus/settings.py declares the training entry points'), and
check_out_dir, the rule of the overwrite setting: a prepare script must not write into a directory
that holds another kind of data.

A directory holds one kind of token files (find_shards refuses a mix): nanoGPT's train.bin/val.bin,
written by data/text, openwebtext, shakespeare and shakespeare_char, or llm.c's token shards
(*train*.bin / *val*.bin), written by data/fineweb. Each writer also rewrites meta.json, so writing
one kind where the other lies would leave shards described by another dataset's meta.json (and a
fineweb run could no longer resume them); and a training run's out_dir (checkpoints, run.lock,
metrics.jsonl) is no dataset directory at all.

Usage (in a prepare script):
    from nanogpt_plus.prepare.settings import CACHE_DIR, NUM_PROC, OVERWRITE, check_out_dir
    DEFAULTS = Schema(Group('the text', ...), Group('output', out_dir=..., overwrite=OVERWRITE, ...))
    config = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(config)                          # a type, choice or range: one line naming the setting
    check_out_dir(config['out_dir'], RAW, config['overwrite'])   # before any work
"""

import fnmatch
import os

from configurator import Setting
from nanogpt_plus.errors import UserError
from nanogpt_plus.shards import RAW_NAMES, is_shard_name

# the two kinds of dataset a prepare script writes
RAW = "raw"
SHARDS = "shards"
KINDS = {RAW: "a train.bin/val.bin dataset", SHARDS: "a dataset of llm.c token shards"}
# how a .txt file is cut into documents (datasets' text builder)
SAMPLE_BY = ("line", "paragraph", "document")

# the files that make a directory a training run's out_dir (train.py, finetune.py): its checkpoints
# (ckpt.pt, ckpt_best.pt, ckpt_<iter>.pt), the lock of a live run (nanogpt_plus/out_dir.py's
# LOCK_NAME: not imported, it would bring torch into every prepare script's workers) and the metrics
# log
CHECKPOINTS = "ckpt*.pt"
RUN_FILES = ("run.lock", "metrics.jsonl")
# a dataset's description; tokenizer.json stays (it may be our input)
DATASET_META = ("meta.json", "meta.pkl")


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
    False, "True: write even where out_dir holds another kind of dataset (which is replaced) or a "
    "training run's files",
    kind=bool)


def out_dir_setting(default, outputs):
    """ A script's out_dir: its own default, and the files it writes there. """
    return Setting(default, f"where {outputs} go", not_empty=True)


# -----------------------------------------------------------------------------
# the out_dir check

def check_out_dir(out_dir, writes, overwrite=False):
    """
    Refuse (one-line UserError) to write a dataset of kind `writes` (RAW or SHARDS) into an out_dir
    that holds the other kind of dataset or a training run's files; the same kind again (a re-run, a
    resumed fineweb run) is fine. With overwrite the directory is taken: the other kind's token
    files and meta are removed, so the new dataset replaces it (a loader refuses a directory with
    both kinds), and a run's files are left alone.
    """
    if not os.path.isdir(out_dir):
        return
    names = sorted(os.listdir(out_dir))
    run_files = [n for n in names if fnmatch.fnmatch(n, CHECKPOINTS) or n in RUN_FILES]
    other = other_dataset(names, writes)
    if overwrite:
        if other:
            for name in other + [n for n in DATASET_META if n in names]:
                os.remove(os.path.join(out_dir, name))
            print(
                f"--overwrite=True: removed {KINDS[other_kind(writes)]} from {out_dir} ({len(other)} token "
                f"files and its meta)")
        return
    if run_files:
        raise UserError(
            f"{out_dir} holds a training run's files ({listed(run_files)}), not a dataset; pass "
            f"another --out_dir, or --overwrite=True to write the dataset beside them")
    if other:
        raise UserError(
            f"{out_dir} holds {KINDS[other_kind(writes)]} ({listed(other)}) and this script writes "
            f"{KINDS[writes]}; pass --overwrite=True to replace it, or another --out_dir")


def other_dataset(names, writes):
    """ The token files among names that belong to the kind of dataset other than `writes`. """
    if writes == RAW:
        return [n for n in names if is_shard_name(n)]
    if writes == SHARDS:
        return [n for n in names if n in RAW_NAMES]
    raise ValueError(f"writes must be {RAW!r} or {SHARDS!r}, got {writes!r}")


def other_kind(writes):
    return SHARDS if writes == RAW else RAW


def listed(names, most=2):
    """ 'a, b, ...': the first names of a list, enough to recognise it. """
    return ", ".join(names[:most]) + (", ..." if len(names) > most else "")
