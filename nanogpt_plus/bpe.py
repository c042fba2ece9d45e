"""
Byte-level BPE tokenizers of any size, trained on your own corpus (Hugging Face `tokenizers`) and
stored as a tokenizer.json: the BPETokenizer, training one, reading one from a file or from the
description that names it, and the checks that refuse, in one line, a tokenizer.json that would not
give a text back byte for byte (a normalizer, BPE dropout, a pre-tokenizer without its ByteLevel
step, ...). tokenizer.py gives it the interface of the other tokenizers (load_tokenizer).

Usage:
    from nanogpt_plus.bpe import read_tokenizer_file, train_bpe
    tok = train_bpe(iter(texts), 8192)           # 8,192 tokens, <|endoftext|> among them
    tok = read_tokenizer_file('data/mine/tokenizer.json')
    tok.encode_ordinary("Hello"), tok.decode(ids), tok.meta()
"""

import functools
import hashlib
import json
import os

from nanogpt_plus.errors import TokenizerError, error_line

# the end-of-text token of GPT-2's BPE and of every bpe tokenizer made here: it separates documents
EOT_TEXT = "<|endoftext|>"
# a bpe tokenizer's file, beside the meta that names it
TOKENIZER_FILE = "tokenizer.json"


MIN_BPE_VOCAB = 257  # the 256 byte tokens every byte-level BPE starts from, plus <|endoftext|>
# the largest BPE trained here: 1,048,576 tokens, 4x the largest vocabularies in use (256k) and 20x
# GPT-2's. The tokenizers library allocates for vocab_size up front (~70 bytes a token: 70 GB and an
# abort for 10**9), and a corpus rarely has that many distinct byte pairs to merge anyway
MAX_BPE_VOCAB = 2**20


@functools.lru_cache(maxsize=None)
def byte_alphabet():
    """
    {character: byte} of byte-level BPE (GPT-2's): a token's text is one printable character per
    byte, the printable bytes standing for themselves and the other 68 (controls, space, ...)
    shifted to 256 + n in order.
    """
    # '!'..'~', '¡'..'¬', '®'..'ÿ'
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    table = {}
    shifted = 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class BPETokenizer:
    """
    A byte-level BPE described by a Hugging Face tokenizer.json, with an <|endoftext|> token. Every
    text encodes (no unknown characters) and decodes back byte for byte: the tokens are pieces of
    its UTF-8 bytes.
    """
    kind = "bpe"

    def __init__(self, tokenizer_json, name="the tokenizer"):
        from tokenizers import Tokenizer
        self.json = tokenizer_json
        spec = _check_byte_level_bpe(tokenizer_json, name)
        try:
            self.tok = Tokenizer.from_str(tokenizer_json)
            self.ordinary = Tokenizer.from_str(tokenizer_json)
        except BaseException as e:  # the Rust parser's error: a field missing or of the wrong type
            # a panic inside the Rust library arrives as pyo3's PanicException, a BaseException: one
            # line too
            if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
                raise
            raise TokenizerError(
                f"{name} is not a valid tokenizer.json ({error_line(e)}); use the file "
                f"prepare.py wrote, or --tokenizer=bpe to train a new one") from None
        # encode_ordinary: '<|endoftext|>' in a text is just text
        self.ordinary.encode_special_tokens = True
        for t in (self.tok, self.ordinary):
            # a tokenizer.json saved with truncation or padding on (max_length, pad_id) would cut
            # every document short or fill it with pad ids, silently: the ids here are always those
            # of the whole text
            t.no_truncation()
            t.no_padding()
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        self.eot_token = self.tok.token_to_id(EOT_TEXT)
        self._bytes = _token_byte_table(spec, self.tok, self.vocab_size, name)
        _check_round_trip(self, name)

    def encode(self, text):
        # like GPT2Tokenizer: the end-of-text marker in a prompt is the special token
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_ordinary(self, text):
        return self.ordinary.encode(text, add_special_tokens=False).ids

    def encode_ordinary_batch(self, texts):
        """ encode_ordinary of many texts at once, in parallel threads of the Rust library. """
        return [e.ids for e in self.ordinary.encode_batch(list(texts), add_special_tokens=False)]

    def decode_bytes(self, ids):
        return b"".join(self._bytes[int(i)] for i in ids)

    def decode(self, ids):
        # a sample may stop in the middle of a character's bytes: shown as U+FFFD, like tiktoken's
        # decode
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token):
        return self._bytes[int(token)]

    def meta(self):
        return {"kind": "bpe", "vocab_size": self.vocab_size, "eot_token": self.eot_token,
                "tokenizer_json": self.json}

    def file_meta(self):
        """
        The description a directory's meta file keeps when the tokenizer.json beside it holds the
        rest.
        """
        return {
            "kind": "bpe",
            "vocab_size": self.vocab_size,
            "eot_token": self.eot_token,
            "tokenizer_file": TOKENIZER_FILE,
            "tokenizer_sha256": tokenizer_file_sha256(self.json)
        }


