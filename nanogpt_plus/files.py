"""
Files on disk: the one atomic writer every output goes through (datasets, checkpoints, exports, eval
results), the one rule for where an output may go (check_output), and reading JSONL files with one-line errors.

An output is written under a hidden temporary name beside it (.train.bin.tmp.<pid>, .ckpt.pt.tmp.<pid>),
fsynced, and renamed over the real name only when complete, so a crash at any moment leaves either the old
complete file or the new one, never a file that looks finished but isn't. Several outputs of one run
(train.bin, val.bin, meta.json) are renamed together, after all of them are on disk.

Usage:
    from nanogpt_plus.files import atomic_outputs, atomic_write, read_jsonl
    atomic_write('out/ckpt.pt', lambda f: torch.save(ckpt, f))        # one file
    with atomic_outputs('data/mine') as out:                          # several, renamed together
        ids.tofile(out.path('train.bin'))
        ...
    records = read_jsonl('val.jsonl', required_keys=('text',))        # [(line number, dict)]
    check_output('out/eval.json', 'output_file', overwrite=False)     # before the work: refused in one line

An output path names something the user has (a setting they typed, a default beside their files), so before
any work check_output refuses one that would replace a checkpoint, a dataset's files, a directory holding
them, or a file the run reads, unless --overwrite=True; an earlier output of the same script is none of
these, so re-running replaces it.
"""

import glob
import json
import os
import re
import sys
import zipfile
from contextlib import contextmanager

from nanogpt_plus.errors import UserError

# -----------------------------------------------------------------------------
# atomic outputs

class WriteFailed(UserError, OSError):
    """
    An output could not be written (a full disk, a quota, a read-only or unwritable directory): one line for
    the user, and still an OSError (with the OS's errno and strerror) for a caller that handles a failed
    write with advice of its own (train.py's checkpoints: resume from the last one).
    """

    def __init__(self, message, cause):
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.message = message

    def __str__(self):
        return self.message


def write_failed(error, final):
    """ The WriteFailed for an OSError met while writing final (whose previous version, if any, is kept). """
    reason = error.strerror or str(error)
    if os.path.isdir(final):  # the output directory itself could not be made
        kept = "nothing was written"
    else:
        kept = f"the previous {final} is unchanged" if os.path.exists(final) else f"no {final} was written"
    return WriteFailed(f"could not write {final} ({reason}); {kept}. Make room on the disk (or fix the "
                       f"directory's permissions, or write somewhere else) and run again", error)


def _is_write_error(error, directory):
    """ Whether an OSError raised inside atomic_outputs is about its outputs (not, say, an input file read there). """
    if isinstance(error, UserError):
        return False  # already one line (a WriteFailed of a nested writer, say)
    return error.filename is None or os.path.abspath(error.filename).startswith(os.path.abspath(directory))


def temp_path(final):
    """ The hidden name this process writes final under: same directory (so os.replace is atomic), pid last. """
    directory, name = os.path.split(final)
    return os.path.join(directory, f".{name}.tmp.{os.getpid()}")


class AtomicOutputs:
    """ Temp paths for a run's outputs; commit() renames all of them over the real names, discard() drops them. """

    def __init__(self, directory):
        self.directory = directory
        self.pending = []  # (temp path, final path), in the order they were asked for
        self.writing = directory  # the output being written (for error messages)

    def path(self, name):
        """ Where to write the output called name (a path inside directory); it appears at commit(). """
        final = os.path.join(self.directory, name)
        remove_stale_temps(final)
        tmp = temp_path(final)
        self.pending.append((tmp, final))
        self.writing = final  # outputs are written in the order they are asked for: a failure is this one's
        return tmp

    def commit(self):
        # every file's data reaches the disk before the first rename, so no final name ever points at
        # a half-written file, even after a power cut between two renames
        for tmp, final in self.pending:
            self.writing = final  # a full disk can surface only now, as fsync writes out the cached pages
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        for tmp, final in self.pending:
            self.writing = final
            os.replace(tmp, final)
        self.pending = []
        _fsync_dir(self.directory)  # and the renames themselves are made durable

    def discard(self):
        for tmp, _ in self.pending:
            if os.path.exists(tmp):
                os.remove(tmp)
        self.pending = []


