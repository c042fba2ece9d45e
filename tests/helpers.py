"""
Shared test helpers, imported by the test modules (`from helpers import ...`; pytest puts tests/ on sys.path):
the repository path, the tiny training run and its argument builder, loss parsing and comparison, checkpoint
saving, an in-process entry-point runner, byte-level BPE corpora, tokenizers and datasets, the launchers of the
slow tier (run_python, start_python, COMPILE), and below them what the tests of several rooms share: tiny train.py
runs in this process, fine-tuning sources and tasks, finished runs to copy, GPT's modern options, tiny models and
datasets. Fixtures and hooks stay in conftest.py.
"""
import builtins
import errno
import functools
import json
import math
import os
import pickle
import random
import re
import runpy
import shutil
import signal
import subprocess
import sys

import numpy as np
import torch

import finetune
import train
from configurator import Settings
from model import GPT, GPTConfig
from nanogpt_plus import finetuning
from nanogpt_plus.distributed import DistInfo
from nanogpt_plus.engine import generate
from nanogpt_plus.files import temp_path
from nanogpt_plus.muon import MuonWithAdamW
from nanogpt_plus.optimizer import AdamWSpec, MuonSpec, make_optimizer
from nanogpt_plus.tokenizer import CharTokenizer, load_tokenizer

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
        # prepare.py's entries (test_corpus pins them)
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


# -----------------------------------------------------------------------------
# tiny train.py runs in this process

tiny_args = functools.partial(train_args, dropout=0.1, num_threads=1)  # fixed threads: bitwise runs


def train_out(capsys, args):
    train.main(args)
    out = capsys.readouterr().out
    return out


def eval_losses(out):
    return [(int(m.group(1)), float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^step (\d+): train loss (\S+), val loss (\S+)$", out, re.M)]


def run_train(capsys, args):
    train.main(args)
    return capsys.readouterr()


def train_here(dataset, out_dir, capsys=None, **settings):
    """ train.py in this process; its stdout when capsys is given. """
    train.main(train_args(dataset, out_dir, num_threads=1, **settings))
    return capsys.readouterr().out if capsys else None


def one_line(args, timeout=120, **kwargs):
    r = run_python(['train.py'] + args, timeout=timeout, **kwargs)
    assert r.returncode == 2 and r.stderr.startswith('error: ') and r.stderr.strip().count('\n') == 0, r.stderr[-2000:]
    return r.stderr


# -----------------------------------------------------------------------------
# fine-tuning sources and tasks (finetune.py's tests and the other rooms' that fine-tune)

ALPHABET = "abcdefghijklmnopqrstuvwxyz ."


LETTERS = "abcdef"


SINGLE = DistInfo(False, 0, 0, 1, 'cpu')


def make_source(path, n_embd=32, block_size=64, seed=0):
    """ A tiny random-init char GPT saved as a train.py-style checkpoint (the fine-tune's source). """
    tok = CharTokenizer.from_text(ALPHABET)
    torch.manual_seed(seed)
    m = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=n_embd, block_size=block_size, vocab_size=tok.vocab_size,
                      bias=False))
    save_test_checkpoint(m, tok.meta(), os.path.join(path, 'ckpt.pt'))
    return str(path)


def _word(r):
    return ''.join(r.choice('abcdefghijklmnop') for _ in range(r.randint(2, 4)))


def gen_classification(r):
    # which of two marker words the text contains
    words = [_word(r) for _ in range(r.randint(2, 5))]
    label = r.randint(0, 1)
    words.insert(r.randint(0, len(words)), ['xyz', 'wvu'][label])
    return {'text': ' '.join(words), 'label': ['pos', 'neg'][label]}


def gen_entailment(r):
    # whether the hypothesis repeats a word of the premise
    a, b = r.sample('abcd', 2)
    label = r.randint(0, 1)
    hyp = r.choice([a, b]) if label else r.choice([c for c in 'abcd' if c not in (a, b)])
    return {'premise': f"{a * 3} {b * 3}", 'hypothesis': hyp * 3, 'label': ['neutral', 'entailment'][label]}


def gen_similarity(r):
    # whether the two texts share their first word
    label = r.randint(0, 1)
    a = r.choice('xz')
    b = a if label else ('z' if a == 'x' else 'x')
    rest1 = ' '.join(r.sample(LETTERS, 2))
    rest2 = ' '.join(r.sample(LETTERS, 2))
    return {'text1': f"{a * 3} {rest1}", 'text2': f"{b * 3} {rest2}", 'label': label}


