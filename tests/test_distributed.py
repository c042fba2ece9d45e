"""
nanogpt_plus/distributed.py (and process_group.py behind it): train.py under torchrun with 2 gloo processes: DDP
equal to one process with double accumulation; FSDP (FSDP2) with the same losses as DDP, half the parameters per
rank, checkpoints that resume under FSDP and in one process, the full state dicts held by rank 0, bf16 mixed
precision, ranks other than 0 built on the meta device and sent rank 0's shards, optimizer state resumed without
keeping the checkpoint mapped, DDP with torch.compile; and when the ranks' work is uneven or something goes wrong
(evaluation with eval_iters not a multiple of the ranks, a checkpoint rank 0 cannot write, a rank that dies, SIGTERM
to torchrun), the process group's timeout, and a single process comparing nothing. Every launch has a timeout, so a
hang fails instead of stalling.
"""
import functools
import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict

import pytest
import torch

import train
from helpers import (
    TINY,
    TORCHRUN,
    assert_losses_close,
    iter_losses,
    project_frames,
    run_python,
    start_python,
    tiny_args,
    train_args,
    train_one_and_two_ranks,
)
from model import GPT, GPTConfig
from nanogpt_plus import hf_import
from nanogpt_plus.checkpoint import load_checkpoint, save_checkpoint
from nanogpt_plus.distributed import DistInfo, full_state_dicts, load_optimizer_state, said_once, wrap_model
from nanogpt_plus.init_from import model_from_checkpoint
from nanogpt_plus.process_group import mixed_precision_policy

TORCHRUN_2 = TORCHRUN + ["--standalone", "--nproc_per_node=2"]


ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


EVAL_LINE = re.compile(r"^step 0: train loss (\S+), val loss (\S+)$", re.M)


def launch(cmd_args, nproc=2, timeout=60):
    """ train.py (under torchrun for nproc=2) to the end; a hang fails after timeout seconds. """
    launcher = TORCHRUN_2 if nproc == 2 else []
    proc = start(launcher + ["train.py", *cmd_args])
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def start(args):
    return start_python(args, env=ENV)


def workers_of(proc):
    """ The pids of torchrun's worker processes (its children). """
    found = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def stop(proc):
    """ Kill proc and its workers if still running: torchrun starts them in sessions of their own, so a
    hung test would otherwise leave them behind. """
    if proc.poll() is not None:
        return
    for pid in workers_of(proc):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.communicate()


@pytest.mark.parametrize("parallelism,eval_iters", [("fsdp", 3), ("ddp", 1)])
def test_uneven_evaluation_finishes_with_the_single_process_losses(dataset, tmp_path, parallelism, eval_iters):
    # 3 batches over 2 ranks (FSDP: every forward all-gathers), 1 batch over 2 (DDP: the first forward
    # broadcasts buffers): both used to hang at step 0
    common = dict(eval_only=True, eval_iters=eval_iters, num_threads=1)
    two = launch(train_args(dataset, tmp_path / "two", parallelism=parallelism, **common))
    one = launch(train_args(dataset, tmp_path / "one", **common), nproc=1)
    assert two.returncode == 0 and one.returncode == 0, two.stderr[-2000:] + one.stderr[-2000:]
    (a,) = EVAL_LINE.findall(one.stdout)
    (b,) = EVAL_LINE.findall(two.stdout)
    # the ranks sum their shares of the batches in another order: equal within rounding, not bitwise
    assert all(abs(float(x) - float(y)) < 2e-4 for x, y in zip(a, b)), (a, b)


def test_a_checkpoint_rank0_cannot_write_stops_every_rank_with_one_message(dataset, tmp_path):
    # a directory where rank 0 must write the file, put there once the run has started (one there
    # before is refused when the out_dir is claimed): the save at iteration 300 fails
    began = time.time()
    proc = start(TORCHRUN_2 + ["train.py", *train_args(dataset, tmp_path, max_iters=300, eval_interval=300,
                                                       lr_decay_iters=300, num_threads=1)])
    try:
        wait_for_line(proc, "iter 0:")
        os.makedirs(tmp_path / "ckpt.pt")
        out, err = proc.communicate(timeout=60)
    finally:
        stop(proc)
    r = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert time.time() - began < 60, "the ranks waited for each other"
    assert r.returncode != 0
    # printed once (rank 0's); torchrun's summary repeats it as each rank's "traceback" (runtime.record_for_torchrun)
    said = re.findall(r"^(error: could not write the checkpoint.*)$", r.stderr, re.M)
    assert len(said) == 1, r.stderr[-3000:]
    assert f"  traceback : {said[0]}\n" in r.stderr.split("Root Cause")[1], r.stderr[-3000:]
    # no worker traceback (torchrun prints its summary)
    assert not project_frames(r.stderr), r.stderr[-3000:]
    assert "finishing this iteration" not in r.stderr


