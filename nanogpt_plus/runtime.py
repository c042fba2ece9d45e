"""
How a script runs from start to end: run_main around its main() (errors the user can fix as one line
and exit code 2, a clean stop after a signal as 75, the process group torn down once, at the end of
a run that finished), and the provenance a run prints at start-up and keeps in its checkpoints
(its commit), with what every rank of a run must start from alike (same_start: its code, where
code_digest tells two copies at one commit apart, the checkpoint, weights, settings and data).

Usage:
    from nanogpt_plus.runtime import run_main
    if __name__ == '__main__':
        run_main(main)
"""

import functools
import json
import os
import subprocess
import sys
import time
import traceback

import torch

from nanogpt_plus.checkpoint import CHECKPOINT, checkpoint_path, load_checkpoint
from nanogpt_plus.dataset import SAME_DATA, data_digests, tokenizer_digest
from nanogpt_plus.distributed import destroy_distributed, lost_peer, several_processes
from nanogpt_plus.errors import (
    EXIT_USER_ERROR,
    Interrupted,
    PeerFailed,
    error_line,
    exit_code,
    host_memory_error,
    printable,
)
from nanogpt_plus.files import file_digest
from nanogpt_plus.init_from import is_hf_dir
from nanogpt_plus.machine import device_type_of
from nanogpt_plus.signals import Stopped, work_ended, work_started


def run_main(main):
    """
    Run a script's main(): errors the user can fix print as one line ('error: ...') and exit code 2;
    a clean stop after a signal (Interrupted) exits EXIT_INTERRUPTED (75), a second Ctrl-C 130, as
    does a signal that stopped work that can't resume (Stopped, said in one line). The
    process group is destroyed here, once main() has returned on every rank (a teardown is a
    collective of its own). Under torchrun a failing rank exits at once (os._exit, no interpreter
    shutdown and no teardown), so it never waits while its peers sit in a collective: they see it
    gone (gloo: 'Connection closed by peer') or torchrun stops them, and the whole job ends with the
    one message of the rank that failed. In every case the work is over once the exit code is known:
    a signal after that is said and changes nothing (signals.work_ended).
    """
    try:
        work_started()  # a signal that came during the imports stops the work here
        code = _run(main)
        work_ended(code)
    except Stopped as e:  # as main() ended, before work_ended: one line and 130, as any other
        code = _stopped(e)
        work_ended(code)
    record_exit_code(code)
    _exit(code)


# the directory scripts/slurm_train.sh names for a job: each rank writes its exit code there
# (rank-<RANK>), so that the job requeues from what the run did (75: stopped, resumable), never from
# lines in its log, which a value (an out_dir, a dataset name) echoed in an error could forge
EXIT_CODES_DIR = 'NANOGPT_EXIT_CODES_DIR'


def record_exit_code(code):
    """ This rank's exit code, into the EXIT_CODES_DIR the environment names (if any); whole or not at all. """
    directory = os.environ.get(EXIT_CODES_DIR)
    if not directory:
        return
    path = os.path.join(directory, f"rank-{os.environ.get('RANK', '0')}")
    try:
        with open(f"{path}.{os.getpid()}", 'w', encoding='utf-8') as f:
            f.write(f"{code}\n")
        os.replace(f"{path}.{os.getpid()}", path)
    except OSError as e:  # the job then ends as a failed one would: said, not requeued
        print(f"warning: could not record the exit code in {printable(path)} ({e.strerror or e})",
              file=sys.stderr)


