"""
Shared test set-up: no network for any library, and no process group
left behind by a test (like litgpt's conftest).
"""
import json
import os
import re

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


TINY_VOCAB = 20


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


# a 2-layer model and a short schedule on the CPU: what train_args starts from
TINY_RUN = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=4, gradient_accumulation_steps=2,
                max_iters=12, eval_interval=6, eval_iters=4, log_interval=1, warmup_iters=2, lr_decay_iters=12,
                learning_rate=1e-2, min_lr=1e-3, dropout=0.0, device='cpu', compile=False)


def train_args(dataset, out_dir, **settings):
    """ train.py's --key=value arguments for a tiny run on `dataset` into out_dir: TINY_RUN, then settings. """
    run = dict(TINY_RUN, dataset=dataset, out_dir=str(out_dir))
    run.update(settings)
    return [f"--{k}={v}" for k, v in run.items()]


@pytest.fixture(scope="module")
def one_thread():
    """ For tiny models a second intra-op thread only adds synchronisation (and stalls on a busy CPU). """
    import torch
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


ITER_LINE = re.compile(r"^iter (\d+): loss (\S+),", re.M)  # train.py's (and nanoGPT's) per-iteration line


def iter_losses(out):
    """ {iteration: loss} from train.py's `iter N: loss X, ...` lines. """
    return {int(m.group(1)): float(m.group(2)) for m in ITER_LINE.finditer(out)}


def assert_losses_close(a, b, keys, tol=2e-4):
    """ The losses of iterations `keys` agree within tol in the two {iteration: loss} dicts. """
    assert set(keys) <= a.keys() and set(keys) <= b.keys(), (a, b)
    for k in keys:
        assert abs(a[k] - b[k]) < tol, (k, a[k], b[k])


def train_one_and_two_ranks(args, tmp_path, steps):
    """
    train.py with args in one process (out_dir tmp_path/one) and under torchrun with 2 gloo ranks (tmp_path/two),
    one thread each; both must finish and print the same losses for iterations 0..steps-1 (within 2e-4).
    Returns the two CompletedProcesses.
    """
    import subprocess
    import sys
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launchers = {'one': [sys.executable, "train.py"],
                 'two': [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py"]}
    runs = {name: subprocess.run([*cmd, *args, f"--out_dir={tmp_path / name}"], cwd=REPO, capture_output=True,
                                 text=True, timeout=300, env=env) for name, cmd in launchers.items()}
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-2000:]
    a, b = iter_losses(runs['one'].stdout), iter_losses(runs['two'].stdout)
    assert a.keys() == b.keys() == set(range(steps))
    assert_losses_close(a, b, range(steps))
    return runs['one'], runs['two']


def save_test_checkpoint(model, tokenizer_meta, path, dataset='x'):
    """ A model saved the way train.py saves one (through the one checkpoint builder), at iteration 0. """
    from nanogpt_plus.checkpoint import build_checkpoint, save_checkpoint
    ckpt = build_checkpoint(model, iter_num=0, best_val_loss=1e9, config={'dataset': dataset},
                            tokenizer=tokenizer_meta, provenance={}, optimizer={})
    save_checkpoint(ckpt, str(path))
    return str(path)
