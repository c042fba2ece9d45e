"""
FineWeb-Edu for GPT-2 (llm.c's and build-nanogpt's corpus), or any other corpus, into llm.c's token shards:
a Hugging Face dataset by name and config, or local .parquet / .jsonl / .json / .txt files. Every document is
GPT-2 BPE encoded (or with your own byte-level BPE: --tokenizer=PATH of a tokenizer.json) by num_proc worker
processes, with the end-of-text token (50256 for GPT-2) BEFORE it (as llm.c does; nanoGPT's openwebtext puts it
after), and the token stream is cut into shards of shard_size tokens in llm.c's .bin format (a 1024-byte header:
magic 20240520, version 1, token count; then uint16 tokens; for a vocabulary past 65,536 tokens llm.c's uint32
shards, magic 20240801, version 7). The first shard is val (<prefix>_val_000000.bin), the others train
(<prefix>_train_000001.bin, ...); meta.json records the tokenizer (a tokenizer.json is copied beside the shards)
and what each shard consumed.

Usage:
    python data/fineweb/prepare.py                                  # FineWeb-Edu sample-10BT: ~10B tokens, 100 shards
    python data/fineweb/prepare.py --streaming=True --max_tokens=1000000000    # tokenizing starts at once; 1B tokens
    python data/fineweb/prepare.py --dataset=HuggingFaceFW/fineweb --name=sample-10BT --prefix=fineweb
    python data/fineweb/prepare.py --files='corpus/*.parquet' --shard_size=10000000 --out_dir=data/mine
    python data/fineweb/prepare.py --tokenizer=data/mytext/tokenizer.json --out_dir=data/fineweb_mybpe

Killed or stopped by max_tokens? Run the same command again (a larger --max_tokens, or 0, to go further): the
complete shards are kept and tokenizing goes on after the last one. Memory holds one shard (200 MB at the
default size) plus the documents in flight, never the corpus. Read a shard with nanogpt_plus.dataset.shards.open_shard.
"""
# first, before torch is imported (seconds): from here on a signal stops the work in one line and
# exit code 130 (it can't resume; no output is left half-written), or is only said once it is done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import os

from configurator import Group, Schema, Setting, configure
from nanogpt_plus import settings
from nanogpt_plus.prepare.fineweb import prepare_fineweb
from nanogpt_plus.runtime import run_main

HERE = os.path.dirname(os.path.abspath(__file__))

DEFAULTS = Schema(
    Group('the documents',
          dataset=Setting('HuggingFaceFW/fineweb-edu', "Hugging Face dataset (used when files is ''), e.g. "
                                                       "HuggingFaceFW/fineweb"),
          name=Setting('sample-10BT', "its config ('' for none): sample-10BT, sample-100BT, ..."),
          files=Setting('', "local files instead: comma-separated paths or globs (.parquet, .jsonl, .json, .txt)"),
          text_column=Setting('text', "the column holding the documents (.txt files: one document per paragraph)",
                              not_empty=True),
          streaming=Setting(False, "stream the dataset instead of downloading it first: disk holds only the shards")),
    Group('the shards',
          num_proc=settings.num_proc(settings.default_num_proc()),
          # llm.c's header counts a shard's tokens in an int32
          shard_size=Setting(10 ** 8, "tokens per shard (llm.c's 100M: 200 MB files); the last shard holds the rest",
                             low=1, high=2 ** 31 - 1),
          max_tokens=Setting(0, "stop after this many tokens in all (0 = the whole corpus), e.g. 1000000000 for a "
                                "short run", low=0),
          prefix=Setting('edufineweb', "shard names: <prefix>_val_000000.bin, <prefix>_train_000001.bin, ..."),
          tokenizer=Setting('gpt2', "'gpt2', or the path of a byte-level BPE tokenizer.json (data/text/prepare.py's)"),
          out_dir=settings.dataset_out_dir(HERE, "the shards and meta.json"),
          overwrite=settings.dataset_overwrite(False)),
)


def main():
    config = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(config)
    prepare_fineweb(**config)


if __name__ == "__main__":
    run_main(main)
