"""train.py --parallelism=fsdp (FSDP2) on the CPU with 2 gloo processes: same losses as DDP, half the
parameters per rank, nanoGPT-format checkpoints that resume under FSDP and in a single process; the
full state dicts held by rank 0 only, FSDP's bf16 mixed precision, memory-mapped checkpoint loading, and
how wrap_model puts DDP and torch.compile together."""
import functools
import gc
import os
import re
import shutil
from dataclasses import asdict

import pytest
import torch

from helpers import TORCHRUN, assert_losses_close, iter_losses, run_python, train_args
from model import GPT, GPTConfig
from nanogpt_plus import hf_import
from nanogpt_plus.checkpoint import load_checkpoint, save_checkpoint
from nanogpt_plus.distributed import DistInfo, full_state_dicts, load_optimizer_state, wrap_model
from nanogpt_plus.init_from import model_from_checkpoint
from nanogpt_plus.process_group import mixed_precision_policy

# 4 micro-batches per step = 2 per rank: exercises FSDP's gradient accumulation without sync
args = functools.partial(train_args, gradient_accumulation_steps=4, max_iters=6, eval_interval=3, lr_decay_iters=6,
                         bias=True, always_save_checkpoint=True)


def train(cmd_args, nproc=2):
    launcher = TORCHRUN + ["--standalone", f"--nproc_per_node={nproc}"] if nproc > 1 else []
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = run_python(launcher + ["train.py", *cmd_args], timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return r.stdout


def test_fsdp_equals_ddp_halves_memory_and_checkpoints_resume(dataset, tmp_path):
    ddp = train(args(dataset, tmp_path / "ddp"))
    fsdp = train(args(dataset, tmp_path / "fsdp", parallelism="fsdp", max_iters=3))
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
    resumed = train(args(dataset, tmp_path / "fsdp", parallelism="fsdp", init_from="resume"))
    assert_losses_close(ddp_losses, iter_losses(resumed), range(4, 7))
    single = train(args(dataset, tmp_path / "single", init_from="resume", num_threads=1), nproc=1)
    assert_losses_close(ddp_losses, iter_losses(single), range(4, 7))
    final = load_checkpoint(str(tmp_path / "fsdp" / "ckpt.pt"))
    for k, v in ck_ddp["model"].items():
        # Adam amplifies fp noise
        torch.testing.assert_close(final["model"][k], v, atol=3e-4, rtol=1e-3)


def test_bad_parallelism_is_one_clear_error(tmp_path):
    r = run_python(["train.py", "--parallelism=zero3", "--device=cpu"], timeout=120)
    assert r.returncode == 2
    assert "parallelism must be 'ddp' or 'fsdp'" in r.stderr and "Traceback" not in r.stderr


# -----------------------------------------------------------------------------
# the pieces in-process: 2 gloo ranks started with torch.multiprocessing, or a 1-rank gloo group

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=20, bias=True, dropout=0.0)
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


def test_load_checkpoint_memory_maps_the_file(tmp_path):
    path = str(tmp_path / 'ckpt.pt')
    model = GPT(GPTConfig(**TINY))
    save_checkpoint({'model': model.state_dict(), 'model_args': model.config.model_args()}, path)
    ckpt = load_checkpoint(path)
    with open('/proc/self/maps') as f:
        assert any(line.rstrip().endswith(path) for line in f)  # the tensors are pages of the file
    for k, v in model.state_dict().items():
        torch.testing.assert_close(ckpt['model'][k], v)


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
