"""
Files on disk: the one atomic writer every output goes through (datasets, checkpoints, exports, eval
results), reading JSONL files with one-line errors, and the cheap digest that tells two nodes'
copies of a file apart. Where an output may go at all is outputs.py's.

An output is written under a hidden temporary name beside it (.train.bin.nanogpt_plus.tmp.<pid>,
.ckpt.pt.nanogpt_plus.tmp.<pid>), fsynced, and renamed over the real name only when complete, so a
crash at any moment leaves either the old complete file or the new one, never a file that looks
finished but isn't. Several outputs of one run (train.bin, val.bin, meta.json) are renamed together,
after all of them are on disk.

Usage:
    from nanogpt_plus.files import atomic_outputs, atomic_write, read_jsonl
    atomic_write('out/ckpt.pt', lambda f: torch.save(ckpt, f))        # one file
    with atomic_outputs('data/mine') as out:                          # several, renamed together
        ids.tofile(out.path('train.bin'))
        ...
    records = read_jsonl('val.jsonl', required_keys=('text',))        # [(line number, dict)]
"""

import errno
import fcntl
import glob
import json
import os
import shutil
from contextlib import contextmanager

from nanogpt_plus.errors import UserError, special_file
from nanogpt_plus.signals import held, published

# in every temp file's name, so that a sweep for the temps of killed runs removes only files this
# project wrote (a user's own .thesis.tmp.4242 has no such mark)
TEMP_MARK = ".nanogpt_plus.tmp."
# -----------------------------------------------------------------------------
# atomic outputs

class WriteFailed(UserError, OSError):
    """
    An output could not be written (a full disk, a quota, a read-only or unwritable directory): one
    line for the user, and still an OSError (with the OS's errno and strerror) for a caller that
    handles a failed write with advice of its own (train.py's checkpoints: resume from the last
    one).
    """

    def __init__(self, message, cause):
        super().__init__(cause.errno, cause.strerror or str(cause))
        self.message = message

    def __str__(self):
        return self.message


def write_failed(error, final):
    """
    The WriteFailed for an OSError met while writing final (whose previous version, if any, is
    kept).
    """
    reason = error.strerror or str(error)
    if os.path.isdir(final):  # the output directory itself could not be made
        kept = "nothing was written"
    else:
        kept = f"the previous {final} is unchanged" if os.path.exists(
            final) else f"no {final} was written"
    return WriteFailed(
        f"could not write {final} ({reason}); {kept}. Make room on the disk (or fix the "
        f"directory's permissions, or write somewhere else) and run again", error)


def _is_write_error(error, directory):
    """
    Whether an OSError raised inside atomic_outputs is about its outputs (not, say, an input file
    read there).
    """
    if isinstance(error, UserError):
        return False  # already one line (a WriteFailed of a nested writer, say)
    return error.filename is None or os.path.abspath(error.filename).startswith(
        os.path.abspath(directory))


def temp_path(final):
    """
    The hidden name this process writes final under: same directory (so os.replace is atomic), pid
    last.
    """
    directory, name = os.path.split(final)
    return os.path.join(directory, f".{name}{TEMP_MARK}{os.getpid()}")


class AtomicOutputs:
    """
    Temp paths for a run's outputs; commit() renames all of them over the real names, discard()
    drops them.
    """

    def __init__(self, directory):
        self.directory = directory
        self.pending = []  # (temp path, final path), in the order they were asked for
        self.writing = directory  # the output being written (for error messages)
        # files of an earlier output that the new one has not: removed at commit()
        self.outdated = []

    def path(self, name):
        """
        Where to write the output called name (a path inside directory); it appears at commit().
        """
        final = os.path.join(self.directory, name)
        remove_stale_temps(final)
        tmp = temp_path(final)
        self.pending.append((tmp, final))
        # outputs are written in the order they are asked for: a failure is this one's
        self.writing = final
        return tmp

    def remove_at_commit(self, name):
        """ A file of an earlier output in directory that this one has not (a bpe dataset's tokenizer.json when the
        new one is char): removed once the new files are in place, so that nothing reads it as theirs. """
        self.outdated.append(os.path.join(self.directory, name))

    def commit(self):
        # every file's data reaches the disk before the first rename, so no final name ever points
        # at a half-written file, even after a power cut between two renames
        for tmp, final in self.pending:
            # a full disk can surface only now, as fsync writes out the cached pages
            self.writing = final
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        # a signal that stops the work (signals.Stopped) waits until every output is renamed and
        # the earlier output's leftovers are gone: never a new train.bin beside an old val.bin
        with held():
            for tmp, final in self.pending:
                self.writing = final
                os.replace(tmp, final)
                # (a file inside atomic_directory's temp is not in place yet: its directory is, later)
                if TEMP_MARK not in os.path.dirname(final):
                    published(final)
            self.pending = []
            for path in self.outdated:
                if os.path.isfile(path):
                    os.remove(path)
        _fsync_dir(self.directory)  # and the renames themselves are made durable

    def discard(self):
        for tmp, _ in self.pending:
            if os.path.exists(tmp):
                os.remove(tmp)
        self.pending = []


