"""train.py: learning, exact resume, atomic checkpoints, DDP on CPU, init_from, compile, wandb, NaN and signals."""
import functools
import json
import os
import re
import signal
import time

import pytest
import torch

import train
from helpers import COMPILE, TORCHRUN, iter_losses, run_python, start_python, train_args, train_one_and_two_ranks
from helpers import TINY_VOCAB as VOCAB
from model import GPT, NANOGPT_MODEL_ARGS, GPTConfig
from nanogpt_plus import checkpoint as checkpoint_mod
from nanogpt_plus.checkpoint import load_checkpoint, save_checkpoint
from nanogpt_plus.dataset import read_dataset_meta
from nanogpt_plus.errors import EXIT_INTERRUPTED, UserError

tiny_args = functools.partial(train_args, dropout=0.1, num_threads=1)  # fixed threads: bitwise runs


def run_train(capsys, args):
    train.main(args)
    out = capsys.readouterr().out
    return out



def eval_losses(out):
    return [(int(m.group(1)), float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^step (\d+): train loss (\S+), val loss (\S+)$", out, re.M)]


def test_loss_decreases_and_nanogpt_lines(dataset, tmp_path, capsys):
    out = run_train(capsys, tiny_args(dataset, tmp_path, max_iters=24, eval_interval=12, lr_decay_iters=24))
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


def test_checkpoint_is_nanogpt_compatible_and_weights_only(dataset, tmp_path, capsys):
    run_train(capsys, tiny_args(dataset, tmp_path))
    ckpt = torch.load(tmp_path / "ckpt.pt", map_location="cpu", weights_only=True)
    for key in ("model", "optimizer", "model_args", "iter_num", "best_val_loss", "config"):
        assert key in ckpt
    assert tuple(sorted(ckpt["model_args"])) == tuple(sorted(NANOGPT_MODEL_ARGS))
    assert not any(k.startswith("_orig_mod.") or k.startswith("module.") for k in ckpt["model"])
    # the final save: 13 steps done
    assert ckpt["iter_num"] == 13 and ckpt["config"]["dataset"] == dataset
    assert ckpt["tokenizer"]["kind"] == "char" and ckpt["tokenizer"]["vocab_size"] == VOCAB
    # what nanoGPT's sample.py does with it: GPTConfig(**model_args), strip prefixes, load_state_dict
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    summary = json.load(open(tmp_path / "ckpt.json"))
    assert summary["iter_num"] == 13 and summary["model_args"]["n_layer"] == 2


def test_resume_is_exact(dataset, tmp_path, capsys):
    """ Stopped at its final checkpoint and resumed further: the same iteration losses, bitwise (CPU, fp32, eager). """
    full = run_train(capsys, tiny_args(dataset, tmp_path / "full", max_iters=12))
    part1 = run_train(capsys, tiny_args(dataset, tmp_path / "split", max_iters=6))
    part2 = run_train(capsys, tiny_args(dataset, tmp_path / "split", max_iters=12, init_from="resume"))
    reference = iter_losses(full)
    # the final checkpoint holds 7 steps: resumes at 7
    resumed = {**iter_losses(part1), **iter_losses(part2)}
    assert min(iter_losses(part2)) == 7
    assert resumed == reference
    assert eval_losses(part2)[-1] == eval_losses(full)[-1]


def test_atomic_checkpoint_survives_crash_mid_save(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=10))
    good = {"model": model.state_dict(), "model_args": model.config.model_args(), "iter_num": 1}
    save_checkpoint(good, str(path))
    real_save = torch.save

    def crashing_save(obj, f):
        real_save(obj, f)
        f.write(b"partial")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(checkpoint_mod.torch, "save", crashing_save)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(dict(good, iter_num=2), str(path))
    monkeypatch.undo()
    assert load_checkpoint(str(path))["iter_num"] == 1  # the old checkpoint is intact
    assert sorted(os.listdir(tmp_path)) == ["ckpt.json", "ckpt.pt"]  # no temp files left behind


def test_corrupt_and_unsafe_checkpoints_are_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="corrupt"):
        load_checkpoint(str(path))

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))
    torch.save({"model": {}, "model_args": {}, "x": Evil()}, path)
    with pytest.raises(UserError, match=r"pickled Python object \(\S*system\) that loading could run as code") as e:
        load_checkpoint(str(path))
    # our words, not torch's advice to switch the safety off
    assert "weights_only" not in str(e.value)
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(UserError, match="no checkpoint at"):
        load_checkpoint(str(tmp_path / "missing.pt"))


