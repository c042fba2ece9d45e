"""
The processes of a run: joining torchrun's process group, and the small agreements between ranks that keep
them from waiting on each other forever (rank 0 decides and all ranks learn the outcome; sums over ranks).

Usage:
    from nanogpt_plus.distributed import init_distributed, master_decides
    dist_info = init_distributed(device='auto', backend='auto')   # torchrun's ranks, or a single process
    master_decides(dist_info, lambda: write_the_file())           # rank 0 acts; every rank ends alike
"""

import datetime
import os
import socket
from dataclasses import dataclass

import torch

from nanogpt_plus.device import device_type_of, resolve_device
from nanogpt_plus.errors import EXIT_USER_ERROR, PeerFailed, UserError, exit_code


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


def init_distributed(device='auto', backend='auto', timeout=0):
    """
    Under torchrun (RANK in the environment) join the process group: nccl for CUDA, gloo for CPU, each
    CUDA rank on cuda:LOCAL_RANK. Otherwise a single process on the resolved device. timeout: the seconds a
    collective may wait for the other ranks (the dist_timeout setting; 0 = PyTorch's default).
    """
    import torch.distributed as dist
    device = resolve_device(device)
    if int(os.environ.get('RANK', -1)) == -1:
        return DistInfo(False, 0, 0, 1, device)
    rank = int(os.environ['RANK'])
    local_rank = int(os.environ['LOCAL_RANK'])
    world_size = int(os.environ['WORLD_SIZE'])
    device_type = device_type_of(device)
    if device_type == 'cuda':
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    elif device_type == 'mps':
        raise UserError("distributed training on MPS is not supported; use --device=cpu or a CUDA machine")
    if backend == 'auto':
        backend = 'nccl' if device_type == 'cuda' else 'gloo'
    if not dist.is_initialized():
        kwargs = dict(device_id=torch.device(device)) if backend == 'nccl' else {}
        if timeout:
            kwargs['timeout'] = datetime.timedelta(seconds=timeout)
        dist.init_process_group(backend=backend, **kwargs)
    return DistInfo(True, rank, local_rank, world_size, device)


def destroy_distributed():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def several_processes():
    """ Whether this process is one of several torchrun workers (read from the environment: the group may be gone). """
    return int(os.environ.get('WORLD_SIZE', '1')) > 1


def lost_peer(error):
    """ Whether error is a collective failing because another rank is gone (gloo) or unreachable (nccl). """
    import torch.distributed as dist
    # DistBackendError (nccl errors, timeouts), DistNetworkError, ...
    if isinstance(error, dist.DistError):
        return True
    # gloo raises a plain RuntimeError when the peer's socket closes
    return isinstance(error, RuntimeError) and any(
        s in str(error) for s in ('Connection closed by peer', 'Connection reset by peer', 'Broken pipe'))


def master_decides(dist_info, fn):
    """
    Run fn() on rank 0 only (writing a checkpoint, say) and let every rank end the same way: when it raises,
    rank 0 raises the error and the others PeerFailed, instead of walking on into the next collective that
    rank 0 will never join. Costs one broadcast (with several processes).
    """
    error = None
    if dist_info.master:
        try:
            fn()
        # every kind, a second Ctrl-C too: the other ranks must hear of it first
        except BaseException as e:
            error = e
    outcome = None if error is None else exit_code(error)
    if dist_info.under_torchrun:
        import torch.distributed as dist
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        outcome = box[0]
    if error is not None:
        raise error
    if outcome is not None:
        raise PeerFailed("rank 0 failed", outcome)


def fail_everywhere(error, dist_info):
    """ Raise a UserError that every rank has decided on alike: rank 0 reports it, the others stop quietly. """
    if dist_info.master:
        raise error
    raise PeerFailed(str(error), exit_code(error))


