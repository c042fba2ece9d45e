"""
Tests for finetune.py and nanogpt_plus/finetuning.py (GPT-1-style supervised fine-tuning): each task
format learns a small synthetic task from a tiny checkpoint made here, GPT-1's input transformations, the
auxiliary LM loss over real tokens only, symmetric similarity, 2..5 choices, reload + predict, resume,
DDP == 1 process, the fine-tuning config files, and bad input.

Usage:
    python -m pytest tests/test_finetune.py -q
"""
import json
import math
import os
import random
import runpy
import sys
import types

import pytest
import torch

import finetune
import helpers
from configurator import ConfigError, Settings, parse_config
from helpers import REPO, TORCHRUN, run_python, save_test_checkpoint
from model import GPT, GPTConfig
from nanogpt_plus import finetuning
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.distributed import DistInfo
from nanogpt_plus.errors import UserError
from nanogpt_plus.init_from import init_model
from nanogpt_plus.signals import GracefulExit
from nanogpt_plus.tokenizer import CharTokenizer, load_tokenizer

ALPHABET = "abcdefghijklmnopqrstuvwxyz ."
LETTERS = "abcdef"
SINGLE = DistInfo(False, 0, 0, 1, 'cpu')


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


# -----------------------------------------------------------------------------
# helpers: a tiny "pretrained" char checkpoint on disk, synthetic JSONL tasks

def make_source(path, n_embd=32, block_size=64, seed=0):
    """ A tiny random-init char GPT saved as a train.py-style checkpoint (the fine-tune's source). """
    tok = CharTokenizer.from_text(ALPHABET)
    torch.manual_seed(seed)
    m = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=n_embd, block_size=block_size, vocab_size=tok.vocab_size,
                      bias=False))
    save_test_checkpoint(m, tok.meta(), os.path.join(path, 'ckpt.pt'))
    return str(path)


def _word(r):
    return ''.join(r.choice('abcdefghijklmnop') for _ in range(r.randint(2, 4)))


def gen_classification(r):
    # which of two marker words the text contains
    words = [_word(r) for _ in range(r.randint(2, 5))]
    label = r.randint(0, 1)
    words.insert(r.randint(0, len(words)), ['xyz', 'wvu'][label])
    return {'text': ' '.join(words), 'label': ['pos', 'neg'][label]}


def gen_entailment(r):
    # whether the hypothesis repeats a word of the premise
    a, b = r.sample('abcd', 2)
    label = r.randint(0, 1)
    hyp = r.choice([a, b]) if label else r.choice([c for c in 'abcd' if c not in (a, b)])
    return {'premise': f"{a * 3} {b * 3}", 'hypothesis': hyp * 3, 'label': ['neutral', 'entailment'][label]}


def gen_similarity(r):
    # whether the two texts share their first word
    label = r.randint(0, 1)
    a = r.choice('xz')
    b = a if label else ('z' if a == 'x' else 'x')
    rest1 = ' '.join(r.sample(LETTERS, 2))
    rest2 = ' '.join(r.sample(LETTERS, 2))
    return {'text1': f"{a * 3} {rest1}", 'text2': f"{b * 3} {rest2}", 'label': label}


def gen_multiple_choice(r):
    # which choice continues the context's pattern (2 to 5 choices)
    n = r.randint(2, 5)
    choices = r.sample(LETTERS, n)
    label = r.randrange(n)
    return {'context': ' '.join([choices[label]] * 4), 'choices': choices, 'label': label}


GENERATORS = {'classification': gen_classification, 'entailment': gen_entailment, 'similarity': gen_similarity,
              'multiple_choice': gen_multiple_choice}


def write_jsonl(path, records):
    with open(path, 'w', encoding='utf-8') as f:
        for rec in records:
            f.write(json.dumps(rec) + '\n')
    return str(path)


def make_task(tmp_path, task, n_train=512, n_val=100, seed=0):
    r = random.Random(seed)
    train = write_jsonl(tmp_path / f'{task}_train.jsonl', [GENERATORS[task](r) for _ in range(n_train)])
    val = write_jsonl(tmp_path / f'{task}_val.jsonl', [GENERATORS[task](r) for _ in range(n_val)])
    return train, val


def config(**overrides):
    cfg = dict(finetune.DEFAULTS, device='cpu', dropout=0.0, batch_size=16, learning_rate=3e-3, warmup_frac=0.1,
               log_interval=1000)
    cfg.update(overrides)
    return Settings(cfg)


def run_script(args, env_extra=None, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS='1', **(env_extra or {}))
    return run_python(['finetune.py'] + args, timeout=timeout, env=env)


