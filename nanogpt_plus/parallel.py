"""
Spreading training over processes: DDP or FSDP2 around the plain model (then torch.compile), control of the
gradient communication during accumulation, and the full (unsharded) state dicts a checkpoint stores and their
re-sharding on resume.

Usage:
    from nanogpt_plus.parallel import wrap_model, grad_sync_context, full_state_dicts
    model = wrap_model(raw_model, dist_info, compile_model=True, parallelism='ddp')
"""

from contextlib import contextmanager

import torch

from nanogpt_plus.device import PTDTYPE
from nanogpt_plus.errors import UserError


def wrap_model(model, dist_info, compile_model=False, parallelism='ddp', dtype='float32'):
    """
    DistributedDataParallel or FSDP2 around a plain model, then torch.compile; returns the model to train.
    parallelism='fsdp' (under torchrun) shards the model in place with FSDP2 instead of DDP, so create the
    optimizer after this call: its parameters are the sharded ones. dtype (the run's 'float32', 'bfloat16' or
    'float16') sets FSDP's mixed precision. The caller keeps `model` itself for checkpoints: it never gets
    the '_orig_mod.'/'module.' prefixes of the wrappers.
    """
    distributed = dist_info is not None and dist_info.under_torchrun
    fsdp = distributed and parallelism == 'fsdp'
    if fsdp:
        # in place: the compiled module below is the sharded one
        shard_model(model, dist_info, dtype)
    elif distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP
        device_ids = [dist_info.local_rank] if 'cuda' in dist_info.device else None
        # forward_sync_buffers=False (formerly broadcast_buffers): the model's only buffers are the causal
        # masks (non-persistent, built the same on every rank, read only by the manual attention path), so
        # broadcasting them before every synced forward would send n_layer x block_size^2 bytes that change
        # nothing; DDP still syncs them once, at construction
        model = DDP(model, device_ids=device_ids, forward_sync_buffers=False)
    if compile_model:
        print("compiling the model... (takes a ~minute)")
        # compile last: dynamo's DDPOptimizer splits the graph at DDP's gradient buckets, so each bucket's
        # all-reduce overlaps the rest of the backward, only when the module it compiles is the DDP one
        # (compiled inside DDP, the whole backward is one graph and the all-reduces wait for its end)
        model = torch.compile(model)
    return model


