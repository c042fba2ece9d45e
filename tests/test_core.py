"""
nanogpt_plus/evaluation/core.py (the CORE tasks, eval.py --task=core): the three task types on a small bundle
written here, against a direct loop over model(...) per prompt; centring and CORE by hand; bad bundles refused in
one line; the download path; eval.py under torchrun with 2 gloo ranks equal to one process (slow).
"""
import json
import os
import random
import re
import stat
import zipfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import assert_one_line_error, refuse_to_open, run, run_eval, run_with_file_size_limit, save_test_checkpoint
from model import GPT, GPTConfig
from nanogpt_plus.errors import UserError
from nanogpt_plus.evaluation import core as core_eval
from nanogpt_plus.evaluation import score_examples
from nanogpt_plus.tokenizer import CharTokenizer, GPT2Tokenizer

# every choice starts with "the": the prompts share it, so only what follows is scored
MC = [
    {'query': 'Which one is fast?', 'choices': ['the red car', 'the red bus', 'the blue car'], 'gold': 0},
    {'query': 'What do cats say?', 'choices': ['the meow', 'the woof', 'the moo'], 'gold': 0},
    {'query': 'Pick a number:', 'choices': ['the one', 'the two', 'the three', 'the four'], 'gold': 2},
    {'query': 'Colour of the sky?', 'choices': ['the blue one', 'the green one'], 'gold': 0},
    {'query': 'Where do fish live?', 'choices': ['the sea', 'the desert', 'the sky'], 'gold': 0},
]


# every option ends with " said": the shared suffix reaches into the options
SCHEMA = [
    {'context_options': ['The man said', 'The woman said'], 'continuation': 'hello to her', 'gold': 0},
    {'context_options': ['A dog said', 'A cat said', 'A cow said'], 'continuation': 'nothing at all', 'gold': 1},
    {'context_options': ['Paul said', 'Mary said'], 'continuation': 'she is tired', 'gold': 1},
    {'context_options': ['He said', 'They said'], 'continuation': 'we are late', 'gold': 1},
]


# contexts with trailing spaces (and a tab): dropped before the delimiter
LM = [
    {'context': 'The capital of France is  ', 'continuation': 'Paris'},
    {'context': 'One, two, three, ', 'continuation': 'four'},
    {'context': 'Roses are red, violets are\t ', 'continuation': 'blue'},
    {'context': 'A B C', 'continuation': 'D E'},
    {'context': 'Monday, Tuesday,  ', 'continuation': 'Wednesday'},
]


# label, type, few-shot examples, delimiter, examples, random baseline (%)
TASKS = [
    ('mc_two_shot', 'multiple_choice', 2, ' ', MC, 25.0),
    ('schema_one_shot', 'schema', 1, ' ', SCHEMA, 50.0),
    ('lm_two_shot', 'language_modeling', 2, ' ', LM, 0.0),
    ('mc_answer', 'multiple_choice', 0, '\nAnswer: ', MC, 30.0),
]


def write_bundle(directory, tasks=TASKS):
    """ A DCLM-format bundle of tasks (TASKS' rows) under directory; returns its path. """
    os.makedirs(os.path.join(directory, 'eval_data', 'sets'), exist_ok=True)
    entries = []
    for label, task_type, shots, delimiter, items, _ in tasks:
        uri = f'sets/{label}.jsonl'
        with open(os.path.join(directory, 'eval_data', uri), 'w', encoding='utf-8') as f:
            f.writelines(json.dumps(item) + '\n' for item in items)
        entries.append(f"- label: {label}\n  dataset_uri: {uri}\n  num_fewshot: [{shots}]\n"
                       f"  icl_task_type: {task_type}\n  continuation_delimiter: {json.dumps(delimiter)}\n")
    with open(os.path.join(directory, 'core.yaml'), 'w', encoding='utf-8') as f:
        f.write('icl_tasks:\n' + ''.join(entries))
    with open(os.path.join(directory, 'eval_meta_data.csv'), 'w', encoding='utf-8') as f:
        f.write('Eval Task,Task Category,Random baseline,Description\n')
        f.writelines(f'{t[0]},test,{t[5]},a test task\n' for t in tasks)
    return str(directory)


def tiny_gpt(vocab_size, block_size, seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=block_size, vocab_size=vocab_size)).eval()


# -----------------------------------------------------------------------------
# the reference: prompts written out as text, split by hand into what is context and what is scored,
# each one through the model alone

def shuffled_with_shots(items, k):
    """ The examples in the bundle's fixed order, each with its k few-shot examples: DCLM's draw as
    nanochat makes it (lines shuffled by Random(1337), example i's shots by Random(1234 + i)). """
    order = list(range(len(items)))
    random.Random(1337).shuffle(order)
    kept = [items[i] for i in order]
    return [(item, [kept[j] for j in random.Random(1234 + i).sample([j for j in range(len(kept)) if j != i], k)])
            for i, item in enumerate(kept)]


def split_prompts(task_type, item, shots, delimiter):
    """ [(context text, scored text)] of an example, one per choice / option / the LM item. """
    if task_type == 'multiple_choice':
        head = '\n\n'.join(s['query'] + delimiter + s['choices'][s['gold']] for s in shots + [item])
        # the example's own answer goes
        head = head[:len(head) - len(item['choices'][item['gold']])]
        return [(head + 'the', choice[len('the'):]) for choice in item['choices']]
    if task_type == 'schema':
        lines = [s['context_options'][s['gold']] + delimiter + s['continuation'] for s in shots]
        head = ''.join(line + '\n\n' for line in lines)
        return [(head + option[:-len(' said')], ' said' + delimiter + item['continuation'])
                for option in item['context_options']]
    lines = [s['context'].strip() + delimiter + s['continuation'] for s in shots]
    head = ''.join(line + '\n\n' for line in lines)
    return [(head + item['context'].strip(), delimiter + item['continuation'])]


@torch.no_grad()
def reference_rows(model, tok, context, scored, block_size):
    """ (sum of losses, tokens scored, all greedy, scored tokens) of one prompt, forwarded alone. """
    start = [] if tok.eot_token is None else [tok.eot_token]
    tokens = start + tok.encode_ordinary(context) + tok.encode_ordinary(scored)
    # the split is at a token boundary
    assert tokens == start + tok.encode_ordinary(context + scored)
    n = len(tok.encode_ordinary(scored))
    tokens = tokens[-(block_size + 1):]
    n = min(n, len(tokens) - 1)
    logits, _ = model(torch.tensor([tokens[:-1]]), all_positions=True)
    targets = torch.tensor(tokens[1:])
    losses = F.cross_entropy(logits[0].double(), targets, reduction='none')[-n:]
    greedy = bool((logits[0].argmax(-1) == targets)[-n:].all())
    return losses.sum().item(), n, greedy, tokens[-n:]


def reference_task(model, tok, task, block_size):
    """ (rows as reference_rows gives them, accuracy) of one TASKS row. """
    label, task_type, k, delimiter, items, _ = task
    rows = []
    correct = []
    for item, shots in shuffled_with_shots(items, k):
        prompts = split_prompts(task_type, item, shots, delimiter)
        mine = [reference_rows(model, tok, c, s, block_size) for c, s in prompts]
        rows += mine
        if task_type == 'language_modeling':
            correct.append(mine[0][2])
        else:
            means = [r[0] / r[1] for r in mine]
            correct.append(means.index(min(means)) == item['gold'])
    return rows, sum(correct) / len(correct)


def test_three_task_types_match_a_direct_loop(tmp_path):
    tok = GPT2Tokenizer()
    block_size = 20  # most few-shot prompts are longer: cropped from the left
    model = tiny_gpt(tok.vocab_size, block_size)
    tasks = core_eval.read_bundle(write_bundle(tmp_path / 'bundle'))
    assert [t.label for t in tasks] == [t[0] for t in TASKS]
    assert tasks[3].delimiter == '\nAnswer: ' and tasks[0].num_fewshot == 2 and tasks[1].baseline == 50.0
    cropped = 0
    for task, spec in zip(tasks, TASKS):
        expected_rows, expected_acc = reference_task(model, tok, spec, block_size)
        rows, offsets = core_eval.task_rows(task, core_eval.task_items(task), tok, block_size)
        assert [tokens[len(tokens) - n:] for tokens, n in rows] == [r[3] for r in expected_rows]
        cropped += sum(len(tokens) == block_size + 1 for tokens, _ in rows)
        # 3 rows a batch: rows of different examples and lengths share a padded batch
        table = score_examples(model, rows, offsets, batch_size=3, device='cpu')
        torch.testing.assert_close(table[:, 0], torch.tensor([r[0] for r in expected_rows], dtype=torch.float64),
                                   rtol=1e-5, atol=1e-5)
        assert table[:, 1].tolist() == [r[1] for r in expected_rows]
        assert table[:, 2].tolist() == [float(r[2]) for r in expected_rows]
        golds = [item.get('gold') for _, item in core_eval.task_items(task)]
        correct = core_eval.correct_examples(task.task_type, table, offsets, golds, rows)
        assert sum(correct) / len(correct) == expected_acc and len(correct) == len(spec[4])
    assert cropped > 0
    # what is scored, decoded: after the answers' shared "the"; the options' shared " said" and the
    # continuation; the LM item's continuation after its context lost its trailing spaces
    mc = core_eval.task_rows(tasks[0], [(1, MC[0])] * 3, tok, 64)[0][:3]
    assert [tok.decode(t[len(t) - n:]) for t, n in mc] == [' red car', ' red bus', ' blue car']
    schema = core_eval.task_rows(tasks[1], [(1, SCHEMA[0])] * 2, tok, 64)[0][:2]
    assert [tok.decode(t[len(t) - n:]) for t, n in schema] == [' said hello to her'] * 2
    lm_task = core_eval.CoreTask('lm', 'language_modeling', 0, ' ', 'x', 0.0)
    (tokens, n), = core_eval.task_rows(lm_task, [(1, LM[0])], tok, 64)[0]
    assert tok.decode(tokens) == '<|endoftext|>The capital of France is Paris' and tok.decode(tokens[-n:]) == ' Paris'


def test_few_shot_prompts_rendered():
    item = {'query': 'Q3', 'choices': ['a', 'b'], 'gold': 1}
    shots = [{'query': 'Q1', 'choices': ['x', 'y'], 'gold': 0}, {'query': 'Q2', 'choices': ['z', 'w'], 'gold': 1}]
    assert core_eval.prompts_of('multiple_choice', item, shots, ': ') == ['Q1: x\n\nQ2: w\n\nQ3: a',
                                                                          'Q1: x\n\nQ2: w\n\nQ3: b']
    schema = {'context_options': ['A', 'B'], 'continuation': 'c', 'gold': 0}
    assert core_eval.prompts_of('schema', schema, [dict(schema, gold=1)], ' ') == ['B c\n\nA c', 'B c\n\nB c']
    lm = {'context': ' ctx  ', 'continuation': 'end'}
    assert core_eval.prompts_of('language_modeling', lm, [{'context': 'one ', 'continuation': 'two'}], ' ') == \
        ['one two\n\nctx', 'one two\n\nctx end']
    # few-shot examples: a fixed draw, never the example itself
    draws = [core_eval.fewshot_for(i, 6, 5) for i in range(6)]
    assert all(sorted(d) == [j for j in range(6) if j != i] for i, d in enumerate(draws))
    assert core_eval.fewshot_for(2, 50, 10) == core_eval.fewshot_for(2, 50, 10) != core_eval.fewshot_for(3, 50, 10)


@torch.no_grad()
def greedy_text(model, tok, text, n):
    """ The model's n greedy characters after text (a character tokenizer: no start token). """
    ids = tok.encode(text)
    for _ in range(n):
        logits, _ = model(torch.tensor([ids[-model.config.block_size:]]))
        ids.append(int(logits[0, -1].argmax()))
    return tok.decode(ids[len(tok.encode(text)):])


def test_language_modelling_is_the_greedy_match():
    """ A character model (no start token): an item is right exactly when its continuation is the greedy one. """
    tok = CharTokenizer.from_text("abcdefgh \n")
    model = tiny_gpt(tok.vocab_size, 16, seed=1)
    contexts = ['ab cd  ', 'ba ', 'hhh', 'gf e\n']
    # no delimiter: the continuation follows the context with its trailing space and newline dropped
    greedy = [greedy_text(model, tok, c.strip(), 3) for c in contexts]
    assert all(g.strip() == g for g in greedy)  # (this model's: so no continuation is blank)
    wrong = {g: ('a' if g[0] != 'a' else 'b') + g[1:] for g in greedy}
    items = [{'context': c, 'continuation': g if k % 2 == 0 else wrong[g]}
             for k, (c, g) in enumerate(zip(contexts, greedy))]
    task = core_eval.CoreTask('lm', 'language_modeling', 0, '', 'x', 0.0)
    rows, offsets = core_eval.task_rows(task, list(enumerate(items, 1)), tok, 16)
    table = score_examples(model, rows, offsets, batch_size=3, device='cpu')
    correct = core_eval.correct_examples('language_modeling', table, offsets, [None] * len(items), rows)
    expected = [reference_rows(model, tok, it['context'].strip(), it['continuation'], 16)[2] for it in items]
    assert correct == [float(e) for e in expected] == [1.0, 0.0, 1.0, 0.0]


def test_centring_and_core_by_hand(tmp_path):
    assert core_eval.centered(0.5, 25.0) == pytest.approx(1 / 3)
    assert core_eval.centered(0.25, 25.0) == 0.0
    assert core_eval.centered(1.0, 50.0) == 1.0
    assert core_eval.centered(0.1, 20.0) == pytest.approx(-0.125)
    assert core_eval.core_score([1 / 3, 0.0, 1.0, -0.125]) == pytest.approx((1 / 3 + 1 - 0.125) / 4)
    # end to end: CORE is the mean of each task's accuracy centred on its bundle baseline
    tok = GPT2Tokenizer()
    model = tiny_gpt(tok.vocab_size, 32)
    result = core_eval.evaluate_bundle(model, tok.meta(), data_file=write_bundle(tmp_path / 'b'), batch_size=4)
    tasks = result['metrics']['tasks']
    centred = [(tasks[label]['accuracy'] - b / 100) / (1 - b / 100) for label, *_, b in TASKS]
    assert [tasks[t[0]]['centered'] for t in TASKS] == pytest.approx(centred)
    assert result['metrics']['core'] == pytest.approx(sum(centred) / len(centred))
    assert result['num_examples'] == sum(len(t[4]) for t in TASKS) and result['data_file'] == str(tmp_path / 'b')


def test_dataset_uri_relative_to_eval_data_or_starting_with_it(tmp_path):
    # DCLM writes 'sets/x.jsonl' (under eval_data/); a task of one's own written as 'eval_data/sets/x.jsonl' reads
    # the same file, not eval_data/eval_data/sets/x.jsonl
    bundle = write_bundle(tmp_path / 'b')
    as_dclm = core_eval.read_bundle(bundle)
    rewrite(tmp_path / 'b' / 'core.yaml', 'dataset_uri: sets/mc_two_shot.jsonl',
            'dataset_uri: eval_data/sets/mc_two_shot.jsonl')
    rewrite(tmp_path / 'b' / 'core.yaml', 'dataset_uri: sets/lm_two_shot.jsonl',
            'dataset_uri: ./eval_data/sets/lm_two_shot.jsonl')
    prefixed = core_eval.read_bundle(bundle)
    assert [os.path.samefile(a.path, b.path) for a, b in zip(as_dclm, prefixed)] == [True] * len(TASKS)
    assert core_eval.task_file('B', 'eval_data/sets/x.jsonl') == os.path.join('B', 'eval_data/sets/x.jsonl')
    assert core_eval.task_file('B', 'sets/x.jsonl') == os.path.join('B', 'eval_data', 'sets/x.jsonl')


class SlowGPT(torch.nn.Module):
    """ A GPT whose every forward takes a second on the fake clock of nanogpt_plus/progress.py. """

    def __init__(self, gpt, clock):
        super().__init__()
        self.gpt, self.config, self.clock = gpt, gpt.config, clock

    def forward(self, *args, **kwargs):
        self.clock.now += 1.0
        return self.gpt(*args, **kwargs)


def test_bits_per_byte_pass_after_core_is_said_and_shows_progress(tmp_path, monkeypatch, capsys):
    # eval.py --task=core --dataset=...: after the tasks' lines, the split's bits per byte is said before its first
    # batch, then how far it is (20 batches of a fake second each), rather than minutes of silence
    from nanogpt_plus import progress
    clock = type('Clock', (), {'now': 0.0, 'perf_counter': lambda self: self.now})()
    monkeypatch.setattr(progress, 'time', clock)
    tok = CharTokenizer.from_text('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ,?:\n\t')
    os.makedirs(tmp_path / 'ds')
    with open(tmp_path / 'ds' / 'meta.json', 'w') as f:
        json.dump(tok.meta(), f)
    # 40 windows of block_size 24
    tokens = np.random.default_rng(0).integers(0, tok.vocab_size, 24 * 40 + 1)
    tokens.astype(np.uint16).tofile(tmp_path / 'ds' / 'val.bin')
    model = SlowGPT(tiny_gpt(tok.vocab_size, 24), clock)
    capsys.readouterr()  # GPT's own line
    result = core_eval.evaluate_bundle(model, tok.meta(), data_file=write_bundle(tmp_path / 'b'),
                                       dataset=str(tmp_path / 'ds'), batch_size=2, progress=True)
    lines = capsys.readouterr().out.splitlines()
    # the tasks' own lines, then the pass's
    assert [line.split()[0] for line in lines[:len(TASKS)]] == [t[0] for t in TASKS]
    said = f"bits per byte of {tmp_path / 'ds'}'s val split"
    assert lines[len(TASKS):] == [f"{said}: 20 batches, starting",
                                  f"{said}: 20 batches, about 20 s",
                                  f"{said}: 17/20 batches, 17 s so far, about 3 s left"]
    assert result['metrics']['val_bpb'] > 0
    # without progress (the other ranks) nothing is said
    core_eval.evaluate_bundle(model, tok.meta(), data_file=str(tmp_path / 'b'), dataset=str(tmp_path / 'ds'),
                              batch_size=2)
    assert capsys.readouterr().out == ''


def test_core_times_the_threads_once_and_retunes_over_every_task(tmp_path, monkeypatch):
    """ eval.py --task=core with num_threads=0: the first task's first batch is timed, the batches of all the
    tasks re-check the count, and the scores are the same as without it. """
    from helpers import FakeThreadTiming
    from nanogpt_plus import machine
    tok = GPT2Tokenizer()
    model = tiny_gpt(tok.vocab_size, 32)
    bundle = write_bundle(tmp_path / 'b')
    plain = core_eval.evaluate_bundle(model, tok.meta(), data_file=bundle, batch_size=2)
    fake = FakeThreadTiming({2: 0.03, 1: 0.01}, interval=4, probe=1, window=4).install(monkeypatch, machine)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        threads = machine.auto_threads('cpu', 0, 'batch', say=lambda line: None)
        timed = core_eval.evaluate_bundle(model, tok.meta(), data_file=bundle, batch_size=2, threads=threads)
        assert fake.timed == [[2, 1]] and {n for _, n in fake.seen} == {1, 2}
        assert timed['metrics']['core'] == pytest.approx(plain['metrics']['core'])
    finally:
        torch.set_num_threads(before)


def test_max_examples_keeps_the_first_of_a_fixed_shuffle(tmp_path):
    task = core_eval.read_bundle(write_bundle(tmp_path / 'b'))[2]
    whole = core_eval.task_items(task)
    assert [n for n, _ in core_eval.task_items(task, max_examples=3)] == [n for n, _ in whole][:3]
    assert sorted(n for n, _ in whole) == [1, 2, 3, 4, 5] and [n for n, _ in whole] != [1, 2, 3, 4, 5]
    with pytest.raises(UserError, match=r'2-shot but has 2 examples kept by --max_examples.*raise --max_examples'):
        core_eval.task_items(task, max_examples=2)


def test_score_card_marks_its_sources():
    metrics = {'core': 0.1234, 'val_bpb': 1.5, 'tasks': {f't{i}': {} for i in range(22)}}
    card = core_eval.score_card(metrics, 'out/ckpt.pt')
    assert card[0] == 'CORE 0.123400 (22 tasks)'
    mine = card[2]
    assert mine.split()[:3] == ['this', 'model', '0.123400'] and 'measured here: out/ckpt.pt' in mine
    assert 'not comparable' not in mine
    assert 'val_bpb' in card[3] and '1.500000' in card[3] and 'measured here' in card[3]
    published = card[4:]
    assert len(published) == 4 and all('published: nanochat' in line for line in published)
    assert any('0.256525' in line and 'LEADERBOARD' in line for line in published)
    for line, size, core in zip(published, ('124M', '355M', '774M'), ('0.1139', '0.1849', '0.2146')):
        assert f'{size} ' in line and f' {core} ' in line
    partial = core_eval.score_card(dict(metrics, tasks={'a': {}}), 'x', max_examples=10)
    assert "1 of DCLM's 22 tasks, at most 10 examples a task: not comparable" in partial[2]


# -----------------------------------------------------------------------------
# bad bundles: one line each

def rewrite(path, old, new):
    with open(path, encoding='utf-8') as f:
        text = f.read()
    assert old in text
    with open(path, 'w', encoding='utf-8') as f:
        f.write(text.replace(old, new))


BAD_BUNDLES = [
    # (what to do to a good bundle, the message)
    (lambda d: os.remove(d / 'core.yaml'), r'no core\.yaml in .*--core_dir'),
    (lambda d: (d / 'core.yaml').write_text('icl_tasks: [\n  - label: x\n'), r'core\.yaml is not valid YAML at line'),
    (lambda d: (d / 'core.yaml').write_text('tasks: []\n'), r"has no 'icl_tasks' list"),
    (lambda d: rewrite(d / 'core.yaml', 'icl_task_type: schema', 'icl_task_type: generation'),
     r"icl_tasks entry 2 \(schema_one_shot\) has icl_task_type 'generation'"),
    (lambda d: rewrite(d / 'core.yaml', 'num_fewshot: [2]', 'num_fewshot: two'), r"icl_tasks entry 1 needs a 'label'"),
    (lambda d: os.remove(d / 'eval_data' / 'sets' / 'lm_two_shot.jsonl'), r'no data file at .*lm_two_shot\.jsonl'),
    (lambda d: os.remove(d / 'eval_meta_data.csv'), r'no eval_meta_data\.csv in'),
    (lambda d: rewrite(d / 'eval_meta_data.csv', 'Random baseline', 'Baseline'), r"has no 'Random baseline' column"),
    (lambda d: rewrite(d / 'eval_meta_data.csv', 'mc_answer,', 'other,'), r'has no row for task mc_answer'),
    (lambda d: rewrite(d / 'eval_meta_data.csv', '50.0', 'n/a'), r"'Random baseline' of schema_one_shot is 'n/a'"),
]


@pytest.mark.parametrize('damage,message', BAD_BUNDLES)
def test_bad_bundle_refused_in_one_line(tmp_path, damage, message):
    bundle = write_bundle(tmp_path / 'b')
    damage(tmp_path / 'b')
    with pytest.raises(UserError, match=message) as e:
        core_eval.read_bundle(bundle)
    assert '\n' not in str(e.value)


