"""
FineWeb-Edu (llm.c's and build-nanogpt's GPT-2 corpus), or any text collection, into llm.c's token
shards: a Hugging Face dataset by name and config (downloaded, or streamed with streaming=True) or
local .txt / .jsonl / .json / .parquet files; every document encoded by num_proc worker processes
(GPT-2's BPE, or the byte-level BPE of a tokenizer.json), with the end-of-text token (50256 for
GPT-2) BEFORE it, as llm.c does (nanoGPT's openwebtext puts it after); the token stream cut into
shards of shard_size tokens (a document may run on into the next shard, as in llm.c). The first
shard is val (<prefix>_val_000000.bin), the rest train (<prefix>_train_000001.bin, ...); the format
is in nanogpt_plus/dataset/shards.py: uint16 tokens, or llm.c's uint32 shards (magic 20240801, version 7)
for a vocabulary past 65,536. A tokenizer.json is copied beside the shards and named in meta.json,
so the directory describes its own tokenizer (dataset.read_dataset_meta).

Memory holds one shard buffer plus two windows of documents in flight, never the corpus. Each shard
is renamed into place when complete and then meta.json is rewritten (atomically) with what it
consumed: its first and last document, its token count, UTF-8 bytes and sha256 (and each split's
tokens and bytes, "split_bytes", for train.py's bits per byte). A re-run with the same settings
keeps the shards meta.json vouches for and goes on after the last one; only the one document it
split is tokenized again.

Usage:
    from nanogpt_plus.prepare.fineweb import prepare_fineweb
    prepare_fineweb('data/fineweb')                                      # FineWeb-Edu sample-10BT, ~10B tokens
    prepare_fineweb('data/mine', files='corpus/*.parquet', shard_size=10**6, max_tokens=10**8, num_proc=4)
    prepare_fineweb('data/mine_bpe', files='corpus/*.parquet', tokenizer='data/mytext/tokenizer.json')
"""

import hashlib
import itertools
import json
import multiprocessing
import os
import re
import signal
import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

from nanogpt_plus.bpe import TOKENIZER_FILE, BPETokenizer, read_tokenizer_file, tokenizer_fingerprint
from nanogpt_plus.dataset import as_token_array, split_bytes_record, token_dtype
from nanogpt_plus.dataset.shards import read_header, shard_header, write_shard
from nanogpt_plus.errors import UserError, error_line
from nanogpt_plus.files import atomic_write
from nanogpt_plus.outputs import SHARDS, check_out_dir, preparing
from nanogpt_plus.prepare.corpus import LOCAL_BUILDERS, expand_files
from nanogpt_plus.prepare.text import find_invalid_utf8
from nanogpt_plus.prepare.token_files import bpe_meta
from nanogpt_plus.tokenizer import GPT2Tokenizer, get_gpt2_encoding, token_byte_lengths

FORMAT_VERSION = 1  # of meta.json's layout
CHUNKSIZE = 16  # documents per task sent to a worker (llm.c's imap chunksize)
READ_BATCH = 256  # documents read from the dataset at a time
# a shard's UTF-8 bytes are summed this many tokens at a time (8 kB of lengths): a whole shard's at
# once would take 800 MB for 10**8 tokens
BYTES_RUN = 1 << 10


def prepare_fineweb(out_dir, *args, **kwargs):
    """ _prepare_fineweb(out_dir, ...), one prepare at a time in out_dir (outputs.preparing). """
    with preparing(out_dir):
        return _prepare_fineweb(out_dir, *args, **kwargs)


