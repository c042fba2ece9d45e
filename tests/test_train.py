"""
train.py: learning and nanoGPT's lines, an exact resume, bits per byte beside the losses, activation checkpointing,
compile, threads retuned only in auto mode, a NaN or an out-of-memory stopping without overwriting the checkpoint,
and its one-line errors.
"""
import json
import math
import os
import re

import numpy as np
import pytest
import torch

import train
from helpers import (
    COMPILE,
    assert_losses_close,
    eval_losses,
    exit_code,
    iter_losses,
    one_error_line,
    one_line,
    tiny_args,
    train_args,
    train_out,
    write_split_files,
)
from model import GPT
from nanogpt_plus import machine
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.errors import UserError
from nanogpt_plus.machine import ThreadRetuner
from nanogpt_plus.metrics import read_metrics
from nanogpt_plus.runtime import run_main


def test_loss_decreases_and_nanogpt_lines(dataset, tmp_path, capsys):
    out = train_out(capsys, tiny_args(dataset, tmp_path, max_iters=24, eval_interval=12, lr_decay_iters=24))
    assert "tokens per iteration will be: 128" in out  # 2 accumulation x 4 batch x 16 block
    evals = eval_losses(out)
    assert [e[0] for e in evals] == [0, 12, 24]
    assert evals[-1][2] < evals[0][2] - 1.0  # val loss fell by more than a nat
    # MFU: n/a for a process's first 5 iterations (nanoGPT prints a -100.00% placeholder), then a measured figure
    for it in range(5):
        assert re.search(rf"^iter {it}: loss \d+\.\d{{4}}, time \d+\.\d{{2}}ms, mfu n/a$", out, re.M)
    m = re.search(r"^iter 23: loss \d+\.\d{4}, time \d+\.\d{2}ms, mfu (\d+\.\d{2})%$", out, re.M)
    assert m and float(m.group(1)) > 0
    assert f"saving checkpoint to {tmp_path}" in out
    # the metrics file: one JSON line per logged iteration and per evaluation
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    iters = [r for r in records if r["type"] == "iter"]
    assert len(iters) == 25 and {"iter", "loss", "lr", "grad_norm", "tokens_per_sec", "mfu", "time_ms"} <= set(iters[0])
    assert iters[4]["mfu"] is None and iters[23]["mfu"] > 0 and all(r["tokens_per_sec"] > 0 for r in iters)
    assert len([r for r in records if r["type"] == "eval"]) == 3


def test_resume_is_exact(dataset, tmp_path, capsys):
    """ Stopped at its final checkpoint and resumed further: the same iteration losses, bitwise (CPU, fp32, eager). """
    full = train_out(capsys, tiny_args(dataset, tmp_path / "full", max_iters=12))
    part1 = train_out(capsys, tiny_args(dataset, tmp_path / "split", max_iters=6))
    part2 = train_out(capsys, tiny_args(dataset, tmp_path / "split", max_iters=12, init_from="resume"))
    reference = iter_losses(full)
    # the final checkpoint holds 7 steps: resumes at 7
    resumed = {**iter_losses(part1), **iter_losses(part2)}
    assert min(iter_losses(part2)) == 7
    assert resumed == reference
    assert eval_losses(part2)[-1] == eval_losses(full)[-1]


def test_nan_loss_stops_without_overwriting(dataset, tmp_path, capsys, monkeypatch):
    train_out(capsys, tiny_args(dataset, tmp_path, max_iters=6))
    calls = {"n": 0}
    real_forward = GPT.forward

    def poisoned_forward(self, idx, targets=None, kv_cache=None):
        logits, loss = real_forward(self, idx, targets, kv_cache)
        if self.training:
            calls["n"] += 1
            if calls["n"] > 4 and loss is not None:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned_forward)
    with pytest.raises(UserError, match=r"loss is nan at iter \d+; stopping without saving"):
        train.main(tiny_args(dataset, tmp_path, max_iters=12, init_from="resume"))
    # the last good checkpoint (the first run's final one, after 7 steps) is still there and finite
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert ckpt["iter_num"] == 7
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_missing_dataset_and_resume_errors(tmp_path):
    with pytest.raises(UserError, match=r"no token file at .*run python data/nope/prepare.py"):
        train.main(["--dataset=nope", f"--out_dir={tmp_path}", "--device=cpu", "--compile=False"])
    with pytest.raises(UserError, match="there is no checkpoint"):
        train.main([f"--out_dir={tmp_path / 'empty'}", "--init_from=resume", "--device=cpu"])


