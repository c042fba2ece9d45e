"""
The token-window loader: (B, T) windows of a dataset split's tokens, with explicit state so runs
resume exactly and DDP ranks stride one shared stream.

A split's tokens are a TokenSource: nanoGPT's one raw file (train.bin: uint16, or uint32 when its
directory's meta.json says "dtype": "uint32", for vocabularies past 65,536), or a list of llm.c
token shards (nanogpt_plus.dataset.shards: ours, llm.c's, build-nanogpt's, modded-nanogpt's). The windows
come in one of two orders (data_order):
  'random'      nanoGPT's get_batch: each micro-batch is B windows of T+1 tokens drawn uniformly from every
                window of every file (so a file is drawn in proportion to its number of windows, and a window
                never crosses the end of a file) with the loader's seeded torch.Generator. On one file these
                are exactly the draws this loader always made, so runs on train.bin are unchanged.
  'sequential'  llm.c's and build-nanogpt's: each micro-batch is the next B*T+1 consecutive tokens (B windows,
                each starting T after the last), through the files in order, so every token is a target once
                per epoch. A file's tail too short for a whole micro-batch is skipped (as llm.c does); after
                the last file the stream wraps to the first one and the epoch count goes up.

Either way every process computes the same sequence of micro-batches, and micro-batch k belongs to
rank k % world_size (each call to next_batch consumes world_size micro-batches). So the global batch
of an optimizer step is the same for any world size: 2 ranks x 2 accumulation steps see exactly the
micro-batches 1 rank x 4 steps sees; and any rank's state_dict resumes all of them. training_data
opens train.py's dataset (nanogpt_plus.dataset says what its files are) and loaders, on every rank with one
verdict.

Usage:
    from nanogpt_plus.dataloader import TokenWindowLoader
    loader = TokenWindowLoader(split_files('shakespeare_char', 'train'), batch_size=12, block_size=64,
                               seed=1337, rank=0, world_size=1, device='cpu', order='random')
    x, y = loader.next_batch()          # (B, T) int64 inputs and targets shifted by one
    state = loader.state_dict()         # resume later with loader.load_state_dict(state)
    loader.check_vocab(model.config.vocab_size)   # ids the model has no embedding for: one line, not a crash
"""

import os
from dataclasses import dataclass

import numpy as np
import torch

from nanogpt_plus.dataset import (
    SAME_DATA,
    data_digests,
    find_dataset,
    has_header,
    missing_token_file,
    raw_token_dtype,
    tokenizer_digest,
)
from nanogpt_plus.distributed import every_rank
from nanogpt_plus.errors import UserError, special_file
from nanogpt_plus.files import refuse_special_file
from nanogpt_plus.machine import environment_value

# the data_order setting's choices: nanoGPT's random windows, or llm.c's pass over every token
# (training_loader acts on them)
ORDERS = ('random', 'sequential')

# -----------------------------------------------------------------------------
# opening a split's token files

def open_tokens(path, dataset=None, dtype=None):
    """
    nanoGPT's raw token file as a read-only memmap, or one clear error. dtype: the dataset's
    (Dataset.raw_dtype, worked out once); None reads it from the meta.json beside the file
    (raw_token_dtype).
    """
    if not os.path.exists(path):
        raise UserError(missing_token_file(path, dataset))
    refuse_special_file(path, "token file")
    size = os.path.getsize(path)
    if size == 0:  # (numpy can't memmap an empty file)
        raise UserError(f"{path} is empty (0 tokens); re-run the dataset's prepare.py on some text")
    dtype = raw_token_dtype(path) if dtype is None else np.dtype(dtype)
    if size % dtype.itemsize:
        raise UserError(
            f"{path} is {size:,} bytes, not a whole number of {dtype} tokens ({dtype.itemsize} bytes "
            f"each), so it is truncated or not a token file of this dataset; re-run prepare.py")
    return np.memmap(path, dtype=dtype, mode='r')


