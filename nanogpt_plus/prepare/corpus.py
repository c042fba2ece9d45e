"""
Large corpora, nanoGPT's openwebtext recipe for any text collection and any tokenizer: a Hugging
Face dataset by name or local .txt / .jsonl / .json / .parquet files; a val split (a shuffled share
of the documents, or the end of the text when it is one document, as in nanoGPT's Shakespeare); the
tokenizer (GPT-2's, the corpus's characters, a byte-level BPE trained on the train split, or a
tokenizer.json); every document encoded by num_proc worker processes (then the end-of-text token,
where the tokenizer has one); each split concatenated into one uint16 (or, past 65,536 tokens,
uint32) file batch by batch, so memory is bounded by one batch, not by the corpus.

Usage:
    from nanogpt_plus.prepare.corpus import prepare_corpus
    prepare_corpus('data/openwebtext')                                         # ~9B tokens from the Hub
    prepare_corpus('data/mine', files='corpus/*.jsonl', text_column='body', num_proc=4)
    prepare_corpus('data/mytext', files='corpus/*.txt', sample_by='document', test_size=0.1,
                   tokenizer='bpe', vocab_size=8192)                           # data/text/prepare.py
"""

import functools
import glob
import json
import math
import os
import re
import time

import numpy as np

from nanogpt_plus.bpe import BPETokenizer, check_bpe_vocab_size, read_tokenizer_file, train_bpe
from nanogpt_plus.errors import UserError, error_line
from nanogpt_plus.files import atomic_outputs
from nanogpt_plus.outputs import RAW, check_out_dir, check_same_dataset, preparing
from nanogpt_plus.prepare.shakespeare import encode_chars
from nanogpt_plus.prepare.text import find_invalid_utf8
from nanogpt_plus.prepare.token_files import ByteCounter, check_vocab_fits, write_dataset_meta, write_token_batches
from nanogpt_plus.tokenizer import CharTokenizer, GPT2Tokenizer, load_tokenizer, token_byte_lengths

# the Hugging Face datasets builder that reads each kind of local file
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# the sample_by setting's choices: how the text builder cuts a .txt file into documents
SAMPLE_BY = ("line", "paragraph", "document")
# what --tokenizer names; anything else is the path of a tokenizer.json
TOKENIZERS = ("bpe", "gpt2", "char")
DEFAULT_BPE_VOCAB = 8192
# one long text is cut into pieces of about this many characters (see text_pieces)
PIECE_CHARS = 1 << 16
TEXT_ROWS = 256  # documents (or pieces) read at a time for the tokenizer's training and vocabulary


def prepare_corpus(out_dir, *args, **kwargs):
    """ _prepare_corpus(out_dir, ...), one prepare at a time in out_dir (outputs.preparing). """
    with preparing(out_dir):
        return _prepare_corpus(out_dir, *args, **kwargs)