def test_compile_on_cpu(dataset, tmp_path, capsys):
    pytest.importorskip("torch._inductor")
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        # inductor still emits vectorised C++ (at::vec) that the forced scalar build can't compile: a
        # PyTorch limitation of that debugging switch, not of train.py
        pytest.skip("torch.compile's CPU code does not build under ATEN_CPU_CAPABILITY=default")
    out = train_out(capsys, tiny_args(dataset, tmp_path, **COMPILE, max_iters=3, eval_interval=3, dropout=0.0))
    assert "compiling the model" in out
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert not any("_orig_mod" in k for k in ckpt["model"])
    assert eval_losses(out)[-1][2] < eval_losses(out)[0][2]


def decoded_bytes_per_token(tok, path):
    """ The split's text, decoded whole, in UTF-8 bytes per token: the reference. """
    ids = np.fromfile(path, dtype=np.uint16)
    return len(tok.decode_bytes(ids.tolist())) / len(ids)


@pytest.mark.parametrize('kind', ['char', 'char_pkl', 'gpt2', 'bpe'])
def test_metrics_bpb_is_loss_over_ln2_and_bytes_per_token(two_datasets, kind, tmp_path, capsys, request):
    # bpe: your own byte-level BPE (vocab 512; its tokenizer.json beside the data)
    tok, dataset = request.getfixturevalue('bpe512') if kind == 'bpe' else two_datasets[kind][::-1]
    out = tmp_path / kind
    train.main(train_args(dataset, out, max_iters=4, eval_interval=2, lr_decay_iters=4,
                          n_embd=16, block_size=16))
    printed = capsys.readouterr().out
    records = read_metrics(str(out / 'metrics.jsonl'))
    expected = {split: decoded_bytes_per_token(tok, os.path.join(dataset, f'{split}.bin'))
                for split in ('train', 'val')}
    measured, = [r for r in records if r['type'] == 'bytes_per_token']
    assert measured['train'] == pytest.approx(expected['train'], rel=1e-12)
    assert measured['val'] == pytest.approx(expected['val'], rel=1e-12)
    assert measured['train_whole'] and measured['val_whole']
    # multi-byte characters; BPE words
    assert expected['train'] > (1.0 if kind.startswith('char') else 2.0)
    evals = [r for r in records if r['type'] == 'eval']
    assert [r['iter'] for r in evals] == [0, 2, 4]
    for r in evals:
        for split in ('train', 'val'):
            assert r[f'{split}_bpb'] == pytest.approx(r[f'{split}_loss'] / math.log(2) / expected[split],
                                                      rel=1e-12)
    # nanoGPT's line is as it was
    assert f"step 2: train loss {evals[1]['train_loss']:.4f}, val loss {evals[1]['val_loss']:.4f}\n" in printed
    assert not [line for line in printed.splitlines() if line.startswith(('step', 'iter')) and 'bpb' in line]


def test_train_with_activation_checkpointing(dataset, tmp_path, capsys):
    train.main(tiny_args(dataset, tmp_path / 'plain', max_iters=6, eval_interval=6))
    plain = iter_losses(capsys.readouterr().out)
    train.main(tiny_args(dataset, tmp_path / 'ac', max_iters=6, eval_interval=6, activation_checkpointing=True))
    recomputed = iter_losses(capsys.readouterr().out)
    assert_losses_close(recomputed, plain, range(7))
    assert 'activation_checkpointing' not in load_checkpoint(str(tmp_path / 'ac' / 'ckpt.pt'))['model_extra_args']


# -----------------------------------------------------------------------------
# out of memory