def test_a_rank_that_dies_ends_the_run_without_saving(dataset, tmp_path):
    proc = start_endless_run(dataset, tmp_path, log_interval=1)
    try:
        wait_for_line(proc, "iter 3:")
        workers = workers_of(proc)
        assert len(workers) == 2, workers
        os.kill(max(workers), signal.SIGKILL)  # one worker disappears mid-run (the OOM killer, say)
        _, err = proc.communicate(timeout=20)
    finally:
        stop(proc)
    assert proc.returncode != 0
    assert "another process of this run is gone" in err, err[-3000:]
    assert not project_frames(err), err[-3000:]  # one line, no traceback of the surviving rank
    assert not os.path.exists(tmp_path / "ckpt.pt")


def endless_run_args(dataset, out_dir, log_interval):
    """ A 2-rank run that would go on for 100,000 iterations (no evaluation after iter 0): a test ends it. """
    return train_args(dataset, out_dir, max_iters=100000, lr_decay_iters=100000, eval_interval=100000,
                      log_interval=log_interval, num_threads=1)


def start_endless_run(dataset, out_dir, log_interval):
    return start(TORCHRUN_2 + ["train.py", *endless_run_args(dataset, out_dir, log_interval)])


def wait_for_line(proc, prefix, timeout=60):
    """ Read proc's stdout until a line starts with prefix; returns what was read. """
    seen = ""
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        seen += line
        if line.startswith(prefix):
            return seen
        assert line, "the run ended early: " + seen[-2000:] + proc.stderr.read()[-3000:]
    raise AssertionError(f"no '{prefix}' line within {timeout} s: " + seen[-2000:])