def _prepare_fineweb(out_dir, dataset="HuggingFaceFW/fineweb-edu", name="sample-10BT", files="",
                    text_column="text", streaming=False, num_proc=1, shard_size=10**8, max_tokens=0,
                    prefix="edufineweb", cache_dir="", progress=True, tokenizer="gpt2",
                    overwrite=False):
    """
    Shards <prefix>_{val,train}_NNNNNN.bin and meta.json in out_dir (resuming a run left there); a
    summary. tokenizer: 'gpt2' or the path of a byte-level BPE tokenizer.json (or of a directory
    holding one). An out_dir holding train.bin/val.bin or a training run is refused unless overwrite
    (outputs.check_out_dir).
    """
    check_options(num_proc, shard_size, max_tokens, prefix)
    tok = chosen_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size if tok else get_gpt2_encoding().n_vocab)
    spec = ShardSpec(source=corpus_source(dataset, name, files), text_column=text_column,
                     streaming=streaming, shard_size=shard_size, prefix=prefix,
                     tokenizer=tokenizer_identity(tok), dtype=str(dtype))
    # before resume reads meta.json: another dataset's would look like shards of other settings
    check_out_dir(out_dir, SHARDS, overwrite)
    records, end_of_corpus = resume(out_dir, spec, max_tokens)
    done = sum(r["tokens"] for r in records)
    if end_of_corpus or (max_tokens and done >= max_tokens):
        print(
            f"{out_dir} already holds all {done:,} tokens of these settings in {len(records)} shards; nothing to do"
        )
        return summary(records, 0, 0.0)
    # beside the shards before the next one: meta.json names it (and its sha256)
    if tok is not None:
        atomic_write(os.path.join(out_dir, TOKENIZER_FILE),
                     lambda f: f.write(tok.json.encode("utf-8")))
    ds, column = load_documents(dataset, name, files, text_column, streaming, num_proc, cache_dir)
    t0 = time.time()
    with tqdm(total=max_tokens or None, initial=done, unit="tok", unit_scale=True,
              disable=not progress, desc="tokenizing") as bar:
        writer = ShardWriter(out_dir, spec, tokenizer_meta(tok, dtype), dtype, records=records,
                             bar=bar, byte_lengths=token_byte_lengths(tok or GPT2Tokenizer()))
        end_of_corpus = fill_shards(writer, ds, column, num_proc, max_tokens, tok)
        writer.finish(end_of_corpus)
    result = summary(writer.records, writer.total - done, time.time() - t0)
    report(result, out_dir, num_proc, shard_size)
    return result


def report(result, out_dir, num_proc, shard_size):
    n_val = result["val_shards"]
    print(
        f"wrote {result['tokens']:,} tokens in {result['shards']} shards ({n_val} val, "
        f"{result['shards'] - n_val} train) to {out_dir}: tokenized {result['new_tokens']:,} at "
        f"{result['tokens_per_second']:,.0f} tokens/s (num_proc={num_proc}, {result['seconds']:.1f} s)"
    )
    if result["shards"] and result["shards"] == n_val:
        print(
            f"note: only a val shard: the corpus (or max_tokens) holds fewer tokens than two shards of "
            f"{shard_size:,}; lower --shard_size to get train shards")


def check_options(num_proc, shard_size, max_tokens, prefix):
    if num_proc < 1:
        raise UserError(f"num_proc must be at least 1, got {num_proc}")
    if not 0 < shard_size < 2 ** 31:
        raise UserError(
            f"shard_size must be between 1 and {2 ** 31 - 1:,} tokens (llm.c's int32 count), "
            f"got {shard_size:,}")
    if max_tokens < 0:
        raise UserError(
            f"max_tokens must be 0 (the whole corpus) or a number of tokens, got {max_tokens}")
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
        raise UserError(
            f"prefix must be a plain file-name prefix (letters, digits, _ . -), got {prefix!r}")
    # readers tell the splits apart by these words in the name
    if "train" in prefix or "val" in prefix:
        raise UserError(
            f"prefix {prefix!r} contains 'train' or 'val', which would make the split of every shard "
            f"ambiguous; pick another --prefix")


def chosen_tokenizer(choice):
    """
    None for GPT-2's BPE (--tokenizer=gpt2), else the BPETokenizer of the tokenizer.json at that
    path.
    """
    if choice == "gpt2":
        return None
    if choice in ("bpe", "char") or not os.path.exists(choice):
        raise UserError(
            f"--tokenizer={choice}: token shards take gpt2 or the path of a byte-level BPE "
            f"tokenizer.json (train one with data/text/prepare.py --tokenizer=bpe)")
    tok = read_tokenizer_file(choice)
    print(
        f"using the tokenizer {choice}: {tok.vocab_size:,} tokens, end-of-text token {tok.eot_token}"
    )
    return tok


def tokenizer_meta(tok, dtype):
    """
    meta.json's description of the shards' tokenizer, what read_dataset_meta reads (tok None:
    GPT-2).
    """
    if tok is None:
        # no top-level vocab_size on purpose: a model trained from scratch then pads GPT-2's 50,257
        # to 50,304, as llm.c and build-nanogpt do
        return {
            "kind": "gpt2",
            "eot_token": get_gpt2_encoding().eot_token,
            "dtype": np.dtype(dtype).name
        }
    return bpe_meta(tok, dtype)


