"""
Bits per byte beside train.py's losses: each split's bytes per token measured once (whole, or an even
sample of a large split), val_bpb/train_bpb in metrics.jsonl equal to loss / ln 2 / bytes per token of
the split's decoded text, for a character and a GPT-2 BPE dataset; plot_metrics.py draws both runs on
one bits-per-byte axis.
"""
import json
import math
import os
import pickle
import runpy

import numpy as np
import pytest

import train
from helpers import REPO, train_args
from nanogpt_plus import tokenizer
from nanogpt_plus.dataloader import TokenSource
from nanogpt_plus.dataset.shards import write_shard
from nanogpt_plus.errors import UserError
from nanogpt_plus.metrics import read_metrics
from nanogpt_plus.tokenizer import CharTokenizer, GPT2Tokenizer

# 1-, 2- and 3-byte characters: a character's token is not a byte
CHAR_TEXT = "the café sells crème brûlée for 5 € a slice.\n" * 60
BPE_TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, naïve "
            "and wise alike — €3 a loaf.\n") * 40


def write_split_files(directory, ids, meta=None, pickled=False):
    """ train.bin (the first 80%) and val.bin of token ids, and meta.json (or nanoGPT's meta.pkl) when
    given. """
    os.makedirs(directory, exist_ok=True)
    ids = np.asarray(ids, dtype=np.uint16)
    cut = len(ids) * 4 // 5
    ids[:cut].tofile(os.path.join(directory, 'train.bin'))
    ids[cut:].tofile(os.path.join(directory, 'val.bin'))
    if meta is not None and pickled:
        with open(os.path.join(directory, 'meta.pkl'), 'wb') as f:
            pickle.dump({k: meta[k] for k in ('vocab_size', 'itos', 'stoi')}, f)
    elif meta is not None:
        with open(os.path.join(directory, 'meta.json'), 'w', encoding='utf-8') as f:
            json.dump(meta, f)
    return str(directory)


def decoded_bytes_per_token(tok, path):
    """ The split's text, decoded whole, in UTF-8 bytes per token: the reference. """
    ids = np.fromfile(path, dtype=np.uint16)
    return len(tok.decode_bytes(ids.tolist())) / len(ids)


@pytest.fixture(scope='module')
def two_datasets(tmp_path_factory):
    """ {'char': (dataset, tokenizer), 'char_pkl': ..., 'gpt2': ...}: text with multi-byte characters in a
    character vocabulary (its meta.json, or nanoGPT's meta.pkl) and in GPT-2's BPE (no meta). """
    root = tmp_path_factory.mktemp('bpb')
    char = CharTokenizer.from_text(CHAR_TEXT)
    gpt2 = GPT2Tokenizer()
    ids = char.encode(CHAR_TEXT)
    return {'char': (write_split_files(root / 'char', ids, char.meta()), char),
            'char_pkl': (write_split_files(root / 'char_pkl', ids, char.meta(), pickled=True), char),
            'gpt2': (write_split_files(root / 'gpt2', gpt2.encode_ordinary(BPE_TEXT)), gpt2)}


@pytest.mark.parametrize('kind', ['char', 'char_pkl', 'gpt2', 'bpe'])
def test_metrics_bpb_is_loss_over_ln2_and_bytes_per_token(two_datasets, kind, tmp_path, capsys, request):
    # bpe: your own byte-level BPE (vocab 512; its tokenizer.json beside the data)
    tok, dataset = request.getfixturevalue('bpe512') if kind == 'bpe' else two_datasets[kind][::-1]
    out = tmp_path / kind
    train.main(train_args(dataset, out, max_iters=4, eval_interval=2, lr_decay_iters=4,
                          n_embd=16, block_size=16))
    printed = capsys.readouterr().out
    records = read_metrics(str(out / 'metrics.jsonl'))
    expected = {split: decoded_bytes_per_token(tok, os.path.join(dataset, f'{split}.bin'))
                for split in ('train', 'val')}
    measured, = [r for r in records if r['type'] == 'bytes_per_token']
    assert measured['train'] == pytest.approx(expected['train'], rel=1e-12)
    assert measured['val'] == pytest.approx(expected['val'], rel=1e-12)
    assert measured['train_whole'] and measured['val_whole']
    # multi-byte characters; BPE words
    assert expected['train'] > (1.0 if kind.startswith('char') else 2.0)
    evals = [r for r in records if r['type'] == 'eval']
    assert [r['iter'] for r in evals] == [0, 2, 4]
    for r in evals:
        for split in ('train', 'val'):
            assert r[f'{split}_bpb'] == pytest.approx(r[f'{split}_loss'] / math.log(2) / expected[split],
                                                      rel=1e-12)
    # nanoGPT's line is as it was
    assert f"step 2: train loss {evals[1]['train_loss']:.4f}, val loss {evals[1]['val_loss']:.4f}\n" in printed
    assert not [line for line in printed.splitlines() if line.startswith(('step', 'iter')) and 'bpb' in line]