@pytest.mark.parametrize('line,message', [
    ('{"query": "q", "choices": ["a", "b"], "gold": 2}', r"line 6: a multiple_choice example needs"),
    ('{"query": "q", "choices": ["a"], "gold": 0}', r"line 6: a multiple_choice example needs"),
    ('{"query": "q", "gold": 0}', r"line 6 has no 'choices' field"),
    ('{"query": null, "choices": ["a", "b"], "gold": 0}', r"line 6: a multiple_choice example needs"),
    ('{"query": "q", "choices": [["a"], "b"], "gold": 0}', r"line 6: a multiple_choice example needs"),
    ('{"query": "q", "choices": ["a", "b"], "gold": 0', r'line 6 is not valid JSON'),
])
def test_bad_example_names_its_line(tmp_path, line, message):
    task = core_eval.read_bundle(write_bundle(tmp_path / 'b'))[0]
    with open(task.path, 'a', encoding='utf-8') as f:
        f.write(line + '\n')
    with pytest.raises(UserError, match=message):
        core_eval.task_items(task)


def test_numbers_in_a_task_file_read_as_text(tmp_path):
    """ A number where text goes is written as it prints (as nanochat's templates render it). """
    items = [{'query': f'{k} + {k} =', 'choices': [2 * k, 2 * k + 1, 0.5], 'gold': 0} for k in range(3)]
    task = core_eval.read_bundle(write_bundle(tmp_path / 'b', [('sums', 'multiple_choice', 1, ' ', items, 25)]))[0]
    kept = dict(core_eval.task_items(task))
    assert kept[2] == {'query': '1 + 1 =', 'choices': ['2', '3', '0.5'], 'gold': 0}
    assert core_eval.prompts_of('multiple_choice', kept[2], [kept[1]], ' ')[0] == '0 + 0 = 0\n\n1 + 1 = 2'


def test_missing_core_dir_and_offline_download(tmp_path, monkeypatch):
    with pytest.raises(UserError, match=r'no eval bundle directory at .*nope.*--core_dir='):
        core_eval.bundle_dir(str(tmp_path / 'nope'))
    target = tmp_path / 'data' / 'eval_bundle'
    with pytest.raises(UserError, match=r'could not download .*offline, download and unzip it elsewhere and pass '
                                        r'--core_dir=PATH/eval_bundle'):
        core_eval.download_bundle('http://127.0.0.1:9/eval_bundle.zip', str(target))
    assert not target.exists()
    # the download path itself, from a zip shaped like nanochat's (a file:// URL: no network)
    bundle = write_bundle(tmp_path / 'src' / 'eval_bundle')
    archive = tmp_path / 'eval_bundle.zip'
    with zipfile.ZipFile(archive, 'w') as z:
        for root, _, files in os.walk(bundle):
            for name in files:
                path = os.path.join(root, name)
                z.write(path, os.path.relpath(path, tmp_path / 'src'))
    core_eval.download_bundle(archive.as_uri(), str(target))
    assert [t.label for t in core_eval.read_bundle(str(target))] == [t[0] for t in TASKS]
    assert sorted(os.listdir(target.parent)) == ['eval_bundle']  # nothing left half-unpacked
    monkeypatch.setattr(core_eval, 'default_bundle_dir', lambda: str(target))
    assert core_eval.bundle_dir('') == str(target)  # there: not downloaded again


def test_cli_core_ddp_equals_single_process(tmp_path):
    tok = CharTokenizer.from_text('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ,?:\n\t')
    model = tiny_gpt(tok.vocab_size, 24, seed=2)
    out_dir = str(tmp_path / 'out')
    save_test_checkpoint(model, tok.meta(), os.path.join(out_dir, 'ckpt.pt'), dataset=str(tmp_path / 'ds'))
    os.makedirs(tmp_path / 'ds')
    with open(tmp_path / 'ds' / 'meta.json', 'w') as f:
        json.dump(tok.meta(), f)
    np.random.default_rng(0).integers(0, tok.vocab_size, 301).astype(np.uint16).tofile(tmp_path / 'ds' / 'val.bin')
    np.zeros(20, dtype=np.uint16).tofile(tmp_path / 'ds' / 'train.bin')
    bundle = write_bundle(tmp_path / 'bundle')
    lines = {}
    for ddp in (False, True):
        out_file = str(tmp_path / f'core_{ddp}.json')
        r = run_eval([f'--out_dir={out_dir}', '--task=core', f'--core_dir={bundle}', f'--dataset={tmp_path / "ds"}',
                      '--batch_size=3', f'--output_file={out_file}'], torchrun=ddp)
        assert r.returncode == 0, r.stderr[-3000:]
        printed = r.stdout.strip().splitlines()
        line = json.loads(printed[-1])
        assert line == json.load(open(out_file))
        assert list(line) == ['task', 'metrics', 'num_examples', 'source', 'data_file'] and line['data_file'] == bundle
        # a line per task as it is done, the CORE line, the score card
        for label, *_ in TASKS:
            assert sum(p.startswith(label + ' ') and 'accuracy' in p for p in printed) == 1
        assert f"CORE {line['metrics']['core']:.6f} (4 tasks)" in printed
        assert any(p.startswith('  this model ') and 'measured here' in p for p in printed)
        lines[ddp] = line
    assert lines[False] == lines[True]
    # the val bits per byte is the loss task's
    r = run_eval([f'--out_dir={out_dir}', '--task=loss', f'--dataset={tmp_path / "ds"}', '--batch_size=3'])
    assert r.returncode == 0, r.stderr[-2000:]
    loss = json.loads(r.stdout.strip().splitlines()[-1])
    assert lines[False]['metrics']['val_bpb'] == pytest.approx(loss['metrics']['bits_per_byte'], rel=1e-9)


def test_cli_core_refusals(tmp_path):
    r = run_eval(['--init_from=gpt2', '--task=core', f'--core_dir={tmp_path / "nope"}'])
    assert r.returncode == 2 and r.stderr.count('\n') == 1 and r.stderr.startswith('error: no eval bundle directory')
    r = run_eval(['--task=core', '--data_file=x.jsonl'])
    assert r.returncode == 2 and 'reads its bundle from --core_dir' in r.stderr and 'Traceback' not in r.stderr


# -----------------------------------------------------------------------------
# bundles that must not be taken as they stand: one line, exit 2, nothing changed

