"""
Stopping cleanly on SIGINT/SIGTERM/SIGHUP (Ctrl-C, preemption, a closed terminal), in one line and a
documented exit code at any moment of a script's life:
  - work that can resume (train.py, finetune.py): the signal sets a flag, the loop finishes its
    iteration, saves, and the script exits with code 75 ("interrupted, resumable");
  - work that can't (sampling, an evaluation, an export, a dataset's preparation): the signal stops
    it at once (Stopped, exit code 130); outputs are written whole or not at all (files.py), so
    nothing half-written is left;
  - after the work is done: the signal is said and changes nothing (the exit code the work earned).
A script's first lines call early_exit_request, which also ends the process as soon as Python's
exit functions have run (end_process): the interpreter's own teardown (a second or more once torch
is loaded) runs with the signals back at their defaults, where SIGTERM would end it with 143.

Usage:
    from nanogpt_plus.signals import GracefulExit
    exit_request = GracefulExit().install()
    ...
    if exit_request.should_stop(dist_info):   # every iteration, on every rank
        save_and_stop()
"""

import atexit
import os
import signal
import sys
from contextlib import contextmanager

from nanogpt_plus.errors import EXIT_INTERRUPTED, exit_code

# the signals a script stops on: Ctrl-C, a scheduler's or kill's SIGTERM, a closed terminal
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
# the exit code of work a signal stopped that can't resume: a shell's for Ctrl-C (128 + SIGINT)
EXIT_STOPPED = 130
# what a signal does to resumable work, said when it comes (GracefulExit's notice)
FINISH_AND_SAVE = "finishing this iteration, then saving a checkpoint"
# should_stop's stand-in for a signal number: this node's torchrun agent is gone (no signal is
# this number)
AGENT_GONE = 1000


class Stopped(KeyboardInterrupt):
    """
    A signal stopped work that can't resume (GracefulExit with resumable=False), or any work when it
    came during the script's start-up (its imports; at_start_up): a KeyboardInterrupt, as Ctrl-C's
    is, so that only the code that cleans up (finally, with) runs on the way out; run_main says it
    in one line and exits with code (130; 75 for resumable work stopped at start-up).
    """

    def __init__(self, signum, where='', at_start_up=False, code=EXIT_STOPPED):
        super().__init__(signal.Signals(signum).name if signum != AGENT_GONE else
                         "the end of a node's torchrun agent (killed, or it crashed)")
        self.signum = int(signum)
        # under torchrun, where the signal came (GracefulExit.stop_together): 'rank 1 (node 1)'
        self.where = where
        self.at_start_up = at_start_up
        self.code = code

    def line(self):
        if self.at_start_up:  # work_started: nothing of the work ran
            return (f"stopped by {self} during start-up, before any work began; nothing was written "
                    f"(exit code {self.code})")
        if _PUBLISHED:  # outputs were put in place before it (a signal waits for their renames)
            return (f"stopped by {self} before the script had finished; it can't be resumed. What it "
                    f"wrote is whole: the last output put in place was {_PUBLISHED[-1]} (exit code "
                    f"{self.code})")
        # outputs are written whole or not at all (files.atomic_outputs)
        verb = 'noticed' if self.signum == AGENT_GONE else 'received'
        at = f" ({verb} by {self.where}; every process of the run stopped with it)" if self.where else ""
        return (f"stopped by {self}{at} before the work was done; it can't be resumed, and no output "
                f"was left half-written (exit code {self.code})")


# the outputs this process has put in place (files.AtomicOutputs.commit), the last one last
_PUBLISHED = []


def published(path):
    """ files.py's call once an output is in place: a stop after it no longer says none was written. """
    _PUBLISHED.append(path)