def test_large_split_is_sampled_evenly(tmp_path):
    """ Past sample_tokens, runs spread evenly over all the files; below it, every token of every file. """
    tok = CharTokenizer.from_text('ab€')  # 'a', 'b': 1 byte; '€': 3 bytes
    stoi = tok.stoi
    # three files: all 'a', then all '€', then alternating: 1, 3 and 2 bytes per token
    files = []
    for k, text in enumerate(['a' * 3000, '€' * 3000, 'b€' * 1500]):
        path = str(tmp_path / f'data_val_{k:06d}.bin')
        write_shard(path, np.array([stoi[c] for c in text], dtype=np.uint16))  # llm.c shards
        files.append(path)
    source = TokenSource(files)
    whole = tokenizer.split_bytes_per_token(source, tok)
    assert whole == {'bytes_per_token': 2.0, 'tokens_counted': 9000, 'whole': True}
    sample = tokenizer.split_bytes_per_token(source, tok, sample_tokens=9000 - 1)
    assert not sample['whole'] and 0 < sample['tokens_counted'] <= 9000 - 1
    assert sample['bytes_per_token'] == pytest.approx(2.0, abs=0.01)
    # ids the tokenizer lacks (a padded vocabulary): no figure rather than a wrong one
    np.array([0, 1, 7], dtype=np.uint16).tofile(tmp_path / 'val.bin')
    assert tokenizer.split_bytes_per_token(TokenSource([str(tmp_path / 'val.bin')]), tok)['bytes_per_token'] is None


def test_plot_a_char_and_a_bpe_run_on_one_bpb_axis(two_datasets, tmp_path, capsys):
    for kind in ('char', 'gpt2'):
        train.main(train_args(two_datasets[kind][0], tmp_path / kind, max_iters=4, eval_interval=2,
                              lr_decay_iters=4, n_embd=16, block_size=16))
    capsys.readouterr()
    main = runpy.run_path(os.path.join(REPO, 'scripts', 'plot_metrics.py'))
    png = tmp_path / 'both.png'
    counts = main['plot'](str(tmp_path / 'char' / 'metrics.jsonl'), str(png), bpb=True,
                          others=[str(tmp_path / 'gpt2' / 'metrics.jsonl')])
    assert counts == (5, 3, 0) and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the curves drawn are the bits per byte: the per-iteration losses over the train split's bytes
    records = read_metrics(str(tmp_path / 'gpt2' / 'metrics.jsonl'))
    iters, evals, _ = main['iterations_and_evaluations'](str(tmp_path / 'gpt2' / 'metrics.jsonl'))
    drawn_iters, drawn_evals = main['in_bits_per_byte'](str(tmp_path / 'gpt2' / 'metrics.jsonl'), iters, evals)
    per_token = next(r['train'] for r in records if r['type'] == 'bytes_per_token')
    assert [r['loss'] for r in drawn_iters] == pytest.approx([r['loss'] / math.log(2) / per_token for r in iters])
    assert [r['val_loss'] for r in drawn_evals] == [r['val_bpb'] for r in evals]
    # a run logged before bits per byte existed: one line
    old = tmp_path / 'old' / 'metrics.jsonl'
    os.makedirs(old.parent)
    old.write_text(json.dumps({'type': 'eval', 'iter': 0, 'train_loss': 1.0, 'val_loss': 1.0, 'lr': 0.1}) + '\n')
    with pytest.raises(UserError, match='without val_bpb.*plot it without --bpb'):
        main['plot'](str(old), str(tmp_path / 'x.png'), bpb=True)
