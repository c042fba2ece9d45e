"""
Saves the openwebtext dataset to a binary file for training (nanoGPT's recipe), or any other corpus:
a Hugging Face dataset by name, or local .txt / .jsonl / .parquet files. Documents are GPT-2 BPE encoded
(encode_ordinary + the end-of-text token) by num_proc worker processes, then every split is concatenated
into a uint16 train.bin / val.bin, batch by batch, so memory stays bounded by one batch, not the corpus.

Usage:
    python data/openwebtext/prepare.py                        # openwebtext from the Hugging Face Hub
    python data/openwebtext/prepare.py --files='corpus/*.jsonl' --text_column=text --out_dir=data/mycorpus
    python data/openwebtext/prepare.py --files=book.txt --sample_by=paragraph --num_proc=4 --out_dir=data/book

openwebtext: train.bin is ~17GB, val.bin ~8.5MB; train has ~9B tokens (9,035,582,198), val ~4M (4,434,897).
The map step caches its results in the Hugging Face datasets cache (--cache_dir), so a re-run is quick.
"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))

from configurator import configure
from nanogpt_plus import prepare as dc
from nanogpt_plus.runtime import run_main

defaults = {
    'dataset': 'openwebtext',  # Hugging Face dataset name (used when files is '')
    'files': '',               # local files instead: comma-separated paths or globs (.txt, .jsonl, .json, .parquet)
    'text_column': 'text',     # the column holding the documents (.jsonl / .parquet / Hub datasets)
    'sample_by': 'paragraph',  # .txt files: one document per 'line', 'paragraph' (blank-line separated) or 'document'
    # number of workers in .map() call; a good number to use is ~order number of cpu cores // 2
    'num_proc': max(1, min(8, (os.cpu_count() or 2) // 2)),
    'test_size': 0.0005,       # fraction of documents for val (nanoGPT: 0.0005, ~4,000 of owt's 8M documents)
    'seed': 2357,              # the shuffle before the split (nanoGPT's)
    'total_batches': 1024,     # the splits are written in this many batches (memory: one batch)
    'out_dir': HERE,           # where train.bin, val.bin and meta.json go
    'cache_dir': '',           # Hugging Face datasets cache ('' = its default, ~/.cache/huggingface/datasets)
}


def main():
    config = configure(defaults, doc=__doc__)
    dc.prepare_corpus(**config)


if __name__ == "__main__":
    run_main(main)

# to read the bin files later, e.g. with numpy:
# m = np.memmap('train.bin', dtype=np.uint16, mode='r')
