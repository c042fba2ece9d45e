"""
Signals (nanogpt_plus/signals.py and every script's ending): a signal at any moment of every entry point and prepare
script ends in one line and a documented exit code (75: a clean, resumable stop; 130: work that can't resume was
stopped; 0: the work was done), leaves no half-written output and no run.lock; train.py saves and resumes at SIGINT,
SIGTERM and SIGHUP, and stops before its first iteration when a signal comes during set-up (torch's import
included). Each script is signalled at the earliest moment it can answer and just after its last output; no fixed
sleeps: a case waits for the handler (/proc/<pid>/status) or for a line.
"""
import glob
import json
import os
import queue
import re
import signal
import sys
import threading
import time

import pytest

from helpers import iter_losses, run, run_python, start_python, tiny_args, train_args
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.errors import EXIT_INTERRUPTED
from nanogpt_plus.signals import GracefulExit

DONE = "after the run ended; exiting"  # the line of a signal once the work is done (signals.py)


STOPPED = re.compile(r"stopped by SIG\w+ (before the work was done; it can't be resumed, and no "
                     r"output was left half-written|during start-up, before any work began; nothing was "
                     r"written) \(exit code 130\)")
# a signal that came after the outputs were in place (the renames wait for none)
PUBLISHED = re.compile(r"stopped by SIG\w+ before the script had finished; it can't be resumed\. What it wrote "
                       r"is whole: the last output put in place was .+ \(exit code 130\)")
# a signal that came while the script's imports ran, acted on once they are done
AT_START_UP = ("stopped by {} during start-up, before any work began; nothing was written "
               "(exit code {})")


class Watched:
    """ A started script whose stdout and stderr are read as they come (threads): a test waits for a
    line. """

    def __init__(self, proc):
        self.proc = proc
        self.lines = queue.Queue()
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=self._read, args=(stream, kept), daemon=True)
                        for stream, kept in ((proc.stdout, self.out), (proc.stderr, self.err))]
        for reader in self.readers:
            reader.start()

    def _read(self, stream, kept):
        for line in stream:
            kept.append(line)
            self.lines.put(line)

    def wait_for(self, pattern, timeout=180):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1)
            except queue.Empty:
                assert self.proc.poll() is None, \
                    f"ended ({self.proc.returncode}) before {pattern!r}:\n{self.text()}"
                continue
            if re.search(pattern, line):
                return
        raise AssertionError(f"no {pattern!r} in {timeout} s:\n{self.text()}")

    def wait_for_handler(self, sig=signal.SIGTERM, timeout=60):
        """ Until the script has installed its handler for sig (its first line has run). """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            caught = caught_signals(self.proc.pid)
            assert caught is not None, f"ended before its handler was installed:\n{self.text()}"
            if caught & (1 << (sig - 1)):
                return
            time.sleep(0.002)
        raise AssertionError(f"no handler for {sig.name} in {timeout} s")

    def finish(self, timeout=180):
        self.proc.wait(timeout=timeout)
        for reader in self.readers:
            reader.join(timeout=10)
        return self.proc.returncode, ''.join(self.out), ''.join(self.err)

    def text(self):
        return ''.join(self.out) + ''.join(self.err)


def caught_signals(pid):
    """ The mask of signals pid has a handler for (SigCgt), or None once it is gone. """
    try:
        with open(f'/proc/{pid}/status') as f:
            status = f.read()
    except FileNotFoundError:
        return None
    fields = dict(line.split(':', 1) for line in status.splitlines() if ':' in line)
    if fields.get('State', '').split()[:1] == ['Z']:
        return None
    return int(fields['SigCgt'].strip(), 16)


def start(args, env=None):
    return Watched(start_python(args, env=dict(os.environ, **(env or {}), PYTHONUNBUFFERED='1')))


def no_half_written(*directories):
    """ No temp file of an unfinished output is left in any of directories. """
    for d in directories:
        assert not glob.glob(os.path.join(str(d), '.*.tmp.*')), os.listdir(d)


# -----------------------------------------------------------------------------
# the scripts and their cases: (arguments, the last line each prints, the outputs it writes)