class GracefulExit:
    """
    SIGINT/SIGTERM/SIGHUP (Ctrl-C, preemption, a closed terminal) set a flag instead of killing the
    process, so the loop can finish the current iteration and save. A second Ctrl-C exits at once.
    With resumable=False the signal stops the work at once instead (Stopped).

    Under torchrun the launcher forwards one signal to every worker and SIGKILLs them
    --shutdown_timeout seconds later (30 by default), so the ranks agree on the flag after every
    iteration (should_stop), and between the batches of a long evaluation, rather than at log steps
    only. The same agreement carries "this rank failed" (an error it met while the others could go
    on: its next batch is unreadable), so every rank stops at once with that error. The signal also
    arrives when torchrun tears the job down because one rank died; the agreement then fails (the
    peer is gone) and the rank exits without saving, so a worker only announces the stop once every
    rank has joined the agreement.
    """

    def __init__(self, keep=False, resumable=True, notice=FINISH_AND_SAVE):
        # keep: installed for the whole process (early_exit_request): uninstall() then only marks
        # the work done
        self.keep = keep
        # False: a signal stops the work at once (Stopped); True: it sets the flag a loop polls
        self.resumable = resumable
        # what the handler says a signal does to resumable work: a script that doesn't know yet
        # whether its work can resume (finetune.py: training, or predictions alone) says both
        self.notice = notice
        self.working = False  # run_main has called the script's main() (work_started)
        self.done = False
        self.requested = False
        self.signum = 0  # the signal received, 0 = none
        # every rank knows of a signal: the run stops at the next place it can save
        self.agreed = False
        self.failure = None  # an error this rank met that every rank must stop for (fail)
        self._previous = {}
        self._flag_group = None  # the (gloo, CPU) process group the flag is all-reduced over
        # work that can't resume, under torchrun: a signal waits for stop_together (together())
        self.polled = False
        # a process forked from this one (a data-loading or tokenizing pool's worker) inherits the
        # handler: there it gives way to the signal's default, so that its pool can end it
        self._pid = os.getpid()
        # the process that started this one (under torchrun, the node's agent): should_stop sees it
        # gone when this process's parent changes
        self._parent = os.getppid()

    def install(self):
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if os.getpid() != self._pid:  # a forked worker: the signal does what it would have
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if _HELD['depth']:  # inside held(): handled as the block ends
            _HELD['pending'].append((self, signum))
            return
        name = signal.Signals(signum).name
        if signum == signal.SIGHUP:
            _leave_the_terminal()
        if self.keep and not self.working and not self.done:
            # start-up: the script's imports run (torch's: seconds, much of it C++, which swallows an
            # exception raised inside it, or aborts on it); the signal is only recorded here, and
            # work_started acts on it once they are done
            if not self.requested:
                self.requested = True
                self.signum = int(signum)
            return
        if self.done:  # the work is over and saved: the process ends as it would have
            _say(f"\nreceived {name} after the run ended; exiting")
            return
        if self.requested:
            # a second Ctrl-C ends a resumable run at once (130); after Stopped the way out is
            # only clean-up, which a second signal must not cut short
            if self.resumable and signum == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.requested = True
        self.signum = int(signum)
        if not self.resumable:
            if self.polled and _in_process_group():  # every rank stops at the next stop_together
                return
            raise Stopped(signum)
        if not _in_process_group():  # several processes: should_stop says it, once they all agreed
            _say(f"\nreceived {name}: {self.notice}")

    def interrupt_at_once(self):
        """
        From here on the work can't resume (finetune.py's predictions alone): a signal stops it at
        once, exit code 130; one that came already stops it now.
        """
        self.resumable = False
        if self.requested and not self.done:
            raise Stopped(self.signum)

    def should_stop(self, dist_info):
        """
        True on every rank once any rank got a signal, at the same call on all of them: call it at
        the same places on every rank (once per iteration, between evaluation batches). With several
        processes that is a two-number all-reduce each time, over a gloo group on the CPU: it never
        waits for the GPU (no host sync, unlike a flag on the device); it costs 0.5-0.7 ms measured
        with 2 ranks on a busy 2-core CPU, against a training step of tens of milliseconds (tiny
        models) to seconds. Rank 0 then says why the run stops. An error this rank met where it
        could still go on with the others (fail() recorded it) is heard of here by every rank: the
        lowest rank that met one raises it, the others stop with its exit code, and the first
        process of every other node prints its line too (process_group.end_together).
        """
        failure = self.failure
        self._notice_the_agent(dist_info)
        if not dist_info.under_torchrun:
            if failure is not None:
                raise failure
            self.agreed = self.requested
            return self.requested
        import torch
        import torch.distributed as dist

        # the signal and the failure's exit code, each the max over ranks (0: none)
        flag = torch.tensor([self.signum, 0 if failure is None else exit_code(failure)],
                            dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._cpu_group())
        signum, failed = flag.tolist()
        if failed:
            # the lowest failed rank's line, said on every node (one more gather, at the end)
            from nanogpt_plus.process_group import end_together
            end_together(dist_info, failure, group=self._cpu_group())
        if signum and not self.agreed and dist_info.master:
            why = (f"received {signal.Signals(signum).name}" if signum != AGENT_GONE else
                   "the torchrun agent of a node is gone (killed, or it crashed)")
            print(f"{why}: all processes stop here and save a checkpoint", file=sys.stderr, flush=True)
        self.agreed = self.agreed or bool(signum)
        return bool(signum)

    def _notice_the_agent(self, dist_info):
        """
        Under torchrun: where this node's agent has ended (kill -9, a crash; this process's parent
        changed), stop as for a signal, so that every rank ends nonzero and no other agent waits its
        300 s exit barrier (which follows workers that all exit 0) for the one that is gone.
        """
        if dist_info.under_torchrun and not self.signum and os.getppid() != self._parent:
            self.signum = AGENT_GONE

    def together(self):
        """
        For work that can't resume (eval.py's batches, sample.py's tokens) under torchrun: from here
        on a signal to any rank stops every rank at the same place, the next stop_together, with
        exit code 130 and a line on each naming where it came; instead of that rank alone stopping
        at once while the others go on alone (and then wait for it in a collective, or torchrun in
        its exit barrier). One process stops at once, as before.
        """
        self.polled = True
        return self

    def stop_together(self, dist_info, done=False):
        """
        The agreement of together(), called at the same places on every rank: raises Stopped on
        every rank once any rank got a signal. done: this rank has no more work (its last batch or
        token), while others may have some: it keeps calling until every rank is done, which is
        when this returns True (False while some rank works; `done` itself with one process). One
        three-number all-reduce over a gloo group on the CPU, as should_stop's.
        """
        if not (dist_info.under_torchrun and dist_info.world_size > 1):
            if self.requested and not self.done:
                raise Stopped(self.signum)
            return done
        self._notice_the_agent(dist_info)
        import torch
        import torch.distributed as dist
        # the signal, whether any rank still works, and the lowest signalled rank (as
        # world_size - rank: a max), each the max over ranks
        mine = dist_info.world_size - dist_info.rank if self.signum else 0
        flag = torch.tensor([self.signum, 0 if done else 1, mine], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._cpu_group())
        signum, working, first = flag.tolist()
        if signum:
            rank = dist_info.world_size - first
            per_node = int(os.environ.get('LOCAL_WORLD_SIZE', '1')) or 1
            raise Stopped(signum, where=f"rank {rank} (node {rank // per_node})")
        return working == 0

    def fail(self, error):
        """
        Record an error this rank met while the step could still be finished; the next should_stop
        raises it.
        """
        self.failure = self.failure or error

    def _cpu_group(self):
        import torch.distributed as dist
        if dist.get_backend() == 'gloo':
            return None  # the default group already reduces CPU tensors
        # made at the first agreement, where every rank calls (a collective)
        if self._flag_group is None:
            self._flag_group = dist.new_group(backend='gloo')
        return self._flag_group

    def uninstall(self):
        if self.keep:
            self.done = True
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _say(line):
    """ The handler's one line; a closed terminal (EIO) or pipe can't be told anything. """
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _leave_the_terminal():
    """
    After SIGHUP (the terminal was closed): output that went to the terminal goes nowhere from now
    on, as nohup's does, so that the run's next line doesn't fail on the closed terminal (EIO)
    before it has saved. Output redirected to a file or a pipe is left as it is.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            if os.isatty(fd):
                stream.flush()
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)
        except (OSError, ValueError, AttributeError):
            pass


# held()'s nesting depth, and the signals that arrived inside it, in order
_HELD = {'depth': 0, 'pending': []}


@contextmanager
def held():
    """
    with held(): a few steps no signal may cut in two (the renames that publish a run's outputs):
    SIGINT/SIGTERM/SIGHUP wait and are handled right after the block. Blocking them in this thread
    is not enough: the kernel may deliver a process-directed signal to another thread (torch's,
    a test runner's), and Python then runs the handler in this thread at once; so the handler
    itself also waits (_HELD) while a block is open.
    """
    try:
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    except (AttributeError, ValueError, OSError):  # no pthread_sigmask (Windows)
        previous = None
    _HELD['depth'] += 1
    try:
        yield
    finally:
        _HELD['depth'] -= 1
        if previous is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        if not _HELD['depth']:
            pending, _HELD['pending'] = _HELD['pending'], []
            for handler, signum in pending:
                handler._handle(signum, None)


def _in_process_group():
    """ Whether this process is one of several in a process group; asked from the signal handler, which may run
    while torch is still being imported: then there is none, and nothing is imported from here. """
    dist = sys.modules.get('torch.distributed')
    try:
        return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    except AttributeError:  # torch not imported yet, or half-way
        return False


# the process's kept GracefulExit (early_exit_request), and the exit code run_main ends with
_KEPT = None
_EXIT_CODE = None


def early_exit_request(name, resumable=True, notice=FINISH_AND_SAVE):
    """
    For a script's first lines, before torch is imported (seconds): with name '__main__' (run as a
    script), a GracefulExit installed now and kept until the process ends, so that a signal at any
    moment ends the run in one line with exit code 75 (resumable work, before or during it), 130
    (work that can't resume) or the code the work earned (after it); None when the script is
    imported (a test calls its main()). notice: what a signal then does, said when it comes
    (GracefulExit). This module imports nothing heavy for that reason.
    """
    global _KEPT
    if name != '__main__' or not _is_the_program(sys._getframe(1).f_globals.get('__file__')):
        return None
    _KEPT = GracefulExit(keep=True, resumable=resumable, notice=notice).install()
    # registered before any other module's exit function, so it runs after all of them
    atexit.register(_end_now)
    return _KEPT


def _is_the_program(script):
    """
    Whether script is the program this process runs (python script.py, or a torchrun worker), not one
    run as '__main__' inside another program (a test's runpy.run_path): only the program itself may
    keep the signals and end the process with its own exit code.
    """
    # the interpreter's own command line: a test may replace sys.argv, never this
    if not script:
        return False
    ran = getattr(sys, 'orig_argv', sys.argv)
    return any(os.path.realpath(arg) == os.path.realpath(script) for arg in ran if arg.endswith('.py'))


def work_started():
    """
    run_main's first call, once the script's imports are done: from here on a signal is handled as
    it comes (Stopped, said by run_main). One that came during start-up (the handler only recorded
    it) is acted on now: work that can't resume stops (Stopped: one line, 130) before anything was
    written; resumable work has its flag set, and stops before its first iteration (75).
    """
    _PUBLISHED.clear()  # a script's main() run in-process by a test starts with none
    if _KEPT is None:
        return
    _KEPT.working = True
    if not _KEPT.requested:
        return
    if not _KEPT.resumable:
        raise Stopped(_KEPT.signum, at_start_up=True)
    # resumable work of one process ends too (nothing to save yet: run the command again); under
    # torchrun (RANK set, even for one worker) the ranks agree first, at the end of their set-up
    # (train.py: "stopped before iter N", the line scripts/slurm_train.sh requeues on)
    if 'RANK' not in os.environ:
        raise Stopped(_KEPT.signum, at_start_up=True, code=EXIT_INTERRUPTED)


def work_ended(code):
    """
    run_main's last call: the work is over (its exit code is code), so a signal from now on is said
    and changes nothing, and the process ends once Python's exit functions have run.
    """
    global _EXIT_CODE
    _EXIT_CODE = code
    if _KEPT is not None:
        _KEPT.uninstall()


def _end_now():
    """
    The last exit function (see early_exit_request): end the process with run_main's exit code at
    once. What Python would do after it (free every module, then libtorch's own teardown: a second
    or more) runs with the signals back at their defaults, where a SIGTERM ends the process with 143
    and no line; nothing of ours is left to write by then (the exit functions have run, every
    thread has ended, and the standard streams are flushed here).
    """
    if _EXIT_CODE is None or _KEPT is None or os.getpid() != _KEPT._pid:
        return
    with held():
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            try:
                stream.flush()
            except (OSError, ValueError, AttributeError):
                pass
        os._exit(_EXIT_CODE)