@dataclass(frozen=True)
class ShardSpec:
    """
    Everything the shards' bytes depend on (not num_proc, not max_tokens): meta.json's
    "settings", which a resume must match.
    """
    source: dict  # {"files": [[absolute path, size], ...]}, or {"dataset": ..., "name": ...}
    text_column: str
    streaming: bool
    shard_size: int
    prefix: str
    tokenizer: str  # "gpt2", or "bpe sha256:<the tokenizer.json's fingerprint>"
    dtype: str

    def record(self):
        """ As meta.json holds it, since its first version. """
        return dict(self.source, text_column=self.text_column, streaming=self.streaming,
                    shard_size=self.shard_size, prefix=self.prefix, tokenizer=self.tokenizer,
                    dtype=self.dtype, eot="before each document")


def corpus_source(dataset, name, files):
    """ ShardSpec.source: the local files, by path and size, else the Hub dataset. """
    if files:
        return {"files": [[os.path.abspath(p), os.path.getsize(p)] for p in expand_files(files)]}
    return {"dataset": dataset, "name": name}


def tokenizer_identity(tok):
    """ ShardSpec.tokenizer: a tokenizer.json by its content (not its path or formatting), so that
    only the same tokenizer resumes. """
    return "gpt2" if tok is None else f"bpe sha256:{tokenizer_fingerprint(tok.json)}"


def summary(records, new_tokens, seconds):
    return {
        "shards": len(records),
        "tokens": sum(r["tokens"] for r in records),
        "new_tokens": new_tokens,
        "seconds": seconds,
        "tokens_per_second": new_tokens / max(seconds, 1e-9),
        "files": [r["file"] for r in records],
        "val_shards": sum(r["split"] == "val" for r in records)
    }


# -----------------------------------------------------------------------------
# the documents

def load_documents(dataset, name, files, text_column, streaming, num_proc, cache_dir):
    """
    (dataset, text column): local files when files is set, else the Hub dataset's train split.
    """
    import datasets  # imported here: it takes seconds, and only this path needs it
    kwargs = dict(split="train", streaming=streaming, cache_dir=cache_dir or None)
    if not streaming and num_proc > 1:
        kwargs["num_proc"] = num_proc  # parallel download and conversion of the data files
    if files:
        ds, builder = load_local_files(files, kwargs)
        # .txt: its only column
        where = "the input files"
        text_column = "text" if builder == "text" else text_column
    else:
        try:
            ds = datasets.load_dataset(dataset, name=name or None, **kwargs)
        except Exception as e:
            raise hub_error(e, dataset, name) from None
        where = f"the Hugging Face dataset '{dataset}'" + (f" (config '{name}')" if name else "")
    columns = ds.column_names  # None for some streamed datasets: then the first document is checked
    if columns is not None and text_column not in columns:
        raise UserError(
            f"{where} has no column '{text_column}' (its columns: {', '.join(columns)}); "
            f"pass --text_column=NAME")
    return ds, text_column


def load_local_files(files, kwargs):
    """
    (dataset, builder) of .txt (a document per paragraph), .jsonl / .json / .parquet (one per row)
    files.
    """
    import datasets
    paths = expand_files(files)
    builder = LOCAL_BUILDERS[os.path.splitext(paths[0])[1].lower()]
    if builder in ("text", "json"):  # parquet stores validated UTF-8 already
        bad = find_invalid_utf8(paths)
        if bad:
            raise UserError(f"{bad[0]} is not UTF-8 text (invalid byte at byte offset {bad[1]}); "
                            f"convert it to UTF-8 first")
    if builder == "text":
        kwargs = dict(kwargs, sample_by="paragraph")
    try:
        return datasets.load_dataset(builder, data_files=paths, **kwargs), builder
    except Exception as e:
        raise UserError(
            f"could not read {', '.join(paths[:3])} ({error_line(e)}); check that they are valid "
            f"{builder} files") from None


