"""
Where a script's output may go: the one rule every output path a user names is checked against
(eval.py
--output_file, export_hf.py --hf_dir, finetune.py --predict_out), before any work, so that nothing is computed
for an output that is then refused.

An output path names something the user has (a setting they typed, a default beside their files), so
check_output refuses one that would replace a checkpoint, a dataset's files, a directory holding
them, a file the run reads, or any other existing file that is not an earlier output of the same
kind (an eval result, a predictions file: recognised by what they hold), unless --overwrite=True. A
run's lock (run.lock) is never an output: replacing it would let a second run into a live run's
out_dir; and a live run's out_dir (its lock held) takes no output at all, overwrite or not: the
run's files are its own until it ends. Re-running a script replaces its own earlier output.

Usage:
    from nanogpt_plus.outputs import check_output
    check_output('out/eval.json', 'output_file', overwrite=False, kind='eval result')   # refused in one line
"""

import json
import os
import sys
import zipfile

from nanogpt_plus.errors import UserError
from nanogpt_plus.out_dir import LOCK_NAME, live_holder

# what an output never replaces unprompted: checkpoints (ckpt.pt, snapshots, a Hugging Face
# pytorch_model.bin, any file torch.save wrote) and a dataset's files: its token files (nanoGPT's
# train.bin/val.bin, llm.c's shards; all .bin), and beside them the meta and tokenizer.json that say
# how to read them. They cost hours to remake.
CHECKPOINT_SUFFIX = '.pt'
TOKEN_SUFFIX = '.bin'
DATASET_DESCRIPTIONS = ('meta.json', 'meta.pkl', 'tokenizer.json')
ZIP_MAGIC = b'PK\x03\x04'
# torch.save's legacy (non-zip) format starts with its magic number, pickled: protocol 2, a 10-byte
# long
LEGACY_TORCH_MAGIC = b'\x80\x02\x8a\x0a' + (0x1950a86a20f9469cfc6c).to_bytes(10, 'little')
# the kinds of file output the scripts write, each told by its records (JSON lines): what may be
# replaced
OUTPUT_KINDS = {
    'eval result':
    lambda records: len(records) == 1 and {'task', 'metrics', 'source'} <= records[0].keys(),
    'predictions':
    lambda records: bool(records) and all({'prediction', 'probs'} <= r.keys() for r in records),
}
# an earlier output is read to be recognised: files beyond this size are not one
RECOGNISE_BYTES = 1 << 28


def torch_saved(path):
    """
    Whether the file at path was written by torch.save: a zip holding a data.pkl, or the legacy
    format.
    """
    try:
        with open(path, 'rb') as f:
            head = f.read(len(LEGACY_TORCH_MAGIC))
        if head.startswith(ZIP_MAGIC):
            with zipfile.ZipFile(path) as z:  # reads the zip's directory only
                return any(n == 'data.pkl' or n.endswith('/data.pkl') for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False  # unreadable, or a zip of something else: not a checkpoint we could tell apart
    return head == LEGACY_TORCH_MAGIC


def protected(path):
    """
    What the existing file at path is, if an output must not replace it ('the checkpoint x'), else
    None.
    """
    name = os.path.basename(path)
    if name.endswith(CHECKPOINT_SUFFIX) or torch_saved(path):
        return f"the checkpoint {path}"
    if name.endswith(TOKEN_SUFFIX):
        return f"the token file {path}"
    if name in DATASET_DESCRIPTIONS and _holds_token_files(os.path.dirname(path) or '.'):
        return f"the dataset file {path}"
    return None


def earlier_output(path, kind):
    """
    Whether the file at path is an earlier output of this kind (OUTPUT_KINDS): JSON objects, one per
    line.
    """
    try:
        if os.path.getsize(path) > RECOGNISE_BYTES:
            return False
        with open(path, encoding='utf-8') as f:
            records = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError, RecursionError):
        return False  # unreadable, not text, not JSON lines: not one of ours
    return all(isinstance(r, dict) for r in records) and OUTPUT_KINDS[kind](records)


def _whose(path):
    """
    ' of the run in d' / ' of the dataset in d' for a file in a run's out_dir or a dataset's
    directory.
    """
    directory = os.path.dirname(os.path.abspath(path))
    try:
        names = set(os.listdir(directory))
    except OSError:
        return ''
    if names & {LOCK_NAME, 'metrics.jsonl'} or any(
            n.startswith('ckpt') and n.endswith('.pt') for n in names):
        return f" of the run in {directory}"
    if any(n.endswith(TOKEN_SUFFIX) for n in names) or names & set(DATASET_DESCRIPTIONS):
        return f" of the dataset in {directory}"
    return ''


def _holds_token_files(directory):
    try:
        return any(n.endswith(TOKEN_SUFFIX) for n in os.listdir(directory))
    except OSError:
        return False


