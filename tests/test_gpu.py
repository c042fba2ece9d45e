"""
The CUDA paths (a topic across rooms: what needs a GPU), run by scripts/gpu_check.sh on a machine with a GPU
(skipped without one, see conftest.py), in the configuration users run: train.py's defaults on CUDA (dtype=auto,
compile on) with bf16 and fp16 + GradScaler, fused AdamW, nccl DDP and FSDP (+ compile, and fp16 under FSDP) with 1
process, a resume on CUDA, KV-cache sampling in fp32 and under bf16 autocast, bench.py's MFU against the GPU's own
peak, activation checkpointing's lower peak, and a real out-of-memory as one line.

With 2+ GPUs, the multi-rank paths on K = min(GPUs, 4) nccl ranks (the *_on_k_ranks tests; each skips with "needs 2
CUDA GPUs" on fewer): DDP and FSDP with bf16 and compile against one rank, FSDP == DDP in fp32, a resume across
ranks, the spike guard, in-loop HellaSwag under compile, and SIGTERM to torchrun.
"""
import contextlib
import functools
import json
import os
import re
import signal
import time

import numpy as np
import pytest
import torch

import bench
import train
from helpers import (
    COMPILE,
    TINY_VOCAB,
    TORCHRUN,
    assert_losses_close,
    iter_losses,
    run_python,
    train_args,
    write_hellaswag,
)
from helpers import TINY_VOCAB as VOCAB
from model import GPT, GPTConfig
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.engine import KVCache, generate
from nanogpt_plus.machine import gpu_peak_flops
from nanogpt_plus.metrics import read_metrics
from test_distributed import start, stop, wait_for_line, workers_of
from test_periodic import HELLASWAG_LINE, SYMBOLS, hellaswag_lines, run_eval_script

# compile=None and dtype=auto: train.py's own defaults, which on CUDA compile (tests/helpers.py's TINY_RUN
# turns compile off for the CPU suite); a test that needs eager says so
args = functools.partial(train_args, n_embd=64, block_size=32, batch_size=8, max_iters=20, eval_interval=10,
                         lr_decay_iters=20, device='cuda', compile=None, dtype='auto')


def native_bf16():
    """ bf16 tensor cores (Ampere and later); V100/T4 only emulate it, and dtype=auto gives them fp16. """
    return torch.cuda.is_bf16_supported(including_emulation=False)


def torchrun_command(nproc):
    return TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}"]


def torchrun(nproc, cmd_args, timeout=300):
    """ train.py under torchrun with nproc processes, to its end, which must be a success; returns its stdout. """
    r = run_python(torchrun_command(nproc) + ["train.py", *cmd_args], timeout=timeout)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.gpu
def test_default_configuration_compiles_and_picks_the_dtype(dataset, tmp_path, capsys):
    """ What `python train.py --device=cuda` does: dtype=auto (bf16 where native, else fp16), compiled. """
    train.main(args(dataset, tmp_path))
    out = capsys.readouterr().out
    assert "compiling the model" in out
    losses = list(iter_losses(out).values())
    assert len(losses) == 21 and all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5
    ck = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert ck["provenance"]["dtype"] == ("bfloat16" if native_bf16() else "float16")
    assert not any(k.startswith("_orig_mod.") for k in ck["model"])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_mixed_precision_training_learns(dataset, tmp_path, capsys, dtype):
    if dtype == "bfloat16" and not native_bf16():
        pytest.skip("this GPU has no bfloat16")
    train.main(args(dataset, tmp_path, dtype=dtype))  # compiled, as by default
    out = capsys.readouterr().out
    assert "compiling the model" in out
    losses = list(iter_losses(out).values())
    assert len(losses) == 21 and all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.5
    assert "using fused AdamW: True" in out
    ck = load_checkpoint(str(tmp_path / "ckpt.pt"))
    if dtype == "float16":  # the GradScaler ran and its state is saved for resume
        assert ck["scaler"] and ck["scaler"]["scale"] > 0
    else:
        assert ck["scaler"] is None
    assert all(v.dtype == torch.float32 for v in ck["model"].values())  # master weights stay fp32