def test_out_of_memory_is_one_message_and_keeps_the_checkpoint(dataset, tmp_path, capsys, monkeypatch):
    train.main(tiny_args(dataset, tmp_path, max_iters=3, eval_interval=3))
    saved = (tmp_path / 'ckpt.pt').read_bytes()
    calls = {'n': 0}
    real_forward = GPT.forward

    def forward(self, idx, targets=None, kv_cache=None):
        calls['n'] += self.training
        if calls['n'] > 3:  # the second micro-step of the second iteration after the resume
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")
        return real_forward(self, idx, targets, kv_cache)
    monkeypatch.setattr(GPT, 'forward', forward)
    capsys.readouterr()
    args = tiny_args(dataset, tmp_path, max_iters=12, eval_interval=100, init_from='resume')
    with pytest.raises(SystemExit) as exit_info:
        run_main(lambda: train.main(args))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    # the resume starts at iter 4, the final checkpoint's (max_iters + 1); the failing forward is in iter 5
    assert len(err) == 1 and err[0].startswith(f"error: out of GPU memory at iter 5; the last checkpoint, "
                                               f"{tmp_path / 'ckpt.pt'}, is kept")
    for fix in ('--batch_size', '--gradient_accumulation_steps', '--activation_checkpointing=True',
                '--parallelism=fsdp', '--block_size', '--init_from=resume'):
        assert fix in err[0]
    assert (tmp_path / 'ckpt.pt').read_bytes() == saved


def test_train_retunes_threads_only_in_auto_mode(tiny_dataset, tmp_path, monkeypatch):
    import train

    class Recording(ThreadRetuner):
        def observe(self, dt):
            self.seen.append((dt, torch.get_num_threads()))
            return super().observe(dt)

    made = []

    def make(candidates, first=None):
        made.append(Recording(candidates, interval=2, probe=1))
        made[-1].seen, made[-1].first = [], first
        return made[-1]

    monkeypatch.setattr(machine, 'ThreadRetuner', make)  # what train.py's thread choice makes
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        args = [f'--dataset={tiny_dataset}', '--device=cpu', '--n_layer=1', '--n_head=2', '--n_embd=16',
                '--block_size=8', '--batch_size=2', '--max_iters=12', '--eval_interval=5', '--eval_iters=1',
                '--log_interval=100', '--compile=False', '--always_save_checkpoint=False']
        train.main(args + ['--num_threads=0', f'--out_dir={tmp_path}/auto'])
        assert len(made) == 1 and made[0].candidates == [2, 1] and made[0].first == machine.FIRST_RECHECK
        # iterations 0..12 ran; 0, 5 and 10 evaluated (their time is not the training step's), so 10 were seen,
        # with real times, and both thread counts were tried during training
        assert len(made[0].seen) == 10 and all(dt > 0 for dt, _ in made[0].seen)
        assert {n for _, n in made[0].seen} == {1, 2}
        made.clear()
        torch.set_num_threads(2)
        train.main(args + ['--num_threads=1', f'--out_dir={tmp_path}/fixed'])
        assert made == [] and torch.get_num_threads() == 1  # a fixed count is never changed
    finally:
        torch.set_num_threads(before)


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize("arg, message", [
    ("--seed=18446744073709551616", "seed must be >= 0 and <= 4294967295"),
    ("--block_size=5000 --n_layer=2000", "GiB of causal masks"),
])
def test_settings_that_crashed_are_one_line(dataset, tmp_path, arg, message):
    assert message in one_line(train_args(dataset, tmp_path / 'out') + arg.split())
    assert not (tmp_path / 'out').exists()


