"""
Tokenizer files that would lose text, or that can't be read, and dataset meta files with entries of the wrong
type are refused in one line (issue 24): a byte-level BPE tokenizer.json must give a probe text back byte for
byte and encode it alike each time; a malformed tokenizer.json is a TokenizerError wherever it is read; and
read_dataset_meta checks what it returns, so train.py stops at set-up with exit code 2, not later or silently.

Usage:
    python -m pytest tests/test_tokenizer_safety.py -q
"""
import hashlib
import json
import pickle
import re
import runpy
import sys

import pytest

from helpers import REPO, bpe_corpus_text, run_python, write_bpe_dataset
from nanogpt_plus import bpe
from nanogpt_plus.bpe import EOT_TEXT, ROUND_TRIP_PROBE, BPETokenizer, read_tokenizer_file
from nanogpt_plus.dataset import read_dataset_meta
from nanogpt_plus.errors import TokenizerError
from nanogpt_plus.tokenizer import load_tokenizer


def edited(tokenizer_json, change):
    """ tokenizer_json with change(spec) applied to its parsed form. """
    spec = json.loads(tokenizer_json)
    change(spec)
    return json.dumps(spec)


def before_byte_level(step):
    """ A change putting the pre-tokenizer step `step` before the ByteLevel one (a Sequence of the two). """
    return lambda s: s.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [step, s["pre_tokenizer"]]})


