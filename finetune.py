"""
GPT-1-style supervised fine-tuning: a pretrained GPT plus a linear head on the final hidden state of the
Extract token, trained with L3 = L2 + lm_loss_weight * L1 (the task's cross-entropy plus the auxiliary
language-modelling loss, lambda = 0.5 in the paper), for a few epochs over a labelled JSONL file.

Tasks and their JSONL fields (one example per line), with GPT-1's input transformations
(s = Start, $ = Delim, e = Extract, three new learned tokens appended to the vocabulary):
    classification   {"text", "label"}                   s text e                        -> linear head
    entailment       {"premise", "hypothesis", "label"}  s premise $ hypothesis e        -> linear head
    similarity       {"text1", "text2", "label"}         s a $ b e  and  s b $ a e, summed -> linear head
    multiple_choice  {"context", "choices", "label"}     s context $ choice_i e for each i -> one scalar
                                                         each, softmax over the choices
Labels of the first three are class ids or strings (the map is stored in the checkpoint); the label of
multiple_choice is the index of the right choice (or its text).

Fine-tune a model trained with train.py (its out_dir), GPT-2 weights or a local HF directory:
$ python finetune.py --task=classification --init_from=out-shakespeare-char --out_dir=out-ft \\
      --train_file=train.jsonl --val_file=val.jsonl
$ python finetune.py config/finetune_classification.py --init_from=gpt2 --train_file=... --val_file=...
$ python finetune.py ... --init_from=scratch --dataset=shakespeare_char   # no pretraining, for comparison

With DDP (each rank gets its DistributedSampler share of every global batch):
$ torchrun --standalone --nproc_per_node=2 finetune.py ... --device=cpu

Resume an interrupted fine-tune (Ctrl-C saves out_dir/ckpt_last.pt):
$ python finetune.py ... --out_dir=out-ft --init_from=resume

Predict labels for unlabelled JSONL with a fine-tuned model (or after training, with the best model):
$ python finetune.py --init_from=out-ft --predict_file=test.jsonl --predict_out=predictions.jsonl

out_dir/ckpt.pt holds the best model (by val accuracy) with its head, label map, special tokens and
tokenizer; the last line printed is JSON: {"task": ..., "val_acc": best val accuracy, ...}.
"""

import json
import math
import os
import sys
import time

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.data import DistributedSampler

from configurator import configure
from model import GPT, GPTConfig
from nanogpt_plus.checkpoint import checkpoint_path, init_model, load_checkpoint, model_from_checkpoint, save_checkpoint
from nanogpt_plus.dataloader import dataset_dir
from nanogpt_plus.files import read_jsonl as read_jsonl_records
from nanogpt_plus.parallel import accumulation_per_rank, all_reduce_sum, grad_sync_context, wrap_model
from nanogpt_plus.runtime import (UserError, destroy_distributed, device_type_of, init_distributed, precision,
                                  provenance, run_main)
from nanogpt_plus.tokenizer import TokenizerError, load_tokenizer, read_dataset_meta
from nanogpt_plus.training import (GracefulExit, MetricsLogger, compute_setup, fit_block_size, gather_rng_states,
                                   get_lr, make_grad_scaler, optimizer_step, restore_training_state, tensors_finite)

TASKS = ('classification', 'entailment', 'similarity', 'multiple_choice')
# the JSONL fields holding each task's texts (the label is always 'label')
TASK_FIELDS = {'classification': ('text',), 'entailment': ('premise', 'hypothesis'),
               'similarity': ('text1', 'text2'), 'multiple_choice': ('context', 'choices')}
LAST_CKPT = 'ckpt_last.pt'  # the latest training state, for --init_from=resume; ckpt.pt is the best model

