"""train.py --parallelism=fsdp (FSDP2) on the CPU with 2 gloo processes: same losses as DDP, half the
parameters per rank, nanoGPT-format checkpoints that resume under FSDP and in a single process."""
import functools
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import REPO, assert_losses_close, iter_losses, train_args

from nanogpt_plus.checkpoint import load_checkpoint, model_from_checkpoint

# 4 micro-batches per step = 2 per rank: exercises FSDP's gradient accumulation without sync
args = functools.partial(train_args, gradient_accumulation_steps=4, max_iters=6, eval_interval=3, lr_decay_iters=6,
                         bias=True, always_save_checkpoint=True)


def train(cmd_args, nproc=2):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"] \
        if nproc > 1 else [sys.executable]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(launcher + ["train.py", *cmd_args], cwd=REPO, capture_output=True, text=True,
                       timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


@pytest.mark.slow
def test_fsdp_equals_ddp_halves_memory_and_checkpoints_resume(dataset, tmp_path):
    ddp = train(args(dataset, tmp_path / "ddp"))
    fsdp = train(args(dataset, tmp_path / "fsdp", parallelism="fsdp", max_iters=3))
    ddp_losses, fsdp_losses = iter_losses(ddp), iter_losses(fsdp)
    assert_losses_close(ddp_losses, fsdp_losses, range(4))

    # each of the 2 ranks stores about half of the parameters (rows split evenly, 1-row tensors padded)
    m = re.search(r"^fsdp: this rank holds ([\d,]+) of ([\d,]+) parameters", fsdp, re.M)
    assert m, fsdp[-2000:]
    local, total = (int(g.replace(",", "")) for g in m.groups())
    assert 0.45 < local / total <= 0.55, (local, total)

    # the checkpoint is a plain nanoGPT one: full tensors, AdamW's own state-dict format (integer keys)
    ck_ddp = load_checkpoint(str(tmp_path / "ddp" / "ckpt.pt"))
    ck = load_checkpoint(str(tmp_path / "fsdp" / "ckpt.pt"))
    assert ck["iter_num"] == 3 and ck["config"]["parallelism"] == "fsdp"
    model = model_from_checkpoint(ck)  # loads strictly: every key, every full shape
    assert model.lm_head.weight is model.transformer.wte.weight
    assert ck["model"]["lm_head.weight"].data_ptr() == ck["model"]["transformer.wte.weight"].data_ptr()
    assert not any(type(v) is not torch.Tensor for v in ck["model"].values())
    opt = ck["optimizer"]
    params = [p for group in opt["param_groups"] for p in group["params"]]
    assert params == list(range(len(params))) and sorted(opt["state"]) == params
    ref = dict(model.named_parameters())
    names = [n for n, p in ref.items() if p.dim() >= 2] + [n for n, p in ref.items() if p.dim() < 2]
    for i, name in enumerate(names):
        assert type(opt["state"][i]["exp_avg"]) is torch.Tensor
        assert opt["state"][i]["exp_avg"].shape == ref[name].shape, name
    # the same state a DDP run has after 3 iterations (the DDP run's checkpoint is from iteration 6)
    assert {k: v.shape for k, v in ck["model"].items()} == {k: v.shape for k, v in ck_ddp["model"].items()}

    # resume the FSDP checkpoint under FSDP (optimizer state re-sharded) and in one process with 4 micro-steps:
    # both continue exactly where the uninterrupted DDP run went
    shutil.copytree(tmp_path / "fsdp", tmp_path / "single")
    resumed = train(args(dataset, tmp_path / "fsdp", parallelism="fsdp", init_from="resume"))
    assert_losses_close(ddp_losses, iter_losses(resumed), range(3, 7))
    single = train(args(dataset, tmp_path / "single", init_from="resume", num_threads=1), nproc=1)
    assert_losses_close(ddp_losses, iter_losses(single), range(3, 7))
    final = load_checkpoint(str(tmp_path / "fsdp" / "ckpt.pt"))
    for k, v in ck_ddp["model"].items():
        torch.testing.assert_close(final["model"][k], v, atol=3e-4, rtol=1e-3)  # Adam amplifies fp noise


def test_bad_parallelism_is_one_clear_error(tmp_path):
    r = subprocess.run([sys.executable, "train.py", "--parallelism=zero3", "--device=cpu"], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "parallelism must be 'ddp' or 'fsdp'" in r.stderr and "Traceback" not in r.stderr
