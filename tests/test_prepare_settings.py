"""
The settings of the dataset scripts (data/*/prepare.py) and of scripts/*.py, each declared once as a Schema with
a one-line help: --help lists every setting with its default and help, a wrong type or range is one line and exit
code 2 before any work. And the out_dir rule (nanogpt_plus/outputs.py check_out_dir): no prepare script
writes where another kind of dataset or a training run lies, unless --overwrite=True; the same kind again is fine.
In-process (runpy) and offline, but for two real command lines.
"""
import os
import re
import runpy
import signal
import sys

import numpy as np
import pytest

from configurator import Schema
from helpers import REPO, run_python
from nanogpt_plus.dataloader import TokenWindowLoader
from nanogpt_plus.dataset import find_shards, split_files
from nanogpt_plus.dataset.shards import write_shard
from nanogpt_plus.errors import UserError
from nanogpt_plus.outputs import RAW, RUN_FILES, SHARDS, check_out_dir
from nanogpt_plus.prepare.shakespeare import TINY_SHAKESPEARE_URL
from nanogpt_plus.settings import default_num_proc

DATA = {name: os.path.join(REPO, "data", name) for name in
        ("text", "fineweb", "openwebtext", "shakespeare", "shakespeare_char")}

# every dataset script's settings with the defaults they had as plain dicts (names and defaults are the interface)
DATA_SETTINGS = {
    "text": dict(input='', dataset='', name='', text_column='text', sample_by='document', tokenizer='bpe',
                 vocab_size=8192, val_fraction=0.1, seed=2357, num_proc=default_num_proc(), out_dir=DATA["text"],
                 cache_dir='', overwrite=False),
    "fineweb": dict(dataset='HuggingFaceFW/fineweb-edu', name='sample-10BT', files='', text_column='text',
                    streaming=False, num_proc=default_num_proc(), shard_size=10 ** 8, max_tokens=0,
                    prefix='edufineweb', tokenizer='gpt2', out_dir=DATA["fineweb"], overwrite=False),
    "openwebtext": dict(dataset='openwebtext', name='', files='', text_column='text', sample_by='paragraph',
                        num_proc=default_num_proc(), test_size=0.0005, seed=2357, total_batches=1024,
                        out_dir=DATA["openwebtext"], cache_dir='', overwrite=False),
    "shakespeare": dict(input='', out_dir=DATA["shakespeare"], url=TINY_SHAKESPEARE_URL, timeout=10.0,
                        overwrite=False),
    "shakespeare_char": dict(input='', out_dir=DATA["shakespeare_char"], url=TINY_SHAKESPEARE_URL, timeout=10.0,
                             overwrite=False),
}

# one value of the wrong type per script, and the words of its one-line error
WRONG_TYPE = {
    "data/text/prepare.py": ("--vocab_size=big", "--vocab_size: vocab_size expects int, got str ('big')"),
    "data/fineweb/prepare.py": ("--streaming=yes", "--streaming: streaming expects bool, got str ('yes')"),
    "data/openwebtext/prepare.py": ("--num_proc=2.5", "--num_proc: num_proc expects int, got float (2.5)"),
    "data/shakespeare/prepare.py": ("--timeout=soon", "--timeout: timeout expects float, got str ('soon')"),
    "data/shakespeare_char/prepare.py": ("--overwrite=yes", "--overwrite: overwrite expects bool, got str ('yes')"),
    "scripts/plot_metrics.py": ("{tmp}/config.py", "config.py: out_dir expects str, got int (3)"),
    "scripts/bench_fineweb_prepare.py": ("--size_mb=big", "size_mb expects int, got str ('big')"),
    "scripts/bench_loader.py": ("--batch_size=1.5", "batch_size expects int, got float (1.5)"),
    "scripts/bench_prepare.py": ("--seed=x", "seed expects int, got str ('x')"),
    "scripts/bench_sample.py": ("--threads=two", "threads expects int, got str ('two')"),
    "scripts/bench_tokenizer.py": ("--max_iters=many", "max_iters expects int, got str ('many')"),
    "scripts/bench_train_cpu.py": ("--rounds=None", "rounds expects int, got None"),
    "scripts/bench_weights.py": ("--repeats=3.5", "repeats expects int, got float (3.5)"),
    "scripts/finetune_demo.py": ("--pretrain_iters=lots", "pretrain_iters expects int, got str ('lots')"),
}
SCRIPTS = list(WRONG_TYPE)


