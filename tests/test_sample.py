"""
sample.py end to end: tiny checkpoints trained here (a character model and a GPT-2 BPE one), run through the CLI,
plus nanoGPT-format checkpoints, streaming (a character split over tokens printed once whole), and the error
messages.
"""
import os
import pickle
import re
import signal
import sys

import pytest
import torch

import sample
from helpers import REPO, run_python, save_test_checkpoint
from model import GPT, GPTConfig
from nanogpt_plus.tokenizer import CharTokenizer, GPT2Tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


SAMPLE = os.path.join(REPO, 'sample.py')


SEP = '---------------'


CHAR_TEXT = "abcd\n" * 200


BPE_TEXT = "Hello world!<|endoftext|>" * 60


def train_tiny(model, ids, max_steps, lr=1e-2, batch_size=16):
    """ Fit a small model to a periodic token stream, so that its greedy continuations are predictable. """
    torch.manual_seed(0)
    data = torch.tensor(ids, dtype=torch.long)
    bs = model.config.block_size
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(max_steps):
        ix = torch.randint(len(data) - bs - 1, (batch_size,))
        x = torch.stack([data[i:i + bs] for i in ix])
        y = torch.stack([data[i + 1:i + 1 + bs] for i in ix])
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.05:
            break
    assert loss.item() < 0.1, "the tiny model failed to learn its periodic text"
    return model.eval()


@pytest.fixture(scope="module")
def char_model(tmp_path_factory):
    tok = CharTokenizer.from_text(CHAR_TEXT)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=tok.vocab_size))
    train_tiny(model, tok.encode(CHAR_TEXT), max_steps=600)
    out_dir = tmp_path_factory.mktemp("out-char")
    save_test_checkpoint(model, tok.meta(), out_dir / "ckpt.pt", dataset="tiny")
    return model, tok, out_dir


@pytest.fixture(scope="module")
def bpe_out_dir(tmp_path_factory):
    tok = GPT2Tokenizer()
    torch.manual_seed(0)
    # the padded vocabulary, like nanoGPT's GPT-2 models; a block of 8 tokens, so samples run past it
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=16, block_size=8, vocab_size=50304))
    train_tiny(model, tok.encode(BPE_TEXT), max_steps=600, batch_size=8)
    out_dir = tmp_path_factory.mktemp("out-bpe")
    save_test_checkpoint(model, tok.meta(), out_dir / "ckpt.pt", dataset="tiny")
    return out_dir


def run_sample(*args, cwd=REPO):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return run_python([SAMPLE, *args], cwd=cwd,
                          env=env, timeout=300)


def samples_of(stdout):
    """ The printed samples: the text before each separator line (dropping the configurator's lines). """
    body = stdout.split("number of parameters", 1)[1].split("\n", 1)[1]
    return body.split(SEP + "\n")[:-1]


# -----------------------------------------------------------------------------
# happy paths

def test_char_model_end_to_end(char_model):
    _, _, out_dir = char_model
    # 30 new tokens with a 16-token block: past the block in both modes
    for mode in ("exact", "fast"):
        r = run_sample(f"--out_dir={out_dir}", "--device=cpu", "--num_samples=3", "--max_new_tokens=30",
                       "--temperature=0", "--start=ab", f"--mode={mode}")
        assert r.returncode == 0, r.stderr
        assert samples_of(r.stdout) == ["ab" + ("cd\nab" * 6) + "\n"] * 3
        assert "generated 90 tokens in" in r.stderr and "tokens/s)" in r.stderr


