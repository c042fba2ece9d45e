"""
The processes of a run, as a script sees them: one process, or torchrun's ranks (DistInfo, start);
the agreements between ranks that keep them from waiting on each other forever (one verdict for every
rank, rank 0 decides and all learn the outcome, sums over ranks); and the model over them (wrap_model:
DDP or FSDP2, then torch.compile; the gradient sync of accumulation, the full state dicts a checkpoint
stores and their re-sharding on resume). For one process each of these is what it would be without
the others (fn(), the values themselves, the plain model); the process group, its collectives and the
DDP/FSDP code are process_group.py's, imported only where there are ranks. Signals, which must be
caught before torch is imported, live in signals.py.

Usage:
    from configurator import read_settings
    from nanogpt_plus.distributed import GROUP_SETTINGS, master_decides, start, wrap_model
    # the settings, read by every rank (a failure held), then torchrun's ranks (or a single process)
    # and one verdict on the settings
    cfg, failure, group = read_settings(DEFAULTS, sys.argv[1:], check_settings, __doc__, GROUP_SETTINGS)
    dist_info = start(failure, **group)
    master_decides(dist_info, lambda: write_the_file())           # rank 0 acts; every rank ends alike
    model = wrap_model(raw_model, dist_info, compile_model, parallelism='fsdp')
"""

import functools
import os
from contextlib import contextmanager, redirect_stdout
from dataclasses import dataclass

import torch

from nanogpt_plus.errors import MachineError, UserError
from nanogpt_plus.machine import check_environment, device_type_of, resolve_device


@dataclass
class DistInfo:
    # started by torchrun (RANK in the environment): a process group exists, even of one
    under_torchrun: bool
    rank: int
    local_rank: int
    world_size: int
    device: str

    @property
    def master(self):
        return self.rank == 0  # rank 0 is the process that logs and writes the checkpoints


def init_distributed(device='auto', backend='auto', timeout=0, join_timeout=120):
    """
    Under torchrun (RANK in the environment) join the process group (process_group.join: nccl for
    CUDA, gloo for CPU, each CUDA rank on cuda:LOCAL_RANK). Otherwise a single process on the
    resolved device. timeout: the seconds a collective may wait for the other ranks (the
    dist_timeout setting; 0 = PyTorch's default); join_timeout: the seconds joining waits for them.
    """
    device = resolve_device(device)
    if int(os.environ.get('RANK', -1)) == -1:
        return DistInfo(False, 0, 0, 1, device)
    from nanogpt_plus import process_group  # a run of several processes only
    rank, local_rank, world_size, device = process_group.join(device, device_type_of(device), backend,
                                                              timeout, join_timeout)
    return DistInfo(True, rank, local_rank, world_size, device)


# the settings a process group is formed with (start's keywords: DistInfo's device, the backend,
# the collectives' timeout, the wait for every rank to join), which a node that could not read its
# settings takes from its command line alone (configurator.read_settings)
GROUP_SETTINGS = ('device', 'backend', 'dist_timeout', 'join_timeout')
# the backend setting's choices: 'auto' = nccl for CUDA, gloo for CPU (init_distributed)
BACKENDS = ('auto', 'nccl', 'gloo')


def start(failure=None, device='auto', backend='auto', dist_timeout=0, join_timeout=120):
    """
    A script's process group, with one verdict on its settings and the environment variables the
    project reads (machine.check_environment): DistInfo. Reading the settings
    (configurator.read_settings) may fail on one node only: a config file only node 0 has, a value
    one machine refuses; that failure is held and given here. Under torchrun the group is formed
    all the same (where the settings failed, with GROUP_SETTINGS as the command line gives them:
    else their defaults, the other nodes' too unless a config file sets them), and every rank
    learns whether every rank read its settings (every_rank): a failure on any rank ends every rank
    at once with its exit code and its line on every node, instead of the ranks that read theirs
    waiting for it in their first collective until the group's timeout (30 minutes for gloo).
    A node whose device or backend can't be used (--device=cuda where CUDA is missing, nccl on a
    CPU) never raises before joining: it joins on the CPU with gloo, which works on every machine
    (the other nodes' group then meets it where they use gloo too), and says why in the verdict.
    """
    if failure is not None and int(os.environ.get('RANK', -1)) == -1:
        raise failure  # a single process: no one waits for it
    if int(os.environ.get('RANK', -1)) != -1:
        try:
            check_group_settings(device, backend)
        except UserError as e:
            failure = failure or e
        if failure is not None:
            device, backend = 'cpu', 'gloo'  # joins anywhere: the verdict says why this node stops
    dist_info = init_distributed(device, backend, dist_timeout, join_timeout)
    every_rank(dist_info, functools.partial(_start_verdict, failure))
    return dist_info


def check_group_settings(device, backend):
    """ Refuse a device this machine lacks, or a backend that can't drive the device. """
    device_type = device_type_of(resolve_device(device))
    if backend == 'nccl' and device_type != 'cuda':
        raise MachineError(f"--backend=nccl needs CUDA, and this node's device is {device_type}: "
                           f"use --backend=gloo (or auto) on a CPU node, or --device=cuda where CUDA works")