@pytest.fixture(scope='module')
def trained(tmp_path_factory, dataset):
    """ A tiny finished train.py run, the source of sample, eval and export: (out_dir, dataset). """
    from nanogpt_plus.checkpoint import CHECKPOINT
    out = tmp_path_factory.mktemp('trained')
    r = run_python(['train.py', *train_args(dataset, out, max_iters=2, eval_interval=2)])
    assert r.returncode == 0 and (out / CHECKPOINT).exists(), r.stderr[-2000:]
    return str(out), dataset


def script_case(name, trained, tmp_path):
    """ (argv, the pattern of its last output, the directories it writes) for script `name`. """
    out_dir, dataset = trained
    text = tmp_path / 'input.txt'
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 400)
    cases = {
        'sample': (['sample.py', f'--out_dir={out_dir}', '--device=cpu', '--num_samples=1',
                    '--max_new_tokens=8', '--start=a', '--num_threads=1'],
                   r"^generated \d+ tokens", []),
        'eval': (['eval.py', f'--init_from={out_dir}', f'--dataset={dataset}', '--split=train',
                  '--device=cpu', '--max_examples=8', f'--output_file={tmp_path / "eval.json"}'],
                 r'^\{"task"', [tmp_path]),
        'export_hf': (['export_hf.py', f'--out_dir={out_dir}', f'--hf_dir={tmp_path / "hf"}'],
                      r'^\{"hf_dir"', [tmp_path / 'hf']),
        'export_gguf': (['export_gguf.py', f'--out_dir={out_dir}', f'--gguf_file={tmp_path / "m.gguf"}'],
                        r'^\{"gguf_file"', [tmp_path]),
        'bench': (['bench.py', f'--dataset={dataset}', '--device=cpu', '--n_layer=2', '--n_head=2',
                   '--n_embd=32', '--block_size=16', '--batch_size=4', '--burnin=1', '--steps=2',
                   '--num_threads=1'],
                  r"^peak memory", []),
        'prepare_char': (['data/shakespeare_char/prepare.py', f'--input={text}',
                          f'--out_dir={tmp_path / "d"}'],
                         r"^val has", [tmp_path / 'd']),
        'prepare_text': (['data/text/prepare.py', f'--input={text}', '--tokenizer=char',
                          f'--out_dir={tmp_path / "t"}', f'--cache_dir={tmp_path / "cache"}'],
                         r"val", [tmp_path / 't']),
        'prepare_bpe': (['data/text/prepare.py', f'--input={text}', '--tokenizer=bpe',
                         '--vocab_size=300', f'--out_dir={tmp_path / "b"}',
                         f'--cache_dir={tmp_path / "cache"}'],
                        r"val", [tmp_path / 'b']),
    }
    return cases[name]


NON_RESUMABLE = ['sample', 'eval', 'export_hf', 'export_gguf', 'bench', 'prepare_char', 'prepare_text',
                 'prepare_bpe']


# scripts that need the network for their data: their early signal only (while torch is imported)
EARLY_ONLY = ['data/openwebtext/prepare.py', 'data/fineweb/prepare.py',
              'data/shakespeare/prepare.py']


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/<pid>/status')
@pytest.mark.parametrize('name', NON_RESUMABLE)
def test_a_signal_as_soon_as_a_script_can_answer_stops_it_in_130(name, trained, tmp_path):
    args, _, outputs = script_case(name, trained, tmp_path)
    proc = start(args)
    proc.wait_for_handler()
    proc.proc.send_signal(signal.SIGTERM)
    code, out, err = proc.finish()
    # torch is still being imported (seconds): the work has not started
    assert code == 130 and STOPPED.search(err), (code, out + err)
    assert 'Traceback' not in err and len(err.strip().splitlines()) <= 2, err
    no_half_written(*[d for d in outputs if os.path.isdir(d)])


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/<pid>/status')
@pytest.mark.parametrize('script', EARLY_ONLY)
def test_a_signal_as_a_network_prepare_script_starts_ends_in_130(script, tmp_path):
    proc = start([script, f'--out_dir={tmp_path / "d"}'])
    proc.wait_for_handler()
    proc.proc.send_signal(signal.SIGTERM)
    code, out, err = proc.finish()
    assert code == 130 and STOPPED.search(err) and 'Traceback' not in err, (code, out + err)
    assert not (tmp_path / 'd').exists() or not os.listdir(tmp_path / 'd')


