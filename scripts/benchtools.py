"""
What the benchmark scripts share (not an entry point): their lists of integers (--num_procs), a scratch
directory, a JSONL corpus, the CPU seconds of a process and its workers, a process run with one clear line when it
fails, and the CPU the figures were measured on.

Usage (from a script in scripts/, which Python puts on sys.path):
    from benchtools import (cpu_model, cpu_seconds, parse_ints, parse_num_procs, run_checked, work_directory,
                            write_jsonl_corpus)
"""
import json
import os
import platform
import shutil
import subprocess
import tempfile
from contextlib import contextmanager

from nanogpt_plus.errors import UserError


def parse_ints(text, setting):
    """ --setting=1,2,4 -> [1, 2, 4] (one line on anything else). """
    try:
        return [int(p) for p in text.split(",")]
    except ValueError:
        raise UserError(f"--{setting} must be comma-separated integers, got {text!r}") from None


def parse_num_procs(text):
    return parse_ints(text, 'num_procs')


@contextmanager
def work_directory(work_dir, prefix):
    """ work_dir (kept), or a new temporary directory removed at the end of the block. """
    work = work_dir or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(work, exist_ok=True)
    try:
        yield work
    finally:
        if not work_dir:
            shutil.rmtree(work, ignore_errors=True)


def cpu_seconds():
    """ User + system CPU seconds of this process and its finished children (the tokenizer workers). """
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def cpu_model():
    """ lscpu's 'Model name' (what the figures were measured on), else platform's guess. """
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    names = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")]
    return names[0] if names else platform.processor() or "unknown"


def write_jsonl_corpus(path, documents):
    """ A JSONL corpus, {"text": document} per line (what prepare.py's --input/--files read); its size in bytes. """
    written = 0
    with open(path, "w", encoding="utf-8") as f:
        for doc in documents:
            line = json.dumps({"text": doc}) + "\n"
            f.write(line)
            written += len(line)
    return written


def run_checked(cmd, what, cwd=None, env=None):
    """ Run cmd as a process; its stdout, or one line naming what failed with its last line of output. """
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ['no output']
        raise UserError(f"{what} failed (exit code {proc.returncode}): {tail[0]}")
    return proc.stdout