def last_json(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


SPECIAL = {'start': 100, 'delim': 101, 'extract': 102}


def val_accuracy(ckpt, path, task):
    """ The accuracy on path of the model saved in a fine-tune's checkpoint, recomputed from the file. """
    model = finetuning.model_from_finetune_checkpoint(ckpt)
    examples = finetuning.read_jsonl(path, task)
    encoded = finetuning.encode_examples(examples, task, load_tokenizer(ckpt['tokenizer']), ckpt['special_tokens'],
                                         model.gpt.config.block_size, path)
    labels = finetuning.label_ids(examples, task, ckpt['label_map'], path)
    correct, seen, _, _ = finetuning.evaluate(model, encoded, labels, ckpt['special_tokens'], 8, 'cpu',
                                              torch.autocast('cpu', enabled=False))
    assert seen == len(examples)
    return correct / seen


# -----------------------------------------------------------------------------
# each task format learns its synthetic task

# Budgets with a margin: a training outcome must not hang on float rounding (another CPU's kernels, another
# thread count). The relation tasks (is a letter repeated, are two words equal) are learnt in a jump whose
# timing varies with the seed, hence their extra epochs; at lr 3e-3 similarity sometimes never jumps (stays
# at chance), so those two use 1e-3. Over training seeds 1-8 and 1337, each with ATEN_CPU_CAPABILITY=avx2
# and =default (and 1 or 2 threads for 1337), every run ended at 1.0 but one entailment run at 0.96 (one
# premise/hypothesis pair learnt wrongly). A head that reads the Start position instead of the Extract token
# stays at chance (0.5; 0.25 for multiple choice), far below 0.9. Each run is a few seconds.
FIT_BUDGETS = [('classification', 256, 2, 3e-3), ('entailment', 1024, 8, 1e-3), ('similarity', 1024, 3, 1e-3),
               ('multiple_choice', 1024, 3, 3e-3)]


@pytest.mark.parametrize('task,n_train,epochs,lr', FIT_BUDGETS)
def test_task_reaches_90_percent(tmp_path, task, n_train, epochs, lr):
    src = make_source(tmp_path / 'src', n_embd=64)
    train, val = make_task(tmp_path, task, n_train=n_train)
    res = finetune.finetune(config(task=task, init_from=src, out_dir=str(tmp_path / 'out'), train_file=train,
                                   val_file=val, epochs=epochs, learning_rate=lr), SINGLE)
    assert res['task'] == task
    assert res['val_acc'] >= 0.9, res
    assert res['steps'] == epochs * math.ceil(n_train / 16) and res['epochs'] == epochs
    ckpt = load_checkpoint(str(tmp_path / 'out' / 'ckpt.pt'))  # weights_only
    assert ckpt['task'] == task and ckpt['val_acc'] == res['val_acc']
    assert ckpt['epoch'] == res['best_epoch'] and ckpt['history'][-1]['val_acc'] == res['val_acc']
    assert ckpt['model_args']['vocab_size'] == len(ALPHABET) + 3
    assert ckpt['special_tokens'] == {'start': len(ALPHABET), 'delim': len(ALPHABET) + 1,
                                      'extract': len(ALPHABET) + 2}
    # the source checkpoint is untouched
    assert load_checkpoint(os.path.join(src, 'ckpt.pt'))['model_args']['vocab_size'] == len(ALPHABET)


# -----------------------------------------------------------------------------
# input transformations, batching and the losses

def test_input_transformations():
    enc = lambda s: [ord(c) - ord('a') for c in s]  # noqa: E731
    S = 100
    D = 101
    E = 102
    assert finetuning.encode_example(['ab'], 'classification', enc, SPECIAL, 16) == [[S, 0, 1, E]]
    assert finetuning.encode_example(['ab', 'c'], 'entailment', enc, SPECIAL, 16) == [[S, 0, 1, D, 2, E]]
    assert finetuning.encode_example(['ab', 'c'], 'similarity', enc, SPECIAL, 16) == \
        [[S, 0, 1, D, 2, E], [S, 2, D, 0, 1, E]]
    assert finetuning.encode_example(['ab', 'c', 'd'], 'multiple_choice', enc, SPECIAL, 16) == \
        [[S, 0, 1, D, 2, E], [S, 0, 1, D, 3, E]]


def test_truncation_keeps_special_tokens_and_trims_the_longer_text():
    enc = lambda s: [ord(c) - ord('a') for c in s]  # noqa: E731
    (seq,) = finetuning.encode_example(['abcdefghij', 'xyz'], 'entailment', enc, SPECIAL, 10)
    assert len(seq) == 10
    assert seq[0] == 100 and seq[-1] == 102 and seq.count(101) == 1
    assert seq[1:seq.index(101)] == enc('abcd')  # the long premise lost its end...
    assert seq[seq.index(101) + 1:-1] == enc('xyz')  # ...the short hypothesis kept everything
    a, b = finetuning.truncate_pair(list(range(8)), list(range(8)), 6)
    assert (len(a), len(b)) == (3, 3)
    # a multiple-choice context keeps its end (what the choices continue)
    (seq, _) = finetuning.encode_example(['abcdefghij', 'x', 'y'], 'multiple_choice', enc, SPECIAL, 8)
    assert seq == [100] + enc('ghij') + [101, enc('x')[0], 102]
    (seq,) = finetuning.encode_example(['abcdefghij'], 'classification', enc, SPECIAL, 5)
    assert seq == [100] + enc('abc') + [102]


def test_special_tokens_grow_the_tied_embedding():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=10))
    old = gpt.transformer.wte.weight.detach().clone()
    special = finetuning.add_special_tokens(gpt, None)
    assert special == {'start': 10, 'delim': 11, 'extract': 12}
    w = gpt.transformer.wte.weight
    assert w.shape == (13, 16) and w is gpt.lm_head.weight
    assert torch.equal(w[:10].detach(), old)
    assert 0.0 < w[10:].detach().std() < 0.1  # N(0, 0.02) like the other rows


