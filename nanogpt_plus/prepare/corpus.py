"""
Large corpora, nanoGPT's openwebtext recipe for any text collection: a Hugging Face dataset by name or
local .txt / .jsonl / .json / .parquet files; a small shuffled val split; every document GPT-2 encoded
(encode_ordinary, then the end-of-text token) by num_proc worker processes; each split concatenated into
one uint16 file batch by batch, so memory is bounded by one batch, not by the corpus.

Usage:
    from nanogpt_plus.prepare.corpus import prepare_corpus
    prepare_corpus('data/openwebtext')                                         # ~9B tokens from the Hub
    prepare_corpus('data/mine', files='corpus/*.jsonl', text_column='body', num_proc=4)
"""

import glob
import os
import time

import numpy as np

from nanogpt_plus.files import atomic_outputs
from nanogpt_plus.prepare.text import find_invalid_utf8
from nanogpt_plus.prepare.token_files import check_vocab_fits, write_meta, write_token_batches
from nanogpt_plus.runtime import UserError
from nanogpt_plus.tokenizer import get_gpt2_encoding

# the Hugging Face datasets builder that reads each kind of local file
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


def prepare_corpus(out_dir, dataset="openwebtext", files="", text_column="text", num_proc=1, test_size=0.0005,
                   seed=2357, total_batches=1024, cache_dir="", sample_by="paragraph", load_from_cache_file=True,
                   progress=True, name=""):
    """ nanoGPT's openwebtext/prepare.py for any corpus: train.bin, val.bin (uint16) and meta.json in out_dir. """
    if num_proc < 1:
        raise UserError(f"num_proc must be at least 1, got {num_proc}")
    ds, text_column = load_corpus(dataset, files, text_column, num_proc, cache_dir, sample_by, name)
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


# -----------------------------------------------------------------------------
# finding and loading the documents

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
    if len({LOCAL_BUILDERS[k] for k in kinds}) > 1:  # one load_dataset call reads one builder's files
        raise UserError(f"mixed file kinds ({', '.join(sorted(kinds))}); prepare one kind of file per run")
    if not any(os.path.getsize(p) for p in paths):
        raise UserError(f"the input files are empty ({', '.join(paths[:3])}); pass files with some text")
    return paths


def load_corpus(dataset="openwebtext", files="", text_column="text", num_proc=1, cache_dir="",
                sample_by="paragraph", name=""):
    """
    One Hugging Face Dataset with a text column: local files (.txt: one document per line/paragraph/file,
    per sample_by; .jsonl/.json/.parquet: one per row) when files is set, else the train split of the Hub
    dataset (of its config `name`, e.g. 'sample-10BT'; '' = the dataset's default).
    """
    import datasets  # imported here: it takes seconds, and only this path needs it
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
            # a bad byte surfaces as some builder error deep in datasets; name the file and the offset instead
            bad = find_invalid_utf8(paths) if builder in ("text", "json") else None
            if bad:
                raise UserError(f"{bad[0]} is not UTF-8 text (invalid byte at byte offset {bad[1]}); "
                                f"convert it to UTF-8 first") from None
            raise UserError(f"could not read {', '.join(paths[:3])} ({_first_line(e)}); check that they are "
                            f"valid {builder} files") from None
        where = ", ".join(paths[:3]) + (" ..." if len(paths) > 3 else "")
    else:
        what = f"'{dataset}'" + (f" (config '{name}')" if name else "")
        try:
            dd = datasets.load_dataset(dataset, name or None, **kwargs)
        except Exception as e:  # unknown name or config, no network, offline mode: all the same to the user
            raise UserError(f"could not load the Hugging Face dataset {what} ({_first_line(e)}); check the "
                            f"name{', --name' if name else ''} and the network, or pass local files with "
                            f"--files=...") from None
        if "train" not in dd:
            raise UserError(f"the dataset {what} has no 'train' split (it has {', '.join(dd)})")
        ds, where = dd["train"], f"the Hugging Face dataset {what}"
    if text_column not in ds.column_names:
        raise UserError(f"{where} has no column '{text_column}' (its columns: {', '.join(ds.column_names)}); "
                        f"pass --text_column=NAME")
    if len(ds) < 2:
        raise UserError(f"{where} holds {len(ds)} document(s); at least 2 are needed for a train/val split")
    return ds, text_column


def _first_line(e):
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0]}" if msg else type(e).__name__


# -----------------------------------------------------------------------------
# tokenizing in parallel

def tokenize_splits(ds, text_column, num_proc=1, test_size=0.0005, seed=2357, load_from_cache_file=True):
    """ nanoGPT's recipe: a small shuffled val split, then every document tokenized (num_proc workers). """
    import datasets
    check_vocab_fits(get_gpt2_encoding().n_vocab, "the GPT-2 tokenizer")
    # a corpus like openwebtext is a single 'train' split: hold out test_size of its documents, shuffled
    # with a fixed seed so a re-run holds out the same ones
    split_dataset = ds.train_test_split(test_size=test_size, seed=seed, shuffle=True)
    split_dataset["val"] = split_dataset.pop("test")
    # uint16 ids in the Arrow cache: a quarter of the default int64, and what the token files store
    features = datasets.Features({"ids": datasets.List(datasets.Value("uint16")), "len": datasets.Value("int64")})
    return split_dataset.map(tokenize_batch, batched=True, fn_kwargs={"text_column": text_column},
                             remove_columns=ds.column_names, features=features, desc="tokenizing the splits",
                             num_proc=num_proc if num_proc > 1 else None, load_from_cache_file=load_from_cache_file)


def tokenize_batch(batch, text_column):
    """ datasets.map function: GPT-2 encode_ordinary of each document, then the end-of-text token. """
    enc = get_gpt2_encoding()  # cached per worker process
    ids = [enc.encode_ordinary(text or "") for text in batch[text_column]]
    for doc in ids:
        doc.append(enc.eot_token)  # 50256 closes every document, so documents stay apart in the stream
    return {"ids": ids, "len": [len(doc) for doc in ids]}


# -----------------------------------------------------------------------------
# writing the splits

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


def _arrow_batches(dset, column, num_batches):
    """ Contiguous slices of a tokenized split as flat numpy arrays, in order (zero-copy Arrow reads). """
    bounds = np.linspace(0, len(dset), num_batches + 1).astype(np.int64)
    table = dset.with_format("arrow")
    for start, stop in zip(bounds[:-1], bounds[1:]):
        if stop > start:
            yield table[int(start):int(stop)].column(column).combine_chunks().flatten().to_numpy()