@pytest.mark.gpu
def test_fused_adamw_matches_foreach_on_cuda():
    torch.manual_seed(0)
    a = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=VOCAB)).cuda()
    b = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=VOCAB)).cuda()
    b.load_state_dict(a.state_dict())
    opt_a = a.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cuda')
    opt_b = b.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cuda', fused=False)
    assert opt_a.defaults['fused'] and not opt_b.defaults.get('fused')
    x = torch.randint(VOCAB, (4, 32), device='cuda')
    for _ in range(3):
        for model, opt in ((a, opt_a), (b, opt_b)):
            _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (k, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=k)


@pytest.mark.gpu
def test_compile_trains(dataset, tmp_path, capsys):
    train.main(args(dataset, tmp_path, **COMPILE, dtype='bfloat16' if native_bf16() else 'float16'))
    out = capsys.readouterr().out
    assert "compiling the model" in out
    losses = list(iter_losses(out).values())
    assert len(losses) == 21 and losses[-1] < losses[0] - 0.5
    ck = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert not any(k.startswith("_orig_mod.") for k in ck["model"])


# with 1 process nccl, DDP/FSDP wrapping, compile of the wrapped model and the sharded checkpoints still run; more
# ranks need more GPUs (the *_on_k_ranks tests below)
@pytest.mark.gpu
@pytest.mark.parametrize("parallelism, dtype", [("ddp", "auto"), ("fsdp", "auto"), ("fsdp", "float16")])
def test_nccl_one_process(dataset, tmp_path, parallelism, dtype):
    out = torchrun(1, args(dataset, tmp_path, backend='nccl', parallelism=parallelism, dtype=dtype, max_iters=10,
                           eval_interval=5))
    assert "compiling the model" in out
    losses = list(iter_losses(out).values())
    assert len(losses) == 11 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    ck = load_checkpoint(str(tmp_path / "ckpt.pt"))
    # full tensors, never DTensors
    assert all(type(v) is torch.Tensor for v in ck["model"].values())


@pytest.mark.gpu
def test_resume_on_cuda_continues_exactly(dataset, tmp_path, capsys, monkeypatch):
    """
    Stopped at its final checkpoint and resumed further on CUDA: the same iteration losses bitwise, with the CUDA RNG,
    the loader and the optimizer restored. Bitwise needs deterministic kernels: fp32, manual attention
    (flash attention's backward adds in a varying order), eager, and torch's deterministic algorithms.
    """
    # deterministic cuBLAS (read when it starts a handle)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        run = functools.partial(args, dataset, dtype='float32', attention='manual', compile=False, dropout=0.1)
        train.main(run(tmp_path / "full", max_iters=20))
        full = iter_losses(capsys.readouterr().out)
        train.main(run(tmp_path / "split", max_iters=10))
        part1 = iter_losses(capsys.readouterr().out)
        train.main(run(tmp_path / "split", max_iters=20, init_from="resume"))
        part2 = iter_losses(capsys.readouterr().out)
    finally:
        torch.use_deterministic_algorithms(was)
    assert min(part2) == 11 and len(full) == 21  # the final checkpoint of part 1 holds 11 steps
    assert {**part1, **part2} == full  # dropout 0.1: the CUDA RNG state is restored too


@pytest.mark.gpu
def test_resume_default_configuration_on_cuda(dataset, tmp_path, capsys):
    """ The same with the defaults (compiled, bf16 or fp16 + the GradScaler's saved scale): close, not bitwise. """
    train.main(args(dataset, tmp_path / "full"))
    full = iter_losses(capsys.readouterr().out)
    train.main(args(dataset, tmp_path / "split", max_iters=10))
    part1 = iter_losses(capsys.readouterr().out)
    train.main(args(dataset, tmp_path / "split", init_from="resume"))
    part2 = iter_losses(capsys.readouterr().out)
    assert min(part2) == 11 and len(full) == 21  # the final checkpoint of part 1 holds 11 steps
    # flash attention's backward (and so any two CUDA runs of it) adds in a varying order: close, not equal
    assert_losses_close(full, {**part1, **part2}, range(21), tol=2e-2)