@pytest.mark.usefixtures('one_thread')
def test_a_missing_dataset_is_said_before_the_memory_a_model_of_it_needs(tmp_path, capsys, monkeypatch):
    """ The GPT-2 defaults on a dataset not prepared: its prepare.py to run, not the memory of a guessed vocabulary. """
    monkeypatch.setenv('NANOGPT_FREE_MEMORY_GIB', '1')  # the 124M model's first step can't fit
    monkeypatch.chdir(tmp_path)
    args = ['--dataset=no_such_dataset', '--device=cpu', '--compile=False']
    assert exit_code(lambda: train.main(args)) == 2
    line = one_error_line(capsys)
    assert line == ("error: no token file at data/no_such_dataset/train.bin; run python "
                    "data/no_such_dataset/prepare.py first")
    assert os.listdir(tmp_path) == []  # no out_dir (nor anything else)
    # a prepared one: then the memory is what to change
    write_split_files(tmp_path / 'data' / 'mine', np.arange(1000) % 20)
    assert exit_code(lambda: train.main(['--dataset=mine', '--device=cpu', '--compile=False'])) == 2
    assert "GiB of memory" in one_error_line(capsys)
    assert sorted(os.listdir(tmp_path)) == ['data']


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize('best', [float('nan'), -1.0])
def test_a_checkpoint_whose_best_val_loss_cant_be_beaten_resumes_with_no_best(best, dataset, tmp_path, capsys):
    """ NaN (or a negative loss) as the best so far: said in one line, and the next evaluation is the best again. """
    settings = dict(always_save_checkpoint=False, eval_interval=3, lr_decay_iters=9)
    train.main(tiny_args(dataset, tmp_path, max_iters=3, **settings))
    ckpt = load_checkpoint(str(tmp_path / 'ckpt.pt'))
    assert ckpt['iter_num'] == 4 and math.isfinite(ckpt['best_val_loss'])
    ckpt['best_val_loss'] = best
    torch.save(ckpt, tmp_path / 'edited.pt')  # (not over the file ckpt's tensors are mapped from)
    os.replace(tmp_path / 'edited.pt', tmp_path / 'ckpt.pt')
    best_before = (tmp_path / 'ckpt_best.pt').read_bytes()
    capsys.readouterr()
    train.main(tiny_args(dataset, tmp_path, max_iters=6, init_from='resume', **settings))
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if 'best_val_loss' in line]
    assert notes == [f"note: {tmp_path / 'ckpt.pt'} records best_val_loss={best}, which no val loss can improve on; "
                     f"this run starts with no best, so its next evaluation counts as the best"]
    # iteration 6's evaluation was saved as the best: ckpt_best.pt moved on, with a real loss
    saved = load_checkpoint(str(tmp_path / 'ckpt_best.pt'))
    assert (tmp_path / 'ckpt_best.pt').read_bytes() != best_before and saved['iter_num'] == 6
    assert 0 < saved['best_val_loss'] < 10
    assert load_checkpoint(str(tmp_path / 'ckpt.pt'))['iter_num'] == 7


def test_a_resume_whose_batch_cant_fit_is_refused_before_any_work(dataset, tmp_path, monkeypatch, capsys):
    """ The memory check covered new models only: a resume with --batch_size=200000 failed in the CPU's
    allocator (a traceback). Now one line, exit 2, the run's files as they were. """
    from helpers import assert_one_line_error, run, train_here
    train_here(dataset, tmp_path, max_iters=2, eval_interval=2)
    capsys.readouterr()
    before = {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)}
    monkeypatch.setenv('NANOGPT_FREE_MEMORY_GIB', '1')
    code, out, err = run("train.py", monkeypatch, capsys, *train_args(dataset, tmp_path, max_iters=4, num_threads=1),
                         "--init_from=resume", "--batch_size=200000")
    assert_one_line_error(code, err, "GiB of activations for batch_size=200000), and NANOGPT_FREE_MEMORY_GIB=1 says "
                                     "this machine has 1 GiB free")
    assert {name: (tmp_path / name).read_bytes() for name in os.listdir(tmp_path)} == before


def test_a_stop_between_micro_steps_resumes_exactly(dataset, tmp_path, capsys, monkeypatch):
    """ A signal inside a step of several micro-steps (with dropout: the RNG moves in each) stops before the
    next one and saves the state before that step: resumed, the same iteration losses, bitwise. """
    import signal

    from nanogpt_plus.errors import Interrupted
    settings = dict(max_iters=8, gradient_accumulation_steps=4, dropout=0.1, eval_interval=100, lr_decay_iters=8)
    full = train_out(capsys, tiny_args(dataset, tmp_path / "full", **settings))
    real = train.grad_sync_context
    micro_steps = []

    def signalled_at_the_second_micro_step_of_iter_3(model, sync):
        micro_steps.append(sync)
        if len(micro_steps) == 3 * 4 + 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the handler only sets the flag
        return real(model, sync)
    monkeypatch.setattr(train, "grad_sync_context", signalled_at_the_second_micro_step_of_iter_3)
    with pytest.raises(Interrupted):
        train.main(tiny_args(dataset, tmp_path / "split", **settings))
    part1 = capsys.readouterr().out
    assert len(micro_steps) == 3 * 4 + 2  # stopped before the third micro-step of iter 3
    assert "saving checkpoint to" in part1 and "(interrupted at iter 3)" in part1
    assert load_checkpoint(str(tmp_path / "split" / "ckpt.pt"))["iter_num"] == 3
    monkeypatch.setattr(train, "grad_sync_context", real)
    part2 = train_out(capsys, tiny_args(dataset, tmp_path / "split", init_from="resume", **settings))
    assert min(iter_losses(part2)) == 3
    assert {**iter_losses(part1), **iter_losses(part2)} == iter_losses(full)