def _run(main):
    """ main() to its end, said; returns the process's exit code. """
    try:
        main()
    # saved, and the script said how to resume; every rank stopped at one iteration
    except Interrupted as e:
        destroy_distributed()
        return exit_code(e)
    except PeerFailed as e:  # rank 0 said why; no teardown: a rank may still be gone
        # the first process of another node repeats the line, for whoever reads this node's log
        if e.say and e.code == 0:  # NothingToDo: not an error
            print(e.say)
        elif e.say:
            print(f"error: {printable(e.say)}", file=sys.stderr)
        if e.code == EXIT_USER_ERROR and e.line:
            # the same line as the failed rank's: torchrun's summary names it whichever rank it
            # takes for the first to fail
            record_for_torchrun(f"error: {printable(e.line)}")
        return exit_code(e)
    except Stopped as e:
        return _stopped(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except SystemExit as e:  # --help, or sys.exit() in main: the code it asks for
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except Exception as e:
        # the machine's memory ran out (not CUDA's): the user's to fix, as a CUDA out-of-memory is
        e = host_memory_error(e) or e
        # NothingToDo: a requeued job whose run is complete; said, exit 0 (every rank raised it: no
        # teardown, as for a user error)
        if exit_code(e) == 0:
            print(e)
            return 0
        # UserError, ConfigError, TokenizerError: the user's to fix
        if exit_code(e) == EXIT_USER_ERROR:
            print(f"error: {printable(str(e))}", file=sys.stderr)
            record_for_torchrun(f"error: {printable(str(e))}")
            return EXIT_USER_ERROR
        if not several_processes():
            traceback.print_exc()  # a bug of ours: the whole story
            return 1
        if lost_peer(e):  # a consequence, not the cause: the rank that failed has printed the cause
            print(
                f"rank {os.environ.get('RANK')}: stopping without saving, another process of this run is "
                f"gone ({error_line(e)})",
                file=sys.stderr)
        else:
            traceback.print_exc()
        return 1
    destroy_distributed()
    return 0


def record_for_torchrun(line):
    """
    Under torchrun, leave line in this worker's error file (TORCHELASTIC_ERROR_FILE, which the
    elastic agent sets for each worker and reads when the worker fails): its failure summary then
    shows the line as the worker's 'traceback' instead of "To enable traceback see: ...". The
    format is torch's ErrorHandler's ({"message": {"message", "extraInfo"}}) without the Python
    call stack, which the summary would show instead: a user's error has none worth reading.
    Nothing happens outside torchrun; a file that can't be written only leaves the summary as it
    was (the line is printed already).
    """
    path = os.environ.get('TORCHELASTIC_ERROR_FILE')
    if not path:
        return
    record = {'message': {'message': line, 'extraInfo': {'timestamp': str(int(time.time()))}}}
    try:
        with open(path, 'w', encoding='utf-8') as f:
            json.dump(record, f)
    except OSError:
        pass


def _stopped(stop):
    """ Say that a signal stopped work that can't resume (signals.Stopped); its exit code. """
    print(stop.line(), file=sys.stderr)
    return stop.code


def _exit(code):
    # with one process the exit functions (wandb, logging) run, then signals._end_now ends it
    # before the interpreter's teardown
    if not several_processes():
        if code:
            sys.exit(code)
        return  # the script ends as any Python program does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@functools.lru_cache(maxsize=None)
def git_commit():
    """ The current git commit of this checkout (with '+dirty' when modified), or 'unknown'. """
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(['git', 'rev-parse', '--short', 'HEAD'],
                                cwd=here,
                                capture_output=True,
                                text=True,
                                timeout=5).stdout.strip()
        dirty = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=no'], cwd=here,
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return 'unknown'
    return (commit + ('+dirty' if dirty else '')) if commit else 'unknown'


# this project's checkout: the directory above this package
PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=None)
def code_digest(root=PROJECT_DIR):
    """
    What tells two copies of this project's code apart beyond their commit (git_commit's '+dirty'
    says only that there are edits, not which): in a git checkout, a digest of the names and
    contents on disk of the tracked files that differ from HEAD ('no uncommitted changes' when
    none); without git, or outside a checkout, a digest of the project's .py files (those at root
    and in the package). Read from the files, not from `git diff`'s text, whose form depends on each
    node's git version and settings.
    """
    import hashlib
    digest = hashlib.sha256()
    try:
        top = _git(root, 'rev-parse', '--show-toplevel').strip()
        changed = _git(top, 'diff', 'HEAD', '--name-only', '--no-renames', '-z').split('\0')
    except (OSError, subprocess.SubprocessError):
        top = None  # no git, or no checkout here: the .py files themselves
    if top is not None:
        changed = sorted(name for name in changed if name)
        if not changed:
            return "git: no uncommitted changes"
        for name in changed:
            _digest_file(digest, top, name)
        return f"git: uncommitted changes {digest.hexdigest()[:16]}"
    package = os.path.join(root, 'nanogpt_plus')
    names = [n for n in os.listdir(root) if n.endswith('.py')]
    for folder, _, files in os.walk(package):
        names += [os.path.relpath(os.path.join(folder, n), root)
                  for n in files if n.endswith('.py')]
    for name in sorted(names):
        _digest_file(digest, root, name)
    return f"no git checkout: .py files {digest.hexdigest()[:16]}"


def _git(cwd, *args):
    """ git's output for args in cwd; a SubprocessError when git fails (not a checkout). """
    return subprocess.run(['git', *args], cwd=cwd, capture_output=True, text=True, timeout=5,
                          check=True).stdout


def _digest_file(digest, root, name):
    """
    Add the file root/name to digest: its name and files.file_digest (all of a source file; a large
    tracked data file is not read whole), or that it is gone.
    """
    try:
        content = file_digest(os.path.join(root, name))
    except OSError:  # deleted, or not a file
        content = '(none)'
    digest.update(f"{name}\0{content}\0".encode())


def provenance(device):
    """
    What produced a run: versions, commit and device, printed at start-up and kept in checkpoints.
    """
    info = {
        'torch': str(torch.__version__),
        'python': sys.version.split()[0],
        'git_commit': git_commit(),
        'device': str(device),
        'num_threads': torch.get_num_threads()
    }
    if device_type_of(device) == 'cuda':
        info['gpu'] = torch.cuda.get_device_name(torch.device(device))
    return info


# -----------------------------------------------------------------------------
# what every rank of a run must start from alike: its code, checkpoint, weights, settings and data