@pytest.mark.gpu
def test_kv_cache_under_bf16_autocast_equals_full_forward():
    """ sample.py's default on CUDA: the KV cache holds bf16 keys/values, each step's logits as a full forward's. """
    if not native_bf16():
        pytest.skip("this GPU has no bfloat16")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=VOCAB)).cuda().eval()
    seq = torch.randint(VOCAB, (3, 20), device='cuda')
    ctx = torch.amp.autocast(device_type='cuda', dtype=torch.bfloat16)
    cache = KVCache(model.config.n_layer, 20)
    with torch.no_grad(), ctx:
        # prefill with the prompt, then one token a step
        cached = [model(seq[:, :5], kv_cache=cache)[0][:, -1]]
        cached += [model(seq[:, t:t + 1], kv_cache=cache)[0][:, -1] for t in range(5, 20)]
        full = [model(seq[:, :t + 1])[0][:, -1] for t in range(4, 20)]
    assert cache.k.dtype == torch.bfloat16 and cache.pos == 20
    for t, (a, b) in enumerate(zip(cached, full)):
        # bf16 keeps 8 bits of mantissa: the cached and the recomputed activations round a little apart
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2, msg=f"position {t + 4}")
    # and generation through the cache runs end to end under the autocast context, as sample.py calls it
    out = generate(model, seq[:, :5], 20, top_k=1, ctx=ctx)
    assert out.shape == (3, 25) and out.device.type == 'cuda'


@pytest.mark.gpu
def test_kv_cache_sampling_on_cuda_equals_reference():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=VOCAB)).cuda().eval()
    idx = torch.randint(VOCAB, (3, 5), device='cuda')
    fast = generate(model, idx, 20, top_k=1)  # greedy: deterministic, comparable token for token
    ref = model.generate(idx, 20, top_k=1)
    assert fast.device.type == 'cuda' and torch.equal(fast, ref)


@pytest.mark.gpu
def test_bench_on_cuda_reports_mfu_against_the_gpu(capsys, monkeypatch):
    monkeypatch.delenv('NANOGPT_PEAK_FLOPS', raising=False)
    bench.main(['--device=cuda', '--real_data=False', '--n_layer=2', '--n_head=2', '--n_embd=64', '--block_size=64',
                '--batch_size=4', '--burnin=2', '--steps=3', '--compile=False'])
    out = capsys.readouterr().out
    assert re.search(r"^time per iteration: [\d.]+ms, MFU: [\d.]+%$", out, re.M)
    dtype = torch.bfloat16 if native_bf16() else torch.float16  # what bench.py's dtype=auto picks
    m = re.search(r"of ([\d.]+) TFLOP/s peak \(cuda", out)
    assert m, out
    assert float(m.group(1)) == pytest.approx(gpu_peak_flops(torch.cuda.get_device_name(), dtype) / 1e12, rel=1e-3)
    assert "peak CUDA memory allocated" in out


# -----------------------------------------------------------------------------
# several GPUs: the multi-rank paths over nccl on K ranks; each test skips ("needs 2 CUDA GPUs") with fewer GPUs

# 4 ranks at most: 3 and 4 already split the batches and HellaSwag's examples unevenly and shard tensors whose rows
# don't divide by the ranks, while every further rank adds a process and its NCCL set-up to each run
K = min(torch.cuda.device_count(), 4)


multi_gpu = pytest.mark.skipif(K < 2, reason="needs 2 CUDA GPUs")


