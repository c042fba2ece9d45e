"""
Every setting is checked before any work, a resume is checked against its checkpoint, and the inputs and
outputs a user can get wrong (token files, config files, JSONL, checkpoints, a full disk) end in one line.
"""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import bench
import eval as eval_script
import finetune
import sample
import train
from configurator import ConfigError, Settings, parse_config
from helpers import REPO, TINY_VOCAB, run_python, train_args
from model import GPT, GPTConfig
from nanogpt_plus import dataloader, finetuning
from nanogpt_plus.checkpoint import build_checkpoint, load_checkpoint, save_checkpoint
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import WriteFailed, atomic_write
from nanogpt_plus.init_from import ARCHITECTURE
from nanogpt_plus.runtime import run_main

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def train_settings(*args):
    """ train.py's settings for these --key=value arguments, as main() sees them. """
    return parse_config(train.DEFAULTS, list(args))


def copy_dataset(src, dst, meta=None, train_tokens=None):
    """ The dataset src copied to dst, with another meta.json and/or train.bin. """
    shutil.copytree(src, dst)
    if meta is not None:
        (dst / "meta.json").write_text(json.dumps(meta))
    if train_tokens is not None:
        np.asarray(train_tokens, dtype=np.uint16).tofile(dst / "train.bin")
    return str(dst)


# -----------------------------------------------------------------------------
# settings: every one checked in check_settings, one line naming it

BAD_TRAIN_SETTINGS = [
    ("--batch_size=0", "batch_size must be >= 1, got 0"),
    ("--block_size=0", "block_size must be >= 1"),
    ("--gradient_accumulation_steps=0", "gradient_accumulation_steps must be >= 1"),
    ("--max_iters=-1", "max_iters must be >= 0"),
    ("--eval_interval=0", "eval_interval must be >= 1"),
    ("--log_interval=0", "log_interval must be >= 1"),
    ("--eval_iters=0", "eval_iters must be >= 1"),
    ("--learning_rate=0", "learning_rate must be > 0.0"),
    ("--min_lr=-1e-5", "min_lr must be >= 0"),
    ("--warmup_iters=-1", "warmup_iters must be >= 0"),
    ("--lr_decay_iters=-5", "lr_decay_iters must be >= 0"),
    ("--dropout=1.0", "dropout must be >= 0.0 and < 1.0, got 1.0"),
    ("--dropout=-0.1", "dropout must be >= 0.0 and < 1.0"),
    ("--grad_clip=-1", "grad_clip must be >= 0.0, got -1.0"),
    ("--weight_decay=-0.1", "weight_decay must be >= 0"),
    ("--beta1=1.0", "beta1 must be >= 0.0 and < 1.0"),
    ("--beta2=-0.5", "beta2 must be >= 0.0 and < 1.0"),
    ("--n_layer=0", "n_layer must be >= 1"),
    ("--n_head=0", "n_head must be >= 1"),
    ("--n_embd=100", r"n_embd \(100\) must be divisible by n_head \(12\)"),
    ("--gelu=relu", "gelu must be 'none' or 'tanh', got 'relu'"),
    ("--attention=fast", "attention must be 'flash' or 'manual'"),
    ("--dtype=fp8", "dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got 'fp8'"),
    ("--backend=mpi", "backend must be"),
    ("--compile=yes", "compile must be None, True or False, got 'yes'"),
    ("--parallelism=zero3", "parallelism must be 'ddp' or 'fsdp'"),
    ("--num_threads=-1", "num_threads must be >= 0"),
    ("--seed=-3", "seed must be >= 0"),
    ("--out_dir=", "out_dir must not be empty"),
]


@pytest.mark.parametrize("arg, message", BAD_TRAIN_SETTINGS, ids=[a for a, _ in BAD_TRAIN_SETTINGS])
def test_bad_train_setting_is_one_line(arg, message):
    with pytest.raises(UserError, match=message):
        train.check_settings(train_settings(arg))