def _prepare_corpus(out_dir, dataset="openwebtext", files="", text_column="text", num_proc=1,
                   test_size=0.0005, seed=2357, total_batches=1024, cache_dir="",
                   sample_by="paragraph", load_from_cache_file=True, progress=True, name="",
                   tokenizer="gpt2", vocab_size=None, overwrite=False):
    """
    nanoGPT's openwebtext/prepare.py for any corpus: train.bin, val.bin and meta.json in out_dir (+
    meta.pkl for char, tokenizer.json for bpe; meta.json records each split's tokens and UTF-8
    bytes, counted as they are written, for train.py's bits per byte). tokenizer: 'gpt2', 'char', 'bpe' (trained on the
    train split, of vocab_size tokens, None = 8,192) or the path of a tokenizer.json; test_size: the
    share held out for val. An out_dir holding token shards, a training run or another dataset (of
    another corpus, tokenizer or vocabulary) is refused unless overwrite (outputs.check_out_dir,
    check_same_dataset).
    """
    check_options(num_proc, test_size)
    # now, so a bad choice fails before the corpus is read
    tok = given_tokenizer(tokenizer, vocab_size)
    # after the cheap checks: with overwrite it removes the shards there
    check_out_dir(out_dir, RAW, overwrite)
    # another corpus or tokenizer than the dataset there was made from: refused before any work
    corpus = corpus_record(dataset, files, name)
    preparation = check_same_dataset(out_dir, corpus, tokenizer_name(tokenizer, vocab_size), tok,
                                     overwrite)
    ds, text_column = load_corpus(dataset, files, text_column, num_proc, cache_dir, sample_by, name)
    print(n_documents(len(ds)))
    splits, by_documents = split_corpus(ds, text_column, test_size, seed, piece_chars(tok))
    if tok is None:  # char and bpe: made from the corpus
        tok = corpus_tokenizer(tokenizer, vocab_size or DEFAULT_BPE_VOCAB, splits, text_column,
                               by_documents, progress)
        # the corpus changed under its name and size: another vocabulary, refused before the
        # encoding
        preparation = check_same_dataset(out_dir, corpus, preparation["tokenizer"], tok, overwrite)
    dtype = describe_tokenizer(tok, by_documents)
    t0 = time.time()
    tokenized = tokenize_splits(splits, text_column, tok, dtype, by_documents, num_proc,
                                load_from_cache_file)
    t_tok = time.time() - t0
    t0 = time.time()
    # each split's UTF-8 bytes, recorded for the bits per byte
    counter = ByteCounter(token_byte_lengths(tok))
    with atomic_outputs(out_dir) as out:
        counts = write_splits(tokenized, out, dtype, total_batches, progress, counter)
        write_dataset_meta(out, tok, dtype, preparation, counter.record())
    t_write = time.time() - t0
    return report(out_dir, counts, tokenized if by_documents else None, len(ds), num_proc, t_tok,
                  t_write)


def report(out_dir, counts, tokenized, documents, num_proc, t_tok, t_write):
    """
    The closing lines (tokens per split, speed) and the figures; tokenized is None for a one-text
    corpus.
    """
    total = sum(counts.values())
    for split, n in counts.items():
        print(f"{split} has {n:,} tokens" +
              (f" ({n_documents(len(tokenized[split]))})" if tokenized else ""))
    print(
        f"wrote {total:,} tokens to {out_dir}: tokenized at {total / max(t_tok, 1e-9):,.0f} tokens/s "
        f"(num_proc={num_proc}, {t_tok:.1f} s), written at {total / max(t_write, 1e-9):,.0f} tokens/s"
    )
    return {
        "train_tokens": counts["train"],
        "val_tokens": counts["val"],
        "documents": documents,
        "tokenize_seconds": t_tok,
        "write_seconds": t_write,
        "tokens_per_second": total / max(t_tok, 1e-9)
    }


def n_documents(n):
    return f"{n:,} document{'' if n == 1 else 's'}"


def check_options(num_proc, test_size):
    if num_proc < 1:
        raise UserError(f"num_proc must be at least 1, got {num_proc}")
    if not 0 < test_size < 1:
        raise UserError(
            f"the share of the corpus held out for val must be between 0 and 1 (exclusive), got "
            f"{test_size}; e.g. 0.1 holds out a tenth")


# -----------------------------------------------------------------------------
# finding and loading the documents

def expand_files(files):
    """
    A comma-separated list of paths or glob patterns -> sorted existing paths, all of one supported
    kind.
    """
    paths = []
    for pattern in (p.strip() for p in files.split(",") if p.strip()):
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        for path in matches:
            if os.path.isdir(path):
                raise UserError(
                    f"input {path} is a directory; pass its files (e.g. --input='{path}/*.txt')")
            if not os.path.isfile(path):
                raise UserError(
                    f"input file {path} does not exist; pass existing .txt, .jsonl or .parquet files"
                )
            try:  # now: datasets would say it deep in its own words, after minutes on the others
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise UserError(f"could not read input file {path} ({e.strerror or e}); make it "
                                f"readable by this user") from None
        if not matches:
            raise UserError(
                f"no files match {pattern}; pass existing .txt, .jsonl or .parquet files")
        paths += matches
    kinds = {os.path.splitext(p)[1].lower() for p in paths}
    unknown = [p for p in paths if os.path.splitext(p)[1].lower() not in LOCAL_BUILDERS]
    if unknown:
        # a file's kind is told by its extension alone
        ext = os.path.splitext(unknown[0])[1]
        named = f"the extension {ext}" if ext else "no extension"
        raise UserError(
            f"can't read {unknown[0]}: it has {named}, and --input reads .txt, .jsonl, .json and "
            f".parquet files (told by their extension); rename it, e.g. to {os.path.splitext(unknown[0])[0]}.txt")
    # one load_dataset call reads one builder's files
    if len({LOCAL_BUILDERS[k] for k in kinds}) > 1:
        raise UserError(
            f"mixed file kinds ({', '.join(sorted(kinds))}); prepare one kind of file per run")
    if not any(os.path.getsize(p) for p in paths):
        raise UserError(
            f"the input files are empty ({', '.join(paths[:3])}); pass files with some text")
    return paths


