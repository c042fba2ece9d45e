"""
Where a script may write: every rule on the paths a script writes to, in one room. Each is checked before the
work, so nothing is computed for an output that is then refused, and a refusal is one line naming the setting.

1. A training run's directory, out_dir (train.py, finetune.py): one run at a time. The run holds the lock
   out_dir/run.lock while it lives (claim_out_dir), so two runs never write into one out_dir at once. A new
   run over an earlier one's checkpoints is refused with the commands that work: resume it (where these
   settings would), write elsewhere, or start over (--overwrite=True) (prepare_out_dir, check_new_run); a
   resume from a snapshot branches off (checkpoint.branch_off). The checkpoint files themselves (their names,
   snapshots, going back to one) are checkpoint.py's.
2. An output path a user names (eval.py --output_file, export_hf.py --hf_dir, export_gguf.py --gguf_file,
   finetune.py --predict_out, bench.py's results): check_output refuses one that would replace a checkpoint,
   a dataset's files, a directory holding them, a file the run reads, or any other existing file that is not
   an earlier output of the same kind (an eval result, a predictions file, a GGUF export: recognised by what
   they hold), unless --overwrite=True.
   Re-running a script replaces its own earlier output.
3. A dataset's directory (data/<name>/prepare.py): check_out_dir refuses to write one kind of dataset where
   another kind lies, or into a training run's out_dir; check_same_dataset refuses to replace a train.bin/
   val.bin dataset with another one (another corpus, tokenizer or vocabulary); --overwrite=True allows both.
Overwrite or not, a run's lock (run.lock) is never an output (replacing it would let a second run into a live
run's out_dir), and a live run's out_dir (its lock held) takes no output and no dataset at all: the run's files
are its own until it ends.

Usage:
    from nanogpt_plus.outputs import OutDirSpec, check_output, check_out_dir, claim_out_dir, prepare_out_dir
    spec = cfg.select(OutDirSpec)    # out_dir, init_from, resume_from, overwrite, eval_only
    with claim_out_dir('out', dist_info, prepare=lambda: prepare_out_dir(spec, 'train.py', argv)):
        ...   # rank 0 holds out/run.lock until the block ends, however it ends
    check_output('out/eval.json', 'output_file', overwrite=False, output_kind='eval result')  # refused in a line
    check_out_dir('data/mine', RAW, overwrite=False)    # a prepare script, before any work
"""

import fcntl
import hashlib
import json
import os
import shlex
import socket
import sys
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

from nanogpt_plus.checkpoint import CHECKPOINT, branch_off, checkpoint_files, is_checkpoint_name, sidecar_of
from nanogpt_plus.dataset import RAW_NAMES, is_shard_name, tokenizer_identity
from nanogpt_plus.distributed import master_decides
from nanogpt_plus.errors import UserError, special_file
from nanogpt_plus.files import check_not_special, flock_held, remove_stale_temps_in, temp_path

LOCK_NAME = 'run.lock'
# the files beside its checkpoints that make a directory a training run's out_dir: its lock and its metrics log
RUN_FILES = (LOCK_NAME, 'metrics.jsonl')


def run_files(directory):
    """
    The names in directory that make it a training run's out_dir (its checkpoints, RUN_FILES), sorted; [] when
    it is no directory.
    """
    if not os.path.isdir(directory):
        return []
    return sorted(set(checkpoint_files(directory)) | set(RUN_FILES) & set(os.listdir(directory)))


