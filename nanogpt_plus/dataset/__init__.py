"""
What a prepared dataset is, worked out once at set-up and then handed to everything that reads it
(the model builder, the loaders, the tokenizer and vocabulary checks): its directory, the token
files of each split (nanoGPT's train.bin/val.bin or llm.c's shards), the dtype of the raw files, and
the tokenizer description its meta file gives (and so the vocabulary size), read and checked here:
meta.json (ours, plain JSON) or nanoGPT's meta.pkl (read with an unpickler that builds plain data
only), and each split's tokens and UTF-8 bytes as its preparation counted them (meta.json's
"split_bytes": train.py's bits per byte without a tokenizer). Whether a dataset's tokens mean to a
model what they meant to the tokenizer that made them is checked here too (check_dataset_tokenizer).
Which files are whose is told by their names (find_shards); llm.c's shard format itself is
dataset/shards.py's, loaded only where a directory holds shards.

Usage:
    from nanogpt_plus.dataset import find_dataset
    data = find_dataset('shakespeare_char')     # a name under data/, or a directory
    data.files('train'), data.meta, data.vocab_size
"""

import json
import os
import pickle
from dataclasses import dataclass

import numpy as np

from nanogpt_plus.errors import TokenizerError, UserError, error_line
from nanogpt_plus.files import refuse_special_file, sampled_digest

# the checkout above the package nanogpt_plus: data/<name> is looked up here too, wherever a script runs
REPO_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -----------------------------------------------------------------------------
# token files: nanoGPT's train.bin/val.bin (raw tokens) or llm.c's shards (a header, then the tokens;
# dataset/shards.py), told apart by their names

RAW_NAMES = ("train.bin", "val.bin")  # nanoGPT's header-less token files


def has_header(path):
    """
    Whether a token file is an llm.c shard; train.bin and val.bin (exactly) are nanoGPT's raw files.
    """
    return os.path.basename(path) not in RAW_NAMES


def token_dtype(vocab_size):
    """
    The shard dtype for a vocabulary: uint16 while every id fits (GPT-2's 50,257), else uint32.
    """
    return np.dtype(np.uint16) if vocab_size <= 2 ** 16 else np.dtype(np.uint32)


def as_token_array(ids, dtype):
    """
    ids as a dtype array, refusing (instead of silently wrapping, as numpy would) an id that doesn't
    fit.
    """
    arr = np.asarray(ids)
    dtype = np.dtype(dtype)
    if arr.dtype == dtype:
        return arr
    limit = np.iinfo(dtype).max
    if arr.size and (arr.min() < 0 or arr.max() > limit):
        bad = int(arr.max()) if arr.max() > limit else int(arr.min())
        raise UserError(
            f"token id {bad} does not fit in {dtype} (0..{limit:,}); the tokenizer's vocabulary is "
            f"too large for {dtype} token files")
    return arr.astype(dtype)


def is_shard_name(name):
    """
    Whether a file name is a shard's by find_shards' rule: a *train*.bin or *val*.bin other than
    nanoGPT's.
    """
    if not name.endswith(".bin") or name.startswith(".") or name in RAW_NAMES:
        return False
    return "train" in name or "val" in name


def find_shards(data_dir):
    """
    (train files, val files) of a dataset directory, by name: files called exactly train.bin /
    val.bin are nanoGPT's raw uint16 files; otherwise every *train*.bin (sorted by name) is a
    training shard and every
    *val*.bin a validation shard, with llm.c's header. Either list may be empty (one split, say); a directory
    with no token files at all, or with both kinds, is a UserError. Names only: opening validates
    (dataloader.open_token_file, shards.open_shard).
    """
    if not os.path.isdir(data_dir):
        raise UserError(f"no dataset directory at {data_dir}; prepare the dataset first")
    names = sorted(n for n in os.listdir(data_dir) if n.endswith(".bin") and not n.startswith("."))
    raw = [n for n in RAW_NAMES if n in names]
    shards = [n for n in names if is_shard_name(n)]
    train = [n for n in shards if "train" in n]
    val = [n for n in shards if "val" in n]
    both = sorted(set(train) & set(val))
    if both:
        raise UserError(
            f"{os.path.join(data_dir, both[0])} names both train and val, so its split is unclear; "
            f"rename it to *train*.bin or *val*.bin")
    if raw and (train or val):
        raise UserError(
            f"{data_dir} holds both nanoGPT's {'/'.join(raw)} and llm.c shards ({(train + val)[0]}, "
            f"...); keep one kind of token file per directory")
    if raw:
        train = [n for n in raw if n == "train.bin"]
        val = [n for n in raw if n == "val.bin"]
    if not (train or val):
        raise UserError(
            f"{data_dir} has no token files (train.bin/val.bin, or *train*.bin / *val*.bin shards); "
            f"prepare the dataset first")
    return [os.path.join(data_dir, n) for n in train], [os.path.join(data_dir, n) for n in val]


