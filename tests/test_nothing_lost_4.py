"""
Nothing lost, round 4 (issue 42), the data-loss items: a prepare script refuses to replace
another dataset (another corpus, tokenizer or vocabulary) without --overwrite=True; the sweep of
killed runs' temp files removes only files this project named, and only once a run's checks
passed; a live run's out_dir takes no output of another script, --overwrite=True or not; a
checkpoint name taken by a directory is refused before any training.
"""
import fcntl
import json
import os
import runpy
import shutil
import socket
import sys

import pytest

import export_hf
import finetune
import train
from helpers import REPO, dead_pid, exit_code, run_script, start_python, train_args
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import remove_stale_temps_in, temp_path
from nanogpt_plus.outputs import LOCK_NAME, OutDirLock, check_output

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

TEXT = os.path.join(REPO, "data", "text", "prepare.py")
CHAR = os.path.join(REPO, "data", "shakespeare_char", "prepare.py")
GPT2 = os.path.join(REPO, "data", "shakespeare", "prepare.py")


def prepare(monkeypatch, script, *args):
    """ A data/<name>/prepare.py in this process, as a command line runs it: its exit code. """
    monkeypatch.setattr(sys, "argv", ["prepare.py", *args])
    return exit_code(runpy.run_path(script)["main"])


def contents(directory):
    """ Every file in directory (not below it) and its bytes. """
    names = sorted(os.listdir(directory))
    return {n: (directory / n).read_bytes() for n in names if (directory / n).is_file()}


