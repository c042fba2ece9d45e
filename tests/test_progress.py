"""
nanogpt_plus/progress.py, no silent minutes: long work says what it is doing and for how long, then how far it is;
quick work prints nothing extra. In process, on a fake clock, so that "long" takes no time here.
"""
import sys

import pytest
import torch

import train
from helpers import run_script, save_test_checkpoint
from model import GPT, GPTConfig
from nanogpt_plus import machine, progress
from nanogpt_plus.distributed import DistInfo
from nanogpt_plus.machine import choose_threads
from nanogpt_plus.tokenizer import CharTokenizer

SEP = '---------------'


SINGLE = DistInfo(under_torchrun=False, rank=0, local_rank=0, world_size=1, device='cpu')


class FakeClock:
    """ Stands in for the time module in nanogpt_plus/progress.py: time moves only when told to. """

    def __init__(self):
        self.now = 100.0

    def perf_counter(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(progress, 'time', fake)
    return fake


def run_steps(clock, seconds, total=100, **kwargs):
    """ A Progress over `total` steps of the given durations (one per step, the last repeated). """
    meter = progress.Progress(total, "working", "steps", **kwargs)
    for k in range(total):
        clock.now += seconds[min(k, len(seconds) - 1)]
        meter.advance()


def test_long_work_is_announced_then_reported(clock, capsys):
    run_steps(clock, [0.5])  # 50 s in all
    lines = capsys.readouterr().out.splitlines()
    # announced once the first 3 steps set the pace, then a line every 15 s (30 steps)
    assert lines[0] == "working: 100 steps, about 50 s"
    assert lines[1:] == ["working: 33/100 steps, 16 s so far, about 34 s left",
                         "working: 63/100 steps, 32 s so far, about 18 s left",
                         "working: 93/100 steps, 46 s so far, about 4 s left"]


def test_quick_work_prints_nothing(clock, capsys):
    run_steps(clock, [0.05])  # 5 s in all
    # a slow first step (warm-up) does not make quick work look long
    run_steps(clock, [1.0, 0.01])
    # nor does work that is long but shown by another rank
    run_steps(clock, [0.5], show=False)
    assert capsys.readouterr().out == ""


def test_time_left_follows_the_recent_pace(clock, capsys):
    # the pace doubles after 10 steps: the time left is the latest steps', not the mean's
    run_steps(clock, [1.0] * 10 + [0.5], file=sys.stderr)
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[2] == "working: 54/100 steps, 32 s so far, about 23 s left"


def test_durations_read_well():
    durations = [progress.duration(s) for s in (8.2, 89, 210, 7200)]
    assert durations == ["8 s", "89 s", "3.5 min", "2.0 h"]


# -----------------------------------------------------------------------------
# train.py: the loss estimate and the thread timing

class SlowModel(torch.nn.Module):
    """ A model whose forward takes `seconds` on the fake clock; its loss is the batch's mean. """

    def __init__(self, clock, seconds):
        super().__init__()
        self.clock = clock
        self.seconds = seconds

    def forward(self, X, Y):
        self.clock.now += self.seconds
        return None, X.float().mean()


class CountingLoader:
    """ Batches 0, 1, 2, ... as (X, Y), restarting at reset(). """

    def __init__(self):
        self.k = 0

    def reset(self):
        self.k = 0

    def next_batch(self):
        self.k += 1
        X = torch.full((2, 4), float(self.k - 1))
        return X, X


def estimate(clock, seconds, dist_info=SINGLE):
    loaders = {'train': CountingLoader(), 'val': CountingLoader()}
    no_autocast = torch.autocast('cpu', enabled=False)
    return train.estimate_loss(SlowModel(clock, seconds), loaders, 200, no_autocast, dist_info)


def test_a_long_loss_estimate_shows_its_progress(clock, capsys):
    # nanoGPT's char model on a CPU: 2 x 200 batches of ~0.5 s
    losses = estimate(clock, 0.5)
    assert losses == {'train': 99.5, 'val': 99.5}  # the same numbers as without progress
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "evaluating: 400 batches, about 3.3 min"
    assert lines[1] == "evaluating: 33/400 batches, 16 s so far, about 3.1 min left"
    # then a line every 15 s (30 batches), across the two splits
    assert lines[-1] == "evaluating: 393/400 batches, 3.3 min so far, about 4 s left"
    assert len(lines) == 14


def test_a_runs_first_loss_estimate_is_said_before_its_first_batch(clock, capsys):
    # train.py's first evaluation of a process: its first batch (the warm-up, half a minute on a busy CPU) comes
    # after a line saying what starts; nanoGPT's `step N:` line and the estimate's numbers are unchanged
    said_before = []

    class FirstBatchLooks(SlowModel):
        def forward(self, X, Y):
            if not said_before:
                said_before.append(capsys.readouterr().out)
            return super().forward(X, Y)

    loaders = {'train': CountingLoader(), 'val': CountingLoader()}
    losses = train.estimate_loss(FirstBatchLooks(clock, 0.01), loaders, 200, torch.autocast('cpu', enabled=False),
                                 SINGLE, announce=" (the train and val loss at iter 0)")
    assert losses == {'train': 99.5, 'val': 99.5}
    assert said_before == ["evaluating: 400 batches (the train and val loss at iter 0), starting\n"]
    assert capsys.readouterr().out == ""  # quick: nothing more
    rank1 = DistInfo(under_torchrun=False, rank=1, local_rank=1, world_size=1, device='cpu')
    train.estimate_loss(SlowModel(clock, 0.5), loaders, 200, torch.autocast('cpu', enabled=False), rank1,
                        announce=" (the train and val loss at iter 0)")
    assert capsys.readouterr().out == ""


def test_begin_says_what_starts_on_the_rank_that_shows(capsys):
    assert progress.Progress(40, "evaluating", "batches").begin(" of x").total == 40
    progress.Progress(40, "evaluating", "batches", show=False).begin()
    assert capsys.readouterr().out == "evaluating: 40 batches of x, starting\n"


def test_a_quick_loss_estimate_and_other_ranks_stay_silent(clock, capsys):
    estimate(clock, 0.01)
    rank1 = DistInfo(under_torchrun=False, rank=1, local_rank=1, world_size=1, device='cpu')
    estimate(clock, 0.5, dist_info=rank1)
    assert capsys.readouterr().out == ""


def tiny_model(block_size=8, vocab_size=5):
    torch.manual_seed(0)
    config = GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=block_size, vocab_size=vocab_size)
    return GPT(config)


