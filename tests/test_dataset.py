"""
nanogpt_plus/dataset/ (its __init__.py), what a prepared dataset is: its meta files checked where they are read
(entries of the wrong type, a bpe meta.json its tokenizer.json contradicts), the digest that tells two tokenizers
apart, and each split's bytes as its preparation recorded them (written by the prepare scripts, read here, used by
train.py's bits per byte).
"""
import json
import os
import pickle

import numpy as np
import pytest

import train
from helpers import bpe_corpus_text, train_args, write_bpe_dataset
from nanogpt_plus import tokenizer
from nanogpt_plus.dataloader import TokenSource
from nanogpt_plus.dataset import find_dataset, read_dataset_meta, split_files, tokenizer_digest
from nanogpt_plus.errors import TokenizerError
from nanogpt_plus.metrics import read_metrics
from nanogpt_plus.prepare.shakespeare import prepare_bpe, prepare_char
from nanogpt_plus.tokenizer import CharTokenizer, GPT2Tokenizer


def test_tokenizer_digest_tells_vocabularies_of_one_size_apart():
    meta = {'kind': 'char', 'vocab_size': 3, 'stoi': {'a': 0, 'b': 1, 'c': 2}}
    other = dict(meta, stoi={'a': 2, 'b': 1, 'c': 0})
    assert tokenizer_digest(meta) == tokenizer_digest(json.loads(json.dumps(meta)))
    assert tokenizer_digest(meta) != tokenizer_digest(other)
    assert tokenizer_digest(meta).startswith('char (3 tokens) ')
    assert tokenizer_digest(None) is None


CHAR_META = {"kind": "char", "vocab_size": 3, "stoi": {"a": 0, "b": 1, "c": 2}, "itos": {"0": "a", "1": "b", "2": "c"}}


BAD_META = {
    "vocab_size a string": (dict(CHAR_META, vocab_size="3"), r"says vocab_size='3', not a positive whole number"),
    "vocab_size a float": (dict(CHAR_META, vocab_size=3.0), r"says vocab_size=3.0, not a positive whole number"),
    "vocab_size negative": (dict(CHAR_META, vocab_size=-3), r"says vocab_size=-3, not a positive whole number"),
    "vocab_size zero": (dict(CHAR_META, vocab_size=0), r"says vocab_size=0, not a positive whole number"),
    "vocab_size a bool": (dict(CHAR_META, vocab_size=True), r"says vocab_size=True, not a positive whole number"),
    "itos a list": (dict(CHAR_META, itos=["a", "b", "c"]), r"has an 'itos' that is a list, not an \{id: character\}"),
    "itos keyed by words": (dict(CHAR_META, itos={"one": "a"}), r"has an 'itos' that is not an \{id: character\}"),
    "itos not the inverse of stoi": (dict(CHAR_META, itos={"0": "a", "1": "c", "2": "b"}),
                                     "has an 'itos' that is not the inverse of its 'stoi'"),
    "stoi a list": (dict(CHAR_META, stoi=["a", "b", "c"]), r"has a 'stoi' that is not a \{character: id\}"),
    "stoi with string ids": (dict(CHAR_META, stoi={"a": "0", "b": "1", "c": "2"}),
                             r"has a 'stoi' that is not a \{character: id\}"),
    "stoi with ids past vocab_size": (dict(CHAR_META, vocab_size=2), "has a 'stoi' with ids past its vocab_size=2"),
    "an unknown kind": ({"kind": "wordpiece", "vocab_size": 30000}, "names the tokenizer kind 'wordpiece', not one of"),
    "a list, not an object": ([CHAR_META], "holds a list, not a tokenizer description"),
    "eot_token a string": ({"kind": "gpt2", "eot_token": "50256"}, r"says eot_token='50256', not a token id"),
    # a kind that contradicts the rest: the checkpoints would claim it (a GPT-2 model of 64 tokens)
    "gpt2 with another size": ({"kind": "gpt2", "vocab_size": 64},
                               r"says kind 'gpt2' with vocab_size=64, but GPT-2's tokenizer has 50,257 tokens"),
    "gpt2 with characters": (dict(CHAR_META, kind="gpt2", vocab_size=None),
                             r"says kind 'gpt2' but holds a character vocabulary \('stoi'/'itos'\)"),
    "char of another size": (dict(CHAR_META, vocab_size=65), r"says vocab_size=65, but its 'stoi' has 3 characters"),
    "tokenizer_file a list": ({"kind": "bpe", "vocab_size": 512, "tokenizer_file": ["tokenizer.json"]},
                              "has a list as its tokenizer_file, not a string"),
    "tokenizer_json not a text": ({"kind": "bpe", "tokenizer_json": {"model": {}}},
                                  "has a dict as its tokenizer_json, not a string"),
}