def test_bad_setting_exits_2_before_any_work(tmp_path, capsys):
    out_dir = tmp_path / "never"
    with pytest.raises(SystemExit) as e:
        run_main(lambda: train.main(["--batch_size=0", f"--out_dir={out_dir}", "--device=cpu"]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: batch_size must be >= 1, got 0; change --batch_size (or the config file that sets it)"]
    assert not out_dir.exists()  # nothing was made


def test_defaults_pass_and_settings_know_what_was_given(tmp_path):
    config_file = tmp_path / "c.py"
    config_file.write_text("n_layer = 12  # the default's value, but chosen\n")
    cfg = train_settings(str(config_file), "--batch_size=4", f"--out_dir={tmp_path}")
    train.check_settings(cfg)  # nanoGPT's defaults are all valid
    assert isinstance(cfg, Settings) and cfg.given == {"n_layer", "batch_size", "out_dir"}
    # what checkpoints save: a plain dict
    assert type(dict(cfg)) is dict and dict(cfg)["batch_size"] == 4


@pytest.mark.parametrize("check, settings, message", [
    (sample.check_settings, dict(sample.DEFAULTS, num_samples=0), "num_samples must be >= 1"),
    (sample.check_settings, dict(sample.DEFAULTS, top_k=0), "top_k must be >= 1"),
    (sample.check_settings, dict(sample.DEFAULTS, max_new_tokens=-1), "max_new_tokens must be >= 0"),
    (eval_script.check_settings, dict(eval_script.DEFAULTS, batch_size=0), "batch_size must be >= 1"),
    (eval_script.check_settings, dict(eval_script.DEFAULTS, stride=-2), "stride must be >= 0"),
    (finetune.check_settings, dict(finetune.DEFAULTS, warmup_frac=1.5), r"warmup_frac must be >= 0.0 and <= 1.0"),
    (finetune.check_settings, dict(finetune.DEFAULTS, epochs=0), "epochs must be >= 1"),
    (finetune.check_settings, dict(finetune.DEFAULTS, n_head=5), r"n_embd \(768\) must be divisible by n_head"),
    (bench.check_settings, dict(bench.DEFAULTS, dropout=1.5), "dropout must be"),
    (bench.check_settings, dict(bench.DEFAULTS, steps=0), "steps must be >= 1"),
])
def test_other_scripts_check_their_settings(check, settings, message):
    with pytest.raises(UserError, match=message):
        check(Settings(settings))  # as read_settings hands them: read as attributes


@pytest.mark.parametrize("body, error", [
    ("batch_size = 1 / 0\n", "ZeroDivisionError"),
    ("import not_a_module_anywhere\n", "ModuleNotFoundError"),
    ("batch_size = 4\nout_dir = undefined_name\n", "NameError"),
])
def test_config_file_that_raises_names_file_line_and_error(tmp_path, body, error):
    path = tmp_path / "bad_config.py"
    path.write_text(body)
    line = body.count("\n")  # the failing statement is the last line of each body
    with pytest.raises(ConfigError, match=rf"config file {path} failed on line {line} \({error}: .*\); fix that"):
        parse_config(train.DEFAULTS, [str(path)])


# -----------------------------------------------------------------------------
# resuming: checked against the checkpoint before any work

@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory):
    """ out_dir of a finished tiny run: its final checkpoint is at iter 7 (max_iters=6 + 1: the steps done). """
    out = tmp_path_factory.mktemp("trained")
    train.main(train_args(dataset, out, max_iters=6, eval_interval=3, num_threads=1))
    return out


@pytest.fixture
def run_dir(trained, tmp_path):
    """ A copy of the trained run, for a test to resume (or fail to resume) in. """
    return shutil.copytree(trained, tmp_path / "run")


def resume_args(dataset, run_dir, **settings):
    return train_args(dataset, run_dir, init_from="resume", num_threads=1, **settings)


@pytest.mark.parametrize("setting, saved", [("n_layer", 2), ("block_size", 16), ("gelu", "none")])
def test_resume_with_another_architecture_is_refused(dataset, run_dir, setting, saved):
    # block_size 8: smaller, would crop
    value = {"n_layer": 3, "block_size": 8, "gelu": "tanh"}[setting]
    before = (run_dir / "ckpt.pt").read_bytes()
    with pytest.raises(UserError, match=rf"--{setting}={value!r} but the checkpoint .* has {setting}={saved!r}"):
        train.main(resume_args(dataset, run_dir, **{setting: value}))
    assert (run_dir / "ckpt.pt").read_bytes() == before


def test_resume_takes_the_checkpoints_architecture(dataset, run_dir, capsys):
    # none of the model settings given: the defaults (GPT-2 124M, block_size 1024) give way to the checkpoint's
    args = [a for a in resume_args(dataset, run_dir, max_iters=8, eval_interval=4, lr_decay_iters=8)
            if a.split("=")[0][2:] not in ARCHITECTURE]
    train.main(args)
    assert "tokens per iteration will be: 128" in capsys.readouterr().out  # 2 x 4 x block_size 16
    ckpt = load_checkpoint(str(run_dir / "ckpt.pt"))
    assert ckpt["iter_num"] == 9  # the final checkpoint: max_iters + 1 steps done
    for key in ("n_layer", "n_head", "n_embd", "block_size", "bias"):
        # the saved settings describe the model
        assert ckpt["config"][key] == ckpt["model_args"][key], key
    assert ckpt["config"]["gelu"] == ckpt["model_extra_args"]["gelu"]


def test_resume_of_a_complete_run_says_so(dataset, run_dir):
    with pytest.raises(UserError, match=r"already complete: its checkpoint is at iter 7, past max_iters=6; .*"
                                        r"larger --max_iters"):
        train.main(resume_args(dataset, run_dir, max_iters=6))  # the finished run itself


def test_resume_on_another_character_vocabulary_is_refused(dataset, run_dir, tmp_path):
    # 'A'.. instead of 'a'..: same ids, other characters
    stoi = {chr(65 + i): i for i in range(TINY_VOCAB)}
    other = copy_dataset(dataset, tmp_path / "upper",
                         meta={"kind": "char", "vocab_size": TINY_VOCAB, "stoi": stoi})
    with pytest.raises(UserError, match="another character vocabulary .* would mean other tokens"):
        train.main(resume_args(other, run_dir))
    gpt2 = copy_dataset(dataset, tmp_path / "bpe", meta={"kind": "gpt2", "vocab_size": 50257})
    with pytest.raises(UserError, match=r"tokenized with gpt2 \(50,257 tokens\), the model .* with char \(20 tokens\)"):
        # its weights, another dataset
        train.main(train_args(gpt2, tmp_path / "new", init_from=str(run_dir)))


def test_a_finetune_checkpoint_is_not_resumed(dataset, tmp_path):
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=TINY_VOCAB))
    out = tmp_path / "out-ft"
    out.mkdir()
    # what finetune.py keeps in out_dir/ckpt.pt: the model and its task head, no optimizer state
    ckpt = build_checkpoint(model, 10, 1e9, {"dataset": dataset}, {"kind": "gpt2"}, {}, task="classification",
                            head={})
    save_checkpoint(ckpt, str(out / "ckpt.pt"))
    with pytest.raises(UserError, match=r"ckpt.pt is not a train.py training checkpoint \(it has no 'optimizer'.*"
                                        r"use --init_from=.*ckpt.pt"):
        train.main(train_args(dataset, out, init_from="resume"))