def test_char_model_default_sampling_is_seeded(char_model):
    _, _, out_dir = char_model
    args = (f"--out_dir={out_dir}", "--device=cpu", "--max_new_tokens=40", "--temperature=2.0", "--top_k=None")
    a = run_sample(*args)
    b = run_sample(*args)
    assert a.returncode == 0, a.stderr
    sa = samples_of(a.stdout)
    # + print's newline
    assert len(sa) == 10 and all(s.startswith("\n") and len(s) == 1 + 40 + 1 for s in sa)
    assert all(set(s) <= set("abcd\n") for s in sa)  # only the model's vocabulary
    assert sa == samples_of(b.stdout)  # same seed, same samples
    assert len(set(sa)) == 10  # ten independent samples at a high temperature
    c = run_sample(*args, "--seed=7")
    assert c.returncode == 0, c.stderr
    sc = samples_of(c.stdout)
    assert len(sc) == 10 and sc != sa


def test_bpe_model_end_to_end_and_stop_at_eot(bpe_out_dir):
    r = run_sample(f"--out_dir={bpe_out_dir}", "--device=cpu", "--num_samples=2", "--max_new_tokens=12",
                   "--temperature=0", "--start=Hello")
    assert r.returncode == 0, r.stderr
    assert samples_of(r.stdout) == ["Hello" + " world!<|endoftext|>Hello" * 3 + "\n"] * 2
    assert "generated 24 tokens" in r.stderr
    r = run_sample(f"--out_dir={bpe_out_dir}", "--device=cpu", "--num_samples=2", "--max_new_tokens=12",
                   "--temperature=0", "--start=Hello", "--stop_at_eot=True")
    assert r.returncode == 0, r.stderr
    assert samples_of(r.stdout) == ["Hello world!\n"] * 2
    # ' world', '!' per sample; <|endoftext|> is not counted
    assert "generated 4 tokens" in r.stderr