# -----------------------------------------------------------------------------
# default config values: GPT-1's fine-tuning recipe (lr 6.25e-5, batch 32, 3 epochs, dropout 0.1,
# warmup over 0.2% of training, lambda 0.5)
DEFAULTS = dict(
    task='',  # classification | entailment | similarity | multiple_choice ('' = the checkpoint's, when predicting)
    init_from='scratch',  # a train.py out_dir or ckpt.pt, 'resume' (out_dir/ckpt_last.pt), gpt2*, an HF dir, 'scratch'
    out_dir='out-finetune',
    train_file='',  # JSONL with labels
    val_file='',  # JSONL with labels; accuracy after every epoch picks the checkpoint kept in out_dir/ckpt.pt
    predict_file='',  # JSONL without (or with ignored) labels: write predictions of the best model
    predict_out='',  # where the predictions go ('' = out_dir/predictions.jsonl)
    # data / tokenizer for init_from=scratch
    dataset='openwebtext',  # scratch models use this dataset's tokenizer (char meta), else GPT-2 BPE
    # model (init_from=scratch only, except dropout and block_size)
    n_layer=12,
    n_head=12,
    n_embd=768,
    block_size=0,  # 0 = the source model's (1024 for scratch); smaller crops the model
    bias=False,
    gelu='none',
    dropout=0.1,  # GPT-1 fine-tunes with dropout 0.1, in the model and before the head
    attention='flash',
    # fine-tuning
    epochs=3,
    batch_size=32,  # examples per micro-batch per process
    gradient_accumulation_steps=1,  # global: divided by the number of DDP processes, like train.py
    lm_loss_weight=0.5,  # lambda in L3 = L2 + lambda * L1; 0 turns the auxiliary LM loss off
    learning_rate=6.25e-5,
    weight_decay=0.01,
    beta1=0.9,
    beta2=0.999,
    grad_clip=1.0,
    decay_lr=True,
    warmup_frac=0.002,  # warm up over this fraction of all steps, then decay to min_lr by the last step
    min_lr=0.0,
    log_interval=10,
    eval_batch_size=0,  # 0 = batch_size
    # logging / system
    wandb_log=False,
    wandb_project='finetune',
    wandb_run_name='finetune',
    backend='auto',
    device='auto',
    dtype='auto',
    compile=False,
    seed=1337,
)
# -----------------------------------------------------------------------------


# -----------------------------------------------------------------------------
# data: JSONL -> checked examples -> token sequences with GPT-1's input transformations

def read_jsonl(path, task, labeled=True):
    """
    The examples of a JSONL file as dicts {'texts': [...], 'label': raw label or None, 'line': n, 'record'}.
    Every problem a user can cause names the file, the line and the field.
    """
    if not path:
        raise UserError(f"no file given for the {task} data; pass --train_file=... (and --val_file=...)")
    examples = []
    for n, rec in read_jsonl_records(path, missing_hint="pass an existing JSONL file"):
        texts = []
        for field in TASK_FIELDS[task]:
            if field not in rec:
                raise UserError(f"{path} line {n} has no '{field}' field, which the {task} task needs "
                                f"(fields: {', '.join(TASK_FIELDS[task])}" + (", label)" if labeled else ")"))
            value = rec[field]
            if field == 'choices':
                if not isinstance(value, list) or len(value) < 2 or not all(isinstance(c, str) for c in value):
                    raise UserError(f"{path} line {n}: 'choices' must be a list of at least two strings")
                texts.extend(value)
            elif not isinstance(value, str):
                raise UserError(f"{path} line {n}: '{field}' must be a string, got {type(value).__name__}")
            else:
                texts.append(value)
        label = None
        if labeled:
            if 'label' not in rec:
                raise UserError(f"{path} line {n} has no 'label' field; every training/validation example "
                                f"needs one")
            label = rec['label']
            if isinstance(label, bool) or not isinstance(label, (int, str)):
                raise UserError(f"{path} line {n}: 'label' must be a class id (integer) or a string, "
                                f"got {json.dumps(label)}")
        examples.append({'texts': texts, 'label': label, 'line': n, 'record': rec})
    return examples


def build_label_map(examples, path):
    """ {label: class id}: integer labels are their own ids, strings get ids in sorted order. """
    kinds = {type(ex['label']) for ex in examples}
    if len(kinds) > 1:
        raise UserError(f"{path} mixes integer and string labels; use one kind")
    labels = sorted({ex['label'] for ex in examples})
    if kinds == {int}:
        if labels[0] < 0:
            raise UserError(f"{path}: integer labels must be class ids 0, 1, ...; got {labels[0]}")
        return {i: i for i in range(max(labels[-1] + 1, 2))}
    return {label: i for i, label in enumerate(labels)}


def label_ids(examples, task, label_map, path):
    """ The class id of every example; unknown labels (e.g. in the val file) are an error naming the line. """
    ids = []
    for ex in examples:
        label = ex['label']
        if task == 'multiple_choice':
            n_choices = len(ex['texts']) - 1
            if isinstance(label, str):  # the text of the right choice
                if label not in ex['texts'][1:]:
                    raise UserError(f"{path} line {ex['line']}: label {label!r} is not one of the choices")
                label = ex['texts'][1:].index(label)
            if not 0 <= label < n_choices:
                raise UserError(f"{path} line {ex['line']}: label {label} is not a choice index (0..{n_choices - 1})")
            ids.append(label)
        else:
            if label not in label_map:
                known = ', '.join(json.dumps(k) for k in list(label_map)[:10])
                raise UserError(f"{path} line {ex['line']}: unknown label {json.dumps(label)} (the training data "
                                f"has: {known}); fix the label or add it to the training data")
            ids.append(label_map[label])
    return ids


def truncate_pair(a, b, budget, keep_end_a=False):
    """
    Shorten token lists a and b until len(a) + len(b) <= budget, always trimming the longer one (a on ties),
    so a short text keeps all of its tokens. a loses its end, or its start when keep_end_a (a multiple-
    choice context, whose end is what the choices continue); b always loses its end.
    """
    la, lb = len(a), len(b)
    while la + lb > budget:
        if la >= lb:
            la -= 1
        else:
            lb -= 1
    a = a[len(a) - la:] if keep_end_a else a[:la]
    return a, b[:lb]


def encode_example(texts, task, encode, special, block_size):
    """
    GPT-1's input transformations: the token sequences of one example (one per forward row), each
    [Start] ... [Extract] and at most block_size long. Special tokens are never truncated.
    """
    s, d, e = special['start'], special['delim'], special['extract']
    if task == 'classification':
        a, _ = truncate_pair(encode(texts[0]), [], block_size - 2)
        return [[s] + a + [e]]
    if task == 'entailment':
        a, b = truncate_pair(encode(texts[0]), encode(texts[1]), block_size - 3)
        return [[s] + a + [d] + b + [e]]
    if task == 'similarity':
        # no natural order of the two texts: run both, the model adds the two Extract vectors
        a, b = truncate_pair(encode(texts[0]), encode(texts[1]), block_size - 3)
        return [[s] + a + [d] + b + [e], [s] + b + [d] + a + [e]]
    context = encode(texts[0])
    seqs = []
    for choice in texts[1:]:
        a, b = truncate_pair(context, encode(choice), block_size - 3, keep_end_a=True)
        seqs.append([s] + a + [d] + b + [e])
    return seqs


def encode_examples(examples, task, tokenizer, special, block_size, path):
    """ encode_example for every example; characters a char model can't encode name the line. """
    out = []
    for ex in examples:
        try:
            out.append(encode_example(ex['texts'], task, tokenizer.encode_ordinary, special, block_size))
        except TokenizerError as err:
            raise UserError(f"{path} line {ex['line']}: {err}") from None
    return out


def make_batch(seqs_list, labels, special, device):
    """
    Right-padded rows for a list of examples (each a list of sequences), as tensors:
    idx (R, T) tokens; extract_pos (R,) where each row's Extract token sits; lm_targets (R, T) the next
    text token at every position (-1 where there is none: padding, and positions whose next token is a
    special token, so L1 is language modelling of the text only); choice_mask (B, N) which choice slots
    are real (multiple choice); labels (B,) or None. Causal attention means a row's Extract position
    never sees the padding after it, so no attention mask is needed.
    """
    rows = [seq for seqs in seqs_list for seq in seqs]
    T = max(len(r) for r in rows)
    idx = torch.zeros(len(rows), T, dtype=torch.long)
    targets = torch.full((len(rows), T), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        t = torch.tensor(r, dtype=torch.long)
        idx[i, :len(r)] = t
        targets[i, :len(r) - 1] = t[1:]
    targets[targets >= special['start']] = -1  # the special tokens (appended last) are never LM targets
    extract_pos = torch.tensor([len(r) - 1 for r in rows], dtype=torch.long)
    n_max = max(len(seqs) for seqs in seqs_list)
    choice_mask = torch.tensor([[j < len(seqs) for j in range(n_max)] for seqs in seqs_list], dtype=torch.bool)
    batch = {'idx': idx, 'extract_pos': extract_pos, 'lm_targets': targets, 'choice_mask': choice_mask,
             'labels': None if labels is None else torch.tensor(labels, dtype=torch.long)}
    batch = {k: (v.to(device) if v is not None else None) for k, v in batch.items()}
    batch['n_lm_targets'] = int((targets != -1).sum())  # counted before the copy: no device sync later
    return batch


# -----------------------------------------------------------------------------
# the model: a GPT plus GPT-1's linear head W_y on the Extract position

class TaskHead(nn.Module):
    """
    GPT-1's W_y: dropout, then a linear map of the Extract hidden state to n_out scores. Multiple choice
    has no bias: a softmax over the choices' scores can't see a shared offset, so its gradient would be
    pure rounding noise (which Adam would turn into a random walk).
    """

    def __init__(self, n_embd, n_out, dropout=0.0, bias=True):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.linear = nn.Linear(n_embd, n_out, bias=bias)
        torch.nn.init.normal_(self.linear.weight, mean=0.0, std=0.02)  # like every other Linear of the GPT
        if bias:
            torch.nn.init.zeros_(self.linear.bias)

    def forward(self, h):
        return self.linear(self.dropout(h))


def head_outputs(task, n_classes):
    """ The head's output width: one scalar per choice for multiple choice, else one score per class. """
    return 1 if task == 'multiple_choice' else n_classes


class FinetuneModel(nn.Module):
    """
    The GPT and its task head as one module (one DDP wrapper, one optimizer). forward returns the task
    logits (B, n_classes or n_choices) and the summed next-token loss over the batch's LM targets.
    """

    def __init__(self, gpt, head, task):
        super().__init__()
        self.gpt, self.head, self.task = gpt, head, task

    def forward(self, idx, extract_pos, choice_mask, lm_targets=None):
        h = self.gpt.hidden_states(idx)  # (R, T, C)
        feats = h[torch.arange(h.size(0), device=h.device), extract_pos]  # (R, C): the Extract positions
        if self.task == 'similarity':
            # rows come in pairs (a $ b, b $ a) per example; their sum is symmetric in the two texts
            logits = self.head(feats.view(-1, 2, feats.size(-1)).sum(1))
        elif self.task == 'multiple_choice':
            scores = self.head(feats).squeeze(-1).float()  # (R,): one scalar per (example, choice)
            # lay the scores out as (B, N) with -inf for missing choices, so the softmax ignores them
            logits = scores.new_full(choice_mask.shape, float('-inf')).masked_scatter(choice_mask, scores)
        else:
            logits = self.head(feats)
        lm_loss_sum = None
        if lm_targets is not None:
            lm_logits = self.gpt.lm_head(h)
            lm_loss_sum = F.cross_entropy(lm_logits.view(-1, lm_logits.size(-1)).float(), lm_targets.view(-1),
                                          ignore_index=-1, reduction='sum')
        return logits.float(), lm_loss_sum


def add_special_tokens(gpt, source_ckpt):
    """
    Start, Delim and Extract as three new rows of the (tied) embedding table, initialised like the
    others; a model fine-tuned before already has them.
    """
    if source_ckpt is not None and source_ckpt.get('special_tokens'):
        return dict(source_ckpt['special_tokens'])
    v = gpt.config.vocab_size
    gpt.resize_token_embeddings(v + 3)
    return {'start': v, 'delim': v + 1, 'extract': v + 2}


# -----------------------------------------------------------------------------
# building the model for each init_from

def build_scratch(cfg):
    """ A new random GPT from the model settings, with the tokenizer of --dataset (char meta, else GPT-2). """
    meta = read_dataset_meta(dataset_dir(cfg['dataset']))
    if meta is not None and meta.get('kind', 'gpt2') == 'char':
        tokenizer_meta, vocab_size = meta, int(meta['vocab_size'])
    else:
        tokenizer_meta, vocab_size = {'kind': 'gpt2'}, 50304  # 50257 rounded up, like train.py
    gpt = GPT(GPTConfig(n_layer=cfg['n_layer'], n_head=cfg['n_head'], n_embd=cfg['n_embd'],
                        block_size=cfg['block_size'] or 1024, bias=cfg['bias'], vocab_size=vocab_size,
                        dropout=cfg['dropout'], gelu=cfg['gelu']))
    return gpt, tokenizer_meta


def load_source(cfg):
    """ (gpt, tokenizer meta, source checkpoint or None) for init_from, before the special tokens. """
    init_from = cfg['init_from']
    if init_from == 'scratch':
        gpt, tokenizer_meta = build_scratch(cfg)
        return gpt, tokenizer_meta, None
    if init_from == 'resume':
        ckpt = load_checkpoint(os.path.join(cfg['out_dir'], LAST_CKPT))
        return model_from_checkpoint(ckpt, dropout=cfg['dropout']), ckpt['tokenizer'], ckpt
    source_path = checkpoint_path(init_from, cfg['out_dir'])
    target = os.path.abspath(os.path.join(cfg['out_dir'], 'ckpt.pt'))
    if source_path is not None and os.path.abspath(source_path) == target:
        raise UserError(f"init_from {init_from} is the checkpoint in --out_dir, which fine-tuning would overwrite; "
                        f"pass a different --out_dir (or --init_from=resume to continue an interrupted fine-tune)")
    return init_model(init_from, cfg['out_dir'], dropout=cfg['dropout'])


# -----------------------------------------------------------------------------
# evaluation and prediction

@torch.no_grad()
def evaluate(model, encoded, labels, special, batch_size, device, ctx, indices=None):
    """
    Accuracy pieces over examples (this rank's indices): (n_correct, n_seen, summed task loss, predictions
    as (index, class id, probabilities)).
    """
    was_training = model.training
    model.eval()
    indices = list(range(len(encoded))) if indices is None else list(indices)
    correct, loss_sum, preds = 0, 0.0, []
    for i in range(0, len(indices), batch_size):
        chunk = indices[i:i + batch_size]
        batch = make_batch([encoded[j] for j in chunk], None if labels is None else [labels[j] for j in chunk],
                           special, device)
        with ctx:
            logits, _ = model(batch['idx'], batch['extract_pos'], batch['choice_mask'])
        probs = F.softmax(logits, dim=-1)
        pred = logits.argmax(-1)
        if batch['labels'] is not None:
            correct += int((pred == batch['labels']).sum())
            loss_sum += float(F.cross_entropy(logits, batch['labels'], reduction='sum'))
        for j, p, pr, m in zip(chunk, pred.tolist(), probs.tolist(), batch['choice_mask'].tolist()):
            preds.append((j, p, [round(x, 6) for x, real in zip(pr, m) if real] if model.task == 'multiple_choice'
                          else [round(x, 6) for x in pr]))
    model.train(was_training)
    return correct, len(indices), loss_sum, preds


def write_predictions(model, ckpt_info, cfg, special, tokenizer, device, ctx, path, out_path):
    """ Predictions of model for every example of path, one JSON line each (the input plus prediction). """
    task = ckpt_info['task']
    examples = read_jsonl(path, task, labeled=False)
    encoded = encode_examples(examples, task, tokenizer, special, model.gpt.config.block_size, path)
    bs = cfg['eval_batch_size'] or cfg['batch_size']
    _, _, _, preds = evaluate(model, encoded, None, special, bs, device, ctx)
    id_to_label = {i: label for label, i in (ckpt_info['label_map'] or {}).items()}
    lines = []
    for (j, p, probs) in preds:
        out = dict(examples[j]['record'])
        out['prediction'] = p if task == 'multiple_choice' else id_to_label.get(p, p)
        out['probs'] = probs
        lines.append(json.dumps(out))
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, 'w', encoding='utf-8') as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {len(lines)} predictions to {out_path}")


