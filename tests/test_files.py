"""
nanogpt_plus/files.py: atomic writes (a temp name, renamed when complete) for a checkpoint and a dataset alike, the
sweep of killed runs' temp files (only the names this project gave them), a full disk or a failed write as one line,
JSONL that is not UTF-8, and the file digest that tells contents of one size apart.
"""
import json
import os
import shutil

import pytest

from helpers import dead_pid, dead_runs_temp, run_train, run_with_file_size_limit, train_args
from nanogpt_plus import finetuning
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import WriteFailed, atomic_write, file_digest, remove_stale_temps_in
from nanogpt_plus.prepare.shakespeare import prepare_char


def test_atomic_write_is_the_dataset_writer_for_one_file(tmp_path):
    # a checkpoint goes through the same steps as train.bin: temp name
    # .<name>.nanogpt_plus.tmp.<pid>, renamed when complete
    seen = []

    def write(f):
        seen.append(os.path.basename(f.name))
        f.write(b"new")
    dead = tmp_path / ".ckpt.pt.nanogpt_plus.tmp.99999999"  # left by a save killed with SIGKILL
    dead.write_bytes(b"half")
    (tmp_path / "ckpt.pt").write_bytes(b"old")
    atomic_write(str(tmp_path / "ckpt.pt"), write)
    assert seen == [f".ckpt.pt.nanogpt_plus.tmp.{os.getpid()}"]
    assert (tmp_path / "ckpt.pt").read_bytes() == b"new" and not dead.exists()

    def crash(f):
        f.write(b"partial")
        raise OSError("disk full (simulated)")
    with pytest.raises(OSError, match="simulated"):
        atomic_write(str(tmp_path / "ckpt.pt"), crash)
    assert os.listdir(tmp_path) == ["ckpt.pt"] and (tmp_path / "ckpt.pt").read_bytes() == b"new"
    atomic_write(str(tmp_path / "sub" / "ckpt.json"), lambda f: f.write("{}\n"), binary=False)
    assert (tmp_path / "sub" / "ckpt.json").read_text(encoding="utf-8") == "{}\n"


@pytest.mark.usefixtures('one_thread')
def test_stale_temp_files_are_removed_at_start_up(dataset, tmp_path, capsys):
    dead = tmp_path / f".ckpt.pt.nanogpt_plus.tmp.{dead_pid()}"
    live = tmp_path / f".ckpt.pt.nanogpt_plus.tmp.{os.getppid()}"
    dead.write_bytes(b"half a checkpoint")
    live.write_bytes(b"another process is writing this one")
    out = run_train(capsys, train_args(dataset, tmp_path, max_iters=1)).out
    assert f"removed 1 temp file(s) that killed runs left in {tmp_path}: {dead.name}" in out
    assert not dead.exists() and live.exists()


@pytest.mark.usefixtures('one_thread')
def test_the_sweep_removes_only_files_this_project_named(tmp_path):
    pid = dead_pid()
    users = [tmp_path / ".thesis.tmp.4242", tmp_path / f".notes.txt.tmp.{pid}",
             tmp_path / f".ckpt.pt.tmp.{pid}"]
    for f in users:
        f.write_text("mine")
    ours = dead_runs_temp(tmp_path / "ckpt.pt", pid)
    ours.write_text("half a checkpoint")
    assert remove_stale_temps_in(str(tmp_path)) == [ours.name]
    assert all(f.read_text() == "mine" for f in users)


# too big for a pid, a non-ASCII digit, ...
ODD_PIDS = ("99999999999999999999", "\u00b2", "0", "2147483648", "-1")