def open_token_file(path, dataset=None, dtype=None):
    """
    Any token file split_files returns, validated, as a read-only memmap of its tokens (never read
    whole).
    """
    kind = special_file(path)
    if kind == 'a directory':  # (else an IsADirectoryError from deep in numpy)
        raise UserError(f"{path} is a directory, not a token file; move it away and re-run the "
                        f"dataset's prepare.py, or pass another --dataset")
    if kind is not None:  # a FIFO's size is 0 and its reading never ends: said without opening it
        raise UserError(f"{path} is {kind}, not a regular token file; move it away and re-run the "
                        f"dataset's prepare.py, or pass another --dataset")
    try:
        if not has_header(path):
            return open_tokens(path, dataset, dtype)
        # only a dataset of llm.c shards loads their reader: a run on train.bin/val.bin never does
        from nanogpt_plus.dataset.shards import open_shard
        return open_shard(path)
    except OSError as e:  # no permission to read it, an I/O error
        raise UserError(f"could not read {path} ({e.strerror or e}); make it readable by this "
                        f"user, or pass another --dataset") from None


# a split up to this many tokens (128 MB) is scanned whole when opened, in well under a second; a
# larger one (OpenWebText's 9B tokens, FineWeb's 10B) is checked batch by batch instead, as its
# windows are read. The environment variable NANOGPT_PLUS_SCAN_TOKENS replaces it, so that tests can
# take the per-batch path on small files (read when a file is opened: scan_limit)
SCAN_TOKENS = 1 << 26


def scan_limit():
    """ The size up to which a split is scanned whole: NANOGPT_PLUS_SCAN_TOKENS, else SCAN_TOKENS. """
    limit = environment_value('NANOGPT_PLUS_SCAN_TOKENS')
    return SCAN_TOKENS if limit is None else limit


def check_token_ids(tokens, vocab_size, path, tokenizer_size=None):
    """
    A token id >= the model's vocab_size has no embedding: an IndexError deep in the model on the
    CPU, a device-side assert on a GPU. One >= the tokenizer's size (tokenizer_size, when the
    model's vocabulary is padded past it) has an embedding row but means no text: the data was made
    with another tokenizer. Refuse either in one line naming the file (tokens: an array or a
    tensor).
    """
    top = int(tokens.max())
    if top >= vocab_size:
        raise UserError(
            f"{path} holds token ids up to {top}, beyond the model's vocab_size ({vocab_size}); was it "
            f"prepared with another tokenizer? Re-run prepare.py, or use the model this data was made for"
        )
    if tokenizer_size and top >= tokenizer_size:
        raise UserError(
            f"{path} holds token ids up to {top}, beyond the tokenizer's vocabulary ({tokenizer_size:,} "
            f"tokens; the model's ids from {tokenizer_size:,} to {vocab_size:,} are padding, which no "
            f"text has); was it prepared with another tokenizer? Re-run prepare.py, or use the model "
            f"this data was made for")