def gen_multiple_choice(r):
    # which choice continues the context's pattern (2 to 5 choices)
    n = r.randint(2, 5)
    choices = r.sample(LETTERS, n)
    label = r.randrange(n)
    return {'context': ' '.join([choices[label]] * 4), 'choices': choices, 'label': label}


GENERATORS = {'classification': gen_classification, 'entailment': gen_entailment, 'similarity': gen_similarity,
              'multiple_choice': gen_multiple_choice}


def write_jsonl(path, records):
    with open(path, 'w', encoding='utf-8') as f:
        for rec in records:
            f.write(json.dumps(rec) + '\n')
    return str(path)


def make_task(tmp_path, task, n_train=512, n_val=100, seed=0):
    r = random.Random(seed)
    train = write_jsonl(tmp_path / f'{task}_train.jsonl', [GENERATORS[task](r) for _ in range(n_train)])
    val = write_jsonl(tmp_path / f'{task}_val.jsonl', [GENERATORS[task](r) for _ in range(n_val)])
    return train, val


def config(**overrides):
    base = dict(finetune.DEFAULTS, device='cpu', dropout=0.0, batch_size=16, learning_rate=3e-3, warmup_frac=0.1,
                log_interval=1000)
    return Settings({**base, **overrides})


SPECIAL = {'start': 100, 'delim': 101, 'extract': 102}


def val_accuracy(ckpt, path, task):
    """ The accuracy on path of the model saved in a fine-tune's checkpoint, recomputed from the file. """
    model = finetuning.model_from_finetune_checkpoint(ckpt)
    examples = finetuning.read_jsonl(path, task)
    encoded = finetuning.encode_examples(examples, task, load_tokenizer(ckpt['tokenizer']), ckpt['special_tokens'],
                                         model.gpt.config.block_size, path)
    labels = finetuning.label_ids(examples, task, ckpt['label_map'], path)
    correct, seen, _, _ = finetuning.evaluate(model, encoded, labels, ckpt['special_tokens'], 8, 'cpu',
                                              torch.autocast('cpu', enabled=False))
    assert seen == len(examples)
    return correct / seen


# -----------------------------------------------------------------------------
# a finished tiny run, and copies of it

SHORT = dict(max_iters=3, eval_interval=3, lr_decay_iters=3, warmup_iters=1)


def copy_run(run_dir, to):
    shutil.copytree(run_dir, to, ignore=shutil.ignore_patterns('run.lock'))
    return str(to)


# -----------------------------------------------------------------------------
# a finished tiny run to resume, copied datasets, a disk that fills up

def copy_dataset(src, dst, meta=None, train_tokens=None):
    """ The dataset src copied to dst, with another meta.json and/or train.bin. """
    shutil.copytree(src, dst)
    if meta is not None:
        (dst / "meta.json").write_text(json.dumps(meta))
    if train_tokens is not None:
        np.asarray(train_tokens, dtype=np.uint16).tofile(dst / "train.bin")
    return str(dst)


def resume_args(dataset, run_dir, **settings):
    return train_args(dataset, run_dir, init_from="resume", num_threads=1, **settings)


def run_with_file_size_limit(args, limit_bytes):
    """ python args in a process whose files can't grow past limit_bytes (SIGXFSZ ignored: an EFBIG error). """
    def limit():
        import resource
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    return run_python([*args], timeout=120,
                          preexec_fn=limit, env=env)


# -----------------------------------------------------------------------------
# a killed run's temp file, a one-line error

def dead_runs_temp(final, pid):
    """ The temp file a run of ours with this pid, killed while writing final, left behind. """
    ours = os.path.basename(temp_path(str(final)))  # this process's: the pid last
    return final.parent / f"{ours.rsplit('.', 1)[0]}.{pid}"


def refuse_to_open(monkeypatch, path):
    """ open(path) fails as for a file this user may not read (root, who runs the tests here, reads a chmod 000
    file anyway). Every other path opens as usual. """
    real_open = builtins.open

    def guarded(file, *args, **kwargs):
        if not isinstance(file, int) and os.path.abspath(os.fspath(file)) == os.path.abspath(os.fspath(path)):
            raise PermissionError(errno.EACCES, 'Permission denied', os.fspath(file))
        return real_open(file, *args, **kwargs)
    monkeypatch.setattr(builtins, 'open', guarded)


def one_error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


# -----------------------------------------------------------------------------
# a script run as __main__ in this process, and its one-line error

def run(script, monkeypatch, capsys, *args):
    """ `python SCRIPT ARGS` in this process: (exit code, stdout, stderr). """
    # scripts/*.py import benchtools beside them
    monkeypatch.syspath_prepend(os.path.join(REPO, "scripts"))
    monkeypatch.setattr(sys, "argv", [script, *args])
    code = 0
    try:
        runpy.run_path(os.path.join(REPO, script), run_name="__main__")
    except SystemExit as e:
        code = e.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, message):
    assert code == 2 and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