def test_nanogpt_checkpoint_with_meta_pkl(char_model, tmp_path):
    model, tok, _ = char_model
    # nanoGPT's format: compiled-model keys, no 'tokenizer' / 'model_extra_args', the vocabulary in
    # data/<dataset>/meta.pkl relative to where sample.py runs
    sd = {'_orig_mod.' + k: v for k, v in model.state_dict().items()}
    ckpt = {'model': sd, 'optimizer': {}, 'model_args': model.config.model_args(), 'iter_num': 0,
            'best_val_loss': 1.0, 'config': {'dataset': 'tinychar'}}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    (tmp_path / "data" / "tinychar").mkdir(parents=True)
    with open(tmp_path / "data" / "tinychar" / "meta.pkl", "wb") as f:
        pickle.dump({'vocab_size': tok.vocab_size, 'itos': tok.itos, 'stoi': tok.stoi}, f)
    r = run_sample("--out_dir=.", "--device=cpu", "--num_samples=1", "--max_new_tokens=8", "--temperature=0",
                   "--start=c", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert samples_of(r.stdout) == ["cd\nabcd\na\n"]


def test_help_explains_the_modes():
    r = run_sample("--help")
    assert r.returncode == 0
    assert "exact (default)" in r.stdout and "fast" in r.stdout and "block_size/2" in r.stdout
    assert "--top_p" in r.stdout and "--stop_at_eot" in r.stdout
    # every setting is listed with its default
    assert re.search(r"--mode\s+= 'exact'$", r.stdout, re.M) and re.search(r"--top_k\s+= 200$", r.stdout, re.M)
    assert re.search(r"--num_samples\s+= 10$", r.stdout, re.M)


# -----------------------------------------------------------------------------
# streaming (in process, to see each write)

class RecordingStdout:
    def __init__(self):
        self.writes = []
        self.flushes = 0

    def write(self, s):
        self.writes.append(s)

    def flush(self):
        self.flushes += 1

    def text(self):
        return "".join(self.writes)


def run_in_process(monkeypatch, *args):
    import sample
    out = RecordingStdout()
    monkeypatch.setattr(sys, "argv", ["sample.py", *args])
    monkeypatch.setattr(sys, "stdout", out)
    sample.run_main(sample.main)
    return out


def test_single_sample_streams_token_by_token(char_model, monkeypatch, capsys):
    _, _, out_dir = char_model
    out = run_in_process(monkeypatch, f"--out_dir={out_dir}", "--device=cpu", "--num_samples=1",
                         "--max_new_tokens=20", "--temperature=0", "--start=ab")
    text = out.text()
    assert text.endswith("ab" + "cd\nab" * 4 + "\n" + SEP + "\n")
    # every generated character was written and flushed on its own
    i = out.writes.index("ab")
    assert out.writes[i + 1:i + 21] == list(("cd\nab" * 4))
    assert out.flushes >= 21


def test_stream_decoder_never_splits_multibyte_characters():
    from sample import StreamDecoder
    tok = GPT2Tokenizer()
    text = "héllo wörld 日本語 🙂 naïve"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # some characters span several tokens
    dec = StreamDecoder(tok)
    pieces = [dec.feed(t) for t in ids] + [dec.flush()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    # a character model streams one character per token
    ctok = CharTokenizer.from_text("ab\n")
    cdec = StreamDecoder(ctok)
    assert [cdec.feed(t) for t in ctok.encode("ba\n")] == ["b", "a", "\n"]


def test_many_samples_are_drawn_in_bounded_batches_and_the_first_batch_is_unchanged(char_model, monkeypatch, capsys):
    """ num_samples=10**8 drew one batch that grew to 22 GB, deaf to SIGTERM: now batches of at most
    MAX_BATCH_SAMPLES, each printed when done; the first batch's samples are those of one batch of that size. """
    _, _, out_dir = char_model
    args = (f"--out_dir={out_dir}", "--device=cpu", "--max_new_tokens=3", "--start=ab", "--num_threads=1")
    sizes = []
    real = sample.generate_stream

    def recorded(model, x, *a, **k):
        sizes.append(x.shape[0])
        return real(model, x, *a, **k)
    monkeypatch.setattr(sample, "generate_stream", recorded)
    many = samples_of(run_in_process(monkeypatch, *args, f"--num_samples={sample.MAX_BATCH_SAMPLES * 2 + 5}").text())
    assert sizes == [sample.MAX_BATCH_SAMPLES] * 2 + [5]
    assert len(many) == sample.MAX_BATCH_SAMPLES * 2 + 5
    assert f"generated {len(many) * 3} tokens" in capsys.readouterr().err
    one_batch = samples_of(run_in_process(monkeypatch, *args, f"--num_samples={sample.MAX_BATCH_SAMPLES}").text())
    assert many[:sample.MAX_BATCH_SAMPLES] == one_batch


def test_a_hundred_million_samples_stop_at_sigterm_between_steps(char_model):
    """ The issue's case: memory bounded by one batch, and SIGTERM after the first samples ends it in 130,
    one line. """
    from helpers import start_python
    _, _, out_dir = char_model
    proc = start_python([SAMPLE, f"--out_dir={out_dir}", "--device=cpu", "--num_samples=100000000",
                         "--max_new_tokens=3", "--start=ab", "--num_threads=1"], cwd=REPO)
    for line in proc.stdout:
        if line.rstrip("\n") == SEP:
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == ("stopped by SIGTERM before the work was done; it can't be resumed, "
                                           "and no output was left half-written (exit code 130)")
    assert "Traceback" not in err and not os.path.exists(os.path.join(out_dir, "run.lock"))


# -----------------------------------------------------------------------------
# bad input: one clear line on stderr, exit code 2, no traceback

def expect_error(monkeypatch, capsys, *args):
    with pytest.raises(SystemExit) as e:
        run_in_process(monkeypatch, *args)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    # the error is the last line on stderr, and the only one
    assert err.strip().splitlines()[-1].startswith("error: ") and err.count("error:") == 1, err
    return err


def test_unknown_characters_in_start_are_named(char_model, monkeypatch, capsys):
    _, _, out_dir = char_model
    err = expect_error(monkeypatch, capsys, f"--out_dir={out_dir}", "--device=cpu", "--start=abXzX")
    assert "error:" in err and "2 character(s) not in this model's vocabulary" in err
    assert "'X'" in err and "'z'" in err


def test_long_prompt_is_cropped_with_a_warning(char_model, monkeypatch, capsys):
    _, _, out_dir = char_model
    out = run_in_process(monkeypatch, f"--out_dir={out_dir}", "--device=cpu", "--num_samples=1",
                         "--max_new_tokens=5", "--temperature=0", "--start=" + "abcd\n" * 5 + "abc")
    err = capsys.readouterr().err
    assert "warning: the prompt has 28 tokens, more than the model's block_size (16)" in err
    assert out.text().endswith(("abcd\n" * 5 + "abc")[-16:] + "d\nabc\n" + SEP + "\n")


def test_missing_and_corrupt_checkpoints(tmp_path, monkeypatch, capsys):
    err = expect_error(monkeypatch, capsys, f"--out_dir={tmp_path / 'nothing'}", "--device=cpu")
    assert "no checkpoint at" in err
    (tmp_path / "ckpt.pt").write_bytes(b"definitely not a checkpoint")
    err = expect_error(monkeypatch, capsys, f"--out_dir={tmp_path}", "--device=cpu")
    assert "is corrupt" in err


def test_start_file(char_model, tmp_path, monkeypatch, capsys):
    _, _, out_dir = char_model
    err = expect_error(monkeypatch, capsys, f"--out_dir={out_dir}", "--device=cpu",
                       f"--start=FILE:{tmp_path / 'missing.txt'}")
    assert "missing.txt: no such file" in err
    (tmp_path / "prompt.txt").write_text("bc", encoding="utf-8")
    out = run_in_process(monkeypatch, f"--out_dir={out_dir}", "--device=cpu", "--num_samples=1",
                         "--max_new_tokens=4", "--temperature=0", f"--start=FILE:{tmp_path / 'prompt.txt'}")
    assert out.text().endswith("bcd\nab\n" + SEP + "\n")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="FIFOs")
def test_a_prompt_file_that_never_ends_is_refused_and_a_long_one_is_read_from_its_end(
        char_model, tmp_path, monkeypatch, capsys):
    """ /dev/zero (4 GB in 15 s, deaf to SIGTERM) and a FIFO (blocks at open) are refused in one line,
    unread; a prompt file longer than the model can use is read from its end, said in one line. """
    _, _, out_dir = char_model
    os.mkfifo(tmp_path / "fifo")
    before = sorted(os.listdir(tmp_path))
    for path, kind in (("/dev/zero", "a character device"), (tmp_path / "fifo", "a FIFO (named pipe)")):
        err = expect_error(monkeypatch, capsys, f"--out_dir={out_dir}", "--device=cpu", f"--start=FILE:{path}")
        assert err.strip().splitlines()[-1] == (
            f"error: start=FILE: prompt file {path} is {kind}, not a regular file: reading it could wait "
            f"forever; give a regular file")
    assert sorted(os.listdir(tmp_path)) == before
    # 'bcda' * ~25k: 100,000 bytes, of which the last 16 * 64 are read; the same sample as the whole file's
    (tmp_path / "long.txt").write_text("é" + "bcda" * 25_000 + "bc", encoding="utf-8")
    out = run_in_process(monkeypatch, f"--out_dir={out_dir}", "--device=cpu", "--num_samples=1",
                         "--max_new_tokens=4", "--temperature=0", f"--start=FILE:{tmp_path / 'long.txt'}")
    err = capsys.readouterr().err
    assert (f"note: start=FILE:{tmp_path / 'long.txt'} is 100,004 bytes; reading its last 1,024 (the model "
            f"uses only its last 16 tokens)") in err.splitlines()
    assert out.text().endswith(("bcda" * 25_000 + "bc")[-16:] + "d\nab\n" + SEP + "\n")


def test_a_prompt_file_cut_inside_a_character_starts_at_the_next_one(tmp_path, capsys):
    # 1,201 bytes; the cut at 177 is mid-é
    (tmp_path / "p.txt").write_text("é" * 600 + "x", encoding="utf-8")
    assert sample.read_start(f"FILE:{tmp_path / 'p.txt'}", 16) == "é" * 511 + "x"
    assert "is 1,201 bytes; reading its last 1,024" in capsys.readouterr().err


def test_bad_settings(char_model, monkeypatch, capsys):
    _, _, out_dir = char_model
    for arg, msg in (("--mode=quick", "mode must be"), ("--top_p=1.5", "top_p must be"),
                     ("--temperature=-1.0", "temperature must be"), ("--top_k=0", "top_k must be")):
        err = expect_error(monkeypatch, capsys, f"--out_dir={out_dir}", arg)
        # checked before loading
        assert err.startswith("error: ") and msg in err and err.count("\n") == 1


def test_stream_decoder_prints_a_character_split_over_tokens_once_complete(small_bpe):
    tok, _ = small_bpe
    text = "é世🎉a"
    ids = tok.encode(text)
    assert len(ids) == 10  # 2 + 3 + 4 bytes + 'a': each character split into its bytes
    decoder = sample.StreamDecoder(tok)
    pieces = [decoder.feed(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text and [p for p in pieces if p] == ["é", "世", "🎉", "a"]
    assert tok.encode("<|endoftext|>a") == [tok.eot_token, tok.encode("a")[0]]


# -----------------------------------------------------------------------------
# the CPU thread count: train.py's choice (num_threads=0: timed, re-checked while sampling)

@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_sampling_times_its_threads_on_a_sampling_step_and_retunes(char_model, monkeypatch, capsys, mode):
    from helpers import FakeThreadTiming
    from nanogpt_plus import machine
    _, _, out_dir = char_model
    fake = FakeThreadTiming({2: 0.05, 1: 0.01}, interval=5, probe=2).install(monkeypatch, machine)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # torch's default on 2 cores
        out = run_in_process(monkeypatch, f"--out_dir={out_dir}", "--device=cpu", "--num_samples=1",
                             "--max_new_tokens=30", "--temperature=0", "--start=ab", f"--mode={mode}")
        # the timing left no trace: the same greedy continuation, past the 16-token block
        assert out.text().endswith("ab" + "cd\nab" * 6 + "\n" + SEP + "\n")
        assert fake.timed == [[2, 1]]
        err = capsys.readouterr().err
        assert "using 1 CPU threads (sampling step ms: 2 threads 50.0, 1 threads 10.0)" in err
        # every step after the first was timed, started on the chosen count, and re-checked with the other
        assert len(fake.seen) == 29 and fake.seen[0][1] == 1 and {n for _, n in fake.seen} == {1, 2}
        fake.timed.clear()
        torch.set_num_threads(1)
        out = run_in_process(monkeypatch, f"--out_dir={out_dir}", "--device=cpu", "--num_samples=1",
                             "--max_new_tokens=5", "--start=ab", "--num_threads=2", f"--mode={mode}")
        assert fake.timed == [] and torch.get_num_threads() == 2  # a fixed count: set, never timed
    finally:
        torch.set_num_threads(before)


def test_prompt_is_start_under_a_name_torchrun_lets_through(tmp_path):
    from configurator import parse_config
    from nanogpt_plus.errors import UserError
    assert sample.prompt_setting(parse_config(sample.DEFAULTS, ['--start=abc'])) == ('start', 'abc')
    both = parse_config(sample.DEFAULTS, ['--start=abc', '--prompt=xyz'])
    assert sample.prompt_setting(both) == ('prompt', 'xyz')
    missing = parse_config(sample.DEFAULTS, [f'--prompt=FILE:{tmp_path / "nope.txt"}'])
    assert sample.prompt_files(missing) == {'prompt file': str(tmp_path / 'nope.txt')}
    with pytest.raises(UserError, match=r"^prompt=FILE:.*nope.txt: no such file"):
        name, text = sample.prompt_setting(missing)
        sample.read_start(text, 64, name)