def tree(directory):
    """ {path under directory: its bytes, or where its link points} of everything below directory. """
    found = {}
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = os.path.join(root, name)
            key = os.path.relpath(path, directory)
            if os.path.islink(path):
                found[key] = 'link to ' + os.readlink(path)
            elif os.path.isfile(path):
                with open(path, 'rb') as f:
                    found[key] = f.read()
    return found


def outside_file(d):
    """ A task file beside the bundle (d's parent), the same as one of its own. """
    with open(d.parent / 'x.jsonl', 'w', encoding='utf-8') as f:
        f.writelines(json.dumps(item) + '\n' for item in MC)
    return d.parent / 'x.jsonl'


def link_out(d):
    os.symlink(outside_file(d), d / 'eval_data' / 'sets' / 'linked.jsonl')
    rewrite(d / 'core.yaml', 'dataset_uri: sets/mc_two_shot.jsonl', 'dataset_uri: sets/linked.jsonl')


REFUSED_BUNDLES = [
    # a file outside the bundle, however it is reached
    (lambda d: rewrite(d / 'core.yaml', 'dataset_uri: sets/mc_two_shot.jsonl', f'dataset_uri: {outside_file(d)}'),
     r"icl_tasks entry 1 \(mc_two_shot\) has dataset_uri '/.*x\.jsonl', which leads outside the bundle"),
    (lambda d: rewrite(d / 'core.yaml', 'dataset_uri: sets/mc_two_shot.jsonl',
                       f'dataset_uri: ../../{outside_file(d).name}'),
     r"has dataset_uri '\.\./\.\./x\.jsonl', which leads outside the bundle .*put the file under its eval_data/"),
    (link_out, r"has dataset_uri 'sets/linked\.jsonl', which leads outside the bundle"),
    # a task's second row (the last would win) and a key given twice (the last would win)
    (lambda d: rewrite(d / 'eval_meta_data.csv', 'mc_answer,test,30.0,a test task\n',
                       'mc_answer,test,30.0,a test task\nmc_two_shot,test,99,again\n'),
     r"eval_meta_data\.csv has a second row for task mc_two_shot \(line 6\); keep one row per task"),
    (lambda d: rewrite(d / 'core.yaml', '  icl_task_type: schema\n',
                       '  icl_task_type: schema\n  icl_task_type: multiple_choice\n'),
     r"core\.yaml gives the key 'icl_task_type' twice in one mapping \(line 11\); keep one"),
    # what the readers can't take
    (lambda d: (d / 'eval_meta_data.csv').write_bytes(b'Eval Task,Random baseline\nmc_two_shot,25\nsch\xe9ma,50\n'),
     r"eval_meta_data\.csv is not UTF-8 text \(byte 0xe9\); save it as UTF-8"),
    (lambda d: rewrite(d / 'eval_meta_data.csv', 'a test task\n', 'a ' + 'very ' * 30000 + 'long task\n'),
     r"eval_meta_data\.csv line 2 can't be read as CSV \(field larger than field limit \(131072\)\)"),
    (lambda d: (d / 'core.yaml').write_text('icl_tasks: ' + '[' * 50000),
     r"core\.yaml is nested too deeply to read; fix it or unzip the bundle again"),
]


def run_eval_here(monkeypatch, capsys, *args):
    """ eval.py in this process on the CPU: (exit code, stdout, stderr). """
    return run('eval.py', monkeypatch, capsys, '--device=cpu', *args)


@pytest.mark.parametrize('damage,message', REFUSED_BUNDLES)
def test_bundle_refused_from_the_command_line(tmp_path, monkeypatch, capsys, damage, message):
    bundle = write_bundle(tmp_path / 'b')
    damage(tmp_path / 'b')
    before = tree(tmp_path)
    code, _, err = run_eval_here(monkeypatch, capsys, '--init_from=gpt2', '--task=core', f'--core_dir={bundle}')
    assert_one_line_error(code, err, '')
    assert re.search(message, err), err
    assert tree(tmp_path) == before


def test_a_csv_with_a_byte_order_mark_reads(tmp_path):
    bundle = write_bundle(tmp_path / 'b')
    csv_path = tmp_path / 'b' / 'eval_meta_data.csv'
    # as a spreadsheet saves "CSV UTF-8"
    csv_path.write_bytes(b'\xef\xbb\xbf' + csv_path.read_bytes())
    assert [t.baseline for t in core_eval.read_bundle(bundle)] == [t[5] for t in TASKS]


@pytest.mark.parametrize('name', ['core.yaml', 'eval_meta_data.csv'])
def test_an_unreadable_bundle_file_is_one_line(tmp_path, monkeypatch, capsys, name):
    bundle = write_bundle(tmp_path / 'b')
    before = tree(tmp_path)
    refuse_to_open(monkeypatch, os.path.join(bundle, name))
    code, _, err = run_eval_here(monkeypatch, capsys, '--init_from=gpt2', '--task=core', f'--core_dir={bundle}')
    assert_one_line_error(code, err, f"could not read {os.path.join(bundle, name)} (Permission denied); make it "
                                     f"readable by this user")
    monkeypatch.undo()
    assert tree(tmp_path) == before


@pytest.fixture
def char_run(tmp_path):
    """ The out_dir of a tiny character model that can read TASKS' texts. """
    tok = CharTokenizer.from_text('abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ ,?:\n\t')
    out_dir = tmp_path / 'out'
    save_test_checkpoint(tiny_gpt(tok.vocab_size, 24, seed=2), tok.meta(), str(out_dir / 'ckpt.pt'))
    return out_dir


@pytest.mark.parametrize('line,message', [
    ('[' * 200000, r"mc_two_shot\.jsonl line 6 is nested too deeply to read as JSON; fix or remove that line"),
    (None, r"could not read .*mc_two_shot\.jsonl \(Permission denied\); make it readable by this user"),
])
def test_a_task_file_that_cant_be_read_is_one_line(tmp_path, monkeypatch, capsys, char_run, line, message):
    bundle = write_bundle(tmp_path / 'b')
    task_file = tmp_path / 'b' / 'eval_data' / 'sets' / 'mc_two_shot.jsonl'
    if line is not None:
        with open(task_file, 'a', encoding='utf-8') as f:
            f.write(line + '\n')
    before = tree(tmp_path)
    if line is None:
        refuse_to_open(monkeypatch, task_file)
    code, _, err = run_eval_here(monkeypatch, capsys, f'--out_dir={char_run}', '--task=core', f'--core_dir={bundle}')
    assert_one_line_error(code, err, '')
    assert re.search(message, err), err
    monkeypatch.undo()
    assert tree(tmp_path) == before


