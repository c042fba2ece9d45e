"""
nanogpt_plus/prepare/fineweb.py (data/fineweb/prepare.py) on a small local parquet corpus: exact token counts,
num_proc=2 == 1 byte for byte, streaming, interrupted runs resumed byte-identical, max_tokens, bounded memory, a raw
dataset refused without --overwrite=True, one-line errors. Offline.
"""
import json
import os
import runpy
import sys
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers import EOT, REPO
from nanogpt_plus.dataset import find_shards
from nanogpt_plus.dataset.shards import open_shard, read_header
from nanogpt_plus.errors import UserError
from nanogpt_plus.prepare import fineweb
from nanogpt_plus.prepare.fineweb import ShardWriter, prepare_fineweb
from nanogpt_plus.tokenizer import get_gpt2_encoding

SHARD = 3000  # tokens per shard in these tests: the corpus below makes ~10 shards


def make_docs(n=240, seed=0):
    """ Documents of 0 to ~400 words, with non-ASCII text and an empty one, deterministic. """
    rng = np.random.default_rng(seed)
    words = "the of a GPT café naïve 東京 über shard token stream — résumé 🙂 zebra quietly hex".split()
    docs = [" ".join(rng.choice(words, int(rng.integers(0, 120)))) for _ in range(n)]
    docs[3] = ""
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """ (parquet path, documents, the expected token stream: each document's EOT then its tokens). """
    d = tmp_path_factory.mktemp("fw_corpus")
    docs = make_docs()
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), d / "corpus.parquet")
    enc = get_gpt2_encoding()
    stream = np.concatenate([[EOT] + enc.encode_ordinary(t) for t in docs]).astype(np.uint16)
    return str(d / "corpus.parquet"), docs, stream


def prepare(out_dir, path, cache, **settings):
    settings = dict(dict(shard_size=SHARD, num_proc=1, progress=False), **settings)
    return prepare_fineweb(str(out_dir), files=path, cache_dir=str(cache), **settings)


def shard_bytes(out_dir):
    return {n: (out_dir / n).read_bytes() for n in sorted(os.listdir(out_dir)) if n.endswith(".bin")}


def read_meta(out_dir):
    return json.loads((out_dir / "meta.json").read_text())


@pytest.fixture(scope="module")
def full_run(corpus, tmp_path_factory):
    """ One uninterrupted num_proc=1 run: the reference the other runs are compared with. """
    out = tmp_path_factory.mktemp("fw_full")
    prepare(out, corpus[0], tmp_path_factory.mktemp("cache"))
    return out


# -----------------------------------------------------------------------------
# prepare: exact contents

def test_shards_hold_exactly_the_documents_each_after_its_eot(corpus, full_run):
    _, docs, stream = corpus
    train, val = find_shards(str(full_run))
    assert [os.path.basename(p) for p in val] == ["edufineweb_val_000000.bin"]
    assert [os.path.basename(p) for p in train] == [f"edufineweb_train_{i:06d}.bin" for i in range(1, len(train) + 1)]
    headers = [read_header(p) for p in val + train]
    assert all(h.magic == 20240520 and h.version == 1 for h in headers)
    assert [h.num_tokens for h in headers[:-1]] == [SHARD] * (len(headers) - 1) and 0 < headers[-1].num_tokens <= SHARD
    # the sum of the documents' lengths plus one end-of-text token each, in order, split across shards
    total = sum(len(get_gpt2_encoding().encode_ordinary(d)) + 1 for d in docs)
    assert sum(h.num_tokens for h in headers) == total == len(stream) and len(headers) >= 8
    assert np.array_equal(np.concatenate([open_shard(p) for p in val + train]), stream)
    meta = read_meta(full_run)
    assert meta["kind"] == "gpt2" and meta["tokens"] == total and meta["documents"] == len(docs)
    # so a new model pads GPT-2's vocab to 50304
    assert meta["end_of_corpus"] and "vocab_size" not in meta
    records = meta["shards"]
    assert [r["file"] for r in records] == [os.path.basename(p) for p in val + train]
    assert [r["tokens"] for r in records] == [h.num_tokens for h in headers]
    assert [r["documents"] for r in records] == [int((open_shard(p) == EOT).sum()) for p in val + train]
    # each record starts where the one before ends: (document, token offset in it)
    assert records[0]["start"] == [0, 0] and records[-1]["end"] == [len(docs), 0]
    assert all(a["end"] == b["start"] for a, b in zip(records, records[1:]))


def test_num_proc_2_is_byte_identical_to_num_proc_1(corpus, full_run, tmp_path, monkeypatch):
    monkeypatch.setattr(fineweb, "CHUNKSIZE", 1)  # windows of 2 x 1 x 32 documents: 4 for these 240
    prepare(tmp_path / "out", corpus[0], tmp_path / "cache", num_proc=2)
    assert shard_bytes(tmp_path / "out") == shard_bytes(full_run)
    assert read_meta(tmp_path / "out") == read_meta(full_run)


def test_streaming_gives_the_same_shards(corpus, full_run, tmp_path):
    prepare(tmp_path / "out", corpus[0], tmp_path / "cache", streaming=True)
    assert shard_bytes(tmp_path / "out") == shard_bytes(full_run)