def dead_runs_temp(final, pid):
    """ The temp file a run of ours with this pid, killed while writing final, left behind. """
    ours = os.path.basename(temp_path(str(final)))  # this process's: the pid last
    return final.parent / f"{ours.rsplit('.', 1)[0]}.{pid}"


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture
def texts(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("to be or not to be, that is the question\n" * 60)
    other = tmp_path / "other.txt"
    other.write_text("all the world's a stage, and all the men and women merely players\n" * 40)
    return small, other


# -----------------------------------------------------------------------------
# 1. a prepare script replaces another dataset only with --overwrite=True

def test_another_corpus_tokenizer_or_vocabulary_is_refused_and_the_same_preparation_allowed(
        tmp_path, texts, monkeypatch, capsys):
    small, other = texts
    ds = tmp_path / "ds"
    cache = f"--cache_dir={tmp_path / 'cache'}"
    assert prepare(monkeypatch, CHAR, f"--input={small}", f"--out_dir={ds}") == 0
    made = contents(ds)
    assert set(made) == {"train.bin", "val.bin", "meta.json", "meta.pkl"}
    record = json.loads(made["meta.json"])["preparation"]
    assert record["tokenizer"] == "char"
    assert record["vocabulary"]["vocab_size"] == len(set(small.read_text()))
    capsys.readouterr()
    # the flips: another tokenizer (gpt2, a trained bpe) through data/text, another text,
    # GPT-2 BPE
    refused = {
        (TEXT, f"--input={small}", "--tokenizer=gpt2", cache): "the corpus",
        (TEXT, f"--input={small}", "--tokenizer=bpe", "--vocab_size=260", cache): "the corpus",
        (CHAR, f"--input={other}"): f"then, a text of {len(other.read_text()):,} characters",
        (GPT2, f"--input={small}"): "the tokenizer char then, the tokenizer gpt2 now",
    }
    for (script, *args), words in refused.items():
        assert prepare(monkeypatch, script, *args, f"--out_dir={ds}") == 2
        line = one_error_line(capsys)
        assert line.startswith(f"error: {ds} holds another dataset: ") and words in line, line
        assert line.endswith("pass --overwrite=True to replace it, or another --out_dir")
        assert contents(ds) == made  # not a byte changed, meta.pkl still there
    # the same preparation again is a re-run: allowed, the same files
    assert prepare(monkeypatch, CHAR, f"--input={small}", f"--out_dir={ds}") == 0
    assert contents(ds) == made
    # data/text's own datasets: another vocabulary (the same corpus and tokenizer kind) is another
    # dataset too
    text_ds = tmp_path / "text_ds"
    common = (f"--input={small}", "--tokenizer=bpe", f"--out_dir={text_ds}", cache, "--num_proc=1")
    assert prepare(monkeypatch, TEXT, *common, "--vocab_size=260") == 0
    bpe = contents(text_ds)
    assert prepare(monkeypatch, TEXT, *common, "--vocab_size=260") == 0 and contents(text_ds) == bpe
    capsys.readouterr()
    assert prepare(monkeypatch, TEXT, *common, "--vocab_size=270") == 2
    assert "the tokenizer bpe of 260 tokens trained on the corpus then" in one_error_line(capsys)
    assert contents(text_ds) == bpe
    # --overwrite=True replaces it, and says so
    assert prepare(monkeypatch, TEXT, f"--input={small}", "--tokenizer=gpt2", f"--out_dir={ds}",
                   cache, "--overwrite=True") == 0
    assert f"--overwrite=True: replacing the dataset in {ds}" in capsys.readouterr().out
    assert json.loads((ds / "meta.json").read_text())["kind"] == "gpt2"
    assert not (ds / "meta.pkl").exists()


def test_a_dataset_that_records_no_preparation_is_refused(tmp_path, texts, monkeypatch, capsys,
                                                          tiny_dataset):
    """ Made by an earlier version, nanoGPT or by hand: nothing says it is the same dataset. """
    ds = tmp_path / "old"
    ds.mkdir()
    for name in ("train.bin", "val.bin", "meta.json"):  # conftest's tiny dataset, made by hand
        shutil.copy(os.path.join(tiny_dataset, name), ds / name)
    before = contents(ds)
    assert prepare(monkeypatch, CHAR, f"--input={texts[0]}", f"--out_dir={ds}") == 2
    assert "holds a dataset whose preparation is not recorded" in one_error_line(capsys)
    assert contents(ds) == before


# -----------------------------------------------------------------------------
# 2. the sweep of killed runs' temp files: only our names, only once the run is found to be ours

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


def test_a_users_temp_named_file_survives_train_and_prepare_in_the_current_directory(
        dataset, tmp_path, texts, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    thesis = work / ".thesis.tmp.4242"
    thesis.write_text("chapter 1")
    bin_like = work / f".train.bin.tmp.{dead_pid()}"
    bin_like.write_text("mine too")
    monkeypatch.chdir(work)
    train.main(train_args(dataset, ".", max_iters=1, eval_interval=1))  # --out_dir=.
    assert prepare(monkeypatch, CHAR, f"--input={texts[0]}", "--out_dir=.", "--overwrite=True") == 0
    assert thesis.read_text() == "chapter 1" and bin_like.read_text() == "mine too"


def test_a_refused_run_sweeps_nothing(dataset, tmp_path, capsys):
    """ The earlier run's checkpoint makes the new run a refusal: it leaves out_dir as it was. """
    args = train_args(dataset, tmp_path, max_iters=1, eval_interval=1)
    train.main(args)
    ours = dead_runs_temp(tmp_path / "ckpt.pt", dead_pid())
    ours.write_text("half a checkpoint")
    before = contents(tmp_path)
    assert exit_code(lambda: train.main(args)) == 2
    assert "already holds the checkpoint ckpt.pt" in one_error_line(capsys)
    assert contents(tmp_path) == before


# -----------------------------------------------------------------------------
# 3. a live run's out_dir takes no output, --overwrite=True or not

def hold_lock_as_another_run(directory):
    """ run.lock flocked by a file of this process but naming another pid: a live run to others. """
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": 1, "host": socket.gethostname(), "started": "today"}).encode())
    return fd


def test_check_output_refuses_a_live_runs_out_dir_but_not_our_own(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    fd = hold_lock_as_another_run(run)
    try:
        for path, kind in ((run, "directory"), (run / "eval.json", "file")):
            live = r"is in the out_dir of a live run \(pid 1 on .*--overwrite=True or not"
            with pytest.raises(UserError, match=live):
                check_output(str(path), "x", overwrite=True, kind=kind)
        check_output(str(run / "hf"), "hf_dir", overwrite=False, kind="directory")  # below it: fine
    finally:
        os.close(fd)
    check_output(str(run), "hf_dir", overwrite=False, kind="directory")  # the run ended
    lock = OutDirLock(str(run)).acquire()  # this process's own run: its outputs may go there
    try:
        check_output(str(run / "predictions.jsonl"), "predict_out", overwrite=False)
    finally:
        lock.release()


LOCK_HOLDER = ("import sys, time\n"
               "from nanogpt_plus.outputs import OutDirLock\n"
               "OutDirLock(sys.argv[1]).acquire()\n"
               "print('held', flush=True)\n"
               "time.sleep(300)\n")


def test_a_live_lock_refuses_prepare_and_export_even_with_overwrite(dataset, tmp_path, texts,
                                                                    monkeypatch, capsys):
    """ A real process holds the run's lock: prepare.py and export_hf.py into it change nothing. """
    run = tmp_path / "run"
    # a run's files: ckpt.pt, metrics.jsonl
    train.main(train_args(dataset, run, max_iters=1, eval_interval=1))
    holder = start_python(["-c", LOCK_HOLDER, str(run)], env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        before = contents(run)
        capsys.readouterr()
        text = f"--input={texts[0]}"
        for script, args in ((TEXT, (text, "--tokenizer=char")), (CHAR, (text,))):
            assert prepare(monkeypatch, script, *args, f"--out_dir={run}", "--overwrite=True") == 2
            assert one_error_line(capsys) == (
                f"error: {run} is the out_dir of a live training run (its run.lock is held), which "
                f"no dataset may be written into, --overwrite=True or not; pass another --out_dir")
        assert exit_code(lambda: run_script(export_hf, monkeypatch, f"--out_dir={run}",
                                            f"--hf_dir={run}", "--overwrite=True")) == 2
        line = one_error_line(capsys)
        assert line.startswith(
            f"error: --hf_dir={run} is in the out_dir of a live run (pid {holder.pid} on ")
        assert contents(run) == before
    finally:
        holder.kill()
        holder.communicate()


# -----------------------------------------------------------------------------
# 4. a checkpoint name taken by a directory: refused before any training

def test_auto_resume_with_ckpt_pt_a_directory_is_refused_before_any_step(dataset, tmp_path, capsys):
    (tmp_path / "ckpt.pt").mkdir()
    assert exit_code(lambda: train.main(train_args(dataset, tmp_path, auto_resume=True))) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        f"error: {tmp_path / 'ckpt.pt'} is not a file (a directory or another kind of file is in "
        f"its place), so this run could not save its checkpoint there; move it away, or pass "
        f"another --out_dir")
    assert "iter 0" not in captured.out and sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


def test_finetune_with_its_checkpoint_name_a_directory_is_refused_before_any_step(
        tmp_path, monkeypatch, capsys):
    from test_finetune import make_source, make_task
    src = make_source(tmp_path / "src")
    train_file, val_file = make_task(tmp_path, "classification", n_train=16, n_val=4)
    out = tmp_path / "ft"
    (out / "ckpt_last.pt").mkdir(parents=True)
    args = (f"--init_from={src}", f"--out_dir={out}", f"--train_file={train_file}",
            f"--val_file={val_file}", "--task=classification", "--device=cpu", "--auto_resume=True")
    assert exit_code(lambda: run_script(finetune, monkeypatch, *args)) == 2
    assert f"error: {out / 'ckpt_last.pt'} is not a file" in one_error_line(capsys)
    assert sorted(os.listdir(out)) == ["ckpt_last.pt"]