def mixed_precision_policy(dtype):
    """
    FSDP2's MixedPrecisionPolicy for the run's dtype. bfloat16/float16: every Block's weights are
    all-gathered in that dtype (half the bytes of float32) and used as they are, so autocast has no
    float32 weights to cast and caches no half-precision copy of the whole model; gradients are
    reduce-scattered in float32, so the sum over ranks loses nothing. The sharded weights, their gradients
    and AdamW's state stay float32. float32: no casting (the default policy).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if dtype == 'float32':
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=PTDTYPE[dtype], reduce_dtype=torch.float32)


def shard_model(model, dist_info, dtype='float32'):
    """
    FSDP2: shard every Block, then the root (which keeps wte/lm_head, one tied parameter, plus wpe and
    ln_f), over all ranks. Each rank then holds 1/world_size of every parameter, gradient and AdamW
    state; a Block's full weights are all-gathered just for its forward and backward. FSDP also moves
    the model to the device, one Block at a time, so the full model never has to fit there. Only rank 0
    needs real weights: the other ranks may pass the model built on the meta device, and every rank ends
    with its shards of rank 0's weights (and causal masks built for the device).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Rank 0 has the real weights (resumed, pretrained, or its own seeded init); the other ranks built the model
    # on the meta device (train.py's build_model), or hold pretrained weights of their own. Take rank 0's full
    # state dict before sharding replaces its parameters: set_model_state_dict sends each tensor from it to
    # every rank, which keeps its own shard, so rank 0's weights are the ones everywhere (as DDP's are)
    full_state = model.state_dict() if dist_info.rank == 0 else {}
    mesh = init_device_mesh(torch.device(dist_info.device).type, (dist_info.world_size,))
    mp_policy = mixed_precision_policy(dtype)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if any(t.device.type == 'meta' for t in model.parameters()):
        # storage for this rank's shards (and the masks), uninitialised; the tied wte/lm_head weight is one
        # parameter, so it gets one shard and stays tied
        model.to_empty(device=dist_info.device)
    set_model_state_dict(model, full_state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full_state
    # the causal masks are no state-dict entries: after to_empty they hold garbage, so build them again (on
    # every rank, so all of them run the same code)
    model.init_buffers(torch.device(dist_info.device))
    return model


def is_fsdp(model):
    from torch.distributed.fsdp import FSDPModule
    return isinstance(getattr(model, '_orig_mod', model), FSDPModule)


def local_parameters(model):
    """ The parameter values this rank stores: its shards under FSDP, the whole tensors otherwise. """
    from torch.distributed.tensor import DTensor
    return [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]


def local_param_count(model):
    """ The number of parameter values this rank stores (its shards under FSDP, all of them otherwise). """
    return sum(p.numel() for p in local_parameters(model))


def full_state_dicts(model, optimizer):
    """
    The model and optimizer state dicts of the plain, unsharded model (what ckpt.pt holds, so sample.py
    and a single-process or DDP resume read it unchanged). Under FSDP every shard is all-gathered, so
    every rank must call this at the same point, but only rank 0 (the one that saves) keeps the full
    tensors, in host RAM; the other ranks get (None, None).
    """
    if not is_fsdp(model):
        return model.state_dict(), optimizer.state_dict()
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    keep = dist.get_rank() == 0
    gathered = {}  # id(DTensor) -> full CPU tensor, so the tied wte/lm_head weight stays one tensor

    # One tensor at a time, in the same order on every rank (full_tensor is a collective): a rank holds at most
    # one full tensor on its device while it is gathered, and only rank 0 copies it into host RAM, where it
    # keeps 12 bytes per parameter (weights + AdamW's two moments) instead of every rank doing so. PyTorch's
    # get_model_state_dict/get_optimizer_state_dict(full_state_dict=True, cpu_offload=True) do the same
    # gather, but they would gather the tied weight twice into two tensors and key the optimizer state by
    # parameter name, which ckpt.pt's AdamW format would then need converting back from.
    def full(t):
        if not isinstance(t, DTensor):
            return (t.detach() if torch.is_tensor(t) else t) if keep else None
        if id(t) not in gathered:
            whole = t.full_tensor()
            gathered[id(t)] = whole.detach().cpu() if keep else None
            del whole  # before the next one is gathered
        return gathered[id(t)]
    model_state = {k: full(v) for k, v in model.state_dict(keep_vars=True).items()}
    # AdamW's own format: state keyed by parameter index, values sharded
    opt = optimizer.state_dict()
    opt_state = {i: {k: full(v) for k, v in s.items()} for i, s in sorted(opt['state'].items())}
    if not keep:
        return None, None
    return model_state, {'state': opt_state, 'param_groups': opt['param_groups']}


def load_optimizer_state(optimizer, state_dict):
    """
    optimizer.load_state_dict for a full (unsharded) state dict, sharding it for FSDP parameters: rank 0's
    values are scattered, so the other ranks never read theirs (with a memory-mapped checkpoint, their
    copies of the optimizer state are never paged in from disk).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor
    # an optimizer made of several (MuonWithAdamW): each its own state
    parts = getattr(optimizer, 'parts', None)
    if parts is not None and set(state_dict) == set(parts):
        for name, part in parts.items():
            load_optimizer_state(part, state_dict[name])
        return
    if parts is not None or 'state' not in state_dict:
        raise UserError("the checkpoint's optimizer state is not of this run's optimizer setting (adamw vs muon); "
                        "resume with the optimizer it was trained with")
    params = [p for group in optimizer.param_groups for p in group['params']]
    if any(isinstance(p, DTensor) for p in params):
        import torch.distributed as dist
        source = dist.get_rank() == 0

        def shard(v, p):
            # distribute_tensor scatters from rank 0 (src_data_rank=0); the others only give the shape
            full = v.to(p.device) if source else torch.empty(v.shape, dtype=v.dtype, device=p.device)
            return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=0)
        state = {}
        # the same order on every rank: collectives
        for i, s in sorted(state_dict['state'].items()):
            p = params[int(i)]
            state[i] = {k: shard(v, p) if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == p.shape
                        else v for k, v in s.items()}
        state_dict = dict(state_dict, state=state)
    optimizer.load_state_dict(state_dict)
    # AdamW keeps a loaded tensor as it is when it already has its parameter's device and dtype (a CPU run), so
    # with a memory-mapped checkpoint its state would stay pages of that file, whose disk space a later
    # atomic save (os.replace) could then not free while the run lasts. Take copies: AdamW rewrites every one
    # at its first step anyway, so they cost no more memory than the mapped pages would.
    loaded = {v.data_ptr() for s in state_dict['state'].values() for v in s.values() if torch.is_tensor(v)}
    for s in optimizer.state.values():
        for k, v in s.items():
            if torch.is_tensor(v) and v.data_ptr() in loaded:
                s[k] = v.clone()


@contextmanager
def grad_sync_context(model, sync):
    """
    Skip the gradient communication on all but the last micro-step of gradient accumulation: DDP's
    all-reduce (no_sync), or FSDP's reduce-scatter (gradients then accumulate unsharded on each rank).
    """
    if sync:
        yield
    elif hasattr(model, 'no_sync'):
        with model.no_sync():
            yield
    elif hasattr(model, 'set_requires_gradient_sync'):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield
