"""
nanogpt_plus/finetuning.py: GPT-1's input transformations, truncation that keeps the special tokens, the grown tied
embedding, the auxiliary LM loss over real tokens only, the head on the Extract token, symmetric similarity, 2..5
choices, the default learning rate by width, validation as many batches on every rank, and bad JSONL in one line.
"""
import os

import pytest
import torch

import finetune
from configurator import Settings, parse_config
from helpers import REPO, SINGLE, SPECIAL, config, make_source, write_jsonl
from model import GPT, GPTConfig
from nanogpt_plus import finetuning
from nanogpt_plus.errors import UserError

# -----------------------------------------------------------------------------
# input transformations, batching and the losses

@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


def resolved_rate(n_embd, resumed=None, **settings):
    recipe = Settings(dict(finetune.DEFAULTS, **settings)).select(finetuning.Recipe)
    return finetuning.resolve_learning_rate(recipe, n_embd, resumed)[0]


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
def test_missing_field_names_field_and_line(tmp_path):
    path = write_jsonl(tmp_path / 'bad.jsonl', [{'premise': 'a', 'hypothesis': 'b', 'label': 0},
                                               {'premise': 'a', 'label': 1}])
    with pytest.raises(UserError, match=r"line 2 has no 'hypothesis' field"):
        finetuning.read_jsonl(path, 'entailment')
    path = write_jsonl(tmp_path / 'bad2.jsonl', [{'text': 'a'}])
    with pytest.raises(UserError, match=r"line 1 has no 'label' field"):
        finetuning.read_jsonl(path, 'classification')
    finetuning.read_jsonl(path, 'classification', labeled=False)  # fine for predictions


@pytest.mark.usefixtures('one_thread')
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


class CountingClassifier(torch.nn.Module):
    """ finetuning.evaluate's model interface: constant class logits, and a count of its forward passes. """
    task = 'classification'

    def __init__(self):
        super().__init__()
        self.forwards = 0

    def forward(self, idx, extract_pos, choice_mask, lm_targets=None):
        self.forwards += 1
        return torch.tensor([[1.0, 0.0]]).expand(idx.size(0), 2), None


def test_finetune_validation_runs_as_many_batches_on_every_rank():
    from nanogpt_plus.finetuning import evaluate
    encoded = [[[1, 2, 3]]] * 3
    labels = [0, 1, 0]
    special = {'start': 10}
    results = []
    # 3 examples, batches of 1: rank 0 has 2, rank 1 one plus a padding forward
    for rank in range(2):
        model = CountingClassifier()
        correct, seen, _, preds = evaluate(model, encoded, labels, special, 1, 'cpu', torch.no_grad(),
                                           range(rank, 3, 2), num_batches=2)
        results.append((model.forwards, correct, seen, [p[0] for p in preds]))
    assert results == [(2, 2, 2, [0, 2]), (2, 0, 1, [1])]
