"""
Shared test helpers, imported by the test modules (`from helpers import ...`; pytest puts tests/ on sys.path):
the repository path, the tiny training run and its argument builder, loss parsing and comparison, checkpoint
saving, an in-process entry-point runner, byte-level BPE corpora, tokenizers and datasets, and the launchers of
the slow tier (run_python, start_python, COMPILE). Fixtures and hooks stay in conftest.py.
"""
import json
import os
import re
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_VOCAB = 20  # the symbols of conftest's tiny_dataset
# the tiny dataset's repeating pattern read as 19 letters and a space (HellaSwag endings are scored after a space)
SPACED_SYMBOLS = 'abcdefghijklmnopqrs '


# a 2-layer model and a short schedule on the CPU: what train_args starts from. One fixed thread: the
# thread count is never timed against the machine's load (num_threads=0); the tests of that choice set 0
TINY_RUN = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=4, gradient_accumulation_steps=2,
                max_iters=12, eval_interval=6, eval_iters=4, log_interval=1, warmup_iters=2, lr_decay_iters=12,
                learning_rate=1e-2, min_lr=1e-3, dropout=0.0, device='cpu', compile=False, num_threads=1)


FRAME = re.compile(r'^\s*File "([^"]+)", line \d+', re.M)


def project_frames(text, root=REPO):
    """
    The traceback frames in text that are this project's own files under root: not an installed package's, even
    where the packages live inside root (a virtual environment in the clone, as a newcomer makes one: .venv/).
    torchrun's own report of a failed worker is a traceback of its files only, so this is how a test tells "no
    worker traceback" from "no traceback at all".
    """
    ours = []
    for path in FRAME.findall(text):
        if not os.path.isabs(path):  # "<frozen runpy>", "<string>": no file of anyone's
            continue
        rel = os.path.relpath(path, root)
        parts = rel.split(os.sep)
        if rel.startswith('..') or {'site-packages', 'dist-packages'} & set(parts):
            continue
        if len(parts) > 1 and os.path.exists(os.path.join(root, parts[0], 'pyvenv.cfg')):
            continue  # inside a virtual environment's directory
        ours.append(path)
    return ours


def train_args(dataset, out_dir, **settings):
    """ train.py's --key=value arguments for a tiny run on `dataset` into out_dir: TINY_RUN, then settings. """
    run = dict(TINY_RUN, dataset=dataset, out_dir=str(out_dir))
    run.update(settings)
    return [f"--{k}={v}" for k, v in run.items()]


# train.py's (and nanoGPT's) per-iteration line
ITER_LINE = re.compile(r"^iter (\d+): loss (\S+),", re.M)


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
    env = dict(os.environ, OMP_NUM_THREADS="1")
    launchers = {'one': ["train.py"], 'two': TORCHRUN + ["--standalone", "--nproc_per_node=2", "train.py"]}
    runs = {name: run_python([*cmd, *args, f"--out_dir={tmp_path / name}"], timeout=300, env=env)
            for name, cmd in launchers.items()}
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-2000:]
    a = iter_losses(runs['one'].stdout)
    b = iter_losses(runs['two'].stdout)
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


def dead_pid():
    """ The pid of a process that has ended (and was reaped, so no live process has it for now). """
    p = subprocess.Popen(["true"])  # not Python: a process that is gone at once
    p.wait()
    return p.pid


def exit_code(main):
    """ What runtime.run_main makes of main(): the exit code (0 when main returns). """
    from nanogpt_plus.runtime import run_main
    try:
        run_main(main)
    except SystemExit as e:
        return e.code
    return 0


def run_script(module, monkeypatch, *args):
    """ An entry point's main() in this process (it reads sys.argv), with these command-line settings. """
    monkeypatch.setattr(sys, 'argv', [f'{module.__name__}.py', *args])
    module.main()


# -----------------------------------------------------------------------------
# byte-level BPE datasets (the 'bpe' tokenizer kind)

def bpe_corpus_text(n_words=40000, seed=0):
    """ A deterministic text of made-up words in lines and paragraphs, with accents, CJK and emoji in it:
    enough repeated structure for a few thousand BPE merges, and every kind of UTF-8 character. """
    import random
    rng = random.Random(seed)
    syllables = ["ka", "lo", "mi", "ne", "ru", "sa", "té", "vo", "ñu", "zé", "qu", "th", "ing", "er", "on"]
    vocabulary = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 4))) for _ in range(3000)]
    vocabulary += ["世界", "東京", "データ", "🎉", "🚀", "naïve", "façade", "Ελλάδα", "Москва"]
    words = [rng.choice(vocabulary[:300]) if rng.random() < 0.7 else rng.choice(vocabulary) for _ in range(n_words)]
    lines = []
    i = 0
    while i < len(words):
        n = rng.randint(4, 12)
        lines.append(" ".join(words[i:i + n]).capitalize() + rng.choice([".", ",", "!", "?", ";"]))
        i += n
    return "\n".join(line + ("\n" if k % 7 == 6 else "") for k, line in enumerate(lines)) + "\n"