# -----------------------------------------------------------------------------
# the checks of a tokenizer.json

def _parse_json(text, name, remedy):
    """
    json.loads of a file's text, or one line: not JSON, or nested too deeply for Python to parse.
    """
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise TokenizerError(
            f"{name} is not valid JSON ({error_line(e)}); it is corrupt: {remedy}") from None


def _refuse_type(value, expected, what, name):
    """
    Refuse (in one line) a tokenizer.json field of the wrong type: a file edited by hand, or not a
    tokenizer's.
    """
    if not isinstance(value, expected):
        raise TokenizerError(
            f"{name} is not a valid tokenizer.json (its {what} is a {type(value).__name__}); use "
            f"the file prepare.py wrote, or --tokenizer=bpe to train a new one")


def _check_byte_level_bpe(tokenizer_json, name):
    """
    The parsed tokenizer.json, refusing (in one line) one that isn't a byte-level BPE with
    <|endoftext|>, or whose settings would change the text it encodes (a normalizer, BPE dropout,
    pieces of words marked with a prefix). The fields read here are type-checked first; the Rust
    parser checks the rest (the vocabulary, the merges).
    """
    spec = _parse_json(tokenizer_json, name,
                       "re-run prepare.py with --tokenizer=bpe to train a new one")
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise TokenizerError(
            f"{name} is not a Hugging Face tokenizer.json (no 'model'); pass a tokenizer.json "
            f"or --tokenizer=bpe")
    model = spec["model"]
    if "type" not in model:
        raise TokenizerError(
            f"{name} does not say what its model is (no 'type' in 'model'); pass a byte-level BPE "
            f"tokenizer.json (e.g. one prepare.py trained) or --tokenizer=bpe")
    if model["type"] != "BPE":
        raise TokenizerError(
            f"{name} is a {model['type']} tokenizer, not a byte-level BPE; pass a byte-level BPE "
            f"tokenizer.json (e.g. one prepare.py trained) or --tokenizer=bpe")
    _check_byte_level_step(spec, name)
    normalizer = spec.get("normalizer")
    if normalizer:
        what = normalizer.get("type") if isinstance(normalizer, dict) else type(normalizer).__name__
        raise TokenizerError(
            f"{name} normalizes the text ({what}), so decoding would not give back the text byte "
            f"for byte; pass a byte-level BPE without a normalizer")
    _check_bpe_model(model, name)
    added = spec.get("added_tokens") or []
    _refuse_type(added, list, "'added_tokens'", name)
    for token in added:
        _refuse_type(token, dict, "entry of 'added_tokens'", name)
        if token.get("lstrip") or token.get("rstrip"):
            # the token would take the spaces and line ends beside it in a prompt, and decoding not
            # give them back
            raise TokenizerError(
                f"{name} lets its added token {token.get('content')!r} swallow the whitespace "
                f"around it (lstrip/rstrip); set \"lstrip\": false and \"rstrip\": false in it, or "
                f"use --tokenizer=bpe")
    if not any(t.get("content") == EOT_TEXT and t.get("special") for t in added):
        raise TokenizerError(
            f"{name} has no {EOT_TEXT} special token, which separates documents; train one "
            f"with --tokenizer=bpe (it adds it)")
    return spec


