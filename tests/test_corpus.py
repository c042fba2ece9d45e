"""
nanogpt_plus/prepare/corpus.py (data/text/prepare.py and data/openwebtext/prepare.py): a corpus of .txt, JSONL or
parquet files or a Hub dataset, in a tokenizer of your choice; a byte-level BPE trained on the train split,
deterministic and byte-exact on mixed Unicode; the end-of-text id after each document; char and gpt2 byte-identical
to the Shakespeare scripts on one file; a tokenizer.json reused; uint32 token files past 65,536 tokens (and
data/fineweb's shards in such a vocabulary, from the BPE prepared here); num_proc=2 == 1; each bad setting or input
one line, exit code 2. In-process and offline.
"""
import hashlib
import json
import os
import re
import runpy
import sys

import numpy as np
import pytest

from helpers import (
    REPO,
    assert_one_line_error,
    bpe_corpus_text,
    refuse_to_open,
    run_offline,
    synthetic_bpe_json,
    tokens,
)
from nanogpt_plus.dataset import read_dataset_meta
from nanogpt_plus.errors import UserError
from nanogpt_plus.prepare import corpus
from nanogpt_plus.prepare.corpus import expand_files, load_corpus, prepare_corpus
from nanogpt_plus.tokenizer import get_gpt2_encoding, load_tokenizer

SCRIPT = os.path.join(REPO, "data", "text", "prepare.py")


BINS = ("train.bin", "val.bin")


def prepare(monkeypatch, *args):
    """ data/text/prepare.py ARGS in this process, as `python data/text/prepare.py ARGS` runs it. """
    monkeypatch.setattr(sys, "argv", ["prepare.py", *args])
    runpy.run_path(SCRIPT, run_name="__main__")


def files_of(out_dir, names=BINS + ("meta.json", "tokenizer.json")):
    """ The files' bytes; meta.json's without the record of its preparation (the corpus's path). """
    files = {n: (out_dir / n).read_bytes() for n in names if (out_dir / n).exists()}
    if "meta.json" in files:
        meta = json.loads(files["meta.json"])
        assert set(meta.pop("preparation")) == {"corpus", "tokenizer", "vocabulary"}
        files["meta.json"] = json.dumps(meta).encode()
    return files


def documents_of(ids, eot):
    """ The documents of a token file written by the multi-document path: (tokens..., eot) repeated. """
    assert len(ids) and ids[-1] == eot
    cuts = np.flatnonzero(ids == eot)
    return [ids[a + 1:b] for a, b in zip(np.concatenate([[-1], cuts[:-1]]), cuts)]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """ Eight .txt documents of mixed-Unicode text (one holding the end-of-text marker as plain text). """
    d = tmp_path_factory.mktemp("corpus")
    paragraphs = bpe_corpus_text().split("\n\n")
    for k in range(8):
        text = "\n\n".join(paragraphs[k::8]) + ("\nit ends with <|endoftext|> as text\n" if k == 3 else "")
        (d / f"doc{k}.txt").write_text(text, encoding="utf-8")
    return d


@pytest.fixture(scope="module")
def bpe_runs(corpus_dir, tmp_path_factory):
    """ The same vocab-512 BPE preparation twice (num_proc 1, then 2; separate caches): the two out_dirs. """
    mp = pytest.MonkeyPatch()
    outs = []
    for num_proc in (1, 2):
        out = tmp_path_factory.mktemp(f"bpe_np{num_proc}")
        prepare(mp, f"--input={corpus_dir}/*.txt", "--vocab_size=512", f"--num_proc={num_proc}", f"--out_dir={out}",
                f"--cache_dir={tmp_path_factory.mktemp('cache')}")
        outs.append(out)
    mp.undo()
    return outs


