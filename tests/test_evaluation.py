"""
nanogpt_plus/evaluation/ (its __init__.py: eval.py's tasks): each task against an independent computation
(transformers' GPT-2 on the same weights for HellaSwag; per-token hand loops for loss, bits per byte and LAMBADA),
the loss over several val shards as their token-weighted mean, as many forwards on every rank, eval.py under
torchrun equal to one process, and clear errors (unknown task, missing or malformed files).
"""
import json
import math
import os
import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import TINY_VOCAB, assert_one_line_error, refuse_to_open, run, run_eval, save_test_checkpoint, write_meta
from model import GPT, GPTConfig
from nanogpt_plus.dataset import split_files
from nanogpt_plus.dataset.shards import write_shard
from nanogpt_plus.errors import UserError
from nanogpt_plus.evaluation import (
    evaluate,
    evaluate_hellaswag,
    hellaswag_examples,
    loss_windows,
    read_task_records,
    score_examples,
)
from nanogpt_plus.tokenizer import CharTokenizer, GPT2Tokenizer

CHARS = "abcdefgh é\n"


def tiny_gpt(vocab_size, block_size=16, seed=0, gelu='tanh'):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size, vocab_size=vocab_size,
                         gelu=gelu)).eval()


def run_task(model, task, tok, **settings):
    """ evaluate() on the CPU for a model with tokenizer tok, 4 rows per batch unless settings say otherwise. """
    return evaluate(model, task, tok.meta(), **dict(dict(batch_size=4, device='cpu'), **settings))


def write_jsonl(path, records):
    with open(path, 'w', encoding='utf-8') as f:
        for r in records:
            f.write(json.dumps(r) + '\n')
    return str(path)


# -----------------------------------------------------------------------------
# HellaSwag

HELLASWAG = [
    {'ctx': 'A man is sitting on a roof. He', 'endings': ['is using wrap to wrap a pair of skis.',
     'is ripping level tiles off.', "is holding a rubik's cube.", 'starts pulling up roofing on a roof.'],
     'label': 3},
    {'ctx': 'The cat', 'endings': ['sat.', 'sat on the mat and looked out of the window for a long time.',
     'ran', 'jumped over the quick brown fox, twice']},
    # a context longer than block_size: the row is cropped from the left
    {'ctx': 'Then, the man writes over the snow covering the window of a car, and a woman wearing winter '
            'clothes smiles. Then', 'endings': [', the man adds wax to the windshield and cuts it.',
            ', a person board a ski lift, while two men supporting the head of the person wearing winter '
            'clothes snow as the we girls sled.', ', the man puts on a christmas coat, knitted with netting.',
            ', the man continues removing the snow on his car.']},
    {'ctx': 'Hello', 'endings': [' world', 'there', 'world, how are you doing today my friend?']},
]


def hf_reference_losses(hf, tok, record, block_size):
    """ Per ending (sum, mean) loss with transformers' model, each sequence alone (no batching, no padding). """
    ctx = tok.encode_ordinary(record['ctx'])
    out = []
    for ending in record['endings']:
        end = tok.encode_ordinary(' ' + ending)
        full = (ctx + end)[-(block_size + 1):]
        n = min(len(end), len(full) - 1)
        with torch.no_grad():
            logits = hf(torch.tensor([full[:-1]])).logits[0]
        logp = F.log_softmax(logits.double(), dim=-1)
        nll = -logp[torch.arange(len(full) - 1), torch.tensor(full[1:])][-n:]
        out.append((nll.sum().item(), nll.mean().item()))
    return out


