"""
The errors every script can end with and the exit code of each. This module imports nothing of ours,
so every other module (and configurator.py) may import it without a cycle.

  UserError      something the user can fix (a setting, a missing file, a bad checkpoint): one line, exit 2
  ConfigError    a bad config file or --key=value (a UserError); ConfigFileError: the file itself
  MachineError   what this machine can't give: a device, a backend, an environment variable, memory (a UserError)
  TokenizerError text a tokenizer can't encode, tokenizer files that can't be used (a UserError)
  Interrupted    a signal stopped the run after it saved: exit 75, "resume me"
  PeerFailed     another rank failed at something all ranks depend on and said why: exit with its code
  NothingToDo    the work was done before (a requeued job whose run is complete): one line, exit 0
and the lines some failures end with: a training step out of memory or with a non-finite loss, a weights
file that torch.load refused (load_error: a ckpt.pt, a Hugging Face pytorch_model.bin); printable writes
every error line's control characters escaped.

Usage:
    from nanogpt_plus.errors import UserError
    raise UserError("no token file at data/x/train.bin; run python data/x/prepare.py first")
"""

import os
import re
import stat

# the exit code of a run stopped cleanly by SIGTERM/SIGINT after saving its checkpoint: sysexits.h's
# EX_TEMPFAIL ("temporary failure, retry"), so a scheduler can tell "interrupted, resume me" from
# done (0), a user error (2), a crash (1) and a second Ctrl-C (130)
EXIT_INTERRUPTED = 75
EXIT_USER_ERROR = 2


class UserError(Exception):
    """
    Something the user can fix (missing data, bad checkpoint, bad option); the message says how.
    """


class ConfigError(UserError):
    """ A bad config file or command-line argument; the message says which and what to do. """


class ConfigFileError(ConfigError):
    """ A config file that is missing, unreadable or wrong: a file, which every node must have alike. """


class MachineError(UserError):
    """
    What this machine or its environment can't give (a device, a backend, an environment variable's
    value, the free memory): not a file a node lacks, so a verdict over nodes says so (every_rank).
    """


class TokenizerError(UserError):
    """
    A problem with a tokenizer the user can fix (missing files, unknown characters); the message
    says how.
    """


class Interrupted(Exception):
    """
    A signal stopped the run and its state is saved; run_main exits EXIT_INTERRUPTED without a
    traceback.
    """


class PeerFailed(Exception):
    """
    Rank 0 failed at something all ranks depend on (a checkpoint it alone writes) and prints why
    itself; the other ranks raise this to stop with the same exit code without printing the message
    a second time.
    """

    def __init__(self, message, code, say=None, line=None):
        super().__init__(message)
        self.code = code
        # a line run_main prints on this rank too: the first process of another node than the failed
        # rank's
        self.say = say
        # the failed rank's own line, on every rank: what run_main leaves for torchrun's summary
        self.line = line


class NothingToDo(Exception):
    """
    The work was done before: a requeued job (auto_resume) whose run is complete. Not an error: a
    scheduler must not run it again. run_main prints the message and exits 0.
    """


def exit_code(error):
    """
    The exit code a script ends with for error, so the ranks that didn't raise it can end alike.
    """
    if isinstance(error, PeerFailed):
        return error.code
    if isinstance(error, Interrupted):
        return EXIT_INTERRUPTED
    if isinstance(error, NothingToDo):
        return 0
    if isinstance(error, UserError):
        return EXIT_USER_ERROR
    return 130 if isinstance(error, KeyboardInterrupt) else 1


# the most characters a printed line keeps of what it echoes: a value a user gave (a setting, a
# YAML entry) can be megabytes, and a line of gigabytes once came of 440 bytes of YAML aliases
MAX_LINE_CHARS = 2000


def printable(text, limit=MAX_LINE_CHARS):
    """
    text as one line a terminal shows as it is: every character that is not printable (a newline,
    a tab, a terminal's escape sequence, a zero-width one) written as Python writes it in a string
    literal (\\n, \\x1b, \\u200b). The one place every error line goes through (runtime.run_main),
    so that a value a user gave can't break the line in two, forge a line of its own (one a script
    such as scripts/slurm_train.sh might read) or drive the terminal. Past limit characters the
    middle is cut, and the line says how much.
    """
    if len(text) > limit:
        keep = limit // 2
        text = f"{text[:keep]} [... {len(text) - 2 * keep:,} characters cut ...] {text[-keep:]}"
    return ''.join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def special_file(path):
    """
    What path is when it is there but is not a regular file ('a FIFO', 'a character device', 'a
    directory', ...), else None (a regular file, a link to one, or nothing at all). Told by os.stat
    alone: a FIFO is never opened, so asking can't block.
    """
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    kinds = ((stat.S_ISDIR, 'a directory'), (stat.S_ISFIFO, 'a FIFO (named pipe)'),
             (stat.S_ISCHR, 'a character device'), (stat.S_ISBLK, 'a block device'),
             (stat.S_ISSOCK, 'a socket'))
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in kinds if test(mode)), 'not a regular file')