# -----------------------------------------------------------------------------
# token files

@pytest.mark.parametrize("scan_tokens", [dataloader.SCAN_TOKENS, 0], ids=["whole-file", "per-batch"])
def test_token_id_beyond_the_vocabulary_is_one_line(dataset, tmp_path, monkeypatch, scan_tokens):
    tokens = np.tile(np.arange(TINY_VOCAB), 300)
    tokens[::7] = TINY_VOCAB + 5  # a meta of 20 characters, a file with id 25 (in every window)
    bad = copy_dataset(dataset, tmp_path / "bad", train_tokens=tokens)
    # 0: every file is checked batch by batch
    monkeypatch.setattr(dataloader, "SCAN_TOKENS", scan_tokens)
    message = rf"train.bin holds token ids up to {TINY_VOCAB + 5}, beyond the model's vocab_size \({TINY_VOCAB}\)"
    with pytest.raises(UserError, match=message):
        train.main(train_args(bad, tmp_path / "out", num_threads=1))
    with pytest.raises(UserError, match=message):
        bench.main(["--device=cpu", "--n_layer=1", "--n_head=1", "--n_embd=8", "--block_size=16",
                    "--batch_size=64", "--burnin=0", "--steps=3", "--num_threads=1", f"--dataset={bad}"])