# -----------------------------------------------------------------------------
# 1. a training run's out_dir: the lock
#
# The lock is a JSON line (pid, host, start time, command line). The process that owns it also holds
# an flock on it, which the kernel drops when the process dies in any way (SIGKILL, OOM killer, power
# cut aside), so a lock whose flock can be taken belongs to a run that is gone. A run:
#   1. writes its lock into a temp file and flocks it, then publishes it with os.link (atomic, fails when a
#      run.lock exists): of two runs starting at the same moment exactly one links, the other finds the
#      winner's complete, flocked file and is refused;
#   2. finding a run.lock whose flock it can take (its holder is dead) renames its own file over it while
#      holding that flock: a second run trying the same takeover can't get the dead file's flock meanwhile,
#      and once it does, the name no longer points at that file, so it starts again from 1 (and is refused).
# A lock written on another host can't be proven dead from here (flock is not shared over every
# network file system): such a run is refused and told to delete the file if the other run is gone.

class OutDirLock:
    """
    out_dir/run.lock while the run lives: acquire() takes it (or raises UserError), release() frees
    it.
    """

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, LOCK_NAME)
        self.fd = None  # our lock file, flocked, while we hold it
        self.created = []  # the directories acquire() made for out_dir, the outermost first

    def acquire(self):
        self.created = make_out_dir(self.out_dir)
        if os.path.lexists(self.path) and not os.path.isfile(self.path):
            raise UserError(
                f"{self.path} is not a lock file (a directory or another kind of file is in its place); "
                f"move it away, or pass another --out_dir")
        tmp = temp_path(self.path)
        try:
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except OSError as e:  # a read-only file system, no write permission, a full disk
            raise UserError(
                f"could not write in out_dir {self.out_dir} ({e.strerror or e}); pass an --out_dir this "
                f"user can write to") from None
        try:
            flock_new_file(fd, self.out_dir)
            write_lock_record(fd, self.path)
            self._publish(tmp)
        except BaseException:
            os.close(fd)
            if os.path.exists(tmp):
                os.remove(tmp)
            raise
        self.fd = fd
        return self

    def _publish(self, tmp):
        """ Make tmp (ours, flocked) the run.lock: a new one, or over the lock of a dead run. """
        # each retry means another run changed run.lock meanwhile; it can't go on for long
        for _ in range(100):
            try:
                os.link(tmp, self.path)  # atomic, and fails when a run.lock exists
                os.remove(tmp)
                return
            except FileExistsError:
                pass
            # EPERM/ENOTSUP: a file system without hard links (some FUSE and SMB mounts)
            except OSError as e:
                raise UserError(
                    f"could not create the lock {self.path} ({e.strerror or e}): the file system of "
                    f"{self.out_dir} has no hard links; pass an --out_dir on a local disk"
                ) from None
            if self._take_over(tmp):
                return
        raise UserError(
            f"could not take the lock {self.path}: other runs keep changing it; start one run at a time"
        )

    def _take_over(self, tmp):
        """
        True once tmp replaced a dead run's lock; False to start again (run.lock changed or
        vanished).
        """
        try:
            old = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return False  # its owner just released it: link again
        try:
            if not self._flock_same_file(old):
                return False
            holder = read_holder(old)
            if not holder.get('pid'):
                # our locks are written whole before they get their name: this file is not one of
                # them (another program's output put in its place, perhaps while a live run still
                # holds the lock it replaced)
                raise UserError(
                    f"{self.path} is not a lock this project wrote (it holds no run's pid); if no run "
                    f"uses {self.out_dir}, delete {self.path} and start again")
            if holder.get('host', socket.gethostname()) != socket.gethostname():
                raise UserError(
                    f"{self.path} says a run on {holder.get('host')} (pid {holder.get('pid')}, started "
                    f"{holder.get('started')}) uses {self.out_dir}; this machine can't tell whether it "
                    f"still runs: if it has ended, delete {self.path} and start again")
            # while we hold the dead file's flock: no other run can take it meanwhile
            os.rename(tmp, self.path)
            print(
                f"warning: took over the lock {self.path} of a run that ended without releasing it "
                f"(pid {holder.get('pid')} on {holder.get('host')}, started {holder.get('started')})",
                file=sys.stderr)
            return True
        finally:
            os.close(old)

    def _flock_same_file(self, fd):
        """
        Take fd's flock; True when we have it and run.lock still names fd's file. Refuses a live
        holder.
        """
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not self._names(fd):
                return False  # replaced under us by a run that took it over: look again
            holder = read_holder(fd)
            raise UserError(
                f"{self.out_dir} is in use by another run (pid {holder.get('pid')} on "
                f"{holder.get('host')}, started {holder.get('started')}; lock {self.path}); wait for it "
                f"to end, stop it, or pass another --out_dir") from None
        return self._names(fd)

    def _names(self, fd):
        """ Whether run.lock is (still) the file open as fd. """
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        own = os.fstat(fd)
        return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)

    def release(self):
        """ Remove run.lock (only if it is still ours) and drop the flock. """
        if self.fd is None:
            return
        try:
            if self._names(self.fd):  # no one else can have replaced it while we hold its flock
                os.remove(self.path)
        finally:
            os.close(self.fd)
            self.fd = None


