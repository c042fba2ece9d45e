"""
What a prepared dataset is, worked out once at set-up and then handed to everything that reads it (the model
builder, the loaders, the tokenizer and vocabulary checks): its directory, the token files of each split
(nanoGPT's train.bin/val.bin or llm.c's shards), the dtype of the raw files, and the tokenizer description its
meta file gives (and so the vocabulary size).

Usage:
    from nanogpt_plus.dataset import find_dataset
    data = find_dataset('shakespeare_char')     # a name under data/, or a directory
    data.files('train'), data.meta, data.vocab_size
"""

from dataclasses import dataclass

from nanogpt_plus.dataloader import (TokenWindowLoader, dataset_dir, evaluation_order, holds_shards, raw_token_dtype,
                                     split_files)
from nanogpt_plus.distributed import every_rank
from nanogpt_plus.tokenizer import read_dataset_meta, tokenizer_size


@dataclass(frozen=True)
class Dataset:
    name: str  # as the user gave it (--dataset): the hint in messages (python data/<name>/prepare.py)
    directory: str
    split_files: dict  # {'train': [paths], 'val': [paths]}, in order
    shards: bool  # llm.c token shards (each with its header) rather than nanoGPT's raw files
    raw_dtype: object  # the numpy dtype of the raw train.bin/val.bin (meta.json's 'dtype'); None for shards
    meta: dict  # the tokenizer description of its meta.json / meta.pkl; None: no meta (GPT-2 BPE assumed)

    def files(self, split):
        return self.split_files[split]

    def training_loaders(self, batch_size, block_size, seed, data_order, dist_info):
        """
        train.py's loaders: the training stream (in data_order, strided over ranks) and one fixed stream per split
        to evaluate on: the train split's at random windows (a sample of the whole training set, not just its
        start); the val split's in dataloader.evaluation_order (shards: sequentially from the start; train.bin's:
        random). Returns (train_loader, {'train': ..., 'val': ...}).
        """
        def loader(split, seed, order):
            return TokenWindowLoader(self.files(split), batch_size, block_size, seed=seed, rank=dist_info.rank,
                                     world_size=dist_info.world_size, device=dist_info.device, dataset=self.name,
                                     order=order, dtype=self.raw_dtype)
        return loader('train', seed, data_order), {'train': loader('train', seed + 1, 'random'),
                                                   'val': loader('val', seed + 2, evaluation_order(self.files('val')))}

    @property
    def vocab_size(self):
        """ The tokenizer's vocabulary size its meta gives, or None (no meta, or one that names none). """
        size = (self.meta or {}).get('vocab_size')
        return int(size) if size else None


def find_dataset(name, splits=('train', 'val')):
    """
    The Dataset `name` (data/<name> relative to the working directory or this repo, or a path) with the files
    of `splits` (none: its tokenizer only, for a new model of its vocabulary).
    """
    directory = dataset_dir(name)
    shards = holds_shards(directory)
    files = {split: split_files(name, split) for split in splits}
    # the raw files' dtype from meta.json, once (shards carry theirs in their headers); none asked for: no files
    raw_dtype = raw_token_dtype(files[splits[0]][0]) if splits and not shards else None
    return Dataset(name, directory, files, shards, raw_dtype, read_dataset_meta(directory))


def training_data(cfg, dist_info):
    """
    train.py's dataset and loaders, (Dataset, train_loader, {'train': ..., 'val': ...}), opened on every rank with
    one verdict: a node whose disk lacks the data (or holds another copy that fails its checks) ends every rank
    with the same line, instead of one rank stopping while the others wait for it in a collective.
    """
    def open_all():
        data = find_dataset(cfg['dataset'])
        return (data, *data.training_loaders(cfg['batch_size'], cfg['block_size'], cfg['seed'], cfg['data_order'],
                                             dist_info))
    return every_rank(dist_info, open_all)


def padded_tokenizer_size(model_vocab, tokenizer_meta):
    """
    The tokenizer's vocabulary size where it is below the model's vocab_size (a byte-level vocabulary padded to a
    multiple of 64), else None: a dataset holding ids in the padding was made with another tokenizer.
    """
    size = tokenizer_size(tokenizer_meta or {'kind': 'gpt2'})
    return int(size) if size and int(size) < model_vocab else None