def load_corpus(dataset="openwebtext", files="", text_column="text", num_proc=1, cache_dir="",
                sample_by="paragraph", name=""):
    """
    One Hugging Face Dataset with a text column: local files (.txt: one document per
    line/paragraph/file, per sample_by; .jsonl/.json/.parquet: one per row) when files is set, else
    the train split of the Hub dataset (of its config `name`, e.g. 'sample-10BT'; '' = the dataset's
    default).
    """
    import datasets  # imported here: it takes seconds, and only this path needs it
    kwargs = dict(num_proc=num_proc if num_proc > 1 else None, cache_dir=cache_dir or None)
    if files:
        paths = expand_files(files)
        builder = LOCAL_BUILDERS[os.path.splitext(paths[0])[1].lower()]
        if builder == "text":
            if sample_by not in SAMPLE_BY:
                raise UserError(f"unknown sample_by '{sample_by}': use line, paragraph or document")
            kwargs["sample_by"] = sample_by
            text_column = "text"  # the text builder's only column
        try:
            ds = datasets.load_dataset(builder, data_files=paths, split="train", **kwargs)
        except Exception as e:
            # a bad byte surfaces as some builder error deep in datasets; name the file and the
            # offset instead
            bad = find_invalid_utf8(paths) if builder in ("text", "json") else None
            if bad:
                raise UserError(
                    f"{bad[0]} is not UTF-8 text (invalid byte at byte offset {bad[1]}); "
                    f"convert it to UTF-8 first") from None
            if builder == "json":
                check_json_records(paths, text_column)
            raise UserError(
                f"could not read {', '.join(paths[:3])} ({error_line(e)}); check that they are "
                f"valid {builder} files") from None
        where = ", ".join(paths[:3]) + (" ..." if len(paths) > 3 else "")
    else:
        what = f"'{dataset}'" + (f" (config '{name}')" if name else "")
        try:
            dd = datasets.load_dataset(dataset, name or None, **kwargs)
        # unknown name or config, no network, offline mode: all the same to the user
        except Exception as e:
            raise UserError(
                f"could not load the Hugging Face dataset {what} ({error_line(e)}); check the "
                f"name{', --name' if name else ''} and the network, or pass local files "
                f"instead") from None
        if "train" not in dd:
            raise UserError(f"the dataset {what} has no 'train' split (it has {', '.join(dd)})")
        ds = dd["train"]
        where = f"the Hugging Face dataset {what}"
    if text_column not in ds.column_names:
        raise UserError(
            f"{where} has no column '{text_column}' (its columns: {', '.join(ds.column_names)}); "
            f"pass --text_column=NAME")
    if files and builder == "json" and getattr(ds.features[text_column], "dtype", None) != "string":
        # a number, a list or null among the texts: which line
        check_json_records(paths, text_column)
        raise UserError(
            f"{where}: the '{text_column}' field is not text in every record; give every record a "
            f"string there")
    if not has_text(ds, text_column):
        raise UserError(
            f"{where} holds no text (no documents, or only empty ones); pass a corpus with some text"
        )
    return ds, text_column


