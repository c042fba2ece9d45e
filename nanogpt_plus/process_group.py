"""
What only a run of several processes (torchrun's ranks) does, behind distributed.py's functions: joining
torchrun's process group; the collectives of the verdicts that keep the ranks from waiting on each other
forever (one verdict for every rank, rank 0 decides and all learn the outcome, a failed rank's line on
every node, sums over ranks); and the model spread over the ranks (DDP or FSDP2, the full state dicts
that rank 0 saves, an optimizer state sharded again on resume). distributed.py imports it where there
are ranks: a run of one process forms no group and never loads it.

Usage (through distributed.py, which says what each verdict means):
    from nanogpt_plus.distributed import every_rank, master_decides, wrap_model
"""

import datetime
import os
import socket

import torch
import torch.distributed as dist

from nanogpt_plus.errors import (
    EXIT_USER_ERROR,
    ConfigError,
    ConfigFileError,
    MachineError,
    PeerFailed,
    UserError,
    error_line,
    exit_code,
)


def join(device, device_type, backend='auto', timeout=0, join_timeout=120):
    """
    Join torchrun's process group (RANK, LOCAL_RANK, WORLD_SIZE in the environment): nccl for CUDA,
    gloo for CPU, each CUDA rank on cuda:LOCAL_RANK. Returns (rank, local_rank, world_size, device).
    timeout: the seconds a collective may wait for the other ranks (0 = PyTorch's default).
    join_timeout: the seconds this rank waits for every other rank to join (the store's and the
    backend's rendezvous): a rank whose process ended before joining (killed in its first moments,
    on a node whose worker never started) ends the others in one line that names it, not after the
    30 minutes of gloo's default timeout.
    """
    rank = int(os.environ['RANK'])
    local_rank = int(os.environ['LOCAL_RANK'])
    world_size = int(os.environ['WORLD_SIZE'])
    if device_type == 'cuda':
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    elif device_type == 'mps':
        raise UserError(
            "distributed training on MPS is not supported; use --device=cpu or a CUDA machine")
    if backend == 'auto':
        backend = 'nccl' if device_type == 'cuda' else 'gloo'
    if not dist.is_initialized():
        arrivals = _Arrivals(rank, world_size, join_timeout)
        kwargs = dict(device_id=torch.device(device)) if backend == 'nccl' else {}
        # the whole of joining waits join_timeout at most (init_process_group's timeout is the
        # store's and the rendezvous'), then the collectives wait timeout
        kwargs['timeout'] = datetime.timedelta(seconds=join_timeout)
        try:
            dist.init_process_group(backend=backend, **kwargs)
        except Exception as e:  # a timeout (DistStoreError, RuntimeError): whose?
            absent = arrivals.absent()
            if not absent:
                raise
            raise UserError(never_joined(absent, join_timeout)) from e
        # PyTorch's defaults where timeout is 0: 10 minutes for nccl (None where torch has no
        # nccl), 30 for the others
        from torch.distributed import constants
        collective = datetime.timedelta(seconds=timeout) if timeout else (
            backend == 'nccl' and constants.default_pg_nccl_timeout or constants.default_pg_timeout)
        dist.distributed_c10d._set_pg_timeout(collective)
    return rank, local_rank, world_size, device