def run(script, monkeypatch, capsys, *args):
    """ `python SCRIPT ARGS` in this process: (exit code, stdout, stderr). """
    # scripts/*.py import benchtools beside them
    monkeypatch.syspath_prepend(os.path.join(REPO, "scripts"))
    monkeypatch.setattr(sys, "argv", [script, *args])
    code = 0
    try:
        runpy.run_path(os.path.join(REPO, script), run_name="__main__")
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def schema_of(script):
    """ The script's DEFAULTS, read without running its main(). """
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        return runpy.run_path(os.path.join(REPO, script), run_name="settings_probe")["DEFAULTS"]
    finally:
        sys.path.remove(os.path.join(REPO, "scripts"))


def assert_one_line_error(code, err, message):
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


# -----------------------------------------------------------------------------
# Task 1: settings declared once, with help

@pytest.mark.parametrize("script", SCRIPTS)
def test_every_setting_is_declared_with_a_one_line_help_and_a_valid_default(script):
    schema = schema_of(script)
    assert isinstance(schema, Schema)
    for key, spec in schema.specs.items():
        assert spec.help.strip() and "\n" not in spec.help, key
        assert spec.problem(key, spec.default) is None, key


@pytest.mark.parametrize("name", DATA_SETTINGS)
def test_dataset_scripts_keep_their_settings_and_defaults(name):
    # the names and defaults of the plain dicts these schemas replaced, plus overwrite
    assert dict(schema_of(f"data/{name}/prepare.py")) == DATA_SETTINGS[name]


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_lists_every_setting_with_its_default_and_help(script, monkeypatch, capsys):
    code, out, _ = run(script, monkeypatch, capsys, "--help")
    assert code == 0
    lines = out.split("\nsettings (config files")[1].splitlines()  # the list after the script's doc
    for key, spec in schema_of(script).specs.items():
        at = next((i for i, line in enumerate(lines) if line.strip().startswith(f"--{key} ")), None)
        assert at is not None, key
        assert lines[at].endswith(f"= {spec.default!r}") and lines[at + 1].strip() == spec.help, lines[at:at + 2]


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_value_of_the_wrong_type_is_one_line_and_exit_code_2(script, tmp_path, monkeypatch, capsys):
    (tmp_path / "config.py").write_text("out_dir = 3\n")
    arg, message = WRONG_TYPE[script]
    code, _, err = run(script, monkeypatch, capsys, arg.format(tmp=tmp_path))
    assert_one_line_error(code, err, message)


# a value of the right type that the script can't use: refused by the schema, before anything is read or written
OUT_OF_RANGE = [
    ("text", "--vocab_size=256", "vocab_size must be >= 257, got 256"),
    ("text", "--val_fraction=1.5", "val_fraction must be > 0.0 and < 1.0, got 1.5"),
    ("text", "--val_fraction=0", "val_fraction must be > 0.0 and < 1.0, got 0.0"),
    ("text", "--sample_by=sentence", "sample_by must be 'line', 'paragraph' or 'document', got 'sentence'"),
    ("text", "--num_proc=0", "num_proc must be >= 1, got 0"),
    ("openwebtext", "--test_size=1", "test_size must be > 0.0 and < 1.0, got 1.0"),
    ("openwebtext", "--sample_by=lines", "sample_by must be 'line', 'paragraph' or 'document', got 'lines'"),
    ("fineweb", "--shard_size=0", "shard_size must be >= 1 and <= 2147483647, got 0"),
    ("fineweb", "--shard_size=2147483648", "shard_size must be >= 1 and <= 2147483647, got 2147483648"),
    ("fineweb", "--max_tokens=-1", "max_tokens must be >= 0, got -1"),
    ("fineweb", "--num_proc=-2", "num_proc must be >= 1, got -2"),
    ("shakespeare", "--timeout=0", "timeout must be > 0, got 0.0"),
    ("shakespeare_char", "--timeout=-1", "timeout must be > 0, got -1.0"),
]