def test_bpe_is_deterministic_and_round_trips_every_document_byte_exact(corpus_dir, bpe_runs):
    first, second = bpe_runs
    # same tokenizer.json, same bins
    assert files_of(first) == files_of(second) and len(files_of(first)) == 4
    meta = json.loads((first / "meta.json").read_text())
    assert meta.pop("preparation")["tokenizer"] == "bpe of 512 tokens trained on the corpus"
    split_bytes = meta.pop("split_bytes")  # each split's tokens and bytes: checked below
    tokenizer_json = (first / "tokenizer.json").read_text(encoding="utf-8")
    assert meta == {"kind": "bpe", "vocab_size": 512, "eot_token": 0, "dtype": "uint16",
                    "tokenizer_file": "tokenizer.json",
                    "tokenizer_sha256": hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()}
    tok = load_tokenizer(read_dataset_meta(str(first)))  # what train.py and a checkpoint get
    assert tok.vocab_size == 512 and tok.eot_token == meta["eot_token"]
    # every document exactly once, each followed by the eot id (1 of 8 held out), decoding to its exact bytes
    split = {s: documents_of(np.fromfile(first / s, dtype=np.uint16), tok.eot_token) for s in BINS}
    assert len(split["val.bin"]) == 1 and len(split["train.bin"]) == 7
    decoded = sorted(tok.decode_bytes(d.tolist()) for d in split["train.bin"] + split["val.bin"])
    for s in ("train", "val"):
        ids = np.fromfile(first / f"{s}.bin", dtype=np.uint16)
        assert split_bytes[s] == {"tokens": len(ids), "bytes": len(tok.decode_bytes(ids.tolist()))}
    assert decoded == sorted(p.read_bytes() for p in corpus_dir.glob("*.txt"))
    assert any("東京".encode() in d and "🎉".encode() in d and "façade".encode() in d for d in decoded)


def test_bpe_is_trained_on_the_train_split_only(corpus_dir, bpe_runs, tmp_path):
    # the held-out document's text is not what the tokenizer learned from: training on the 7 train
    # documents alone gives the same tokenizer.json
    from nanogpt_plus.bpe import train_bpe
    tok = load_tokenizer(read_dataset_meta(str(bpe_runs[0])))
    train_ids = np.fromfile(bpe_runs[0] / "train.bin", dtype=np.uint16)
    texts = [tok.decode_bytes(d.tolist()).decode("utf-8") for d in documents_of(train_ids, tok.eot_token)]
    again = train_bpe(iter([texts]), 512, show_progress=False)
    assert again.json == tok.json


def test_tokenizer_path_is_reused_with_the_same_ids(corpus_dir, bpe_runs, tmp_path, monkeypatch, capsys):
    # the file, or the directory holding it
    for path in (bpe_runs[0] / "tokenizer.json", bpe_runs[0]):
        out = tmp_path / path.name
        prepare(monkeypatch, f"--input={corpus_dir}/*.txt", f"--tokenizer={path}", f"--out_dir={out}",
                f"--cache_dir={tmp_path / 'cache'}", "--num_proc=1")
        assert files_of(out) == files_of(bpe_runs[0])
        assert "training" not in capsys.readouterr().out


def shakespeare_script_outputs(name, text_file, out, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["prepare.py", f"--input={text_file}", f"--out_dir={out}"])
    runpy.run_path(os.path.join(REPO, "data", name, "prepare.py"), run_name="__main__")
    return files_of(out, BINS + ("meta.json", "meta.pkl"))


@pytest.mark.parametrize("tokenizer, script", [("char", "shakespeare_char"), ("gpt2", "shakespeare")])
def test_one_text_file_gives_the_shakespeare_scripts_files(tokenizer, script, tmp_path, monkeypatch):
    text_file = tmp_path / "input.txt"
    # ~75k characters, mixed Unicode
    text_file.write_text(bpe_corpus_text(n_words=12000), encoding="utf-8")
    # pieces of ~2,000 characters (instead of 65,536): many cuts, and still the tokens of the whole text
    monkeypatch.setattr(corpus, "PIECE_CHARS", 2000)
    prepare(monkeypatch, f"--input={text_file}", f"--tokenizer={tokenizer}", f"--out_dir={tmp_path / 'text'}",
            f"--cache_dir={tmp_path / 'cache'}", "--num_proc=1")
    ours = files_of(tmp_path / "text", BINS + ("meta.json", "meta.pkl"))
    theirs = shakespeare_script_outputs(script, text_file, tmp_path / script, monkeypatch)
    assert ours == theirs and len(ours) == (4 if tokenizer == "char" else 3)
    assert json.loads(ours["meta.json"])["dtype"] == "uint16"


def test_one_text_is_not_cut_for_a_pre_tokenizer_that_does_not_cut_at_newlines(bpe_runs, tmp_path, monkeypatch):
    # a byte-level BPE without GPT-2's regex sees a whole text as one word, and its merges span newlines
    # (".\nK" can be one token): text in pieces would be encoded differently
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    text = bpe_corpus_text(n_words=3000)
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    # a newline merged with what follows
    assert any("\u010a" in t and t[-1] != "\u010a" for t in bpe.get_vocab())
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe.to_str(), encoding="utf-8")
    (tmp_path / "input.txt").write_text(text, encoding="utf-8")
    monkeypatch.setattr(corpus, "PIECE_CHARS", 2000)
    prepare(monkeypatch, f"--input={tmp_path / 'input.txt'}", f"--tokenizer={path}", f"--out_dir={tmp_path / 'out'}",
            f"--cache_dir={tmp_path / 'cache'}", "--num_proc=1")
    tok = load_tokenizer(read_dataset_meta(str(tmp_path / "out")))
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16)
    assert train.tolist() == tok.encode_ordinary(text[:int(len(text) * 0.9)])


