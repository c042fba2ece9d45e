"""
Shared test set-up: no network for any library, no process group left behind by a test (like litgpt's conftest),
GPU tests skipped without a GPU, the two tiers (fast by default, --runslow for all), and the fixtures the tests of
several files use (datasets, finished runs). Helpers that tests import live in helpers.py.
"""
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types

import numpy as np
import pytest

import helpers
import train
from helpers import (
    BPE_TEXT,
    CHAR_TEXT,
    SHORT,
    TINY_VOCAB,
    bpe_corpus_text,
    synthetic_bpe_json,
    train_args,
    write_bpe_dataset,
    write_split_files,
)
from nanogpt_plus.bpe import BPETokenizer
from nanogpt_plus.tokenizer import CharTokenizer, GPT2Tokenizer

# hermetic: Hugging Face libraries and wandb must never reach for the network inside the test suite
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# no test's outcome may depend on what else the machine runs: the memory check of train.py (in this process and
# in every process a test starts) reads this figure, not /proc/meminfo's MemAvailable (a full suite once failed
# on the default GPT-2 config with 10 GiB free). Tests of the check itself set their own figure
os.environ["NANOGPT_FREE_MEMORY_GIB"] = "64"
# a process a test starts that dies of a fatal signal says where: faulthandler prints the Python stack of
# every thread, torch the C++ backtrace of a std::terminate. A torchrun rank once died of SIGABRT
# ("terminate called without an active exception") in a full run and left only that line, with no
# way to tell at which step of the script it happened
os.environ.setdefault("PYTHONFAULTHANDLER", "1")
os.environ.setdefault("TORCH_CUSTOM_TERMINATE", "1")
# where transformers copies an export's code for trust_remote_code: a directory of this run (removed at its end),
# not the user's cache
if "HF_MODULES_CACHE" not in os.environ:
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix='hf-modules-')
    atexit.register(shutil.rmtree, os.environ["HF_MODULES_CACHE"], ignore_errors=True)


@pytest.fixture(autouse=True)
def destroy_process_group():
    yield
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """ A tiny learnable character dataset (train.bin, val.bin, meta.json): a repeating 20-symbol pattern
    with 5% noise, 54,000 train and 6,000 val tokens. Returns its directory (usable as --dataset). """
    d = tmp_path_factory.mktemp("tiny_ds")
    rng = np.random.default_rng(0)
    tokens = np.tile(np.arange(TINY_VOCAB), 3000)
    noise = rng.random(tokens.size) < 0.05
    tokens[noise] = rng.integers(0, TINY_VOCAB, noise.sum())
    tokens[:54000].astype(np.uint16).tofile(d / "train.bin")
    tokens[54000:].astype(np.uint16).tofile(d / "val.bin")
    stoi = {chr(97 + i): i for i in range(TINY_VOCAB)}
    (d / "meta.json").write_text(json.dumps({"kind": "char", "vocab_size": TINY_VOCAB, "stoi": stoi,
                                             "itos": {i: c for c, i in stoi.items()}}))
    return str(d)


@pytest.fixture(scope="session")
def dataset(tiny_dataset):
    """ The dataset train.py runs in the tests read (a test module may define its own). """
    return tiny_dataset


@pytest.fixture(scope="module")
def one_thread():
    """ For tiny models a second intra-op thread only adds synchronisation (and stalls on a busy CPU). """
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def bpe512(tmp_path_factory):
    """ (tokenizer, dataset directory): a vocab-512 byte-level BPE trained on bpe_corpus_text, and a
    dataset of that text in its tokens (usable as --dataset). """
    from nanogpt_plus.bpe import train_bpe
    text = bpe_corpus_text()
    tok = train_bpe(iter(text.split("\n\n")), 512, show_progress=False)
    return tok, write_bpe_dataset(tmp_path_factory.mktemp("bpe512"), tok, text)


# -----------------------------------------------------------------------------
# the two tiers: `python -m pytest` runs the fast one; `--runslow` adds the tests that start processes or
# compile. A test is slow when it reaches a helper marked helpers.slow (helpers.py explains); nothing is marked
# by hand.

def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run the slow tier: the tests that start processes (scripts, torchrun) or compile")


def _code_names(code):
    """ The global and attribute names a function's code uses, its nested functions' and lambdas' included. """
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _reaches_slow_helper(func, seen):
    """ Whether func uses a helper marked slow, or a function of the tests or of helpers.py that does. """
    func = getattr(func, '__func__', func)
    if getattr(func, 'slow_tier', False):
        return True
    code = getattr(func, '__code__', None)
    if code is None or code in seen:
        return False
    seen.add(code)
    scope = getattr(func, '__globals__', {})
    for name in _code_names(code):
        # helpers.run_python is the names 'helpers' and 'run_python': a name may be a helper's either way
        for obj in (scope.get(name), vars(helpers).get(name)):
            if getattr(obj, 'slow_tier', False):
                return True
            if isinstance(obj, types.FunctionType) and _reaches_slow_helper(obj, seen):
                return True
    return False