def check_json_records(paths, column):
    """
    The first record of JSON-lines files that is not an object with a string `column` (a number, a
    list, null, a line that is not JSON), refused in one line naming the file, the line and the
    field. Read only when loading failed or the column came out as something other than text, to say
    where.
    """
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError:
                    if lineno == 1 and line.lstrip().startswith("["):
                        # a .json file holding one array: not JSON lines, datasets' own message
                        # stands
                        break
                    raise UserError(
                        f"{path} line {lineno} is not valid JSON; fix or remove that line"
                    ) from None
                if not isinstance(record, dict):
                    raise UserError(
                        f"{path} line {lineno} is {_json_kind(record)}, not an object with a "
                        f"'{column}' field; write one object per line")
                if column in record and record[column] is not None and not isinstance(
                        record[column], str):
                    raise UserError(
                        f"{path} line {lineno}: its '{column}' field is {_json_kind(record[column])} "
                        f"({json.dumps(record[column])[:40]}), not text; make it a string")


def _json_kind(value):
    """ 'a number', 'a list', ...: what a JSON value is, for messages. """
    kinds = {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        list: "a list",
        dict: "an object",
        str: "a string"
    }
    return kinds.get(type(value), "null")


def has_text(ds, column, rows=1024):
    """
    Whether any document has a character, read batch by batch (usually the first batch says so).
    """
    import pyarrow.compute as pc
    table = ds.select_columns([column]).with_format("arrow")
    for start in range(0, len(ds), rows):
        if pc.max(pc.utf8_length(table[start:start + rows].column(column))).as_py():
            return True
    return False


# -----------------------------------------------------------------------------
# the val split

def split_corpus(ds, column, test_size, seed, piece_size=PIECE_CHARS):
    """
    (DatasetDict train/val, whether documents were held out). Several documents: a shuffled
    test_size share of them (at least one; the seed fixes which) is val, each document stays whole.
    One document (a single .txt file): its first 1 - test_size of the characters train, the rest
    val, as in nanoGPT's Shakespeare.
    """
    import datasets
    if len(ds) == 1:
        text = ds[0][column] or ""
        cut = int(len(text) * (1 - test_size))
        print(
            f"one document: train is its first {len(text[:cut]):,} characters, val the last {len(text) - cut:,}"
        )
        # pieces, so the tokenizer's training and the encoding run in parallel; cut only where
        # GPT-2's pre-tokenizer pattern (the trained BPE's, tiktoken's) cuts anyway, so the tokens
        # are the whole text's
        return datasets.DatasetDict({
            split:
            datasets.Dataset.from_dict({column: text_pieces(part, piece_size)})
            for split, part in (("train", text[:cut]), ("val", text[cut:]))
        }), False
    # datasets' own count for a fractional test_size (ceil), kept within 1 .. n-1 so neither split
    # is empty
    n_val = min(len(ds) - 1, max(1, math.ceil(test_size * len(ds))))
    split = ds.train_test_split(test_size=n_val, seed=seed, shuffle=True)
    print(f"val: {n_documents(n_val)} of {len(ds):,} (shuffled with seed {seed})")
    return datasets.DatasetDict(train=split["train"], val=split["test"]), True


# a cut between two printable ASCII characters with one newline between them (after it): the GPT-2
# pattern of byte-level BPE (and tiktoken's) makes that newline a token of its own, so the pieces
# pre-tokenize exactly like the whole text, and neither training nor encoding can tell them apart
SAFE_CUT = re.compile(r"(?<=[!-~]\n)(?=[!-~])")


def text_pieces(text, size=PIECE_CHARS):
    """
    text in pieces of about size characters (longer where no safe cut comes soon), joining back to
    text; size None: the whole text as one piece.
    """
    pieces = []
    start = 0
    while size is not None and len(text) - start > size:
        cut = SAFE_CUT.search(text, start + size)
        if cut is None:
            break
        pieces.append(text[start:cut.start()])
        start = cut.start()
    pieces.append(text[start:])
    return pieces