def same_start(settings_record, resumed=None, data=None, data_meta=None,
               resume_file=CHECKPOINT):
    """
    What every rank must start from alike (SAME_START, compared by distributed.every_rank's agree):
      commit, code   its copy of this project: its commit, its uncommitted changes (or .py files)
      checkpoint     the checkpoint it resumes (resumed: source_settings's path), or the one
                     auto_resume looked for and did not find (out_dir/resume_file)
      weights        the checkpoint (or Hugging Face directory) init_from names to start from
      settings       settings_record: all of them, once the source's are applied
      data           a digest of each file it reads (data: {name: path}; train.py compares its
                     dataset's in dataloader.training_data)
      tokenizer      its data's tokenizer description (data_meta: a dataset's meta, or None)
    """
    init_from, out_dir = settings_record['init_from'], settings_record['out_dir']
    looked_for = None
    if resumed is None and settings_record.get('auto_resume') and init_from != 'resume':
        looked_for = os.path.join(out_dir, resume_file)  # absent: else it would be resumed
    weights = None
    if init_from not in ('resume', 'scratch'):
        hf_dir = init_from if is_hf_dir(init_from) else None
        weights = checkpoint_path(init_from, out_dir) or hf_dir
    if init_from == 'resume' and resumed is None:  # eval.py: the checkpoint it evaluates
        resumed = checkpoint_path(init_from, out_dir)
    return {'commit': git_commit(), 'code': code_digest(),
            'checkpoint': checkpoint_state(resumed or looked_for),
            'weights': checkpoint_state(weights),
            'settings': settings_record,
            'data': data_digests(data or {}),
            'tokenizer': tokenizer_digest(data_meta)}


def checkpoint_state(path):
    """
    What a rank tells the others of a checkpoint it reads (None: it reads none): its path, its
    iter_num (None for weights without one) and digest (files.file_digest), both None when the file
    is not on this node. A Hugging Face directory's digest covers each of its files.
    """
    if path is None:
        return None
    state = {'path': path, 'iter_num': None, 'digest': None}
    if os.path.isdir(path):
        names = sorted(n for n in os.listdir(path) if os.path.isfile(os.path.join(path, n)))
        state['digest'] = ' '.join(f"{n}={file_digest(os.path.join(path, n))}" for n in names)
    elif os.path.isfile(path):
        state['digest'] = file_digest(path)
        iter_num = load_checkpoint(path).get('iter_num')  # memory-mapped: no tensor is read
        state['iter_num'] = iter_num if isinstance(iter_num, int) else None
    return state


def checkpoint_difference(states, places, entry='checkpoint'):
    """
    The line for checkpoints (checkpoint_state's, one per rank) that are not the same on every
    node, naming each node's iteration and which is newer (places: (host, node rank) per rank), or
    None when the ranks read different paths (their settings differ, which that entry says).
    entry: what the line calls them: 'checkpoint' (resumed or evaluated), or the weights init_from
    starts from.
    """
    nodes = {}  # node -> (where, state): the ranks of a node read the same file
    for (host, node), state in zip(places, states):
        nodes.setdefault(node, (f"node {node} ({host})", state))
    paths = {state['path'] if state else None for _, state in nodes.values()}
    if len(paths) > 1:
        return None
    path = paths.pop()
    have = [(where, s) for where, s in nodes.values() if s['digest'] is not None]
    lack = [where for where, s in nodes.values() if s['digest'] is None]
    share = "or keep it on a shared file system"
    if lack:
        where, state = max(have, key=lambda h: h[1]['iter_num'] or 0)
        return (f"the ranks differ in {entry}: {path} is on {where}{_at(state)} but not on "
                f"{', '.join(lack)}, so they would not start from the same point; copy it from "
                f"{where} to {path} on {', '.join(lack)} ({share}), then start again")
    iters = [s['iter_num'] for _, s in have]
    newest, kept = max(have, key=lambda h: h[1]['iter_num'] or 0)
    # one newest copy (a tie of two others at the top: which to keep is the user's call)
    if None not in iters and len({s['digest'] for _, s in have if s['iter_num'] == max(iters)}) == 1:
        others = [where for where, s in have if s['digest'] != kept['digest']]
        shown = ', '.join(f"iter {s['iter_num']} on {where}" for where, s in have)
        return (f"the ranks differ in {entry}: {path} is at {shown}; {newest} has the newer "
                f"one: copy it over {path} on {', '.join(others)} ({share}), then start again")
    shown = ', '.join(f"{s['digest']}{_at(s)} on {where}" for where, s in have)
    return (f"the ranks differ in {entry}: the copies of {path} differ ({shown}): they are of "
            f"different runs or partly copied; copy the one to start from to every node ({share})")


def _at(state):
    return f" (iter {state['iter_num']})" if state['iter_num'] is not None else ""


# what must be the same in every rank's same_start (distributed.every_rank's agree), in the order
# they are compared, and what to do: a line, or a function that writes the whole line
SAME_START = {
    'commit': "check out the same commit of this repository on every node",
    'code':
    "the nodes' copies of this repository hold different code at one commit (uncommitted changes; "
    "outside a git checkout, their .py files): commit or undo the changes and check out the same "
    "commit on every node, or copy one node's copy to the others",
    'checkpoint': checkpoint_difference,
    'weights': functools.partial(checkpoint_difference, entry="the weights init_from starts from"),
    'settings': "start every node with the same command line and config files",
    **SAME_DATA,
}