# sitecustomize.py for a process whose signal must land inside `import torch`: the script's handler is
# installed (its first line), then a thread sends the signal to the main thread while the main thread
# waits inside the import: in numpy's import, which torch starts from C++ (where an exception raised
# by the handler used to be swallowed), or at torch's own start where numpy came first
SIGNAL_INSIDE_TORCH = """
import os, signal, sys, threading

class SignalInsideTorch:
    fired = False

    def find_spec(self, name, path=None, target=None):
        inside = name == 'numpy' and 'torch' in sys.modules
        if not self.fired and (inside or (name == 'torch' and 'numpy' in sys.modules)):
            self.fired = True
            main, sent = threading.get_ident(), threading.Event()
            sig = getattr(signal, os.environ['SIGNAL_INSIDE_TORCH'])
            threading.Thread(target=lambda: (signal.pthread_kill(main, sig), sent.set())).start()
            sent.wait()
            for _ in range(1000):  # a few bytecodes more: Python runs the handler here at the latest
                pass
            with open(os.environ['SIGNAL_INSIDE_TORCH_LOG'], 'w') as log:
                log.write(name)
        return None

sys.meta_path.insert(0, SignalInsideTorch())
"""


def signalled_inside_torch(args, sig, tmp_path):
    """ (exit code, stdout, stderr, the import it landed in) of args, signalled inside torch's import. """
    hook = tmp_path / 'hook'
    hook.mkdir(parents=True)
    (hook / 'sitecustomize.py').write_text(SIGNAL_INSIDE_TORCH)
    log = tmp_path / 'landed_in'
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), os.environ.get('PYTHONPATH', '')]),
               SIGNAL_INSIDE_TORCH=sig.name, SIGNAL_INSIDE_TORCH_LOG=str(log))
    r = run_python(args, env=env, timeout=300)
    return r.returncode, r.stdout, r.stderr, log.read_text() if log.exists() else None


def test_a_signal_inside_torchs_import_is_acted_on_after_it():
    """ The handler only records a signal while the imports run; work_started acts on it: Stopped. """
    from nanogpt_plus import signals
    kept = GracefulExit(keep=True, resumable=False)
    kept._handle(signal.SIGHUP, None)  # no exception inside the import
    kept._handle(signal.SIGTERM, None)  # a second one changes nothing
    assert kept.requested and kept.signum == signal.SIGHUP and not kept.working
    saved, signals._KEPT = signals._KEPT, kept
    try:
        with pytest.raises(signals.Stopped) as stop:
            signals.work_started()
    finally:
        signals._KEPT = saved
    assert stop.value.line() == AT_START_UP.format('SIGHUP', 130) and stop.value.code == 130


@pytest.mark.parametrize('name,sig', [('eval', signal.SIGINT), ('sample', signal.SIGTERM),
                                      ('export_hf', signal.SIGHUP), ('bench', signal.SIGTERM),
                                      ('prepare_char', signal.SIGTERM), ('prepare_bpe', signal.SIGINT)])
def test_a_signal_inside_torchs_import_stops_the_script_after_it_in_130(name, sig, trained, tmp_path):
    """ eval.py used to finish and exit 0 after such a signal (torch's C++ import swallowed the stop),
    others crashed on a half-imported numpy or aborted. """
    args, _, outputs = script_case(name, trained, tmp_path)
    before = {str(d): sorted(os.listdir(d)) for d in [tmp_path, *outputs] if os.path.isdir(d)}
    code, out, err, landed = signalled_inside_torch(args, sig, tmp_path / 'probe')
    assert landed in ('numpy', 'torch'), (code, out + err)
    assert code == 130 and out == '' and err.strip() == AT_START_UP.format(sig.name, 130), (code, out + err)
    after = {d: sorted(n for n in os.listdir(d) if n != 'probe') for d in before}
    assert after == {d: [n for n in names if n != 'probe'] for d, names in before.items()}
    assert not any(os.path.exists(d) for d in outputs if str(d) not in before)