def piece_chars(tok):
    """
    The piece size for one long text: PIECE_CHARS where the tokenizer's pre-tokenizer is known to
    cut at every SAFE_CUT (GPT-2's, the BPE trained here: tok None, and char), else None (no
    pieces). A tokenizer.json given by path is probed on a newline between every two printable ASCII
    characters: a pre-tokenizer that doesn't end a piece right after it would encode pieces
    differently from the whole text.
    """
    if not isinstance(tok, BPETokenizer):
        return PIECE_CHARS
    printable = [chr(c) for c in range(0x21, 0x7F)]
    pre = tok.tok.pre_tokenizer
    for a in printable:
        for b in printable:
            if not any(end == 2 for _, (_, end) in pre.pre_tokenize_str(a + "\n" + b)):
                return None
    return PIECE_CHARS


def text_batches(dset, column, rows=TEXT_ROWS):
    """
    The texts of a split, rows at a time, as lists of strings (long ones in pieces): bounded memory.
    """
    table = dset.select_columns([column]).with_format("arrow")
    for start in range(0, len(dset), rows):
        texts = table[start:start + rows].column(column).to_pylist()
        yield [piece for text in texts if text for piece in text_pieces(text)]


# -----------------------------------------------------------------------------
# the tokenizer

def given_tokenizer(choice, vocab_size):
    """
    The tokenizer --tokenizer names when it needs no corpus (gpt2, a tokenizer.json: read and
    checked now), None when it is made from the corpus (bpe, char). Refuses a bad choice or a
    vocab_size it doesn't take.
    """
    if choice not in TOKENIZERS and not os.path.exists(choice):
        raise UserError(
            f"unknown tokenizer '{choice}' (and no such file); use --tokenizer=bpe, gpt2, char or "
            f"the path of a tokenizer.json (or of a directory holding one)")
    if vocab_size is not None and choice != "bpe":
        raise UserError(
            f"--vocab_size applies to --tokenizer=bpe only (the tokenizer {choice} has its own "
            f"vocabulary); drop --vocab_size or use --tokenizer=bpe")
    if choice == "bpe" and vocab_size is not None:
        check_bpe_vocab_size(vocab_size)
    if choice in ("bpe", "char"):
        return None
    if choice == "gpt2":
        return GPT2Tokenizer()
    tok = read_tokenizer_file(choice)
    print(f"using the tokenizer {choice}")
    return tok


def corpus_record(dataset, files, name):
    """
    What a dataset's preparation records of its corpus (outputs.check_same_dataset): each local
    file's real path and size, or the Hugging Face dataset's name and config.
    """
    if files:
        return {"files": [[os.path.realpath(p), os.path.getsize(p)] for p in expand_files(files)]}
    return {"dataset": dataset, "config": name or ""}


def tokenizer_name(choice, vocab_size):
    """ The tokenizer a dataset's preparation records: --tokenizer as asked for. """
    if choice == "bpe":
        return f"bpe of {vocab_size or DEFAULT_BPE_VOCAB:,} tokens trained on the corpus"
    return choice if choice in TOKENIZERS else "tokenizer.json (given)"


def corpus_tokenizer(choice, vocab_size, splits, column, by_documents, progress):
    """
    char: every character of the corpus (train and val, like nanoGPT); bpe: trained on train only.
    """
    if choice == "char":
        chars = set()
        for dset in splits.values():
            for texts in text_batches(dset, column):
                chars.update("".join(texts))
        return CharTokenizer({ch: i for i, ch in enumerate(sorted(chars))})
    train = splits["train"]
    print(f"training a byte-level BPE of {vocab_size:,} tokens on "
          + (n_documents(len(train)) if by_documents else "the train text"))
    # val stays out of the training, so its loss measures text the tokenizer has not seen either
    return train_bpe(text_batches(train, column),
                     vocab_size,
                     length=math.ceil(len(train) / TEXT_ROWS),
                     show_progress=progress)


def describe_tokenizer(tok, by_documents):
    """ Print the vocabulary and where the end-of-text token goes; the token files' dtype. """
    dtype = check_vocab_fits(tok.vocab_size, f"the {tok.kind} tokenizer")
    print(f"vocab size: {tok.vocab_size:,}")
    if tok.eot_token is not None:
        where = "after each document" if by_documents else "not used: the corpus is one text"
        print(f"end-of-text token: {tok.eot_token} ({where})")
    print(f"token files: {dtype.name}")
    return dtype