def error_line(error, limit=200):
    """
    'Type: the first line of its message' (cut to limit characters), for an error quoted inside
    ours.
    """
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:limit]}" if lines else type(error).__name__


def out_of_memory_error(iter_num, checkpoint_path, fsdp=True):
    """
    The one line a CUDA out-of-memory error in a training loop ends with: what to change so the step
    fits. Nothing is saved after it (a checkpoint needs memory too, and the step's state is
    half-done), so the last checkpoint, at checkpoint_path, stays as it was.
    """
    if os.path.exists(checkpoint_path):
        kept = f"the last checkpoint, {checkpoint_path}, is kept (nothing was saved after the error)"
        then = "resume with --init_from=resume"
    else:
        kept = f"no checkpoint had been saved to {os.path.dirname(checkpoint_path)} yet"
        then = "start again"
    fixes = [
        "a smaller --batch_size with more --gradient_accumulation_steps (the same tokens per step)",
        "--activation_checkpointing=True (recompute each Block in the backward pass)"
    ]
    if fsdp:
        fixes.append("--parallelism=fsdp under torchrun (shard the weights and optimizer state)")
    fixes.append("a smaller --block_size")
    return UserError(f"out of GPU memory at iter {iter_num}; {kept}. To fit, use " +
                     ", ".join(fixes[:-1]) + f" or {fixes[-1]}, then {then}")


def host_memory_error(error):
    """
    The one line (a UserError) for memory the machine could not give: torch's CPU allocator failing
    ('DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes') or Python's
    MemoryError, anywhere in a script (a resume or a source with a huge batch_size, a long
    block_size in bench.py, millions of samples); None for any other error. A CUDA out-of-memory has
    lines of its own (out_of_memory_error).
    """
    text = str(error)
    if isinstance(error, MemoryError):
        asked = "memory"
    elif isinstance(error, RuntimeError) and "DefaultCPUAllocator" in text:
        found = re.search(r"allocate (\d+) bytes", text)
        asked = f"{int(found.group(1)) / 2**30:,.1f} GiB" if found else "memory"
    else:
        return None
    return UserError(f"this machine could not allocate {asked} (out of CPU memory); use a smaller "
                     f"--batch_size, --block_size or model (sample.py: fewer --num_samples), or a "
                     f"machine with more memory")


def non_finite_loss(value, iter_num, checkpoint_path):
    """
    The one line a NaN or infinite loss stops a training run with: nothing is saved over the last
    good state, the checkpoint at checkpoint_path.
    """
    out_dir = os.path.dirname(checkpoint_path) or '.'
    if os.path.exists(checkpoint_path):
        kept = f"so the last good checkpoint in {out_dir} is kept"
        then = "resume with --init_from=resume"
    else:
        kept = f"and no checkpoint had been saved to {out_dir} yet"
        then = "start again"
    return UserError(
        f"loss is {value} at iter {iter_num}; stopping without saving, {kept}. Lower the learning "
        f"rate (or use --dtype=bfloat16/float32) and {then}")


def load_error(path, error):
    """
    The one line for a file torch.load refused (a ckpt.pt, a Hugging Face pytorch_model.bin): a
    pickled Python object (unsafe), else corrupt. Never torch's own text around it, which advises
    loading with weights_only=False, i.e. running the file's code.
    """
    text = str(error)
    # torch names the global it refused: 'Unsupported global: GLOBAL x.y' or 'unsupported GLOBAL x.y
    # whose ...'
    found = re.search(r"unsupported (?:global: )?GLOBAL (\S+)", text, re.IGNORECASE)
    if found:
        return UserError(
            f"checkpoint {path} holds a pickled Python object ({found.group(1)}) that loading could "
            f"run as code; this project loads only tensors and plain values. Use a checkpoint written "
            f"by this project, or re-save the file's tensors with torch.save in a trusted session")
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and 'weights_only' not in ln]
    detail = next(
        (ln for ln in lines if not ln.startswith(('Please file', 'Check the documentation'))), '')
    # its first sentence: what failed, not torch's guesses why
    detail = detail.split('. ')[0].rstrip('.')[:200]
    return UserError(
        f"checkpoint {path} is corrupt or truncated ({type(error).__name__}: {detail}); "
        f"use another checkpoint")