def all_reduce_sum(values, dist_info):
    """ Sum over ranks of a list of floats (returns them unchanged in a single process). """
    if not dist_info.under_torchrun:
        return list(values)
    import torch.distributed as dist
    t = torch.tensor(values, dtype=torch.float64, device=dist_info.device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_mean(values, dist_info):
    """ Mean over ranks of a list of floats (returns them unchanged in a single process). """
    return [v / dist_info.world_size for v in all_reduce_sum(values, dist_info)]


def accumulation_per_rank(gradient_accumulation_steps, dist_info):
    """
    The micro-steps each of world_size processes runs, so that the global batch (batch_size x
    gradient_accumulation_steps) is the same for any number of processes. Where it doesn't split evenly
    (nanoGPT's Shakespeare config has 1 micro-step, and 2 processes can't share it), every process runs the
    rounded-up share and rank 0 says once what the iteration then holds: a run on 2 processes of a 1-step
    config is a run, not a refusal.
    """
    w = dist_info.world_size
    per_rank = -(-gradient_accumulation_steps // w)  # ceil
    if per_rank * w != gradient_accumulation_steps and dist_info.master:
        print(f"gradient_accumulation_steps={gradient_accumulation_steps} does not split among {w} processes: "
              f"each runs {per_rank}, so an iteration is {per_rank * w} micro-batches, not "
              f"{gradient_accumulation_steps} (give a multiple of {w} to choose the global batch yourself)")
    return per_rank


def every_rank(dist_info, fn, agree=None):
    """
    Run fn() on every rank (each checks what only it can see: a file on its own node's disk) and reach one
    verdict: when fn raises on any rank, the lowest such rank raises its error (the one line, naming the rank and
    host when the ranks disagreed), every other rank stops with the same exit code, instead of walking on into a
    collective the failed rank never joins, and the first process of every other node prints that same line too
    (whoever watches one node's log sees why the run ended). Returns fn()'s result.
    agree: {name: what to do} for entries of fn's result (a dict of plain values: the resolved settings, the
    commit, the checkpoint resumed from, the dataset's sizes) that must be the same on every rank; one that
    differs from rank 0's ends every rank the same way, in one line naming what differs, where, and agree[name].
    One all_gather_object with several processes.
    """
    error = None
    result = None
    try:
        result = fn()
    except Exception as e:  # every kind: the other ranks must hear of it before anyone raises
        error = e
    if not dist_info.under_torchrun:
        if error is not None:
            raise error
        return result
    import torch.distributed as dist
    code = None if error is None else exit_code(error)
    shown = {k: result[k] for k in agree} if agree and error is None else None
    mine = (code, socket.gethostname(), os.environ.get('GROUP_RANK', '0'), str(error) if error else '', shown)
    outcomes = [None] * dist_info.world_size
    dist.all_gather_object(outcomes, mine)
    failed = [r for r, outcome in enumerate(outcomes) if outcome[0] is not None]
    if failed:
        first = failed[0]
        message = outcomes[first][3]
        # a file one node has, another lacks
        if len(failed) < dist_info.world_size and outcomes[first][0] == EXIT_USER_ERROR:
            fine = sorted({o[1] for o in outcomes if o[0] is None})
            message = (f"{message} [rank {first} on {outcomes[first][1]}; ranks on {', '.join(fine)} found what "
                       f"they needed: every node must see this path (a shared file system, or a copy on each "
                       f"node), see docs/training.md#many-machines]")
        if dist_info.rank == first and message == str(error):
            raise error
        if dist_info.rank == first:
            raise type(error)(message) from None
        stop_with(dist_info, outcomes, first, message, outcomes[first][0])
    if agree:
        difference = _first_difference(outcomes, agree)
        if difference:
            stop_with(dist_info, outcomes, 0, difference, EXIT_USER_ERROR, error=UserError(difference))
    return result


def stop_with(dist_info, outcomes, source, message, code, error=None):
    """
    End this rank after rank `source` failed with message (or, given error, every rank alike): the lowest rank
    raises it, the others stop with its exit code, and the first process of every node that is not the raiser's
    says it too (PeerFailed's `say`, printed by run_main).
    """
    nodes = [o[2] for o in outcomes]
    if error is not None and dist_info.rank == 0:
        raise error
    here_first = nodes.index(nodes[dist_info.rank]) == dist_info.rank
    say = message if here_first and nodes[dist_info.rank] != nodes[source] else None
    raise PeerFailed(f"rank {source} failed", code, say=say)


def _first_difference(outcomes, agree):
    """ The line for the first entry of agree that is not the same on every rank as on rank 0, or None. """
    where = [f"rank {r} on {o[1]}" for r, o in enumerate(outcomes)]
    for name, remedy in agree.items():
        values = [o[4][name] for o in outcomes]
        for r, value in enumerate(values):
            if value == values[0]:
                continue
            if isinstance(value, dict) and isinstance(values[0], dict):
                keys = sorted(k for k in value.keys() | values[0].keys() if value.get(k) != values[0].get(k))
                shown = ', '.join(f"{k}={values[0].get(k)!r} on {where[0]} but {value.get(k)!r} on {where[r]}"
                                  for k in keys[:3])
                return f"the ranks differ in {name}: {shown}; {remedy}"
            return f"the ranks differ in {name}: {values[0]!r} on {where[0]} but {value!r} on {where[r]}; {remedy}"
    return None


def broadcast_object(obj, dist_info, src=0):
    """ rank src's obj on every rank (pickled over the process group); obj itself in a single process. """
    if not dist_info.under_torchrun:
        return obj
    import torch.distributed as dist
    box = [obj if dist_info.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
