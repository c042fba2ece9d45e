"""
Shared test set-up: no network for any library, no process group left behind by a test (like litgpt's conftest),
GPU tests skipped without a GPU, and the fixtures. Helpers that tests import live in helpers.py.
"""
import json
import os

import numpy as np
import pytest

from helpers import TINY_VOCAB, bpe_corpus_text, write_bpe_dataset

# hermetic: Hugging Face libraries and wandb must never reach for the network inside the test suite
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(autouse=True)
def destroy_process_group():
    yield
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def pytest_collection_modifyitems(config, items):
    import torch
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