# -----------------------------------------------------------------------------
# tokenizing in parallel


def tokenize_splits(splits, text_column, tokenizer, dtype, add_eot=True, num_proc=1,
                    load_from_cache_file=True):
    """
    Every document of the splits tokenized by num_proc workers (ids, then the eot token if add_eot).
    """
    import datasets

    # dtype ids in the Arrow cache: a quarter (uint16) of the default int64, and what the token
    # files store
    features = datasets.Features({"ids": datasets.List(datasets.Value(np.dtype(dtype).name)),
                                  "len": datasets.Value("int64")})
    # the workers get the tokenizer's description (part of the cache fingerprint, so another
    # tokenizer is never served a stale cache) and build it once per process
    description = json.dumps(tokenizer.meta(), sort_keys=True, ensure_ascii=False)
    return splits.map(tokenize_batch, batched=True, remove_columns=splits["train"].column_names,
                      fn_kwargs={
                          "text_column": text_column,
                          "tokenizer": description,
                          "add_eot": add_eot
                      },
                      features=features,
                      desc="tokenizing the splits",
                      num_proc=num_proc if num_proc > 1 else None,
                      load_from_cache_file=load_from_cache_file)


def tokenize_batch(batch, text_column, tokenizer, add_eot):
    """
    datasets.map function: encode_ordinary of each document, then the end-of-text token (if
    add_eot).
    """
    eot, encode = batch_encoder(tokenizer)  # built once per worker process
    ids = encode([text or "" for text in batch[text_column]])
    if add_eot and eot is not None:
        for doc in ids:
            doc.append(eot)  # closes every document, so documents stay apart in the stream
    return {"ids": ids, "len": [len(doc) for doc in ids]}


@functools.lru_cache(maxsize=4)
def batch_encoder(description):
    """
    (eot id, texts -> ids) for a tokenizer description (JSON): the fastest encoder of each kind.
    """
    tok = load_tokenizer(json.loads(description))
    if tok.kind == "bpe":
        return tok.eot_token, tok.encode_ordinary_batch  # parallel in Rust
    if tok.kind == "char":
        chars = [tok.itos[i] for i in range(tok.vocab_size)]
        return None, lambda texts: [encode_chars(text, chars) for text in texts]  # vectorized
    return tok.eot_token, lambda texts: [tok.encode_ordinary(text) for text in texts]


# -----------------------------------------------------------------------------
# writing the splits

def write_splits(tokenized, out, dtype, total_batches=1024, progress=True, counter=None):
    """
    Each split concatenated into out.path('<split>.bin') as dtype, batch by batch; {split: tokens}.
    counter (a token_files.ByteCounter) counts each batch's UTF-8 bytes on the way.
    """
    counts = {}
    for split, dset in tokenized.items():
        # the total length, summed batch by batch (one int per document, never the ids themselves)
        total = sum(int(lens.sum(dtype=np.int64)) for lens in _len_batches(dset))
        num_batches = max(1, min(total_batches, len(dset)))
        batches = _arrow_batches(dset, "ids", num_batches)
        if counter is not None:
            batches = (counter.add(split, batch) for batch in batches)
        write_token_batches(out.path(f"{split}.bin"),
                            total,
                            batches,
                            dtype,
                            desc=f"writing {split}.bin" if progress else None,
                            num_batches=num_batches)
        counts[split] = total
    return counts


def _len_batches(dset, rows=1 << 20):
    table = dset.select_columns(["len"]).with_format("arrow")
    for start in range(0, len(dset), rows):
        yield table[start:start + rows].column("len").to_numpy()


def _arrow_batches(dset, column, num_batches):
    """
    Contiguous slices of a tokenized split as flat numpy arrays, in order (zero-copy Arrow reads).
    """
    bounds = np.linspace(0, len(dset), num_batches + 1).astype(np.int64)
    table = dset.with_format("arrow")
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if stop > start:
            yield table[int(start):int(stop)].column(column).combine_chunks().flatten().to_numpy()
