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
# first, before torch is imported (seconds): from here on a signal stops the work in one line and
# exit code 130 (it can't resume; no output is left half-written), or is only said once it is done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import os

from configurator import Group, Schema, Setting, configure
from nanogpt_plus import settings
from nanogpt_plus.prepare.corpus import SAMPLE_BY, prepare_corpus
from nanogpt_plus.runtime import run_main

HERE = os.path.dirname(os.path.abspath(__file__))

DEFAULTS = Schema(
    Group('the documents',
          dataset=Setting('openwebtext', "Hugging Face dataset name (used when files is '')"),
          name=Setting('', "the dataset's config name, e.g. 'sample-10BT' of HuggingFaceFW/fineweb ('' = none)"),
          files=Setting('', "local files instead: comma-separated paths or globs (.txt, .jsonl, .json, .parquet)"),
          text_column=settings.text_column('text'),
          sample_by=Setting('paragraph', ".txt files: one document per 'line', 'paragraph' (blank-line separated) "
                                         "or 'document'", choices=SAMPLE_BY)),
    Group('the split',
          test_size=Setting(0.0005, "fraction of documents for val (nanoGPT: 0.0005, ~4,000 of owt's 8M documents)",
                            low=0.0, high=1.0, low_open=True, high_open=True),
          seed=settings.shuffle_seed(2357)),
    Group('the run',
          num_proc=settings.num_proc(settings.default_num_proc()),
          total_batches=Setting(1024, "the splits are written in this many batches (memory: one batch)", low=1),
          out_dir=settings.dataset_out_dir(HERE, "train.bin, val.bin and meta.json"),
          overwrite=settings.dataset_overwrite(False),
          cache_dir=settings.cache_dir('')),
)


def main():
    config = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(config)
    prepare_corpus(**config)


if __name__ == "__main__":
    run_main(main)