# -----------------------------------------------------------------------------
# past 65,536 tokens: uint32

@pytest.fixture(scope="module")
def big_tokenizer(tmp_path_factory):
    """ (path, BPETokenizer) of a valid byte-level BPE tokenizer.json of 70,000 tokens (no training). """
    from nanogpt_plus.bpe import BPETokenizer
    path = tmp_path_factory.mktemp("big_tok") / "tokenizer.json"
    path.write_text(synthetic_bpe_json(70000), encoding="utf-8")
    return path, BPETokenizer(path.read_text(encoding="utf-8"))


def uint32_texts():
    """ Documents whose tokens include ids past 65,535: runs of low control bytes are the vocabulary's last,
    three-byte tokens (see helpers.synthetic_bpe_json), next to ordinary and non-ASCII text. """
    return ["plain words \x00\x00\x00\x00\x01\x02 and café\n", "東京 \x00\x00\x05\x00\x00\x0a 🎉\n",
            "more \x00\x00\x0f\x00\x00\x03 text naïve\n"]


def test_a_vocabulary_past_65536_writes_uint32_token_files(big_tokenizer, tmp_path, monkeypatch):
    for k, text in enumerate(uint32_texts()):
        (tmp_path / f"d{k}.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    path, tok = big_tokenizer
    prepare(monkeypatch, f"--input={tmp_path}/d*.txt", f"--tokenizer={path}", f"--out_dir={out}",
            f"--cache_dir={tmp_path / 'cache'}", "--num_proc=1")
    meta = read_dataset_meta(str(out))
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70000
    assert meta["tokenizer_json"] == tok.json  # (building it again from meta would take a second)
    ids = {s: np.fromfile(out / s, dtype=np.uint32) for s in BINS}
    expected = sum(len(tok.encode_ordinary(t)) + 1 for t in uint32_texts())
    assert sum(len(a) for a in ids.values()) == expected
    assert sum(os.path.getsize(out / s) for s in BINS) == 4 * expected  # 4 bytes a token
    assert max(int(a.max()) for a in ids.values()) > 65535
    docs = [tok.decode_bytes(d.tolist()) for s in BINS for d in documents_of(ids[s], tok.eot_token)]
    assert sorted(docs) == sorted(t.encode("utf-8") for t in uint32_texts())


# -----------------------------------------------------------------------------
# bad settings and inputs: one line each, exit code 2

def other_tokenizer_json(kind):
    """ A tokenizer.json that is not a byte-level BPE: a word-level one, or a BPE over whitespace-split words. """
    from tokenizers import Tokenizer, models, pre_tokenizers
    if kind == "wordlevel":
        return Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).to_str()
    tok = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok.to_str()