def test_sigterm_to_torchrun_stops_every_rank_at_once_and_resumes(dataset, tmp_path):
    # a log step only at iter 0: the stop must not wait for the next one (torchrun SIGKILLs after 30 s)
    args = endless_run_args(dataset, tmp_path, log_interval=100000)
    proc = start(TORCHRUN_2 + ["train.py", *args])
    try:
        seen = wait_for_line(proc, "iter 0:")
        time.sleep(1.0)  # some iterations in
        # what a scheduler does on preemption: torchrun forwards it once
        proc.send_signal(signal.SIGTERM)
        signalled = time.time()
        out, err = proc.communicate(timeout=28)
        stopped_in = time.time() - signalled
    finally:
        stop(proc)
    seen += out
    # torchrun's own code after a signal (its SignalException), as before
    assert proc.returncode == 1, err[-3000:]
    m = re.findall(r"saving checkpoint to .* \(interrupted at iter (\d+)\)", seen)
    assert len(m) == 1, seen[-2000:] + err[-3000:]
    stopped_at = int(m[0])
    assert stopped_at > 1 and stopped_in < 25, (stopped_at, stopped_in)  # torchrun SIGKILLs at 30 s
    assert err.count("received SIGTERM: all processes stop here and save a checkpoint") == 1, err[-3000:]
    assert "stopped cleanly" in seen
    ckpt = load_checkpoint(str(tmp_path / "ckpt.pt"))
    assert ckpt["iter_num"] == stopped_at and len(ckpt["rng"]) == 2
    resumed = launch(args + ["--log_interval=1", "--init_from=resume", f"--max_iters={stopped_at + 1}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(iter_losses(resumed.stdout)) == [stopped_at, stopped_at + 1]


def test_dist_timeout_reaches_the_process_group(dataset, tmp_path, monkeypatch, capsys):
    """ --dist_timeout=S is the timeout train.py's process group is made with (0: PyTorch's own). A real group of
    one gloo rank, in this process, as torchrun's environment describes it. """
    import datetime
    import socket

    import torch.distributed as dist

    with socket.socket() as s:  # a free port for the group's store
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK='0', LOCAL_RANK='0', WORLD_SIZE='1', MASTER_ADDR='127.0.0.1',
                           MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    made = []
    real = dist.init_process_group

    def init_process_group(**kwargs):
        made.append(kwargs)
        return real(**kwargs)
    set_timeouts = []
    real_set = dist.distributed_c10d._set_pg_timeout

    def set_pg_timeout(timeout, group=None):
        set_timeouts.append(timeout)
        return real_set(timeout, group)
    monkeypatch.setattr(dist, 'init_process_group', init_process_group)
    monkeypatch.setattr(dist.distributed_c10d, '_set_pg_timeout', set_pg_timeout)
    train.main(train_args(dataset, tmp_path / 'a', max_iters=1, eval_interval=1, num_threads=1, dist_timeout=77,
                          join_timeout=33))
    # joining waits join_timeout, then the collectives dist_timeout
    assert made == [{'backend': 'gloo', 'timeout': datetime.timedelta(seconds=33)}]
    assert set_timeouts == [datetime.timedelta(seconds=77)]
    dist.destroy_process_group()
    train.main(train_args(dataset, tmp_path / 'b', max_iters=1, eval_interval=1, num_threads=1))
    assert made[1] == {'backend': 'gloo', 'timeout': datetime.timedelta(seconds=120)}
    # 0: gloo's default, not a timeout of 0 s
    assert set_timeouts[1] == datetime.timedelta(minutes=30)
    capsys.readouterr()


@pytest.mark.parametrize("under_torchrun,rank,shown", [(False, 0, True), (True, 0, True), (True, 1, False)])
def test_set_up_lines_said_once_by_rank_0(under_torchrun, rank, shown, capsys):
    # a fake rank: inside said_once only rank 0's stdout lines come out (the model's and AdamW's set-up lines), and
    # stdout is the test's own again after it
    info = DistInfo(under_torchrun, rank, rank, 2 if under_torchrun else 1, 'cpu')
    with said_once(info):
        model = GPT(GPTConfig(**TINY))
        model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
        print("said inside", file=sys.stderr)
    print("after")
    out, err = capsys.readouterr()
    lines = out.splitlines()
    if shown:
        assert lines[0].startswith("number of parameters: ") and lines[1].startswith("num decayed parameter tensors")
        assert len(lines) == 5
    else:
        assert lines == ["after"]
    assert err == "said inside\n"  # errors and warnings are every rank's


def test_a_single_process_describes_nothing_to_compare(tiny_dataset, tmp_path, monkeypatch):
    """ same_start reads files and asks git: a run of one process (no torchrun) has no rank to compare with. """
    from nanogpt_plus.distributed import DistInfo, same_everywhere

    def describe():
        raise AssertionError('described in a single process')
    same_everywhere(DistInfo(False, 0, 0, 1, 'cpu'), describe, {})
    monkeypatch.setattr(train, 'same_start', describe)
    train.main(train_args(tiny_dataset, tmp_path / 'out', max_iters=1))
    assert (tmp_path / 'out' / 'ckpt.pt').exists()


# 4 micro-batches per step = 2 per rank: exercises FSDP's gradient accumulation without sync
args = functools.partial(train_args, gradient_accumulation_steps=4, max_iters=6, eval_interval=3, lr_decay_iters=6,
                         bias=True, always_save_checkpoint=True)


def train_on_ranks(cmd_args, nproc=2):
    launcher = TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = run_python(launcher + ["train.py", *cmd_args], timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def test_fsdp_equals_ddp_halves_memory_and_checkpoints_resume(dataset, tmp_path):
    ddp = train_on_ranks(args(dataset, tmp_path / "ddp"))
    fsdp = train_on_ranks(args(dataset, tmp_path / "fsdp", parallelism="fsdp", max_iters=3))
    ddp_losses = iter_losses(ddp)
    fsdp_losses = iter_losses(fsdp)
    assert_losses_close(ddp_losses, fsdp_losses, range(4))

    # each of the 2 ranks stores about half of the parameters (rows split evenly, 1-row tensors padded)
    m = re.search(r"^fsdp: this rank holds ([\d,]+) of ([\d,]+) parameters", fsdp, re.M)
    assert m, fsdp[-2000:]
    local, total = (int(g.replace(",", "")) for g in m.groups())
    assert 0.45 < local / total <= 0.55, (local, total)

    # the checkpoint is a plain nanoGPT one: full tensors, AdamW's own state-dict format (integer keys)
    ck_ddp = load_checkpoint(str(tmp_path / "ddp" / "ckpt.pt"))
    ck = load_checkpoint(str(tmp_path / "fsdp" / "ckpt.pt"))
    # the final save: 4 steps done
    assert ck["iter_num"] == 4 and ck["config"]["parallelism"] == "fsdp"
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
    # the same state a DDP run has after 4 steps (the DDP run's final checkpoint is after 7)
    assert {k: v.shape for k, v in ck["model"].items()} == {k: v.shape for k, v in ck_ddp["model"].items()}

    # resume the FSDP checkpoint under FSDP (optimizer state re-sharded) and in one process with 4 micro-steps:
    # both continue exactly where the uninterrupted DDP run went
    shutil.copytree(tmp_path / "fsdp", tmp_path / "single")
    resumed = train_on_ranks(args(dataset, tmp_path / "fsdp", parallelism="fsdp", init_from="resume"))
    assert_losses_close(ddp_losses, iter_losses(resumed), range(4, 7))
    single = train_on_ranks(args(dataset, tmp_path / "single", init_from="resume", num_threads=1), nproc=1)
    assert_losses_close(ddp_losses, iter_losses(single), range(4, 7))
    final = load_checkpoint(str(tmp_path / "fsdp" / "ckpt.pt"))
    for k, v in ck_ddp["model"].items():
        # Adam amplifies fp noise
        torch.testing.assert_close(final["model"][k], v, atol=3e-4, rtol=1e-3)


def test_bad_parallelism_is_one_clear_error(tmp_path):
    r = run_python(["train.py", "--parallelism=zero3", "--device=cpu"], timeout=120)
    assert r.returncode == 2
    assert "parallelism must be 'ddp' or 'fsdp'" in r.stderr and "Traceback" not in r.stderr


# the settings of a new TINY model (init_from.ModelSpec): the rest are GPTConfig's defaults
TINY_SPEC = {k: v for k, v in asdict(GPTConfig(**TINY)).items() if k != 'vocab_size'}


def tiny_step(model, optimizer, dtype):
    """ One AdamW step on a fixed batch (the same on every rank, so FSDP's mean gradient is this batch's). """
    g = torch.Generator().manual_seed(1)
    X = torch.randint(0, TINY['vocab_size'], (4, TINY['block_size']), generator=g)
    Y = torch.randint(0, TINY['vocab_size'], (4, TINY['block_size']), generator=g)
    with torch.autocast('cpu', dtype=getattr(torch, dtype), enabled=dtype != 'float32'):
        _, loss = model(X, Y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def fsdp_worker(rank, init_file, out_dir, dtype):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**TINY))
        info = DistInfo(under_torchrun=True, rank=rank, local_rank=rank, world_size=2, device='cpu')
        wrap_model(model, info, parallelism='fsdp', dtype=dtype)
        seen = []  # the dtype of a Block's weight while the Block runs: FSDP's all-gathered copy
        model.transformer.h[0].attn.c_attn.register_forward_pre_hook(lambda m, _: seen.append(m.weight.dtype))
        optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu', fused=False)
        loss = tiny_step(model, optimizer, dtype)
        model_state, opt_state = full_state_dicts(model, optimizer)
        result = {'loss': loss, 'seen': str(seen[0]), 'none': model_state is None and opt_state is None,
                  'sharded_dtype': str(next(model.parameters()).dtype)}
        # the saved optimizer state loads back into the shards: rank 1 passes garbage of the right shapes,
        # rank 0's values are the ones scattered
        full = opt_state if rank == 0 else \
            {'state': {i: {k: torch.full_like(v, float('nan')) if v.dim() else v for k, v in s.items()}
                       for i, s in torch.load(os.path.join(out_dir, 'shapes.pt'), weights_only=True).items()},
             'param_groups': optimizer.state_dict()['param_groups']}
        before = {i: s['exp_avg'].to_local().clone() for i, s in optimizer.state_dict()['state'].items()}
        load_optimizer_state(optimizer, full)
        after = optimizer.state_dict()['state']
        result['reloaded'] = all(torch.equal(before[i], after[i]['exp_avg'].to_local()) for i in before)
        if rank == 0:
            torch.save((model_state, opt_state), os.path.join(out_dir, 'full.pt'))
        torch.save(result, os.path.join(out_dir, f'rank{rank}.pt'))
    finally:
        dist.destroy_process_group()


def run_two_ranks(tmp_path, dtype):
    import torch.multiprocessing as mp

    # rank 1's stand-in for the checkpoint's optimizer state: the shapes of a single-process AdamW's
    torch.manual_seed(0)
    ref = GPT(GPTConfig(**TINY))
    ref_opt = ref.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu', fused=False)
    tiny_step(ref, ref_opt, 'float32')
    torch.save(ref_opt.state_dict()['state'], tmp_path / 'shapes.pt')
    mp.spawn(fsdp_worker, args=(str(tmp_path / 'pg'), str(tmp_path), dtype), nprocs=2, join=True)
    results = [torch.load(tmp_path / f'rank{r}.pt', weights_only=True) for r in (0, 1)]
    return results, ref, ref_opt


def test_fsdp_full_state_dicts_are_held_by_rank_0_only(tmp_path):
    (r0, r1), ref, ref_opt = run_two_ranks(tmp_path, 'float32')
    # rank 1 took part in every gather but kept nothing; rank 0 has what ckpt.pt always held
    assert r1['none'] and not r0['none']
    assert r0['reloaded'] and r1['reloaded']
    model_state, opt_state = torch.load(tmp_path / 'full.pt', weights_only=True)
    # the tied weight: one tensor
    assert model_state['lm_head.weight'] is model_state['transformer.wte.weight']
    assert not any(type(v) is not torch.Tensor for v in model_state.values())  # no DTensors
    ref_state = ref.state_dict()
    assert list(model_state) == list(ref_state)  # plain names, no wrapper prefixes
    for k, v in ref_state.items():
        torch.testing.assert_close(model_state[k], v)
    ref_osd = ref_opt.state_dict()  # AdamW's own format: integer keys, in parameter order
    assert opt_state['param_groups'] == ref_osd['param_groups']
    assert list(opt_state['state']) == list(range(len(ref_osd['state'])))
    for i, s in ref_osd['state'].items():
        for k, v in s.items():
            assert type(opt_state['state'][i][k]) is torch.Tensor
            torch.testing.assert_close(opt_state['state'][i][k], v)


def test_fsdp_bfloat16_gathers_bf16_weights_and_keeps_fp32_shards(tmp_path):
    policy = mixed_precision_policy('bfloat16')
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32
    assert mixed_precision_policy('float16').param_dtype == torch.float16
    assert mixed_precision_policy('float32').param_dtype is None  # float32: nothing cast
    (r0, r1), _, _ = run_two_ranks(tmp_path, 'bfloat16')
    for r in (r0, r1):
        assert r['seen'] == 'torch.bfloat16'  # the all-gathered weights the Block computes with
        # what the optimizer updates and ckpt.pt stores
        assert r['sharded_dtype'] == 'torch.float32'
        assert 0 < r['loss'] < 10 and r['reloaded']
    model_state, _ = torch.load(tmp_path / 'full.pt', weights_only=True)
    assert all(v.dtype == torch.float32 for v in model_state.values())


def test_ddp_then_compile_without_buffer_broadcasts(tmp_path):
    import torch.distributed as dist
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group('gloo', init_method=f'file://{tmp_path / "pg"}', rank=0, world_size=1)
    raw = GPT(GPTConfig(**TINY))
    info = DistInfo(under_torchrun=True, rank=0, local_rank=0, world_size=1, device='cpu')
    # compiles lazily: nothing runs yet
    model = wrap_model(raw, info, compile_model=True, parallelism='ddp')
    # the compiled module is the DDP one (what dynamo's DDPOptimizer needs to overlap the all-reduces)
    assert isinstance(model, OptimizedModule) and isinstance(model._orig_mod, DDP)
    assert model._orig_mod.module is raw
    # no per-step broadcast of the causal masks,
    assert model._orig_mod.forward_sync_buffers is False
    # which is safe because the model's only buffers are those masks, none of them saved state
    buffers = {n for n, _ in raw.named_buffers()}
    assert buffers and not buffers & set(raw.state_dict())
    optimizer = raw.configure_optimizers(0.1, 1e-3, (0.9, 0.95), 'cpu')
    # what write_checkpoint saves: the plain module's names
    model_state, _ = full_state_dicts(raw, optimizer)
    assert not any(k.startswith(('_orig_mod.', 'module.')) for k in model_state)
    assert set(model_state) == set(GPT(GPTConfig(**TINY)).state_dict())


def test_resumed_optimizer_state_does_not_keep_the_checkpoint_mapped(tmp_path):
    path = str(tmp_path / 'ckpt.pt')
    model = GPT(GPTConfig(**TINY))
    optimizer = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu', fused=False)
    tiny_step(model, optimizer, 'float32')
    save_checkpoint({'model': model.state_dict(), 'model_args': model.config.model_args(),
                     'optimizer': optimizer.state_dict()}, path)
    resumed = model.configure_optimizers(0.1, 1e-2, (0.9, 0.95), 'cpu', fused=False)
    ckpt = load_checkpoint(path)
    load_optimizer_state(resumed, ckpt['optimizer'])
    del ckpt
    gc.collect()
    with open('/proc/self/maps') as f:
        # the CPU optimizer state was copied out
        assert not any(line.rstrip().endswith(path) for line in f)
    for i, s in optimizer.state_dict()['state'].items():
        for k, v in s.items():
            torch.testing.assert_close(resumed.state_dict()['state'][i][k], v)


# -----------------------------------------------------------------------------
# FSDP's ranks other than 0 build the model on the meta device and are sent their shards by rank 0

def test_init_model_on_meta_allocates_nothing_and_draws_nothing(tmp_path):
    from nanogpt_plus.init_from import ModelSpec, init_model, scratch_model
    path = str(tmp_path / 'ckpt.pt')
    model = GPT(GPTConfig(**TINY))
    save_checkpoint({'model': model.state_dict(), 'model_args': model.config.model_args()}, path)
    rng = torch.get_rng_state()
    meta, _, ckpt = init_model(path, on_meta=True)
    scratch = scratch_model(ModelSpec(**TINY_SPEC), {'vocab_size': TINY['vocab_size']}, 'data', on_meta=True)
    assert torch.equal(torch.get_rng_state(), rng)  # no initialisation ran
    # still there for the optimizer, loader and RNG states
    assert ckpt is not None and 'model' in ckpt
    for m in (meta, scratch):
        tensors = list(m.parameters()) + list(m.buffers())
        assert tensors and all(t.is_meta for t in tensors)
        assert m.lm_head.weight is m.transformer.wte.weight
        assert {k: v.shape for k, v in m.state_dict().items()} == {k: v.shape for k, v in model.state_dict().items()}


def test_a_pretrained_model_on_meta_reads_only_its_config(tmp_path, monkeypatch):
    """ FSDP's ranks other than 0 and a Hugging Face directory (or gpt2*): config.json only, no weights read. """
    from transformers import GPT2Config, GPT2LMHeadModel

    from nanogpt_plus.init_from import init_model
    GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=60)).save_pretrained(
        tmp_path / 'hf')
    real, _, _ = init_model(str(tmp_path / 'hf'))
    monkeypatch.setattr(hf_import, 'read_tensors', lambda path: pytest.fail(f"rank >0 read the weights {path}"))
    meta, tokenizer_meta, _ = init_model(str(tmp_path / 'hf'), on_meta=True)
    assert meta.config == real.config and tokenizer_meta == {'kind': 'gpt2'}
    assert all(t.is_meta for t in meta.parameters()) and meta.lm_head.weight is meta.transformer.wte.weight
    assert {k: v.shape for k, v in meta.state_dict().items()} == {k: v.shape for k, v in real.state_dict().items()}