# -----------------------------------------------------------------------------
# finding a dataset's files

def holds_shards(data_dir):
    """
    Whether a directory holds llm.c token shards: a *train*.bin or *val*.bin other than nanoGPT's
    two.
    """
    if not os.path.isdir(data_dir):
        return False
    return any(is_shard_name(n) for n in os.listdir(data_dir))


def dataset_dir(dataset):
    """
    data/<dataset> (relative to the working directory, like nanoGPT, else to this repo), or a path.
    """
    for candidate in (dataset, os.path.join('data',
                                            dataset), os.path.join(REPO_DIR, 'data', dataset)):
        if os.path.isdir(candidate) and (os.path.exists(os.path.join(candidate, 'train.bin'))
                                         or holds_shards(candidate)):
            return candidate
    return os.path.join('data', dataset)


def missing_token_file(path, dataset=None):
    """
    The line for a token file that isn't there: a name under data/ has its prepare.py to run; a
    directory given as a path was prepared some other way.
    """
    named = dataset and not os.path.isabs(dataset) and os.sep not in dataset
    hint = f"run python data/{dataset}/prepare.py first" if named else "prepare the dataset first"
    return f"no token file at {path}; {hint}"


def is_prepared(dataset):
    """
    Whether a dataset's token files are there (what they hold is checked when they are opened):
    what depends on the dataset (the memory a new model of its vocabulary needs) is judged only
    then, so that a missing dataset is said first, with its prepare.py.
    """
    try:
        return all(os.path.lexists(path) for split in ('train', 'val')
                   for path in split_files(dataset, split))
    except UserError:  # shards without one split: said when the data is opened
        return False


def split_files(dataset, split):
    """
    The token files of a dataset's split ('train' or 'val'), in order: its llm.c shards (by
    find_shards' naming rule), else nanoGPT's data_dir/<split>.bin (whose absence
    open_token_file reports, with the prepare.py to run). dataset is a name under data/ or a
    directory.
    """
    data_dir = dataset_dir(dataset)
    if not holds_shards(data_dir):
        return [os.path.join(data_dir, f'{split}.bin')]
    if split not in ('train', 'val'):
        raise UserError(f"a directory of token shards has the splits train and val, not '{split}'; "
                        f"use --split=train or --split=val")
    files = find_shards(data_dir)[0 if split == 'train' else 1]
    if not files:
        raise UserError(
            f"{data_dir} has no {split} shards (no *{split}*.bin file); prepare the dataset again "
            f"with its {split} split")
    return files


# the dtypes a raw train.bin/val.bin can have (meta.json's "dtype")
RAW_DTYPES = ('uint16', 'uint32')