def _start_verdict(failure):
    """ A rank's part in start's verdict: its settings' failure, else its environment variables. """
    _raise(failure)
    check_environment()


def _raise(error):
    """ Raise error, if any (a rank's part in a verdict on what it met before). """
    if error is not None:
        raise error


def destroy_distributed():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def several_processes():
    """
    Whether this process is one of several torchrun workers (read from the environment: the group
    may be gone).
    """
    return int(os.environ.get('WORLD_SIZE', '1')) > 1


def lost_peer(error):
    """
    Whether error is a collective failing because another rank is gone (gloo) or unreachable (nccl).
    """
    import torch.distributed as dist
    # DistBackendError (nccl errors, timeouts), DistNetworkError, ...
    if isinstance(error, dist.DistError):
        return True
    # gloo raises a plain RuntimeError when the peer's socket closes
    return isinstance(error, RuntimeError) and any(
        s in str(error)
        for s in ('Connection closed by peer', 'Connection reset by peer', 'Broken pipe'))


def master_decides(dist_info, fn):
    """
    Run fn() on rank 0 only (writing a checkpoint, say) and let every rank end the same way: when it
    raises, rank 0 raises the error and the others PeerFailed with its exit code, instead of walking
    on into the next collective that rank 0 will never join, and the first process of every other
    node says rank 0's line too (whoever reads that node's log sees why the run ended). Costs one
    broadcast (with several processes).
    """
    if not dist_info.under_torchrun:  # one process: nobody to tell
        fn()
        return
    from nanogpt_plus import process_group
    process_group.master_decides(dist_info, fn)


def fail_everywhere(error, dist_info):
    """
    Raise a UserError that every rank has decided on alike: rank 0 reports it, the others stop with
    its exit code, and the first process of every other node says it too.
    """
    if dist_info.master:
        raise error
    from nanogpt_plus import process_group
    raise process_group.peer_failed(error)


def all_reduce_sum(values, dist_info):
    """ Sum over ranks of a list of floats (returns them unchanged in a single process). """
    if not dist_info.under_torchrun:
        return list(values)
    from nanogpt_plus import process_group
    return process_group.all_reduce_sum(values, dist_info.device)


def all_reduce_mean(values, dist_info):
    """ Mean over ranks of a list of floats (returns them unchanged in a single process). """
    return [v / dist_info.world_size for v in all_reduce_sum(values, dist_info)]