@pytest.mark.usefixtures('one_thread')
def test_temp_names_with_odd_pid_suffixes_are_not_ours_and_crash_nothing(dataset, tmp_path, monkeypatch, capsys):
    """ .ckpt.pt.nanogpt_plus.tmp.99999999999999999999 made a resume end in OverflowError, '.²' eval.py in
    ValueError after scoring (its result lost): such names are left alone, and the run goes on. """
    from helpers import run
    out_dir, results = tmp_path / "out", tmp_path / "results"
    run_train(capsys, train_args(dataset, out_dir, max_iters=2, eval_interval=2))
    results.mkdir()
    odd = [d / f".{name}.nanogpt_plus.tmp.{pid}" for d, name in ((out_dir, "ckpt.pt"), (results, "eval.json"))
           for pid in ODD_PIDS]
    for f in odd:
        f.write_text("not ours")
    assert remove_stale_temps_in(str(out_dir)) == []
    # a resume, and an evaluation whose result goes beside them
    run_train(capsys, train_args(dataset, out_dir, max_iters=4, eval_interval=2, init_from="resume"))
    code, out, err = run("eval.py", monkeypatch, capsys, f"--init_from={out_dir}", f"--dataset={dataset}",
                         "--device=cpu", "--max_examples=2", "--num_threads=1",
                         f"--output_file={results / 'eval.json'}")
    assert code == 0 and "Traceback" not in err, err
    assert json.loads((results / "eval.json").read_text())["task"] == "loss"
    assert load_checkpoint(str(out_dir / "ckpt.pt"))["iter_num"] == 5
    assert all(f.read_text() == "not ours" for f in odd)
    assert sorted(os.listdir(results)) == sorted(["eval.json", *(f.name for f in odd if f.parent == results)])


@pytest.mark.usefixtures('one_thread')
def test_a_marked_temp_directory_of_a_dead_run_is_swept_whole(dataset, tmp_path, capsys):
    """ A directory under our mark (an output built beside its name, say) goes with what it holds; a live run's,
    a link's target and unmarked directories stay. """
    pid = dead_pid()
    ours = tmp_path / f".hf.nanogpt_plus.tmp.{pid}"
    (ours / "sub").mkdir(parents=True)
    (ours / "sub" / "model.safetensors").write_bytes(b"half an export")
    live = tmp_path / f".hf2.nanogpt_plus.tmp.{os.getppid()}"
    live.mkdir()
    users = tmp_path.parent / f"{tmp_path.name}-users"
    (users / "keep").mkdir(parents=True)
    (users / "keep" / "notes.txt").write_text("mine")
    link = tmp_path / f".link.nanogpt_plus.tmp.{pid}"
    os.symlink(users / "keep", link)  # the link is the temp: removed, never what it points to
    plain = tmp_path / f".thesis.tmp.{pid}"
    plain.mkdir()
    out = run_train(capsys, train_args(dataset, tmp_path, max_iters=1)).out
    assert f"removed 2 temp file(s) that killed runs left in {tmp_path}: " in out
    assert not ours.exists() and not os.path.lexists(link)
    assert live.is_dir() and plain.is_dir() and (users / "keep" / "notes.txt").read_text() == "mine"


@pytest.mark.usefixtures('one_thread')
def test_jsonl_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    # latin-1, not UTF-8
    path.write_bytes(b'{"text": "ok", "label": 0}\n{"text": "caf\xe9", "label": 1}\n')
    with pytest.raises(UserError, match=r"train.jsonl line 2 is not UTF-8 text \(byte 0xe9 at position 14\)"):
        finetuning.read_jsonl(str(path), "classification")


@pytest.mark.usefixtures('one_thread')
def test_full_disk_while_preparing_a_dataset(tmp_path):
    out = tmp_path / "ds"
    prepare_char("to be or not to be\n" * 100, str(out))  # a previous, complete dataset
    before = (out / "train.bin").read_bytes()
    text = tmp_path / "big.txt"
    text.write_text("all the world's a stage\n" * 2000)  # 48,000 characters: a 86 KB train.bin
    # another text: the earlier dataset is replaced only with --overwrite=True
    r = run_with_file_size_limit(["data/shakespeare_char/prepare.py", f"--input={text}",
                                  f"--out_dir={out}", "--overwrite=True"], 60_000)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: could not write {out / 'train.bin'} (File too large); the previous {out / 'train.bin'} is "
        f"unchanged. Make room on the disk (or fix the directory's permissions, or write somewhere else) and run again")
    assert (out / "train.bin").read_bytes() == before
    assert sorted(os.listdir(out)) == ["meta.json", "meta.pkl", "train.bin", "val.bin"]