def test_nan_loss_stops_without_overwriting(dataset, tmp_path, capsys, monkeypatch):
    run_train(capsys, tiny_args(dataset, tmp_path, max_iters=6))
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


def test_init_from_local_hf_dir(dataset, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel
    hf_dir = tmp_path / "hf"
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=VOCAB + 5)
    GPT2LMHeadModel(config).save_pretrained(hf_dir)
    args = tiny_args(dataset, tmp_path / "out", init_from=str(hf_dir), max_iters=6, eval_interval=3)
    # a plain Hugging Face directory is a GPT-2 BPE model: on a character dataset its ids would mean other tokens
    with pytest.raises(UserError, match=r"tokenized with char \(20 tokens\), the model .* with gpt2 \(50,257 tokens\)"):
        train.main(args)
    # as export_hf.py writes
    (hf_dir / "nanogpt_tokenizer.json").write_text(json.dumps(read_dataset_meta(dataset)))
    out = run_train(capsys, args)
    assert "Initializing from OpenAI GPT-2 weights" in out
    ckpt = load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))
    assert ckpt["model_args"]["block_size"] == 16  # cropped from 32
    assert ckpt["model_args"]["vocab_size"] == VOCAB + 5 and ckpt["model_extra_args"]["gelu"] == "tanh"
    evals = eval_losses(out)
    assert evals[-1][2] < evals[0][2]


def test_init_from_exported_char_model_keeps_its_tokenizer(dataset, tmp_path, capsys):
    """ A character model exported by export_hf.py and trained further stays a character model: the
    checkpoint's tokenizer is the exported one, not GPT-2's (else sample.py would decode it as BPE). """
    from nanogpt_plus.hf_export import export
    meta = read_dataset_meta(dataset)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=VOCAB))
    export(model, meta, str(tmp_path / "hf"))
    args = tiny_args(dataset, tmp_path / "out", init_from=str(tmp_path / "hf"), max_iters=3, eval_interval=3)
    run_train(capsys, args)
    ckpt = load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))
    assert ckpt["tokenizer"]["kind"] == "char" and ckpt["tokenizer"]["stoi"] == meta["stoi"]
    assert json.load(open(tmp_path / "out" / "ckpt.json"))["tokenizer"]["kind"] == "char"


def test_init_from_a_training_out_dir_starts_at_iter_0_from_its_weights(dataset, tmp_path, capsys):
    """ init_from=<a train.py out_dir>: its weights and tokenizer, but a new run (iteration 0, new optimizer). """
    run_train(capsys, tiny_args(dataset, tmp_path / "first", max_iters=6))
    second = run_train(capsys, tiny_args(dataset, tmp_path / "second", init_from=str(tmp_path / "first"),
                                         max_iters=3, eval_interval=3))
    assert f"Initializing from the weights in {tmp_path / 'first' / 'ckpt.pt'} (training starts at iter 0)" in second
    assert min(iter_losses(second)) == 0 and "Resuming training" not in second
    # the same weights evaluated on the same fixed batches: those of the first run's final checkpoint (after 7
    # steps), which a resume of it evaluates at iter 7
    final = run_train(capsys, tiny_args(dataset, tmp_path / "first", init_from="resume", max_iters=7, eval_interval=7))
    assert eval_losses(final)[0][0] == 7 and eval_losses(second)[0][1:] == eval_losses(final)[0][1:]
    source, ckpt = (load_checkpoint(str(tmp_path / d / "ckpt.pt")) for d in ("first", "second"))
    assert ckpt["iter_num"] == 4 and ckpt["tokenizer"] == source["tokenizer"]
    assert ckpt["model_args"] == source["model_args"]


