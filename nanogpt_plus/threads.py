"""
The CPU thread count: chosen at start-up by timing a few training passes at each candidate count, and
re-checked while training as the machine's load changes (num_threads=0), or fixed by the user.

Usage:
    from nanogpt_plus.threads import tune_cpu_threads, ThreadRetuner
    threads, timings = tune_cpu_threads(model, X, Y, ctx)
"""

import collections
import functools
import time

import torch

from nanogpt_plus.errors import UserError


def apply_cpu_threads(num_threads):
    """ num_threads > 0 fixes torch's CPU thread count; 0 keeps it (see tune_cpu_threads). """
    if num_threads < 0:
        raise UserError(f"num_threads must be 0 (auto) or a positive number, got {num_threads}")
    if num_threads > 0:
        torch.set_num_threads(num_threads)


def thread_candidates():
    """ The CPU thread counts worth trying: torch's current count (one per core by default), half, ..., 1. """
    candidates = []
    n = torch.get_num_threads()
    while n >= 1:
        candidates.append(n)
        n = n // 2 if n > 1 else 0
    return candidates


def tune_cpu_threads(model, X, Y, ctx, repeats=3, max_flops=2e10, announce=None):
    """
    Pick the fastest CPU thread count for this model and batch by timing a few forward/backward passes
    with torch's default (one thread per core), half of it, ..., down to 1, and keep the fastest. Small
    models are bound by per-op overhead, where extra OpenMP threads mostly wait on each other (and
    collapse when the cores are shared with other processes); big ones (a forward/backward of more than
    max_flops) keep every core without trying. The passes leave no trace: gradients are dropped and the
    RNG restored. The choice is re-checked during training by ThreadRetuner. announce: called with a
    line that says what is being timed, before the timing starts (print, say).
    Returns (threads, {threads: mean seconds}).
    """
    candidates = thread_candidates()
    if len(candidates) == 1 or 6 * model.get_num_params() * X.numel() > max_flops:
        return candidates[0], {}
    if announce is not None:
        # seconds of silence otherwise (9 s on 2 busy cores) before the run's first iteration
        announce(f"timing CPU thread counts {', '.join(map(str, candidates))} for this model "
                 f"({repeats + 1} forward/backward passes each, a few seconds) ...")
    rng = torch.get_rng_state()

    def fwd_bwd():
        with ctx:
            _, loss = model(X, Y)
        loss.backward()

    timings = {}
    for n in candidates:
        torch.set_num_threads(n)
        fwd_bwd()  # warm-up (allocator, thread pool)
        ts = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fwd_bwd()
            ts.append(time.perf_counter() - t0)
        timings[n] = sum(ts) / len(ts)  # the mean: on shared cores the cost is in occasional stalls
    model.zero_grad(set_to_none=True)
    torch.set_rng_state(rng)
    best = min(timings, key=timings.get)
    torch.set_num_threads(best)
    return best, timings


def describe_thread_choice(threads, timings):
    """ The line train.py and bench.py print after tune_cpu_threads (scripts/bench_train_cpu.py reads it). """
    return (f"using {threads} CPU threads (fwd+bwd ms: "
            + ", ".join(f"{n} threads {t * 1000:.1f}" for n, t in timings.items()) + ")")


class ThreadRetuner:
    """
    Keeps the automatic CPU thread count (num_threads=0) the fastest while training. The best count moves
    with the machine's load (other processes on the cores), so a choice made at start-up can go stale.
    Every `interval` iterations, each other candidate count is timed on `probe` real training iterations
    (after one warm-up iteration) and compared with the mean of the current count's last `window`
    iterations; the lowest mean time per iteration wins. Means, not medians: on shared cores the cost of
    too many threads is mostly rare long stalls (a thread descheduled at a barrier), which a median hides
    and throughput pays for. A candidate whose first timed iteration takes over 1.5x the current mean is
    dropped at once, so a round costs little. Feed it the time of every ordinary iteration (not those
    that evaluated or saved a checkpoint).
    """

    def __init__(self, candidates, interval=250, probe=8, window=50):
        self.candidates = list(candidates)
        self.interval = interval
        self.probe = probe
        self.recent = collections.deque(maxlen=window)  # the current count's latest iteration times
        self.since_round = 0  # ordinary iterations since the last round
        self.todo = []  # candidates still to time in this round; the first one is being timed
        self.times = []  # the timed iterations of todo[0]
        self.means = {}  # thread count -> mean seconds per iteration, this round
        self.start = None  # the thread count in use when this round started
        self.warmup = 0  # iterations to ignore after a change of thread count

    def observe(self, dt):
        """ Record an iteration's time in seconds. Returns a message when the thread count changed. """
        if not self.todo:
            self.recent.append(dt)
            self.since_round += 1
            if self.since_round >= self.interval and len(self.candidates) > 1:
                self.start = torch.get_num_threads()
                self.means = {self.start: sum(self.recent) / len(self.recent)}
                self.todo = [n for n in self.candidates if n != self.start]
                self._time_next()
            return None
        if self.warmup:
            self.warmup -= 1
            return None
        self.times.append(dt)
        hopeless = dt > 1.5 * self.means[self.start]
        if len(self.times) < self.probe and not hopeless:
            return None
        self.means[self.todo.pop(0)] = sum(self.times) / len(self.times)
        if self.todo:
            self._time_next()
            return None
        best = min(self.means, key=self.means.get)
        torch.set_num_threads(best)
        self.since_round = 0
        self.recent.clear()
        if best == self.start:
            return None
        return (f"using {best} CPU threads instead of {self.start} (ms/iter: "
                + ", ".join(f"{k} threads {v * 1000:.1f}" for k, v in self.means.items()) + ")")

    def _time_next(self):
        torch.set_num_threads(self.todo[0])
        self.times = []
        self.warmup = 1


def choose_threads(model, loader, ctx, dist_info, fsdp=False):
    """
    num_threads=0 on the CPU: small models run faster on fewer threads than cores (per-op overhead outweighs
    the parallelism), so time the candidates on a batch of an evaluation stream (rewound before every
    evaluation, so the training stream is untouched) and keep the fastest. Returns a ThreadRetuner that
    re-checks while training, as the machine's load changes (None when there was nothing to choose).
    Under FSDP the other ranks' models are on the meta device and can't run a forward: rank 0 times for them
    all and its choice is set on every rank (same cores per process, same model: the same best count).
    """
    if not fsdp:
        return _time_threads(model, loader, ctx, dist_info.master)
    import torch.distributed as dist
    choice = [None, None]  # (threads, the counts timed, or None when there was nothing to choose)
    if dist_info.rank == 0:
        retuner = _time_threads(model, loader, ctx, master=True)
        choice = [torch.get_num_threads(), retuner and retuner.candidates]
    dist.broadcast_object_list(choice, src=0)
    threads, candidates = choice
    torch.set_num_threads(threads)
    return ThreadRetuner(candidates) if candidates else None


def _time_threads(model, loader, ctx, master):
    # the master says what it is timing, then what it chose
    announce = functools.partial(print, flush=True) if master else None
    threads, timings = tune_cpu_threads(model, *loader.next_batch(), ctx, announce=announce)
    if not timings:
        return None
    if master:
        print(describe_thread_choice(threads, timings))
    return ThreadRetuner(list(timings))  # the thread counts it timed