@pytest.mark.parametrize('script', ['train.py', 'finetune.py', 'scripts/plot_metrics.py'])
def test_a_signal_inside_torchs_import_stops_train_finetune_and_scripts(script, dataset, tmp_path):
    """ train.py and finetune.py: 75 (run the command again, nothing to resume), nothing written, not even
    out_dir; a script of scripts/ as any other (130). """
    out_dir = tmp_path / 'out'
    args = {'train.py': train_args(dataset, out_dir),
            'finetune.py': ['--task=classification', f'--out_dir={out_dir}', '--device=cpu'],
            'scripts/plot_metrics.py': [f'--out_dir={out_dir}']}[script]
    code, out, err, landed = signalled_inside_torch([script, *args], signal.SIGTERM, tmp_path)
    expected = 130 if script.startswith('scripts/') else EXIT_INTERRUPTED
    assert landed in ('numpy', 'torch'), (code, out + err)
    assert code == expected and out == '' and err.strip() == AT_START_UP.format('SIGTERM', expected), \
        (code, out + err)
    assert not out_dir.exists()


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/<pid>/status')
@pytest.mark.parametrize('name', NON_RESUMABLE)
def test_a_signal_just_after_the_last_output_changes_nothing(name, trained, tmp_path):
    args, last, outputs = script_case(name, trained, tmp_path)
    proc = start(args)
    proc.wait_for(last)
    proc.proc.send_signal(signal.SIGTERM)
    code, out, err = proc.finish()
    assert 'Traceback' not in err and code != -signal.SIGTERM, (code, out + err)
    if code == 130:  # it came before main() returned: said as it is, every output whole or absent
        assert STOPPED.search(err) or PUBLISHED.search(err), err
    else:  # the work was done: exit 0, the signal said (or it came after the process had ended)
        assert code == 0, (code, out + err)
        assert 'received SIGTERM' not in err or DONE in err, err
    no_half_written(*[d for d in outputs if os.path.isdir(d)])


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/<pid>/status')
def test_a_long_generation_and_an_evaluation_stop_at_a_signal(trained, tmp_path):
    """ Work of minutes: a signal while it runs stops it at once, in one line and 130, writing
    nothing. """
    out_dir, dataset = trained
    # the tiny dataset's letters: sample.py's default prompt, a newline, is none of them
    long_sample = ['sample.py', f'--out_dir={out_dir}', '--device=cpu', '--num_samples=2',
                   '--max_new_tokens=100000', '--num_threads=1', '--start=abc']
    long_eval = ['eval.py', f'--init_from={out_dir}', f'--dataset={dataset}', '--split=train',
                 '--device=cpu', '--batch_size=1', f'--output_file={tmp_path / "eval.json"}']
    for args, started in [(long_sample, r"^sampling "), (long_eval, r"^provenance")]:
        proc = start(args)
        proc.wait_for(started)
        proc.proc.send_signal(signal.SIGTERM)
        code, out, err = proc.finish()
        assert code == 130 and STOPPED.search(err) and 'Traceback' not in err, \
            (code, out + err)
        assert not (tmp_path / 'eval.json').exists()
    no_half_written(tmp_path)


# -----------------------------------------------------------------------------
# train.py: 75 and a checkpoint before the work is done, 0 after it, run.lock released