def test_scratch_is_a_new_model_even_beside_a_file_named_scratch(dataset, tmp_path, capsys, monkeypatch):
    """ init_from='scratch' never reads a file of that name in the working directory (as init_model doesn't). """
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scratch").write_bytes(b"not a checkpoint")
    out = run_train(capsys, tiny_args(dataset, tmp_path / "out", max_iters=1, eval_interval=1))
    assert "Initializing a new model from scratch" in out and "Initializing from the weights" not in out


def test_resume_from_nanogpt_checkpoint(dataset, tmp_path, capsys):
    """ A checkpoint as nanoGPT writes it (compiled: '_orig_mod.' keys; no loader/RNG/tokenizer state). """
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=VOCAB, bias=False))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    ckpt = {"model": {"_orig_mod." + k: v for k, v in model.state_dict().items()}, "optimizer": optimizer.state_dict(),
            "model_args": model.config.model_args(), "iter_num": 6, "best_val_loss": torch.tensor(3.0),
            # its tokenizer: the meta of the dataset it names, as nanoGPT's
            "config": {"dataset": dataset}}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    train.main(tiny_args(dataset, tmp_path, init_from="resume", max_iters=8))
    captured = capsys.readouterr()
    assert "no data-loader state" in captured.err
    assert iter_losses(captured.out).keys() == {6, 7, 8}


def test_ddp_two_processes_equals_one_with_double_accumulation(dataset, tmp_path):
    common = tiny_args(dataset, tmp_path, gradient_accumulation_steps=4, max_iters=6, eval_interval=6, dropout=0.0)
    one, two = train_one_and_two_ranks(common, tmp_path, steps=7)
    assert "tokens per iteration will be: 256" in two.stdout
    sd1 = load_checkpoint(str(tmp_path / "one" / "ckpt.pt"))["model"]
    sd2 = load_checkpoint(str(tmp_path / "two" / "ckpt.pt"))["model"]
    for k in sd1:
        torch.testing.assert_close(sd1[k], sd2[k], atol=3e-4, rtol=1e-3)  # Adam amplifies fp noise
    # gradient accumulation that doesn't divide by the number of processes runs the rounded-up share, said once
    odd = run_python(TORCHRUN + ["--standalone", "--nproc_per_node=2", "train.py", *common, "--max_iters=1",
                                 "--gradient_accumulation_steps=3", f"--out_dir={tmp_path / 'odd'}"], timeout=300)
    assert odd.returncode == 0, odd.stderr[-2000:]
    said = "gradient_accumulation_steps=3 does not split among 2 processes: each runs 2, so an iteration is 4"
    assert odd.stdout.count(said) == 1 and "tokens per iteration will be: 256" in odd.stdout