def k_rank_args(dataset, out_dir, **settings):
    """ args() with 2 micro-batches per rank in every step: a global batch that 1 rank takes as 2K micro-steps. """
    return args(dataset, out_dir, gradient_accumulation_steps=2 * K, **settings)


def write_char_dataset(directory, train_tokens, val_tokens, symbols):
    """ A character dataset of these token ids (train.bin, val.bin) over `symbols` (meta.json). Returns it. """
    os.makedirs(directory, exist_ok=True)
    np.asarray(train_tokens, dtype=np.uint16).tofile(os.path.join(directory, "train.bin"))
    np.asarray(val_tokens, dtype=np.uint16).tofile(os.path.join(directory, "val.bin"))
    stoi = {ch: i for i, ch in enumerate(symbols)}
    with open(os.path.join(directory, "meta.json"), "w", encoding="utf-8") as f:
        json.dump({"kind": "char", "vocab_size": len(symbols), "stoi": stoi,
                   "itos": {i: ch for ch, i in stoi.items()}}, f)
    return str(directory)


def grad_norms(out_dir):
    """ {iteration: gradient norm before clipping} from a run's metrics.jsonl. """
    return {r["iter"]: r["grad_norm"] for r in read_metrics(str(out_dir / "metrics.jsonl")) if r["type"] == "iter"}


@pytest.mark.gpu
@multi_gpu
@pytest.mark.parametrize("parallelism", ["ddp", "fsdp"])
def test_bf16_compiled_on_k_ranks_equals_one_rank(dataset, tmp_path, parallelism):
    """
    DDP and FSDP with bf16 and compile on K ranks, against the same run on 1 rank that takes all 2K micro-batches:
    the loader strides one stream over the ranks, so every step has the same global batch and the losses agree.
    Within 2e-2: the ranks' gradients are summed in another order, and bf16 rounds such differences up (the
    tolerance of test_resume_default_configuration_on_cuda). The gradient norms of the first steps agree within
    2 %: under FSDP the norm spans every rank's shards. Both bite: on the CPU with 2 gloo ranks, ranks that all
    read rank 0's micro-batches missed the losses at iteration 1, and a norm over one rank's shards read 0.71 of
    the true one.
    """
    if not native_bf16():
        pytest.skip("this GPU has no bfloat16")
    run = functools.partial(k_rank_args, dataset, parallelism=parallelism, dtype='bfloat16', max_iters=10,
                            lr_decay_iters=10)
    one = torchrun(1, run(tmp_path / "one"))
    many = torchrun(K, run(tmp_path / "many"))
    assert "compiling the model" in many
    losses = iter_losses(many)
    assert sorted(losses) == list(range(11)) and all(np.isfinite(list(losses.values()))) and losses[10] < losses[0]
    assert_losses_close(iter_losses(one), losses, range(11), tol=2e-2)
    norms_one = grad_norms(tmp_path / "one")
    norms_many = grad_norms(tmp_path / "many")
    for it in range(5):
        assert norms_many[it] == pytest.approx(norms_one[it], rel=2e-2), (it, norms_one, norms_many)
    ck = load_checkpoint(str(tmp_path / "many" / "ckpt.pt"))
    assert ck["provenance"]["world_size"] == K and ck["provenance"]["dtype"] == "bfloat16"
    # full tensors, never DTensors
    assert all(type(v) is torch.Tensor for v in ck["model"].values())
    if parallelism == "fsdp":  # each rank stores about 1/K of the parameters
        m = re.search(r"^fsdp: this rank holds ([\d,]+) of ([\d,]+) parameters", many, re.M)
        assert m, many[-2000:]
        local, total = (int(g.replace(",", "")) for g in m.groups())
        assert 0.9 / K < local / total < 1.1 / K, (local, total)


