"""
RNG state for exact resume: every generator a training step can draw from (torch's CPU and CUDA ones for
dropout, Python's and numpy's), as tensors and plain values that a weights_only checkpoint can hold, gathered
from every rank so that rank 0 can save them all.

Usage:
    from nanogpt_plus.rng import gather_rng_states, set_rng_state
    states = gather_rng_states(dist_info)   # one per rank, on every rank
    set_rng_state(states[rank])
"""

import random

import numpy as np
import torch


def rng_state():
    """ Every RNG a training step can touch (dropout, shuffles), as tensors and plain values. """
    state = {'torch': torch.get_rng_state(), 'python': _python_rng_state(), 'numpy': _numpy_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state['cuda'] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state):
    torch.set_rng_state(state['torch'])
    if 'cuda' in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state['cuda'])
    if 'python' in state:
        version, internal, gauss = state['python']
        random.setstate((version, tuple(internal), gauss))
    if 'numpy' in state:
        name, keys, pos, has_gauss, cached = state['numpy']
        np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _python_rng_state():
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _numpy_rng_state():
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]


def gather_rng_states(dist_info):
    """ The RNG state of every rank, gathered to all ranks (so rank 0 can save them all). """
    state = rng_state()
    if not dist_info.under_torchrun:
        return [state]
    import torch.distributed as dist
    states = [None] * dist_info.world_size
    dist.all_gather_object(states, state)
    return states



def restore_rng_states(states, rank):
    """
    On resume, this rank's RNG states from a checkpoint's list of every saved rank's. A rank the checkpoint has no
    state for (resuming on more ranks than were saved) starts from rank 0's, then is reseeded with a number drawn
    from it plus its rank: its own stream, the same on every resume, never another rank's copy (which would give
    two ranks the same dropout masks). Returns whether the state was derived.
    """
    if rank < len(states):
        set_rng_state(states[rank])
        return False
    set_rng_state(states[0])
    seed = int(torch.randint(2 ** 62, (1,)).item()) + rank
    torch.manual_seed(seed)  # every device's generator too
    random.seed(seed)
    np.random.seed(seed % 2 ** 32)
    return True