# -----------------------------------------------------------------------------
# GPT's modern options: configs and models with every parameter random

# every option away from GPT-2's at once, for the models the tests build
ALL_OPTIONS = dict(pos='rope', norm='rmsnorm', qk_norm=True, mlp_act='relu2', logit_softcap=1.5,
                   tie_embeddings=False)


def modern_config(**options):
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50, dropout=0.0, bias=True)
    args.update(options)
    return GPTConfig(**args)


@torch.no_grad()
def randomized(model, seed=0):
    """
    The model with every parameter drawn afresh so that each option shows in the logits: O(1) activations and
    attention scores (GPT-2's N(0, 0.02) init makes every attention nearly uniform, which would hide a wrong
    rotation), gains away from 1 and biases away from 0 (a dropped one would change nothing otherwise).
    """
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith('.bias'):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif p.dim() == 1:  # the norms' gains
            p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
        else:
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(p.size(1)))
    return model.eval()


def modern_model(seed=0, **options):
    torch.manual_seed(seed)
    return randomized(GPT(modern_config(**options)), seed)


def muon_optimizer(model, learning_rate=1e-3, muon_lr=0.02, ns_steps=5):
    """ What train.py builds for optimizer='muon' on the CPU (make_optimizer). """
    adamw = AdamWSpec(learning_rate=learning_rate, weight_decay=0.1, beta1=0.9, beta2=0.95)
    muon = MuonSpec(muon_lr=muon_lr, muon_momentum=0.95, muon_weight_decay=0.0, muon_ns_steps=ns_steps)
    opt = make_optimizer(model, adamw, 'cpu', muon=muon)
    assert isinstance(opt, MuonWithAdamW) and opt.float32_ns
    return opt


# -----------------------------------------------------------------------------
# a tiny GPT with random weights

def tiny_gpt(seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=50304, bias=True, gelu='tanh')
    args.update(kw)
    model = GPT(GPTConfig(**args))
    with torch.no_grad():  # random LayerNorm parameters too, so a dropped or misplaced one shows
        for name, p in model.named_parameters():
            if '.ln_' in name or 'ln_f' in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith('.bias'):
                p.normal_(0.0, 0.02)
    return model.eval()


# -----------------------------------------------------------------------------
# a tiny model of a padded bpe vocabulary, and its greedy text

# the bpe512 tokenizer's 512 tokens and 64 rows of padding, as a vocab padded for speed has
PADDED_VOCAB = 576


PROMPT = "Kalo mi té"


def bpe_gpt(scale, seed=0, vocab_size=PADDED_VOCAB):
    """
    A tiny GPT with PADDED_VOCAB rows. scale: the std of its weight matrices; at 1.0 (against GPT-2's 0.02) a
    random model's greedy text is varied (no token repeated over and over) and its top two logits stay well
    apart (>= 0.05 here, against ~1e-6 between our kernels and transformers'), so equal greedy tokens mean
    equal models, not luck.
    """
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=vocab_size, bias=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, scale)
            elif name.endswith('.bias'):
                p.normal_(0.0, 0.1)
            else:  # LayerNorm weights: random too, so a dropped or misplaced one shows
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def greedy_ids(model, prompt_ids, n, vocab_size):
    """ Our greedy continuation (the engine, temperature=0, only the tokenizer's ids) of prompt_ids. """
    with torch.no_grad():
        return generate(model, torch.tensor([prompt_ids]), n, temperature=0, vocab_size=vocab_size)[0].tolist()


# -----------------------------------------------------------------------------
# datasets of multi-byte text, in a character vocabulary and in GPT-2's BPE

# 1-, 2- and 3-byte characters: a character's token is not a byte
CHAR_TEXT = "the café sells crème brûlée for 5 € a slice.\n" * 60


BPE_TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, naïve "
            "and wise alike — €3 a loaf.\n") * 40


def write_split_files(directory, ids, meta=None, pickled=False):
    """ train.bin (the first 80%) and val.bin of token ids, and meta.json (or nanoGPT's meta.pkl) when
    given. """
    os.makedirs(directory, exist_ok=True)
    ids = np.asarray(ids, dtype=np.uint16)
    cut = len(ids) * 4 // 5
    ids[:cut].tofile(os.path.join(directory, 'train.bin'))
    ids[cut:].tofile(os.path.join(directory, 'val.bin'))
    if meta is not None and pickled:
        with open(os.path.join(directory, 'meta.pkl'), 'wb') as f:
            pickle.dump({k: meta[k] for k in ('vocab_size', 'itos', 'stoi')}, f)
    elif meta is not None:
        with open(os.path.join(directory, 'meta.json'), 'w', encoding='utf-8') as f:
            json.dump(meta, f)
    return str(directory)