def test_lm_loss_counts_only_real_tokens():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=10))
    special = finetuning.add_special_tokens(gpt, None)
    model = finetuning.FinetuneModel(gpt, finetuning.TaskHead(16, 2), 'classification').eval()
    seqs = [[[special['start'], 1, 2, 3, special['extract']]], [[special['start'], 4, special['extract']]]]
    batch = finetuning.make_batch(seqs, [0, 1], special, 'cpu')
    # targets: the next text token; never padding, never a special token
    assert batch['lm_targets'].tolist() == [[1, 2, 3, -1, -1], [4, -1, -1, -1, -1]]
    assert batch['extract_pos'].tolist() == [4, 2]
    logits, lm_sum = model(batch['idx'], batch['extract_pos'], batch['choice_mask'], batch['lm_targets'])
    # the same sum computed row by row on the unpadded sequences
    expected = 0.0
    with torch.no_grad():
        for row in seqs:
            x = torch.tensor([row[0]])
            lm_logits = gpt.lm_head(gpt.hidden_states(x))[0]
            for t in range(len(row[0]) - 1):
                if row[0][t + 1] < special['start']:
                    expected += float(torch.nn.functional.cross_entropy(lm_logits[t:t + 1], x[0, t + 1:t + 2]))
    assert lm_sum.item() == pytest.approx(expected, rel=1e-5)
    # whatever sits in the padding changes neither the task logits nor the LM loss
    idx2 = batch['idx'].clone()
    idx2[1, 3:] = 7
    logits2, lm_sum2 = model(idx2, batch['extract_pos'], batch['choice_mask'], batch['lm_targets'])
    torch.testing.assert_close(logits2, logits)
    torch.testing.assert_close(lm_sum2, lm_sum)


def test_head_reads_the_extract_token():
    """ The task logits are the head applied to each row's Extract hidden state, whatever the padding. """
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=10))
    special = finetuning.add_special_tokens(gpt, None)
    head = finetuning.TaskHead(16, 3)
    model = finetuning.FinetuneModel(gpt, head, 'classification').eval()
    seqs = [[[special['start'], 1, 2, 3, special['extract']]], [[special['start'], 4, special['extract']]]]
    batch = finetuning.make_batch(seqs, [0, 1], special, 'cpu')
    logits, _ = model(batch['idx'], batch['extract_pos'], batch['choice_mask'])
    with torch.no_grad():  # each sequence alone, unpadded: its Extract token is its last
        expected = torch.cat([head(gpt.hidden_states(torch.tensor(row))[:, -1]) for row in seqs])
    torch.testing.assert_close(logits, expected)


def test_similarity_is_symmetric():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, block_size=32, vocab_size=10))
    special = finetuning.add_special_tokens(gpt, None)
    model = finetuning.FinetuneModel(gpt, finetuning.TaskHead(16, 2), 'similarity').eval()
    enc = lambda s: [int(c) for c in s]  # noqa: E731
    ab = finetuning.encode_example(['1234', '56'], 'similarity', enc, special, 32)
    ba = finetuning.encode_example(['56', '1234'], 'similarity', enc, special, 32)
    b1 = finetuning.make_batch([ab], None, special, 'cpu')
    b2 = finetuning.make_batch([ba], None, special, 'cpu')
    l1, _ = model(b1['idx'], b1['extract_pos'], b1['choice_mask'])
    l2, _ = model(b2['idx'], b2['extract_pos'], b2['choice_mask'])
    torch.testing.assert_close(l1, l2)
    # ...while one order alone is not symmetric: the sum is what makes it so
    h1 = gpt.hidden_states(b1['idx'][:1])[0, -1]
    h2 = gpt.hidden_states(b2['idx'][:1])[0, -1]
    assert not torch.allclose(h1, h2)


def test_multiple_choice_with_2_to_5_choices():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=10))
    special = finetuning.add_special_tokens(gpt, None)
    model = finetuning.FinetuneModel(gpt, finetuning.TaskHead(16, 1, bias=False), 'multiple_choice').eval()
    enc = lambda s: [int(c) for c in s]  # noqa: E731
    examples = [finetuning.encode_example(['123'] + [str(i) for i in range(n)], 'multiple_choice', enc, special, 32)
                for n in (2, 3, 4, 5)]
    batch = finetuning.make_batch(examples, [0, 1, 2, 3], special, 'cpu')
    logits, _ = model(batch['idx'], batch['extract_pos'], batch['choice_mask'])
    assert logits.shape == (4, 5)
    assert torch.isinf(logits).tolist() == [[n >= k for n in range(5)] for k in (2, 3, 4, 5)]
    probs = torch.softmax(logits, -1)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4))
    # a choice's score doesn't depend on the other examples or choices in the batch
    alone = finetuning.make_batch([examples[3][:2]], [0], special, 'cpu')
    l_alone, _ = model(alone['idx'], alone['extract_pos'], alone['choice_mask'])
    torch.testing.assert_close(l_alone[0], logits[3, :2])
    # the loss is the cross-entropy over each example's real choices only (the -inf slots add nothing)
    loss = torch.nn.functional.cross_entropy(logits, batch['labels'])
    expected = sum(torch.nn.functional.cross_entropy(logits[i:i + 1, :n], batch['labels'][i:i + 1])
                   for i, n in enumerate((2, 3, 4, 5))) / 4
    assert torch.isfinite(loss)
    torch.testing.assert_close(loss, expected)