# -----------------------------------------------------------------------------
# prepare: resuming

def stop_after(monkeypatch, target, calls, error=KeyboardInterrupt):
    """ Make target (a ShardWriter method or a fineweb function) raise on its call number `calls`. """
    owner, name = target
    real = getattr(owner, name)
    count = [0]

    def wrapped(*args, **kwargs):
        count[0] += 1
        if count[0] == calls:
            raise error("simulated kill")
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, wrapped)


def test_interrupted_run_resumed_is_byte_identical(corpus, full_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    # killed after the first shard is complete (while writing the second)
    stop_after(monkeypatch, (ShardWriter, "write"), calls=2)
    with pytest.raises(KeyboardInterrupt):
        prepare(out, corpus[0], tmp_path / "cache")
    monkeypatch.undo()
    assert [r["file"] for r in read_meta(out)["shards"]] == ["edufineweb_val_000000.bin"]
    assert sorted(shard_bytes(out)) == ["edufineweb_val_000000.bin"] and not any(
        n.startswith(".") for n in os.listdir(out))  # no temp file left
    # killed again, now between a shard's rename and the meta.json recording it (shard 3 on disk, unrecorded)
    stop_after(monkeypatch, (fineweb, "save_meta"), calls=3)
    with pytest.raises(KeyboardInterrupt):
        prepare(out, corpus[0], tmp_path / "cache")
    monkeypatch.undo()
    assert len(shard_bytes(out)) == 4 and len(read_meta(out)["shards"]) == 3
    capsys.readouterr()
    prepare(out, corpus[0], tmp_path / "cache")
    assert "resuming: keeping 3 complete shards (9,000 tokens)" in capsys.readouterr().out
    assert shard_bytes(out) == shard_bytes(full_run) and read_meta(out) == read_meta(full_run)


def test_resume_rewrites_a_damaged_shard_and_refuses_other_settings(corpus, full_run, tmp_path, capsys):
    out = tmp_path / "out"
    prepare(out, corpus[0], tmp_path / "cache", max_tokens=4 * SHARD)
    damaged = out / "edufineweb_train_000002.bin"
    damaged.write_bytes(damaged.read_bytes()[:-2] + b"\x00\x00")  # same size, one token changed
    capsys.readouterr()
    prepare(out, corpus[0], tmp_path / "cache")
    assert f"{damaged} is missing or doesn't match meta.json" in capsys.readouterr().out
    assert shard_bytes(out) == shard_bytes(full_run)
    prepare(out, corpus[0], tmp_path / "cache")
    assert "nothing to do" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"prepared with other settings \(shard_size: 3000 then, 2000 now\)"):
        prepare(out, corpus[0], tmp_path / "cache", shard_size=2000)
    (out / "meta.json").unlink()
    with pytest.raises(UserError, match="holds shards named edufineweb_.* but no meta.json"):
        prepare(out, corpus[0], tmp_path / "cache")


