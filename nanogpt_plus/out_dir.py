"""
A run's directory, out_dir: who may write there, and whether a new run may.
  - the lock: out_dir/run.lock, so that two runs never write into one out_dir at once (below);
  - a new run over an earlier one's checkpoints is refused, with the commands that work: resume it (where
    these settings would), write elsewhere, or start over (--overwrite=True); a resume from a snapshot
    branches off (checkpoint.branch_off).
The checkpoint files themselves (their names, snapshots, going back to one) are checkpoint.py's.

The lock is a JSON line (pid, host, start time, command line). The process that owns it also holds
an flock on it, which the kernel drops when the process dies in any way (SIGKILL, OOM killer, power
cut aside), so a lock whose flock can be taken belongs to a run that is gone. A run:
  1. writes its lock into a temp file and flocks it, then publishes it with os.link (atomic, fails when a
     run.lock exists): of two runs starting at the same moment exactly one links, the other finds the
     winner's complete, flocked file and is refused;
  2. finding a run.lock whose flock it can take (its holder is dead) renames its own file over it while
     holding that flock: a second run trying the same takeover can't get the dead file's flock meanwhile,
     and once it does, the name no longer points at that file, so it starts again from 1 (and is refused).
A lock written on another host can't be proven dead from here (flock is not shared over every
network file system): such a run is refused and told to delete the file if the other run is gone.

Usage:
    from nanogpt_plus.out_dir import OutDirSpec, claim_out_dir, prepare_out_dir
    spec = cfg.select(OutDirSpec)    # out_dir, init_from, resume_from, overwrite, eval_only
    with claim_out_dir('out', dist_info, prepare=lambda: prepare_out_dir(spec, 'train.py', argv)):
        ...   # rank 0 holds out/run.lock until the block ends, however it ends
"""

import fcntl
import json
import os
import shlex
import socket
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

from nanogpt_plus.checkpoint import CHECKPOINT, branch_off, checkpoint_files, is_checkpoint_name, sidecar_of
from nanogpt_plus.distributed import master_decides
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import flock_held, remove_stale_temps_in, temp_path

LOCK_NAME = 'run.lock'


# -----------------------------------------------------------------------------
# the lock

class OutDirLock:
    """
    out_dir/run.lock while the run lives: acquire() takes it (or raises UserError), release() frees
    it.
    """

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.path = os.path.join(out_dir, LOCK_NAME)
        self.fd = None  # our lock file, flocked, while we hold it

    def acquire(self):
        make_out_dir(self.out_dir)
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
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"could not create out_dir {out_dir} ({e.strerror or e}); pass another --out_dir"
        ) from None


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
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


@contextmanager
def claim_out_dir(out_dir, dist_info, prepare=None):
    """
    Hold out_dir's lock on rank 0 for the body of the with-block, released however it ends. Then
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
    master_decides(dist_info, claim)
    try:
        yield lock
    finally:
        lock.release()


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
# a run's start: a resume continues its line, a new run may not replace an earlier one's checkpoints

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
    elsewhere = command_line(script, argv, out_dir=f"{out_dir.rstrip(os.sep)}-2")
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
