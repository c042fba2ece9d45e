"""
Fault injection for train.py's checkpoints (a script, not a test): train a small model that saves its
state every iteration (checkpoint_interval=1, a checkpoint of ~40 MB, so saves take a noticeable time) and
keeps the last 3 as snapshots (keep_checkpoints=3: a snapshot copy and a pruning after every save), SIGKILL it
at random moments (many land during a save), and check after each kill that
  - ckpt.pt and every snapshot load with torch.load(weights_only=True),
  - the next start removes every temp file the killed run left and takes over its lock,
  - --init_from=resume continues at the checkpoint's iteration (and iter_num advances over the kills).
Halfway, one start goes back to the oldest snapshot (--resume_from): from then on, after every kill, the files
of the line it left (moved to out/abandoned_1/) must be byte for byte what they were. A last resume is stopped
with SIGTERM (exit 75, no lock or temp file left). Prints a summary; exit 1 = a check failed.

Usage:
$ python scripts/fault_inject.py                    # 20 kills, in a temp directory
$ python scripts/fault_inject.py --kills=50 --seed=1 --max_delay=3.0
"""
# first, before torch is imported (seconds): a signal from here on stops the script in one line
# and exit code 130, a signal during the imports once they are done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from configurator import configure
from nanogpt_plus.checkpoint import CHECKPOINT, load_checkpoint, snapshots
from nanogpt_plus.runtime import run_main

# max_delay: the longest wait (s) after the first iter line
DEFAULTS = dict(kills=20, seed=0, max_delay=1.5)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = dict(n_layer=4, n_head=4, n_embd=256, block_size=64, batch_size=4, gradient_accumulation_steps=1)


def make_dataset(directory, vocab=64):
    """ Random tokens (train.bin, val.bin, meta.json): what the model learns doesn't matter here. """
    rng = np.random.default_rng(0)
    for split, n in (('train', 200_000), ('val', 20_000)):
        rng.integers(0, vocab, n).astype(np.uint16).tofile(os.path.join(directory, f'{split}.bin'))
    stoi = {chr(0x100 + i): i for i in range(vocab)}
    with open(os.path.join(directory, 'meta.json'), 'w') as f:
        json.dump({'kind': 'char', 'vocab_size': vocab, 'stoi': stoi, 'itos': {i: c for c, i in stoi.items()}}, f)


class Training:
    """ train.py running in a child process, its output collected by two reader threads. """

    def __init__(self, data_dir, out_dir, resume, resume_from=''):
        settings = dict(MODEL, dataset=data_dir, out_dir=out_dir, init_from='resume' if resume else 'scratch',
                        resume_from=resume_from, checkpoint_interval=1, keep_checkpoints=3, max_iters=100000,
                        lr_decay_iters=100000, eval_interval=100000, eval_iters=1, log_interval=1, device='cpu',
                        compile=False, num_threads=1)
        self.proc = subprocess.Popen([sys.executable, '-u', 'train.py'] + [f'--{k}={v}' for k, v in settings.items()],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS='1'))
        self.out = []
        self.err = []
        self.first_iter = None  # the iteration of the first `iter N:` line
        self.started = threading.Event()
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True)]
        for t in self.readers:
            t.start()

    def _read(self, stream, lines):
        for line in stream:
            lines.append(line)
            if self.first_iter is None and line.startswith('iter '):
                self.first_iter = int(line.split()[1].rstrip(':'))
                self.started.set()
        if stream is self.proc.stdout:
            self.started.set()  # ended before its first iteration

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for t in self.readers:
            t.join()


def temp_files(out_dir):
    return sorted(n for n in os.listdir(out_dir) if '.tmp.' in n)


def checkpoint_iter(out_dir):
    """ iter_num of out_dir/ckpt.pt, loaded the only safe way (None when there is none yet). """
    path = os.path.join(out_dir, CHECKPOINT)
    if not os.path.exists(path):
        return None
    # train.py's own loader: torch.load(weights_only=True)
    return int(load_checkpoint(path)['iter_num'])


def snapshot_iters(out_dir):
    return sorted(snapshots(out_dir))


def check_snapshots(out_dir):
    """ The snapshots in out_dir that do not load, as failures. """
    failures = []
    for _, name in sorted(snapshots(out_dir).items()):
        try:
            load_checkpoint(os.path.join(out_dir, name))
        except Exception as e:  # what a torn snapshot would raise
            failures.append(f"snapshot {name} does not load: {type(e).__name__}: {e}")
    return failures


def fingerprints(directory):
    """ {name: sha256} of the files of a directory (a line of the run left behind). """
    result = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), 'rb') as f:
            result[name] = hashlib.sha256(f.read()).hexdigest()
    return result


