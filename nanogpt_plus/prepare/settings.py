"""
What the data/<name>/prepare.py scripts share around their work (their shared settings are declared
with the entry points' in the package's settings.py): check_out_dir and check_same_dataset, the rule
of the overwrite setting: a prepare script must not write into a directory that holds another kind
of data, another dataset or a live run.

A directory holds one kind of token files (find_shards refuses a mix): nanoGPT's train.bin/val.bin,
written by data/text, openwebtext, shakespeare and shakespeare_char, or llm.c's token shards
(*train*.bin / *val*.bin), written by data/fineweb. Each writer also rewrites meta.json, so writing
one kind where the other lies would leave shards described by another dataset's meta.json (and a
fineweb run could no longer resume them); and a training run's out_dir (checkpoints, run.lock,
metrics.jsonl) is no dataset directory at all.

Usage (in a prepare script):
    from nanogpt_plus.prepare.settings import check_out_dir
    DEFAULTS = Schema(Group('the text', ...), Group('output', overwrite=settings.dataset_overwrite(False), ...))
    config = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(config)                          # a type, choice or range: one line naming the setting
    check_out_dir(config.out_dir, RAW, config.overwrite)   # before any work
"""

import fnmatch
import hashlib
import json
import os

from nanogpt_plus.dataset import tokenizer_identity
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import flock_held
from nanogpt_plus.shards import RAW_NAMES, is_shard_name

# the two kinds of dataset a prepare script writes
RAW = "raw"
SHARDS = "shards"
KINDS = {RAW: "a train.bin/val.bin dataset", SHARDS: "a dataset of llm.c token shards"}

# the files that make a directory a training run's out_dir (train.py, finetune.py): its checkpoints
# (ckpt.pt, ckpt_best.pt, ckpt_<iter>.pt), the lock of a live run (nanogpt_plus/out_dir.py's
# LOCK_NAME: not imported, it would bring torch into every prepare script's workers) and the metrics
# log
CHECKPOINTS = "ckpt*.pt"
RUN_LOCK = "run.lock"
RUN_FILES = (RUN_LOCK, "metrics.jsonl")
# a dataset's description; tokenizer.json stays (it may be our input)
DATASET_META = ("meta.json", "meta.pkl")


# -----------------------------------------------------------------------------
# the out_dir check

def check_out_dir(out_dir, writes, overwrite=False):
    """
    Refuse (one-line UserError) to write a dataset of kind `writes` (RAW or SHARDS) into an out_dir
    that holds the other kind of dataset or a training run's files; the same kind again (a re-run, a
    resumed fineweb run) is fine. A live run's out_dir (its lock held) is refused, overwrite or not.
    With overwrite the directory is taken: the other kind's token
    files and meta are removed, so the new dataset replaces it (a loader refuses a directory with
    both kinds), and a run's files are left alone.
    """
    if not os.path.isdir(out_dir):
        return
    if flock_held(os.path.join(out_dir, RUN_LOCK)):
        # a live run: its out_dir takes no dataset, overwrite or not (the run could not resume
        # from a directory holding token files)
        raise UserError(
            f"{out_dir} is the out_dir of a live training run (its {RUN_LOCK} is held), which no "
            f"dataset may be written into, --overwrite=True or not; pass another --out_dir")
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


# -----------------------------------------------------------------------------
# the same dataset again, or another one
#
# A train.bin/val.bin dataset's meta.json records its preparation (write_dataset_meta): the corpus
# (its files' real paths and sizes, a Hugging Face dataset's name, or the digest of a text read
# whole), the tokenizer as asked for, and the vocabulary it came out as. A prepare script compares
# its own before it writes: the same preparation again (a re-run) replaces the files; another
# corpus, tokenizer or vocabulary is another dataset, which only --overwrite=True replaces.