def _check_bpe_model(model, name):
    """
    Refuse model settings that make the ids of a text random (dropout) or its tokens other than its
    bytes.
    """
    dropout = model.get("dropout")
    if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and dropout > 0:
        # skipped merges at random: a dataset's token files would differ at every run, and a
        # prompt's from them
        raise TokenizerError(
            f"{name} uses BPE dropout (\"dropout\": {dropout}), so the same text encodes "
            f"differently each time; set \"dropout\": null in its model, or use --tokenizer=bpe")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            # the marker is part of the token's text, so its bytes would be decoded as if the text
            # held them
            raise TokenizerError(
                f"{name} marks pieces of words ({key} {model[key]!r}), so its tokens are not "
                f"the text's bytes; pass a byte-level BPE without it, or use --tokenizer=bpe")


def _check_byte_level_step(spec, name):
    """
    Refuse a pre-tokenizer without a ByteLevel step, or one whose ByteLevel step adds a space to the
    text.
    """
    pre = spec.get("pre_tokenizer") or {}
    _refuse_type(pre, dict, "'pre_tokenizer'", name)
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    _refuse_type(steps, list, "pre-tokenizer Sequence's 'pretokenizers'", name)
    for step in steps:
        _refuse_type(step, dict, "pre-tokenizer step", name)
    byte_level = [step for step in steps if step and step.get("type") == "ByteLevel"]
    if not byte_level:
        raise TokenizerError(
            f"{name} is a BPE over characters, not bytes (its pre-tokenizer has no ByteLevel "
            f"step), so some text would have no tokens; pass a byte-level BPE or --tokenizer=bpe")
    if any(step.get("add_prefix_space") for step in byte_level):
        # a space before every document (and before every piece of a long one) that the text never
        # had
        raise TokenizerError(
            f"{name} puts a space before every text (its ByteLevel pre-tokenizer has "
            f"add_prefix_space), so decoding would not give back the text byte for byte; set "
            f"\"add_prefix_space\": false in it, or use --tokenizer=bpe")


# The text every bpe tokenizer must give back byte for byte, and encode alike each time: what a
# pre-tokenizer, a normalizer or a model setting may drop or change. Runs of spaces and tabs, every
# line end, blank lines, space at either end, case, accents precomposed and combining, forms
# NFC/NFKC rewrite (the Ohm sign, a ligature, a superscript, full-width letters, a no-break space),
# CJK, emoji with a skin tone, a flag and a ZWJ family.
ROUND_TRIP_PROBE = (
    "  Hello, World! It's 2024: 3.14 + x_1 = {y}; #tag @user ~/path\\file.txt\n"
    "Two  spaces,   three and    four.\tA tab,\t\ttwo tabs. \t \r\n"
    "A Windows line end above, a blank line below.\n\n"
    "café cafe\u0301 naïve Ångström 50\u2126 \ufb01ne x\u00b2 \uff26\uff55\uff4c\uff4c width\u00a0nbsp\n"
    "日本語のテキスト、中文，한국어 — dashes – and 'quotes' \"double\"\n"
    "emoji 🎉🚀 👍🏽 🇫🇷 👩\u200d👩\u200d👧 zero\u200bwidth\x00\x7f end  \n\n")


def _check_round_trip(tok, name):
    """
    Refuse a tokenizer that doesn't give ROUND_TRIP_PROBE back byte for byte (a pre-tokenizer step
    that drops whitespace or characters) or that encodes it differently from one call to the next:
    token files in its ids would hold another text than the corpus, or another one at every run,
    without an error.
    """
    remedy = "pass a byte-level BPE that keeps every byte (e.g. one prepare.py trained), or use --tokenizer=bpe"
    ids = tok.encode_ordinary(ROUND_TRIP_PROBE)
    # a prompt with the end-of-text token in it: whitespace beside it must survive too
    prompt = f"{ROUND_TRIP_PROBE} {EOT_TEXT}\n{ROUND_TRIP_PROBE}"
    for text, got in ((ROUND_TRIP_PROBE, ids), (prompt, tok.encode(prompt))):
        back = tok.decode_bytes(got)
        if back != text.encode("utf-8"):
            raise TokenizerError(
                f"{name} does not give text back byte for byte ({_first_difference(text, back)}); "
                f"{remedy}")
    again = [tok.encode_ordinary(ROUND_TRIP_PROBE), tok.encode_ordinary(ROUND_TRIP_PROBE),
             *tok.encode_ordinary_batch([ROUND_TRIP_PROBE, ROUND_TRIP_PROBE])]
    if any(other != ids for other in again):
        raise TokenizerError(
            f"{name} encodes the same text differently from one call to the next (BPE dropout or "
            f"another random step), so its token files could not be reproduced; {remedy}")


