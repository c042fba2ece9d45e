"""
Stopping cleanly on SIGINT/SIGTERM (Ctrl-C, preemption): the signal sets a flag, the loop finishes
its iteration, saves, and the script exits with code 75 ("interrupted, resumable").

Usage:
    from nanogpt_plus.signals import GracefulExit
    exit_request = GracefulExit().install()
    ...
    if exit_request.should_stop(dist_info):   # every iteration, on every rank
        save_and_stop()
"""

import signal
import sys

from nanogpt_plus.errors import PeerFailed, exit_code


class GracefulExit:
    """
    SIGINT/SIGTERM (Ctrl-C, preemption) set a flag instead of killing the process, so the loop can
    finish the current iteration and save. A second Ctrl-C exits at once.

    Under torchrun the launcher forwards one signal to every worker and SIGKILLs them
    --shutdown_timeout seconds later (30 by default), so the ranks agree on the flag after every
    iteration (should_stop), and between the batches of a long evaluation, rather than at log steps
    only. The same agreement carries "this rank failed" (an error it met while the others could go
    on: its next batch is unreadable), so every rank stops at once with that error. The signal also
    arrives when torchrun tears the job down because one rank died; the agreement then fails (the
    peer is gone) and the rank exits without saving, so a worker only announces the stop once every
    rank has joined the agreement.
    """

    def __init__(self, keep=False):
        # keep: installed for the whole process (early_exit_request): uninstall() then only marks
        # the work done
        self.keep = keep
        self.done = False
        self.requested = False
        self.signum = 0  # the signal received, 0 = none
        # every rank knows of a signal: the run stops at the next place it can save
        self.agreed = False
        self.failure = None  # an error this rank met that every rank must stop for (fail)
        self._previous = {}
        self._flag_group = None  # the (gloo, CPU) process group the flag is all-reduced over

    def install(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def _handle(self, signum, frame):
        if self.done:  # the work is over and saved: the process ends as it would have, exit code 0
            print(f"\nreceived {signal.Signals(signum).name} after the run ended; exiting",
                  file=sys.stderr,
                  flush=True)
            return
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True
        self.signum = int(signum)
        if not _in_process_group():  # several processes: should_stop says it, once they all agreed
            print(
                f"\nreceived {signal.Signals(signum).name}: finishing this iteration, then saving a checkpoint",
                file=sys.stderr,
                flush=True)

    def should_stop(self, dist_info):
        """
        True on every rank once any rank got a signal, at the same call on all of them: call it at
        the same places on every rank (once per iteration, between evaluation batches). With several
        processes that is a two-number all-reduce each time, over a gloo group on the CPU: it never
        waits for the GPU (no host sync, unlike a flag on the device); it costs 0.5-0.7 ms measured
        with 2 ranks on a busy 2-core CPU, against a training step of tens of milliseconds (tiny
        models) to seconds. Rank 0 then says why the run stops. An error this rank met where it
        could still go on with the others (fail() recorded it) is heard of here by every rank: this
        rank raises it (its line is the one printed), the others stop with its exit code.
        """
        failure = self.failure
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
            if failure is not None:
                raise failure
            raise PeerFailed("another rank failed and said why", failed)
        if signum and not self.agreed and dist_info.master:
            print(
                f"received {signal.Signals(signum).name}: all processes stop here and save a checkpoint",
                file=sys.stderr,
                flush=True)
        self.agreed = self.agreed or bool(signum)
        return bool(signum)

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


def _in_process_group():
    """ Whether this process is one of several in a process group; asked from the signal handler, which may run
    while torch is still being imported: then there is none, and nothing is imported from here. """
    dist = sys.modules.get('torch.distributed')
    try:
        return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)
    except AttributeError:  # torch not imported yet, or half-way
        return False


def early_exit_request(name):
    """
    For a script's first lines, before torch is imported (seconds): with name '__main__' (run as a
    script), a GracefulExit installed now and kept until the process ends, so that a signal at any
    moment ends the run in one line with exit code 75 (before or during its work) or 0 (after it);
    None when the script is imported (a test calls its main(), which installs its own). This module
    imports nothing heavy for that reason.
    """
    return GracefulExit(keep=True).install() if name == '__main__' else None