# -----------------------------------------------------------------------------
# checkpoint: reload, predict, resume

def test_checkpoint_reloads_and_predicts_the_same(tmp_path, monkeypatch):
    src = make_source(tmp_path / 'src')
    train, val = make_task(tmp_path, 'classification', n_train=128, n_val=40)
    out = tmp_path / 'out'
    res = finetune.finetune(config(task='classification', init_from=src, out_dir=str(out), train_file=train,
                                   val_file=val, epochs=1, predict_file=val), SINGLE)
    ckpt = load_checkpoint(str(out / 'ckpt.pt'))
    assert ckpt['label_map'] == {'neg': 0, 'pos': 1}
    assert ckpt['tokenizer']['kind'] == 'char'
    model = finetuning.model_from_finetune_checkpoint(ckpt)
    tok = CharTokenizer(ckpt['tokenizer']['stoi'])
    examples = finetuning.read_jsonl(val, 'classification')
    encoded = finetuning.encode_examples(examples, 'classification', tok, ckpt['special_tokens'], 64, val)
    labels = finetuning.label_ids(examples, 'classification', ckpt['label_map'], val)
    correct, seen, _, preds = finetuning.evaluate(model, encoded, labels, ckpt['special_tokens'], 8, 'cpu',
                                                torch.autocast('cpu', enabled=False))
    assert correct / seen == pytest.approx(res['val_acc'])
    # the predictions written after training (by the reloaded best model) agree with these
    written = [json.loads(line) for line in open(out / 'predictions.jsonl')]
    id_to_label = {i: k for k, i in ckpt['label_map'].items()}
    assert [w['prediction'] for w in written] == [id_to_label[p] for _, p, _ in preds]
    # the file is still a plain GPT checkpoint for the other scripts (grown vocabulary, tied head)
    gpt, tokenizer_meta, _ = init_model(str(out))
    assert gpt.config.vocab_size == len(ALPHABET) + 3 and tokenizer_meta['kind'] == 'char'

    # predict-only mode from the command line gives the same predictions
    unlabeled = write_jsonl(tmp_path / 'unlabeled.jsonl', [{'text': json.loads(line)['text']} for line in open(val)])
    p = run_script([f'--init_from={out}', f'--predict_file={unlabeled}', f'--predict_out={tmp_path / "p.jsonl"}',
                    '--device=cpu'])
    assert p.returncode == 0, p.stderr
    assert [json.loads(line)['prediction'] for line in open(tmp_path / 'p.jsonl')] == [w['prediction'] for w in written]
    # with int8 weights (in-process): the same model's predictions, its probabilities within rounding
    monkeypatch.setattr(sys, 'argv', ['finetune.py', f'--init_from={out}', f'--predict_file={unlabeled}',
                                      f'--predict_out={tmp_path / "p8.jsonl"}', '--device=cpu', '--weights=int8'])
    finetune.main()
    int8 = [json.loads(line) for line in open(tmp_path / 'p8.jsonl')]
    assert max(abs(a - b) for w, q in zip(written, int8) for a, b in zip(w['probs'], q['probs'])) < 0.05
    assert int8 != written  # the matrices really were int8 (the probabilities moved)


def test_resume_continues_exactly(tmp_path):
    src = make_source(tmp_path / 'src')
    train, val = make_task(tmp_path, 'classification', n_train=64, n_val=20)
    common = dict(task='classification', init_from=src, train_file=train, val_file=val, decay_lr=False,
                  dropout=0.1, batch_size=8)
    full = finetune.finetune(config(out_dir=str(tmp_path / 'a'), epochs=2, **common), SINGLE)
    finetune.finetune(config(out_dir=str(tmp_path / 'b'), epochs=1, **common), SINGLE)
    res = finetune.finetune(config(out_dir=str(tmp_path / 'b'), epochs=2, **dict(common, init_from='resume')),
                            SINGLE)
    assert res['epochs'] == 2 and res['steps'] == 16
    assert res == dict(full, out_dir=str(tmp_path / 'b'))
    assert_same_training_state(tmp_path / 'a', tmp_path / 'b')