def file_identity(path):
    """
    (device, inode, size, mtime) of a file, None when it is gone: what changes when the file is
    replaced.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class TokenSource:
    """
    The token files of one split, validated once and then memory-mapped anew for every read: a
    memmap kept open holds on to every page it has touched, so on a corpus larger than RAM the
    process would keep growing (numpy memmap, see stackoverflow.com/q/45132940).
    """

    def __init__(self, paths, dataset=None, dtype=None):
        self.paths = list(paths)
        opened = [open_token_file(p, dataset, dtype) for p in self.paths]
        # what np.memmap needs to map it again
        self.layouts = [(m.dtype, m.offset, len(m)) for m in opened]
        self.sizes = np.array([n for _, _, n in self.layouts], dtype=np.int64)  # tokens per file
        # each file as it was validated: another file under its name (a dataset prepared again while
        # the run reads it, perhaps with another vocabulary) is refused at the next read instead of
        # trained on
        self.pins = [file_identity(p) for p in self.paths]
        # set by check_vocab for a large split: every window checked
        self.vocab_size = self.tokenizer_size = None

    def tokens(self, i):
        """
        File i's tokens, a fresh read-only memmap (of the file validated at start-up, or one line).
        """
        if file_identity(self.paths[i]) != self.pins[i]:
            raise UserError(
                f"{self.paths[i]} changed while the run was reading it (replaced, prepared again, "
                f"truncated or deleted); the run stops here without saving. Restore the dataset the run "
                f"started with and resume with --init_from=resume, or start a new run on the new one"
            )
        dtype, offset, n = self.layouts[i]
        return np.memmap(self.paths[i], dtype=dtype, mode='r', offset=offset, shape=(n,))

    def read(self, files, starts, length):
        """
        (len(starts), length) int64 tensor: row j is tokens[starts[j]:starts[j] + length] of file
        files[j].
        """
        window = np.empty((len(starts), length), dtype=np.int64)
        span = np.arange(length, dtype=np.int64)
        for i in np.unique(files):
            rows = np.flatnonzero(files == i)
            window[rows] = self.tokens(i)[starts[rows, None] + span]
            # on the CPU, before the device sees an id it has no embedding for
            if self.vocab_size is not None:
                check_token_ids(window[rows], self.vocab_size, self.paths[i], self.tokenizer_size)
        return torch.from_numpy(window)

    def check_vocab(self, vocab_size, tokenizer_size=None):
        """
        Refuse ids the model (or its tokenizer) doesn't have: now for a small split, else in each
        read.
        """
        if self.sizes.sum() <= scan_limit():
            for i, path in enumerate(self.paths):
                check_token_ids(self.tokens(i), vocab_size, path, tokenizer_size)  # all of it, now
        else:
            self.vocab_size = vocab_size
            self.tokenizer_size = tokenizer_size

    def describe(self):
        """ The split's files, for messages: the file, or the shards' directory. """
        if len(self.paths) == 1:
            return self.paths[0]
        return f"the {len(self.paths)} shards in {os.path.dirname(self.paths[0]) or '.'}"


# -----------------------------------------------------------------------------
# the two orders of windows: draw() returns one micro-batch as (file of each window, its start)

class RandomOrder:
    """
    nanoGPT's order: B windows drawn uniformly from all windows of all files, by a seeded generator.
    """
    name = 'random'

    def __init__(self, sizes, batch_size, block_size, seed):
        # start positions whose T+1 tokens fit in the file
        windows = np.maximum(sizes - block_size, 0)
        # global window g lies in the first file whose end is above g
        self.ends = np.cumsum(windows)
        self.begins = self.ends - windows
        self.batch_size = batch_size
        self.seed = seed
        self.generator = torch.Generator()
        self.reset()

    def reset(self):
        self.generator.manual_seed(self.seed)

    def draw(self):
        g = torch.randint(int(self.ends[-1]), (self.batch_size,), generator=self.generator).numpy()
        files = np.searchsorted(self.ends, g, side='right')
        return files, g - self.begins[files]  # on one file: the start is g itself

    def state_dict(self):
        return {'generator': self.generator.get_state(), 'seed': self.seed}

    def load_state_dict(self, state):
        self.generator.set_state(state['generator'])


class SequentialOrder:
    """
    llm.c's order: consecutive micro-batches of B*T+1 tokens through the files, wrapping after the
    last.
    """
    name = 'sequential'

    def __init__(self, sizes, batch_size, block_size, names):
        self.sizes = sizes
        self.names = names
        # a micro-batch reads step + 1 tokens and moves on by step
        self.step = batch_size * block_size
        # its windows, relative to position
        self.starts = np.arange(batch_size, dtype=np.int64) * block_size
        self.reset()

    def reset(self):
        self.file = 0
        self.position = 0
        self.epoch = 0

    def draw(self):
        # the init check (a file holds a micro-batch) ends this loop within one pass over the files
        while self.position + self.step + 1 > self.sizes[self.file]:
            self.file = self.file + 1
            self.position = 0
            # the end of an epoch: every micro-batch once, start again
            if self.file == len(self.sizes):
                self.file = 0
                self.epoch = self.epoch + 1
        files = np.full(len(self.starts), self.file)
        starts = self.position + self.starts
        self.position += self.step
        return files, starts

    def state_dict(self):
        # the file's name too: a resume over another list of files is refused rather than read
        # elsewhere
        return {'file': self.file, 'file_name': self.names[self.file], 'position': self.position,
                'epoch': self.epoch}

    def load_state_dict(self, state):
        file = int(state['file'])
        if file >= len(self.names) or self.names[file] != state['file_name']:
            raise UserError(
                f"the checkpoint's data position is in the shard {state['file_name']}, which is not "
                f"shard {file} of this dataset; resume on the dataset the run was started on")
        self.file = file
        self.position = int(state['position'])
        self.epoch = int(state['epoch'])


def make_order(order, source, batch_size, block_size, seed):
    """ The order of windows over source, after checking that its files are long enough for it. """
    largest = int(source.sizes.max())
    where = source.describe()
    if order == 'random':
        if largest <= block_size:
            what = f"{where} has only {largest} tokens" if len(source.paths) == 1 else \
                f"the largest of {where} has only {largest} tokens"
            raise UserError(
                f"{what}, fewer than block_size+1 ({block_size + 1}); use a smaller --block_size or "
                f"more data")
        return RandomOrder(source.sizes, batch_size, block_size, seed)
    if order == 'sequential':
        if largest <= batch_size * block_size:
            raise UserError(
                f"no file of {where} holds batch_size*block_size+1 ({batch_size * block_size + 1:,}) "
                f"tokens, one micro-batch in sequential order (the largest has {largest:,}); use a "
                f"smaller --batch_size or --block_size, or more data")
        return SequentialOrder(source.sizes, batch_size, block_size,
                               [os.path.basename(p) for p in source.paths])
    raise UserError(f"unknown data order '{order}'; use one of: {', '.join(ORDERS)}")


def evaluation_order(paths):
    """
    The order of a fixed evaluation stream over paths: sequential from the start for shards, so the
    val loss covers distinct tokens, the same ones whatever the seed, data_order or world size, as
    llm.c measures it; nanoGPT's random windows for its val.bin, as nanoGPT does (and this loader
    always did).
    """
    return 'sequential' if any(has_header(p) for p in paths) else 'random'


# -----------------------------------------------------------------------------
# the loader

def split_window(window, device, pin):
    """
    (x, y) = (window[:, :-1], window[:, 1:]) on device, each contiguous, for a contiguous (B, T+1)
    CPU window. With pin (CUDA) the window goes over once, from page-locked memory, and is sliced on
    the GPU: x and y themselves are strided views, and pinning a view keeps its strides, so a
    non_blocking copy of one would go through a pageable temporary and neither be cheap nor return
    at once.
    """
    if pin:
        # a non_blocking copy from pinned memory returns at once: the CPU goes on queueing work
        window = window.pin_memory().to(device, non_blocking=True)
        # contiguous() copies on the GPU, queued after the transfer (targets.view(-1) needs
        # contiguous y)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()
    return window[:, :-1].contiguous().to(device), window[:, 1:].contiguous().to(device)


class TokenWindowLoader:
    """
    (B, T) batches of a split's token files (a path or a list of them) in data order `order`.
    """

    def __init__(self, paths, batch_size, block_size, seed=1337, rank=0, world_size=1, device='cpu',
                 dataset=None, order='random', dtype=None):
        paths = [paths] if isinstance(paths, str) else list(paths)
        self.source = TokenSource(paths, dataset, dtype)
        self.block_size = block_size
        self.rank = rank
        self.world_size = world_size
        self.device = device
        # it keeps the seed and batch size
        self.order = make_order(order, self.source, batch_size, block_size, seed)
        self.micro_step = 0  # global micro-batch counter, shared by all ranks
        self._pin = 'cuda' in str(device)

    def check_vocab(self, vocab_size, tokenizer_size=None):
        """
        Refuse ids the model (or its tokenizer) doesn't have: now for a small split, else in each
        batch read.
        """
        self.source.check_vocab(vocab_size, tokenizer_size)

    @property
    def epoch(self):
        """
        Passes completed over the files (sequential order; random windows have no epochs: 0).
        """
        return getattr(self.order, 'epoch', 0)

    def reset(self):
        """
        Back to the start of the stream (evaluation calls this to see the same batches every time).
        """
        self.order.reset()
        self.micro_step = 0

    def next_batch(self):
        # draw the next world_size micro-batches of the shared stream and keep this rank's one, so
        # every rank's order stays in the same state
        for r in range(self.world_size):
            draw = self.order.draw()
            if r == self.rank:
                files, starts = draw
        self.micro_step += self.world_size
        window = self.source.read(files, starts, self.block_size + 1)  # (B, T+1)
        return split_window(window, self.device, self._pin)

    def state_dict(self):
        return dict(self.order.state_dict(), order=self.order.name, micro_step=self.micro_step)

    def load_state_dict(self, state):
        # checkpoints from before data_order drew random windows
        saved = state.get('order', 'random')
        if saved != self.order.name:
            raise UserError(
                f"the checkpoint's data loader read the {saved} order, but data_order is "
                f"'{self.order.name}'; resume with --data_order={saved}")
        self.order.load_state_dict(state)
        self.micro_step = int(state['micro_step'])


# -----------------------------------------------------------------------------
# train.py's data

@dataclass(frozen=True)
class DataSpec:
    """ What train.py's loaders need of the settings. """
    dataset: str
    data_order: str
    batch_size: int
    block_size: int
    seed: int