@pytest.mark.gpu
@multi_gpu
def test_fsdp_equals_ddp_fp32_on_k_ranks(dataset, tmp_path):
    """ test_distributed's check on nccl: K ranks, 2 micro-steps each, the same losses (fp32 eager; TF32 matmuls). """
    from test_distributed import args as fsdp_args
    run = functools.partial(fsdp_args, dataset, device='cuda', dtype='float32', gradient_accumulation_steps=2 * K)
    ddp = torchrun(K, run(tmp_path / "ddp"))
    fsdp = torchrun(K, run(tmp_path / "fsdp", parallelism='fsdp'))
    assert_losses_close(iter_losses(ddp), iter_losses(fsdp), range(7), tol=2e-3)


@pytest.mark.gpu
@multi_gpu
def test_stop_and_resume_on_k_ranks_continues_the_run(dataset, tmp_path):
    """
    Stopped by max_iters on K ranks and resumed on K ranks (train.py's defaults: DDP, compiled, bf16 or fp16): the
    losses of an uninterrupted K-rank run, within test_resume_default_configuration_on_cuda's 2e-2. Resumed without
    the loader's position or without AdamW's state, they would part by up to 0.2 and 0.1 (measured on the CPU, fp32,
    with this data and batch).
    """
    run = functools.partial(k_rank_args, dataset)
    full = iter_losses(torchrun(K, run(tmp_path / "full")))
    part1 = iter_losses(torchrun(K, run(tmp_path / "split", max_iters=10)))
    ck = load_checkpoint(str(tmp_path / "split" / "ckpt.pt"))
    # part 1's final save: 11 steps, every rank's RNG states
    assert ck["iter_num"] == 11 and len(ck["rng"]) == K
    part2 = iter_losses(torchrun(K, run(tmp_path / "split", init_from="resume")))
    assert min(part2) == 11 and sorted(full) == list(range(21))
    assert_losses_close(full, {**part1, **part2}, range(21), tol=2e-2)


SPIKE_AT = 135  # the guard judges steps once its window holds SPIKE_WINDOW (128) of them


# skipped for its loss (named first)
SPIKE_SKIP_LINE = re.compile(r"^iter (\d+): skipped the update: loss ", re.M)


def spiked_dataset(directory, tokens_per_iter, spike_at, iters):
    """
    conftest's tiny pattern (5 % noise) for `iters` iterations read in order (data_order=sequential), with the
    tokens of iteration spike_at's global batch replaced by random ones: a loss spike on every rank at once. With
    the batches of 2 and 4 ranks (in one process on the CPU, fp32) that step's loss was 34-37 standard deviations
    above its running mean and its gradient norm 7.5-10.6; the guard skipped no other step.
    """
    rng = np.random.default_rng(0)
    n = -(-(iters * tokens_per_iter + 1) // TINY_VOCAB) * TINY_VOCAB  # whole periods of the pattern
    tokens = np.tile(np.arange(TINY_VOCAB), n // TINY_VOCAB)
    noise = rng.random(n) < 0.05
    tokens[noise] = rng.integers(0, TINY_VOCAB, noise.sum())
    first = spike_at * tokens_per_iter
    tokens[first:first + tokens_per_iter] = rng.integers(0, TINY_VOCAB, tokens_per_iter)
    return write_char_dataset(directory, tokens, tokens[:6000], [chr(97 + i) for i in range(TINY_VOCAB)])


@pytest.mark.gpu
@multi_gpu
def test_spike_guard_on_k_ranks_skips_the_spiked_update(tmp_path):
    """
    The spike guard under FSDP (bf16, compiled) on K ranks: the loss is averaged over the ranks and the gradient
    norm spans all shards, so every rank judges the spiked step alike. It is skipped, AdamW takes no step for it,
    and the run goes on to its end.
    """
    if not native_bf16():
        pytest.skip("this GPU has no bfloat16")
    last = SPIKE_AT + 4
    # 2K micro-batches of 8 x 32
    data = spiked_dataset(tmp_path / "data", 2 * K * 8 * 32, SPIKE_AT, last + 2)
    out = torchrun(K, k_rank_args(data, tmp_path / "out", parallelism='fsdp', dtype='bfloat16',
                                  data_order='sequential', max_iters=last, lr_decay_iters=last, eval_interval=1000,
                                  skip_loss_z=5.0, skip_grad_z=5.0))
    skips = SPIKE_SKIP_LINE.findall(out)
    assert [int(it) for it in skips] == [SPIKE_AT], out[-3000:]
    assert sorted(iter_losses(out)) == list(range(last + 1))
    ck = load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))
    assert ck["spike_guard"]["skipped"] == 1
    # iterations 0..last ran and one update was skipped: every parameter's AdamW step count is last, not last + 1
    assert {float(s["step"]) for s in ck["optimizer"]["state"].values()} == {float(last)}