def hub_error(e, dataset, name):
    """
    The one-line UserError for whatever load_dataset raised (its errors differ by cause and
    version).
    """
    from datasets.exceptions import DatasetNotFoundError
    what = f"the Hugging Face dataset '{dataset}'"
    if isinstance(e, DatasetNotFoundError):
        return UserError(
            f"{what} does not exist or is not public ({error_line(e)}); check --dataset")
    if isinstance(e, ValueError) and ("BuilderConfig" in str(e) or
                                      "Config name is missing" in str(e)):
        return UserError(
            f"{what} has no config '{name}' ({error_line(e)}); pass one of them with --name=...")
    if isinstance(e, (ConnectionError, OSError, TimeoutError)):
        return UserError(
            f"could not reach the Hugging Face Hub for the dataset '{dataset}' ({error_line(e)}); "
            f"check the network, or pass local files with --files=...")
    return UserError(
        f"could not load {what} ({error_line(e)}); check --dataset and --name, or pass local files "
        f"with --files=...")


def iterate_texts(ds, column, start=0):
    """
    The documents' texts from index start on, a batch at a time (a Dataset is memory-mapped Arrow).
    """
    import datasets
    ds = ds.select_columns([column]) if ds.column_names is not None else ds
    if isinstance(ds, datasets.IterableDataset):
        # streaming: the documents before start are still downloaded, though not tokenized again
        for record in ds.skip(start) if start else ds:
            if column not in record:
                raise UserError(
                    f"the documents have no column '{column}' (they have {', '.join(record)}); "
                    f"pass --text_column=NAME")
            yield record[column]
        return
    for i in range(start, len(ds), READ_BATCH):
        yield from ds[i:i + READ_BATCH][column]


def guarded(texts, count_so_far):
    """
    texts, with a dropped connection mid-stream turned into one line that says the run can be
    resumed.
    """
    try:
        yield from texts
    except (ConnectionError, TimeoutError) as e:
        raise UserError(
            f"lost the connection to the Hugging Face Hub after {count_so_far():,} documents "
            f"({error_line(e)}); re-run with the same settings to resume from the last shard"
        ) from None


# -----------------------------------------------------------------------------
# tokenizing in parallel

def document_encoder(tok=None):
    """
    text -> the end-of-text token, then the text's tokens (llm.c's order), as the shard dtype: with
    GPT-2's BPE (tok None) or the BPETokenizer tok.
    """
    if tok is None:
        enc = get_gpt2_encoding()
        encode = enc.encode_ordinary
        eot = enc.eot_token
        vocab_size = enc.n_vocab
    else:
        encode = tok.encode_ordinary
        eot = tok.eot_token
        vocab_size = tok.vocab_size
    dtype = token_dtype(vocab_size)
    return lambda text: as_token_array([eot] + encode(text or ""), dtype)


_worker = {}  # the document encoder of a pool's worker process, built once by init_worker


def init_worker(tokenizer_json):
    """
    Pool initializer: the tokenizer is built once per worker (sent once, not with every task).
    """
    ignore_interrupts()
    _worker["encode"] = document_encoder(None if tokenizer_json is
                                         None else BPETokenizer(tokenizer_json))


def encode_in_worker(text):
    return _worker["encode"](text)


def tokenize_stream(texts, num_proc, window=None, tok=None):
    """
    The token arrays of texts, in order. Pool.imap alone would read the whole corpus ahead into its
    task queue (it never waits for the consumer), so documents go in windows: the next window is
    queued before the current one is consumed, which keeps the workers busy while at most two
    windows are in flight.
    """
    if num_proc == 1:
        yield from map(document_encoder(tok), texts)  # no pool: no pickling, same result
        return
    window = window or num_proc * CHUNKSIZE * 32
    tokenizer_json = None if tok is None else tok.json  # what a worker builds its tokenizer from
    with multiprocessing.Pool(num_proc, initializer=init_worker,
                              initargs=(tokenizer_json, )) as pool:
        ahead = None
        for batch in iter(lambda: list(itertools.islice(texts, window)), []):
            queued = pool.imap(encode_in_worker, batch, chunksize=CHUNKSIZE)
            if ahead is not None:
                yield from ahead
            ahead = queued
        if ahead is not None:
            yield from ahead


def ignore_interrupts():
    """
    Workers leave Ctrl-C to the main process, which stops the pool (instead of a traceback per
    worker).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def fill_shards(writer, ds, column, num_proc, max_tokens, tok=None):
    """
    Feed documents from the writer's position until the corpus or max_tokens ends; True at corpus
    end.
    """
    first_doc, offset = writer.position
    texts = guarded(iterate_texts(ds, column, start=first_doc), lambda: writer.position[0])
    for doc, tokens in enumerate(tokenize_stream(texts, num_proc, tok=tok), start=first_doc):
        # offset: the resumed document's first tokens are in the last kept shard
        stop = min(len(tokens), offset + max_tokens - writer.total) if max_tokens else len(tokens)
        writer.add(doc, tokens, offset, stop)
        offset = 0
        if max_tokens and writer.total >= max_tokens:
            return False
    return True


# -----------------------------------------------------------------------------
# writing the shards

def shard_name(prefix, index):
    """ llm.c's names: the first shard is val, the others train. """
    return f"{prefix}_{'val' if index == 0 else 'train'}_{index:06d}.bin"