def train_signalled_at(line, sig, dataset, out_dir, **settings):
    """ A tiny train.py run into out_dir, sent sig once its output shows line: (code, stdout, stderr). """
    proc = start(['train.py', *train_args(dataset, out_dir, **settings)])
    proc.wait_for(line)
    proc.proc.send_signal(sig)
    return proc.finish()


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/<pid>/status')
@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGHUP])
def test_train_saves_and_exits_75_at_sigterm_and_sighup(sig, dataset, tmp_path):
    from nanogpt_plus.checkpoint import CHECKPOINT, load_checkpoint
    from nanogpt_plus.outputs import LOCK_NAME
    code, out, err = train_signalled_at(r"^iter 3:", sig, dataset, tmp_path, max_iters=200,
                                        eval_interval=100)
    assert code == 75, (code, out + err)
    assert f"received {sig.name}: finishing this iteration, then saving a checkpoint" in err
    assert "stopped cleanly; continue with --init_from=resume" in out and 'Traceback' not in err
    assert 3 <= load_checkpoint(str(tmp_path / CHECKPOINT))['iter_num'] < 200
    assert not (tmp_path / LOCK_NAME).exists()
    no_half_written(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/<pid>/status')
def test_a_step_of_endless_micro_steps_stops_at_sigterm(dataset, tmp_path):
    """ gradient_accumulation_steps=10**12: one step never ends, so the signal is heard between its
    micro-steps; the run saves the state before that step (iter 0) and leaves no run.lock. """
    from nanogpt_plus.checkpoint import CHECKPOINT, load_checkpoint
    from nanogpt_plus.outputs import LOCK_NAME
    code, out, err = train_signalled_at(r"^step 0:", signal.SIGTERM, dataset, tmp_path,
                                        gradient_accumulation_steps=10**12, num_threads=1)
    assert code == 75 and 'Traceback' not in err, (code, out + err)
    assert out.strip().splitlines()[-2:] == [
        f"saving checkpoint to {tmp_path} (interrupted at iter 0)",
        f"stopped cleanly; continue with --init_from=resume --out_dir={tmp_path} (exit code 75)"]
    assert load_checkpoint(str(tmp_path / CHECKPOINT))['iter_num'] == 0
    assert sorted(os.listdir(tmp_path)) == ['ckpt.json', 'ckpt.pt', 'metrics.jsonl']
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/<pid>/status')
def test_train_at_the_earliest_moment_stops_before_its_first_step(dataset, tmp_path):
    from nanogpt_plus.outputs import LOCK_NAME
    proc = start(['train.py', *train_args(dataset, tmp_path)])
    proc.wait_for_handler()
    proc.proc.send_signal(signal.SIGTERM)
    code, out, err = proc.finish()
    # torch is still being imported: 75 once it is, nothing written (a signal during set-up: test below)
    assert code == 75 and err.strip() == AT_START_UP.format('SIGTERM', 75), (code, out + err)
    assert not (tmp_path / LOCK_NAME).exists() and not os.listdir(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/<pid>/status')
@pytest.mark.parametrize('sig', [signal.SIGTERM, signal.SIGHUP])
def test_train_after_its_final_save_exits_0(sig, dataset, tmp_path):
    from nanogpt_plus.checkpoint import CHECKPOINT, load_checkpoint
    from nanogpt_plus.outputs import LOCK_NAME
    code, out, err = train_signalled_at(r"\(final, iter 5\)", sig, dataset, tmp_path, max_iters=4,
                                        eval_interval=4)
    # the final save goes on (a signal during it is said as a stop, which it then is): exit 0,
    # never 128 + sig
    assert code == 0 and 'Traceback' not in err, (code, out + err)
    assert load_checkpoint(str(tmp_path / CHECKPOINT))['iter_num'] == 5
    assert not (tmp_path / LOCK_NAME).exists()
    no_half_written(tmp_path)


# -----------------------------------------------------------------------------
# finetune.py: as train.py

@pytest.fixture
def finetune_args(tmp_path):
    from helpers import make_source, make_task
    src = make_source(tmp_path / 'src')
    train_file, val_file = make_task(tmp_path, 'classification', n_train=64, n_val=8)
    return ['finetune.py', '--task=classification', f'--init_from={src}',
            f'--train_file={train_file}', f'--val_file={val_file}', f'--out_dir={tmp_path / "ft"}',
            '--device=cpu', '--batch_size=8']


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/<pid>/status')
def test_finetune_at_the_earliest_moment_stops_resumable(finetune_args, tmp_path):
    from nanogpt_plus.outputs import LOCK_NAME
    proc = start(finetune_args + ['--epochs=50'])
    proc.wait_for_handler()
    proc.proc.send_signal(signal.SIGTERM)
    code, out, err = proc.finish()
    assert code == 75 and err.strip() == AT_START_UP.format('SIGTERM', 75), (code, out + err)
    assert not (tmp_path / 'ft' / LOCK_NAME).exists()
    no_half_written(tmp_path / 'ft')


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/<pid>/status')
def test_finetune_after_its_result_exits_0(finetune_args, tmp_path):
    from nanogpt_plus.outputs import LOCK_NAME
    proc = start(finetune_args + ['--epochs=1'])
    proc.wait_for(r'^\{"task"')
    proc.proc.send_signal(signal.SIGTERM)
    code, out, err = proc.finish()
    assert code == 0 and 'Traceback' not in err, (code, out + err)
    assert 'received SIGTERM' not in err or DONE in err, err
    assert json.loads(out.strip().splitlines()[-1])['interrupted'] is False
    assert not (tmp_path / 'ft' / LOCK_NAME).exists()
    no_half_written(tmp_path / 'ft')


# -----------------------------------------------------------------------------
# in this process: the pieces

@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/<pid>/status')
def test_a_signal_during_the_renames_waits_until_every_output_is_in_place(tmp_path, monkeypatch):
    """ Stopped comes after the last rename: never a new train.bin beside an old val.bin. """
    from nanogpt_plus import files
    from nanogpt_plus.signals import GracefulExit, Stopped, work_started
    for name in ('train.bin', 'val.bin'):
        (tmp_path / name).write_bytes(b'old')
    real_replace = os.replace
    renamed = []

    def replace(src, dst):  # SIGTERM arrives between the two renames
        renamed.append(os.path.basename(dst))
        if len(renamed) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        real_replace(src, dst)
    stop = GracefulExit(resumable=False).install()
    stop.working = True  # inside main(), as run_main marks it
    work_started()  # nothing published yet
    try:
        monkeypatch.setattr(files.os, 'replace', replace)
        with pytest.raises(Stopped) as stopped:
            with files.atomic_outputs(str(tmp_path)) as out:
                for name in ('train.bin', 'val.bin'):
                    with open(out.path(name), 'wb') as f:
                        f.write(b'new')
    finally:
        stop.uninstall()
    assert renamed == ['train.bin', 'val.bin']
    assert [(tmp_path / n).read_bytes() for n in ('train.bin', 'val.bin')] == [b'new', b'new']
    # what is true: the outputs were published before the stop (not "before the work was done")
    assert PUBLISHED.fullmatch(stopped.value.line()) and stopped.value.line().endswith('val.bin (exit code 130)')
    no_half_written(tmp_path)


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/<pid>/status')
def test_a_signal_another_thread_took_waits_for_the_end_of_held_too():
    """ The kernel may hand a process-directed signal to a thread that doesn't block it; Python then
    runs the handler in the main thread inside held(), which must wait for the block's end too. """
    from nanogpt_plus.signals import GracefulExit, Stopped, held
    stop = GracefulExit(resumable=False).install()
    stop.working = True
    steps = []
    try:
        with pytest.raises(Stopped):
            with held():
                stop._handle(signal.SIGTERM, None)  # as Python calls it, whichever thread got it
                steps.append('first rename')
                with held():  # nested: still waits for the outermost block
                    steps.append('second rename')
                steps.append('clean-up')
    finally:
        stop.uninstall()
    assert steps == ['first rename', 'second rename', 'clean-up']
    assert stop.requested and stop.signum == signal.SIGTERM


@pytest.mark.skipif(not sys.platform.startswith('linux'), reason='reads /proc/<pid>/status')
def test_after_the_work_a_signal_is_said_and_the_code_stays(capsys):
    from nanogpt_plus.signals import GracefulExit, Stopped
    stop = GracefulExit(keep=True, resumable=False)
    stop.working = True
    with pytest.raises(Stopped):
        stop._handle(signal.SIGHUP, None)
    stop._handle(signal.SIGTERM, None)  # a second one while cleaning up: nothing more
    stop.uninstall()
    stop._handle(signal.SIGTERM, None)
    assert DONE in capsys.readouterr().err


def test_sigint_saves_and_resumes(dataset, tmp_path):
    args = tiny_args(dataset, tmp_path, max_iters=100000, lr_decay_iters=100000, eval_interval=100000)
    proc = start_python(["-u", "train.py", *args])
    seen = ""
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        seen += line
        if line.startswith("iter 3:"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    seen += out
    # "interrupted, resumable" for a scheduler
    assert proc.returncode == EXIT_INTERRUPTED == 75, err[-2000:]
    assert "finishing this iteration" in err
    m = re.search(r"saving checkpoint to .* \(interrupted at iter (\d+)\)", seen)
    assert m, seen[-2000:]
    stopped_at = int(m.group(1))
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["iter_num"] == stopped_at
    resumed = run_python(["train.py", *args, "--init_from=resume",
                              f"--max_iters={stopped_at + 2}"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert min(iter_losses(resumed.stdout)) == stopped_at


@pytest.mark.usefixtures('one_thread')
def test_a_signal_during_set_up_stops_before_the_first_iteration(dataset, tmp_path):
    # SIGTERM while the dataset is being read (set-up): exit 75 and one line, not 143
    code = ("import os, signal, train; real = train.training_data\n"
            "train.training_data = lambda *a, **k: (os.kill(os.getpid(), signal.SIGTERM), real(*a, **k))[1]\n"
            "from nanogpt_plus.runtime import run_main; run_main(train.main)")
    r = run_python(['-c', code] + train_args(dataset, tmp_path / 'out', num_threads=1), timeout=120)
    assert r.returncode == 75, r.stderr[-2000:]
    assert "stopped before iter 0: a signal came during set-up; nothing new to save" in r.stdout
    assert not iter_losses(r.stdout) and not (tmp_path / 'out' / 'ckpt.pt').exists()


@pytest.mark.usefixtures('one_thread')
def test_a_signal_after_the_work_is_done_ends_the_process_as_it_would_have(capsys):
    kept = GracefulExit(keep=True)
    kept.uninstall()  # the run is over: main's finally
    kept._handle(signal.SIGTERM, None)
    assert not kept.requested and "received SIGTERM after the run ended; exiting" in capsys.readouterr().err


@pytest.mark.usefixtures('one_thread')
def test_a_signal_while_torch_is_imported_ends_in_75_and_one_line(dataset, tmp_path):
    """ SIGTERM half a second after `python train.py` started (torch is still being imported): exit 75, said. """
    args = ['train.py', *train_args(dataset, tmp_path, max_iters=50, num_threads=1)]
    proc = start_python(args)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    # (or, on a slow start, during set-up)
    assert err.strip() == AT_START_UP.format('SIGTERM', 75) or \
        "stopped before iter 0: a signal came during set-up; nothing new to save" in out
    assert not iter_losses(out) and "Traceback" not in err


def test_a_script_run_inside_another_program_leaves_its_exit_code_alone(monkeypatch, capsys):
    """
    A script run as '__main__' in this process (as these tests do) must not keep the signals or end
    the process with its own exit code at exit: the test run once exited 2 with every test passed,
    from a prepare script's refusal recorded in-process.
    """
    from nanogpt_plus import signals
    code, _, _ = run("data/text/prepare.py", monkeypatch, capsys, "--tokenizer=nope")
    assert code == 2
    assert signals._KEPT is None and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


@pytest.mark.usefixtures('one_thread')
def test_a_signal_before_finetune_knows_its_work_says_what_it_does_to_each(finetune_args, tmp_path, monkeypatch,
                                                                              capsys):
    """ Predictions alone, SIGTERM while the settings are checked: not "saving a checkpoint"; 130 and no output. """
    import finetune
    from helpers import exit_code, run_script
    from nanogpt_plus import finetuning
    ft = tmp_path / 'ft'
    val_file = next(a.split('=', 1)[1] for a in finetune_args if a.startswith('--val_file='))
    run_script(finetune, monkeypatch, *finetune_args[1:], '--epochs=1')  # the model to predict with
    capsys.readouterr()
    before = sorted(os.listdir(ft))
    real_start = finetuning.start
    monkeypatch.setattr(finetuning, 'start', lambda *a, **k: (os.kill(os.getpid(), signal.SIGTERM),
                                                              real_start(*a, **k))[1])
    request = GracefulExit(notice=finetune.UNDECIDED).install()
    monkeypatch.setattr(finetune, 'EXIT_REQUEST', request)
    monkeypatch.setattr(sys, 'argv', ['finetune.py', f'--init_from={ft}', f'--predict_file={val_file}',
                                      f'--predict_out={tmp_path / "p.jsonl"}', '--device=cpu'])
    try:
        code = exit_code(finetune.main)
    finally:
        request.uninstall()
    err = [line for line in capsys.readouterr().err.splitlines() if line]
    assert code == 130 and err == [
        "received SIGTERM: a fine-tune finishes its step, then saves a checkpoint; predictions alone (--predict_file "
        "without --train_file) stop at once",
        "stopped by SIGTERM before the work was done; it can't be resumed, and no output was left "
        "half-written (exit code 130)"], err
    assert sorted(os.listdir(ft)) == before and not (tmp_path / 'p.jsonl').exists()