def never_joined(absent, join_timeout):
    """ The line for ranks that had not joined the process group join_timeout seconds after this one. """
    per_node = int(os.environ.get('LOCAL_WORLD_SIZE', '1')) or 1
    nodes = sorted({r // per_node for r in absent})
    ranks = ', '.join(str(r) for r in absent)
    names = ', '.join(str(n) for n in nodes)
    return (f"node {names} never joined the process group (rank {ranks}, waited "
            f"{join_timeout} s): its process ended or stalled before joining; see node {names}'s "
            f"log (torchrun's summary there says how its worker ended), then start the run again on "
            f"every node (--join_timeout=S waits longer for a node that is slow to start)")


class _Arrivals:
    """
    Who has come to join: every rank marks its arrival in torchrun's store (the agent's, at
    MASTER_ADDR:MASTER_PORT) before joining, so a rank whose join timed out can say which ranks
    never came. Keys are of this run and restart (TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT).
    Where the store can't be reached the marks are skipped: the join then fails with PyTorch's error.
    """

    def __init__(self, rank, world_size, join_timeout):
        self.world_size = world_size
        run = os.environ.get('TORCHELASTIC_RUN_ID', 'none')
        restart = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')
        self.prefix = f"nanogpt_plus/arrived/{run}/{restart}/"
        self.store = None
        if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True':
            return  # no torchrun agent's store to mark: init_process_group makes the store itself
        try:
            self.store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']),
                                       is_master=False,
                                       timeout=datetime.timedelta(seconds=join_timeout))
            self.store.set(self.prefix + str(rank), socket.gethostname())
        except Exception:  # no store to mark (not torchrun's), or not reachable
            self.store = None

    def absent(self):
        """ The ranks that never marked their arrival (none where there was no store). """
        if self.store is None:
            return []
        try:
            return [r for r in range(self.world_size) if not self.store.check([self.prefix + str(r)])]
        except Exception:
            return []


# -----------------------------------------------------------------------------
# the verdicts' collectives (distributed.every_rank, master_decides, fail_everywhere, all_reduce_sum,
# broadcast_object; signals.py's end_together)

def master_decides(dist_info, fn):
    """ distributed.master_decides with several processes: rank 0 runs fn(), one broadcast tells the others. """
    error = None
    if dist_info.master:
        try:
            fn()
        # every kind, a second Ctrl-C too: the other ranks must hear of it first
        except BaseException as e:
            error = e
    box = [None if error is None else (exit_code(error), _line_for_the_others(error))]
    dist.broadcast_object_list(box, src=0)
    outcome = box[0]
    if error is not None:
        raise error
    if outcome is not None:
        code, line = outcome
        # rank 0 alone read or wrote what failed (its file, its disk): another node's log says whose
        said = f"on node 0 (rank 0, whose files these are): {line}"
        raise PeerFailed("rank 0 failed", code, say=_said_on_this_node(said, source_node='0'),
                         line=line)


def peer_failed(error):
    """
    What a rank other than 0 raises for an error every rank decided on alike (distributed.fail_everywhere):
    rank 0's exit code, and its line where this is the first process of another node.
    """
    return PeerFailed(str(error), exit_code(error), say=_said_on_this_node(str(error), '0'),
                      line=str(error))


def _line_for_the_others(error):
    """
    What the other nodes say of an error rank 0 met alone: its line (a user's error, or the one of
    a run that has nothing to do), a crash in short; None for a signal (every node got its own).
    """
    code = exit_code(error)
    if code in (0, EXIT_USER_ERROR):
        return str(error)
    if isinstance(error, Exception):
        return f"rank 0 failed ({error_line(error)}); its log has the traceback"
    return None


def _said_on_this_node(line, source_node):
    """
    line, where this process is the first of its node (local rank 0) and another node's than the
    failed rank's (whose log has the line already): run_main prints it (PeerFailed's say). None
    elsewhere, so a node with several processes says it once.
    """
    first = os.environ.get('LOCAL_RANK', '0') == '0'
    return line if first and os.environ.get('GROUP_RANK', '0') != source_node else None


def all_reduce_sum(values, device):
    """ Sum over ranks of a list of floats, as float64 on device. """
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def every_rank(dist_info, fn, agree=None):
    """ distributed.every_rank with several processes: every rank's outcome of fn(), one verdict. """
    error = None
    result = None
    try:
        result = fn()
    except Exception as e:  # every kind: the other ranks must hear of it before anyone raises
        error = e
    shown = {k: result[k] for k in agree} if agree and error is None else None
    outcomes = [None] * dist_info.world_size
    dist.all_gather_object(outcomes, _outcome(error, shown))
    failed = [r for r, outcome in enumerate(outcomes) if outcome[0] is not None]
    if failed:
        first = failed[0]
        message = outcomes[first][3]
        # what one node met, another didn't: where, and what differs between them
        if len(failed) < dist_info.world_size and outcomes[first][0] == EXIT_USER_ERROR:
            fine = sorted({o[1] for o in outcomes if o[0] is None})
            message = (f"{message} [rank {first} on {outcomes[first][1]}; ranks on {', '.join(fine)} "
                       f"{_WHY_ONE_NODE[outcomes[first][5]]}]")
        if dist_info.rank == first and message == str(error):
            raise error
        if dist_info.rank == first:
            raise type(error)(message) from None
        stop_with(dist_info, outcomes, first, message, outcomes[first][0])
    if agree:
        difference = _first_difference(outcomes, agree)
        if difference:
            stop_with(dist_info, outcomes, 0, difference, EXIT_USER_ERROR,
                      error=UserError(difference))
    return result


def _outcome(error, shown=None):
    """
    What a rank tells the others in a verdict: (its exit code, None when it is fine; its host; its
    node, torchrun's node rank; its error's line; shown: the values that must agree; what the error
    is about: a key of _WHY_ONE_NODE).
    """
    code = None if error is None else exit_code(error)
    node = os.environ.get('GROUP_RANK', '0')
    return (code, socket.gethostname(), node, str(error) if error else '', shown, _about(error))


# what a user error met on some nodes only says of the others, by what it is about (_about)
_WHY_ONE_NODE = {
    'files': ("found what they needed: every node must have the same files at the same paths (a shared "
              "file system, or the same copy on each node), see docs/training.md#many-machines"),
    'settings': "read theirs: every node must be given the same command line",
    'machine': "passed this check: fix this node's machine or environment, or leave the node out",
}


def _about(error):
    """ What a user error is about: a node's machine, its command line's settings, else its files. """
    if isinstance(error, MachineError):
        return 'machine'
    if isinstance(error, ConfigError) and not isinstance(error, ConfigFileError):
        return 'settings'
    return 'files'


def end_together(dist_info, failure, group=None):
    """
    Once an agreement (signals.py's, every step) has shown that some rank met a failure mid-run (a
    bad token id in its next batch): every rank ends, the lowest such rank raising its failure, the
    others stopping with its exit code, and the first process of every other node saying its line
    (stop_with). Every rank calls this at the same point: one all_gather_object over group.
    """
    outcomes = [None] * dist_info.world_size
    dist.all_gather_object(outcomes, _outcome(failure), group=group)
    first = next(r for r, outcome in enumerate(outcomes) if outcome[0] is not None)
    if dist_info.rank == first:
        raise failure
    stop_with(dist_info, outcomes, first, outcomes[first][3], outcomes[first][0])


def stop_with(dist_info, outcomes, source, message, code, error=None):
    """
    End this rank after rank `source` failed with message (or, given error, every rank alike): the
    lowest rank raises it, the others stop with its exit code, and the first process of every node
    that is not the raiser's says it too (PeerFailed's `say`, printed by run_main).
    """
    nodes = [o[2] for o in outcomes]
    if error is not None and dist_info.rank == 0:
        raise error
    here_first = nodes.index(nodes[dist_info.rank]) == dist_info.rank
    say = message if here_first and nodes[dist_info.rank] != nodes[source] else None
    raise PeerFailed(f"rank {source} failed", code, say=say, line=message)


def _first_difference(outcomes, agree):
    """
    The line for the first entry of agree that is not the same on every rank as on rank 0, or None.
    An entry whose remedy is a function writes its own line from every rank's value and place
    ((host, node rank) per rank), or returns None to leave the difference to a later entry (a
    checkpoint read from another path: the settings say why).
    """
    where = [f"rank {r} on {o[1]}" for r, o in enumerate(outcomes)]
    left = None  # an entry that left its difference to a later one, said if none differs
    for name, remedy in agree.items():
        values = [o[4][name] for o in outcomes]
        if callable(remedy) and any(value != values[0] for value in values):
            line = remedy(values, [(o[1], o[2]) for o in outcomes])
            if line:
                return line
            left = left or name
            continue
        for r, value in enumerate(values):
            if value == values[0]:
                continue
            if isinstance(value, dict) and isinstance(values[0], dict):
                keys = sorted(k for k in value.keys() | values[0].keys()
                              if value.get(k) != values[0].get(k))
                shown = ', '.join(
                    f"{k}={values[0].get(k)!r} on {where[0]} but {value.get(k)!r} on {where[r]}"
                    for k in keys[:3])
                return f"the ranks differ in {name}: {shown}; {remedy}"
            return f"the ranks differ in {name}: {values[0]!r} on {where[0]} but {value!r} on {where[r]}; {remedy}"
    if left:
        return f"the ranks differ in {left}; every node must start from the same files and settings"
    return None


def broadcast_object(obj, dist_info, src=0):
    """ rank src's obj on every rank, pickled over the process group. """
    box = [obj if dist_info.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# -----------------------------------------------------------------------------
# the model over the ranks: DDP or FSDP2 around the plain model, the full state dicts a checkpoint
# stores, re-sharded on resume

def spread_model(model, dist_info, parallelism='ddp', dtype='float32'):
    """
    distributed.wrap_model's part under torchrun: FSDP2 shards the model in place
    (parallelism='fsdp'), else DistributedDataParallel wraps it; returns the module to compile.
    """
    if parallelism == 'fsdp':
        # in place: the compiled module is the sharded one
        return shard_model(model, dist_info, dtype)
    from torch.nn.parallel import DistributedDataParallel as DDP
    device_ids = [dist_info.local_rank] if 'cuda' in dist_info.device else None
    # forward_sync_buffers=False (formerly broadcast_buffers): the model's only buffers are the
    # causal masks (non-persistent, built the same on every rank, read only by the manual
    # attention path), so broadcasting them before every synced forward would send n_layer x
    # block_size^2 bytes that change nothing; DDP still syncs them once, at construction
    return DDP(model, device_ids=device_ids, forward_sync_buffers=False)


def mixed_precision_policy(dtype):
    """
    FSDP2's MixedPrecisionPolicy for the run's dtype. bfloat16/float16: every Block's weights are
    all-gathered in that dtype (half the bytes of float32) and used as they are, so autocast has no
    float32 weights to cast and caches no half-precision copy of the whole model; gradients are
    reduce-scattered in float32, so the sum over ranks loses nothing. The sharded weights, their
    gradients and AdamW's state stay float32. float32: no casting (the default policy).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    if dtype == 'float32':
        return MixedPrecisionPolicy()
    return MixedPrecisionPolicy(param_dtype=getattr(torch, dtype), reduce_dtype=torch.float32)


def shard_model(model, dist_info, dtype='float32'):
    """
    FSDP2: shard every Block, then the root (which keeps wte/lm_head, one tied parameter, plus wpe
    and ln_f), over all ranks. Each rank then holds 1/world_size of every parameter, gradient and
    AdamW state; a Block's full weights are all-gathered just for its forward and backward. FSDP
    also moves the model to the device, one Block at a time, so the full model never has to fit
    there. Only rank 0 needs real weights: the other ranks may pass the model built on the meta
    device, and every rank ends with its shards of rank 0's weights (and causal masks built for the
    device).
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Rank 0 has the real weights (resumed, pretrained, or its own seeded init); the other ranks
    # built the model on the meta device (train.py's build_model), or hold pretrained weights of
    # their own. Take rank 0's full state dict before sharding replaces its parameters:
    # set_model_state_dict sends each tensor from it to every rank, which keeps its own shard, so
    # rank 0's weights are the ones everywhere (as DDP's are)
    full_state = model.state_dict() if dist_info.rank == 0 else {}
    mesh = init_device_mesh(torch.device(dist_info.device).type, (dist_info.world_size,))
    mp_policy = mixed_precision_policy(dtype)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    if any(t.device.type == 'meta' for t in model.parameters()):
        # storage for this rank's shards (and the masks), uninitialised; the tied wte/lm_head weight
        # is one parameter, so it gets one shard and stays tied
        model.to_empty(device=dist_info.device)
    set_model_state_dict(model, full_state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    del full_state
    # the causal masks are no state-dict entries: after to_empty they hold garbage, so build them
    # again (on every rank, so all of them run the same code)
    model.init_buffers(torch.device(dist_info.device))
    return model


def is_fsdp(model):
    from torch.distributed.fsdp import FSDPModule
    return isinstance(getattr(model, '_orig_mod', model), FSDPModule)


def local_parameters(model):
    """
    The parameter values this rank stores: its shards under FSDP, the whole tensors otherwise.
    """
    from torch.distributed.tensor import DTensor
    return [p.to_local() if isinstance(p, DTensor) else p for p in model.parameters()]


def full_state_dicts(model, optimizer):
    """
    The model and optimizer state dicts of the plain, unsharded model (what ckpt.pt holds, so
    sample.py and a single-process or DDP resume read it unchanged). Under FSDP every shard is
    all-gathered, so every rank must call this at the same point, but only rank 0 (the one that
    saves) keeps the full tensors, in host RAM; the other ranks get (None, None).
    """
    if not is_fsdp(model):
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.tensor import DTensor
    keep = dist.get_rank() == 0
    gathered = {}  # id(DTensor) -> full CPU tensor, so the tied wte/lm_head weight stays one tensor

    # One tensor at a time, in the same order on every rank (full_tensor is a collective): a rank
    # holds at most one full tensor on its device while it is gathered, and only rank 0 copies it
    # into host RAM, where it keeps 12 bytes per parameter (weights + AdamW's two moments) instead
    # of every rank doing so. PyTorch's
    # get_model_state_dict/get_optimizer_state_dict(full_state_dict=True, cpu_offload=True) do the
    # same gather, but they would gather the tied weight twice into two tensors and key the
    # optimizer state by parameter name, which ckpt.pt's AdamW format would then need converting
    # back from.
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


def sharded_optimizer_state(optimizer, state_dict):
    """
    A full (unsharded) optimizer state dict with the values of FSDP parameters (DTensors) sharded
    like them: rank 0's values are scattered, so the other ranks never read theirs (with a
    memory-mapped checkpoint, their copies of the optimizer state are never paged in from disk). The
    same dict where no parameter is sharded (DDP).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor
    params = [p for group in optimizer.param_groups for p in group['params']]
    if not any(isinstance(p, DTensor) for p in params):
        return state_dict
    source = dist.get_rank() == 0

    def shard(v, p):
        # distribute_tensor scatters from rank 0 (src_data_rank=0); the others only give the
        # shape
        full = v.to(p.device) if source else torch.empty(
            v.shape, dtype=v.dtype, device=p.device)
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=0)
    state = {}
    # the same order on every rank: collectives
    for i, s in sorted(state_dict['state'].items()):
        p = params[int(i)]
        state[i] = {
            k:
            shard(v, p)
            if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == p.shape else v
            for k, v in s.items()
        }
    return dict(state_dict, state=state)