class ShardWriter:
    """
    One shard buffer, filled with the token stream and written out whenever full. position is the
    (document, token offset in it) of the next token, which is where each shard record starts and
    ends.
    """

    def __init__(self, out_dir, spec, tokenizer, dtype, records, bar, byte_lengths):
        self.out_dir = out_dir
        self.spec = spec  # a ShardSpec
        self.records = list(records)
        self.bar = bar
        self.tokenizer = tokenizer  # meta.json's description of the tokenizer (tokenizer_meta)
        # the UTF-8 bytes of each token id (tokenizer.token_byte_lengths): each shard's bytes
        self.byte_lengths = byte_lengths
        self.buffer = np.empty(spec.shard_size, dtype=dtype)
        self.filled = 0
        self.documents = 0  # documents whose first token (the end-of-text) is in the buffer
        self.position = list(records[-1]["end"]) if records else [0, 0]
        self.start = list(self.position)
        self.total = sum(r["tokens"] for r in records)  # tokens in the kept shards and the buffer

    def add(self, doc, tokens, start=0, stop=None):
        """
        tokens[start:stop] of document doc (by default all); a shard is written each time the buffer
        fills.
        """
        stop = len(tokens) if stop is None else stop
        while start < stop:
            take = min(stop - start, len(self.buffer) - self.filled)
            self.buffer[self.filled:self.filled + take] = tokens[start:start + take]
            self.documents += start == 0
            self.filled = self.filled + take
            self.total = self.total + take
            start = start + take
            self.position = [doc, start] if start < len(tokens) else [doc + 1, 0]
            self.bar.update(take)
            if self.filled == len(self.buffer):
                self.write()

    def write(self):
        """
        The buffer as the next shard, then meta.json recording it (in that order: see resume).
        """
        tokens = self.buffer[:self.filled]
        name = shard_name(self.spec.prefix, len(self.records))
        write_shard(os.path.join(self.out_dir, name), tokens)
        record = {
            "file": name,
            "split": "val" if not self.records else "train",
            "tokens": int(self.filled),
            "bytes": self.utf8_bytes(tokens),
            "documents": self.documents,
            "start": self.start,
            "end": list(self.position),
            "sha256": shard_sha256(tokens)
        }
        self.records.append(record)
        save_meta(self.out_dir, self.spec, self.tokenizer, self.records, end_of_corpus=False)
        self.bar.write(
            f"wrote {name}: {record['tokens']:,} tokens, {record['documents']:,} documents")
        self.filled = 0
        self.documents = 0
        self.start = list(self.position)

    def utf8_bytes(self, tokens):
        """ The UTF-8 bytes tokens decode to, summed BYTES_RUN tokens at a time. """
        return sum(int(self.byte_lengths[tokens[i:i + BYTES_RUN]].sum())
                   for i in range(0, len(tokens), BYTES_RUN))

    def finish(self, end_of_corpus):
        """
        The last, shorter shard (if any tokens are left), and meta.json saying whether the corpus
        ended.
        """
        if self.filled:
            self.write()
        save_meta(self.out_dir, self.spec, self.tokenizer, self.records, end_of_corpus)


def shard_sha256(tokens):
    """
    The sha256 of a shard file's bytes, computed from its tokens in memory (header, then the
    tokens).
    """
    h = hashlib.sha256(shard_header(len(tokens), tokens.dtype))
    h.update(memoryview(np.ascontiguousarray(tokens)).cast("B"))
    return h.hexdigest()


def file_sha256(path, chunk_bytes=1 << 24):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(chunk_bytes), b""):
            h.update(chunk)
    return h.hexdigest()


