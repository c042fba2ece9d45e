"""
The byte-level BPE tokenizer kind ('bpe'): training is deterministic, any text round-trips byte for byte,
the end-of-text token is special only where it should be, and every kind of bad tokenizer.json is refused
in one line. The tokenizer module only (datasets, training and export have their own tests).
"""
import hashlib
import json

import pytest

from helpers import bpe_corpus_text, synthetic_bpe_json, write_bpe_dataset
from nanogpt_plus.bpe import (
    EOT_TEXT,
    MIN_BPE_VOCAB,
    BPETokenizer,
    read_tokenizer_file,
    tokenizer_fingerprint,
    train_bpe,
)
from nanogpt_plus.dataset import read_dataset_meta
from nanogpt_plus.errors import TokenizerError
from nanogpt_plus.tokenizer import CharTokenizer, GPT2Tokenizer, load_tokenizer

MIXED = "Héllo, naïve façade! 世界 データ 🎉🚀 Ελλάδα Москва\n\tend\r\n\x00\x7f tail "


def paragraphs():
    return iter(bpe_corpus_text().split("\n\n"))


def test_training_is_deterministic_and_fills_the_vocabulary(bpe512):
    tok, _ = bpe512
    again = train_bpe(paragraphs(), 512, show_progress=False)
    assert again.json == tok.json
    assert tok.vocab_size == 512
    # the merges were learned from the corpus: its text takes far fewer tokens than bytes
    text = bpe_corpus_text()[:20000]
    assert len(tok.encode_ordinary(text)) < 0.6 * len(text.encode("utf-8"))


@pytest.mark.parametrize("text", [MIXED, bpe_corpus_text()[:5000], "", " ", "🎉" * 7, "\ufffd\U0010ffff"])
def test_any_text_round_trips_byte_for_byte(bpe512, text):
    tok, _ = bpe512
    ids = tok.encode_ordinary(text)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert sum(len(tok.token_bytes(i)) for i in ids) == len(text.encode("utf-8"))
    assert tok.encode_ordinary_batch([text, text]) == [ids, ids]


def test_end_of_text_is_special_in_prompts_only(bpe512):
    tok, _ = bpe512
    assert tok.eot_token == tok.tok.token_to_id(EOT_TEXT) and tok.token_bytes(tok.eot_token) == EOT_TEXT.encode()
    text = f"one{EOT_TEXT}two"
    assert tok.eot_token in tok.encode(text)            # a prompt: the marker is the token
    assert tok.eot_token not in tok.encode_ordinary(text)  # a document: the marker is just text
    assert tok.decode(tok.encode(text)) == text == tok.decode(tok.encode_ordinary(text))


def test_a_split_character_decodes_with_replacement_then_whole(bpe512):
    tok, _ = bpe512
    ids = tok.encode_ordinary("🎉")
    assert len(ids) > 1  # not a merge of this small vocabulary: four byte tokens
    assert tok.decode(ids[:1]) == "\ufffd" and tok.decode(ids) == "🎉"


def test_description_round_trip_and_fingerprint(bpe512):
    tok, _ = bpe512
    # what a checkpoint keeps survives JSON (and torch.save) intact
    meta = json.loads(json.dumps(tok.meta()))
    back = load_tokenizer(meta)
    assert isinstance(back, BPETokenizer) and back.encode_ordinary(MIXED) == tok.encode_ordinary(MIXED)
    reformatted = json.dumps(json.loads(tok.json), indent=4)
    assert tokenizer_fingerprint(reformatted) == tokenizer_fingerprint(tok.json)
    other = train_bpe(paragraphs(), 600, show_progress=False)
    assert tokenizer_fingerprint(other.json) != tokenizer_fingerprint(tok.json)


def test_too_small_and_unfillable_vocabularies_are_refused():
    with pytest.raises(TokenizerError, match=f"vocab_size={MIN_BPE_VOCAB - 1} is smaller"):
        train_bpe(iter(["some text"]), MIN_BPE_VOCAB - 1, show_progress=False)
    with pytest.raises(TokenizerError, match=r"fills only [\d,]+ of the 5,000 tokens"):
        train_bpe(iter(["a small text, a small text"]), 5000, show_progress=False)


def test_a_vocabulary_past_65536_works():
    tok = BPETokenizer(synthetic_bpe_json(70000))
    assert tok.vocab_size == 70000 and tok.eot_token == 256
    text = "\x00" * 9 + MIXED  # the three-byte tokens (ids 65,793 up) begin with two zero bytes
    ids = tok.encode_ordinary(text)
    assert max(ids) > 65535 and tok.decode(ids) == text