def _is_slow(item):
    """ The test, or one of the fixtures it uses, reaches a slow helper. """
    funcs = [getattr(item, 'obj', None)]
    fixtureinfo = getattr(item, '_fixtureinfo', None)
    for defs in (fixtureinfo.name2fixturedefs.values() if fixtureinfo is not None else ()):
        funcs += [d.func for d in defs]
    seen = set()
    return any(_reaches_slow_helper(f, seen) for f in funcs if f is not None)


def pytest_collection_modifyitems(config, items):
    import torch
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    fast = []
    for item in items:
        if _is_slow(item):
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
        if "slow" not in item.keywords:
            fast.append(item)
    # an explicit -m (say -m slow) chooses the tests itself
    if config.getoption("--runslow") or config.getoption("-m"):
        return
    config.hook.pytest_deselected(items=[item for item in items if "slow" in item.keywords])
    items[:] = fast


@pytest.fixture(autouse=True)
def current_test(request, monkeypatch):
    """
    The running test, for the launchers' check (helpers.in_slow_tier); and for a fast test, a Python process
    started any other way fails it too, so that no process escapes the slow tier.
    """
    helpers.CURRENT_TEST = request.node
    if request.node.get_closest_marker('slow') is None:
        real_init = subprocess.Popen.__init__

        def popen_init(self, args, *rest, **kwargs):
            program = args[0] if isinstance(args, (list, tuple)) and args else args
            if isinstance(program, str) and (program == sys.executable or 'python' in os.path.basename(program)
                                             or 'torchrun' in program):
                helpers.in_slow_tier(f"starts {program}")
            real_init(self, args, *rest, **kwargs)
        monkeypatch.setattr(subprocess.Popen, '__init__', popen_init)
    yield
    helpers.CURRENT_TEST = None


# -----------------------------------------------------------------------------
# a finished tiny run, and copies of it

@pytest.fixture(scope='module')
def finished(tiny_dataset, tmp_path_factory):
    """The out_dir of a complete 2-layer run (max_iters=3: its checkpoint is at iter 4)."""
    out_dir = tmp_path_factory.mktemp('finished')
    train.main(train_args(tiny_dataset, out_dir, **SHORT))
    return out_dir


# -----------------------------------------------------------------------------
# a finished tiny run to resume, copied datasets, a disk that fills up

@pytest.fixture(scope="module")
def trained(dataset, tmp_path_factory):
    """ out_dir of a finished tiny run: its final checkpoint is at iter 7 (max_iters=6 + 1: the steps done). """
    out = tmp_path_factory.mktemp("trained")
    train.main(train_args(dataset, out, max_iters=6, eval_interval=3, num_threads=1))
    return out


@pytest.fixture
def run_dir(trained, tmp_path):
    """ A copy of the trained run, for a test to resume (or fail to resume) in. """
    return shutil.copytree(trained, tmp_path / "run")


# -----------------------------------------------------------------------------
# datasets of multi-byte text, in a character vocabulary and in GPT-2's BPE

@pytest.fixture(scope='module')
def two_datasets(tmp_path_factory):
    """ {'char': (dataset, tokenizer), 'char_pkl': ..., 'gpt2': ...}: text with multi-byte characters in a
    character vocabulary (its meta.json, or nanoGPT's meta.pkl) and in GPT-2's BPE (no meta). """
    root = tmp_path_factory.mktemp('bpb')
    char = CharTokenizer.from_text(CHAR_TEXT)
    gpt2 = GPT2Tokenizer()
    ids = char.encode(CHAR_TEXT)
    return {'char': (write_split_files(root / 'char', ids, char.meta()), char),
            'char_pkl': (write_split_files(root / 'char_pkl', ids, char.meta(), pickled=True), char),
            'gpt2': (write_split_files(root / 'gpt2', gpt2.encode_ordinary(BPE_TEXT)), gpt2)}


# -----------------------------------------------------------------------------
# a small synthetic bpe tokenizer and its dataset

@pytest.fixture(scope="module")
def small_bpe(tmp_path_factory):
    """ (a 300-token synthetic BPE, whose vocabulary pads to 320; a dataset of 20,000 characters in it). Its few
    merges join a zero byte with another, so every character beyond ASCII takes several tokens. """
    tok = BPETokenizer(synthetic_bpe_json(300))
    return tok, write_bpe_dataset(tmp_path_factory.mktemp("bpe300"), tok, bpe_corpus_text()[:20000])