def test_thread_timing_is_announced_before_it_starts(capsys):
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    loader = CountingLoader()
    loader.next_batch = lambda: (torch.zeros(2, 8, dtype=torch.long),) * 2
    model = tiny_model()
    capsys.readouterr()
    try:
        retuner = choose_threads(model, loader, torch.autocast('cpu', enabled=False), SINGLE)
        out = capsys.readouterr().out.splitlines()
        assert out[0].startswith("timing CPU thread counts 2, 1 for this model (4 forward/backward")
        chosen = torch.get_num_threads()
        assert out[1].startswith(f"using {chosen} CPU threads (fwd+bwd ms: 2 threads ")
        assert len(out) == 2 and retuner.candidates == [2, 1]
        rank1 = DistInfo(under_torchrun=False, rank=1, local_rank=1, world_size=1, device='cpu')
        choose_threads(model, loader, torch.autocast('cpu', enabled=False), rank1)
        assert capsys.readouterr().out == ""
    finally:
        torch.set_num_threads(threads)


def test_a_model_too_large_to_time_is_rechecked_on_its_running_iterations(monkeypatch, capsys):
    """ Past max_flops nothing is timed before training (nothing said), but the re-checks still run, the first
    after FIRST_RECHECK iterations: on busy cores a thread per core can stall a GPT-2-vocabulary model too. """
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    loader = CountingLoader()
    loader.next_batch = lambda: (torch.zeros(2, 8, dtype=torch.long),) * 2
    monkeypatch.setattr(machine, 'tune_cpu_threads', lambda *args, **kwargs: (2, {}))
    model = tiny_model()
    capsys.readouterr()
    try:
        retuner = choose_threads(model, loader, torch.autocast('cpu', enabled=False), SINGLE)
        assert capsys.readouterr().out == "" and torch.get_num_threads() == 2
        assert retuner.candidates == [2, 1] and retuner.since_round == retuner.interval - machine.FIRST_RECHECK
        torch.set_num_threads(1)  # one candidate: nothing to re-check
        assert choose_threads(model, loader, torch.autocast('cpu', enabled=False), SINGLE) is None
    finally:
        torch.set_num_threads(threads)