ERRORS = {
    "vocab_too_small": (["--vocab_size=256"], "vocab_size must be >= 257, got 256"),
    # the tokenizer library used to abort (rc 134) on a 70 GB allocation: refused before any text is read
    "vocab_absurd": (["--vocab_size=1000000000"], r"^error: vocab_size=1,000,000,000 is more than a BPE trained "
                     r"here can sensibly have: at most 1,048,576 .*use --vocab_size=1048576 or less$"),
    "vocab_too_large": (["--vocab_size=5000"], r"the corpus fills only [\d,]+ of the 5,000 tokens asked for"),
    "corrupt_json": (["--tokenizer={tmp}/corrupt.json"], r"corrupt\.json is not valid JSON .*it is corrupt"),
    "not_bpe": (["--tokenizer={tmp}/wordlevel.json"], "is a WordLevel tokenizer, not a byte-level BPE"),
    "not_byte_level": (["--tokenizer={tmp}/whitespace.json"], "is a BPE over characters, not bytes"),
    "unknown_tokenizer": (["--tokenizer=sentencepiece"], "unknown tokenizer 'sentencepiece' .*--tokenizer=bpe"),
    "vocab_size_for_char": (["--tokenizer=char", "--vocab_size=512"], "--vocab_size applies to --tokenizer=bpe only"),
    "val_fraction_0": (["--val_fraction=0"], r"val_fraction must be > 0\.0 and < 1\.0, got 0\.0"),
    "val_fraction_1.5": (["--val_fraction=1.5"], r"val_fraction must be > 0\.0 and < 1\.0, got 1\.5"),
    "empty_corpus": (["--input={tmp}/empty.jsonl"], "holds no text"),
    "no_input": (["--input="], "no text given; pass --input=FILES"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_are_one_line_and_exit_code_2(case, tmp_path, monkeypatch, capsys):
    (tmp_path / "small.txt").write_text("a small corpus, too small for 5,000 tokens\n" * 20, encoding="utf-8")
    (tmp_path / "corrupt.json").write_text('{"model": {"type": "BPE", ', encoding="utf-8")
    for kind in ("wordlevel", "whitespace"):
        (tmp_path / f"{kind}.json").write_text(other_tokenizer_json(kind), encoding="utf-8")
    (tmp_path / "empty.jsonl").write_text('{"text": ""}\n{"text": ""}\n', encoding="utf-8")
    args, message = ERRORS[case]
    with pytest.raises(SystemExit) as e:
        prepare(monkeypatch, f"--input={tmp_path}/small.txt", f"--out_dir={tmp_path / 'out'}",
                f"--cache_dir={tmp_path / 'cache'}", "--num_proc=1", *(a.format(tmp=tmp_path) for a in args))
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    last = err.strip().splitlines()[-1]  # progress bars of datasets may come before it
    assert last.startswith("error: ") and re.search(message, last), last
    assert not (tmp_path / "out").exists()  # nothing written


def test_fineweb_shards_of_a_vocabulary_past_65536_are_llm_c_uint32(big_tokenizer, bpe_runs, tmp_path, capsys):
    from nanogpt_plus.dataset import find_shards
    from nanogpt_plus.dataset.shards import open_shard, read_header
    from nanogpt_plus.prepare.fineweb import prepare_fineweb
    with open(tmp_path / "docs.jsonl", "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in uint32_texts())
    out = tmp_path / "shards"

    def run(tokenizer, num_proc=1):
        return prepare_fineweb(str(out), files=str(tmp_path / "docs.jsonl"), shard_size=16, num_proc=num_proc,
                               cache_dir=str(tmp_path / "cache"), progress=False, tokenizer=str(tokenizer))
    path, tok = big_tokenizer
    run(path)
    train, val = find_shards(str(out))
    headers = [read_header(p) for p in val + train]
    assert len(headers) >= 2 and all((h.magic, h.version, h.dtype) == (20240801, 7, np.uint32) for h in headers)
    # the shards' directory describes its tokenizer, like a prepare.py dataset
    meta = read_dataset_meta(str(out))
    assert (meta["kind"], meta["vocab_size"], meta["dtype"]) == ("bpe", 70000, "uint32")
    assert meta["tokenizer_json"] == tok.json and (out / "tokenizer.json").exists()
    stream = np.concatenate([open_shard(p) for p in val + train])
    assert stream.tolist() == [i for t in uint32_texts() for i in [tok.eot_token] + tok.encode_ordinary(t)]
    assert stream.max() > 65535
    # the tokenizer is a setting a resume must match: the same one has nothing to do, another is refused
    capsys.readouterr()
    run(path)
    assert "nothing to do" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"prepared with other settings \((dtype|tokenizer): "):
        run(bpe_runs[0] / "tokenizer.json")


def test_fineweb_workers_build_the_bpe_from_its_json(bpe_runs):
    from nanogpt_plus.prepare.fineweb import tokenize_stream
    tok = load_tokenizer(read_dataset_meta(str(bpe_runs[0])))
    texts = [f"document {i}: naïve 東京 🎉 " * (i % 5) for i in range(50)]
    in_pool = [a.tolist() for a in tokenize_stream(iter(texts), num_proc=2, window=8, tok=tok)]
    assert in_pool == [[tok.eot_token] + tok.encode_ordinary(t) for t in texts]


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
    r = run_offline("data/openwebtext/prepare.py", f"--files={tmp_path / 'corpus.jsonl'}", "--text_column=body",
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
    with pytest.raises(UserError, match=r"can.t read .*a\.csv: it has the extension \.csv"):
        expand_files(str(tmp_path / "a.csv"))
    (tmp_path / "e.txt").write_text("")
    with pytest.raises(UserError, match="empty"):
        expand_files(str(tmp_path / "e.txt"))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine text\n\nmore \xff text\n")
    with pytest.raises(UserError, match=r"bad\.txt is not UTF-8 text \(invalid byte at byte offset 16\)"):
        load_corpus(files=str(bad), cache_dir=str(tmp_path / "cache"))


@pytest.mark.usefixtures('one_thread')
def test_a_jsonl_text_that_is_not_a_string_is_one_line(tmp_path):
    cases = {'{"text": 5}': "line 2: its 'text' field is a number (5), not text; make it a string",
             '["a", "list"]': "line 2 is a list, not an object with a 'text' field",
             '{"text": ["x"]}': "line 2: its 'text' field is a list"}
    for i, (bad, words) in enumerate(cases.items()):
        path = tmp_path / f'c{i}.jsonl'
        path.write_text('{"text": "a first document"}\n' + bad + '\n')
        with pytest.raises(UserError, match=rf"^{path} {re.escape(words)}"):
            prepare_corpus(str(tmp_path / f'out{i}'), files=str(path), tokenizer='char', progress=False)
        assert not os.path.exists(tmp_path / f'out{i}' / 'train.bin')


@pytest.mark.usefixtures('one_thread')
def test_an_unreadable_input_is_one_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "a.txt").write_text("some text to read\n" * 20, encoding="utf-8")
    (tmp_path / "b.txt").write_text("more text, not readable\n" * 20, encoding="utf-8")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    refuse_to_open(monkeypatch, tmp_path / "b.txt")  # as chmod 000 does for a user other than root
    with pytest.raises(SystemExit) as e:
        prepare(monkeypatch, f"--input={tmp_path}/*.txt", f"--out_dir={tmp_path / 'out'}", "--tokenizer=char",
                f"--cache_dir={tmp_path / 'cache'}")
    assert_one_line_error(e.value.code, capsys.readouterr().err,
                          f"could not read input file {tmp_path}/b.txt (Permission denied); make it readable")
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no out_dir, no cache


def test_a_directory_as_input_says_so(tmp_path):
    with pytest.raises(UserError, match=rf"^input {tmp_path} is a directory; pass its files"):
        expand_files(str(tmp_path))


@pytest.mark.usefixtures('one_thread')
def test_files_an_earlier_preparation_left_are_removed(tmp_path):
    corpus = tmp_path / 'c.jsonl'
    corpus.write_text(''.join(json.dumps({'text': f'document number {i} of the corpus'}) + '\n' for i in range(40)))
    out = tmp_path / 'data'
    prepare_corpus(str(out), files=str(corpus), tokenizer='bpe', vocab_size=300, progress=False)
    assert (out / 'tokenizer.json').exists()
    prepare_corpus(str(out), files=str(corpus), tokenizer='char', progress=False, overwrite=True)
    # --tokenizer=<dir> finds none
    assert not (out / 'tokenizer.json').exists() and (out / 'meta.pkl').exists()
    prepare_corpus(str(out), files=str(corpus), tokenizer='gpt2', progress=False, overwrite=True)
    assert not (out / 'meta.pkl').exists() and json.load(open(out / 'meta.json'))['kind'] == 'gpt2'


@pytest.mark.usefixtures('one_thread')
def test_an_input_without_a_known_extension_and_an_out_dir_that_is_a_file_say_so(tmp_path, monkeypatch, capsys):
    from helpers import assert_one_line_error, run
    (tmp_path / "notes").write_text("some text\n")
    (tmp_path / "a.txt").write_text("some text\n")
    (tmp_path / "taken").write_text("mine")
    before = sorted(os.listdir(tmp_path))
    script = os.path.join("data", "text", "prepare.py")
    code, _, err = run(script, monkeypatch, capsys, f"--input={tmp_path / 'notes'}", "--tokenizer=char",
                       f"--out_dir={tmp_path / 'ds'}")
    assert_one_line_error(code, err, f"can't read {tmp_path / 'notes'}: it has no extension, and --input reads "
                                     f".txt, .jsonl, .json and .parquet files (told by their extension)")
    # an out_dir that is a file: said before the work, not as a full disk after it
    code, _, err = run(script, monkeypatch, capsys, f"--input={tmp_path / 'a.txt'}", "--tokenizer=char",
                       f"--out_dir={tmp_path / 'taken'}")
    assert_one_line_error(code, err,
                          f"--out_dir={tmp_path / 'taken'} is a file, not a directory; pass another --out_dir")
    assert sorted(os.listdir(tmp_path)) == before and (tmp_path / "taken").read_text() == "mine"