def meta_worker(rank, init_file, out_dir, source):
    import torch.distributed as dist

    from nanogpt_plus.init_from import ModelSpec, fit_block_size, init_model, scratch_model
    from nanogpt_plus.process_group import shard_model
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2)
    try:
        # as train.py seeds: a rank 1 that initialised would differ from rank 0
        torch.manual_seed(0 + rank)
        if source == 'scratch':
            model = scratch_model(ModelSpec(**TINY_SPEC), {'vocab_size': TINY['vocab_size']}, 'data',
                                  on_meta=rank != 0)
        else:
            model, _, _ = init_model(os.path.join(out_dir, 'ckpt.pt'), on_meta=rank != 0)
            # cropped on meta too: the masks must come back at the cropped size
            fit_block_size(model, 8)
        result = {'meta_before': all(t.is_meta for t in list(model.parameters()) + list(model.buffers()))}
        shard_model(model, DistInfo(under_torchrun=True, rank=rank, local_rank=rank, world_size=2, device='cpu'))
        result['tied'] = model.lm_head.weight is model.transformer.wte.weight
        result['local'] = {n: p.to_local().clone() for n, p in model.named_parameters()}
        result['masks'] = [b.attn.bias.clone() for b in model.transformer.h]
        model.eval()
        generator = torch.Generator().manual_seed(3)
        X = torch.randint(0, TINY['vocab_size'], (2, model.config.block_size), generator=generator)
        with torch.no_grad():
            for path in ('flash', 'manual'):  # the manual path reads the masks
                model.set_attention(path)
                result[path] = model(X, all_positions=True)[0]
        result['X'] = X
        torch.save(result, os.path.join(out_dir, f'meta{rank}.pt'))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize('source', ['scratch', 'resume'])