# -----------------------------------------------------------------------------
# sample.py: samples as they finish, progress on stderr, the thread count

def test_samples_are_printed_in_order_as_they_finish(capsys):
    from sample import BatchPrinter
    tok = CharTokenizer.from_text("abc.")
    stop = tok.encode(".")[0]
    a, b = tok.encode("ab")
    printer = BatchPrinter(tok, tok.encode("c"), num_samples=3, stop_token=stop)
    printed = []
    # sample 1 finishes first, but waits for sample 0; sample 2 never draws the stop token
    for row in ([a, a, a], [b, stop, b], [stop, stop, a], [stop, stop, b]):
        printer.add(torch.tensor(row))
        printed.append(capsys.readouterr().out)
    printer.finish()
    printed.append(capsys.readouterr().out)
    assert printed == ["", "", f"cab\n{SEP}\nca\n{SEP}\n", "", f"cabab\n{SEP}\n"]
    assert printer.generated() == [[a, b], [a], [a, b, a, b]]


@pytest.fixture
def char_out_dir(tmp_path):
    tok = CharTokenizer.from_text("abcd\n")
    save_test_checkpoint(tiny_model(block_size=16, vocab_size=tok.vocab_size), tok.meta(),
                         tmp_path / "ckpt.pt")
    return tmp_path


def slow_sampling(clock, monkeypatch):
    """ sample.py, whose every token step takes a (fake) second. """
    import sample
    steps = sample.generate_stream

    def slow_stream(*args, **kwargs):
        for tokens in steps(*args, **kwargs):
            clock.now += 1.0
            yield tokens
    monkeypatch.setattr(sample, 'generate_stream', slow_stream)
    return sample


def test_a_long_batch_of_samples_reports_on_stderr(char_out_dir, clock, monkeypatch, capsys):
    sample = slow_sampling(clock, monkeypatch)  # 40 s for the batch
    threads = torch.get_num_threads()
    try:
        run_script(sample, monkeypatch, f"--out_dir={char_out_dir}", "--device=cpu",
                   "--num_samples=3", "--max_new_tokens=40", "--start=ab", "--num_threads=1")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.startswith("sampling 3 samples")]
    batch = "sampling 3 samples in one batch: "
    assert err == [batch + "40 tokens each, about 40 s",
                   batch + "17/40 tokens each, 17 s so far, about 23 s left",
                   batch + "32/40 tokens each, 32 s so far, about 8 s left"]
    # stdout is what it was: each sample, then the separator line
    samples = captured.out.split("number of parameters", 1)[1].split("\n", 1)[1].split(SEP + "\n")
    assert len(samples) == 4 and samples[-1] == ""
    assert all(s.startswith("ab") and len(s) == 2 + 40 + 1 for s in samples[:-1])


def test_one_sample_streams_without_progress_lines(char_out_dir, clock, monkeypatch, capsys):
    sample = slow_sampling(clock, monkeypatch)
    run_script(sample, monkeypatch, f"--out_dir={char_out_dir}", "--device=cpu", "--num_samples=1",
               "--max_new_tokens=40", "--start=ab")
    captured = capsys.readouterr()
    # the tokens themselves show the progress
    assert "tokens each" not in captured.err
    assert captured.out.endswith(SEP + "\n")
