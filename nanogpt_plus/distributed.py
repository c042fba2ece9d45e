"""
The processes of a run: joining torchrun's process group, and the small agreements between ranks that keep
them from waiting on each other forever (rank 0 decides and all ranks learn the outcome; sums over ranks).

Usage:
    from nanogpt_plus.distributed import init_distributed, master_decides
    dist_info = init_distributed(device='auto', backend='auto')   # torchrun's ranks, or a single process
    master_decides(dist_info, lambda: write_the_file())           # rank 0 acts; every rank ends alike
"""

import os
import socket
from dataclasses import dataclass

import torch

from nanogpt_plus.device import device_type_of, resolve_device
from nanogpt_plus.errors import PeerFailed, UserError, exit_code


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


def init_distributed(device='auto', backend='auto'):
    """
    Under torchrun (RANK in the environment) join the process group: nccl for CUDA, gloo for CPU, each
    CUDA rank on cuda:LOCAL_RANK. Otherwise a single process on the resolved device.
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
    gradient_accumulation_steps) is the same for any number of processes.
    """
    w = dist_info.world_size
    if gradient_accumulation_steps % w != 0:
        raise UserError(f"gradient_accumulation_steps ({gradient_accumulation_steps}) must be divisible by the "
                        f"number of processes ({w}); pick a multiple of {w}")
    return gradient_accumulation_steps // w


def every_rank(dist_info, fn):
    """
    Run fn() on every rank (each checks what only it can see: a file on its own node's disk) and reach one
    verdict: when fn raises on any rank, the lowest such rank raises its error (the one line printed, naming
    the rank and host when the ranks disagreed) and every other rank stops quietly with the same exit code,
    instead of walking on into a collective the failed rank never joins. Returns fn()'s result. One
    all_gather_object with several processes.
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
    outcomes = [None] * dist_info.world_size
    dist.all_gather_object(outcomes, (None if error is None else exit_code(error), socket.gethostname()))
    failed = [r for r, (code, _) in enumerate(outcomes) if code is not None]
    if not failed:
        return result
    first = failed[0]
    if dist_info.rank != first:
        raise PeerFailed(f"rank {first} failed", outcomes[first][0])
    # a file one node has, another lacks
    if len(failed) < dist_info.world_size and isinstance(error, UserError):
        fine = sorted({host for code, host in outcomes if code is None})
        raise type(error)(f"{error} [rank {first} on {outcomes[first][1]}; ranks on {', '.join(fine)} found what "
                          f"they needed: every node must see this path (a shared file system, or a copy on each "
                          f"node), see docs/training.md#many-machines]") from None
    raise error


def broadcast_object(obj, dist_info, src=0):
    """ rank src's obj on every rank (pickled over the process group); obj itself in a single process. """
    if not dist_info.under_torchrun:
        return obj
    import torch.distributed as dist
    box = [obj if dist_info.rank == src else None]
    dist.broadcast_object_list(box, src=src)
    return box[0]