def test_fsdp_meta_ranks_get_rank_0s_shards_and_masks(tmp_path, source):
    import torch.multiprocessing as mp
    torch.manual_seed(0)  # rank 0's init (seed + rank 0)
    ref = GPT(GPTConfig(**TINY))
    if source == 'resume':
        torch.manual_seed(5)
        ref = GPT(GPTConfig(**TINY))
        save_checkpoint({'model': ref.state_dict(), 'model_args': ref.config.model_args()}, str(tmp_path / 'ckpt.pt'))
        ref.crop_block_size(8)
    mp.spawn(meta_worker, args=(str(tmp_path / 'pg'), str(tmp_path), source), nprocs=2, join=True)
    r0, r1 = (torch.load(tmp_path / f'meta{r}.pt', weights_only=True) for r in (0, 1))
    assert r1['meta_before'] and not r0['meta_before']
    full = dict(ref.named_parameters())
    for rank, r in ((0, r0), (1, r1)):
        assert r['tied']
        assert set(r['local']) == set(full)
        for name, p in full.items():
            chunks = p.detach().chunk(2, dim=0)  # FSDP2 shards dim 0 as torch.chunk does
            expected = chunks[rank] if rank < len(chunks) else p.detach()[:0]
            assert torch.equal(r['local'][name], expected), (rank, name)
        causal = torch.tril(torch.ones(ref.config.block_size, ref.config.block_size, dtype=torch.bool))
        assert all(torch.equal(m[0, 0], causal) and m.shape[:2] == (1, 1) for m in r['masks'])
        ref.eval()
        with torch.no_grad():
            for path in ('flash', 'manual'):
                ref.set_attention(path)
                torch.testing.assert_close(r[path], ref(r['X'], all_positions=True)[0])