@pytest.fixture(scope="module")
def spaced_dataset(tiny_dataset, tmp_path_factory):
    """ conftest's tiny dataset read as SYMBOLS, whose last symbol is a space (HellaSwag scores after a space). """
    tokens = {split: np.fromfile(os.path.join(tiny_dataset, f"{split}.bin"), dtype=np.uint16)
              for split in ("train", "val")}
    return write_char_dataset(tmp_path_factory.mktemp("spaced"), tokens["train"], tokens["val"], SYMBOLS)


@pytest.fixture(scope="module")
def hellaswag_jsonl(tmp_path_factory):
    """ 12 examples in HellaSwag's format: the pattern's end as the context, its start among 3 random endings. """
    return write_hellaswag(tmp_path_factory.mktemp("hellaswag") / "hellaswag.jsonl")


@pytest.mark.gpu
@multi_gpu
def test_in_loop_hellaswag_compiled_on_k_ranks_is_eval_py(spaced_dataset, hellaswag_jsonl, tmp_path, monkeypatch,
                                                          capsys):
    """
    HellaSwag scored in the loop by the compiled DDP model on K ranks, each scoring its share of the 12 examples
    (as many forwards as the others, padded): one line per scoring, every example counted once, and at iteration
    12 the count eval.py gives on that iteration's checkpoint. By then the model has learnt the pattern (12/12,
    against 0/12 at iteration 0, on the CPU with this batch): no near-tie that bf16 could flip.
    """
    out = torchrun(K, k_rank_args(spaced_dataset, tmp_path / "out", max_iters=12, eval_interval=6, lr_decay_iters=12,
                                  hellaswag_interval=6, hellaswag_file=hellaswag_jsonl, keep_checkpoints=3))
    assert "compiling the model" in out
    lines = hellaswag_lines(out)
    # rank 0 prints
    assert sorted(lines) == [0, 6, 12] and len(HELLASWAG_LINE.findall(out)) == 3, out[-3000:]
    assert [total for _, _, total in lines.values()] == [12, 12, 12]
    assert lines[12][1] > lines[0][1]
    result = run_eval_script(monkeypatch, capsys, tmp_path / "out" / "ckpt_12.pt", hellaswag_jsonl)
    assert result["num_examples"] == 12 and round(result["metrics"]["acc_norm"] * 12) == lines[12][1]


# torchrun starts each worker through this script, so that the test learns every worker's exit code. torchrun
# sends its SIGTERM to each worker's process group: train.py gets it and stops, while the wrapper only waits
RECORD_EXIT = """
import os, signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda signum, frame: None)
code = subprocess.call([sys.executable, "train.py", *sys.argv[2:]])
with open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w") as f:
    f.write(str(code))
sys.exit(code)
"""


def stop_with_workers(proc):
    """ test_distributed.stop, after killing each worker's process group: the wrapper and the train.py under it. """
    if proc.poll() is None:
        for pid in workers_of(proc):
            with contextlib.suppress(ProcessLookupError):
                # torchrun starts every worker in a session (and group) of its own
                os.killpg(pid, signal.SIGKILL)
    stop(proc)