def flock_new_file(fd, out_dir):
    """
    flock a file only we know yet (it never blocks); some network file systems have no locks at all.
    """
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        raise UserError(
            f"the file system of {out_dir} does not support file locks ({e.strerror or e}); "
            f"pass an --out_dir on a local disk") from None


def make_out_dir(out_dir):
    """
    Create out_dir (and the directories above it that are missing), refusing a file or a dataset's
    directory in its place; returns the directories it created, the outermost first ([]: out_dir
    was there), which a refused run removes again while they are empty (remove_created).
    """
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"out_dir {out_dir} is a file, not a directory; pass another --out_dir")
    # a run's files (ckpt.pt, metrics.jsonl, ...) beside a dataset's would mix two things that cost
    # hours to remake
    held = sorted(n for n in os.listdir(out_dir)
                  if n.endswith('.bin')) if os.path.isdir(out_dir) else []
    if held:
        raise UserError(
            f"out_dir {out_dir} is a dataset's directory (it holds {held[0]}); pass another --out_dir"
        )
    missing = []
    place = os.path.abspath(out_dir)
    while not os.path.lexists(place):
        missing.insert(0, place)
        place = os.path.dirname(place)
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        remove_created(missing)  # the parents it made before it failed
        raise UserError(
            f"could not create out_dir {out_dir} ({e.strerror or e}); pass another --out_dir"
        ) from None
    return missing


def remove_created(created):
    """
    After a refused run: remove the directories it created for its out_dir (make_out_dir's list), the
    innermost first, each only while it is still empty, so that a refusal leaves nothing behind and
    never removes what anyone put there meanwhile.
    """
    for directory in reversed(created):
        try:
            os.rmdir(directory)  # fails on a directory that is not empty: it stays
        except OSError:
            return


def write_lock_record(fd, path):
    """
    This run's record into its new lock file, on disk; a full disk or a quota is one line, as saves
    give.
    """
    try:
        os.write(fd, (json.dumps(lock_record()) + "\n").encode())
        os.fsync(fd)
    except OSError as e:
        raise UserError(
            f"could not write the lock {path} ({e.strerror or e}); make room on the disk, or pass an "
            f"--out_dir where this run can write") from None


def lock_record():
    return {'pid': os.getpid(), 'host': socket.gethostname(),
            'started': datetime.now().astimezone().isoformat(timespec='seconds'),
            'command': ' '.join(shlex.quote(a) for a in sys.argv)}


def read_holder(fd):
    """ The JSON record of the lock file open as fd ({} when it can't be read). """
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        record = json.loads(os.read(fd, 65536).decode() or '{}')
    except (OSError, ValueError, RecursionError):  # (thousands of nested [: not a record of ours)
        return {}
    return record if isinstance(record, dict) else {}