def raw_token_dtype(path):
    """
    The dtype of a raw token file: its directory's meta.json "dtype" (prepare.py records it), else
    uint16 (nanoGPT's, and what a directory without meta.json or with nanoGPT's meta.pkl holds).
    Only that key is read (and vocab_size): a bpe meta.json names its tokenizer.json rather than
    holding it, so this never parses a tokenizer. uint16 for a vocabulary past 65,536 is refused:
    its ids were cut, or the file is uint32 and would read as twice as many small, wrong ids that no
    vocabulary check catches.
    """
    meta_path = os.path.join(os.path.dirname(path), 'meta.json')
    if not os.path.exists(meta_path):
        return np.dtype(np.uint16)
    refuse_special_file(meta_path, "the dataset's")
    try:
        with open(meta_path, encoding='utf-8') as f:
            meta = json.load(f)
        dtype = meta.get('dtype', 'uint16')
        vocab_size = meta.get('vocab_size')
    except (OSError, ValueError, AttributeError) as e:
        raise UserError(
            f"{meta_path} is unreadable ({e}); re-run the dataset's prepare.py") from None
    if dtype not in RAW_DTYPES:
        raise UserError(
            f"{meta_path} says the token files are {dtype!r}, not one of {', '.join(RAW_DTYPES)}; "
            f"re-run the dataset's prepare.py")
    if isinstance(vocab_size, int) and np.dtype(dtype).itemsize < token_dtype(vocab_size).itemsize:
        raise UserError(
            f"{meta_path} says the token files are {dtype}, but its vocabulary of {vocab_size:,} tokens "
            f"needs {token_dtype(vocab_size)}; re-run the dataset's prepare.py (it records the dtype)"
        )
    return np.dtype(dtype)


# -----------------------------------------------------------------------------
# the dataset, described once

@dataclass(frozen=True)
class Dataset:
    # as the user gave it (--dataset): the hint in messages (python data/<name>/prepare.py)
    name: str
    directory: str
    split_files: dict  # {'train': [paths], 'val': [paths]}, in order
    shards: bool  # llm.c token shards (each with its header) rather than nanoGPT's raw files
    # the numpy dtype of the raw train.bin/val.bin (meta.json's 'dtype'); None for shards
    raw_dtype: object
    # the tokenizer description of its meta.json / meta.pkl; None: no meta (GPT-2 BPE assumed)
    meta: dict
    # {split: {'tokens': N, 'bytes': B}} meta.json's "split_bytes" records; None: not recorded
    split_bytes: dict = None

    def files(self, split):
        return self.split_files[split]

    def recorded_bytes(self, split, tokens):
        """
        {'bytes_per_token', 'tokens_counted', 'whole': True} of a split of `tokens` tokens, as its
        preparation counted them over every token (meta.json's "split_bytes"); None when they were
        not counted (a dataset prepared before they were, or nanoGPT's) or were counted for token
        files of another length (ones copied in from another preparation): then they are measured.
        """
        count = (self.split_bytes or {}).get(split)
        if count is None or count['tokens'] != tokens or not tokens:
            return None
        return {'bytes_per_token': count['bytes'] / count['tokens'], 'tokens_counted': count['tokens'],
                'whole': True}

    @property
    def vocab_size(self):
        """
        The tokenizer's vocabulary size its meta gives, or None (no meta, or one that names none).
        """
        size = (self.meta or {}).get('vocab_size')
        return int(size) if size else None


def find_dataset(name, splits=('train', 'val')):
    """
    The Dataset `name` (data/<name> relative to the working directory or this repo, or a path) with
    the files of `splits` (none: its tokenizer only, for a new model of its vocabulary).
    """
    directory = dataset_dir(name)
    shards = holds_shards(directory)
    files = {split: split_files(name, split) for split in splits}
    # the raw files' dtype from meta.json, once (shards carry theirs in their headers); none asked
    # for: no files
    raw_dtype = raw_token_dtype(files[splits[0]][0]) if splits and not shards else None
    meta, split_bytes = _read_meta(directory)
    return Dataset(name, directory, files, shards, raw_dtype, meta, split_bytes)


# -----------------------------------------------------------------------------
# its meta file: the tokenizer description (meta.json, or nanoGPT's meta.pkl)

class _SafeUnpickler(pickle.Unpickler):
    """
    Loads only plain data (dicts, lists, strings, numbers); a meta.pkl can't run code through us.
    """

    def find_class(self, module, name):
        raise pickle.UnpicklingError(
            f"meta.pkl refers to {module}.{name}; only plain data is allowed")


