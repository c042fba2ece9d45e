"""
nanogpt_plus/dataset/ (its __init__.py), what a prepared dataset is: its meta files checked where they are read
(entries of the wrong type, a bpe meta.json its tokenizer.json contradicts), and the digest that tells two
tokenizers apart.
"""
import json
import pickle

import pytest

from helpers import bpe_corpus_text, write_bpe_dataset
from nanogpt_plus.dataset import read_dataset_meta, tokenizer_digest
from nanogpt_plus.errors import TokenizerError


def test_tokenizer_digest_tells_vocabularies_of_one_size_apart():
    meta = {'kind': 'char', 'vocab_size': 3, 'stoi': {'a': 0, 'b': 1, 'c': 2}}
    other = dict(meta, stoi={'a': 2, 'b': 1, 'c': 0})
    assert tokenizer_digest(meta) == tokenizer_digest(json.loads(json.dumps(meta)))
    assert tokenizer_digest(meta) != tokenizer_digest(other)
    assert tokenizer_digest(meta).startswith('char (3 tokens) ')
    assert tokenizer_digest(None) is None


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