def synthetic_bpe_json(vocab_size):
    """ A valid byte-level BPE tokenizer.json of exactly vocab_size tokens, built without training (for
    vocabularies no small corpus can fill, e.g. past 65,536): the 256 byte tokens, <|endoftext|>, then merges
    of a token and a byte into one, in a fixed order. """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from nanogpt_plus.bpe import EOT_TEXT, byte_alphabet
    chars = sorted(byte_alphabet(), key=lambda ch: byte_alphabet()[ch])
    vocab = {ch: i for i, ch in enumerate(chars)}  # ids 0..255, then <|endoftext|> as 256
    vocab[EOT_TEXT] = 256
    # merges of (first, byte): all two-byte tokens, then three-byte ones
    merges = []
    firsts = list(chars)
    while len(vocab) < vocab_size:
        longer = []
        for a in firsts:
            for b in chars:
                if len(vocab) < vocab_size and a + b not in vocab:
                    vocab[a + b] = len(vocab)
                    merges.append((a, b))
                    longer.append(a + b)
        firsts = longer
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOT_TEXT])
    return tok.to_str()


def write_bpe_dataset(directory, tokenizer, text, val_fraction=0.1):
    """ A bpe dataset in prepare.py's format: train.bin / val.bin (uint16, or uint32 past 65,536 tokens),
    tokenizer.json and meta.json naming it with its sha256, the eot id and the dtype. The text is split by
    characters like nanoGPT's Shakespeare (first 90% train); returns the directory. """
    from nanogpt_plus.bpe import TOKENIZER_FILE
    from nanogpt_plus.dataset import token_dtype
    from nanogpt_plus.prepare.token_files import bpe_meta
    os.makedirs(directory, exist_ok=True)
    dtype = token_dtype(tokenizer.vocab_size)
    cut = int(len(text) * (1 - val_fraction))
    for split, part in (("train", text[:cut]), ("val", text[cut:])):
        np.array(tokenizer.encode_ordinary(part), dtype=dtype).tofile(os.path.join(directory, f"{split}.bin"))
    with open(os.path.join(directory, TOKENIZER_FILE), "w", encoding="utf-8") as f:
        f.write(tokenizer.json)
    with open(os.path.join(directory, "meta.json"), "w", encoding="utf-8") as f:
        # prepare.py's entries (test_prepare_text pins them)
        json.dump(bpe_meta(tokenizer, dtype), f, indent=1)
    return str(directory)


def write_hellaswag(path, n=12, seed=1):
    """
    n examples in HellaSwag's JSONL format in the tiny dataset's letters (SPACED_SYMBOLS): the end of its pattern as
    the context, the pattern's start (the true continuation, after the scorer's space) among 3 random endings.
    Returns the path.
    """
    rng = np.random.default_rng(seed)
    letters = SPACED_SYMBOLS.strip()
    os.makedirs(os.path.dirname(str(path)) or '.', exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:
        for k in range(n):
            true = letters[:2 + k % 3]
            endings = [''.join(rng.choice(list(letters), len(true))) for _ in range(3)]
            endings.insert(k % 4, true)
            f.write(json.dumps({'ctx': letters[-(3 + k % 6):], 'endings': endings, 'label': k % 4}) + '\n')
    return str(path)


# -----------------------------------------------------------------------------
# the slow tier: starting processes (a script, torchrun) and compiling. The helpers below that do either are
# marked with `slow`; conftest.py puts every test that reaches one of them (directly, through a function of its
# module or of this one, or through a fixture) in the slow tier when it collects the tests, so that
# `python -m pytest` leaves it out and `python -m pytest --runslow` runs it. No test is marked by hand, and a
# launcher started by a test the collection did not see as slow fails that test (in_slow_tier).

# the running test (conftest.py sets it): the launchers check that it is in the slow tier
CURRENT_TEST = None
# torchrun as a module of this Python: run_python(TORCHRUN + ['--standalone', '--nproc_per_node=2', ...])
TORCHRUN = ['-m', 'torch.distributed.run']


def slow(helper):
    """ Marks a helper that starts processes or compiles: every test that reaches it is in the slow tier. """
    helper.slow_tier = True
    return helper


class SlowSettings(dict):
    """ Settings that make a run slow (COMPILE): a dict that carries the slow mark to the tests that use it. """
    slow_tier = True


# torch.compile: tens of seconds on 2 cores, the first time
COMPILE = SlowSettings(compile=True)


def in_slow_tier(what):
    """ Refuse, in the running test, a launch the collection did not see (see `slow`). """
    if CURRENT_TEST is not None and CURRENT_TEST.get_closest_marker('slow') is None:
        raise AssertionError(f"{CURRENT_TEST.nodeid} {what}, but was not collected as slow: start it through a "
                             f"helper of tests/helpers.py marked `slow`, from the test or a function it calls")


@slow
def run_python(args, cwd=REPO, timeout=300, env=None, **kwargs):
    """ `python <args>` in a new process (a script, or TORCHRUN + ...), run to its end; its output captured. """
    in_slow_tier("starts a process")
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env, **kwargs)


@slow
def start_python(args, cwd=REPO, env=None, **kwargs):
    """ `python <args>` started in the background, its output piped (a test that signals or kills it). """
    in_slow_tier("starts a process")
    return subprocess.Popen([sys.executable, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, **kwargs)


@slow
def start_program(argv, cwd=REPO, env=None, **kwargs):
    """ A program other than Python (a shell script) started in the background, its output piped. """
    in_slow_tier("starts a process")
    return subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            **kwargs)
