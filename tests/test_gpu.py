"""
The CUDA paths, run by scripts/gpu_check.sh on a machine with a GPU (skipped without one, see conftest.py),
in the configuration users run: train.py's defaults on CUDA (dtype=auto, compile on) with bf16 and fp16 +
GradScaler, fused AdamW, nccl DDP and FSDP (+ compile, and fp16 under FSDP) with 1 process (with 2+ GPUs also
FSDP == DDP on 2 ranks), a resume on CUDA, KV-cache sampling in fp32 and under bf16 autocast, and bench.py's
MFU against the GPU's own peak.
"""
import functools
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

import bench
import train
from helpers import REPO
from helpers import TINY_VOCAB as VOCAB
from helpers import assert_losses_close, iter_losses, train_args
from model import GPT, GPTConfig
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.engine import KVCache, generate
from nanogpt_plus.hardware import gpu_peak_flops

pytestmark = pytest.mark.gpu


# compile=None and dtype=auto: train.py's own defaults, which on CUDA compile (tests/helpers.py's TINY_RUN
# turns compile off for the CPU suite); a test that needs eager says so
args = functools.partial(train_args, n_embd=64, block_size=32, batch_size=8, max_iters=20, eval_interval=10,
                         lr_decay_iters=20, device='cuda', compile=None, dtype='auto')


def native_bf16():
    """ bf16 tensor cores (Ampere and later); V100/T4 only emulate it, and dtype=auto gives them fp16. """
    return torch.cuda.is_bf16_supported(including_emulation=False)


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


def test_compile_trains(dataset, tmp_path, capsys):
    train.main(args(dataset, tmp_path, compile=True, dtype='bfloat16' if native_bf16() else 'float16'))
    out = capsys.readouterr().out
    assert "compiling the model" in out
    losses = list(iter_losses(out).values())
    assert len(losses) == 21 and losses[-1] < losses[0] - 0.5
    ck = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert not any(k.startswith("_orig_mod.") for k in ck["model"])


# multi-rank nccl needs 2+ GPUs (test_fsdp_equals_ddp_on_two_gpus); with 1 process nccl, DDP/FSDP wrapping,
# compile of the wrapped model and the sharded checkpoints still run
@pytest.mark.parametrize("parallelism, dtype", [("ddp", "auto"), ("fsdp", "auto"), ("fsdp", "float16")])
def test_nccl_one_process(dataset, tmp_path, parallelism, dtype):
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                        "train.py", *args(dataset, tmp_path, backend='nccl', parallelism=parallelism, dtype=dtype,
                                          max_iters=10, eval_interval=5)],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "compiling the model" in r.stdout
    losses = list(iter_losses(r.stdout).values())
    assert len(losses) == 11 and all(np.isfinite(losses)) and losses[-1] < losses[0]
    ck = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert all(type(v) is torch.Tensor for v in ck["model"].values())  # full tensors, never DTensors


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_fsdp_equals_ddp_on_two_gpus(dataset, tmp_path):
    """ tests/test_fsdp.py's check on nccl: 2 ranks, 2 micro-steps each, the same losses (fp32; TF32 matmuls). """
    from test_fsdp import args as fsdp_args
    from test_fsdp import train as torchrun
    ddp = torchrun(fsdp_args(dataset, tmp_path / "ddp", device='cuda', dtype='float32'))
    fsdp = torchrun(fsdp_args(dataset, tmp_path / "fsdp", device='cuda', dtype='float32', parallelism='fsdp'))
    assert_losses_close(iter_losses(ddp), iter_losses(fsdp), range(7), tol=2e-3)


def test_resume_on_cuda_continues_exactly(dataset, tmp_path, capsys, monkeypatch):
    """
    Stopped at its final checkpoint and resumed further on CUDA: the same iteration losses bitwise, with the CUDA RNG,
    the loader and the optimizer restored. Bitwise needs deterministic kernels: fp32, manual attention
    (flash attention's backward adds in a varying order), eager, and torch's deterministic algorithms.
    """
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (read when it starts a handle)
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
        cached = [model(seq[:, :5], kv_cache=cache)[0][:, -1]]  # prefill with the prompt, then one token a step
        cached += [model(seq[:, t:t + 1], kv_cache=cache)[0][:, -1] for t in range(5, 20)]
        full = [model(seq[:, :t + 1])[0][:, -1] for t in range(4, 20)]
    assert cache.k.dtype == torch.bfloat16 and cache.pos == 20
    for t, (a, b) in enumerate(zip(cached, full)):
        # bf16 keeps 8 bits of mantissa: the cached and the recomputed activations round a little apart
        torch.testing.assert_close(a.float(), b.float(), atol=5e-2, rtol=5e-2, msg=f"position {t + 4}")
    # and generation through the cache runs end to end under the autocast context, as sample.py calls it
    out = generate(model, seq[:, :5], 20, top_k=1, ctx=ctx)
    assert out.shape == (3, 25) and out.device.type == 'cuda'


def test_kv_cache_sampling_on_cuda_equals_reference():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=VOCAB)).cuda().eval()
    idx = torch.randint(VOCAB, (3, 5), device='cuda')
    fast = generate(model, idx, 20, top_k=1)  # greedy: deterministic, comparable token for token
    ref = model.generate(idx, 20, top_k=1)
    assert fast.device.type == 'cuda' and torch.equal(fast, ref)


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