def check_start(run, out_dir, expected_iter, left_lock, left_temps):
    """ The failures of a start after a kill: temp files left, lock not taken over, not resumed where saved. """
    failures = []
    stale = [n for n in temp_files(out_dir) if not n.endswith(f'.tmp.{run.proc.pid}')]
    if stale:
        failures.append(f"temp files of dead runs survived the start: {stale}")
    if left_lock and not any('took over the lock' in line for line in run.err):
        failures.append("the dead run's lock was not taken over with a warning")
    if left_temps and not any(line.startswith('removed ') for line in run.out):
        failures.append("no line about the removed temp files")
    if run.first_iter != expected_iter:
        failures.append(f"started at iter {run.first_iter}, the checkpoint holds {expected_iter}")
    return failures


def main():
    cfg = configure(DEFAULTS, doc=__doc__)
    rng = random.Random(cfg.seed)
    work = tempfile.mkdtemp(prefix='fault_inject_')
    data_dir = os.path.join(work, 'data')
    out_dir = os.path.join(work, 'out')
    os.makedirs(data_dir)
    make_dataset(data_dir)
    failures = []
    mid_save = 0
    temp_bytes = 0
    iters = [0]
    left_lock = left_temps = False
    # the line left by going back, its hashes
    abandoned = os.path.join(out_dir, 'abandoned_1')
    left_line = None
    for k in range(cfg.kills):
        saved_iter = checkpoint_iter(out_dir) if os.path.isdir(out_dir) else None
        # halfway: go back to the oldest snapshot, as a user would after a loss spike
        back = k == cfg.kills // 2 and saved_iter is not None and len(snapshot_iters(out_dir)) > 1
        resume_from = str(snapshot_iters(out_dir)[0]) if back else ''
        run = Training(data_dir, out_dir, resume=saved_iter is not None, resume_from=resume_from)
        run.started.wait(timeout=120)
        problems = check_start(run, out_dir, int(resume_from) if back else saved_iter or 0, left_lock, left_temps)
        if back:
            left_line = fingerprints(abandoned)
            print(f"went back to iter {resume_from}: {', '.join(left_line)} kept in {abandoned}", flush=True)
        time.sleep(rng.uniform(0, cfg.max_delay))
        run.kill()
        left = [n for n in temp_files(out_dir) if n.endswith(f'.tmp.{run.proc.pid}')]
        mid_save += bool(left)
        temp_bytes += sum(os.path.getsize(os.path.join(out_dir, n)) for n in left)
        left_lock = os.path.exists(os.path.join(out_dir, 'run.lock'))
        left_temps = bool(left)
        try:
            iters.append(checkpoint_iter(out_dir) or 0)
        except Exception as e:  # what a torn checkpoint would raise
            problems.append(f"ckpt.pt does not load after the kill: {type(e).__name__}: {e}")
        problems += check_snapshots(out_dir)
        if left_line is not None and fingerprints(abandoned) != left_line:
            problems.append(f"the line left behind in {abandoned} changed")
        print(f"kill {k + 1:2d}: started at iter {run.first_iter}, killed with ckpt.pt at iter {iters[-1]}"
              f"{', mid-save (' + ', '.join(left) + ')' if left else ''}"
              f"{'; FAILED: ' + '; '.join(problems) if problems else ''}", flush=True)
        failures += problems
    failures += finish(data_dir, out_dir, iters[-1], left_lock, left_temps)
    print(f"\nkills: {cfg.kills}, mid-save: {mid_save} (their temp files: {temp_bytes / 2**20:.0f} MB, "
          f"removed by the next start), ckpt.pt and every snapshot loaded with weights_only=True after every kill; "
          f"the line left by going back {'unchanged' if left_line else 'not made'}; "
          f"iter_num {iters[0]} -> {iters[-1]} over the kills; failures: {len(failures)}")
    for f in failures:
        print(f"  {f}")
    if failures:
        sys.exit(1)


def finish(data_dir, out_dir, saved_iter, left_lock, left_temps):
    """ A last resume runs to completion (exit 0), leaving neither a lock nor temp files. """
    run = Training(data_dir, out_dir, resume=True)
    run.started.wait(timeout=120)
    problems = check_start(run, out_dir, saved_iter, left_lock, left_temps)
    run.proc.send_signal(signal.SIGTERM)  # a clean stop: saves, exits 75
    code = run.proc.wait(timeout=120)
    for t in run.readers:
        t.join()
    if code != 75:
        problems.append(f"the clean stop exited {code}, not 75: {''.join(run.err)[-500:]}")
    if os.path.exists(os.path.join(out_dir, 'run.lock')) or temp_files(out_dir):
        problems.append(f"left behind: {temp_files(out_dir)} {os.listdir(out_dir)}")
    if checkpoint_iter(out_dir) <= saved_iter:
        problems.append("the last resume did not advance iter_num")
    print(f"last resume: from iter {saved_iter}, SIGTERM -> exit {code}, ckpt.pt at iter {checkpoint_iter(out_dir)}")
    return problems


if __name__ == '__main__':
    run_main(main)