@contextmanager
def claim_out_dir(out_dir, dist_info, prepare=None):
    """
    Hold out_dir's lock on rank 0 for the body of the with-block, released however it ends (and
    out_dir removed again when the block fails and this claim created it, while it is empty). Then
    (still on rank 0) check that no checkpoint name there is taken by a directory, run prepare()
    (e.g. the overwrite check) and remove the temp files dead processes of ours left there. Every
    rank learns whether rank 0 succeeded (master_decides), so a refused run ends on all of them.
    """
    lock = OutDirLock(out_dir)

    def claim():
        lock.acquire()
        try:
            check_checkpoint_names(out_dir)
            if prepare is not None:
                prepare()
            # only now that the checks found out_dir to be this run's: a refused run touches nothing
            removed = remove_stale_temps_in(out_dir)
            if removed:
                print(f"removed {len(removed)} temp file(s) that killed runs left in {out_dir}: "
                      f"{', '.join(removed)}")
        except BaseException:
            lock.release()
            raise
    try:
        master_decides(dist_info, claim)
        try:
            yield lock
        finally:
            lock.release()
    except BaseException:
        # a refused run (its settings, data or disk) leaves no empty out_dir of its own making; one
        # that wrote anything keeps it
        remove_created(lock.created)
        raise


def live_holder(directory):
    """
    The lock record (pid, host, started) of a live run, other than this process, that holds
    directory's run.lock, else None: no output of another script may go into that directory.
    """
    path = os.path.join(directory, LOCK_NAME)
    if not flock_held(path):
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None  # released just now
    try:
        holder = read_holder(fd)
    finally:
        os.close(fd)
    if holder.get('pid') == os.getpid() and holder.get('host') == socket.gethostname():
        return None  # our own run's directory (finetune.py's predictions beside its checkpoints)
    return holder


def check_checkpoint_names(out_dir):
    """
    Refuse a run whose checkpoint names in out_dir are taken by something a save can't replace (a
    directory called ckpt.pt, say): its first save would fail only after all the training before it.
    """
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if is_checkpoint_name(name) and os.path.lexists(path) and not os.path.isfile(path):
            raise UserError(
                f"{path} is not a file (a directory or another kind of file is in its place), so "
                f"this run could not save its checkpoint there; move it away, or pass another "
                f"--out_dir")


# -----------------------------------------------------------------------------
# 1. a training run's out_dir at its start: a resume continues its line, a new run may not replace an
# earlier one's checkpoints

@dataclass(frozen=True)
class OutDirSpec:
    """ What train.py's start in its out_dir reads of the settings (prepare_out_dir). """
    out_dir: str
    init_from: str
    resume_from: str
    overwrite: bool
    eval_only: bool


def prepare_out_dir(spec, script, argv, resume_refusal=None):
    """
    train.py's start in its out_dir (spec: an OutDirSpec), on rank 0 with out_dir locked: a resume
    continues a line of its own (branch_off keeps the files of the line it leaves); a new run into
    an out_dir that holds an earlier run's checkpoints (ckpt.pt, ckpt_best.pt, snapshots) is refused
    with the commands to resume it or start over, unless --overwrite=True. eval_only runs write no
    checkpoint and change nothing. resume_refusal(): why a resume of that earlier run with this
    run's settings would be refused, or None (init_from.resume_refusal), so that the refusal
    suggests resuming only where that works.
    """
    if spec.eval_only:
        return
    if spec.init_from == 'resume':
        branch_off(spec.out_dir, spec.resume_from)
        return
    checkpoints = checkpoint_files(spec.out_dir)
    # asked only where there is an earlier run to refuse (it reads that run's checkpoint)
    why_not = resume_refusal() if checkpoints and resume_refusal is not None else None
    check_new_run(spec.out_dir, checkpoints, script, argv, spec.overwrite, why_not_resume=why_not)