def test_sigint_saves_and_resumes(dataset, tmp_path):
    args = tiny_args(dataset, tmp_path, max_iters=100000, lr_decay_iters=100000, eval_interval=100000)
    proc = start_python(["-u", "train.py", *args])
    seen = ""
    deadline = time.time() + 120
    while time.time() < deadline:
        line = proc.stdout.readline()
        seen += line
        if line.startswith("iter 3:"):
            break
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    seen += out
    # "interrupted, resumable" for a scheduler
    assert proc.returncode == EXIT_INTERRUPTED == 75, err[-2000:]
    assert "finishing this iteration" in err
    m = re.search(r"saving checkpoint to .* \(interrupted at iter (\d+)\)", seen)
    assert m, seen[-2000:]
    stopped_at = int(m.group(1))
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["iter_num"] == stopped_at
    resumed = run_python(["train.py", *args, "--init_from=resume",
                              f"--max_iters={stopped_at + 2}"], timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert min(iter_losses(resumed.stdout)) == stopped_at


def test_compile_on_cpu(dataset, tmp_path, capsys):
    pytest.importorskip("torch._inductor")
    if os.environ.get("ATEN_CPU_CAPABILITY") == "default":
        # inductor still emits vectorised C++ (at::vec) that the forced scalar build can't compile: a
        # PyTorch limitation of that debugging switch, not of train.py
        pytest.skip("torch.compile's CPU code does not build under ATEN_CPU_CAPABILITY=default")
    out = run_train(capsys, tiny_args(dataset, tmp_path, **COMPILE, max_iters=3, eval_interval=3, dropout=0.0))
    assert "compiling the model" in out
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert not any("_orig_mod" in k for k in ckpt["model"])
    assert eval_losses(out)[-1][2] < eval_losses(out)[0][2]


def test_wandb_offline(dataset, tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_train(capsys, tiny_args(dataset, tmp_path, wandb_log=True, max_iters=2, eval_interval=2))
    runs = [d for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run")]
    assert runs, os.listdir(tmp_path / "wandb")


def test_wandb_resume_continues_its_run_and_a_new_run_gets_a_new_one(dataset, tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")

    def wandb_ids():
        # offline-run-<date>_<time>-<id>[-<n>], one directory per wandb.init (-n: the same id in the same second);
        # two runs started in the same second sort by id, not by start, so compare counts, not order
        return sorted(d.split("-")[3] for d in os.listdir(tmp_path / "wandb") if d.startswith("offline-run"))
    run_train(capsys, tiny_args(dataset, tmp_path, wandb_log=True, max_iters=2, eval_interval=2))
    first = load_checkpoint(str(tmp_path / "ckpt.pt"))["wandb_id"]
    assert wandb_ids() == [first]
    # preempted and resumed (twice, the second by auto_resume): the same wandb run each time
    run_train(capsys, tiny_args(dataset, tmp_path, wandb_log=True, max_iters=4, eval_interval=2, init_from="resume"))
    run_train(capsys, tiny_args(dataset, tmp_path, wandb_log=True, max_iters=6, eval_interval=2, auto_resume=True))
    assert load_checkpoint(str(tmp_path / "ckpt.pt"))["wandb_id"] == first
    assert wandb_ids() == [first] * 3
    # started over: a new run, under a new id
    run_train(capsys, tiny_args(dataset, tmp_path, wandb_log=True, max_iters=2, eval_interval=2, overwrite=True))
    second = load_checkpoint(str(tmp_path / "ckpt.pt"))["wandb_id"]
    assert second != first and wandb_ids() == sorted([first] * 3 + [second])


def test_plot_metrics(dataset, tmp_path, capsys):
    run_train(capsys, tiny_args(dataset, tmp_path, max_iters=4, eval_interval=2))
    r = run_python(["scripts/plot_metrics.py", f"--out_dir={tmp_path}"], timeout=120)
    assert r.returncode == 0, r.stderr
    assert "plotted 5 iterations and 3 evaluations" in r.stdout
    assert (tmp_path / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lr_schedule():
    from nanogpt_plus.optimizer import LRSchedule
    schedule = LRSchedule(learning_rate=1e-3, warmup_iters=10, lr_decay_iters=100, min_lr=1e-4)
    lrs = [schedule.rate(it) for it in range(120)]
    # linear warmup
    assert lrs[0] == pytest.approx(1e-3 / 11) and lrs[9] == pytest.approx(1e-3 * 10 / 11)
    assert lrs[10] == pytest.approx(1e-3)  # cosine starts at the max
    assert lrs[55] == pytest.approx((1e-3 + 1e-4) / 2)  # halfway through the decay
    assert all(a >= b for a, b in zip(lrs[10:101], lrs[11:101]))  # monotone decay
    assert lrs[100] == pytest.approx(1e-4) and lrs[119] == 1e-4
    no_decay = LRSchedule(learning_rate=1e-3, warmup_iters=10, lr_decay_iters=10, min_lr=1e-4)
    assert no_decay.rate(10) == 1e-4  # no decay phase: no division by zero