def test_resume_keeps_the_models_architecture(tmp_path, monkeypatch, capsys):
    """ train.py's rules on --init_from=resume: nothing cropped, a different architecture setting refused. """
    src = make_source(tmp_path / 'src', block_size=64)
    train, val = make_task(tmp_path, 'classification', n_train=32, n_val=8)
    out = tmp_path / 'ft'
    common = [f'--init_from={src}', f'--out_dir={out}', f'--train_file={train}', f'--val_file={val}',
              '--task=classification', '--device=cpu', '--batch_size=8']
    helpers.run_script(finetune, monkeypatch, *common, '--epochs=1')
    last = (out / 'ckpt_last.pt').read_bytes()
    resume = [a for a in common if not a.startswith('--init_from')] + ['--init_from=resume', '--epochs=2']
    for bad, message in (('--block_size=32', r"--block_size=32 but the checkpoint .*ckpt_last.pt has block_size=64"),
                         ('--n_layer=3', r"--n_layer=3 but the checkpoint .*ckpt_last.pt has n_layer=2")):
        with pytest.raises(UserError, match=message):
            helpers.run_script(finetune, monkeypatch, *resume, bad)
        assert (out / 'ckpt_last.pt').read_bytes() == last  # nothing written
    helpers.run_script(finetune, monkeypatch, *resume, '--block_size=64')  # the model's own: fine
    assert load_checkpoint(str(out / 'ckpt_last.pt'))['model_args']['block_size'] == 64


def test_a_failed_save_is_one_line_on_every_rank(tmp_path, monkeypatch):
    """ finetune.py writes through train.py's Checkpointer: an OSError names the file and what to do. """
    src = make_source(tmp_path / 'src')
    train, val = make_task(tmp_path, 'classification', n_train=16, n_val=4)
    out = tmp_path / 'ft'
    (out / 'ckpt_last.pt').mkdir(parents=True)  # a directory where the file goes: the rename fails
    with pytest.raises(UserError, match=rf"could not write the checkpoint {out / 'ckpt_last.pt'} \(.*\); make room"):
        finetune.finetune(config(task='classification', init_from=src, out_dir=str(out), train_file=train,
                                 val_file=val, epochs=1, batch_size=8), SINGLE)
    # the weights are voted finite on every rank before anything is written
    monkeypatch.setattr('nanogpt_plus.checkpoint.tensors_finite', lambda tensors: False)
    with pytest.raises(UserError, match="weights are not finite at iter 2; not saving"):
        finetune.finetune(config(task='classification', init_from=src, out_dir=str(tmp_path / 'ft2'),
                                 train_file=train, val_file=val, epochs=1, batch_size=8), SINGLE)


def test_interrupted_fine_tune_resumes_exactly(tmp_path, monkeypatch, capsys):
    """ A signal mid-epoch saves the state of that step; resuming ends exactly where an uninterrupted run does. """
    src = make_source(tmp_path / 'src')
    train, val = make_task(tmp_path, 'classification', n_train=64, n_val=20)
    common = dict(task='classification', init_from=src, train_file=train, val_file=val, dropout=0.1, batch_size=8,
                  epochs=2)
    full = finetune.finetune(config(out_dir=str(tmp_path / 'a'), **common), SINGLE)
    asked = []

    # as if Ctrl-C came during step 11 (epoch 1, step 3)
    def stop_at_step_11(self, dist_info, sync_point=True):
        asked.append(1)
        return len(asked) == 11

    monkeypatch.setattr(GracefulExit, 'should_stop', stop_at_step_11)
    part = finetune.finetune(config(out_dir=str(tmp_path / 'b'), **common), SINGLE)
    assert (part['interrupted'], part['steps'], part['epochs'], part['best_epoch']) == (True, 11, 1, 0)
    assert f"stopped cleanly; continue with --init_from=resume --out_dir={tmp_path / 'b'}" in capsys.readouterr().out
    saved = load_checkpoint(str(tmp_path / 'b' / finetune.LAST_CKPT))
    assert (saved['epoch'], saved['step_in_epoch'], saved['iter_num']) == (1, 3, 11)
    monkeypatch.undo()
    res = finetune.finetune(config(out_dir=str(tmp_path / 'b'), **dict(common, init_from='resume', task='')),
                            SINGLE)
    assert res == dict(full, out_dir=str(tmp_path / 'b'))
    assert_same_training_state(tmp_path / 'a', tmp_path / 'b')


def assert_same_training_state(dir_a, dir_b):
    """ The ckpt_last.pt of two fine-tunes hold bit-identical weights, head, optimizer state and history. """
    a = load_checkpoint(str(dir_a / finetune.LAST_CKPT))
    b = load_checkpoint(str(dir_b / finetune.LAST_CKPT))
    for k in a['model']:
        torch.testing.assert_close(a['model'][k], b['model'][k], rtol=0, atol=0)
    torch.testing.assert_close(a['head'], b['head'], rtol=0, atol=0)
    torch.testing.assert_close(a['optimizer']['state'], b['optimizer']['state'], rtol=0, atol=0)
    assert a['history'] == b['history']
    assert (a['epoch'], a['step_in_epoch'], a['iter_num']) == (b['epoch'], b['step_in_epoch'], b['iter_num'])


