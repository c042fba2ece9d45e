"""
Progress of long work that a person waits for (an evaluation, a batch of samples): once the first
steps show that the whole will take more than a few seconds, one line says what is running and for
about how long, then a line every so often says how far it is. Quick work prints nothing, so a
small run's output stays what it was.

Usage:
    progress = Progress(400, "evaluating", "batches", show=master)
    for X, Y in progress.over(batches):
        ...
    # work whose very first step may be long: say what starts before it starts
    progress = Progress(400, "evaluating", "batches", show=master).begin()
"""

import sys
import time


def duration(seconds):
    """ A duration for a person: '8 s', '3.5 min', '1.2 h'. """
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class Progress:
    """
    Counts the steps of one piece of work, `total` of them, and reports it when it is long. The
    estimate is made once `settle` steps or `settle_s` seconds are done, from the first step's time
    and the later ones' mean: the first pays for warm-up (allocator, caches), which would make quick
    work look long. Work projected past quiet_s seconds is announced, then reported every every_s
    seconds, its time left taken from the steps since the previous line (so that it follows a
    machine whose load changes). show=False (the ranks but the first, say) counts silently.
    file: where the lines go (None: stdout at the time of printing).
    """

    def __init__(self, total, what, unit, show=True, file=None, quiet_s=10.0, every_s=15.0,
                 settle=3, settle_s=2.0, clock=None):
        self.total = total
        self.what = what  # what is running: "evaluating"
        self.unit = unit  # what is counted, plural: "batches"
        self.show = show
        self.file = file
        self.quiet_s = quiet_s
        self.every_s = every_s
        self.settle = settle
        self.settle_s = settle_s
        self.clock = clock if clock is not None else time.perf_counter  # seconds, any origin
        self.start = self.clock()
        self.done = 0
        self.first = None  # (seconds, steps) at the first count: the warm-up
        self.announced = False
        self.last = (self.start, 0)  # (time, steps done) at the latest line

    def begin(self, detail=''):
        """
        Say now, before the first step, what is starting: for work whose first step alone may take
        long (the first evaluation of a run on a busy CPU, whose first batch pays for the warm-up),
        where waiting for the estimate would leave the person looking at a silent screen. detail
        follows the count: "evaluating: 40 batches<detail>, starting". Returns the Progress.
        """
        if self.show:
            self._print(f"{self.what}: {self.total} {self.unit}{detail}, starting")
        return self

    def advance(self, steps=1):
        """ Count finished steps; print the announcement or a progress line when one is due. """
        self.done += steps
        if not self.show or self.done >= self.total:
            return
        now = self.clock()
        elapsed = now - self.start
        if self.first is None:
            self.first = (elapsed, self.done)
        if not self.announced:
            settled = self.done >= self.settle or elapsed >= self.settle_s
            projected = self._projected(elapsed)
            if settled and projected > self.quiet_s:
                self.announced = True
                self.last = (now, self.done)
                self._print(f"{self.what}: {self.total} {self.unit}, about {duration(projected)}")
        elif now - self.last[0] >= self.every_s:
            then, done_then = self.last
            left = (now - then) / (self.done - done_then) * (self.total - self.done)
            self.last = (now, self.done)
            self._print(f"{self.what}: {self.done}/{self.total} {self.unit}, "
                        f"{duration(elapsed)} so far, about {duration(left)} left")

    def over(self, items):
        """ The items, counting one step as each is finished (when the next one is asked for). """
        for item in items:
            yield item
            self.advance()

    def _projected(self, elapsed):
        """ Seconds for the whole: the first steps as they went, the others at the later pace. """
        first_s, first_n = self.first
        if self.done == first_n:
            return elapsed / self.done * self.total
        return first_s + (elapsed - first_s) / (self.done - first_n) * (self.total - first_n)

    def _print(self, line):
        # flushed: a run whose output goes to a file or a pipe shows its progress as it happens too
        print(line, file=self.file if self.file is not None else sys.stdout, flush=True)