def test_empty_token_file_is_one_line(dataset, tmp_path):
    empty = copy_dataset(dataset, tmp_path / "empty", train_tokens=[])
    with pytest.raises(UserError, match=r"train.bin is empty \(0 tokens\); re-run"):
        train.main(train_args(empty, tmp_path / "out"))


# -----------------------------------------------------------------------------
# files a user gives: JSONL, checkpoints

def test_jsonl_that_is_not_utf8_names_file_and_line(tmp_path):
    path = tmp_path / "train.jsonl"
    # latin-1, not UTF-8
    path.write_bytes(b'{"text": "ok", "label": 0}\n{"text": "caf\xe9", "label": 1}\n')
    with pytest.raises(UserError, match=r"train.jsonl line 2 is not UTF-8 text \(byte 0xe9 at position 14\)"):
        finetuning.read_jsonl(str(path), "classification")


def test_unsafe_checkpoint_is_explained_in_our_words(tmp_path):
    path = tmp_path / "ckpt.pt"
    # a numpy scalar
    torch.save({"model": {}, "model_args": {}, "best_val_loss": np.float64(1.5)}, path)
    with pytest.raises(UserError) as e:
        load_checkpoint(str(path))
    message = str(e.value)
    assert "holds a pickled Python object (numpy" in message and "multiarray.scalar" in message
    assert "only tensors and plain values" in message and "written by this project" in message
    assert "weights_only" not in message and "\n" not in message
    path.write_bytes(path.read_bytes()[:200])  # truncated: a clear one-liner of its own
    with pytest.raises(UserError, match=r"ckpt.pt is corrupt or truncated \(\w+: [^\n]*\); use another checkpoint$"):
        load_checkpoint(str(path))


# -----------------------------------------------------------------------------
# a full disk: a real failing write (RLIMIT_FSIZE: writes past the limit fail with EFBIG)

def run_with_file_size_limit(args, limit_bytes):
    """ python args in a process whose files can't grow past limit_bytes (SIGXFSZ ignored: an EFBIG error). """
    def limit():
        import resource
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return run_python([*args], timeout=120,
                          preexec_fn=limit, env=env)


def test_full_disk_while_saving_a_checkpoint(dataset, run_dir):
    before = (run_dir / "ckpt.pt").read_bytes()
    assert len(before) > 100_000  # the limit below stops the checkpoint, not the small logs
    r = run_with_file_size_limit(["train.py", *resume_args(dataset, run_dir, max_iters=9, eval_interval=9)], 100_000)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        f"error: could not write the checkpoint {run_dir / 'ckpt.pt'} (File too large); make room")
    assert (run_dir / "ckpt.pt").read_bytes() == before  # the previous checkpoint is kept
    assert not [f for f in os.listdir(run_dir) if ".tmp." in f]  # and no temp file is left


def test_full_disk_while_preparing_a_dataset(tmp_path):
    from nanogpt_plus.prepare.shakespeare import prepare_char
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


def test_full_disk_is_found_before_a_large_split_is_memory_mapped(tmp_path, monkeypatch):
    from nanogpt_plus.files import atomic_outputs
    from nanogpt_plus.prepare.token_files import write_token_batches

    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")
    # as on a full disk: an error, not a SIGBUS later
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(WriteFailed, match=r"could not write .*train.bin \(No space left on device\); no "):
        with atomic_outputs(str(tmp_path)) as out:
            write_token_batches(out.path("train.bin"), 10, iter([np.arange(10)]))
    assert os.listdir(tmp_path) == []


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