def accumulation_per_rank(gradient_accumulation_steps, dist_info):
    """
    The micro-steps each of world_size processes runs, so that the global batch (batch_size x
    gradient_accumulation_steps) is the same for any number of processes. Where it doesn't split
    evenly (nanoGPT's Shakespeare config has 1 micro-step, and 2 processes can't share it), every
    process runs the rounded-up share and rank 0 says once what the iteration then holds: a run on 2
    processes of a 1-step config is a run, not a refusal.
    """
    w = dist_info.world_size
    per_rank = -(-gradient_accumulation_steps // w)  # ceil
    if per_rank * w != gradient_accumulation_steps and dist_info.master:
        print(
            f"gradient_accumulation_steps={gradient_accumulation_steps} does not split among {w} processes: "
            f"each runs {per_rank}, so an iteration is {per_rank * w} micro-batches, not "
            f"{gradient_accumulation_steps} (give a multiple of {w} to choose the global batch yourself)"
        )
    return per_rank


def every_rank(dist_info, fn, agree=None):
    """
    Run fn() on every rank (each checks what only it can see: a file on its own node's disk) and
    reach one verdict: when fn raises on any rank, the lowest such rank raises its error (the one
    line, naming the rank and host when the ranks disagreed), every other rank stops with the same
    exit code, instead of walking on into a collective the failed rank never joins, and the first
    process of every other node prints that same line too (whoever watches one node's log sees why
    the run ended). Returns fn()'s result.
    agree: {name: what to do} for entries of fn's result (a dict of plain values: the resolved
    settings, the commit, the checkpoint resumed from, the dataset's sizes) that must be the same on
    every rank; one that differs from rank 0's ends every rank the same way, in one line naming what
    differs, where, and agree[name] (or the line a function there writes:
    process_group._first_difference). One all_gather_object with several processes.
    """
    if not dist_info.under_torchrun:
        return fn()  # one process: its own verdict, nothing to agree on
    from nanogpt_plus import process_group
    return process_group.every_rank(dist_info, fn, agree)


@contextmanager
def said_once(dist_info):
    """
    Inside, the lines printed to stdout are rank 0's only; the other ranks' are dropped. For the
    set-up lines every rank would print alike (the model's parameter count, the optimizer's groups):
    under torchrun the ranks share one stdout, whose lines then repeat and can run into each other
    ("...802,816 parametersnum decayed..."). Errors go to stderr and are untouched; one process prints
    as it always did.
    """
    if dist_info.master:
        yield
        return
    with open(os.devnull, 'w') as sink, redirect_stdout(sink):
        yield


def same_everywhere(dist_info, describe, agree):
    """
    every_rank(dist_info, describe, agree) where there are ranks to compare: each rank describes
    what it starts from (its code, checkpoint, data: digests that read files and ask git), and one
    that differs from rank 0's ends every rank in one line. A single process has no one to differ
    from, so it describes nothing.
    """
    if dist_info.under_torchrun:
        every_rank(dist_info, describe, agree=agree)


def broadcast_object(obj, dist_info, src=0):
    """
    rank src's obj on every rank (pickled over the process group); obj itself in a single process.
    """
    if not dist_info.under_torchrun:
        return obj
    from nanogpt_plus import process_group
    return process_group.broadcast_object(obj, dist_info, src)


# -----------------------------------------------------------------------------
# the model over the processes: DDP or FSDP2 around the plain model, then torch.compile; the
# gradient sync of accumulation; the full state dicts a checkpoint stores, re-sharded on resume

def wrap_model(model, dist_info, compile_model=False, parallelism='ddp', dtype='float32'):
    """
    DistributedDataParallel or FSDP2 around a plain model (process_group.spread_model), then
    torch.compile; returns the model to train. parallelism='fsdp' (under torchrun) shards the model
    in place with FSDP2 instead of DDP, so create the optimizer after this call: its parameters are
    the sharded ones. dtype (the run's 'float32', 'bfloat16' or 'float16') sets FSDP's mixed
    precision. The caller keeps `model` itself for checkpoints: it never gets the
    '_orig_mod.'/'module.' prefixes of the wrappers.
    """
    if dist_info is not None and dist_info.under_torchrun:
        from nanogpt_plus import process_group
        model = process_group.spread_model(model, dist_info, parallelism, dtype)
    if compile_model:
        print("compiling the model... (takes a ~minute)")
        # compile last: dynamo's DDPOptimizer splits the graph at DDP's gradient buckets, so each
        # bucket's all-reduce overlaps the rest of the backward, only when the module it compiles is
        # the DDP one (compiled inside DDP, the whole backward is one graph and the all-reduces wait
        # for its end)
        model = torch.compile(model)
    return model


def in_process_group():
    """
    Whether this process has joined a process group (under torchrun it has, even a group of one):
    without one, no model or optimizer state is sharded.
    """
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def local_parameters(model):
    """
    The parameter values this rank stores: its shards under FSDP, the whole tensors otherwise.
    """
    if not in_process_group():
        return list(model.parameters())
    from nanogpt_plus import process_group
    return process_group.local_parameters(model)


def local_param_count(model):
    """
    The number of parameter values this rank stores (its shards under FSDP, all of them otherwise).
    """
    return sum(p.numel() for p in local_parameters(model))


def full_state_dicts(model, optimizer):
    """
    The model and optimizer state dicts of the plain, unsharded model (what ckpt.pt holds, so
    sample.py and a single-process or DDP resume read it unchanged). Under FSDP every shard is
    all-gathered, so every rank must call this at the same point, but only rank 0 (the one that
    saves) keeps the full tensors, in host RAM; the other ranks get (None, None).
    """
    if not in_process_group():
        return model.state_dict(), optimizer.state_dict()
    from nanogpt_plus import process_group
    return process_group.full_state_dicts(model, optimizer)


def load_optimizer_state(optimizer, state_dict):
    """
    optimizer.load_state_dict for a full (unsharded) state dict, sharding it for FSDP parameters:
    rank 0's values are scattered, so the other ranks never read theirs (with a memory-mapped
    checkpoint, their copies of the optimizer state are never paged in from disk).
    """
    # an optimizer made of several (MuonWithAdamW): each its own state
    parts = getattr(optimizer, 'parts', None)
    if parts is not None and set(state_dict) == set(parts):
        for name, part in parts.items():
            load_optimizer_state(part, state_dict[name])
        return
    if parts is not None or 'state' not in state_dict:
        raise UserError(
            "the checkpoint's optimizer state is not of this run's optimizer setting (adamw vs muon); "
            "resume with the optimizer it was trained with")
    if in_process_group():  # FSDP's parameters are sharded: so is their state
        from nanogpt_plus import process_group
        state_dict = process_group.sharded_optimizer_state(optimizer, state_dict)
    optimizer.load_state_dict(state_dict)
    # AdamW keeps a loaded tensor as it is when it already has its parameter's device and dtype (a
    # CPU run), so with a memory-mapped checkpoint its state would stay pages of that file, whose
    # disk space a later atomic save (os.replace) could then not free while the run lasts. Take
    # copies: AdamW rewrites every one at its first step anyway, so they cost no more memory than
    # the mapped pages would.
    loaded = {
        v.data_ptr()
        for s in state_dict['state'].values()
        for v in s.values() if torch.is_tensor(v)
    }
    for s in optimizer.state.values():
        for k, v in s.items():
            if torch.is_tensor(v) and v.data_ptr() in loaded:
                s[k] = v.clone()


@contextmanager
def grad_sync_context(model, sync):
    """
    Skip the gradient communication on all but the last micro-step of gradient accumulation: DDP's
    all-reduce (no_sync), or FSDP's reduce-scatter (gradients then accumulate unsharded on each
    rank).
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
