"""
Reading the text a dataset is made of: a UTF-8 file, raw bytes, or a download, with newlines
normalized the way Python's text mode does it (so nanoGPT's counts come out unchanged) and one clear
sentence for a file that is missing, empty, or not UTF-8.

Usage:
    from nanogpt_plus.prepare.text import read_text_file, find_invalid_utf8
    text = read_text_file('data/shakespeare_char/input.txt')
    bad = find_invalid_utf8(['a.jsonl', 'b.jsonl'])     # (path, byte offset) or None, streamed
"""

import codecs
import os
import urllib.request

from nanogpt_plus.errors import UserError
from nanogpt_plus.files import read_response


def read_text_file(path):
    """
    The contents of a UTF-8 text file with newlines normalized like Python's text mode (as nanoGPT
    reads it).
    """
    if os.path.isdir(path):
        raise UserError(f"input {path} is a directory; pass a UTF-8 text file")
    if not os.path.isfile(path):
        raise UserError(f"input file {path} does not exist; pass an existing UTF-8 text file")
    with open(path, "rb") as f:
        raw = f.read()
    text = decode_utf8(raw, path)
    if not text.strip():
        raise UserError(f"input file {path} is empty; pass a text file with some content")
    return text


def decode_utf8(raw, name):
    """
    raw bytes as text: UTF-8 (an error names the first bad byte), no byte-order mark, '\\n'
    newlines.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(
            f"{name} is not UTF-8 text (invalid byte 0x{raw[e.start]:02x} at byte offset {e.start}); "
            f"convert it to UTF-8 first") from None
    text = text.removeprefix("\ufeff")  # a byte-order mark is not part of the text
    return text.replace("\r\n", "\n").replace("\r", "\n")


def find_invalid_utf8(paths, chunk_bytes=1 << 24):
    """
    (path, byte offset) of the first byte that isn't valid UTF-8 in these files, else None (streams
    them).
    """
    for path in paths:
        decoder = codecs.getincrementaldecoder("utf-8")()
        read = 0
        with open(path, "rb") as f:
            while True:
                chunk = f.read(chunk_bytes)
                # e.start counts from the start of the decoder's buffer: the undecoded tail of the
                # last chunk (a split multi-byte character) followed by this chunk
                buffer_start = read - len(decoder.getstate()[0])
                read += len(chunk)
                try:
                    decoder.decode(chunk, final=not chunk)
                except UnicodeDecodeError as e:
                    return path, buffer_start + e.start
                if not chunk:
                    break
    return None


def download_text(url, timeout=10.0, deadline_s=900):
    """
    The UTF-8 text at url, within deadline_s in all (timeout: each read); raises OSError (URLError,
    timeouts) when there is no network.
    """
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return decode_utf8(read_response(response, deadline_s), url)