@pytest.mark.usefixtures('one_thread')
def test_a_failed_write_is_a_user_error_and_an_oserror(tmp_path):
    def full(f):
        raise OSError(28, "No space left on device")
    with pytest.raises(WriteFailed) as e:
        atomic_write(str(tmp_path / "x.json"), full)
    # one line; and train.py's OSError path
    assert isinstance(e.value, UserError) and isinstance(e.value, OSError)
    assert e.value.errno == 28 and e.value.strerror == "No space left on device"
    assert str(e.value).startswith(f"could not write {tmp_path / 'x.json'} (No space left on device); no ")
    assert os.listdir(tmp_path) == []


def test_file_digest_tells_contents_of_one_size_apart_from_its_ends(tmp_path):
    a, b, c = (tmp_path / n for n in 'abc')
    a.write_bytes(bytes(range(256)) * 100)
    b.write_bytes(bytes(reversed(range(256))) * 100)  # the same size
    shutil.copy(a, c)
    assert file_digest(a) == file_digest(c) and file_digest(a) != file_digest(b)
    assert file_digest(a).startswith('25600:')
    # only the ends are read: a change in the middle of a file over two spans is not seen (the price of its speed)
    data = bytearray(a.read_bytes())
    data[12800] ^= 1
    c.write_bytes(bytes(data))
    assert file_digest(c, span=4096) == file_digest(a, span=4096) and file_digest(c) != file_digest(a)





# -----------------------------------------------------------------------------
# an input that is a FIFO or a device: refused before it is opened

def unblock_a_reader(fifo):
    """ Opens the FIFO's other end once a reader does, so that a regression that opens it ends (on
    EOF) rather than hanging the test run. """
    import threading

    def writer():
        with open(fifo, "wb"):
            pass
    threading.Thread(target=writer, daemon=True).start()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
@pytest.mark.parametrize("which", ["train.bin", "meta.json", "ckpt.pt", "config"])
def test_a_fifo_where_an_input_is_read_is_refused_unopened(which, dataset, tmp_path, monkeypatch, capsys):
    """ A FIFO where ckpt.pt, a dataset's meta.json or train.bin, or a config file is read used to block
    forever (deaf to SIGTERM): one line naming it, exit 2, nothing made. """
    from helpers import run, train_args
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    out_dir = tmp_path / "out"
    fifo = {"train.bin": data / "train.bin", "meta.json": data / "meta.json", "ckpt.pt": out_dir / "ckpt.pt",
            "config": tmp_path / "config.py"}[which]
    if which == "ckpt.pt":
        out_dir.mkdir()
    if fifo.exists():
        fifo.unlink()
    os.mkfifo(fifo)
    unblock_a_reader(fifo)
    listed = lambda: {d: sorted(set(os.listdir(d)) - {"out"}) for d in (tmp_path, data)}  # noqa: E731
    before = listed()
    if which == "ckpt.pt":
        args = ("sample.py", f"--out_dir={out_dir}", "--device=cpu")
    else:
        config = [str(fifo)] if which == "config" else []
        args = ("train.py", *config, *train_args(str(data), out_dir, num_threads=1))
    code, out, err = run(args[0], monkeypatch, capsys, *args[1:])
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, (code, err)
    assert lines[0].startswith("error: ") and f"{fifo} is a FIFO (named pipe), not a regular" in lines[0]
    # (an empty out_dir may be left for now: it is made before the data is read)
    assert listed() == before
    assert not out_dir.exists() or os.listdir(out_dir) == (["ckpt.pt"] if which == "ckpt.pt" else [])