def test_hellaswag_matches_transformers_reference(tmp_path):
    from transformers import GPT2LMHeadModel

    from nanogpt_plus.hf_export import export
    tok = GPT2Tokenizer()
    model = tiny_gpt(50257, block_size=24)
    export(model, tok.meta(), str(tmp_path / 'hf'))
    hf = GPT2LMHeadModel.from_pretrained(str(tmp_path / 'hf')).eval()

    ref = [hf_reference_losses(hf, tok, r, 24) for r in HELLASWAG]
    best_sum = [min(range(len(r)), key=lambda i: r[i][0]) for r in ref]
    best_mean = [min(range(len(r)), key=lambda i: r[i][1]) for r in ref]
    # the data is chosen so that total and per-token loss disagree somewhere: acc and acc_norm differ
    assert best_sum != best_mean
    # labels: right by total loss, right by mean loss, wrong for both, right for the first one
    records = [dict(r) for r in HELLASWAG]
    records[0]['label'] = best_sum[0]
    records[1]['label'] = best_mean[1]
    records[2]['label'] = next(i for i in range(4) if i not in (best_sum[2], best_mean[2]))
    records[3]['label'] = best_sum[3]
    acc = sum(r['label'] == b for r, b in zip(records, best_sum)) / len(records)
    acc_norm = sum(r['label'] == b for r, b in zip(records, best_mean)) / len(records)
    path = write_jsonl(tmp_path / 'hs.jsonl', records)

    # batch sizes that put endings of different lengths (and of different examples) in one padded batch
    for batch_size in (1, 3, 16):
        result = run_task(model, 'hellaswag', tok, data_file=path, batch_size=batch_size)
        assert result['metrics'] == {'acc': acc, 'acc_norm': acc_norm}
        assert result['num_examples'] == 4

    # per ending, the scores themselves: only the ending tokens, cropped rows included
    rows, offsets, _ = hellaswag_examples(read_task_records('hellaswag', path), tok, 24)
    assert max(len(t) for t, _ in rows) == 25  # the long context was cropped to block_size + 1
    table = score_examples(model, rows, offsets, batch_size=5, device='cpu')
    expected = torch.tensor([loss for r in ref for loss in r], dtype=torch.float64)
    torch.testing.assert_close(table[:, 0], expected[:, 0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(table[:, 0] / table[:, 1], expected[:, 1], rtol=1e-5, atol=1e-5)
    # endings longer than the block keep only their last block_size tokens
    assert table[:, 1].tolist() == [min(len(tok.encode_ordinary(' ' + e)), 24) for r in records for e in r['endings']]

    # the in-process entry (a training loop's): the same metrics from examples built once
    examples = hellaswag_examples(read_task_records('hellaswag', path), tok, 24)
    assert evaluate_hellaswag(model, examples, batch_size=2, device='cpu') == {'acc': acc, 'acc_norm': acc_norm}

    one = run_task(model, 'hellaswag', tok, data_file=path, max_examples=1)
    assert one['num_examples'] == 1 and one['metrics']['acc'] == 1.0
    assert one['metrics']['acc_norm'] == float(best_mean[0] == best_sum[0])


# -----------------------------------------------------------------------------
# LAMBADA

def train_on(model, tok, text, steps=30):
    """ A few optimizer steps on one repeated text, so the model's greedy continuations are predictable. """
    ids = torch.tensor(tok.encode(text))
    T = model.config.block_size
    x = torch.stack([ids[i:i + T] for i in range(0, len(ids) - T - 1, 7)])
    y = torch.stack([ids[i + 1:i + T + 1] for i in range(0, len(ids) - T - 1, 7)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    for _ in range(steps):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_lambada_against_hand_computation(tmp_path):
    tok = CharTokenizer.from_text(CHARS)
    torch.manual_seed(3)
    model = train_on(tiny_gpt(tok.vocab_size, block_size=16, seed=3), tok, "ab cd efg " * 12)
    # the whole last word right; the first letters right but not the last; no pattern at all
    hits = ["efg ab cd efg ab cd", "ab cd efg ab cd efg"]
    wrong_last = "efg ab cd efg ab ce"
    texts = hits + [wrong_last, 'abc defgh ab' * 3 + 'éa', 'h\ng ab']
    path = write_jsonl(tmp_path / 'lambada.jsonl', [{'text': t} for t in texts])

    nlls = []
    greedy = []
    for text in texts:
        context, word = text.rsplit(' ', 1)
        full = tok.encode(context + ' ' + word)
        nll = 0.0
        ok = True
        # the passage is cropped from the left to block_size + 1 tokens
        start = max(0, len(full) - 17)
        # each target char of ' ' + word, after everything before it
        for j in range(len(context), len(full)):
            with torch.no_grad():
                logits = model(torch.tensor([full[start:j]]))[0][0, -1].double()
            nll -= F.log_softmax(logits, -1)[full[j]].item()
            ok &= logits.argmax().item() == full[j]
        nlls.append(nll)
        greedy.append(ok)
    assert greedy[:3] == [True, True, False]

    result = run_task(model, 'lambada', tok, data_file=path, batch_size=2)
    assert result['metrics']['acc'] == pytest.approx(sum(greedy) / len(texts))
    assert result['metrics']['ppl'] == pytest.approx(math.exp(sum(nlls) / len(texts)), rel=1e-6)
    assert result['num_examples'] == 5


# -----------------------------------------------------------------------------
# loss over a token file

@pytest.mark.parametrize('num_tokens,block_size,stride', [(50, 8, 0), (50, 8, 3), (9, 8, 0), (2, 8, 1), (37, 5, 5)])
def test_loss_windows_score_every_token_once(num_tokens, block_size, stride):
    seen = []
    for begin, end, n_scored in loss_windows(num_tokens, block_size, stride):
        assert 0 < end - begin <= block_size and 0 < n_scored <= end - begin
        targets = list(range(end + 1 - n_scored, end + 1))  # target positions this window scores
        # a sliding window's promise: each target sees the start of the file or block_size - S + 1 tokens
        assert all(t - begin >= min(t, block_size - (stride or block_size) + 1) for t in targets)
        seen += targets
    assert seen == list(range(1, num_tokens))


def test_loss_and_bits_per_byte_against_hand_computation(tmp_path):
    tok = CharTokenizer.from_text(CHARS)
    T = 8
    model = tiny_gpt(tok.vocab_size, block_size=T, seed=1)
    text = "abc défg h\naé" * 4
    ids = tok.encode(text)
    data_dir = tmp_path / 'tiny'
    os.makedirs(data_dir)
    np.array(ids, dtype=np.uint16).tofile(data_dir / 'val.bin')
    with open(data_dir / 'meta.json', 'w') as f:
        json.dump(tok.meta(), f)

    def nll_of(j, start):
        with torch.no_grad():
            logits = model(torch.tensor([ids[start:j]]))[0][0, -1].double()
        return -F.log_softmax(logits, -1)[ids[j]].item()

    num_bytes = len(tok.decode(ids[1:]).encode('utf-8'))
    assert num_bytes > len(ids) - 1  # 'é' is two bytes
    for stride in (0, 3, 1):
        S = stride or T
        # target j sees the context from the start of the last window that scores it
        starts = [0 if j <= T else math.ceil((j - T) / S) * S for j in range(1, len(ids))]
        nll = sum(nll_of(j, s) for j, s in zip(range(1, len(ids)), starts))
        result = run_task(model, 'loss', tok, data_file=str(data_dir / 'val.bin'), stride=stride, batch_size=3)
        m = result['metrics']
        assert result['task'] == 'loss' and result['data_file'] == str(data_dir / 'val.bin')
        assert m['tokens'] == len(ids) - 1 and m['bytes'] == num_bytes
        assert m['loss'] == pytest.approx(nll / (len(ids) - 1), rel=1e-6)
        assert m['perplexity'] == pytest.approx(math.exp(nll / (len(ids) - 1)), rel=1e-6)
        assert m['bits_per_byte'] == pytest.approx(nll / math.log(2) / num_bytes, rel=1e-6)
        # every batch padded to block_size (what --compile does): the same numbers
        padded = run_task(model, 'loss', tok, data_file=str(data_dir / 'val.bin'), stride=stride, batch_size=3,
                          pad_to=T)['metrics']
        assert padded.keys() == m.keys() and all(padded[k] == pytest.approx(m[k], rel=1e-6) for k in m)

    # max_examples: only the first windows (non-overlapping: 2 windows = 2 * T targets)
    result = run_task(model, 'loss', tok, data_file=str(data_dir / 'val.bin'), max_examples=2)
    assert result['num_examples'] == 2 and result['metrics']['tokens'] == 2 * T
    nll = sum(nll_of(j, (j - 1) // T * T) for j in range(1, 2 * T + 1))
    assert result['metrics']['loss'] == pytest.approx(nll / (2 * T), rel=1e-6)

    # --dataset (a name under data/ or a directory) and --split pick the token file
    # dataset_dir recognises a dataset by it
    np.zeros(4, dtype=np.uint16).tofile(data_dir / 'train.bin')
    by_name = run_task(model, 'loss', tok, dataset=str(data_dir), split='val')
    assert by_name['data_file'] == str(data_dir / 'val.bin') and by_name['metrics']['tokens'] == len(ids) - 1

    with pytest.raises(UserError, match='stride'):
        run_task(model, 'loss', tok, data_file=str(data_dir / 'val.bin'), stride=T + 1)


# -----------------------------------------------------------------------------
# end to end: one command per task, DDP equals one process

def test_cli_ddp_equals_single_process(tmp_path):
    tok = CharTokenizer.from_text(CHARS)
    model = tiny_gpt(tok.vocab_size, block_size=16, seed=2)
    out_dir = str(tmp_path / 'out')
    save_test_checkpoint(model, tok.meta(), os.path.join(out_dir, 'ckpt.pt'), dataset=str(tmp_path / 'ds'))
    os.makedirs(tmp_path / 'ds')
    rng = np.random.default_rng(0)
    rng.integers(0, tok.vocab_size, 203).astype(np.uint16).tofile(tmp_path / 'ds' / 'val.bin')
    # dataset_dir looks for train.bin
    np.zeros(20, dtype=np.uint16).tofile(tmp_path / 'ds' / 'train.bin')
    records = [{'ctx': 'abc de', 'endings': ['fg', 'a', 'hh gg', 'bad'], 'label': i % 4} for i in range(5)]
    records += [{'ctx': 'h' * k + ' ab', 'endings': ['c' * k, 'd', 'e f'], 'label': k % 3} for k in range(1, 5)]
    hs = write_jsonl(tmp_path / 'hs.jsonl', records)

    results = {}
    for task, extra in (('hellaswag', [f'--data_file={hs}', '--batch_size=3']),
                        # the dataset comes from the checkpoint
                        ('loss', ['--stride=5', '--batch_size=2'])):
        for ddp in (False, True):
            out_file = str(tmp_path / f'{task}_{ddp}.json')
            r = run_eval([f'--out_dir={out_dir}', f'--task={task}', f'--output_file={out_file}'] + extra, torchrun=ddp)
            assert r.returncode == 0, r.stderr[-3000:]
            line = json.loads(r.stdout.strip().splitlines()[-1])
            assert line == json.load(open(out_file))  # the printed line and the file agree
            # the documented layout, in this order, naming the checkpoint and the file scored
            assert list(line) == ['task', 'metrics', 'num_examples', 'source', 'data_file']
            assert line['task'] == task and line['source'] == os.path.join(out_dir, 'ckpt.pt')
            assert line['data_file'] == (hs if task == 'hellaswag' else os.path.join(tmp_path, 'ds', 'val.bin'))
            results[task, ddp] = line
    for task in ('hellaswag', 'loss'):
        single = results[task, False]
        ddp = results[task, True]
        assert single['num_examples'] == ddp['num_examples']
        for key, value in single['metrics'].items():
            # equal up to float32 rounding: a row's logits can differ in the last bits with the batch it is in
            assert ddp['metrics'][key] == pytest.approx(value, rel=1e-6), key
    assert results['hellaswag', False]['metrics'] == results['hellaswag', True]['metrics']
    assert results['hellaswag', False]['num_examples'] == 9
    assert results['loss', False]['metrics']['tokens'] == 202


# -----------------------------------------------------------------------------
# errors

def test_cli_errors_unknown_task_and_missing_file(tmp_path):
    r = run_eval(['--task=winogrande'])
    assert r.returncode == 2 and "unknown task 'winogrande'" in r.stderr and 'Traceback' not in r.stderr
    missing = str(tmp_path / 'nope.jsonl')
    r = run_eval(['--task=hellaswag', f'--data_file={missing}'])
    assert r.returncode == 2 and f'no data file at {missing}' in r.stderr and 'Traceback' not in r.stderr


def test_missing_token_file_and_dataset(tmp_path):
    tok = CharTokenizer.from_text(CHARS)
    model = tiny_gpt(tok.vocab_size)
    with pytest.raises(UserError, match='no token file'):
        run_task(model, 'loss', tok, data_file=str(tmp_path / 'val.bin'))
    with pytest.raises(UserError, match='--dataset'):
        # neither a file nor a dataset (eval.py's main takes it from the checkpoint)
        run_task(model, 'loss', tok)
    with pytest.raises(UserError, match='batch_size must be at least 1'):
        run_task(model, 'loss', tok, data_file=str(tmp_path / 'val.bin'), batch_size=0)


def test_malformed_jsonl_names_the_line(tmp_path):
    tok = CharTokenizer.from_text(CHARS)
    model = tiny_gpt(tok.vocab_size)
    path = tmp_path / 'bad.jsonl'
    good = json.dumps({'ctx': 'ab', 'endings': ['c', 'd'], 'label': 0})
    path.write_text(good + '\n\n' + '{"ctx": "ab", "endings": [\n')
    with pytest.raises(UserError, match=r'line 3 is not valid JSON'):
        run_task(model, 'hellaswag', tok, data_file=str(path))
    path.write_text(good + '\n' + json.dumps({'ctx': 'ab', 'endings': ['c', 'd']}) + '\n')
    with pytest.raises(UserError, match=r"line 2 has no 'label'"):
        run_task(model, 'hellaswag', tok, data_file=str(path))
    path.write_text(good + '\n' + json.dumps({'ctx': 'ab', 'endings': ['c', 'd'], 'label': 5}) + '\n')
    with pytest.raises(UserError, match=r'line 2:'):
        run_task(model, 'hellaswag', tok, data_file=str(path))
    path.write_text(json.dumps({'text': 'ab c'}) + '\n' + json.dumps({'text': 'nospace'}) + '\n')
    with pytest.raises(UserError, match=r'line 2:'):
        run_task(model, 'lambada', tok, data_file=str(path))
    with pytest.raises(UserError, match='unknown task'):
        run_task(model, 'piqa', tok, data_file=str(path))


@pytest.mark.parametrize('task,damage,message', [
    ('hellaswag', 'nested', r"hs\.jsonl line 2 is nested too deeply to read as JSON; fix or remove that line"),
    ('lambada', 'nested', r"lb\.jsonl line 2 is nested too deeply to read as JSON; fix or remove that line"),
    ('hellaswag', 'unreadable', r"could not read .*hs\.jsonl \(Permission denied\); make it readable by this user"),
    ('loss', 'unreadable', r"could not read .*val\.bin \(Permission denied\); make it readable by this user"),
])
def test_a_data_file_that_cant_be_read_is_one_line(tmp_path, monkeypatch, capsys, task, damage, message):
    tok = CharTokenizer.from_text(CHARS)
    out_dir = tmp_path / 'out'
    save_test_checkpoint(tiny_gpt(tok.vocab_size), tok.meta(), str(out_dir / 'ckpt.pt'))
    data = tmp_path / 'data'
    data.mkdir()
    files = {'hellaswag': ('hs.jsonl', json.dumps({'ctx': 'ab', 'endings': ['c', 'd'], 'label': 0})),
             'lambada': ('lb.jsonl', json.dumps({'text': 'ab cd'}))}
    if task == 'loss':
        path = data / 'val.bin'
        (np.arange(40) % tok.vocab_size).astype(np.uint16).tofile(path)
        (data / 'meta.json').write_text(json.dumps(tok.meta()))
    else:
        name, good = files[task]
        path = data / name
        # 200,000 [ on a line: more than the JSON decoder's recursion allows
        path.write_text(good + '\n' + ('[' * 200_000 if damage == 'nested' else good) + '\n')
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    if damage == 'unreadable':
        refuse_to_open(monkeypatch, path)
    code, _, err = run('eval.py', monkeypatch, capsys, '--device=cpu', f'--out_dir={out_dir}', f'--task={task}',
                       f'--data_file={path}')
    assert_one_line_error(code, err, '')
    assert re.search(message, err), err
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before


def test_eval_loss_over_several_val_shards_is_their_token_weighted_mean(tmp_path):
    from model import GPT, GPTConfig
    from nanogpt_plus.evaluation import evaluate
    d = tmp_path / "d"
    d.mkdir()
    rng = np.random.default_rng(1)
    for i, n in enumerate((90, 57)):
        write_shard(str(d / f"x_val_{i:06d}.bin"), rng.integers(0, TINY_VOCAB, n).astype(np.uint16))
    write_shard(str(d / "x_train_000002.bin"), np.arange(40, dtype=np.uint16) % TINY_VOCAB)
    write_meta(d)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=TINY_VOCAB)).eval()
    meta = {"kind": "char", "vocab_size": TINY_VOCAB}
    both = evaluate(model, 'loss', meta, dataset=str(d), batch_size=4)
    parts = [evaluate(model, 'loss', meta, data_file=p, batch_size=4)['metrics'] for p in split_files(str(d), 'val')]
    assert both['data_file'] == str(d) and both['metrics']['tokens'] == 89 + 56
    expected = sum(m['loss'] * m['tokens'] for m in parts) / 145
    assert both['metrics']['loss'] == pytest.approx(expected, rel=1e-9)
    assert both['metrics']['bytes'] == sum(m['bytes'] for m in parts)
    assert evaluate(model, 'loss', meta, data_file=str(d), split='train')['metrics']['tokens'] == 39


class CountingModel(torch.nn.Module):
    """ Logits of all-zero weights, and a count of its forward passes. """

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def forward(self, idx, all_positions=False):
        self.forwards += 1
        return torch.zeros(*idx.shape, 5), None


class FakeDist:
    under_torchrun = True
    device = 'cpu'

    def __init__(self, rank, world_size):
        self.rank = rank
        self.world_size = world_size


def test_score_examples_runs_as_many_forwards_on_every_rank(monkeypatch):
    # 5 examples of one row over 2 ranks with batches of 2: rank 0 has 3 rows (2 batches), rank 1 has 2 (1)
    import torch.distributed as dist
    # one process plays each rank in turn
    monkeypatch.setattr(dist, "all_reduce", lambda t, op=None: None)
    rows = [([1, 2, 3], 2)] * 5
    counts = []
    tables = []
    for rank in range(2):
        model = CountingModel()
        tables.append(score_examples(model, rows, list(range(6)), 2, 'cpu', dist_info=FakeDist(rank, 2)))
        counts.append(model.forwards)
    assert counts == [2, 2]
    # the padding forward is not in the results: rank 1's table holds its 2 rows only
    assert tables[1][:, 1].tolist() == [0, 2, 0, 2, 0]


# -----------------------------------------------------------------------------
# the CPU thread count: train.py's choice (num_threads=0: timed on a batch, re-checked over the batches)

@pytest.mark.parametrize('task', ['loss', 'hellaswag'])
def test_eval_times_its_threads_on_its_batches_and_retunes(tmp_path, monkeypatch, capsys, task):
    import eval as eval_script
    from helpers import FakeThreadTiming, run_script
    from nanogpt_plus import machine
    tok = CharTokenizer.from_text(CHARS)
    out_dir = str(tmp_path / 'out')
    save_test_checkpoint(tiny_gpt(tok.vocab_size), tok.meta(), os.path.join(out_dir, 'ckpt.pt'),
                         dataset=str(tmp_path / 'ds'))
    os.makedirs(tmp_path / 'ds')
    np.random.default_rng(0).integers(0, tok.vocab_size, 200).astype(np.uint16).tofile(tmp_path / 'ds' / 'val.bin')
    np.zeros(20, dtype=np.uint16).tofile(tmp_path / 'ds' / 'train.bin')
    hs = write_jsonl(tmp_path / 'hs.jsonl', [{'ctx': 'abc de', 'endings': ['fg', 'a'], 'label': i % 2}
                                             for i in range(12)])
    args = [f'--out_dir={out_dir}', f'--task={task}', '--device=cpu', '--batch_size=2', f'--data_file={hs}'
            if task == 'hellaswag' else '--stride=0']
    fake = FakeThreadTiming({2: 0.04, 1: 0.02}, interval=3, probe=1, window=3).install(monkeypatch, machine)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # torch's default on 2 cores
        run_script(eval_script, monkeypatch, *args)
        reference = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        # 13 loss windows (199 targets, 16 a window) or 24 HellaSwag rows, 2 a batch: the first timed at each
        # count, then every batch after the first fed to the retuner, which re-checked the other count
        assert fake.timed == [[2, 1]]
        assert len(fake.seen) == {'loss': 6, 'hellaswag': 11}[task]
        assert fake.seen[0][1] == 1 and {n for _, n in fake.seen} == {1, 2}
        fake.timed.clear()
        torch.set_num_threads(1)
        run_script(eval_script, monkeypatch, *args, '--num_threads=2')
        out = capsys.readouterr().out
        assert fake.timed == [] and torch.get_num_threads() == 2  # a fixed count: set, never timed
        # the thread count changes no figure beyond float rounding
        metrics = json.loads(out.strip().splitlines()[-1])['metrics']
        assert metrics == pytest.approx(reference['metrics'], rel=1e-5)
    finally:
        torch.set_num_threads(before)