@pytest.mark.parametrize("case", list(BAD_META))
def test_a_bad_meta_json_entry_is_refused_when_the_dataset_is_read(case, tmp_path):
    meta, message = BAD_META[case]
    (tmp_path / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    with pytest.raises(TokenizerError, match=message) as e:
        read_dataset_meta(str(tmp_path))
    assert str(e.value).startswith(f"{tmp_path / 'meta.json'} ") and str(e.value).endswith(
        "; re-run the dataset's prepare.py") and "\n" not in str(e.value)


@pytest.mark.parametrize("case", ["vocab_size a string", "itos a list", "stoi with string ids"])
def test_a_bad_meta_pkl_entry_is_refused_too(case, tmp_path):
    meta, message = BAD_META[case]
    meta = dict(meta, itos={int(i): ch for i, ch in meta["itos"].items()}) if isinstance(meta["itos"], dict) else meta
    (tmp_path / "meta.pkl").write_bytes(pickle.dumps(meta))
    with pytest.raises(TokenizerError, match=message) as e:
        read_dataset_meta(str(tmp_path))
    assert str(e.value).startswith(str(tmp_path / "meta.pkl"))


@pytest.mark.parametrize("key", ["vocab_size", "eot_token"])
def test_a_bpe_meta_json_its_tokenizer_json_contradicts_is_refused_when_read(key, bpe512, tmp_path):
    directory = write_bpe_dataset(tmp_path / "ds", bpe512[0], bpe_corpus_text(300))
    meta = json.loads((tmp_path / "ds" / "meta.json").read_text(encoding="utf-8"))
    good = meta[key]
    (tmp_path / "ds" / "meta.json").write_text(json.dumps(dict(meta, **{key: 300})), encoding="utf-8")
    with pytest.raises(TokenizerError, match=f"meta.json says {key}=300 but its tokenizer.json has {key}={good}; "
                                             f"re-run the dataset's prepare.py"):
        read_dataset_meta(directory)


# -----------------------------------------------------------------------------
# each split's UTF-8 bytes, counted by its preparation (meta.json's "split_bytes"): exactly what
# tokenizer.split_bytes_per_token measures over the whole split; train.py takes its bits-per-byte figures from the
# record (no tokenizer loaded) when the token files have the recorded number of tokens, and measures them otherwise
# (a dataset prepared before the record, or one whose files differ from it); a malformed record is refused in one line

# 1-, 2-, 3- and 4-byte characters, so a token's bytes are not a token
TEXT = "To be, or not to be — café, naïve, 東京 and 🙂: that is the question.\nWhether 'tis nobler.\n" * 40


def read_record(directory):
    with open(os.path.join(directory, 'meta.json'), encoding='utf-8') as f:
        return json.load(f).get('split_bytes')


def write_record(directory, record):
    """ meta.json with its "split_bytes" replaced by record (None: removed, as before the record existed). """
    path = os.path.join(directory, 'meta.json')
    with open(path, encoding='utf-8') as f:
        meta = json.load(f)
    meta.pop('split_bytes', None)
    if record is not None:
        meta['split_bytes'] = record
    with open(path, 'w', encoding='utf-8') as f:
        json.dump(meta, f)


def measured(directory, split, tok):
    """ split_bytes_per_token over every token of a split: what the record must equal. """
    source = TokenSource(split_files(str(directory), split))
    return tokenizer.split_bytes_per_token(source, tok, sample_tokens=1 << 40)


def assert_record_is_the_whole_split(directory, tok, splits=('train', 'val')):
    record = read_record(directory)
    assert record['version'] == 1 and set(record) == {'version', *splits}
    data = find_dataset(str(directory))
    for split in splits:
        whole = measured(directory, split, tok)
        assert whole['whole'] and record[split]['tokens'] == whole['tokens_counted'] > 0
        assert whole['bytes_per_token'] == record[split]['bytes'] / record[split]['tokens']
        # the dataset's reading of it is the measurement itself, float for float
        assert data.recorded_bytes(split, whole['tokens_counted']) == whole
    return record


@pytest.fixture(scope='module')
def prepared(tmp_path_factory):
    """ {'char': (directory, tokenizer), 'gpt2': ...}: TEXT prepared as data/shakespeare_char and data/shakespeare
    do. """
    root = tmp_path_factory.mktemp('split_bytes')
    prepare_char(TEXT, str(root / 'char'))
    prepare_bpe(TEXT, str(root / 'gpt2'))
    return {'char': (str(root / 'char'), CharTokenizer.from_text(TEXT)), 'gpt2': (str(root / 'gpt2'), GPT2Tokenizer())}


@pytest.mark.parametrize('kind', ['char', 'gpt2'])
def test_shakespeare_records_each_whole_split(prepared, kind):
    directory, tok = prepared[kind]
    record = assert_record_is_the_whole_split(directory, tok)
    # the decoded text itself: nanoGPT's 90/10 character split, so train + val is TEXT
    assert record['train']['bytes'] + record['val']['bytes'] == len(TEXT.encode('utf-8'))
    assert record['train']['bytes'] > record['train']['tokens']  # multi-byte characters, BPE words
    # the record is not part of the tokenizer's description (what a checkpoint keeps)
    assert 'split_bytes' not in find_dataset(directory).meta
    if kind == 'char':  # nanoGPT's meta.pkl holds its own keys only
        with open(os.path.join(directory, 'meta.pkl'), 'rb') as f:
            assert set(pickle.load(f)) == {'vocab_size', 'itos', 'stoi'}


def test_a_rerun_is_the_same_dataset_and_records_an_old_one(tmp_path, capsys):
    """ check_same_dataset still knows a re-run, of a dataset prepared before the record too (which gets one). """
    directory = str(tmp_path / 'char')
    prepare_char(TEXT, directory)
    before = read_record(directory)
    write_record(directory, None)
    prepare_char(TEXT, directory)  # no --overwrite: the same preparation
    assert read_record(directory) == before
    assert '--overwrite' not in capsys.readouterr().out


@pytest.mark.parametrize('tokenizer_name', ['char', 'gpt2'])
def test_corpus_records_each_whole_split(tmp_path, tokenizer_name):
    from nanogpt_plus.prepare.corpus import prepare_corpus
    docs = [TEXT[i:i + 97 + i % 50] for i in range(0, len(TEXT), 150)]
    with open(tmp_path / 'corpus.jsonl', 'w', encoding='utf-8') as f:
        f.writelines(json.dumps({'text': doc}) + '\n' for doc in docs)
    out = str(tmp_path / 'out')
    # several batches per split, end-of-text tokens (gpt2) between the documents
    prepare_corpus(out, files=str(tmp_path / 'corpus.jsonl'), test_size=0.2, total_batches=3, progress=False,
                   cache_dir=str(tmp_path / 'cache'), tokenizer=tokenizer_name)
    tok = tokenizer.load_tokenizer(find_dataset(out).meta)
    assert_record_is_the_whole_split(out, tok)


def test_fineweb_shards_record_each_whole_split(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nanogpt_plus.prepare.fineweb import prepare_fineweb
    docs = [TEXT[i:i + 200] for i in range(0, len(TEXT), 200)]
    pq.write_table(pa.table({'text': docs}), tmp_path / 'corpus.parquet')
    out = tmp_path / 'out'
    prepare_fineweb(str(out), files=str(tmp_path / 'corpus.parquet'), shard_size=400, progress=False,
                    cache_dir=str(tmp_path / 'cache'))
    meta = json.loads((out / 'meta.json').read_text())
    assert len(meta['shards']) > 2 and all(r['bytes'] > r['tokens'] for r in meta['shards'])
    assert_record_is_the_whole_split(str(out), GPT2Tokenizer())
    # a run resumed from an earlier version's shards (their bytes uncounted) records no split's bytes
    for r in meta['shards']:
        del r['bytes']
    del meta['split_bytes'], meta['end_of_corpus']
    (out / 'meta.json').write_text(json.dumps(meta))
    prepare_fineweb(str(out), files=str(tmp_path / 'corpus.parquet'), shard_size=400, progress=False,
                    cache_dir=str(tmp_path / 'cache'))
    assert read_record(str(out)) is None and find_dataset(str(out)).split_bytes is None


def bytes_record(directory):
    """ The 'bytes_per_token' record of a run's metrics.jsonl. """
    record, = [r for r in read_metrics(os.path.join(directory, 'metrics.jsonl')) if r['type'] == 'bytes_per_token']
    return record


def run_train(directory, out):
    train.main(train_args(directory, out, max_iters=2, eval_interval=2, lr_decay_iters=2, warmup_iters=1, eval_iters=1,
                          n_layer=1, n_embd=16, block_size=16))


@pytest.fixture
def no_measuring(monkeypatch):
    """ A measurement of a split's bytes fails the test (the record must be taken). """
    def measure(*args, **kwargs):
        raise AssertionError("the split's bytes were measured")
    monkeypatch.setattr(tokenizer, 'split_bytes_per_token', measure)


def test_train_takes_the_record(tmp_path, no_measuring, capsys):
    directory = str(tmp_path / 'char')
    prepare_char(TEXT, directory)
    record = read_record(directory)
    # a record with its bytes doubled: the figure train.py logs is the record's, not a measurement
    doubled = dict(record, **{s: dict(record[s], bytes=2 * record[s]['bytes']) for s in ('train', 'val')})
    write_record(directory, doubled)
    run_train(directory, tmp_path / 'run')
    logged = bytes_record(tmp_path / 'run')
    for split in ('train', 'val'):
        assert logged[split] == 2 * record[split]['bytes'] / record[split]['tokens']
        assert logged[f'{split}_tokens_counted'] == record[split]['tokens'] and logged[f'{split}_whole'] is True
    capsys.readouterr()


@pytest.mark.parametrize('kind', ['char', 'gpt2'])
def test_train_measures_without_a_record(prepared, tmp_path, kind, capsys):
    """ A dataset prepared before the record existed: measured, the same figures. """
    source, tok = prepared[kind]
    directory = str(tmp_path / kind)
    os.makedirs(directory)
    for name in os.listdir(source):
        with open(os.path.join(source, name), 'rb') as f, open(os.path.join(directory, name), 'wb') as g:
            g.write(f.read())
    record = read_record(directory)
    write_record(directory, None)
    run_train(directory, tmp_path / 'run')
    logged = bytes_record(tmp_path / 'run')
    for split in ('train', 'val'):
        assert logged[split] == measured(directory, split, tok)['bytes_per_token']
        assert logged[split] == record[split]['bytes'] / record[split]['tokens']
        assert logged[f'{split}_tokens_counted'] == record[split]['tokens'] and logged[f'{split}_whole'] is True
    capsys.readouterr()


def test_train_measures_a_split_whose_files_differ_from_the_record(tmp_path, monkeypatch, capsys):
    """ Token files of another length than recorded (copied in from another preparation): that split measured,
    the other taken from the record. """
    directory = str(tmp_path / 'char')
    prepare_char(TEXT, directory)
    record = read_record(directory)
    wrong = dict(record, val={'tokens': record['val']['tokens'] + 1, 'bytes': 1})
    write_record(directory, wrong)
    calls = []
    real = tokenizer.split_bytes_per_token

    def measure(source, tok, **kwargs):
        calls.append(source.paths)
        return real(source, tok, **kwargs)
    monkeypatch.setattr(tokenizer, 'split_bytes_per_token', measure)
    run_train(directory, tmp_path / 'run')
    logged = bytes_record(tmp_path / 'run')
    assert calls == [[os.path.join(directory, 'val.bin')]]
    assert logged['val'] == record['val']['bytes'] / record['val']['tokens']
    assert logged['train'] == record['train']['bytes'] / record['train']['tokens']
    capsys.readouterr()


@pytest.mark.parametrize('record, words', [
    ([1, 2], "not a {\"version\": 1, ...} record"),
    ({'train': {'tokens': 5, 'bytes': 5}}, "not a {\"version\": 1, ...} record"),
    ({'version': 2, 'train': {'tokens': 5, 'bytes': 5}}, "not a {\"version\": 1, ...} record"),
    ({'version': 1, 'test': {'tokens': 5, 'bytes': 5}}, "entry 'test'"),
    ({'version': 1, 'train': {'tokens': -5, 'bytes': 5}}, "entry 'train'"),
    ({'version': 1, 'train': {'tokens': 5, 'bytes': '5'}}, "entry 'train'"),
    ({'version': 1, 'train': {'tokens': True, 'bytes': 5}}, "entry 'train'"),
    ({'version': 1, 'train': {'tokens': 5}}, "entry 'train'"),
    ({'version': 1, 'val': [5, 5]}, "entry 'val'"),
])
def test_a_malformed_record_is_refused_in_one_line(tmp_path, record, words, capsys):
    directory = str(tmp_path / 'char')
    prepare_char(TEXT, directory)
    write_record(directory, record)
    for attempt in (lambda: find_dataset(directory), lambda: run_train(directory, tmp_path / 'run')):
        with pytest.raises(TokenizerError) as e:
            attempt()
        message = str(e.value)
        assert '\n' not in message and words in message and "re-run the dataset's prepare.py" in message
        assert message.startswith(os.path.join(directory, 'meta.json'))
    capsys.readouterr()


def test_the_record_equals_a_measurement_of_large_token_ids(tmp_path):
    """ The counter of the prepare scripts and split_bytes_per_token sum the same lengths, batch by batch too. """
    from nanogpt_plus.prepare.token_files import ByteCounter
    tok = GPT2Tokenizer()
    ids = np.random.default_rng(0).integers(0, tok.vocab_size, 5000).astype(np.uint16)
    counter = ByteCounter(tokenizer.token_byte_lengths(tok))
    for batch in np.array_split(ids, 7):
        counter.add('train', batch)
    counter.add('val', ids[:10].tolist())  # a list of ids, as GPT-2's encoder gives
    ids.tofile(tmp_path / 'train.bin')
    ids[:10].tofile(tmp_path / 'val.bin')
    record = counter.record()
    for split in ('train', 'val'):
        whole = measured(tmp_path, split, tok)
        assert record[split] == {'tokens': whole['tokens_counted'],
                                 'bytes': len(tok.decode_bytes(np.fromfile(tmp_path / f'{split}.bin',
                                                                           dtype=np.uint16).tolist()))}
        assert whole['bytes_per_token'] == record[split]['bytes'] / record[split]['tokens']