def _tokenizer_json_with(bpe512, change):
    spec = json.loads(bpe512[0].json)
    change(spec)
    return json.dumps(spec)


@pytest.mark.parametrize("change, message", [
    (lambda s: s["model"].update(type="WordPiece"), "is a WordPiece tokenizer, not a byte-level BPE"),
    (lambda s: s.update(pre_tokenizer={"type": "Whitespace"}), "not bytes"),
    (lambda s: s["pre_tokenizer"].update(add_prefix_space=True), "puts a space before every text"),
    (lambda s: s.update(normalizer={"type": "NFC"}), "normalizes the text"),
    (lambda s: s.update(added_tokens=[]), "has no <|endoftext|> special token"),
    (lambda s: s.pop("model"), "not a Hugging Face tokenizer.json"),
    (lambda s: s["model"]["vocab"].update({"Ж": 700}), "ids run 0..|not written in the byte-level alphabet"),
])
def test_a_tokenizer_json_that_is_not_byte_level_bpe_is_refused(bpe512, change, message):
    with pytest.raises(TokenizerError, match=message):
        BPETokenizer(_tokenizer_json_with(bpe512, change), name="x/tokenizer.json")


def test_a_corrupt_or_missing_tokenizer_file_is_one_line(tmp_path, bpe512):
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe512[0].json[:1000], encoding="utf-8")
    with pytest.raises(TokenizerError, match="is not valid JSON"):
        read_tokenizer_file(str(path))
    with pytest.raises(TokenizerError, match="no tokenizer file at"):
        read_tokenizer_file(str(tmp_path / "nope.json"))
    path.write_text(bpe512[0].json, encoding="utf-8")
    # a directory holding tokenizer.json
    assert read_tokenizer_file(str(tmp_path)).json == bpe512[0].json


def test_dataset_meta_reads_the_tokenizer_in_and_checks_it(tmp_path, bpe512):
    tok = bpe512[0]
    d = write_bpe_dataset(tmp_path / "ds", tok, MIXED * 20)
    meta = read_dataset_meta(d)
    assert meta["kind"] == "bpe" and meta["tokenizer_json"] == tok.json and meta["dtype"] == "uint16"
    assert meta["tokenizer_sha256"] == hashlib.sha256(tok.json.encode()).hexdigest()
    (tmp_path / "ds" / "tokenizer.json").write_text(tok.json.replace('"ka"', '"kx"'), encoding="utf-8")
    with pytest.raises(TokenizerError, match="its sha256 differs"):
        read_dataset_meta(d)
    (tmp_path / "ds" / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="could not be read"):
        read_dataset_meta(d)


def test_every_kind_has_the_same_interface(bpe512):
    for tok in (GPT2Tokenizer(), CharTokenizer.from_text("abc \n"), bpe512[0]):
        ids = tok.encode_ordinary("a b\nc")
        assert tok.decode(ids) == "a b\nc" and tok.decode_bytes(ids) == b"a b\nc"
        assert b"".join(tok.token_bytes(i) for i in ids) == b"a b\nc"
        assert load_tokenizer(tok.meta()).encode("a b") == tok.encode("a b")


def test_unknown_kind_is_refused():
    with pytest.raises(TokenizerError, match="unknown tokenizer kind 'wordpiece'"):
        load_tokenizer({"kind": "wordpiece"})


def test_truncation_and_padding_saved_in_the_file_are_ignored(bpe512):
    from tokenizers import Tokenizer
    tok = bpe512[0]
    saved = Tokenizer.from_str(tok.json)
    saved.enable_truncation(max_length=4)
    saved.enable_padding(length=64, pad_id=tok.eot_token, pad_token=EOT_TEXT)
    other = BPETokenizer(saved.to_str())
    ids = tok.encode_ordinary(MIXED)
    assert len(ids) > 4 and other.encode_ordinary(MIXED) == ids and other.encode(MIXED) == tok.encode(MIXED)
    assert other.encode_ordinary_batch([MIXED, "a"]) == [ids, tok.encode_ordinary("a")]


def test_a_description_its_tokenizer_json_contradicts_is_refused(bpe512):
    for key in ("vocab_size", "eot_token"):
        meta = dict(bpe512[0].meta(), **{key: 300})
        with pytest.raises(TokenizerError, match=f"says {key}=300 but its tokenizer.json has {key}="):
            load_tokenizer(meta)