def test_init_from_out_dir_is_refused(tmp_path):
    src = make_source(tmp_path / 'src')
    train, val = make_task(tmp_path, 'classification', n_train=8, n_val=4)
    with pytest.raises(UserError, match='overwrite'):
        finetune.finetune(config(task='classification', init_from=src, out_dir=src, train_file=train), SINGLE)


# -----------------------------------------------------------------------------
# tokenizers: scratch with a char dataset, GPT-2 BPE from a (tiny) Hugging Face model

def test_scratch_uses_the_dataset_char_vocabulary(tmp_path):
    data = tmp_path / 'chardata'
    data.mkdir()
    tok = CharTokenizer.from_text(ALPHABET)
    (data / 'meta.json').write_text(json.dumps(tok.meta()))
    train, val = make_task(tmp_path, 'classification', n_train=32, n_val=8)
    res = finetune.finetune(config(task='classification', init_from='scratch', dataset=str(data), n_layer=1, n_head=2,
                                   n_embd=16, block_size=32, out_dir=str(tmp_path / 'out'), train_file=train,
                                   val_file=val, epochs=1), SINGLE)
    ckpt = load_checkpoint(str(tmp_path / 'out' / 'ckpt.pt'))
    assert ckpt['tokenizer']['kind'] == 'char'
    assert ckpt['tokenizer'] == tok.meta()  # the dataset's vocabulary itself, not a default
    assert ckpt['model_args']['vocab_size'] == len(ALPHABET) + 3
    assert (ckpt['model_args']['n_layer'], ckpt['model_args']['n_embd'], ckpt['model_args']['block_size']) == \
        (1, 16, 32)
    assert ckpt['source_model'] == 'scratch'
    assert res['steps'] == 2 and res['best_epoch'] == 0  # 32 examples / batch 16, one epoch
    assert res['val_acc'] == pytest.approx(val_accuracy(ckpt, val, 'classification'))


def test_gpt2_bpe_model_from_a_local_hf_directory(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=64, vocab_size=50257))
    hf.save_pretrained(tmp_path / 'hf')
    train, val = make_task(tmp_path, 'entailment', n_train=16, n_val=8)
    res = finetune.finetune(config(task='entailment', init_from=str(tmp_path / 'hf'), out_dir=str(tmp_path / 'out'),
                                   train_file=train, val_file=val, epochs=1, batch_size=8), SINGLE)
    ckpt = load_checkpoint(str(tmp_path / 'out' / 'ckpt.pt'))
    assert ckpt['tokenizer'] == {'kind': 'gpt2'}
    assert ckpt['special_tokens'] == {'start': 50257, 'delim': 50258, 'extract': 50259}
    assert ckpt['model_args']['vocab_size'] == 50260
    assert ckpt['label_map'] == {'entailment': 0, 'neutral': 1}
    assert res['steps'] == 2  # 16 examples / batch 8, one epoch
    assert res['val_acc'] == pytest.approx(val_accuracy(ckpt, val, 'entailment'))


# -----------------------------------------------------------------------------
# the default learning rate (learning_rate=0): GPT-1's at GPT-1's width, larger for narrower models

def resolved_rate(n_embd, resumed=None, **settings):
    recipe = Settings(dict(finetune.DEFAULTS, **settings)).select(finetuning.Recipe)
    return finetuning.resolve_learning_rate(recipe, n_embd, resumed)[0]


def test_default_learning_rate_follows_the_width():
    assert finetune.DEFAULTS['learning_rate'] == 0.0 and "0 = scaled from the model's width" in \
        finetune.DEFAULTS.specs['learning_rate'].help  # --help says what 0 means
    # GPT-1's rate for GPT-1's (and GPT-2 small's) width, exactly
    assert resolved_rate(768) == 6.25e-5
    # narrower: 6.25e-5 x (768 / n_embd) ** 1.5 (the quick-start model is 128 wide), the wider GPT-2s below it
    assert resolved_rate(128) == pytest.approx(6.25e-5 * 6 ** 1.5, rel=1e-12) == pytest.approx(9.186e-4, rel=1e-3)
    assert resolved_rate(1600) < resolved_rate(1024) < 6.25e-5 < resolved_rate(384) < resolved_rate(128)
    # GPT-1's recipe file on GPT-2 small (gpt2 is 768 wide) keeps GPT-1's rate
    cfg = parse_config(finetune.DEFAULTS, [os.path.join(REPO, 'config', 'finetune_classification.py')])
    assert finetuning.resolve_learning_rate(cfg.select(finetuning.Recipe), 768)[0] == 6.25e-5
    # an explicit rate wins, whatever the width; a resume with 0 keeps the rate its run used
    assert resolved_rate(128, learning_rate=2e-3) == 2e-3 and resolved_rate(768, learning_rate=1e-4) == 1e-4
    assert resolved_rate(128, resumed={'config': {'learning_rate': 7e-4}}) == 7e-4
    assert resolved_rate(128, resumed={'config': {'learning_rate': 7e-4}}, learning_rate=1e-3) == 1e-3
    # min_lr above the rate would make the "decay" a rise: refused in one line, unless there is no decay
    with pytest.raises(UserError, match=r"min_lr \(0.001\) is above the learning rate \(6.25e-05"):
        resolved_rate(768, min_lr=1e-3)
    assert resolved_rate(768, min_lr=1e-3, decay_lr=False) == 6.25e-5