def test_a_label_is_printed_with_its_control_characters_escaped(tmp_path, monkeypatch, capsys, char_run):
    # a label that would clear the screen and colour what follows, and a newline that would forge a line
    label = 'mc\x1b[2J\x1b[31m\nCORE 1.000000'
    bundle = write_bundle(tmp_path / 'b', [('mc_x', 'multiple_choice', 0, ' ', MC, 25.0), TASKS[2]])
    # YAML reads JSON's escapes
    rewrite(tmp_path / 'b' / 'core.yaml', 'label: mc_x', f'label: {json.dumps(label)}')
    rewrite(tmp_path / 'b' / 'eval_meta_data.csv', 'mc_x,', f'"{label}",')
    assert core_eval.read_bundle(bundle)[0].label == label
    code, out, err = run_eval_here(monkeypatch, capsys, f'--out_dir={char_run}', '--task=core', f'--core_dir={bundle}')
    assert code == 0, err
    # no escape reaches the terminal, and no line is forged
    assert '\x1b' not in out + err and sum(p.startswith('CORE ') for p in out.splitlines()) == 1
    shown = r'mc\x1b[2J\x1b[31m\nCORE 1.000000'
    assert sum(p.startswith(shown + ' ') and 'accuracy' in p for p in out.splitlines()) == 1
    # JSON escapes it itself
    assert label in json.loads(out.strip().splitlines()[-1])['metrics']['tasks']
    # and in a refusal
    rewrite(tmp_path / 'b' / 'eval_meta_data.csv', '"mc', '"other')
    code, _, err = run_eval_here(monkeypatch, capsys, '--init_from=gpt2', '--task=core', f'--core_dir={bundle}')
    assert_one_line_error(code, err, f"has no row for task {shown}; add its 'Random baseline'")


# -----------------------------------------------------------------------------
# choices the model can't tell apart: no answer, never right

def test_choices_it_cant_tell_apart_count_as_wrong(tmp_path):
    tok = GPT2Tokenizer()
    model = tiny_gpt(tok.vocab_size, 64)
    mc = [{'query': 'Same?', 'choices': ['the cat', 'the cat', 'the cat'], 'gold': 0},  # all alike
          {'query': 'Empty?', 'choices': ['', '', ''], 'gold': 0},  # no tokens of their own
          {'query': 'Either?', 'choices': ['yes', 'no'], 'gold': 0}]
    schema = [{'context_options': ['He said', 'He said'], 'continuation': 'hello', 'gold': 0},
              {'context_options': ['She said', 'She said', 'She said'], 'continuation': 'bye', 'gold': 2},
              {'context_options': ['A said', 'B said'], 'continuation': 'so', 'gold': 0}]
    bundle = write_bundle(tmp_path / 'b', [('mc', 'multiple_choice', 0, ' ', mc, 25.0),
                                           ('schema', 'schema', 0, ' ', schema, 50.0)])
    for task in core_eval.read_bundle(bundle):
        records = core_eval.task_items(task)
        rows, offsets = core_eval.task_rows(task, records, tok, 64)
        table = score_examples(model, rows, offsets, batch_size=4, device='cpu')
        golds = [item['gold'] for _, item in records]
        correct = dict(zip([item[task.task_type == 'schema' and 'context_options' or 'choices'][0]
                            for _, item in records], core_eval.correct_examples(task.task_type, table, offsets,
                                                                               golds, rows)))
        # the alike ones are wrong whatever gold is; the one with a real choice is the model's lowest mean loss
        alike = [k for k, v in correct.items() if k in ('the cat', '', 'He said', 'She said')]
        assert [correct[k] for k in alike] == [0.0, 0.0] and len(alike) == 2
    # by hand: the lowest mean loss is a choice another choice repeats -> wrong, even with gold among them
    rows = [([1, 2], 1), ([1, 2], 1), ([1, 3], 1)]
    table = torch.tensor([[0.1, 1, 0], [0.1, 1, 0], [0.5, 1, 0]], dtype=torch.float64)
    assert core_eval.correct_examples('multiple_choice', table, [0, 3], [0], rows) == [0.0]
    table[2, 0] = 0.05  # now the distinct one is lowest: right when it is gold
    assert core_eval.correct_examples('multiple_choice', table, [0, 3], [2], rows) == [1.0]
    # a choice with no tokens of its own is never the answer, even alone at the lowest
    rows = [([1, 2], 0), ([1, 3], 1)]
    table = torch.tensor([[0.0, 0, 0], [2.0, 1, 0]], dtype=torch.float64)
    assert core_eval.correct_examples('multiple_choice', table, [0, 2], [1], rows) == [1.0]


# -----------------------------------------------------------------------------
# the download: what it unpacks into, and what it can't

def bundle_zip(tmp_path, extra=None):
    """ A zip shaped like nanochat's eval_bundle.zip (extra(zipfile) may add entries); its path. """
    bundle = write_bundle(tmp_path / 'src' / 'eval_bundle')
    archive = tmp_path / 'eval_bundle.zip'
    with zipfile.ZipFile(archive, 'w', zipfile.ZIP_DEFLATED) as z:
        for root, _, files in os.walk(bundle):
            for name in files:
                path = os.path.join(root, name)
                z.write(path, os.path.relpath(path, tmp_path / 'src'))
        if extra:
            extra(z)
    return archive


def add_link(z):
    info = zipfile.ZipInfo('eval_bundle/eval_data/sets/passwd.jsonl')
    info.external_attr = (stat.S_IFLNK | 0o777) << 16  # how zip -y stores a symbolic link
    z.writestr(info, '/etc/passwd')