def test_a_raw_dataset_is_refused_and_replaced_with_overwrite(corpus, full_run, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    for split in ("train", "val"):
        np.arange(10, dtype=np.uint16).tofile(out / f"{split}.bin")
    (out / "meta.json").write_text('{"kind": "gpt2", "vocab_size": 50257, "dtype": "uint16"}')
    with pytest.raises(UserError, match=r"holds a train\.bin/val\.bin dataset \(train\.bin, val\.bin\) and this "
                                        r"script writes a dataset of llm\.c token shards; pass --overwrite=True"):
        prepare(out, corpus[0], tmp_path / "cache")
    assert sorted(os.listdir(out)) == ["meta.json", "train.bin", "val.bin"]  # untouched
    prepare(out, corpus[0], tmp_path / "cache", overwrite=True)
    # the shards alone: train.bin and val.bin are gone
    assert shard_bytes(out) == shard_bytes(full_run)
    assert read_meta(out)["shards"] == read_meta(full_run)["shards"]
    # shards again into their own directory: no --overwrite needed, the run finds all of them done
    capsys.readouterr()
    prepare(out, corpus[0], tmp_path / "cache")
    assert "nothing to do" in capsys.readouterr().out


def test_max_tokens_is_exact_and_a_larger_one_continues(corpus, full_run, tmp_path):
    out = tmp_path / "out"
    n = 2 * SHARD + 1234  # not a whole number of shards
    r = prepare(out, corpus[0], tmp_path / "cache", max_tokens=n)
    assert r["tokens"] == n and [read_header(str(out / f)).num_tokens for f in r["files"]] == [SHARD, SHARD, 1234]
    assert np.array_equal(np.concatenate([open_shard(str(out / f)) for f in r["files"]]), corpus[2][:n])
    assert not read_meta(out)["end_of_corpus"]
    # the short last shard is redone
    r = prepare(out, corpus[0], tmp_path / "cache", max_tokens=5 * SHARD)
    assert r["tokens"] == 5 * SHARD and r["new_tokens"] == 3 * SHARD
    full = shard_bytes(full_run)
    assert shard_bytes(out) == {f: full[f] for f in r["files"]}


def test_memory_holds_one_shard_buffer_not_the_corpus(tmp_path, monkeypatch):
    # ~1 MB of text (~300k tokens) into 60 shards of 5,000 tokens: the Python allocations at the peak stay far
    # below the corpus (its text, or its tokens: 600 kB as uint16)
    docs = make_docs(n=3000, seed=1)
    pq.write_table(pa.table({"text": docs}), tmp_path / "big.parquet")
    corpus_bytes = sum(len(d.encode()) for d in docs)
    # documents read at a time: small beside this corpus
    monkeypatch.setattr(fineweb, "READ_BATCH", 16)
    # a first run makes datasets' lazy imports and its Arrow cache of the file outside the measurement
    prepare(tmp_path / "warm", str(tmp_path / "big.parquet"), tmp_path / "cache", max_tokens=1)
    tracemalloc.start()
    r = prepare(tmp_path / "out", str(tmp_path / "big.parquet"), tmp_path / "cache", shard_size=5000)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert r["shards"] == 60 and len(read_meta(tmp_path / "out")["shards"]) == 60
    assert peak < corpus_bytes / 3, (peak, corpus_bytes)


def test_workers_get_at_most_two_windows_of_documents_ahead():
    # Pool.imap alone would pull every document into its task queue at once; tokenize_stream must not
    pulled = [0]

    def texts():
        for i in range(400):
            pulled[0] += 1
            yield f"document {i}"
    enc = get_gpt2_encoding()
    for consumed, tokens in enumerate(fineweb.tokenize_stream(texts(), num_proc=2, window=20), 1):
        assert pulled[0] - consumed <= 2 * 20
        assert tokens.tolist() == [EOT] + enc.encode_ordinary(f"document {consumed - 1}")
    assert consumed == 400


# -----------------------------------------------------------------------------
# errors

def test_input_errors_are_one_line(corpus, tmp_path, monkeypatch):
    with pytest.raises(UserError, match=r"has no column 'body' \(its columns: id, text\); pass --text_column"):
        prepare(tmp_path / "a", corpus[0], tmp_path / "cache", text_column="body")
    (tmp_path / "bad.jsonl").write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl is not UTF-8 text \(invalid byte at byte offset 30\)"):
        prepare(tmp_path / "b", str(tmp_path / "bad.jsonl"), tmp_path / "cache")

    class BigIds:  # a tokenizer whose ids don't fit the shards' uint16
        n_vocab = 50257
        eot_token = EOT

        def encode_ordinary(self, text):
            return [70000]
    monkeypatch.setattr(fineweb, "get_gpt2_encoding", lambda: BigIds())
    with pytest.raises(UserError, match="token id 70000 does not fit in uint16"):
        prepare(tmp_path / "c", corpus[0], tmp_path / "cache")
    assert not list(tmp_path.glob("c/*.bin"))
    with pytest.raises(UserError, match="prefix 'evaldata' contains 'train' or 'val'"):
        prepare(tmp_path / "d", corpus[0], tmp_path / "cache", prefix="evaldata")


def test_hub_errors_are_one_line(tmp_path, monkeypatch):
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    # offline (conftest): the real call fails at once
    with pytest.raises(UserError, match="could not reach the Hugging Face Hub for the dataset "
                                        "'HuggingFaceFW/fineweb-edu' .*check the network, or pass local files"):
        prepare_fineweb(str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"), progress=False)
    for error, message in [(DatasetNotFoundError("Dataset 'x/y' doesn't exist on the Hub"), "does not exist"),
                           (ValueError("BuilderConfig 'nope' not found. Available: ['default']"),
                            r"has no config 'nope' .*Available: \['default'\].*pass one of them with --name"),
                           (ConnectionError("Couldn't reach 'x/y' on the Hub"), "could not reach"),
                           (RuntimeError("something else"), "could not load")]:
        def fail(*args, error=error, **kwargs):
            raise error
        monkeypatch.setattr(datasets, "load_dataset", fail)
        with pytest.raises(UserError, match=message) as e:
            prepare_fineweb(str(tmp_path / "out"), dataset="x/y", name="nope", progress=False)
        assert "\n" not in str(e.value)


def test_script_on_local_files(corpus, full_run, tmp_path, monkeypatch, capsys):
    # data/fineweb/prepare.py in this process, as `python data/fineweb/prepare.py ARGS` runs it
    def script(*args):
        monkeypatch.setattr(sys, "argv", ["prepare.py", *args])
        runpy.run_path(os.path.join(REPO, "data", "fineweb", "prepare.py"), run_name="__main__")
    args = [f"--files={corpus[0]}", f"--shard_size={SHARD}", f"--out_dir={tmp_path / 'out'}", "--num_proc=2"]
    script(*args)
    assert f"wrote {len(corpus[2]):,} tokens in" in capsys.readouterr().out
    assert shard_bytes(tmp_path / "out") == shard_bytes(full_run)
    with pytest.raises(SystemExit) as e:
        script(*args, "--shard_size=0")
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        "error: shard_size must be >= 1 and <= 2147483647, got 0; change --shard_size (or the config file that "
        "sets it)"]