def read_dataset_meta(data_dir):
    """
    The tokenizer description of a prepared dataset directory: meta.json first, else nanoGPT's
    meta.pkl (read with a restricted unpickler), else None (the dataset is GPT-2 BPE, like nanoGPT
    assumes). A bpe dataset's tokenizer.json is read in (as 'tokenizer_json'), so the description
    stands on its own. What it returns is checked (see _checked_meta): an entry of the wrong type or
    a tokenizer.json that contradicts it is refused here, when the dataset is read, in one line
    naming the file.
    """
    return _read_meta(data_dir)[0]


def _read_meta(data_dir):
    """
    (read_dataset_meta's tokenizer description, the "split_bytes" its meta.json records, checked:
    see _checked_split_bytes; None for none or for a meta.pkl).
    """
    json_path = os.path.join(data_dir, "meta.json")
    pkl_path = os.path.join(data_dir, "meta.pkl")
    for path in (json_path, pkl_path):
        refuse_special_file(path, "the dataset's", TokenizerError)
    if os.path.exists(json_path):
        try:
            with open(json_path, encoding="utf-8") as f:
                meta = json.load(f)
        except (OSError, ValueError, RecursionError) as e:
            raise TokenizerError(f"{json_path} is unreadable ({error_line(e)}); re-run the dataset's prepare.py") \
                from None
        split_bytes = None
        if isinstance(meta, dict):
            # how the dataset was made (outputs.check_same_dataset) and what it holds, not its
            # tokenizer's description
            meta.pop("preparation", None)
            split_bytes = meta.pop("split_bytes", None)
        meta = _checked_meta(meta, json_path, data_dir)
        return meta, _checked_split_bytes(split_bytes, json_path)
    if os.path.exists(pkl_path):
        try:
            with open(pkl_path, "rb") as f:
                meta = _SafeUnpickler(f).load()
        except Exception as e:
            raise TokenizerError(
                f"{pkl_path} is unreadable or unsafe ({e}); re-run the dataset's prepare.py"
            ) from None
        if not isinstance(meta, dict):
            raise TokenizerError(
                f"{pkl_path} does not hold a dict; re-run the dataset's prepare.py")
        meta = _checked_meta(dict(meta), pkl_path, data_dir)
        meta["kind"] = tokenizer_kind(meta)
        return meta, None
    return None, None


KINDS = ("gpt2", "char", "bpe")


