"""
The code names README.md and docs/*.md give a reader exist: every `nanogpt_plus.module.name`, every
name of a `from nanogpt_plus.x import a, b` line, and every short `module.name` (one of the
package's modules, in backticks) imports. A renamed or moved function otherwise leaves the docs
naming one that isn't there. No process is started: the names are imported here.
"""
import glob
import importlib
import os
import re

from helpers import REPO

PACKAGE = 'nanogpt_plus'


def package_modules():
    """ The package's modules as a doc names them short: 'checkpoint', a subpackage 'dataset' and its
    modules 'dataset.shards' (longest first, so that the scan takes the whole dotted module). """
    names = set()
    for path in glob.glob(os.path.join(REPO, PACKAGE, '**', '*.py'), recursive=True):
        parts = os.path.relpath(path, os.path.join(REPO, PACKAGE))[:-len('.py')].split(os.sep)
        if parts[-1] == '__init__':
            parts = parts[:-1]
        if parts:
            names.add('.'.join(parts))
    return sorted(names, key=lambda n: (-len(n), n))


MODULES = package_modules()
# not inside a file name: a temp file's mark (`.ckpt.pt.nanogpt_plus.tmp.<pid>`) is no code
DOTTED = re.compile(rf'(?<![.\w]){PACKAGE}(?:\.\w+)+')
FROM_IMPORT = re.compile(rf'\bfrom ({PACKAGE}(?:\.\w+)*) import ([\w, ]+)')
SHORT = re.compile(rf"`((?:{'|'.join(map(re.escape, MODULES))})\.\w+)")
# a short form that is a file name (`metrics.jsonl`, `tokenizer.json`), not a module's attribute
FILE_SUFFIXES = ('py', 'json', 'jsonl', 'png', 'pt', 'bin', 'pkl', 'txt', 'md')


def doc_files():
    return [os.path.join(REPO, 'README.md')] + sorted(glob.glob(os.path.join(REPO, 'docs', '*.md')))


def named(line):
    """ The dotted names nanogpt_plus.x[.y] a line of a doc mentions. """
    names = [m.rstrip('.') for m in DOTTED.findall(line)]
    for module, imported in FROM_IMPORT.findall(line):
        names += [f'{module}.{n.strip()}' for n in imported.split(',') if n.strip()]
    names += [f'{PACKAGE}.{m}' for m in SHORT.findall(line)
              if m.rsplit('.', 1)[1] not in FILE_SUFFIXES]
    return names


def exists(dotted):
    """ Whether dotted imports: its longest prefix that is a module, then attributes from it. """
    parts = dotted.split('.')
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module('.'.join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_package_name_in_the_docs_exists():
    mentions, missing = 0, []
    for path in doc_files():
        with open(path, encoding='utf-8') as f:
            for number, line in enumerate(f, 1):
                for name in named(line):
                    mentions += 1
                    if not exists(name):
                        missing.append(f"{os.path.relpath(path, REPO)}:{number}: {name}")
    assert mentions > 5  # the docs do name code: a regex that finds nothing would pass vacuously
    assert not missing, "the docs name code that doesn't exist:\n" + "\n".join(missing)


def test_the_scan_finds_each_form():
    line = ("`nanogpt_plus.training.optimizer_step`, `checkpoint.init_model`, `metrics.jsonl`, "
            "from nanogpt_plus.dataset import find_shards, open_token_file; `dataset.shards.open_shard`, "
            "`dataset.shards.open_token_file`")
    assert named(line) == ['nanogpt_plus.training.optimizer_step', 'nanogpt_plus.dataset',
                           'nanogpt_plus.dataset.find_shards', 'nanogpt_plus.dataset.open_token_file',
                           'nanogpt_plus.checkpoint.init_model', 'nanogpt_plus.dataset.shards.open_shard',
                           'nanogpt_plus.dataset.shards.open_token_file']
    assert [exists(n) for n in named(line)] == [False, True, True, False, False, True, False]