# -----------------------------------------------------------------------------
# Shakespeare-like text, token files, the prepare scripts as processes

TEXT = ("First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n" * 40
        + "First Citizen:\nYou are all resolved rather to die than to famish?\n")


def run_offline(script, *args):
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
    return run_python([script, *args], env=env,
                          timeout=120)


def tokens(path):
    return np.fromfile(path, dtype=np.uint16)


# -----------------------------------------------------------------------------
# a character dataset's meta.json

def write_meta(d, vocab_size=TINY_VOCAB):
    stoi = {chr(97 + i): i for i in range(vocab_size)}
    (d / "meta.json").write_text(json.dumps({"kind": "char", "vocab_size": vocab_size, "stoi": stoi,
                                             "itos": {i: c for c, i in stoi.items()}}))


# -----------------------------------------------------------------------------
# eval.py as a process (under torchrun or not)

def run_eval(args, torchrun=False):
    launcher = TORCHRUN + ['--standalone', '--nproc_per_node=2'] if torchrun else []
    env = dict(os.environ, OMP_NUM_THREADS='1')
    return run_python(launcher + ['eval.py', '--device=cpu'] + args, timeout=300, env=env)


# -----------------------------------------------------------------------------
# GPT-2's end-of-text token

EOT = 50256


# -----------------------------------------------------------------------------
# a tiny GPTConfig

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=20, bias=True, dropout=0.0)


# -----------------------------------------------------------------------------
# git in a copy of the repository

def git(cwd, *args):
    return subprocess.run(['git', '-c', 'user.name=t', '-c', 'user.email=t@example.com', *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout


class FakeThreadTiming:
    """
    Stands in for machine.time_thread_counts and machine.ThreadRetuner (monkeypatch both with
    install()): the thread choice of a script with num_threads=0 runs its real timing work once per
    candidate, is told that `fastest` is fastest ({candidate: seconds}, a fake timing, never this
    machine's), and its retuner records the thread count every unit of the loop ran with. The
    retuner is fed the same fake seconds, not the unit's real time: a re-check that this machine's
    load decided would leave another count set when a later pass is timed (finetune.py's val
    batches), and a test's outcome would hang on the load. The tests of sample.py, eval.py and
    finetune.py use it to see that the choice is made and honoured.
    """

    def __init__(self, fastest, **retuning):
        self.fastest = fastest
        self.retuning = retuning  # the retuner's interval, probe, window in these tests
        self.timed = []  # the candidates of each timing, and what work() did
        self.seen = []  # (seconds, thread count) of every unit the retuner was fed

    def time_thread_counts(self, work, candidates, repeats=3, min_seconds=0.0):
        for n in candidates:
            torch.set_num_threads(n)
            work()
        self.timed.append(list(candidates))
        best = min(self.fastest, key=self.fastest.get)
        torch.set_num_threads(best)
        return best, dict(self.fastest)

    def install(self, monkeypatch, machine):
        fake = self

        class Recording(machine.ThreadRetuner):
            def __init__(self, candidates, **settings):
                super().__init__(candidates, **dict(settings, **fake.retuning))

            def observe(self, dt):
                # the fake timing's, whatever the unit took
                dt = fake.fastest[torch.get_num_threads()]
                fake.seen.append((dt, torch.get_num_threads()))
                return super().observe(dt)

        monkeypatch.setattr(machine, 'time_thread_counts', self.time_thread_counts)
        monkeypatch.setattr(machine, 'ThreadRetuner', Recording)
        return self


# -----------------------------------------------------------------------------
# llama.cpp itself (llama-cpp-python) on a GGUF export

@slow
def llama_cpp(path, n_ctx=64, vocab_only=False):
    """ llama.cpp's model of a GGUF file, through llama-cpp-python: the logits of every position kept (scores),
    two threads; vocab_only: its tokenizer alone. Slow: it loads a library of native code and the vocabulary. """
    from llama_cpp import Llama
    return Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, vocab_only=vocab_only, n_threads=2,
                 n_batch=n_ctx, seed=0, verbose=False)


def llama_greedy(llm, prompt_ids, n, n_tokens):
    """ llama.cpp's greedy continuation of prompt_ids: n tokens, each the largest of the first n_tokens logits. """
    llm.reset()
    llm.eval(list(prompt_ids))
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(np.argmax(llm.scores[llm.n_tokens - 1][:n_tokens])))
        llm.eval([ids[-1]])
    return ids
