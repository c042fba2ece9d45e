"""
Metrics logging: one JSON object per line in out_dir/metrics.jsonl (and, when asked, the same
numbers to wandb), marked with the run (start) each record belongs to, and reading a file back as
one true trajectory across resumes.

Usage:
    from nanogpt_plus.metrics import MetricsLogger, read_metrics
    logger = MetricsLogger('out/metrics.jsonl', enabled=master)
    logger.start(iter_num, init_from)
    logger.log({'type': 'iter', 'iter': 5, 'loss': 2.1})
    records = read_metrics('out/metrics.jsonl')
"""

import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime

from nanogpt_plus.errors import UserError, error_line


@dataclass(frozen=True)
class WandbSpec:
    """ Whether and where the metrics also go to Weights & Biases. """
    wandb_log: bool
    wandb_project: str
    wandb_run_name: str


class MetricsLogger:
    """
    One JSON object per line in out_dir/metrics.jsonl (always, on the master rank) and, when asked,
    the same numbers to wandb. A wandb that can't start (not installed, not logged in, offline
    without WANDB_MODE=offline) is a warning, not a crash.

    Every start of a run into the out_dir is a new 'run' (1, 2, ... counted from the file): each
    record carries its number, and start() writes a {'type': 'start', 'run', 'iter', ...} record
    first, so a resumed run's repeated iterations can be told from the ones they replace
    (read_metrics).

    wandb_id: the wandb run a resumed run continues (its checkpoint's 'wandb_id'; None: a new wandb
    run). self.wandb_id is the id in use, for the next checkpoint. wandb's steps are the iterations.
    """

    def __init__(self, path, enabled=True, wandb_log=False, wandb_project=None, wandb_run_name=None,
                 config=None, wandb_dir=None, wandb_id=None):
        self.enabled = enabled
        self.path = path
        self.wandb = None
        # kept when wandb can't start this time: the next save still names the run to continue
        self.wandb_id = wandb_id
        self.t_start = time.time()
        self.run = None
        if not enabled:
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        if os.path.lexists(path) and not os.path.isfile(path):
            raise UserError(
                f"{path} is not a file (a directory is in its place?); move it away, or pass another "
                f"--out_dir")
        self.run = last_run_number(path) + 1
        try:
            self.file = open(path, 'a', encoding='utf-8')
        except OSError as e:
            raise UserError(
                f"could not open {path} for writing ({e.strerror or e}); pass an --out_dir this user can "
                f"write to") from None
        if self.file.tell() and not _ends_with_newline(path):
            # a run killed mid-line left half a record: ours start on a line of their own
            self.file.write("\n")
        if wandb_log:
            try:
                import wandb
                # resume='allow': the run of that id continues (a new one when it was never synced),
                # so a preempted and resumed run is one wandb run, not one per start
                run = wandb.init(project=wandb_project, name=wandb_run_name, config=config,
                                 dir=wandb_dir, id=wandb_id, resume='allow')
                self.wandb = wandb
                self.wandb_id = run.id
            except ModuleNotFoundError:  # not installed: WANDB_MODE can't help
                print("warning: wandb is not installed; continuing without it (pip install wandb "
                      "to log there, or --wandb_log=False)", file=sys.stderr)
            # wandb raises many kinds (UsageError, CommError, ...): all mean "no wandb"
            except Exception as e:
                print(
                    f"warning: wandb could not start ({error_line(e)}); "
                    f"continuing without it (set WANDB_MODE=offline to log locally)",
                    file=sys.stderr)

    @classmethod
    def for_run(cls, out_dir, wandb, config_record, enabled, resumed=None):
        """
        The logger of a train.py or finetune.py run: out_dir/metrics.jsonl, and wandb as a WandbSpec
        says (config_record: the run's settings, wandb's config); resumed: the checkpoint a resume
        starts from, whose wandb run it continues.
        """
        return cls(os.path.join(out_dir, 'metrics.jsonl'), enabled=enabled,
                   wandb_log=wandb.wandb_log, wandb_project=wandb.wandb_project,
                   wandb_run_name=wandb.wandb_run_name, config=config_record, wandb_dir=out_dir,
                   wandb_id=(resumed or {}).get('wandb_id'))

    def start(self, iter_num, init_from):
        """
        The record that opens this run: where it starts (a resume: the checkpoint's iteration) and
        from what.
        """
        self.log({'type': 'start', 'iter': iter_num, 'init_from': init_from,
                  'time': datetime.now().astimezone().isoformat(timespec='seconds')})

    def log(self, record):
        if not self.enabled:
            return
        record = dict(record, run=self.run, wall_time=round(time.time() - self.t_start, 3))
        if self.file is not None:
            try:
                self.file.write(json.dumps(record) + "\n")
                self.file.flush()
            except OSError as e:  # a full disk, a quota
                self._stop_writing(e, record)
        if self.wandb is not None and record.get('type') != 'start':
            numbers = {
                k: v
                for k, v in record.items()
                if isinstance(v, (int, float)) and k not in ('iter', 'run')
            }
            self.wandb.log(numbers, step=record.get('iter'))

    def _stop_writing(self, error, record):
        """
        Give up on metrics.jsonl for the rest of the run, said once: training goes on (the hours of
        work since the last checkpoint are worth more than the log), and each checkpoint is saved,
        or refused whole keeping the last one, as on any full disk. A later start of the run writes
        its records on a line of their own after the half one left here.
        """
        print(f"warning: could not write {self.path} ({error.strerror or error}); the run goes on "
              f"without it from iter {record.get('iter')} (make room on the disk: checkpoints need "
              f"it too)", file=sys.stderr)
        file, self.file = self.file, None
        try:
            file.close()  # its buffer still holds the record that did not fit: dropped with it
        except OSError:
            pass

    def close(self):
        if not self.enabled:
            return
        if self.file is not None:
            self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def last_run_number(path):
    """ The highest 'run' of the start records in a metrics file (0 for none, or no file). """
    last = 0
    for record in _metrics_records(path):
        if record.get('type') == 'start':
            last = max(last, record.get('run') or 0)
    return last


def read_metrics(path):
    """
    The records of a metrics.jsonl that make up the run's true trajectory, in order: a later run's
    records replace an earlier run's at iterations from its start on (a resume from iter 1000 drops
    the first run's records past 1000; a new run from iter 0 into the same out_dir drops all of
    them). Its 'start' records stay. Records of files from before the 'run' marks pass as they are.
    """
    kept = []
    for record in _metrics_records(path):
        if record.get('type') == 'start':
            start = record.get('iter', 0)
            kept = [r for r in kept if r.get('type') == 'start' or r.get('iter', -1) < start]
        kept.append(record)
    return kept


def _metrics_records(path):
    """
    The records of a metrics file, skipping lines a killed run left unfinished and any record that
    isn't one of ours (not an object, or an 'iter' or 'run' that is no whole number: a file edited
    or written by another tool), so that such a line costs itself and not the run; none for no file.
    """
    if not os.path.isfile(path):
        return
    with open(path, encoding='utf-8', errors='replace') as f:
        for line in f:
            try:
                record = json.loads(line)
            except (ValueError, RecursionError):
                continue  # half a line: the process was killed while writing it
            if isinstance(record, dict) and all(_whole(record.get(k, 0)) for k in ('iter', 'run')):
                yield record


def _whole(value):
    return isinstance(value, int) and not isinstance(value, bool)


def _ends_with_newline(path):
    with open(path, 'rb') as f:
        f.seek(-1, os.SEEK_END)
        return f.read(1) == b"\n"