def model_from_finetune_checkpoint(ckpt, dropout=0.0):
    """ The FinetuneModel (GPT + head) saved in a finetune.py checkpoint, on the CPU. """
    if not ckpt.get('task') or 'head' not in ckpt:
        raise UserError("this checkpoint has no fine-tuned task head; fine-tune it first (python finetune.py "
                        "--train_file=...)")
    gpt = model_from_checkpoint(ckpt, dropout=dropout)
    head = TaskHead(gpt.config.n_embd, ckpt['head']['linear.weight'].size(0), dropout, 'linear.bias' in ckpt['head'])
    head.load_state_dict(ckpt['head'])
    return FinetuneModel(gpt, head, ckpt['task'])


# -----------------------------------------------------------------------------

def main():
    cfg = configure(DEFAULTS, doc=__doc__)
    if cfg['task'] and cfg['task'] not in TASKS:
        raise UserError(f"unknown task '{cfg['task']}': use {', '.join(TASKS)}")
    if cfg['init_from'] == 'resume' and not os.path.exists(os.path.join(cfg['out_dir'], LAST_CKPT)):
        raise UserError(f"init_from=resume but there is no {os.path.join(cfg['out_dir'], LAST_CKPT)}; check "
                        f"--out_dir or start a new fine-tune with --init_from=<pretrained model>")
    dist_info = init_distributed(cfg['device'], cfg['backend'])
    try:
        if not cfg['train_file'] and cfg['predict_file']:
            predict_only(cfg, dist_info)
        else:
            finetune(cfg, dist_info)
    finally:
        destroy_distributed()


def predict_only(cfg, dist_info):
    """ --predict_file with a fine-tuned checkpoint (init_from) and no --train_file: predictions only. """
    path = checkpoint_path(cfg['init_from'], cfg['out_dir'])
    if path is None:
        raise UserError(f"--predict_file without --train_file needs --init_from to be a fine-tuned out_dir or "
                        f"ckpt.pt; {cfg['init_from']} is not one")
    ckpt = load_checkpoint(path)
    model = model_from_finetune_checkpoint(ckpt)
    if cfg['task'] and cfg['task'] != ckpt['task']:
        raise UserError(f"--task={cfg['task']} but {path} was fine-tuned for {ckpt['task']}; drop --task")
    if not dist_info.master:
        return
    device = dist_info.device
    model.to(device)
    _, ctx = precision(device, cfg['dtype'])
    out_path = cfg['predict_out'] or os.path.join(os.path.dirname(path), 'predictions.jsonl')
    write_predictions(model, ckpt, cfg, ckpt['special_tokens'], load_tokenizer(ckpt['tokenizer']), device, ctx,
                      cfg['predict_file'], out_path)