def test_ddp_two_processes_equals_one_with_double_accumulation(dataset, tmp_path):
    common = tiny_args(dataset, tmp_path, gradient_accumulation_steps=4, max_iters=6, eval_interval=6, dropout=0.0)
    one, two = train_one_and_two_ranks(common, tmp_path, steps=7)
    assert "tokens per iteration will be: 256" in two.stdout
    # the model's and the optimizer's set-up lines once, each on its own line (rank 0's), as one process prints them
    for start in ("number of parameters: ", "num decayed parameter tensors: ", "num non-decayed parameter tensors: ",
                  "using fused AdamW: "):
        assert [line.startswith(start) for line in one.stdout.splitlines()].count(True) == 1
        assert [line.startswith(start) for line in two.stdout.splitlines()].count(True) == 1, start
        assert two.stdout.count(start) == 1, start
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


def test_a_verdict_on_one_node_says_what_the_others_did_by_what_failed():
    # every_rank's suffix: only a file sends the user to compare the nodes' files
    from nanogpt_plus.errors import ConfigError, ConfigFileError, MachineError, UserError
    from nanogpt_plus.process_group import _WHY_ONE_NODE, _about
    assert _about(MachineError("device 'cuda' was asked for but CUDA is not available")) == 'machine'
    assert _about(ConfigError("unknown setting 'bogus'")) == 'settings'
    assert _about(ConfigFileError("config file config/x.py not found")) == 'files'
    assert _about(UserError("no checkpoint at out/ckpt.pt")) == 'files'
    assert "same files" in _WHY_ONE_NODE['files']
    assert not any("files" in _WHY_ONE_NODE[k] for k in ('machine', 'settings'))
