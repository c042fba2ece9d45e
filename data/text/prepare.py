"""
Your own text with your own tokenizer: local .txt / .jsonl / .json / .parquet files (or a Hugging Face
dataset) into train.bin / val.bin, by default with a byte-level BPE trained on the train split. Writes
train.bin and val.bin (uint16 token ids, uint32 when the vocabulary has more than 65,536 tokens), meta.json
(the tokenizer kind, vocab_size, end-of-text id and dtype) and, for a BPE, the tokenizer.json it names.

The split: one document (a single .txt file) is cut by characters, the first 90% train, the rest val (as for
tiny Shakespeare); two or more documents: a shuffled 10% of them (at least one) is val, and each document is
followed by the end-of-text token. --tokenizer=gpt2 and --tokenizer=char give exactly the token files of
data/shakespeare/prepare.py and data/shakespeare_char/prepare.py on a single file.

Usage:
    python data/text/prepare.py --input='corpus/*.txt' --tokenizer=bpe --vocab_size=8192 --out_dir=data/mytext
    python data/text/prepare.py --input=book.txt --tokenizer=char --out_dir=data/book_char
    python data/text/prepare.py --input='more/*.jsonl' --tokenizer=data/mytext/tokenizer.json --out_dir=data/more
    python data/text/prepare.py --dataset=roneneldan/TinyStories --tokenizer=bpe --vocab_size=4096

Then: python train.py --dataset=mytext (the model's vocab_size comes from meta.json, padded to a multiple of 64).
The tokenized splits are cached by Hugging Face datasets (--cache_dir), so a second run skips the encoding.
"""
# first, before torch is imported (seconds): from here on a signal stops the work in one line and
# exit code 130 (it can't resume; no output is left half-written), or is only said once it is done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import os

from configurator import Group, Schema, Setting, configure
from nanogpt_plus import settings
from nanogpt_plus.bpe import MIN_BPE_VOCAB
from nanogpt_plus.errors import UserError
from nanogpt_plus.prepare.corpus import SAMPLE_BY, prepare_corpus
from nanogpt_plus.runtime import run_main

HERE = os.path.dirname(os.path.abspath(__file__))

DEFAULTS = Schema(
    Group('the text',
          input=Setting('', "comma-separated paths or globs of .txt / .jsonl / .json / .parquet files"),
          dataset=Setting('', "a Hugging Face dataset name instead (used when input is '')"),
          name=Setting('', "the dataset's config name ('' = its default)"),
          text_column=settings.text_column('text'),
          sample_by=Setting('document', ".txt files: one document per 'document' (file), 'paragraph' or 'line'",
                            choices=SAMPLE_BY)),
    Group('the tokenizer',
          tokenizer=Setting('bpe', "'bpe' (trained here), 'gpt2', 'char', or the path of a tokenizer.json to reuse",
                            not_empty=True),
          vocab_size=Setting(8192, f"tokens of the trained BPE (--tokenizer=bpe only), at least {MIN_BPE_VOCAB}",
                             low=MIN_BPE_VOCAB)),
    Group('the split',
          val_fraction=Setting(0.1, "the share held out for val: of the characters (one document) or the documents",
                               low=0.0, high=1.0, low_open=True, high_open=True),
          seed=settings.shuffle_seed(2357)),
    Group('the run',
          num_proc=settings.num_proc(settings.default_num_proc()),
          out_dir=settings.dataset_out_dir(HERE, "train.bin, val.bin, meta.json (and tokenizer.json)"),
          overwrite=settings.dataset_overwrite(False),
          cache_dir=settings.cache_dir('')),
)


def main(argv=None):
    config = configure(DEFAULTS, argv, doc=__doc__)
    DEFAULTS.check(config)
    if not config.input and not config.dataset:
        raise UserError("no text given; pass --input=FILES (paths or globs) or --dataset=NAME")
    # vocab_size is the trained BPE's: asked for with another tokenizer it is an error (prepare_corpus says so)
    asked = 'vocab_size' in config.given or config.tokenizer == 'bpe'
    vocab_size = config.vocab_size if asked else None
    prepare_corpus(config.out_dir, dataset=config.dataset, files=config.input, name=config.name,
                   text_column=config.text_column, sample_by=config.sample_by, tokenizer=config.tokenizer,
                   vocab_size=vocab_size, test_size=config.val_fraction, seed=config.seed,
                   num_proc=config.num_proc, cache_dir=config.cache_dir, overwrite=config.overwrite)


if __name__ == "__main__":
    run_main(main)