def dataset_with_tokenizer(directory, text, vocab_size=512, eot_token=0):
    """ A bpe dataset's meta files (no token files: read_dataset_meta reads none) naming the tokenizer.json text. """
    directory.mkdir()
    (directory / "tokenizer.json").write_text(text, encoding="utf-8")
    meta = {"kind": "bpe", "vocab_size": vocab_size, "eot_token": eot_token, "tokenizer_file": "tokenizer.json",
            "tokenizer_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "dtype": "uint16"}
    (directory / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    return str(directory)


# -----------------------------------------------------------------------------
# tokenizers that change the text they encode

LOSSY = {
    "whitespace-dropping pre-tokenizer": (before_byte_level({"type": "WhitespaceSplit"}),
                                          "does not give text back byte for byte"),
    "character-removing pre-tokenizer": (before_byte_level({"type": "Split", "pattern": {"Regex": "[\r\t]"},
                                                            "behavior": "Removed", "invert": False}),
                                         "does not give text back byte for byte"),
    "lowercasing normalizer": (lambda s: s.update(normalizer={"type": "Lowercase"}),
                               r"normalizes the text \(Lowercase"),
    "NFKC normalizer": (lambda s: s.update(normalizer={"type": "NFKC"}), r"normalizes the text \(NFKC"),
    "BPE dropout": (lambda s: s["model"].update(dropout=0.1), r"uses BPE dropout \(\"dropout\": 0.1\)"),
    "marked word pieces": (lambda s: s["model"].update(continuing_subword_prefix="##"), "marks pieces of words"),
    "whitespace-swallowing end-of-text": (lambda s: s["added_tokens"][0].update(rstrip=True),
                                          "swallow the whitespace around it"),
}


@pytest.mark.parametrize("case", list(LOSSY))
def test_a_tokenizer_that_changes_text_is_refused_in_one_line(case, bpe512, tmp_path):
    change, message = LOSSY[case]
    lossy = edited(bpe512[0].json, change)
    with pytest.raises(TokenizerError, match=message) as e:
        BPETokenizer(lossy, name="x/tokenizer.json")
    assert str(e.value).startswith("x/tokenizer.json ") and "\n" not in str(e.value)
    assert re.search("pass a|set \"|use --tokenizer=bpe", str(e.value))  # says what to do
    # a dataset prepared with it is refused when it is read (train.py's set-up), naming its tokenizer.json
    directory = dataset_with_tokenizer(tmp_path / "ds", lossy)
    with pytest.raises(TokenizerError, match=message) as e:
        read_dataset_meta(directory)
    assert str(e.value).startswith(str(tmp_path / "ds" / "tokenizer.json"))


def test_the_refusal_shows_where_the_text_changed(bpe512):
    lossy = edited(bpe512[0].json, before_byte_level({"type": "WhitespaceSplit"}))
    with pytest.raises(TokenizerError, match=r"\('  Hello,' came back as 'Hello,Wo'\)"):
        BPETokenizer(lossy)


def test_random_encoding_is_refused_even_when_the_model_section_hides_it(bpe512, monkeypatch):
    # the probe encodes the text several times: dropout gets caught even past the check of the model section
    monkeypatch.setattr(bpe, "_check_bpe_model", lambda model, name: None)
    with pytest.raises(TokenizerError, match="encodes the same text differently from one call to the next"):
        BPETokenizer(edited(bpe512[0].json, lambda s: s["model"].update(dropout=0.1)), name="x/tokenizer.json")


def test_the_probe_holds_every_kind_of_text_that_gets_lost():
    probe = ROUND_TRIP_PROBE
    for piece in ("  ", "   ", "\n", "\r\n", "\n\n", "\t", "é", "e\u0301", "日本語", "🎉", "\u200d", "\u2126",
                  "A", "\ufb01"):
        assert piece in probe, piece
    assert probe.startswith(" ") and probe.endswith("  \n\n") and EOT_TEXT not in probe


def test_prepare_py_refuses_a_lossy_tokenizer_file(bpe512, tmp_path, monkeypatch, capsys):
    path = tmp_path / "lossy.json"
    path.write_text(edited(bpe512[0].json, before_byte_level({"type": "WhitespaceSplit"})), encoding="utf-8")
    (tmp_path / "small.txt").write_text(bpe_corpus_text(300), encoding="utf-8")
    monkeypatch.setattr(sys, "argv", ["prepare.py", f"--input={tmp_path}/small.txt", f"--tokenizer={path}",
                                      f"--out_dir={tmp_path / 'out'}", f"--cache_dir={tmp_path / 'cache'}",
                                      "--num_proc=1"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(f"{REPO}/data/text/prepare.py", run_name="__main__")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: {path} does not give text back byte for byte")
    assert not (tmp_path / "out").exists()


def test_each_tokenizer_json_text_is_built_and_checked_once(bpe512, tmp_path, monkeypatch):
    checks = []
    check = bpe._check_round_trip
    monkeypatch.setattr(bpe, "_check_round_trip", lambda tok, name: (checks.append(name), check(tok, name)))
    text = json.dumps(json.loads(bpe512[0].json), indent=3)  # a text no other test builds
    (tmp_path / "tokenizer.json").write_text(text, encoding="utf-8")
    tok = read_tokenizer_file(str(tmp_path / "tokenizer.json"))  # prepare.py --tokenizer=PATH
    # its workers, sample.py
    assert load_tokenizer(tok.meta()) is tok and load_tokenizer(tok.meta()) is tok
    assert checks == [str(tmp_path / "tokenizer.json")]


# -----------------------------------------------------------------------------
# malformed tokenizer.json

MALFORMED = {
    "nested too deeply": (lambda good: "[" * 100000 + "]" * 100000, "is not valid JSON"),
    "a deeply nested object": (lambda good: '{"model": ' * 5000 + "1" + "}" * 5000, "is not valid JSON"),
    "a list for the pre-tokenizer": (lambda good: edited(good, lambda s: s.update(pre_tokenizer=[s["pre_tokenizer"]])),
                                     r"its 'pre_tokenizer' is a list"),
    "a string among the pre-tokenizer steps": (
        lambda good: edited(good, lambda s: s.update(pre_tokenizer={"type": "Sequence", "pretokenizers": ["x"]})),
        "its pre-tokenizer step is a str"),
    "a dict for added_tokens": (lambda good: edited(good, lambda s: s.update(added_tokens={EOT_TEXT: 0})),
                                r"its 'added_tokens' is a dict"),
    "a string for the normalizer": (lambda good: edited(good, lambda s: s.update(normalizer="Lowercase")),
                                    r"normalizes the text \(str\)"),
    "a vocab with string ids": (lambda good: edited(good, lambda s: s["model"]["vocab"].update({"!": "1"})),
                                r"is not a valid tokenizer.json \(Exception: invalid type: string"),
    "a vocab with fractional ids": (lambda good: edited(good, lambda s: s["model"]["vocab"].update({"!": 1.5})),
                                    r"is not a valid tokenizer.json \(Exception: invalid type: floating point"),
    "no merges": (lambda good: edited(good, lambda s: s["model"].pop("merges")), "Missing vocab/merges"),
    "no model type": (lambda good: edited(good, lambda s: s["model"].pop("type")), "no 'type' in 'model'"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_tokenizer_json_is_one_line_wherever_it_is_read(case, bpe512, tmp_path):
    make, message = MALFORMED[case]
    text = make(bpe512[0].json)
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    for read in (lambda: BPETokenizer(text, name=str(path)), lambda: read_tokenizer_file(str(path))):
        with pytest.raises(TokenizerError, match=message) as e:
            read()
        assert str(e.value).startswith(f"{path} ") and "\n" not in str(e.value)
    # read_named_tokenizer (a dataset's, an exported model's tokenizer.json) builds and checks what it reads
    with pytest.raises(TokenizerError, match=message) as e:
        read_dataset_meta(dataset_with_tokenizer(tmp_path / "ds", text))
    assert str(e.value).startswith(str(tmp_path / "ds" / "tokenizer.json")) and "\n" not in str(e.value)


# -----------------------------------------------------------------------------
# dataset meta files

CHAR_META = {"kind": "char", "vocab_size": 3, "stoi": {"a": 0, "b": 1, "c": 2}, "itos": {"0": "a", "1": "b", "2": "c"}}

BAD_META = {
    "vocab_size a string": (dict(CHAR_META, vocab_size="3"), r"says vocab_size='3', not a positive whole number"),
    "vocab_size a float": (dict(CHAR_META, vocab_size=3.0), r"says vocab_size=3.0, not a positive whole number"),
    "vocab_size negative": (dict(CHAR_META, vocab_size=-3), r"says vocab_size=-3, not a positive whole number"),
    "vocab_size zero": (dict(CHAR_META, vocab_size=0), r"says vocab_size=0, not a positive whole number"),
    "vocab_size a bool": (dict(CHAR_META, vocab_size=True), r"says vocab_size=True, not a positive whole number"),
    "itos a list": (dict(CHAR_META, itos=["a", "b", "c"]), r"has an 'itos' that is a list, not an \{id: character\}"),
    "itos keyed by words": (dict(CHAR_META, itos={"one": "a"}), r"has an 'itos' that is not an \{id: character\}"),
    "itos not the inverse of stoi": (dict(CHAR_META, itos={"0": "a", "1": "c", "2": "b"}),
                                     "has an 'itos' that is not the inverse of its 'stoi'"),
    "stoi a list": (dict(CHAR_META, stoi=["a", "b", "c"]), r"has a 'stoi' that is not a \{character: id\}"),
    "stoi with string ids": (dict(CHAR_META, stoi={"a": "0", "b": "1", "c": "2"}),
                             r"has a 'stoi' that is not a \{character: id\}"),
    "stoi with ids past vocab_size": (dict(CHAR_META, vocab_size=2), "has a 'stoi' with ids past its vocab_size=2"),
    "an unknown kind": ({"kind": "wordpiece", "vocab_size": 30000}, "names the tokenizer kind 'wordpiece', not one of"),
    "a list, not an object": ([CHAR_META], "holds a list, not a tokenizer description"),
    "eot_token a string": ({"kind": "gpt2", "eot_token": "50256"}, r"says eot_token='50256', not a token id"),
    "tokenizer_file a list": ({"kind": "bpe", "vocab_size": 512, "tokenizer_file": ["tokenizer.json"]},
                              "has a list as its tokenizer_file, not a string"),
    "tokenizer_json not a text": ({"kind": "bpe", "tokenizer_json": {"model": {}}},
                                  "has a dict as its tokenizer_json, not a string"),
}


@pytest.mark.parametrize("case", list(BAD_META))
def test_a_bad_meta_json_entry_is_refused_when_the_dataset_is_read(case, tmp_path):
    meta, message = BAD_META[case]
    (tmp_path / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(TokenizerError, match=message) as e:
        read_dataset_meta(str(tmp_path))
    assert str(e.value).startswith(f"{tmp_path / 'meta.json'} ") and str(e.value).endswith(
        "; re-run the dataset's prepare.py") and "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["vocab_size a string", "itos a list", "stoi with string ids"])
def test_a_bad_meta_pkl_entry_is_refused_too(case, tmp_path):
    meta, message = BAD_META[case]
    meta = dict(meta, itos={int(i): ch for i, ch in meta["itos"].items()}) if isinstance(meta["itos"], dict) else meta
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(meta))
    with pytest.raises(TokenizerError, match=message) as e:
        read_dataset_meta(str(tmp_path))
    assert str(e.value).startswith(str(tmp_path / "meta.pkl"))


@pytest.mark.parametrize("key", ["vocab_size", "eot_token"])
def test_a_bpe_meta_json_its_tokenizer_json_contradicts_is_refused_when_read(key, bpe512, tmp_path):
    directory = write_bpe_dataset(tmp_path / "ds", bpe512[0], bpe_corpus_text(300))
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text(encoding="utf-8"))
    good = meta[key]
    (tmp_path / "ds" / "meta.json").write_text(json.dumps(dict(meta, **{key: 300})), encoding="utf-8")
    with pytest.raises(TokenizerError, match=f"meta.json says {key}=300 but its tokenizer.json has {key}={good}; "
                                             f"re-run the dataset's prepare.py"):
        read_dataset_meta(directory)


def bad_dataset(tmp_path, bpe512, case):
    """ A bpe dataset train.py must refuse: its meta.json contradicts its tokenizer.json, or that loses text. """
    directory = write_bpe_dataset(tmp_path / case, bpe512[0], bpe_corpus_text(3000))
    meta_path = tmp_path / case / "meta.json"
    tokenizer_path = tmp_path / case / "tokenizer.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if case == "contradicted":
        meta["vocab_size"] = 600
    else:
        lossy = edited(bpe512[0].json, before_byte_level({"type": "WhitespaceSplit"}))
        tokenizer_path.write_text(lossy, encoding="utf-8")
        meta["tokenizer_sha256"] = hashlib.sha256(lossy.encode("utf-8")).hexdigest()
    meta_path.write_text(json.dumps(meta), encoding="utf-8")
    return directory


@pytest.mark.parametrize("case, message", [("contradicted", "meta.json says vocab_size=600 but its tokenizer.json"),
                                           ("lossy", "tokenizer.json does not give text back byte for byte")])
def test_train_py_stops_at_set_up_in_one_line(case, message, bpe512, tmp_path):
    directory = bad_dataset(tmp_path, bpe512, case)
    r = run_python(["train.py", f"--dataset={directory}", "--device=cpu", "--n_layer=1",
                        "--n_head=1", "--n_embd=8", "--block_size=8", "--batch_size=2", "--max_iters=1",
                        f"--out_dir={tmp_path / 'out'}"], timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {directory}/") and message in last, last
    assert "prepare.py" in last or "--tokenizer=bpe" in last, last  # and what to do
    assert not (tmp_path / "out" / "ckpt.pt").exists()