def test_the_rate_used_is_printed_and_saved(tmp_path, capsys):
    src = make_source(tmp_path / 'src', n_embd=32)
    train, val = make_task(tmp_path, 'classification', n_train=16, n_val=8)
    common = dict(task='classification', init_from=src, train_file=train, val_file=val, batch_size=8,
                  decay_lr=False)  # no decay: every step runs at the peak rate
    expected = 6.25e-5 * (768 / 32) ** 1.5
    res = finetune.finetune(config(out_dir=str(tmp_path / 'a'), epochs=1, **dict(common, learning_rate=0.0)), SINGLE)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith('learning rate')]
    assert lines == [f"learning rate {expected:.4g} (learning_rate=0: 6.25e-5 x (768 / n_embd 32) ** 1.5)"]
    assert res['learning_rate'] == pytest.approx(expected, rel=1e-12)
    for name in (finetune.BEST_CKPT, finetune.LAST_CKPT):  # the number used, not the 0 asked for
        assert load_checkpoint(str(tmp_path / 'a' / name))['config']['learning_rate'] == res['learning_rate']
    last = load_checkpoint(str(tmp_path / 'a' / finetune.LAST_CKPT))
    # what the steps used
    assert {g['lr'] for g in last['optimizer']['param_groups']} == {res['learning_rate']}
    # a fine-tune given its own rate, resumed with learning_rate=0, goes on at that rate (not the width's)
    finetune.finetune(config(out_dir=str(tmp_path / 'b'), epochs=1, **dict(common, learning_rate=2e-3)), SINGLE)
    capsys.readouterr()
    res = finetune.finetune(config(out_dir=str(tmp_path / 'b'), epochs=2, **dict(common, init_from='resume',
                                                                                  learning_rate=0.0)), SINGLE)
    assert "learning rate 0.002 (the resumed fine-tune's)" in capsys.readouterr().out
    assert res['learning_rate'] == 2e-3 and res['steps'] == 4
    assert load_checkpoint(str(tmp_path / 'b' / finetune.LAST_CKPT))['config']['learning_rate'] == 2e-3


def test_demo_spelling_task_changes_only_the_spelling():
    """ scripts/finetune_demo.py's 'scrambled' class: the same letters in each word, only their inside order moved. """
    demo = runpy.run_path(os.path.join(REPO, 'scripts', 'finetune_demo.py'))
    line = "Hereafter, the rest is silence; Antonio's wit"
    out = demo['scrambled'](line, random.Random(0))
    assert out != line and len(out) == len(line)
    for a, b in zip(line.split(' '), out.split(' ')):
        # case and punctuation stay put
        assert sorted(a) == sorted(b) and (a[0], a[-1]) == (b[0], b[-1])
        if sum(c.isalpha() for c in a) < 4:
            assert a == b  # "the", "is": nothing to shuffle
    # no other order: the caller skips it
    assert demo['scrambled']("seen a bee", random.Random(0)) == "seen a bee"


# -----------------------------------------------------------------------------
# the shipped fine-tuning configs: every setting they assign is one their script knows

@pytest.mark.parametrize('name,script', [('finetune_classification.py', 'finetune'),
                                         ('finetune_shakespeare_plays.py', 'finetune'),
                                         # nanoGPT's: a train.py config
                                         ('finetune_shakespeare.py', 'train')])
def test_finetune_config_files_parse(name, script, tmp_path):
    import train
    defaults = finetune.DEFAULTS if script == 'finetune' else train.DEFAULTS
    path = os.path.join(REPO, 'config', name)
    assigned = {k: v for k, v in runpy.run_path(path).items() if not k.startswith('_') and
                not isinstance(v, types.ModuleType)}
    cfg = parse_config(defaults, [path])  # a key the script doesn't have is a ConfigError here
    assigned.pop('wandb_run_name', None)  # finetune_shakespeare.py's holds the time it was read
    assert assigned and {k: cfg[k] for k in assigned} == assigned
    assert cfg['task'] == 'classification' if script == 'finetune' else cfg['init_from'] == 'gpt2-xl'
    # ...which is what would catch a typo in one of them
    typo = tmp_path / name
    typo.write_text(open(path, encoding='utf-8').read() + "\nlearning_rat = 1e-4\n")
    with pytest.raises(ConfigError, match="unknown setting 'learning_rat'.*did you mean learning_rate"):
        parse_config(defaults, [str(typo)])


# -----------------------------------------------------------------------------
# bad input: one clear line naming the problem