def test_a_zip_with_a_symbolic_link_is_refused(tmp_path, monkeypatch, capsys):
    archive = bundle_zip(tmp_path, add_link)
    target = tmp_path / 'data' / 'core' / 'eval_bundle'
    monkeypatch.setattr(core_eval, 'default_bundle_dir', lambda: str(target))
    monkeypatch.setattr(core_eval, 'BUNDLE_URL', archive.as_uri())
    code, _, err = run_eval_here(monkeypatch, capsys, '--init_from=gpt2', '--task=core')
    assert_one_line_error(code, err, 'eval_bundle.zip holds a symbolic link (eval_bundle/eval_data/sets/passwd.jsonl)')
    assert os.listdir(target.parent) == []  # nothing unpacked, nothing left half-made


@pytest.mark.parametrize('which', ['core', 'eval_bundle'])
def test_a_file_where_the_bundle_goes_is_kept(tmp_path, monkeypatch, capsys, which):
    archive = bundle_zip(tmp_path)
    target = tmp_path / 'data' / 'core' / 'eval_bundle'
    in_the_way = target if which == 'eval_bundle' else target.parent
    in_the_way.parent.mkdir(parents=True, exist_ok=True)
    in_the_way.write_text('my notes')
    monkeypatch.setattr(core_eval, 'default_bundle_dir', lambda: str(target))
    monkeypatch.setattr(core_eval, 'BUNDLE_URL', archive.as_uri())  # a download would succeed
    before = tree(tmp_path / 'data')
    code, out, err = run_eval_here(monkeypatch, capsys, '--init_from=gpt2', '--task=core')
    assert_one_line_error(code, err, f'{in_the_way} is a file, not the directory the eval bundle is kept in; move '
                                     f'it away, or pass --core_dir=DIR')
    assert 'downloading' not in out and tree(tmp_path / 'data') == before


def test_a_file_size_limit_while_unpacking_is_one_line(tmp_path):
    archive = bundle_zip(tmp_path, lambda z: z.writestr('eval_bundle/eval_data/sets/big.jsonl', 'x' * 300_000))
    target = tmp_path / 'data' / 'core' / 'eval_bundle'
    script = ("from nanogpt_plus.evaluation import core; from nanogpt_plus.runtime import run_main; "
              f"run_main(lambda: core.download_bundle({archive.as_uri()!r}, {str(target)!r}))")
    r = run_with_file_size_limit(['-c', script], 100_000)
    assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-2000:]
    assert r.stderr.count('\n') == 1 and r.stderr.startswith(
        f'error: could not unpack {archive.as_uri()} into {target.parent} (File too large); nothing was kept'), r.stderr
    assert os.listdir(target.parent) == []


# bounded work: a trickling download, a zip bomb, YAML aliases

def test_a_trickling_download_is_given_up_on_at_its_overall_deadline(tmp_path, monkeypatch):
    """ Each read had a timeout, the whole download none: a server sending a byte now and then kept
    --task=core downloading past 100 s. """
    import http.server
    import threading
    import time

    from nanogpt_plus import evaluation

    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header('Content-Length', str(10**6))
            self.end_headers()
            try:
                for _ in range(400):  # a byte every 20 ms: no read ever times out
                    self.wfile.write(b'x')
                    self.wfile.flush()
                    time.sleep(0.02)
            except OSError:  # the client gave up
                pass

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer(('127.0.0.1', 0), Trickle)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(evaluation, 'DOWNLOAD_DEADLINE_S', 0.5)
    target = tmp_path / 'data' / 'eval_bundle'
    try:
        with pytest.raises(UserError) as e:
            core_eval.download_bundle(f'http://127.0.0.1:{server.server_address[1]}/eval_bundle.zip', str(target))
    finally:
        server.shutdown()
    assert str(e.value).startswith(f'could not download http://127.0.0.1:{server.server_address[1]}/eval_bundle.zip '
                                   f'(TimeoutError: the download took more than 0.5 s in all (a server sending too '
                                   f'slowly)); offline, download and unzip it elsewhere')
    assert not target.exists() and '\n' not in str(e.value)


def test_a_bundle_that_would_unpack_past_the_limit_is_refused_unpacked(tmp_path, monkeypatch):
    """ A 1 MB zip of 1 GiB of zeros was unpacked: its own sizes are added up first. """
    archive = tmp_path / 'bomb.zip'
    with zipfile.ZipFile(archive, 'w', compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr('eval_bundle/core.yaml', b'\0' * 5 * 2**20)  # 5 MiB of zeros: ~5 KB zipped
    monkeypatch.setattr(core_eval, 'MAX_BUNDLE_BYTES', 2**20)
    target = tmp_path / 'data' / 'eval_bundle'
    with pytest.raises(UserError) as e:
        core_eval.download_bundle(archive.as_uri(), str(target))
    assert str(e.value).startswith(f"{archive.as_uri()} would unpack to 0.0 GiB, more than an eval bundle's limit "
                                   f"of 0.000976562 GiB; nothing was unpacked: pass --core_dir=DIR")
    assert os.listdir(tmp_path / 'data') == []


def test_yaml_aliases_are_refused_before_they_expand(tmp_path):
    """ 440 bytes of anchors and aliases (nine levels of nine) made a 2.1 GB one-line error. """
    bundle = write_bundle(tmp_path / 'b')
    levels = ['a0: &a0 ["lol"]'] + [f'a{i}: &a{i} [' + ', '.join([f'*a{i - 1}'] * 9) + ']' for i in range(1, 10)]
    path = os.path.join(bundle, 'core.yaml')
    with open(path, 'w', encoding='utf-8') as f:
        f.write('\n'.join(levels) + '\nicl_tasks: *a9\n')
    before = os.path.getsize(path)
    with pytest.raises(UserError) as e:
        core_eval.read_bundle(bundle)
    assert str(e.value) == (f"{path} uses a YAML alias (*a0, line 2); a core.yaml has no need of anchors and "
                            f"aliases, and a few of them can expand to gigabytes: write the values out, or unzip "
                            f"the bundle again")
    assert os.path.getsize(path) == before