@pytest.mark.gpu
@multi_gpu
def test_sigterm_to_torchrun_under_nccl_on_k_ranks(dataset, tmp_path):
    """
    Preemption under nccl: SIGTERM to torchrun mid-run. Every worker stops at the same iteration, rank 0 saves, and
    each exits 75 ("resumable") well before torchrun's SIGKILL 30 s on; the checkpoint holds every rank's RNG
    states and resumes on K ranks. (test_distributed.py does this with gloo on the CPU.)
    """
    codes = tmp_path / "exit_codes"
    codes.mkdir()
    (tmp_path / "record_exit.py").write_text(RECORD_EXIT)
    # no log line after iter 0: the stop must not wait for one
    endless = k_rank_args(dataset, tmp_path / "out", max_iters=100000, lr_decay_iters=100000, eval_interval=100000,
                          log_interval=100000)
    proc = start(torchrun_command(K) + [str(tmp_path / "record_exit.py"), str(codes), *endless])
    try:
        seen = wait_for_line(proc, "iter 0:", timeout=300)  # compiled and training
        time.sleep(2.0)  # some iterations in
        # a scheduler's preemption: torchrun passes it on to every worker once
        proc.send_signal(signal.SIGTERM)
        signalled = time.time()
        out, err = proc.communicate(timeout=28)
        stopped_in = time.time() - signalled
    finally:
        stop_with_workers(proc)
    seen += out
    exits = {p.name: p.read_text() for p in codes.iterdir()}
    assert exits == {f"rank{r}": "75" for r in range(K)}, (exits, err[-3000:])
    assert "stopped cleanly" in seen and stopped_in < 25, (stopped_in, seen[-2000:])
    assert err.count("received SIGTERM: all processes stop here and save a checkpoint") == 1, err[-3000:]
    saves = re.findall(r"saving checkpoint to .* \(interrupted at iter (\d+)\)", seen)
    assert len(saves) == 1, seen[-2000:]
    stopped_at = int(saves[0])
    ck = load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))
    assert ck["iter_num"] == stopped_at > 1 and len(ck["rng"]) == K
    resumed = torchrun(K, endless + ["--log_interval=1", "--init_from=resume", f"--max_iters={stopped_at + 1}"])
    assert sorted(iter_losses(resumed)) == [stopped_at, stopped_at + 1]


# -----------------------------------------------------------------------------
# on a CUDA GPU (skipped without one): GPT-2 124M's shape

GPT2_SHAPE = ['--n_layer=12', '--n_head=12', '--n_embd=768', '--block_size=1024']


def bench_peak_mib(*settings):
    """ bench.py's peak memory (MiB) in a process of its own, GPT-2 124M, random tokens, eager, on CUDA. """
    r = run_python(['bench.py', '--device=cuda', '--real_data=False', '--compile=False',
                        '--batch_size=8', '--burnin=1', '--steps=2', *GPT2_SHAPE, *settings], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    m = re.search(r"^peak memory: ([\d,]+) MiB \(peak CUDA memory allocated", r.stdout, re.M)
    return int(m.group(1).replace(',', ''))


@pytest.mark.gpu
def test_activation_checkpointing_lowers_the_cuda_peak_of_gpt2():
    plain = bench_peak_mib()
    recomputed = bench_peak_mib('--activation_checkpointing=True')
    # the Blocks' activations at 8 x 1024 tokens are ~2 GiB in bf16; the logits and AdamW state stay either way
    assert recomputed < plain - 1024, (plain, recomputed)


@pytest.mark.gpu
def test_real_cuda_out_of_memory_is_one_message(dataset, tmp_path):
    # 4096 sequences of 1024 tokens through GPT-2 124M's Blocks: hundreds of GiB of activations
    args = train_args(dataset, tmp_path, device='cuda', batch_size=4096, gradient_accumulation_steps=1,
                      max_iters=2, eval_interval=100, n_layer=12, n_head=12, n_embd=768, block_size=1024)
    r = run_python(['train.py', *args], timeout=600)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith("error: out of GPU memory at iter 0; no checkpoint had been")