def check_same_dataset(out_dir, corpus, tokenizer, tok=None, overwrite=False):
    """
    Refuse (one-line UserError) to replace the train.bin/val.bin dataset in out_dir with another
    one, unless overwrite; returns this preparation's record for meta.json. The record: corpus (a
    dict saying what was read: files with their sizes, a Hub dataset's name, a text's digest), the
    tokenizer as asked for ('gpt2', 'char', ...) and, given the tokenizer itself (tok), its
    vocabulary; those known so far (None: not yet) must match what the dataset's meta.json records:
    a script checks before reading the corpus and again once its tokenizer is made. A dataset that
    records none (an older version's, nanoGPT's, another program's) can't be told apart from
    another, so it is refused too.
    """
    preparation = {"corpus": corpus, "tokenizer": tokenizer,
                   "vocabulary": vocabulary(tok) if tok is not None else None}
    preparation = {k: v for k, v in preparation.items() if v is not None}
    paths = [os.path.join(out_dir, n) for n in RAW_NAMES]
    if not any(os.path.lexists(p) for p in paths):
        return preparation  # no dataset there to lose
    before = recorded_preparation(out_dir)
    differs = [k for k in ("corpus", "tokenizer", "vocabulary")
               if k in preparation and (before is None or before.get(k) != preparation[k])]
    if not differs:
        return preparation
    if overwrite:
        if "vocabulary" in preparation:  # said once, by the check of the whole record
            print(f"--overwrite=True: replacing the dataset in {out_dir} (made from "
                  f"{describe(before)})")
        return preparation
    if before is None:
        what = "a dataset whose preparation is not recorded (an earlier version's or another " \
               "program's), which can't be told from another one"
    else:
        key = differs[0]
        what = (f"another dataset: {describe(before, key)} then, {describe(preparation, key)} "
                f"now")
    raise UserError(
        f"{out_dir} holds {what}; pass --overwrite=True to replace it, or another --out_dir")


def vocabulary(tok):
    """
    A dataset's record of its vocabulary: the size and a digest of what makes the tokenizer itself
    (dataset.tokenizer_identity: GPT-2's, the {character: id} table, the tokenizer.json's content).
    """
    identity = json.dumps(tokenizer_identity(tok.meta()), sort_keys=True, ensure_ascii=False)
    return {"vocab_size": tok.vocab_size,
            "sha256": hashlib.sha256(identity.encode("utf-8")).hexdigest()}


def recorded_preparation(out_dir):
    """ The preparation the meta.json in out_dir records, or None (no meta.json, or none in it). """
    try:
        with open(os.path.join(out_dir, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError, RecursionError):
        return None
    record = meta.get("preparation") if isinstance(meta, dict) else None
    return record if isinstance(record, dict) else None


def describe(preparation, key=None):
    """ Words for a preparation's corpus, tokenizer or vocabulary (key), or for all three. """
    if preparation is None:
        return "an unrecorded preparation"
    if key is None:
        return "; ".join(describe(preparation, k) for k in ("corpus", "tokenizer")
                         if k in preparation)
    value = preparation.get(key)
    if key == "tokenizer":
        return f"the tokenizer {value}"
    if key == "vocabulary":
        if not isinstance(value, dict) or not isinstance(value.get("vocab_size"), int):
            return "an unrecorded vocabulary"
        return (f"a vocabulary of {value['vocab_size']:,} tokens (sha256 "
                f"{str(value.get('sha256'))[:12]})")
    if isinstance(value, dict) and value.get("files"):
        files = value["files"]
        more = f" and {len(files) - 1} more files" if len(files) > 1 else ""
        return f"the corpus {files[0][0]} ({files[0][1]:,} bytes){more}"
    if isinstance(value, dict) and value.get("dataset"):
        config = f" (config {value['config']})" if value.get("config") else ""
        return f"the Hugging Face dataset {value['dataset']}{config}"
    if isinstance(value, dict) and value.get("text_sha256"):
        return (f"a text of {value.get('characters', 0):,} characters (sha256 "
                f"{value['text_sha256'][:12]})")
    return "an unrecorded corpus"