def finetune(cfg, dist_info):
    """ Fine-tune, evaluate after every epoch, keep the best model; returns the final result dict. """
    master = dist_info.master
    device = dist_info.device
    device_type = device_type_of(device)
    W = dist_info.world_size
    accum = accumulation_per_rank(cfg['gradient_accumulation_steps'], dist_info)
    dtype, ctx, compile_model, _ = compute_setup(device, cfg['dtype'], cfg['compile'], num_threads=0, peak=False)
    run_provenance = dict(provenance(device), dtype=dtype, world_size=W)  # printed now, kept in checkpoints
    if master:
        os.makedirs(cfg['out_dir'], exist_ok=True)
        print("provenance: " + json.dumps(run_provenance))

    resume = cfg['init_from'] == 'resume'
    if cfg['task'] not in TASKS and not (resume and not cfg['task']):
        raise UserError(f"unknown task '{cfg['task']}': pass --task=one of {', '.join(TASKS)}")

    # the model: the same initial weights on every rank (head, new embeddings), then per-rank dropout
    torch.manual_seed(cfg['seed'])
    gpt, tokenizer_meta, source_ckpt = load_source(cfg)
    task = (cfg['task'] or source_ckpt.get('task')) if resume else cfg['task']
    if resume and task != source_ckpt.get('task'):
        raise UserError(f"--task={task} but the fine-tune in {cfg['out_dir']} is {source_ckpt.get('task')}; "
                        f"drop --task to resume it")
    fit_block_size(gpt, cfg['block_size'])
    block_size = gpt.config.block_size
    if block_size < 5:
        raise UserError(f"block_size {block_size} is too small for the special tokens; use 16 or more")
    special = add_special_tokens(gpt, source_ckpt)
    tokenizer = load_tokenizer(tokenizer_meta)

    # data: labels of the training file define the classes (kept from the checkpoint when resuming)
    train_examples = read_jsonl(cfg['train_file'], task)
    if resume:
        label_map = source_ckpt.get('label_map')
    else:
        label_map = None if task == 'multiple_choice' else build_label_map(train_examples, cfg['train_file'])
    train_labels = label_ids(train_examples, task, label_map, cfg['train_file'])
    train_encoded = encode_examples(train_examples, task, tokenizer, special, block_size, cfg['train_file'])
    val_encoded = val_labels = None
    if cfg['val_file']:
        val_examples = read_jsonl(cfg['val_file'], task)
        val_labels = label_ids(val_examples, task, label_map, cfg['val_file'])
        val_encoded = encode_examples(val_examples, task, tokenizer, special, block_size, cfg['val_file'])
    elif master:
        print("warning: no --val_file; the model of the last epoch is kept and val_acc is null", file=sys.stderr)
    n_classes = len(label_map) if label_map else None

    head = TaskHead(gpt.config.n_embd, head_outputs(task, n_classes), cfg['dropout'], bias=task != 'multiple_choice')
    if resume:
        head.load_state_dict(source_ckpt['head'])
    gpt.set_attention(cfg['attention'])
    raw_model = FinetuneModel(gpt, head, task).to(device)
    torch.manual_seed(cfg['seed'] + dist_info.rank)  # dropout differs per rank; data order does not

    optimizer = configure_optimizers(raw_model, cfg, device_type)
    scaler = make_grad_scaler(device_type, dtype)
    model = wrap_model(raw_model, dist_info, compile_model)

    # epochs over a DistributedSampler: one seeded permutation per epoch (the same on every rank and for
    # every world size); rank r takes positions r, r+W, ... of it, so the micro-batches of all ranks in
    # one optimizer step together hold exactly the examples a single process would take for that step
    sampler = DistributedSampler(range(len(train_encoded)), num_replicas=W, rank=dist_info.rank, shuffle=True,
                                 seed=cfg['seed'], drop_last=False)
    per_step = cfg['batch_size'] * accum
    steps_per_epoch = math.ceil(len(sampler) / per_step)
    total_steps = cfg['epochs'] * steps_per_epoch
    warmup_iters = int(cfg['warmup_frac'] * total_steps)
    lr_decay_iters = max(total_steps - 1, warmup_iters + 1)

    epoch, step_in_epoch, iter_num, best_val_acc, best_epoch, history = 0, 0, 0, None, None, []
    if resume:
        restore_training_state(source_ckpt, optimizer, scaler, dist_info)
        epoch, step_in_epoch = int(source_ckpt['epoch']), int(source_ckpt['step_in_epoch'])
        iter_num, best_val_acc = int(source_ckpt['iter_num']), source_ckpt.get('best_val_acc')
        best_epoch, history = source_ckpt.get('best_epoch'), list(source_ckpt.get('history') or [])
        if master:
            print(f"resuming the fine-tune at epoch {epoch}, step {step_in_epoch} of {steps_per_epoch}")
    source_name = (source_ckpt or {}).get('source_model', cfg['init_from']) if resume else cfg['init_from']
    source_ckpt = None  # free up memory

    def checkpoint(extra):
        return dict({
            'model': raw_model.gpt.state_dict(),
            'model_args': raw_model.gpt.config.model_args(),
            'model_extra_args': raw_model.gpt.config.model_extra_args(),
            'head': raw_model.head.state_dict(),
            'task': task,
            'label_map': label_map,
            'special_tokens': special,
            'tokenizer': tokenizer_meta,
            'config': dict(cfg),
            'source_model': source_name,
            'iter_num': iter_num,
            'best_val_loss': 1e9,  # train.py's key, so generic tools can read the file; see val_acc
            'provenance': run_provenance,
        }, **extra)

    def save_last(reason):
        """ The full training state (all ranks call this: RNG states are gathered from every rank). """
        rng_states = gather_rng_states(dist_info)
        if not master:
            return
        if not tensors_finite(raw_model.parameters()):
            raise UserError(f"the weights are not finite at step {iter_num}; not saving. Lower the learning rate")
        save_checkpoint(checkpoint({'optimizer': optimizer.state_dict(), 'epoch': epoch,
                                    'step_in_epoch': step_in_epoch, 'best_val_acc': best_val_acc,
                                    'best_epoch': best_epoch, 'history': history, 'rng': rng_states,
                                    'scaler': scaler.state_dict() if scaler.is_enabled() else None}),
                        os.path.join(cfg['out_dir'], LAST_CKPT))
        print(f"saved the training state to {os.path.join(cfg['out_dir'], LAST_CKPT)} ({reason})")

    logger = MetricsLogger(os.path.join(cfg['out_dir'], 'metrics.jsonl'), enabled=master,
                           wandb_log=cfg['wandb_log'], wandb_project=cfg['wandb_project'],
                           wandb_run_name=cfg['wandb_run_name'], config=cfg, wandb_dir=cfg['out_dir'])
    exit_request = GracefulExit().install()
    lm_w = cfg['lm_loss_weight']
    eval_bs = cfg['eval_batch_size'] or cfg['batch_size']
    interrupted = False
    last_loss = None  # the train loss of the last logged step (every epoch's last step is logged)
    t0 = time.time()
    try:
        while epoch < cfg['epochs'] and not interrupted:
            sampler.set_epoch(epoch)
            order = list(sampler)  # this rank's examples for the epoch, in order
            while step_in_epoch < steps_per_epoch:
                lr = get_lr(iter_num, cfg['learning_rate'], warmup_iters, lr_decay_iters, cfg['min_lr']) \
                    if cfg['decay_lr'] else cfg['learning_rate']
                for group in optimizer.param_groups:
                    group['lr'] = lr
                start = step_in_epoch * per_step
                micro = [order[start + m * cfg['batch_size']: start + (m + 1) * cfg['batch_size']]
                         for m in range(accum)]
                micro = [m for m in micro if m]
                # every rank must run the same number of forward/backward passes (DDP); the sampler pads
                # every rank to the same length, so the number of non-empty micro-batches agrees
                batches = [make_batch([train_encoded[i] for i in m], [train_labels[i] for i in m], special, device)
                           for m in micro]
                # normalise by the counts of the whole global batch (all micro-batches, all ranks): the
                # gradient is then exactly that of one big batch, for any world size and accumulation
                n_ex = sum(b['labels'].numel() for b in batches)
                n_tok = sum(b['n_lm_targets'] for b in batches)
                n_ex, n_tok = all_reduce_sum([float(n_ex), float(n_tok)], dist_info)
                step_cls = torch.zeros((), device=device)
                step_lm = torch.zeros((), device=device)
                for k, b in enumerate(batches):
                    with grad_sync_context(model, k == len(batches) - 1):
                        with ctx:
                            logits, lm_sum = model(b['idx'], b['extract_pos'], b['choice_mask'],
                                                   b['lm_targets'] if lm_w > 0 else None)
                        cls_loss = F.cross_entropy(logits, b['labels'], reduction='sum') / n_ex
                        loss = cls_loss
                        if lm_w > 0:
                            lm_loss = lm_sum / max(n_tok, 1.0)
                            loss = loss + lm_w * lm_loss
                            step_lm += lm_loss.detach()
                        step_cls += cls_loss.detach()
                        # DDP averages gradients over the W ranks; scale up so they add up instead
                        scaler.scale(loss * W).backward()
                grad_norm = optimizer_step(model, optimizer, scaler, cfg['grad_clip'])
                iter_num += 1
                step_in_epoch += 1
                log_step = iter_num % cfg['log_interval'] == 0 or step_in_epoch == steps_per_epoch
                if log_step:
                    # the step's losses summed over ranks (one sync, at log time only)
                    step_cls, step_lm = all_reduce_sum([step_cls.item(), step_lm.item()], dist_info)
                    last_loss = step_cls + lm_w * step_lm
                    if not math.isfinite(step_cls + step_lm):
                        raise UserError(f"the loss is {step_cls + step_lm} at step {iter_num}; lower the "
                                        f"learning rate (or use --dtype=float32)")
                    if master:
                        dt = time.time() - t0
                        print(f"epoch {epoch} step {iter_num}/{total_steps}: loss {last_loss:.4f} "
                              f"(task {step_cls:.4f}, lm {step_lm:.4f}), lr {lr:.2e}, {dt:.1f}s")
                        logger.log({'type': 'iter', 'iter': iter_num, 'epoch': epoch, 'loss': last_loss,
                                    'task_loss': step_cls, 'lm_loss': step_lm, 'lr': lr,
                                    'grad_norm': float(grad_norm) if grad_norm is not None else None})
                if exit_request.should_stop(dist_info, sync_point=log_step):
                    interrupted = True
                    break
            if interrupted:
                save_last(f"interrupted at epoch {epoch}, step {step_in_epoch}")
                if master:
                    print(f"stopped cleanly; continue with --init_from=resume --out_dir={cfg['out_dir']}")
                break

            # end of the epoch: accuracy on the val file (every rank a strided share), keep the best model
            record = {'epoch': epoch, 'iter': iter_num, 'train_loss': last_loss}
            if val_encoded is not None:
                correct, seen, loss_sum, _ = evaluate(raw_model, val_encoded, val_labels, special, eval_bs, device,
                                                      ctx, range(dist_info.rank, len(val_encoded), W))
                correct, seen, loss_sum = all_reduce_sum([correct, seen, loss_sum], dist_info)
                record.update(val_acc=correct / seen, val_loss=loss_sum / seen)
                if master:
                    print(f"epoch {epoch}: val accuracy {correct / seen:.4f} "
                          f"({int(round(correct))}/{int(round(seen))}), "
                          f"val loss {loss_sum / seen:.4f}")
            history.append(record)
            if master:
                logger.log(dict(record, type='eval'))
            improved = val_encoded is None or best_val_acc is None or record['val_acc'] > best_val_acc
            if improved:
                best_val_acc, best_epoch = record.get('val_acc'), epoch
                if master:
                    save_checkpoint(checkpoint({'epoch': epoch, 'val_acc': best_val_acc,
                                                'val_loss': record.get('val_loss'), 'history': history}),
                                    os.path.join(cfg['out_dir'], 'ckpt.pt'))
                    print(f"saved the best model so far to {os.path.join(cfg['out_dir'], 'ckpt.pt')}")
            epoch += 1
            step_in_epoch = 0
            save_last(f"end of epoch {epoch - 1}")
    finally:
        exit_request.uninstall()
        logger.close()

    result = {'task': task, 'val_acc': best_val_acc, 'best_epoch': best_epoch, 'epochs': epoch,
              'steps': iter_num, 'out_dir': cfg['out_dir'], 'interrupted': interrupted}
    if cfg['predict_file'] and not interrupted and master:
        best = load_checkpoint(os.path.join(cfg['out_dir'], 'ckpt.pt'))
        best_model = model_from_finetune_checkpoint(best).to(device)
        write_predictions(best_model, best, cfg, special, tokenizer, device, ctx, cfg['predict_file'],
                          cfg['predict_out'] or os.path.join(cfg['out_dir'], 'predictions.jsonl'))
    if master:
        print(json.dumps(result))
    return result


def configure_optimizers(model, cfg, device_type):
    """ GPT.configure_optimizers' AdamW over the GPT and the head (its weight decays, its bias does not). """
    optimizer = model.gpt.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'],
                                               (cfg['beta1'], cfg['beta2']), device_type)
    optimizer.add_param_group({'params': [model.head.linear.weight], 'weight_decay': cfg['weight_decay']})
    if model.head.linear.bias is not None:
        optimizer.add_param_group({'params': [model.head.linear.bias], 'weight_decay': 0.0})
    return optimizer


if __name__ == '__main__':
    run_main(main)