def _first_difference(text, back):
    """
    Where a text and the bytes it came back as part, as a few characters of each around that place.
    """
    back = back.decode("utf-8", errors="replace")
    at = next((i for i, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
    start = max(0, at - 8)
    return f"{text[start:at + 8]!r} came back as {back[start:at + 8]!r}"


def _token_byte_table(spec, tok, vocab_size, name):
    """ The bytes of every token id, 0..vocab_size-1 (a special token's are its text's UTF-8). """
    alphabet = byte_alphabet()
    # written as themselves, not in bytes
    added = {t.get("content") for t in spec.get("added_tokens") or []}
    table = [None] * vocab_size
    for text, i in tok.get_vocab(with_added_tokens=True).items():
        if i >= vocab_size:
            raise TokenizerError(
                f"{name} numbers its tokens with gaps (id {i} in a vocabulary of {vocab_size}); "
                f"pass a tokenizer.json whose ids run 0..{vocab_size - 1}")
        if text in added:
            table[i] = text.encode("utf-8")
        elif all(ch in alphabet for ch in text):
            table[i] = bytes(alphabet[ch] for ch in text)
        else:
            raise TokenizerError(
                f"{name} has the token {text!r}, which is not written in the byte-level alphabet; "
                f"pass a byte-level BPE tokenizer.json")
    missing = [i for i, b in enumerate(table) if b is None]
    if missing:
        raise TokenizerError(
            f"{name} has no token with id {missing[0]}; pass a tokenizer.json whose ids run "
            f"0..{vocab_size - 1}")
    return table


# -----------------------------------------------------------------------------
# training one, reading one, naming one

def check_bpe_vocab_size(vocab_size):
    """ Refuse a vocab_size with no room for merges, or more than MAX_BPE_VOCAB, before any text is read. """
    if vocab_size < MIN_BPE_VOCAB:
        raise TokenizerError(
            f"vocab_size={vocab_size} is smaller than a byte-level BPE's base vocabulary (256 "
            f"bytes + {EOT_TEXT} = {MIN_BPE_VOCAB}); use --vocab_size={MIN_BPE_VOCAB} or more")
    if vocab_size > MAX_BPE_VOCAB:
        raise TokenizerError(
            f"vocab_size={vocab_size:,} is more than a BPE trained here can sensibly have: at most "
            f"{MAX_BPE_VOCAB:,} (the tokenizer library allocates memory for every token up front, "
            f"and a corpus has rarely that many byte pairs to merge); use --vocab_size={MAX_BPE_VOCAB} "
            f"or less")


def train_bpe(texts, vocab_size, length=None, show_progress=True):
    """
    A byte-level BPE of vocab_size tokens learned from texts (an iterator of strings or of lists of
    strings, read once): GPT-2's pre-tokenizer (its regex, then bytes), the 256 byte tokens,
    <|endoftext|> as id 0, then merges. Memory holds the distinct words seen, not the corpus. The
    same texts and vocab_size give the same tokenizer.json. length (the number of items, if known)
    drives the progress bar.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    check_bpe_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT],
                                  show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got < vocab_size:
        raise TokenizerError(
            f"the corpus fills only {got:,} of the {vocab_size:,} tokens asked for (BPE ran out "
            f"of pairs to merge); use --vocab_size={got} or less, or more text")
    return _bpe_tokenizer(tok.to_str(), name="the trained tokenizer")


def read_tokenizer_file(path):
    """
    A BPETokenizer from a tokenizer.json file (--tokenizer=PATH), or one line saying what is wrong.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise TokenizerError(f"no tokenizer file at {path}; pass the path of a tokenizer.json, or "
                             f"--tokenizer=bpe|gpt2|char") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(
            f"{path} could not be read as a tokenizer.json ({e}); pass a readable UTF-8 "
            f"tokenizer.json, or --tokenizer=bpe to train one") from None
    return _bpe_tokenizer(text, name=path)


def tokenizer_fingerprint(tokenizer_json):
    """
    The sha256 of a tokenizer.json's content, independent of its formatting (key order,
    indentation).
    """
    spec = _parse_json(tokenizer_json, "the tokenizer.json", "use the file prepare.py wrote")
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def tokenizer_file_sha256(tokenizer_json):
    """
    The sha256 a meta.json records of the tokenizer.json beside it: of its exact UTF-8 text, as
    written.
    """
    return hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()


_BUILT_BPE = {}  # tokenizer.json text -> its BPETokenizer, least recently used first
_BUILT_BPE_KEPT = 4


def _bpe_tokenizer(tokenizer_json, name="the tokenizer"):
    """
    One BPETokenizer per tokenizer.json text: building and checking one of a large vocabulary takes
    a second, and a run reads the same file as a dataset's, then a checkpoint's tokenizer. Keyed by
    the text alone (not by name, which only goes into the message of a tokenizer refused, and a
    refused one is not kept).
    """
    tok = _BUILT_BPE.pop(tokenizer_json, None) or BPETokenizer(tokenizer_json, name)
    _BUILT_BPE[tokenizer_json] = tok  # (re)inserted last: the most recently used
    while len(_BUILT_BPE) > _BUILT_BPE_KEPT:
        del _BUILT_BPE[next(iter(_BUILT_BPE))]
    return tok


def described_bpe(meta, source="the bpe tokenizer description", name="the tokenizer",
                   remedy="re-run the dataset's prepare.py"):
    """
    The BPETokenizer of a bpe description, refusing one whose vocab_size or eot_token its file
    contradicts. source names the description in that message, name the tokenizer.json in the
    tokenizer's own.
    """
    if not isinstance(meta["tokenizer_json"], str):
        raise TokenizerError(
            f"{source} holds a {type(meta['tokenizer_json']).__name__} as its tokenizer.json, not "
            f"its text; {remedy}")
    tok = _bpe_tokenizer(meta["tokenizer_json"], name)
    # a model's vocab_size is taken from meta.json's, so a meta.json edited by hand must agree with
    # the file
    for key in ("vocab_size", "eot_token"):
        if meta.get(key) is not None and meta[key] != getattr(tok, key):
            raise TokenizerError(f"{source} says {key}={meta[key]!r} but its tokenizer.json has "
                                 f"{key}={getattr(tok, key)}; {remedy}")
    return tok


def read_named_tokenizer(directory, meta, made_with, remedy):
    """
    The text of the tokenizer.json a bpe description names ('tokenizer_file', in directory), checked
    against the sha256 it records: one file, never a second copy that could drift apart, yet a file
    replaced or re-saved since is refused. made_with says whose it is ("the dataset's tokens were
    made"); remedy what to do. The tokenizer is built (once per text) and checked here, so a file
    that can't be used is refused naming it.
    """
    for key in ("tokenizer_file", "tokenizer_sha256"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            raise TokenizerError(f"the description of the tokenizer {made_with} with has a "
                                 f"{type(meta[key]).__name__} as its {key}, not a string; {remedy}")
    path = os.path.join(directory, meta.get("tokenizer_file") or "tokenizer.json")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(
            f"{path} (the tokenizer {made_with} with) could not be read ({e}); {remedy}") from None
    expected = meta.get("tokenizer_sha256")
    if expected and tokenizer_file_sha256(text) != expected:
        raise TokenizerError(
            f"{path} is not the tokenizer {made_with} with (its sha256 differs from the one "
            f"recorded); {remedy}")
    _bpe_tokenizer(text, name=path)
    return text