def test_missing_field_names_field_and_line(tmp_path):
    path = write_jsonl(tmp_path / 'bad.jsonl', [{'premise': 'a', 'hypothesis': 'b', 'label': 0},
                                               {'premise': 'a', 'label': 1}])
    with pytest.raises(UserError, match=r"line 2 has no 'hypothesis' field"):
        finetuning.read_jsonl(path, 'entailment')
    path = write_jsonl(tmp_path / 'bad2.jsonl', [{'text': 'a'}])
    with pytest.raises(UserError, match=r"line 1 has no 'label' field"):
        finetuning.read_jsonl(path, 'classification')
    finetuning.read_jsonl(path, 'classification', labeled=False)  # fine for predictions


def test_unknown_val_label_and_empty_file(tmp_path):
    src = make_source(tmp_path / 'src')
    train = write_jsonl(tmp_path / 't.jsonl', [{'text': 'ab', 'label': 'x'}, {'text': 'cd', 'label': 'y'}])
    val = write_jsonl(tmp_path / 'v.jsonl', [{'text': 'ab', 'label': 'x'}, {'text': 'cd', 'label': 'z'}])
    with pytest.raises(UserError, match=r'v.jsonl line 2: unknown label "z"'):
        finetune.finetune(config(task='classification', init_from=src, out_dir=str(tmp_path / 'o'),
                                 train_file=train, val_file=val), SINGLE)
    empty = tmp_path / 'empty.jsonl'
    empty.write_text('\n')
    with pytest.raises(UserError, match='has no examples'):
        finetuning.read_jsonl(str(empty), 'classification')
    mc = write_jsonl(tmp_path / 'mc.jsonl', [{'context': 'a', 'choices': ['b', 'c'], 'label': 2}])
    with pytest.raises(UserError, match='not a choice index'):
        finetuning.label_ids(finetuning.read_jsonl(mc, 'multiple_choice'), 'multiple_choice', None, mc)


def test_cli_errors_are_one_line(tmp_path):
    src = make_source(tmp_path / 'src')
    train = write_jsonl(tmp_path / 't.jsonl', [{'text': 'ab', 'label': 0}, {'txt': 'cd', 'label': 1}])
    p = run_script(['--task=classification', f'--init_from={src}', f'--out_dir={tmp_path / "o"}',
                    f'--train_file={train}', '--device=cpu'])
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1] == \
        f"error: {train} line 2 has no 'text' field, which the classification task needs (fields: text, label)"
    # a character the char model doesn't know names the line too
    bad = write_jsonl(tmp_path / 'u.jsonl', [{'text': 'ab', 'label': 0}, {'text': 'AB', 'label': 1}])
    p = run_script(['--task=classification', f'--init_from={src}', f'--out_dir={tmp_path / "o"}',
                    f'--train_file={bad}', '--device=cpu'])
    assert p.returncode == 2 and 'u.jsonl line 2:' in p.stderr and 'not in this model' in p.stderr


# -----------------------------------------------------------------------------
# DDP: 2 gloo processes == 1 process with the same global batch

def test_ddp_two_processes_match_one(tmp_path):
    src = make_source(tmp_path / 'src')
    # 90 examples: the last step of each epoch is a partial global batch (and 90 is even, so the
    # DistributedSampler adds no duplicate examples)
    train, val = make_task(tmp_path, 'multiple_choice', n_train=90, n_val=31)
    common = ['--task=multiple_choice', f'--init_from={src}', f'--train_file={train}', f'--val_file={val}',
              '--device=cpu', '--dropout=0.0', '--epochs=2', '--learning_rate=3e-3', '--batch_size=8']
    # global batch 16 both ways: 1 process x 8 examples x 2 accumulation steps; 2 processes x 8 x 1
    one = run_script(common + [f'--out_dir={tmp_path / "one"}', '--gradient_accumulation_steps=2'])
    assert one.returncode == 0, one.stdout[-2000:] + one.stderr[-3000:]
    two = run_python(TORCHRUN + ['--standalone', '--nproc_per_node=2', 'finetune.py'] + common
                     + [f'--out_dir={tmp_path / "two"}', '--gradient_accumulation_steps=2'],
                     timeout=240, env=dict(os.environ, OMP_NUM_THREADS='1'))
    # stdout too: its last lines say how far rank 0 got before a rank died
    assert two.returncode == 0, two.stdout[-2000:] + two.stderr[-3000:]
    r1 = last_json(one.stdout)
    r2 = last_json(two.stdout)
    assert r1['steps'] == r2['steps'] == 2 * 6
    assert r1['val_acc'] == r2['val_acc']
    a = load_checkpoint(str(tmp_path / 'one' / finetune.LAST_CKPT))
    b = load_checkpoint(str(tmp_path / 'two' / finetune.LAST_CKPT))
    # equal up to float rounding: the gradient sums are added in another order (gloo all-reduce vs
    # accumulation), and Adam's normalisation magnifies differences of near-zero gradients a little
    for k in a['model']:
        torch.testing.assert_close(a['model'][k], b['model'][k], rtol=1e-3, atol=1e-4)
    torch.testing.assert_close(a['head'], b['head'], rtol=1e-3, atol=1e-4)
    assert [h['train_loss'] for h in a['history']] == pytest.approx([h['train_loss'] for h in b['history']],
                                                                     rel=1e-4)