@pytest.mark.parametrize("name, arg, message", OUT_OF_RANGE)
def test_a_value_out_of_range_is_one_line_before_any_work(name, arg, message, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    code, _, err = run(f"data/{name}/prepare.py", monkeypatch, capsys, arg, f"--out_dir={out}",
                       f"--input={tmp_path / 'missing.txt'}" if name in ("text", "shakespeare", "shakespeare_char")
                       else f"--files={tmp_path / 'missing.jsonl'}")
    assert_one_line_error(code, err, message)
    assert not out.exists()


def test_the_real_command_lines(tmp_path):
    # the two paths in a fresh interpreter: --help prints the manual, exit 0; a bad choice is one line, exit 2
    r = run_python(["data/fineweb/prepare.py", "--help"], timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("FineWeb-Edu for GPT-2"), r.stderr
    assert "  --overwrite   = False\n      True: write even where out_dir holds another dataset" in r.stdout
    r = run_python(["scripts/bench_sample.py", "--which=all"], timeout=120)
    assert r.returncode == 2 and r.stderr == "error: which must be 'both', 'gpt2' or 'char', got 'all'\n", r.stderr


# -----------------------------------------------------------------------------
# Task 2: an output never replaces another kind of data

def shard_dir(path):
    """ A directory of llm.c shards as data/fineweb/prepare.py leaves it (the tokens need not be real ones). """
    path.mkdir()
    write_shard(str(path / "edufineweb_val_000000.bin"), np.arange(100, dtype=np.uint16))
    write_shard(str(path / "edufineweb_train_000001.bin"), np.arange(100, dtype=np.uint16))
    (path / "meta.json").write_text('{"kind": "gpt2", "dtype": "uint16", "shards": []}')
    return path


def raw_dir(path):
    """ A directory holding nanoGPT's train.bin / val.bin and their meta. """
    path.mkdir()
    for split in ("train", "val"):
        np.arange(100, dtype=np.uint16).tofile(path / f"{split}.bin")
    (path / "meta.json").write_text('{"kind": "gpt2", "vocab_size": 50257, "dtype": "uint16"}')
    return path


def contents(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_run_files_are_the_training_scripts_names(tmp_path):
    """ What makes a directory a run's is what the training scripts write: checkpoint.py's names, the lock. """
    from nanogpt_plus.checkpoint import BEST, CHECKPOINT, LAST
    from nanogpt_plus.outputs import LOCK_NAME, run_files
    assert LOCK_NAME in RUN_FILES and "metrics.jsonl" in RUN_FILES
    names = [CHECKPOINT, BEST, LAST, "ckpt_2000.pt", *RUN_FILES]
    for name in names + ["ckpt.txt", "input.txt"]:
        (tmp_path / name).write_bytes(b"x")
    assert run_files(str(tmp_path)) == sorted(names)


@pytest.mark.parametrize("writes, make, holds", [(RAW, shard_dir, "a dataset of llm.c token shards"),
                                                 (SHARDS, raw_dir, "a train.bin/val.bin dataset")])
def test_another_kind_of_dataset_is_refused_and_overwrite_replaces_it(writes, make, holds, tmp_path, capsys):
    d = make(tmp_path / "d")
    before = contents(d)
    with pytest.raises(UserError) as e:
        check_out_dir(str(d), writes)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{d} holds {holds} (")
    assert message.endswith("; pass --overwrite=True to replace it, or another --out_dir")
    assert contents(d) == before  # nothing touched
    # overwrite: the other kind's token files and meta go, so the directory will hold one kind
    (d / "input.txt").write_text("kept")
    check_out_dir(str(d), writes, overwrite=True)
    assert sorted(os.listdir(d)) == ["input.txt"]
    assert "--overwrite=True: removed" in capsys.readouterr().out


@pytest.mark.parametrize("run_file", ["ckpt.pt", "ckpt_best.pt", "ckpt_1000.pt", "run.lock", "metrics.jsonl"])
@pytest.mark.parametrize("writes", [RAW, SHARDS])
def test_a_training_runs_out_dir_is_refused(run_file, writes, tmp_path):
    (tmp_path / run_file).write_bytes(b"x")
    with pytest.raises(UserError, match=rf"^{re.escape(str(tmp_path))} holds a training run's files \({run_file}\), "
                                        r"not a dataset; pass another --out_dir, or --overwrite=True"):
        check_out_dir(str(tmp_path), writes)
    check_out_dir(str(tmp_path), writes, overwrite=True)
    # overwrite writes beside a run's files, never removes them
    assert os.listdir(tmp_path) == [run_file]


def test_the_same_kind_again_or_a_new_directory_is_fine(tmp_path):
    check_out_dir(str(raw_dir(tmp_path / "raw")), RAW)
    check_out_dir(str(shard_dir(tmp_path / "shards")), SHARDS)
    check_out_dir(str(tmp_path / "new"), RAW)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "input.txt").write_text("text")  # a Shakespeare script's own download
    (tmp_path / "other" / "ckpt.txt").write_text("not a checkpoint")
    check_out_dir(str(tmp_path / "other"), SHARDS)


TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n" * 30


@pytest.mark.parametrize("name", ["shakespeare_char", "shakespeare", "text", "openwebtext"])
def test_every_raw_writer_refuses_a_directory_of_shards(name, tmp_path, monkeypatch, capsys):
    (tmp_path / "in.txt").write_text(TEXT)
    shards = shard_dir(tmp_path / "fineweb")
    before = contents(shards)
    source = f"--files={tmp_path / 'in.txt'}" if name == "openwebtext" else f"--input={tmp_path / 'in.txt'}"
    args = [source, f"--out_dir={shards}"] + (["--tokenizer=char"] if name == "text" else [])
    code, _, err = run(f"data/{name}/prepare.py", monkeypatch, capsys, *args)
    assert_one_line_error(code, err, f"{shards} holds a dataset of llm.c token shards (edufineweb_train_000001.bin, "
                                     f"edufineweb_val_000000.bin) and this script writes a train.bin/val.bin dataset; "
                                     f"pass --overwrite=True to replace it, or another --out_dir")
    # meta.json too: data/fineweb/prepare.py can still resume there
    assert contents(shards) == before


def test_the_shard_writer_refuses_a_raw_dataset_and_a_training_run(tmp_path, monkeypatch, capsys):
    raw = raw_dir(tmp_path / "raw")
    before = contents(raw)
    code, _, err = run("data/fineweb/prepare.py", monkeypatch, capsys, f"--out_dir={raw}")
    assert_one_line_error(code, err, f"{raw} holds a train.bin/val.bin dataset (train.bin, val.bin) and this script "
                                     f"writes a dataset of llm.c token shards; pass --overwrite=True")
    assert contents(raw) == before
    run_dir = tmp_path / "out"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    code, _, err = run("data/fineweb/prepare.py", monkeypatch, capsys, f"--out_dir={run_dir}")
    assert_one_line_error(code, err, f"{run_dir} holds a training run's files (metrics.jsonl), not a dataset")


def test_a_shakespeare_script_refuses_a_training_runs_out_dir_before_any_download(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out-shakespeare-char"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"a checkpoint")
    code, _, err = run("data/shakespeare_char/prepare.py", monkeypatch, capsys, f"--out_dir={out}", "--url=")
    assert_one_line_error(code, err, f"{out} holds a training run's files (ckpt.pt), not a dataset")
    assert os.listdir(out) == ["ckpt.pt"]  # no input.txt saved there either


def test_preparing_again_works_and_overwrite_replaces_shards(tmp_path, monkeypatch, capsys):
    (tmp_path / "in.txt").write_text(TEXT)
    out = tmp_path / "char"
    args = [f"--input={tmp_path / 'in.txt'}", f"--out_dir={out}"]
    for _ in range(2):  # the same kind into its own directory: no --overwrite needed
        code, _, err = run("data/shakespeare_char/prepare.py", monkeypatch, capsys, *args)
        assert code == 0, err
    first = contents(out)
    # a directory of shards, taken with --overwrite=True: one kind of token files after, which the loader reads
    shards = shard_dir(tmp_path / "shards")
    code, out_text, err = run("data/shakespeare_char/prepare.py", monkeypatch, capsys, args[0], f"--out_dir={shards}",
                              "--overwrite=True")
    assert code == 0, err
    assert "removed a dataset of llm.c token shards" in out_text
    assert contents(shards) == first
    assert find_shards(str(shards)) == ([str(shards / "train.bin")], [str(shards / "val.bin")])
    x, _ = TokenWindowLoader(split_files(str(shards), "train"), 2, 8, seed=0).next_batch()
    assert x.shape == (2, 8)


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