def save_meta(out_dir, spec, tokenizer, records, end_of_corpus):
    """ meta.json, atomically: the tokenizer (train.py reads it), the spec, each shard's record. """
    meta = {
        **tokenizer,
        "format": "llm.c token shards",
        "meta_version": FORMAT_VERSION,
        "settings": spec.record(),
        "tokens": sum(r["tokens"] for r in records),
        "documents": sum(r["documents"] for r in records),
        "end_of_corpus": end_of_corpus,
        "shards": records,
    }
    # each split's tokens and UTF-8 bytes (dataset.split_bytes_record), when every shard's bytes are
    # known: a resume keeps the shards of an earlier version's run, which didn't count them
    if all("bytes" in r for r in records):
        counts = {}
        for r in records:
            tokens, num_bytes = counts.get(r["split"], (0, 0))
            counts[r["split"]] = (tokens + r["tokens"], num_bytes + r["bytes"])
        meta["split_bytes"] = split_bytes_record(counts)
    atomic_write(os.path.join(out_dir, "meta.json"),
                 lambda f: f.write(meta_json(meta)),
                 binary=False)


def meta_json(meta):
    """ meta as indented JSON with one line per shard record (a 10B-token run has 100 of them). """
    # without the closing "\n}"
    head = json.dumps({k: v for k, v in meta.items() if k != "shards"}, indent=1)[:-2]
    shards = ",\n".join(f"  {json.dumps(r)}" for r in meta["shards"])
    return f'{head},\n "shards": [\n{shards}\n ]\n}}\n' if shards else f'{head},\n "shards": []\n}}\n'


# -----------------------------------------------------------------------------
# resuming

def read_meta(out_dir):
    path = os.path.join(out_dir, "meta.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(
            f"{path} is unreadable ({e}); delete the directory's shards and meta.json and start "
            f"again") from None


def resume(out_dir, spec, max_tokens):
    """
    (the complete shards of an earlier run of this ShardSpec, whether it reached the corpus end).
    Shards meta.json doesn't vouch for (a shard renamed in place just before a crash, a changed
    file) and any after them are removed, so the run continues from the last good one.
    """
    meta = read_meta(out_dir)
    ours = our_shard_files(out_dir, spec.prefix)
    if meta is None:
        if ours:
            raise UserError(f"{out_dir} holds shards named {spec.prefix}_* ({ours[0]}, ...) but no "
                            f"meta.json, so they can't be resumed; delete them or pick another "
                            f"--out_dir")
        return [], False
    check_same_settings(out_dir, meta.get("settings", {}), spec.record())
    records = verified_records(out_dir, meta["shards"], spec.shard_size)
    end_of_corpus = meta.get("end_of_corpus", False) and len(records) == len(meta["shards"])
    last = records[-1] if records else None
    if last is not None and last["tokens"] < spec.shard_size and not end_of_corpus:
        # the shorter last shard of a run max_tokens stopped: kept only while max_tokens is the same
        if sum(r["tokens"] for r in records) != max_tokens:
            records.pop()
    for name in sorted(set(ours) - {r["file"] for r in records}):
        os.remove(os.path.join(out_dir, name))
    if records:
        print(
            f"resuming: keeping {len(records)} complete shards ({sum(r['tokens'] for r in records):,} tokens) "
            f"from an earlier run; continuing at document {records[-1]['end'][0]:,}")
    return records, end_of_corpus


def check_same_settings(out_dir, before, now):
    changed = [k for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k)]
    if changed:
        k = changed[0]
        raise UserError(
            f"{out_dir} holds shards prepared with other settings ({k}: {before.get(k)!r} then, "
            f"{now.get(k)!r} now); re-run with the same settings to resume, or pick another --out_dir"
        )


def verified_records(out_dir, records, shard_size):
    """
    The leading records whose shard is on disk, valid and unchanged (its sha256); the rest are
    dropped.
    """
    kept = []
    for i, record in enumerate(records):
        path = os.path.join(out_dir, record["file"])
        try:
            ok = read_header(path).num_tokens == record["tokens"] and file_sha256(
                path) == record["sha256"]
        except UserError:
            ok = False
        if not ok or record["tokens"] > shard_size:
            print(f"{path} is missing or doesn't match meta.json; rewriting the shards from it on")
            break
        kept.append(record)
    return kept


def our_shard_files(out_dir, prefix):
    """
    The files in out_dir named like this run's shards (<prefix>_val_000000.bin,
    <prefix>_train_NNNNNN.bin).
    """
    if not os.path.isdir(out_dir):
        return []
    pattern = re.compile(rf"{re.escape(prefix)}_(val|train)_\d{{6}}\.bin")
    return sorted(n for n in os.listdir(out_dir) if pattern.fullmatch(n))