def training_data(spec, dist_info):
    """
    train.py's dataset and loaders, (Dataset, train_loader, {'train': ..., 'val': ...}), opened on
    every rank with one verdict: a node whose disk lacks the data (or holds another copy that fails
    its checks) ends every rank with the same line, instead of one rank stopping while the others
    wait for it in a collective; and so does a node whose copy holds another tokenizer description,
    other numbers of tokens (a file cut short) or other tokens (a digest of each file's size and
    first and last bytes: another preparation) than rank 0's, which would train on other data
    without an error. spec: a DataSpec.
    """
    def open_all():
        data = find_dataset(spec.dataset)
        loaders = training_loaders(data, spec, dist_info)
        opened = {'data': data, 'loaders': loaders}
        # what the ranks compare: a single process has no one to differ from, and computes none of it
        if dist_info.under_torchrun:
            files = {os.path.basename(p): p for split in ('train', 'val') for p in data.files(split)}
            opened.update(tokenizer=tokenizer_digest(data.meta), tokens=data_digests(files),
                          dataset={split: [int(n) for n in loader.source.sizes]
                                   for split, loader in loaders[1].items()})
        return opened

    # the tokenizer first (a dataset prepared again with another vocabulary), then the numbers of
    # tokens (a file cut short), then each file's content (the same size, other tokens)
    opened = every_rank(dist_info, open_all, agree={
        'tokenizer': SAME_DATA['tokenizer'],
        'dataset': "give every node the same copy of the dataset (its files' tokens per split are "
                   "compared)",
        'tokens': SAME_DATA['data']})
    return (opened['data'], *opened['loaders'])


def training_loaders(data, spec, dist_info):
    """
    train.py's loaders of a dataset.Dataset and a DataSpec: the training stream (in data_order,
    strided over ranks) and one fixed stream per split to evaluate on: the train split's at random
    windows (a sample of the whole training set, not just its start); the val split's in
    evaluation_order (shards: sequentially from the start; train.bin's: random).
    Returns (train_loader, {'train': ..., 'val': ...}).
    """
    def loader(split, seed, order):
        return TokenWindowLoader(data.files(split), spec.batch_size, spec.block_size, seed=seed,
                                 rank=dist_info.rank, world_size=dist_info.world_size,
                                 device=dist_info.device, dataset=data.name, order=order,
                                 dtype=data.raw_dtype)
    train_loader = loader('train', spec.seed, spec.data_order)
    evaluation = {'train': loader('train', spec.seed + 1, 'random'),
                  'val': loader('val', spec.seed + 2, evaluation_order(data.files('val')))}
    return train_loader, evaluation
