"""
OpenWebText (nanoGPT's recipe), or any other corpus: a Hugging Face dataset by name, or local .txt /
.jsonl / .json / .parquet files. Every document is GPT-2 BPE encoded (encode_ordinary, then the
end-of-text token) by num_proc worker processes; each split is then concatenated into a uint16 train.bin /
val.bin, batch by batch, so memory is bounded by one batch rather than by the corpus.

Usage:
    python data/openwebtext/prepare.py                        # openwebtext from the Hugging Face Hub
    python data/openwebtext/prepare.py --dataset=HuggingFaceFW/fineweb --name=sample-10BT --out_dir=data/fw
    python data/openwebtext/prepare.py --files='corpus/*.jsonl' --text_column=text --out_dir=data/mycorpus
    python data/openwebtext/prepare.py --files=book.txt --sample_by=paragraph --num_proc=4 --out_dir=data/book

For openwebtext expect 9,035,582,198 train tokens (a ~17 GB train.bin) and 4,434,897 val tokens (~8.5 MB).
The tokenized splits are cached by Hugging Face datasets (--cache_dir), so a second run skips the encoding.
Read a token file back with np.memmap(path, dtype=np.uint16, mode='r') (meta.json records the dtype).
For your own tokenizer (a BPE trained on the corpus, characters, a tokenizer.json) use data/text/prepare.py.
"""
import os

from configurator import configure
from nanogpt_plus.prepare.corpus import prepare_corpus
from nanogpt_plus.runtime import run_main

HERE = os.path.dirname(os.path.abspath(__file__))

defaults = {
    'dataset': 'openwebtext',  # Hugging Face dataset name (used when files is '')
    'name': '',                # the dataset's config name, e.g. 'sample-10BT' of HuggingFaceFW/fineweb ('' = none)
    'files': '',               # local files instead: comma-separated paths or globs (.txt, .jsonl, .json, .parquet)
    'text_column': 'text',     # the column holding the documents (.jsonl / .parquet / Hub datasets)
    'sample_by': 'paragraph',  # .txt files: one document per 'line', 'paragraph' (blank-line separated) or 'document'
    # tokenizer worker processes: cpu_count() counts hyperthreads, and BPE encoding gains little from a core's second
    'num_proc': max(1, min(8, (os.cpu_count() or 2) // 2)),
    'test_size': 0.0005,       # fraction of documents for val (nanoGPT: 0.0005, ~4,000 of owt's 8M documents)
    'seed': 2357,              # the shuffle before the split (nanoGPT's)
    'total_batches': 1024,     # the splits are written in this many batches (memory: one batch)
    'out_dir': HERE,           # where train.bin, val.bin and meta.json go
    'cache_dir': '',           # Hugging Face datasets cache ('' = its default, ~/.cache/huggingface/datasets)
}


def main():
    config = configure(defaults, doc=__doc__)
    prepare_corpus(**config)


if __name__ == "__main__":
    run_main(main)