def check_new_run(out_dir, checkpoints, script, argv, overwrite, resume_file=CHECKPOINT,
                  why_not_resume=None):
    """
    On rank 0, with out_dir locked: a new run (not a resume) into an out_dir that holds one of
    `checkpoints` (file names) is refused with the commands to continue the earlier run (when it
    left its resume_file and why_not_resume is None) or to start over, unless overwrite. With
    overwrite the earlier files stay until the new run's saves replace them.
    """
    held = [name for name in checkpoints if os.path.isfile(os.path.join(out_dir, name))]
    if not held:
        return
    if not overwrite:
        resumable = os.path.isfile(os.path.join(out_dir, resume_file)) and why_not_resume is None
        raise refuse_overwrite(out_dir, held[0], script, argv, resumable=resumable)
    print(
        f"overwrite=True: the earlier run's checkpoints in {out_dir} stay until this run's saves replace them"
    )


def refuse_overwrite(out_dir, checkpoint, script, argv, resumable=True):
    """
    The UserError for a new run that would overwrite checkpoint (a file in out_dir) without
    --overwrite: it gives the commands to continue the earlier run (when it is resumable) or to
    start over, and another out_dir (the first choice when it can't be resumed: its run is another
    run).
    """
    iter_note = ''
    try:
        with open(sidecar_of(os.path.join(out_dir, checkpoint)), encoding='utf-8') as f:
            iter_note = f" (iter {json.load(f)['iter_num']})"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # the sidecar only adds the iteration to the message
    elsewhere = command_line(script, argv, out_dir=free_sibling(out_dir))
    start_over = command_line(script, argv, overwrite=True)
    if resumable:
        choices = (
            f"continue it with `{command_line(script, argv, init_from='resume')}`, start over with "
            f"`{start_over}`, or pass another --out_dir")
    else:
        choices = f"write this run elsewhere with `{elsewhere}`, or replace the earlier one with `{start_over}`"
    return UserError(
        f"{out_dir} already holds the checkpoint {checkpoint}{iter_note} of an earlier run, which this "
        f"run would overwrite; {choices}")


def free_sibling(out_dir):
    """
    The out_dir a refusal suggests instead: the first of <out_dir>-2, -3, ... that nothing is at yet
    (not even a file), so that the suggested command is not refused in its turn when an earlier
    suggestion was taken.
    """
    base = out_dir.rstrip(os.sep) or out_dir
    n = 2
    while os.path.lexists(f"{base}-{n}"):
        n += 1
    return f"{base}-{n}"


def command_line(script, argv, **replace):
    """
    The command that ran this script with argv, --key=value settings of replace put in (replacing
    any the user gave), for messages that say what to type: command_line('train.py', argv,
    init_from='resume').
    """
    keep = [a for a in argv if not any(a.startswith(f'--{k}=') for k in replace)]
    args = keep + [f'--{k}={v}' for k, v in replace.items()]
    launcher = 'torchrun ...' if 'LOCAL_RANK' in os.environ else 'python'
    return ' '.join([launcher, script] + [shlex.quote(a) for a in args])


# -----------------------------------------------------------------------------
# 2. an output path a user names

# what an output never replaces unprompted: checkpoints (ckpt.pt, snapshots, a Hugging Face
# pytorch_model.bin, any file torch.save wrote) and a dataset's files: its token files (nanoGPT's
# train.bin/val.bin, llm.c's shards; all .bin), and beside them the meta and tokenizer.json that say
# how to read them. They cost hours to remake.
CHECKPOINT_SUFFIX = '.pt'
TOKEN_SUFFIX = '.bin'
# a dataset's description (a prepare script's --overwrite removes it with the token files), and its tokenizer
DATASET_META = ('meta.json', 'meta.pkl')
DATASET_DESCRIPTIONS = DATASET_META + ('tokenizer.json',)
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
        a_run = run_files(directory)
    except OSError:
        return ''
    if a_run:
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