def _is_id(value):
    """
    Whether value is a token id or a count as a meta file can hold one: a whole number (JSON's true
    is not).
    """
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _checked_meta(meta, path, data_dir):
    """
    A dataset's meta (of meta.json or meta.pkl, at path) with itos keyed by ints (JSON's keys are
    strings) and a bpe dataset's tokenizer.json read in, refusing in one line what the rest of the
    code would trip over later or silently misread: a kind we don't know, a vocab_size that isn't a
    positive whole number, a vocabulary that isn't {character: id} / {id: character} or whose two
    halves disagree, a tokenizer.json that contradicts it.
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
        if not (isinstance(stoi, dict) and
                all(isinstance(ch, str) and _is_id(i) for ch, i in stoi.items())):
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
    # a kind that contradicts the rest would train, and every checkpoint would then claim it (a
    # GPT-2 model of 64 tokens that sample.py can't decode)
    if kind == "gpt2" and ("stoi" in meta or "itos" in meta):
        refuse("says kind 'gpt2' but holds a character vocabulary ('stoi'/'itos'); set \"kind\": \"char\"")
    if kind == "gpt2" and size is not None and size != GPT2_TOKENS:
        refuse(f"says kind 'gpt2' with vocab_size={size}, but GPT-2's tokenizer has {GPT2_TOKENS:,} tokens")
    if kind == "char" and size is not None and size != len(meta["stoi"]):
        refuse(f"says vocab_size={size}, but its 'stoi' has {len(meta['stoi'])} characters")
    if kind == "bpe":
        for key in ("tokenizer_file", "tokenizer_sha256", "tokenizer_json"):
            if meta.get(key) is not None and not isinstance(meta[key], str):
                refuse(f"has a {type(meta[key]).__name__} as its {key}, not a string")
        # held in the meta file itself, or else in the file it names
        name = f"the tokenizer.json in {path}"
        # imported here: only a bpe dataset's tokenizer.json is read and checked with the tokenizers
        # library
        from nanogpt_plus.bpe import TOKENIZER_FILE, described_bpe, read_named_tokenizer
        if "tokenizer_json" not in meta:
            meta["tokenizer_json"] = read_named_tokenizer(data_dir, meta,
                                                          "the dataset's tokens were made",
                                                          f"restore it or {remedy}")
            name = os.path.join(data_dir, meta.get("tokenizer_file") or TOKENIZER_FILE)
        described_bpe(meta, source=path, name=name, remedy=remedy)
    return meta


def _ids_to_text(itos, refuse):
    """
    An {id: character} vocabulary with int keys (meta.json's are strings of digits), or refuse(why).
    """
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
# each split's UTF-8 bytes, counted by its preparation: meta.json's
#     "split_bytes": {"version": 1, "train": {"tokens": N, "bytes": B}, "val": {...}}
# every token of the split and the UTF-8 bytes they decode to (tokenizer.token_byte_lengths, the
# lengths split_bytes_per_token sums), so train.py's bits per byte need no tokenizer to measure them

SPLIT_BYTES_VERSION = 1
SPLITS = ("train", "val")


def split_bytes_record(counts):
    """ meta.json's "split_bytes" for {split: (tokens, bytes)}. """
    return {"version": SPLIT_BYTES_VERSION,
            **{split: {"tokens": int(tokens), "bytes": int(num_bytes)}
               for split, (tokens, num_bytes) in counts.items()}}


def _checked_split_bytes(record, path):
    """
    {split: {'tokens': N, 'bytes': B}} of a meta.json's "split_bytes" (None: none), refusing in one
    line one that is not split_bytes_record's: a file edited by hand, or another program's.
    """
    if record is None:
        return None
    if not (isinstance(record, dict) and record.get("version") == SPLIT_BYTES_VERSION):
        raise TokenizerError(
            f"{path} has a 'split_bytes' that is not a {{\"version\": {SPLIT_BYTES_VERSION}, ...}} "
            f"record; re-run the dataset's prepare.py")
    counts = {split: count for split, count in record.items() if split != "version"}
    for split, count in counts.items():
        if split not in SPLITS or not (isinstance(count, dict) and sorted(count) == ["bytes", "tokens"]
                                       and all(_is_id(n) for n in count.values())):
            raise TokenizerError(
                f"{path} has a 'split_bytes' entry {split!r}: {json.dumps(count)[:60]} that is not a "
                f"split's {{\"tokens\": N, \"bytes\": B}}; re-run the dataset's prepare.py")
    return counts


def tokenizer_kind(meta):
    """
    'gpt2', 'char' or 'bpe': a description's kind (nanoGPT's meta.pkl has none: char when it has a
    vocabulary).
    """
    return meta.get("kind", "char" if "stoi" in meta else "gpt2")


GPT2_TOKENS = 50257  # GPT-2's BPE, whose descriptions name no size


def tokenizer_size(meta):
    """
    The number of token ids a tokenizer description uses (GPT-2's name none: 50,257), None if
    unknown.
    """
    kind = tokenizer_kind(meta)
    size = meta.get('vocab_size') or (len(meta.get('stoi') or {}) if kind == 'char' else None)
    return GPT2_TOKENS if size is None and kind == 'gpt2' else size


# -----------------------------------------------------------------------------
# compatibility: whether a dataset's tokens mean to a model what they meant to the tokenizer that
# made them

def tokenizer_identity(meta):
    """
    What makes two tokenizer descriptions the same: ('gpt2',), ('char', its {character: id}
    vocabulary) or ('bpe', the fingerprint of its tokenizer.json: the content, whatever its
    formatting).
    """
    kind = tokenizer_kind(meta)
    if kind == 'char':
        return kind, {str(ch): int(i) for ch, i in (meta.get('stoi') or {}).items()}
    if kind == 'bpe':
        # only a bpe tokenizer has a tokenizer.json to compare
        from nanogpt_plus.bpe import tokenizer_fingerprint
        return kind, tokenizer_fingerprint(
            meta['tokenizer_json']) if meta.get('tokenizer_json') else None
    return (kind,)


def tokenizer_digest(meta):
    """
    What tells two nodes' tokenizer descriptions apart (a dataset prepared again with another
    vocabulary on one node), short enough for a message: its kind and size and a digest of its
    identity (tokenizer_identity: the character vocabulary, the bpe tokenizer.json's content), e.g.
    'char (65 tokens) 3f2a...'; None for a dataset without a meta file.
    """
    if meta is None:
        return None
    import hashlib
    identity = json.dumps(tokenizer_identity(meta), sort_keys=True)
    return f"{_describe_tokenizer(meta)} {hashlib.sha256(identity.encode()).hexdigest()[:12]}"


def data_digests(files):
    """
    {name: sampled_digest} of files ({name: path}): what every rank compares of the data it reads
    (SAME_DATA): each file's size and all of its bytes up to 16 MiB, else 256 blocks spread over it
    (4 MiB each: a dataset of a hundred shards costs 400 MiB of reading at start-up, once per node,
    its ranks finding them in the page cache; docs/training.md has the time it takes).
    """
    return {name: sampled_digest(path) for name, path in files.items()}


# what must be the same on every rank of the data it reads (distributed.every_rank's agree): the
# tokenizer description and each file's digest, and what to do when they are not
SAME_DATA = {
    'tokenizer':
    "give every node the same prepared dataset (its meta.json or meta.pkl describes another "
    "tokenizer on one node)",
    'data':
    "give every node the same copy of each file (the sizes and the bytes of every file are "
    "compared: all of them up to 16 MiB, else 256 blocks spread over it)",
}


TRAIN_REMEDY = "train on a dataset prepared with the model's tokenizer, or from scratch on this one"


def check_dataset_tokenizer(data_dir, data_meta, tokenizer_meta, source, remedy=TRAIN_REMEDY):
    """
    A model trained with one tokenizer reads another's ids as other tokens and trains on (or is
    scored) without an error: refuse a dataset whose meta describes another tokenizer (another kind,
    another character vocabulary, or another bpe tokenizer.json). A dataset without a meta file says
    nothing about its tokenizer; its ids are checked against the model's vocab_size as they are read
    (dataloader.check_token_ids). remedy: what to do.
    """
    if data_meta is None or tokenizer_identity(data_meta) == tokenizer_identity(tokenizer_meta):
        return
    raise UserError(
        f"{_tokenizer_difference(data_dir, data_meta, source, tokenizer_meta)}: its token ids would "
        f"mean other tokens to the model; {remedy}")


def _describe_tokenizer(meta):
    """ A description's kind and size for messages, e.g. 'bpe (8,192 tokens)'. """
    size = tokenizer_size(meta)
    return f"{tokenizer_kind(meta)} ({int(size):,} tokens)" if size else tokenizer_kind(meta)


def _tokenizer_difference(data_dir, data_meta, source, model_meta):
    """ The words for how two different tokenizer descriptions differ, naming both. """
    data = tokenizer_identity(data_meta)
    model = tokenizer_identity(model_meta)
    if data[0] != model[0] or data[0] == 'bpe':
        other = "another tokenizer.json: " if data[0] == model[0] else ""
        return (
            f"the dataset {data_dir} is tokenized with {other}{_describe_tokenizer(data_meta)}, the model "
            f"{source} with {_describe_tokenizer(model_meta)}")
    if set(data[1]) == set(model[1]):
        return f"the dataset {data_dir} numbers the model's characters ({source}) differently"
    data_chars = ''.join(sorted(data[1]))
    model_chars = ''.join(sorted(model[1]))
    return (
        f"the dataset {data_dir} has another character vocabulary ({len(data_chars)} characters "
        f"{data_chars[:40]!r}) than the model {source} ({len(model_chars)} characters {model_chars[:40]!r})"
    )