@contextmanager
def atomic_outputs(directory):
    """
    with atomic_outputs(d) as out: write to out.path('train.bin'), ...; all are renamed at a clean
    exit. An OSError writing them (ENOSPC, EDQUOT, EFBIG, EROFS, EACCES, ...) becomes one
    WriteFailed naming the file.
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
        # after an error (or Ctrl-C) the temp files go; the old outputs stay as they were
        out.discard()


def atomic_write(path, write_fn, binary=True):
    """
    One atomic output: write_fn(f) fills the file object of a temp file, which then replaces path.
    """
    directory, name = os.path.split(os.path.abspath(path))
    with atomic_outputs(directory) as out:
        with open(out.path(name), "wb" if binary else "w",
                  **({} if binary else {
                      "encoding": "utf-8"
                  })) as f:
            write_fn(f)


@contextmanager
def atomic_directory(final, whole=True, outdated=()):
    """
    with atomic_directory('out/hf') as tmp: write a directory's files into tmp, a marked temp
    directory beside final (.hf.nanogpt_plus.tmp.<pid>: the sweep of dead processes' temps removes
    one a kill leaves). At a clean exit tmp becomes final:
      - whole: final is replaced whole. An earlier final is renamed aside, tmp renamed in, the old one
        removed; if the second rename fails, the old one is put back. The two renames can't be cut
        by a signal (held), so a reader finds the old directory or the new one, never a mix.
      - whole=False (a directory holding files of others, which stay): tmp's files are moved in one
        by one, and the names in outdated that the new output has not are removed.
    An error or a signal before that leaves final exactly as it was, and nothing beside it: no temp,
    and no directory on the way to final that this call made. A symbolic link to a directory stays:
    the directory it points to is the one replaced.
    """
    final = os.path.realpath(final) if os.path.isdir(final) else os.path.abspath(final)
    tmp, aside = temp_path(final), temp_path(final + ".old")
    _restore_aside(final, aside)
    remove_stale_temps(final)
    remove_stale_temps(final + ".old")  # a killed process's earlier output, already replaced
    made = _make_parents(os.path.dirname(final))
    try:
        os.mkdir(tmp)
        yield tmp
        # save_pretrained writes without fsync: all of it on disk first
        for name in os.listdir(tmp):
            with open(os.path.join(tmp, name), "rb+") as f:
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        with held():
            if whole or not os.path.isdir(final):
                _swap_in(tmp, final, aside)
            else:
                names = os.listdir(tmp)
                for name in names:  # each name must take a file: none moved in, or all of them
                    if os.path.lexists(os.path.join(final, name)) and \
                            not os.path.isfile(os.path.join(final, name)):
                        raise IsADirectoryError(errno.EISDIR, "not a regular file",
                                                os.path.join(final, name))
                for name in names:
                    os.replace(os.path.join(tmp, name), os.path.join(final, name))
                for name in outdated:
                    if not os.path.lexists(os.path.join(tmp, name)) and \
                            os.path.isfile(os.path.join(final, name)):
                        os.remove(os.path.join(final, name))
            # (a stop from here on says what is in place: the directory, not the files it was built of)
            published(final)
        _fsync_dir(os.path.dirname(final))
        if os.path.lexists(aside):
            # the earlier output, no longer named
            shutil.rmtree(aside, ignore_errors=True)
    finally:
        if os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
        if not os.path.lexists(final):
            for directory in reversed(made):  # a failed output into a new place leaves nothing
                try:
                    os.rmdir(directory)
                except OSError:
                    break


def _swap_in(tmp, final, aside):
    """ Rename the complete directory tmp to final, an earlier final aside first (put back on failure). """
    moved = os.path.isdir(final) and bool(os.listdir(final))
    if moved:
        os.rename(final, aside)
    elif os.path.isdir(final):
        os.rmdir(final)  # an empty directory: nothing to keep
    try:
        os.rename(tmp, final)
    except BaseException:
        if moved:
            os.rename(aside, final)
        raise


def _restore_aside(final, aside_of_this_process):
    """
    An earlier output a process killed between _swap_in's two renames left aside (its final name
    missing) is put back, so that no sweep removes it as a temp.
    """
    if os.path.lexists(final):
        return
    pattern = glob.escape(os.path.basename(aside_of_this_process).rsplit(".", 1)[0]) + ".*"
    for aside in sorted(glob.glob(os.path.join(glob.escape(os.path.dirname(final)), pattern))):
        pid = aside.rsplit(".", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)) and os.path.isdir(aside):
            os.rename(aside, final)
            return


def _make_parents(directory):
    """ Create directory and its missing parents; returns those this call made, outermost first. """
    missing = []
    while directory and not os.path.lexists(directory):
        missing.append(directory)
        directory = os.path.dirname(directory)
    for d in reversed(missing):
        os.mkdir(d)
    return list(reversed(missing))


def remove_stale_temps(final):
    """
    Delete the temp files an earlier run killed mid-write left for final (their process no longer
    exists).
    """
    directory, name = os.path.split(final)
    pattern = f".{glob.escape(name)}{TEMP_MARK}*"
    _remove_stale(glob.glob(os.path.join(glob.escape(directory), pattern)))


def remove_stale_temps_in(directory):
    """
    Delete every temp file of ours (TEMP_MARK) of a dead process in directory (a kill -9 mid-save
    leaves a full-size .ckpt.pt.nanogpt_plus.tmp.<pid>); returns their names. For a directory only
    one run writes to (its out_dir, locked, once the run's checks passed).
    """
    return _remove_stale(glob.glob(os.path.join(glob.escape(directory), f".*{TEMP_MARK}*")))


def _remove_stale(temps):
    removed = []
    for tmp in temps:
        pid = _temp_pid(tmp)
        # a live pid may be another run writing the same output right now: leave its file alone
        if pid is not None and pid != os.getpid() and not _pid_alive(pid):
            try:
                _remove_temp(tmp)
            except FileNotFoundError:
                continue  # another process removed it first
            removed.append(os.path.basename(tmp))
    return removed


def _remove_temp(tmp):
    """
    A dead process's temp: a file (or a link: the link alone goes), or a directory it was building
    under our mark (an export made beside its final name), removed with all it holds.
    """
    if os.path.isdir(tmp) and not os.path.islink(tmp):
        shutil.rmtree(tmp)
    else:
        os.remove(tmp)


# the largest pid any OS gives (Linux's pid_max is at most 2**22); a longer suffix is no pid
MAX_PID = 2**31 - 1


def _temp_pid(tmp):
    """
    The pid a temp file's name ends with (temp_path), or None where the suffix is not one a process
    of ours wrote: ASCII digits only ('²' is a digit to str.isdigit, not to int's range of pids), at
    most MAX_PID. Such a file is not ours, and is left alone.
    """
    suffix = tmp.rsplit(".", 1)[-1]
    if not (suffix.isascii() and suffix.isdigit()) or len(suffix) > len(str(MAX_PID)):
        return None
    pid = int(suffix)
    return pid if 0 < pid <= MAX_PID else None


def _pid_alive(pid):
    try:
        os.kill(pid, 0)  # signal 0 delivers nothing; it only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, it just belongs to another user
    return True


def flock_held(path):
    """
    Whether another open file (another process, live, on this machine) holds an flock on the file at
    path: a run's lock (outputs.OutDirLock) while the run lives. False when there is no such file.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        # a shared lock for an instant: it conflicts only with the exclusive one a live run holds
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # a file system without locks: no lock can be held there either
    finally:
        os.close(fd)  # and with it our shared lock, if we got it
    return False


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
# what an output may not be

def check_not_special(path, setting):
    """
    Refuse, in one line and whatever --overwrite says, an output path that exists and is neither a
    regular file nor a directory: a FIFO, a socket, a device such as /dev/null (writable even by
    root, so the writability check lets it through), or a symbolic link to one. Writing there would
    hang (a FIFO nobody reads), or replace the node with a regular file (the atomic rename), which
    is not what the user who made it meant; and no script's output means anything streamed into
    one.
    """
    what = special_file(path)
    if what is not None and what != 'a directory':  # a directory output is each script's own check
        if os.path.islink(os.path.normpath(path)):
            what = f"a symbolic link to {what}"
        raise UserError(
            f"--{setting}={path} is {what}, not a regular file, which no output may replace or "
            f"write into; pass the path of a regular file or a new one")


# -----------------------------------------------------------------------------
# reading

def refuse_special_file(path, what, error=UserError):
    """
    Refuse, in one line naming it, an input that exists but is a FIFO, a device (/dev/zero) or a
    socket: opening a FIFO to read waits for a writer that may never come, and a device may never
    end, so neither returns to a loop that could hear a signal. os.stat opens nothing. A missing
    path, or a directory, is left to the caller's own message.
    """
    kind = special_file(path)
    if kind == 'a directory':
        kind = None
    if kind is not None:
        raise error(f"{what} {path} is {kind}, not a regular file: reading it could wait forever; "
                    f"give a regular file")


def read_response(response, deadline_s):
    """
    The whole body of an HTTP response (urllib's), read in the pieces the server sends, within
    deadline_s seconds in all: the socket's timeout bounds each read only, so a server trickling a
    byte every few seconds could hold a download for ever. TimeoutError past it.
    """
    import time
    end = time.monotonic() + deadline_s
    pieces = []
    read = getattr(response, 'read1', response.read)
    while piece := read(1 << 16):  # what has arrived, at most 64 KiB: never waits to fill
        pieces.append(piece)
        if time.monotonic() > end:
            raise TimeoutError(f"the download took more than {deadline_s:g} s in all (a server sending "
                               f"too slowly)")
    return b"".join(pieces)


def file_digest(path, span=1 << 20):
    """
    What tells two nodes' copies of a file apart, cheaply (a stale ckpt.pt, a token file of another
    preparation, a JSONL file with fewer rows): its size and the sha256 of its first and last span
    bytes (a MiB; torch.save's zip holds the tensors' data in between, its directory at the end),
    not a read of gigabytes. Two files that differ only in between are not told apart.
    """
    import hashlib
    refuse_special_file(path, "file")
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        digest.update(f.read(span))
        f.seek(max(size - span, 0))
        digest.update(f.read(span))
    return f"{size}:{digest.hexdigest()[:16]}"


def sampled_digest(path, whole=1 << 24, blocks=256, block=1 << 14):
    """
    What tells two nodes' copies of a large file apart where a difference may lie anywhere (a token
    file of another preparation, or one edited in its middle): its size and the sha256 of all of it
    up to `whole` bytes (16 MiB), else of `blocks` blocks of `block` bytes spread evenly from its
    first byte to its last (4 MiB of reading, the first and last blocks among them). A file
    prepared otherwise differs in nearly every block; what is left unseen is an edit that falls
    wholly between two blocks (of a 10 GB file, 0.04% is read).
    """
    import hashlib
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, 'rb') as f:
        if size <= whole:
            for chunk in iter(lambda: f.read(1 << 20), b''):
                digest.update(chunk)
        else:
            step = (size - block) / (blocks - 1)
            for i in range(blocks):
                f.seek(round(i * step))
                digest.update(f.read(block))
    return f"{size}:{digest.hexdigest()[:16]}"


def read_jsonl(path, required_keys=(), missing_hint="pass an existing JSONL file"):
    """
    [(line number, record dict)] of a JSONL file (blank lines skipped). A missing or empty file, a
    line that is not a JSON object, or a record without one of required_keys is one UserError naming
    the line.
    """
    refuse_special_file(path, "file")
    if not path or not os.path.isfile(path):
        raise UserError(f"no data file at {path or '(none given)'}; {missing_hint}")
    records = []
    try:
        f = open(path, 'rb')  # bytes: a line that is not UTF-8 is reported with its number
    except OSError as e:  # no permission to read it, an I/O error
        raise UserError(f"could not read {path} ({e.strerror or e}); make it readable by this "
                        f"user, or pass another file") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            line = _utf8_line(raw, path, lineno)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise UserError(
                    f"{path} line {lineno} is not valid JSON ({e}); fix or remove that line"
                ) from None
            except RecursionError:  # thousands of nested [ or {: the decoder recurses
                raise UserError(f"{path} line {lineno} is nested too deeply to read as JSON; fix "
                                f"or remove that line") from None
            if not isinstance(record, dict):
                raise UserError(
                    f"{path} line {lineno} is not a JSON object; write one object per line")
            missing = [k for k in required_keys if k not in record]
            if missing:
                raise UserError(
                    f"{path} line {lineno} has no {', '.join(repr(k) for k in missing)} field; "
                    f"each line needs {', '.join(required_keys)}")
            records.append((lineno, record))
    if not records:
        raise UserError(f"{path} has no examples; write one JSON object per line")
    return records


def _utf8_line(raw, path, lineno):
    """
    One line of a JSONL file as text (JSON is UTF-8, RFC 8259); anything else is the user's to
    re-encode.
    """
    try:
        return raw.decode('utf-8')
    except UnicodeDecodeError as e:
        raise UserError(
            f"{path} line {lineno} is not UTF-8 text (byte {raw[e.start]:#04x} at position {e.start + 1}); "
            f"save the file as UTF-8") from None