def _conflict(path, kind, inputs, earlier, output_kind=None, recognise=None):
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
        if output_kind and os.path.isfile(path) and not (recognise(path) if recognise else
                                                         earlier_output(path, output_kind)):
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
                f"would write into {path}, which holds files and not the mark of an earlier output "
                f"of this script ({' and '.join(earlier)}), so they are not this project's")
    for name, source in (inputs or {}).items():
        if source and _same(source, path):
            return f"would {'replace' if kind == 'file' else 'write into'} the --{name} this run reads, {source}"
    return None


def check_not_link(path, setting):
    """
    Refuse an output file path that is a symbolic link: the atomic rename would replace the link
    itself (the user's, lost), and writing through it instead would put the output where its name
    doesn't say, past the checks made on that name (a .pt name, a dataset's file). Passing the
    link's target is one word away and says what is meant.
    """
    if os.path.islink(os.path.normpath(path)):
        raise UserError(
            f"--{setting}={path} is a symbolic link (to {os.path.realpath(path)}), which an output "
            f"would replace; pass the path it points to, or another --{setting}")


def check_output(path, setting, overwrite, kind='file', inputs=None, earlier=(), output_kind=None,
                 recognise=None):
    """
    Refuse, in one line naming setting, an output path (kind 'file', or 'directory' for one written
    into) that would replace a checkpoint or a dataset's file (protected), an existing file that is
    not an earlier output_kind (OUTPUT_KINDS: the file output the script writes, as JSON lines; or a file
    recognise(path) tells apart, export_gguf.py's GGUF file), write into a
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
    check_not_special(path, setting)
    if kind == 'file':
        check_not_link(path, setting)
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
    conflict = _conflict(path, kind, inputs, earlier, output_kind, recognise)
    if conflict is None:
        return
    if overwrite is None:  # a script without --overwrite (bench.py): never replaced
        raise UserError(f"--{setting}={path} {conflict}; pass another --{setting}")
    if not overwrite:
        raise UserError(
            f"--{setting}={path} {conflict}; pass another --{setting}, or --overwrite=True to write "
            f"there anyway")
    print(f"warning: --{setting}={path} {conflict} (overwrite=True)", file=sys.stderr)


# -----------------------------------------------------------------------------
# 3. a dataset's directory: one kind of dataset, not the other
#
# A directory holds one kind of token files (dataset.find_shards refuses a mix): nanoGPT's train.bin/val.bin,
# written by data/text, openwebtext, shakespeare and shakespeare_char, or llm.c's token shards
# (*train*.bin / *val*.bin), written by data/fineweb. Each writer also rewrites meta.json, so writing
# one kind where the other lies would leave shards described by another dataset's meta.json (and a
# fineweb run could no longer resume them); and a training run's out_dir (checkpoints, run.lock,
# metrics.jsonl) is no dataset directory at all.

# the two kinds of dataset a prepare script writes
RAW = "raw"
SHARDS = "shards"
DATASET_KINDS = {RAW: "a train.bin/val.bin dataset", SHARDS: "a dataset of llm.c token shards"}


def check_out_dir(out_dir, writes, overwrite=False):
    """
    Refuse (one-line UserError) to write a dataset of kind `writes` (RAW or SHARDS) into an out_dir
    that holds the other kind of dataset or a training run's files; the same kind again (a re-run, a
    resumed fineweb run) is fine. A live run's out_dir (its lock held) is refused, overwrite or not.
    With overwrite the directory is taken: the other kind's token
    files and meta are removed, so the new dataset replaces it (a loader refuses a directory with
    both kinds), and a run's files are left alone.
    """
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        # (else the write fails at the end, after all the work, as if the disk were full)
        raise UserError(f"out_dir {out_dir} is {special_file(out_dir) or 'a file'}, not a directory; pass "
                        f"another --out_dir")
    if not os.path.isdir(out_dir):
        return
    if flock_held(os.path.join(out_dir, LOCK_NAME)):
        # a live run: its out_dir takes no dataset, overwrite or not (the run could not resume
        # from a directory holding token files)
        raise UserError(
            f"{out_dir} is the out_dir of a live training run (its {LOCK_NAME} is held), which no "
            f"dataset may be written into, --overwrite=True or not; pass another --out_dir")
    names = sorted(os.listdir(out_dir))
    a_run = run_files(out_dir)
    other = other_dataset(names, writes)
    if overwrite:
        if other:
            for name in other + [n for n in DATASET_META if n in names]:
                os.remove(os.path.join(out_dir, name))
            print(
                f"--overwrite=True: removed {DATASET_KINDS[other_kind(writes)]} from {out_dir} ({len(other)} token "
                f"files and its meta)")
        return
    if a_run:
        raise UserError(
            f"{out_dir} holds a training run's files ({listed(a_run)}), not a dataset; pass "
            f"another --out_dir, or --overwrite=True to write the dataset beside them")
    check_descriptions(out_dir, names)
    if other:
        raise UserError(
            f"{out_dir} holds {DATASET_KINDS[other_kind(writes)]} ({listed(other)}) and this script writes "
            f"{DATASET_KINDS[writes]}; pass --overwrite=True to replace it, or another --out_dir")


@contextmanager
def preparing(out_dir):
    """
    with preparing(out_dir): a prepare script's work on out_dir, from its first check to its last
    rename, one at a time. Two prepares into one directory would both find it free, both compute,
    and the second's rename would replace the first's dataset without a word: this holds an flock on
    the directory itself (no lock file to leave behind; the kernel drops it when the process dies,
    as run.lock's), and a second prepare meanwhile is refused in one line. A directory this call had
    to make is removed again if the work fails (when it is still empty), so a refused prepare
    leaves nothing.
    """
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):
        raise UserError(f"--out_dir={out_dir} is a file, not a directory; pass another --out_dir")
    made = not os.path.lexists(out_dir)
    try:
        os.makedirs(out_dir, exist_ok=True)
        fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        raise UserError(f"could not create --out_dir={out_dir} ({e.strerror or e}); pass an --out_dir "
                        f"this user can write to") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(
                f"another process is preparing a dataset in {out_dir} right now; wait for it to end, "
                f"or pass another --out_dir") from None
        except OSError:
            pass  # a file system without locks: one prepare at a time is then the user's to keep
        try:
            yield
        except BaseException:
            if made:
                try:
                    os.rmdir(out_dir)  # only when empty: nothing of ours or anyone's is lost
                except OSError:
                    pass
            raise
    finally:
        os.close(fd)  # and with it the flock


def check_descriptions(out_dir, names):
    """
    A dataset's description files (meta.json, meta.pkl, tokenizer.json) in out_dir without token
    files beside them are the user's until shown otherwise: a prepare replaces them only when
    meta.json is one a prepare of ours wrote (it records the preparation, or llm.c shards' settings),
    its token files since removed.
    """
    if any(n.endswith(TOKEN_SUFFIX) for n in names):
        return  # a dataset: check_same_dataset and the kinds' rule decide
    held = [n for n in DATASET_DESCRIPTIONS if n in names]
    if not held or ours_meta(out_dir):
        return
    raise UserError(
        f"{out_dir} holds {listed(held)} but no token files: files no prepare of this project wrote "
        f"(a meta.json of ours records its preparation), which this one would replace; pass another "
        f"--out_dir, or --overwrite=True to replace them")


def ours_meta(out_dir):
    """ Whether out_dir's meta.json was written by a prepare script of this project. """
    if recorded_preparation(out_dir) is not None:
        return True
    try:
        with open(os.path.join(out_dir, "meta.json"), encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError, RecursionError):
        return False
    # fineweb's: the settings its shards were made with, and their records
    return isinstance(meta, dict) and isinstance(meta.get("settings"), dict) and \
        isinstance(meta.get("shards"), list)


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
# 3. a dataset's directory: the same dataset again, or another one
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