def _protected_in(directory):
    """ The first file directly in directory that protected() names, or None. """
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        # .x.tmp.<pid>: a writer's temp file, not data
        if os.path.isfile(path) and not name.startswith('.'):
            what = protected(path)
            if what:
                return what
    return None


def _same(a, b):
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False  # one of them doesn't exist: nothing to replace


def _check_writable(path, setting, kind):
    """
    The output can be made: the nearest existing directory on its way is a directory this user may
    write.
    """
    place = path if kind == 'directory' else os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(place):
        place = os.path.dirname(os.path.abspath(place))  # makedirs creates the rest
    if not os.path.isdir(place):
        raise UserError(
            f"--{setting}={path} is inside {place}, which is a file, not a directory; pass another "
            f"--{setting}")
    if not os.access(place, os.W_OK | os.X_OK):
        raise UserError(
            f"--{setting}={path}: this user may not write in {place}; fix its permissions or pass "
            f"another --{setting}")


def _conflict(path, kind, inputs, earlier, output_kind=None):
    """ What writing the output at path would replace (check_output's words), or None. """
    if kind == 'file':
        # a .pt name is a checkpoint's even before one is there: finetune.py writes its ckpt.pt
        # after the check
        if path.endswith(CHECKPOINT_SUFFIX):
            exists = os.path.exists(path)
            return f"would replace the checkpoint {path}" if exists else "is named like a checkpoint (*.pt)"
        what = protected(path) if os.path.isfile(path) else None
        if what:
            return f"would replace {what}"
        if output_kind and os.path.isfile(path) and not earlier_output(path, output_kind):
            return f"would replace {path}, a file{_whose(path)} that is not an earlier {output_kind}"
    elif os.path.isdir(path):
        what = _protected_in(path)
        # its files would be replaced (a dataset's tokenizer.json) or mixed with an export's
        if what:
            return f"would write into {path}, which holds {what}"
        # files of some other kind: the script's fixed names (README.md, config.json) may be among
        # them
        if earlier and not all(os.path.isfile(os.path.join(path, n)) for n in earlier) and \
                any(not n.startswith('.') for n in os.listdir(path)):
            return (
                f"would write into {path}, which holds files and no earlier output of this script "
                f"({' and '.join(earlier)})")
    for name, source in (inputs or {}).items():
        if source and _same(source, path):
            return f"would {'replace' if kind == 'file' else 'write into'} the --{name} this run reads, {source}"
    return None


def check_output(path, setting, overwrite, kind='file', inputs=None, earlier=(), output_kind=None):
    """
    Refuse, in one line naming setting, an output path (kind 'file', or 'directory' for one written
    into) that would replace a checkpoint or a dataset's file (protected), an existing file that is
    not an earlier output_kind (OUTPUT_KINDS: the file output the script writes), write into a
    directory holding a protected file (or, given earlier: the names an earlier output of the script
    there holds, into a directory of other files), or replace one of inputs ({setting: path} the run
    reads), unless overwrite (None: the script has no --overwrite, and its advice names none);
    and, overwrite or not, a run's lock, an output into a live run's out_dir or an output that
    can't be written at all. Call it before the work, so nothing is computed for an output that is
    then refused. What a script wrote itself (an eval JSON, predictions.jsonl, an export directory)
    is none of these: re-running replaces it.
    """
    if os.path.basename(os.path.normpath(path)) == LOCK_NAME:
        raise UserError(
            f"--{setting}={path} is a run's lock ({LOCK_NAME}), which no output may replace (a second "
            f"run could then start beside a live one); pass another --{setting}")
    directory = path if kind == 'directory' else os.path.dirname(os.path.abspath(path))
    holder = live_holder(directory) if os.path.isdir(directory) else None
    if holder is not None:
        raise UserError(
            f"--{setting}={path} is in the out_dir of a live run (pid {holder.get('pid')} on "
            f"{holder.get('host')}, started {holder.get('started')}), which no output may change, "
            f"--overwrite=True or not; wait for the run to end, or pass another --{setting}")
    if kind == 'directory' and os.path.isfile(path):
        raise UserError(
            f"--{setting}={path} is a file, not a directory; pass a directory (a new one, or an "
            f"earlier output of this script)")
    if kind == 'file' and os.path.isdir(path):
        raise UserError(f"--{setting}={path} is a directory; pass a file path")
    _check_writable(path, setting, kind)
    conflict = _conflict(path, kind, inputs, earlier, output_kind)
    if conflict is None:
        return
    if overwrite is None:  # a script without --overwrite (bench.py): never replaced
        raise UserError(f"--{setting}={path} {conflict}; pass another --{setting}")
    if not overwrite:
        raise UserError(
            f"--{setting}={path} {conflict}; pass another --{setting}, or --overwrite=True to write "
            f"there anyway")
    print(f"warning: --{setting}={path} {conflict} (overwrite=True)", file=sys.stderr)