@contextmanager
def atomic_outputs(directory):
    """
    with atomic_outputs(d) as out: write to out.path('train.bin'), ...; all are renamed at a clean exit. An
    OSError writing them (ENOSPC, EDQUOT, EFBIG, EROFS, EACCES, ...) becomes one WriteFailed naming the file.
    """
    out = AtomicOutputs(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        yield out
        out.commit()
    except OSError as e:
        if not _is_write_error(e, directory):
            raise
        raise write_failed(e, out.writing) from None
    finally:
        out.discard()  # after an error (or Ctrl-C) the temp files go; the old outputs stay as they were


def atomic_write(path, write_fn, binary=True):
    """ One atomic output: write_fn(f) fills the file object of a temp file, which then replaces path. """
    directory, name = os.path.split(os.path.abspath(path))
    with atomic_outputs(directory) as out:
        with open(out.path(name), "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write_fn(f)


def remove_stale_temps(final):
    """ Delete the temp files an earlier run killed mid-write left for final (their process no longer exists). """
    directory, name = os.path.split(final)
    _remove_stale(glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.tmp.*")))


def remove_stale_temps_in(directory):
    """
    Delete every temp file of a dead process in directory (a kill -9 mid-save leaves a full-size
    .ckpt.pt.tmp.<pid>); returns their names. For a directory only one run writes to (its out_dir, locked).
    """
    return _remove_stale(glob.glob(os.path.join(glob.escape(directory), ".*.tmp.*")))


def _remove_stale(temps):
    removed = []
    for tmp in temps:
        pid = tmp.rsplit(".", 1)[-1]
        # a live pid may be another run writing the same output right now: leave its file alone
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            try:
                os.remove(tmp)
            except FileNotFoundError:
                continue  # another process removed it first
            removed.append(os.path.basename(tmp))
    return removed


def _pid_alive(pid):
    try:
        os.kill(pid, 0)  # signal 0 delivers nothing; it only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, it just belongs to another user
    return True


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return  # not possible on every platform (e.g. Windows); the rename is still atomic
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -----------------------------------------------------------------------------
# where an output may go

# what an output never replaces unprompted: checkpoints (ckpt.pt, snapshots, a Hugging Face pytorch_model.bin,
# any file torch.save wrote) and a dataset's files: its token files (nanoGPT's train.bin/val.bin, llm.c's shards;
# all .bin), and beside them the meta and tokenizer.json that say how to read them. They cost hours to remake.
CHECKPOINT_SUFFIX = '.pt'
TOKEN_SUFFIX = '.bin'
DATASET_DESCRIPTIONS = ('meta.json', 'meta.pkl', 'tokenizer.json')
ZIP_MAGIC = b'PK\x03\x04'
# torch.save's legacy (non-zip) format starts with its magic number, pickled: protocol 2, a 10-byte long
LEGACY_TORCH_MAGIC = b'\x80\x02\x8a\x0a' + (0x1950a86a20f9469cfc6c).to_bytes(10, 'little')


def torch_saved(path):
    """ Whether the file at path was written by torch.save: a zip holding a data.pkl, or the legacy format. """
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
    """ What the existing file at path is, if an output must not replace it ('the checkpoint x'), else None. """
    name = os.path.basename(path)
    if name.endswith(CHECKPOINT_SUFFIX) or torch_saved(path):
        return f"the checkpoint {path}"
    if name.endswith(TOKEN_SUFFIX):
        return f"the token file {path}"
    if name in DATASET_DESCRIPTIONS and _holds_token_files(os.path.dirname(path) or '.'):
        return f"the dataset file {path}"
    return None


def _holds_token_files(directory):
    try:
        return any(n.endswith(TOKEN_SUFFIX) for n in os.listdir(directory))
    except OSError:
        return False


def _protected_in(directory):
    """ The first file directly in directory that protected() names, or None. """
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and not name.startswith('.'):  # .x.tmp.<pid>: a writer's temp file, not data
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
    """ The output can be made: the nearest existing directory on its way is a directory this user may write. """
    place = path if kind == 'directory' else os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(place):
        place = os.path.dirname(os.path.abspath(place))  # makedirs creates the rest
    if not os.path.isdir(place):
        raise UserError(f"--{setting}={path} is inside {place}, which is a file, not a directory; pass another "
                        f"--{setting}")
    if not os.access(place, os.W_OK | os.X_OK):
        raise UserError(f"--{setting}={path}: this user may not write in {place}; fix its permissions or pass "
                        f"another --{setting}")


def _conflict(path, kind, inputs, earlier):
    """ What writing the output at path would replace (check_output's words), or None. """
    if kind == 'file':
        # a .pt name is a checkpoint's even before one is there: finetune.py writes its ckpt.pt after the check
        if path.endswith(CHECKPOINT_SUFFIX):
            exists = os.path.exists(path)
            return f"would replace the checkpoint {path}" if exists else "is named like a checkpoint (*.pt)"
        what = protected(path) if os.path.isfile(path) else None
        if what:
            return f"would replace {what}"
    elif os.path.isdir(path):
        what = _protected_in(path)
        if what:  # its files would be replaced (a dataset's tokenizer.json) or mixed with an export's
            return f"would write into {path}, which holds {what}"
        # files of some other kind: the script's fixed names (README.md, config.json) may be among them
        if earlier and not all(os.path.isfile(os.path.join(path, n)) for n in earlier) and \
                any(not n.startswith('.') for n in os.listdir(path)):
            return (f"would write into {path}, which holds files and no earlier output of this script "
                    f"({' and '.join(earlier)})")
    for name, source in (inputs or {}).items():
        if source and _same(source, path):
            return f"would {'replace' if kind == 'file' else 'write into'} the --{name} this run reads, {source}"
    return None


def check_output(path, setting, overwrite, kind='file', inputs=None, earlier=()):
    """
    Refuse, in one line naming setting, an output path (kind 'file', or 'directory' for one written into)
    that would replace a checkpoint or a dataset's file (protected), write into a directory holding one (or,
    given earlier: the names an earlier output of the script there holds, into a directory of other files), or
    replace one of inputs ({setting: path} the run reads), unless overwrite; and one that can't be written at
    all. Call it before the work, so nothing is computed for an output that is then refused. What a script
    wrote itself (an eval JSON, predictions.jsonl, an export directory) is none of these: re-running replaces it.
    """
    if kind == 'directory' and os.path.isfile(path):
        raise UserError(f"--{setting}={path} is a file, not a directory; pass a directory (a new one, or an "
                        f"earlier output of this script)")
    if kind == 'file' and os.path.isdir(path):
        raise UserError(f"--{setting}={path} is a directory; pass a file path")
    _check_writable(path, setting, kind)
    conflict = _conflict(path, kind, inputs, earlier)
    if conflict is None:
        return
    if not overwrite:
        raise UserError(f"--{setting}={path} {conflict}; pass another --{setting}, or --overwrite=True to write "
                        f"there anyway")
    print(f"warning: --{setting}={path} {conflict} (overwrite=True)", file=sys.stderr)


# -----------------------------------------------------------------------------
# reading

def read_jsonl(path, required_keys=(), missing_hint="pass an existing JSONL file"):
    """
    [(line number, record dict)] of a JSONL file (blank lines skipped). A missing or empty file, a line
    that is not a JSON object, or a record without one of required_keys is one UserError naming the line.
    """
    if not path or not os.path.isfile(path):
        raise UserError(f"no data file at {path or '(none given)'}; {missing_hint}")
    records = []
    with open(path, 'rb') as f:  # bytes: a line that is not UTF-8 is reported with its number
        for lineno, raw in enumerate(f, 1):
            line = _utf8_line(raw, path, lineno)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise UserError(f"{path} line {lineno} is not valid JSON ({e}); fix or remove that line") from None
            if not isinstance(record, dict):
                raise UserError(f"{path} line {lineno} is not a JSON object; write one object per line")
            missing = [k for k in required_keys if k not in record]
            if missing:
                raise UserError(f"{path} line {lineno} has no {', '.join(repr(k) for k in missing)} field; "
                                f"each line needs {', '.join(required_keys)}")
            records.append((lineno, record))
    if not records:
        raise UserError(f"{path} has no examples; write one JSON object per line")
    return records


def _utf8_line(raw, path, lineno):
    """ One line of a JSONL file as text (JSON is UTF-8, RFC 8259); anything else is the user's to re-encode. """
    try:
        return raw.decode('utf-8')
    except UnicodeDecodeError as e:
        raise UserError(f"{path} line {lineno} is not UTF-8 text (byte {raw[e.start]:#04x} at position {e.start + 1}); "
                        f"save the file as UTF-8") from None


def load_error(path, error):
    """
    The one line for a file torch.load refused (a ckpt.pt, a Hugging Face pytorch_model.bin): a pickled Python
    object (unsafe), else corrupt. Never torch's own text around it, which advises loading with
    weights_only=False, i.e. running the file's code.
    """
    text = str(error)
    # torch names the global it refused: 'Unsupported global: GLOBAL x.y' or 'unsupported GLOBAL x.y whose ...'
    found = re.search(r"unsupported (?:global: )?GLOBAL (\S+)", text, re.IGNORECASE)
    if found:
        return UserError(f"checkpoint {path} holds a pickled Python object ({found.group(1)}) that loading could "
                         f"run as code; this project loads only tensors and plain values. Use a checkpoint written "
                         f"by this project, or re-save the file's tensors with torch.save in a trusted session")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and 'weights_only' not in ln]
    detail = next((ln for ln in lines if not ln.startswith(('Please file', 'Check the documentation'))), '')
    detail = detail.split('. ')[0].rstrip('.')[:200]  # its first sentence: what failed, not torch's guesses why
    return UserError(f"checkpoint {path} is corrupt or truncated ({type(error).__name__}: {detail}); "
                     f"use another checkpoint")
