"""
The token-window loader: random (B, T) windows from a memmapped uint16 token file, like nanoGPT's
get_batch, with explicit state so runs resume exactly and DDP ranks stride one shared stream.

Every process draws the same sequence of micro-batch offsets from its own seeded torch.Generator; micro-
batch k belongs to rank k % world_size (each call to next_batch consumes world_size micro-batches). So the global batch of an optimizer step is the same for any
world size: 2 ranks x 2 accumulation steps see exactly the micro-batches 1 rank x 4 steps sees.

Usage:
    from nanogpt_plus.dataloader import TokenWindowLoader, dataset_dir
    loader = TokenWindowLoader(os.path.join(dataset_dir('shakespeare_char'), 'train.bin'), batch_size=12,
                               block_size=64, seed=1337, rank=0, world_size=1, device='cpu')
    x, y = loader.next_batch()          # (B, T) int64 inputs and targets shifted by one
    state = loader.state_dict()         # resume later with loader.load_state_dict(state)
    loader.check_vocab(model.config.vocab_size)   # ids the model has no embedding for: one line, not a crash
"""

import os

import numpy as np
import torch

from nanogpt_plus.runtime import UserError

REPO_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout above this package


def dataset_dir(dataset):
    """ data/<dataset> (relative to the working directory, like nanoGPT, else to this repo), or a path. """
    for candidate in (dataset, os.path.join('data', dataset), os.path.join(REPO_DIR, 'data', dataset)):
        if os.path.isdir(candidate) and os.path.exists(os.path.join(candidate, 'train.bin')):
            return candidate
    return os.path.join('data', dataset)


def open_tokens(path, dataset=None):
    """ The uint16 token file as a read-only memmap, with a clear error when it is missing. """
    if not os.path.exists(path):
        hint = f"run python data/{dataset}/prepare.py first" if dataset else "prepare the dataset first"
        raise UserError(f"no token file at {path}; {hint}")
    size = os.path.getsize(path)
    if size == 0:  # (numpy can't memmap an empty file)
        raise UserError(f"{path} is empty (0 tokens); re-run the dataset's prepare.py on some text")
    if size % 2:
        raise UserError(f"{path} has an odd number of bytes, so it is not a uint16 token file; re-run prepare.py")
    return np.memmap(path, dtype=np.uint16, mode='r')


# a file up to this many tokens (128 MB) is scanned whole when opened, in well under a second; a larger one
# (OpenWebText's 9B tokens) is checked batch by batch instead, as its windows are read
SCAN_TOKENS = 1 << 26


def check_token_ids(tokens, vocab_size, path):
    """
    A token id >= the model's vocab_size has no embedding: an IndexError deep in the model on the CPU, a
    device-side assert on a GPU. Refuse it in one line naming the file (tokens: an array or a tensor).
    """
    top = int(tokens.max())
    if top >= vocab_size:
        raise UserError(f"{path} holds token ids up to {top}, beyond the model's vocab_size ({vocab_size}); was it "
                        f"prepared with another tokenizer? Re-run prepare.py, or use the model this data was made for")


def split_window(window, device, pin):
    """
    (x, y) = (window[:, :-1], window[:, 1:]) on device, each contiguous, for a contiguous (B, T+1) CPU window.
    With pin (CUDA) the window goes over once, from page-locked memory, and is sliced on the GPU: x and y
    themselves are strided views, and pinning a view keeps its strides, so a non_blocking copy of one
    would go through a pageable temporary and neither be cheap nor return at once.
    """
    if pin:
        # a non_blocking copy from pinned memory returns at once: the CPU goes on queueing work
        window = window.pin_memory().to(device, non_blocking=True)
        # contiguous() copies on the GPU, queued after the transfer (targets.view(-1) needs contiguous y)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
    return window[:, :-1].contiguous().to(device), window[:, 1:].contiguous().to(device)


class TokenWindowLoader:

    def __init__(self, path, batch_size, block_size, seed=1337, rank=0, world_size=1, device='cpu',
                 dataset=None):
        self.path, self.batch_size, self.block_size = path, batch_size, block_size
        self.rank, self.world_size, self.device = rank, world_size, device
        self.seed = seed
        n = len(open_tokens(path, dataset))
        if n <= block_size:
            raise UserError(f"{path} has only {n} tokens, fewer than block_size+1 ({block_size + 1}); "
                            f"use a smaller --block_size or more data")
        self.num_tokens = n
        self.vocab_size = None  # set by check_vocab for a large file: then every batch's ids are checked
        self.generator = torch.Generator()
        self.reset()
        self._offsets = np.arange(block_size + 1, dtype=np.int64)
        self._pin = 'cuda' in str(device)

    def check_vocab(self, vocab_size):
        """ Refuse ids >= vocab_size (the model's): now for a small file, else in each batch next_batch reads. """
        if self.num_tokens <= SCAN_TOKENS:
            check_token_ids(open_tokens(self.path), vocab_size, self.path)  # all of it, now
        else:
            self.vocab_size = vocab_size  # each batch, as next_batch reads it

    def reset(self):
        """ Back to the start of the stream (evaluation calls this to see the same batches every time). """
        self.generator.manual_seed(self.seed)
        self.micro_step = 0  # global micro-batch counter, shared by all ranks

    def next_batch(self):
        # draw the next world_size micro-batches of the shared stream and keep this rank's one, so every
        # rank's generator stays in the same state (any rank's state_dict resumes all of them)
        for r in range(self.world_size):
            draw = torch.randint(self.num_tokens - self.block_size, (self.batch_size,), generator=self.generator)
            if r == self.rank:
                ix = draw
        self.micro_step += self.world_size
        # a fresh memmap per batch: one kept open holds on to every page it has touched, so on a corpus
        # larger than RAM the process keeps growing (numpy memmap, see stackoverflow.com/q/45132940)
        data = np.memmap(self.path, dtype=np.uint16, mode='r')
        window = torch.from_numpy(data[ix.numpy()[:, None] + self._offsets].astype(np.int64))  # (B, T+1)
        if self.vocab_size is not None:  # on the CPU, before the device sees an id it has no embedding for
            check_token_ids(window, self.vocab_size, self.path)
        return split_window(window, self.device, self._pin)

    def state_dict(self):
        return {'generator': self.generator.get_state(), 'micro_step': self.micro_step, 'seed': self.seed}

    def load_state_dict(self, state):
        self.generator.set_state(state['generator'])
        self.micro_step = int(state['micro_step'])
