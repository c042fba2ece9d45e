"""
GPT-1-style supervised fine-tuning, the library half of finetune.py: labelled JSONL examples,
GPT-1's input transformations, the task head on the Extract token, evaluation, predictions, and the
checkpoint a fine-tune writes (and how to read it back). finetune.py holds the settings and the
training loop.

The tasks, their JSONL fields and input transformations are listed in finetune.py's docstring
(python finetune.py --help); TASK_FIELDS below is the table the code reads.

Usage:
    from nanogpt_plus.finetuning import read_jsonl, encode_examples, make_batch, model_from_finetune_checkpoint
    model = model_from_finetune_checkpoint(load_checkpoint('out-ft/ckpt.pt'))
    examples = read_jsonl('val.jsonl', model.task)
"""

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F
from torch.utils.data import DistributedSampler

from nanogpt_plus import init_from
from nanogpt_plus.checkpoint import build_checkpoint, checkpoint_path, load_checkpoint, require_entries
from nanogpt_plus.distributed import all_reduce_sum, master_decides
from nanogpt_plus.errors import TokenizerError, UserError
from nanogpt_plus.files import atomic_write
from nanogpt_plus.files import read_jsonl as read_jsonl_records
from nanogpt_plus.init_from import fit_block_size, model_from_checkpoint
from nanogpt_plus.machine import auto_threads, precision
from nanogpt_plus.optimizer import LRSchedule
from nanogpt_plus.outputs import check_output
from nanogpt_plus.tokenizer import check_tokenizer_fits, load_tokenizer
from nanogpt_plus.weight_formats import set_weights

TASKS = ('classification', 'entailment', 'similarity', 'multiple_choice')
# the JSONL fields holding each task's texts (the label is always 'label')
TASK_FIELDS = {'classification': ('text',), 'entailment': ('premise', 'hypothesis'),
               'similarity': ('text1', 'text2'), 'multiple_choice': ('context', 'choices')}


# -----------------------------------------------------------------------------
# what the pieces below take of finetune.py's settings (each built with cfg.select)

@dataclass(frozen=True)
class TaskFiles:
    """ A fine-tune's JSONL files: labelled examples to train and validate on, more to predict. """
    train_file: str
    val_file: str
    predict_file: str


def task_files(files):
    """ {setting: path} of the TaskFiles given (those not ''), what every rank compares. """
    return {name: path for name, path in dataclasses.asdict(files).items() if path}


@dataclass(frozen=True)
class TaskModelSpec:
    """
    The task model: the GPT init_from names, cropped to block_size (0: the GPT's own), dropout in
    the head, and how it computes (the attention kernel, activation checkpointing).
    """
    init_from: str
    block_size: int
    dropout: float
    attention: str
    activation_checkpointing: bool


@dataclass(frozen=True)
class Recipe:
    """ How a fine-tune trains: epochs, batches, AdamW's settings, the learning rate's schedule. """
    epochs: int
    batch_size: int
    learning_rate: float  # 0 before resolve_learning_rate: the rate for the model's width
    min_lr: float
    decay_lr: bool
    warmup_frac: float
    weight_decay: float
    beta1: float
    beta2: float


@dataclass(frozen=True)
class PredictSpec:
    """
    finetune.py's predictions with a fine-tuned checkpoint (init_from: its out_dir or ckpt.pt): of
    predict_file, into predict_out ('' = predictions.jsonl beside the checkpoint), in batches of
    eval_batch_size (0 = batch_size), with the weights stored as `weights` and computed in dtype, on
    num_threads CPU threads (0: timed, train.py's choice).
    """
    init_from: str
    out_dir: str
    task: str
    predict_file: str
    predict_out: str
    overwrite: bool
    eval_batch_size: int
    batch_size: int
    weights: str
    dtype: str
    num_threads: int


# -----------------------------------------------------------------------------
# data: JSONL -> checked examples -> class ids

def read_jsonl(path, task, labeled=True):
    """
    The examples of a JSONL file as dicts {'texts': [...], 'label': raw label or None, 'line': n,
    'record'}. Every problem a user can cause names the file, the line and the field.
    """
    if not path:
        raise UserError(
            f"no file given for the {task} data; pass --train_file=... (and --val_file=...)")
    examples = []
    for n, rec in read_jsonl_records(path, missing_hint="pass an existing JSONL file"):
        texts = _example_texts(rec, task, path, n, labeled)
        label = _example_label(rec, path, n) if labeled else None
        examples.append({'texts': texts, 'label': label, 'line': n, 'record': rec})
    return examples


def _example_texts(rec, task, path, n, labeled):
    """
    The texts of record rec (line n) in TASK_FIELDS order; the choices of multiple choice come
    flattened.
    """
    texts = []
    for field in TASK_FIELDS[task]:
        if field not in rec:
            raise UserError(f"{path} line {n} has no '{field}' field, which the {task} task needs "
                            f"(fields: {', '.join(TASK_FIELDS[task])}" +
                            (", label)" if labeled else ")"))
        value = rec[field]
        if field == 'choices':
            if not isinstance(value, list) or len(value) < 2 or not all(
                    isinstance(c, str) for c in value):
                raise UserError(
                    f"{path} line {n}: 'choices' must be a list of at least two strings")
            texts.extend(value)
        elif isinstance(value, str):
            texts.append(value)
        else:
            raise UserError(
                f"{path} line {n}: '{field}' must be a string, got {type(value).__name__}")
    return texts


def _example_label(rec, path, n):
    """
    The raw label of record rec (line n): a class id or a string (bools are JSON's, not class ids).
    """
    if 'label' not in rec:
        raise UserError(
            f"{path} line {n} has no 'label' field; every training/validation example needs one")
    label = rec['label']
    if isinstance(label, bool) or not isinstance(label, (int, str)):
        raise UserError(f"{path} line {n}: 'label' must be a class id (integer) or a string, "
                        f"got {json.dumps(label)}")
    return label


def build_label_map(examples, path):
    """ {label: class id}: integer labels are their own ids, strings get ids in sorted order. """
    kinds = {type(ex['label']) for ex in examples}
    if len(kinds) > 1:
        raise UserError(f"{path} mixes integer and string labels; use one kind")
    labels = sorted({ex['label'] for ex in examples})
    if kinds == {int}:
        if labels[0] < 0:
            raise UserError(f"{path}: integer labels must be class ids 0, 1, ...; got {labels[0]}")
        # at least two classes, so that a file whose labels are all 0 still trains a real classifier
        return {i: i for i in range(max(labels[-1] + 1, 2))}
    return {label: i for i, label in enumerate(labels)}


def label_ids(examples, task, label_map, path):
    """
    The class id of every example; unknown labels (e.g. in the val file) are an error naming the
    line.
    """
    if task == 'multiple_choice':
        return [_choice_index(ex, path) for ex in examples]
    ids = []
    for ex in examples:
        if ex['label'] not in label_map:
            known = ', '.join(json.dumps(k) for k in list(label_map)[:10])
            raise UserError(
                f"{path} line {ex['line']}: unknown label {json.dumps(ex['label'])} (the training "
                f"data has: {known}); fix the label or add it to the training data")
        ids.append(label_map[ex['label']])
    return ids


def _choice_index(ex, path):
    """
    The index of a multiple-choice example's right choice; its label is that index or the choice's
    text.
    """
    label = ex['label']
    choices = ex['texts'][1:]
    if isinstance(label, str):
        if label not in choices:
            raise UserError(f"{path} line {ex['line']}: label {label!r} is not one of the choices")
        label = choices.index(label)
    if not 0 <= label < len(choices):
        raise UserError(
            f"{path} line {ex['line']}: label {label} is not a choice index (0..{len(choices) - 1})"
        )
    return label


# -----------------------------------------------------------------------------
# GPT-1's input transformations: examples -> token sequences -> padded batches

def truncate_pair(a, b, budget, keep_end_a=False):
    """
    Shorten token lists a and b until len(a) + len(b) <= budget, always trimming the longer one (a
    on ties), so a short text keeps all of its tokens. a loses its end, or its start when keep_end_a
    (a multiple- choice context, whose end is what the choices continue); b always loses its end.
    """
    la = len(a)
    lb = len(b)
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
    s = special['start']
    d = special['delim']
    e = special['extract']
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
            out.append(
                encode_example(ex['texts'], task, tokenizer.encode_ordinary, special, block_size))
        except TokenizerError as err:
            raise UserError(f"{path} line {ex['line']}: {err}") from None
    return out


def make_batch(seqs_list, labels, special, device):
    """
    Right-padded rows for a list of examples (each a list of sequences), as tensors:
    idx (R, T) tokens; extract_pos (R,) where each row's Extract token sits; lm_targets (R, T) the
    next text token at every position (-1 where there is none: padding, and positions whose next
    token is a special token, so L1 is language modelling of the text only); choice_mask (B, N)
    which choice slots are real (multiple choice); labels (B,) or None. Causal attention means a
    row's Extract position never sees the padding after it, so no attention mask is needed.
    """
    rows = [seq for seqs in seqs_list for seq in seqs]
    T = max(len(r) for r in rows)
    idx = torch.zeros(len(rows), T, dtype=torch.long)
    targets = torch.full((len(rows), T), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        t = torch.tensor(r, dtype=torch.long)
        idx[i, :len(r)] = t
        targets[i, :len(r) - 1] = t[1:]
    # the special tokens (appended last) are never LM targets
    targets[targets >= special['start']] = -1
    extract_pos = torch.tensor([len(r) - 1 for r in rows], dtype=torch.long)
    n_max = max(len(seqs) for seqs in seqs_list)
    choice_mask = torch.tensor([[j < len(seqs) for j in range(n_max)] for seqs in seqs_list],
                               dtype=torch.bool)
    batch = {
        'idx': idx,
        'extract_pos': extract_pos,
        'lm_targets': targets,
        'choice_mask': choice_mask,
        'labels': None if labels is None else torch.tensor(labels, dtype=torch.long)
    }
    batch = {k: (v.to(device) if v is not None else None) for k, v in batch.items()}
    # counted before the copy: no device sync later
    batch['n_lm_targets'] = int((targets != -1).sum())
    return batch


@dataclass
class TaskData:
    """
    The encoded training (and optional validation) examples of a fine-tune, with their class ids.
    """
    # {raw label: class id}; None for multiple choice (the label is the choice's index)
    label_map: dict
    train_encoded: list
    train_labels: list
    # each training example's number of LM targets (n_lm_targets), counted once
    train_lm_targets: list = None
    val_encoded: list = None  # None without a val file
    val_labels: list = None

    @property
    def n_classes(self):
        return len(self.label_map) if self.label_map else None


def n_lm_targets(seqs, special):
    """
    make_batch's n_lm_targets of one example: each row's next tokens that are text, not special
    tokens.
    """
    return sum(t < special['start'] for seq in seqs for t in seq[1:])


def load_task_data(task, train_file, val_file, tokenizer, special, block_size, label_map=None):
    """
    Read, check and encode the train (and val, if given) files. The training labels define the
    classes unless label_map is given (a resumed fine-tune keeps the classes it started with).
    """
    train_examples = read_jsonl(train_file, task)
    if label_map is None and task != 'multiple_choice':
        label_map = build_label_map(train_examples, train_file)
    train_labels = label_ids(train_examples, task, label_map, train_file)
    data = TaskData(
        label_map, encode_examples(train_examples, task, tokenizer, special, block_size,
                                   train_file), train_labels)
    data.train_lm_targets = [n_lm_targets(e, special) for e in data.train_encoded]
    if val_file:
        val_examples = read_jsonl(val_file, task)
        data.val_labels = label_ids(val_examples, task, label_map, val_file)
        data.val_encoded = encode_examples(val_examples, task, tokenizer, special, block_size,
                                           val_file)
    return data


# -----------------------------------------------------------------------------
# the epochs: the optimizer steps and their learning rates, and each rank's share of every step's
# examples. Every epoch is one seeded permutation (a DistributedSampler's: the same on every rank
# and for every world size); rank r takes positions r, r+W, ... of it, so the micro-batches of all
# ranks in one optimizer step together hold exactly the examples a single process would take for
# that step.

@dataclass
class Schedule:
    """
    The optimizer steps of a fine-tune and their learning rates (warmup, then cosine decay to
    min_lr).
    """
    batch_size: int  # examples per micro-batch on this rank
    accum: int  # micro-batches per optimizer step on this rank
    steps_per_epoch: int
    total_steps: int
    warmup_iters: int
    lr_decay_iters: int
    learning_rate: float
    min_lr: float
    decay_lr: bool

    @classmethod
    def for_run(cls, n_examples, recipe, accum):
        """ recipe's schedule (a Recipe) for n_examples per rank and epoch (a sampler's share). """
        steps_per_epoch = math.ceil(n_examples / (recipe.batch_size * accum))
        total_steps = recipe.epochs * steps_per_epoch
        warmup_iters = int(recipe.warmup_frac * total_steps)
        # decay over all steps, so the last one runs at min_lr (and never a decay phase of length 0)
        lr_decay_iters = max(total_steps - 1, warmup_iters + 1)
        return cls(batch_size=recipe.batch_size, accum=accum, steps_per_epoch=steps_per_epoch,
                   total_steps=total_steps, warmup_iters=warmup_iters,
                   lr_decay_iters=lr_decay_iters, learning_rate=recipe.learning_rate,
                   min_lr=recipe.min_lr, decay_lr=recipe.decay_lr)

    @property
    def per_step(self):
        return self.batch_size * self.accum  # examples per optimizer step on this rank

    @property
    def rates(self):
        """
        The learning rate at each step: train.py's warmup and cosine, over this fine-tune's steps.
        """
        return LRSchedule(learning_rate=self.learning_rate, warmup_iters=self.warmup_iters,
                          lr_decay_iters=self.lr_decay_iters, min_lr=self.min_lr,
                          decay_lr=self.decay_lr)


def step_batches(data, special, schedule, step_in_epoch, order, device):
    """
    This rank's micro-batches of a step: its next batch_size x accum examples of order, as
    make_batch's.
    """
    bs = schedule.batch_size
    start = step_in_epoch * schedule.per_step
    micro = [order[start + m * bs: start + (m + 1) * bs] for m in range(schedule.accum)]
    # every rank must run the same number of forward/backward passes (DDP); the sampler pads every
    # rank to the same length, so the number of non-empty micro-batches agrees
    return [
        make_batch([data.train_encoded[i] for i in m], [data.train_labels[i]
                                                        for i in m], special, device) for m in micro
        if m
    ]


def global_batch_counts(data, sampler, schedule, step_in_epoch):
    """
    (examples, LM targets) of a step's global batch, all ranks together, as floats: what an
    all-reduce of every rank's counts would give, without one (a collective, and the .tolist() after
    it, would wait for the GPU every step). Every rank knows every rank's share of the step from the
    sampler.
    """
    bs = schedule.batch_size
    start = step_in_epoch * schedule.per_step
    n_ex = n_tok = 0
    for order in epoch_orders(len(sampler.dataset), sampler.num_replicas, sampler.shuffle,
                              sampler.seed, sampler.drop_last, sampler.epoch):
        # the examples step_batches takes on that rank
        for i in order[start: start + schedule.accum * bs]:
            n_ex += 1  # one label per example, whatever its number of rows
            n_tok += data.train_lm_targets[i]
    return float(n_ex), float(n_tok)


@functools.lru_cache(maxsize=1)
def epoch_orders(n_examples, world_size, shuffle, seed, drop_last, epoch):
    """
    Every rank's DistributedSampler order of one epoch, computed here on any rank: the same seed and
    epoch give the same permutation everywhere (cached: the steps of an epoch all ask for the same
    one).
    """
    orders = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(n_examples),
                                     num_replicas=world_size,
                                     rank=rank,
                                     shuffle=shuffle,
                                     seed=seed,
                                     drop_last=drop_last)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return tuple(orders)


# -----------------------------------------------------------------------------
# the model: a GPT plus GPT-1's linear head W_y on the Extract position

class TaskHead(nn.Module):
    """
    GPT-1's W_y: dropout, then a linear map of the Extract hidden state to n_out scores. Multiple
    choice has no bias: a softmax over the choices' scores can't see a shared offset, so its
    gradient would be pure rounding noise (which Adam would turn into a random walk).
    """

    def __init__(self, n_embd, n_out, dropout=0.0, bias=True):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.linear = nn.Linear(n_embd, n_out, bias=bias)
        # like every other Linear of the GPT
        torch.nn.init.normal_(self.linear.weight, mean=0.0, std=0.02)
        if bias:
            torch.nn.init.zeros_(self.linear.bias)

    def forward(self, h):
        return self.linear(self.dropout(h))


def head_outputs(task, n_classes):
    """
    The head's output width: one scalar per choice for multiple choice, else one score per class.
    """
    return 1 if task == 'multiple_choice' else n_classes


class FinetuneModel(nn.Module):
    """
    The GPT and its task head as one module (one DDP wrapper, one optimizer). forward returns the
    task logits (B, n_classes or n_choices) and the summed next-token loss over the batch's LM
    targets.
    """

    def __init__(self, gpt, head, task):
        super().__init__()
        self.gpt = gpt
        self.head = head
        self.task = task

    def forward(self, idx, extract_pos, choice_mask, lm_targets=None):
        h = self.gpt.hidden_states(idx)  # (R, T, C)
        # (R, C): the Extract positions
        feats = h[torch.arange(h.size(0), device=h.device), extract_pos]
        if self.task == 'similarity':
            # rows come in pairs (a $ b, b $ a) per example; their sum is symmetric in the two texts
            logits = self.head(feats.view(-1, 2, feats.size(-1)).sum(1))
        elif self.task == 'multiple_choice':
            scores = self.head(feats).squeeze(-1).float()  # (R,): one scalar per (example, choice)
            # lay the scores out as (B, N) with -inf for missing choices, so the softmax ignores
            # them
            logits = scores.new_full(choice_mask.shape,
                                     float('-inf')).masked_scatter(choice_mask, scores)
        else:
            logits = self.head(feats)
        lm_loss_sum = None
        if lm_targets is not None:
            lm_logits = self.gpt.head(h)
            lm_loss_sum = F.cross_entropy(lm_logits.view(-1, lm_logits.size(-1)).float(),
                                          lm_targets.view(-1),
                                          ignore_index=-1,
                                          reduction='sum')
        return logits.float(), lm_loss_sum


def add_special_tokens(gpt, source_ckpt):
    """
    Start, Delim and Extract as three new rows of the (tied) embedding table, initialised like the
    others; a model fine-tuned before already has them. They come after all of the model's rows, the
    ones past its tokenizer's vocabulary too (vocab_size padded to a multiple of 64: GPT-2's 50304,
    a bpe model's), so no text token has their ids and make_batch can tell them apart as ids >=
    Start.
    """
    if source_ckpt is not None and source_ckpt.get('special_tokens'):
        return dict(source_ckpt['special_tokens'])
    v = gpt.config.vocab_size
    gpt.resize_token_embeddings(v + 3)
    return {'start': v, 'delim': v + 1, 'extract': v + 2}


def start(files, source, chosen, resume_file, epochs=None):
    """
    finetune.py's checks of what each rank reads, before any work (run by every rank, one verdict):
    the files (TaskFiles) are there, and the model's architecture is its source's
    (init_from.source_settings, train.py's rules; block_size 0 = the model's own; chosen: the
    architecture settings the user gave, {name: value}; epochs: a training run's, whose resume of a
    complete fine-tune is refused). Returns source_settings's (the settings the source imposes, the
    checkpoint resumed or None).
    """
    for setting in ('train_file', 'val_file', 'predict_file'):
        path = getattr(files, setting)
        if path and not os.path.isfile(path):
            raise UserError(f"--{setting}={path}: there is no file at that path on this machine; "
                            f"check the path (every node of a run must see it)")
    return init_from.source_settings(source, chosen, keep_zero=('block_size',),
                                     resume_file=resume_file, epochs=epochs)


def task_model_and_data(gpt, tokenizer_meta, source, task, spec, files):
    """
    finetune.py's model and data from the source GPT (spec: a TaskModelSpec): cropped to its
    block_size (a pretrained model may train on shorter windows; a resumed one has its own, see
    checkpoint_architecture), the special tokens added, the task files (TaskFiles) encoded with the
    model's tokenizer (the training labels define the classes, a resumed fine-tune keeps its own)
    and the head (the resumed one's: source is its checkpoint). Returns (FinetuneModel on the CPU,
    special, tokenizer, TaskData).
    """
    resume = spec.init_from == 'resume'
    fit_block_size(gpt, spec.block_size)
    if gpt.config.block_size < 5:
        raise UserError(
            f"block_size {gpt.config.block_size} is too small for the special tokens; use 16 or more"
        )
    tokenizer = load_tokenizer(tokenizer_meta)
    # else special tokens would share text ids
    check_tokenizer_fits(gpt.config, tokenizer_meta, spec.init_from)
    special = add_special_tokens(gpt, source)
    data = load_task_data(task, files.train_file, files.val_file, tokenizer, special,
                          gpt.config.block_size, source.get('label_map') if resume else None)
    head = TaskHead(gpt.config.n_embd, head_outputs(task, data.n_classes), spec.dropout,
                    bias=task != 'multiple_choice')
    if resume:
        head.load_state_dict(source['head'])
    gpt.set_attention(spec.attention)
    gpt.set_activation_checkpointing(spec.activation_checkpointing)
    return FinetuneModel(gpt, head, task), special, tokenizer, data


# -----------------------------------------------------------------------------
# the learning rate: GPT-1's for a model as wide as GPT-1, larger for narrower ones

GPT1_LEARNING_RATE = 6.25e-5  # GPT-1's fine-tuning rate (Radford et al. 2018, section 4.1)...
# ...for its 768-wide model; GPT-2 small is as wide, so it keeps the recipe exactly
GPT1_WIDTH = 768
WIDTH_EXPONENT = 1.5  # fitted to the best rates measured at widths 128 and 256 (docs/finetuning.md)


def scaled_learning_rate(n_embd):
    """
    The fine-tuning rate learning_rate=0 gives a model of width n_embd: 6.25e-5 x (768 / n_embd) **
    1.5, which is GPT-1's rate at GPT-1's width. Adam moves every weight by about the rate each step
    and a matrix adds n_embd such moves into each output, so a narrower model needs a larger rate
    for the same change (muP's 1 / width); from GPT-1's point, the middle of the best rates
    docs/finetuning.md measured (about 8e-4 at width 128, 3.7e-4 at 256) needs an exponent of 1.4 to
    1.6, and 1 / width (3.75e-4 at 128) under-trains the quick-start model. It gets 9.2e-4;
    gpt2-medium gets 4.1e-5 and gpt2-xl 2.1e-5 (extrapolated: nothing above 768 was measured).
    """
    return GPT1_LEARNING_RATE * (GPT1_WIDTH / n_embd) ** WIDTH_EXPONENT


def resolve_learning_rate(recipe, n_embd, resumed=None):
    """
    (the peak learning rate of the fine-tune, how it was chosen) for recipe (a Recipe, with the
    learning_rate the user gave). An explicit --learning_rate wins; 0 means the
    rate the interrupted run used (resumed: its ckpt_last.pt, whose config holds the number), else
    scaled_learning_rate of the source model's width. min_lr must not be above it (the decay would
    raise it).
    """
    if recipe.learning_rate > 0:
        lr = recipe.learning_rate
        how = "--learning_rate"
    elif resumed is not None and (resumed.get('config') or {}).get('learning_rate', 0) > 0:
        lr = resumed['config']['learning_rate']
        how = "the resumed fine-tune's"
    else:
        lr = scaled_learning_rate(n_embd)
        how = f"learning_rate=0: 6.25e-5 x (768 / n_embd {n_embd}) ** 1.5"
    if recipe.decay_lr and recipe.min_lr > lr:
        raise UserError(f"min_lr ({recipe.min_lr:g}) is above the learning rate ({lr:g}, {how}), "
                        f"so the decay would raise the rate; set --min_lr to at most that (0.0, "
                        f"the default, decays to zero)")
    return lr, how


def configure_optimizers(model, recipe, device_type):
    """
    GPT.configure_optimizers' AdamW over the GPT and the head (its weight decays, its bias does
    not), with the settings of recipe (a Recipe whose learning_rate is resolved).
    """
    optimizer = model.gpt.configure_optimizers(recipe.weight_decay, recipe.learning_rate,
                                               (recipe.beta1, recipe.beta2), device_type)
    head = model.head.linear
    optimizer.add_param_group({'params': [head.weight], 'weight_decay': recipe.weight_decay})
    if model.head.linear.bias is not None:
        optimizer.add_param_group({'params': [model.head.linear.bias], 'weight_decay': 0.0})
    return optimizer


# -----------------------------------------------------------------------------
# checkpoints: what a fine-tune saves, and the model read back from it


def finetune_checkpoint(model, iter_num, config, tokenizer, provenance, label_map, special,
                        source_model, **extra):
    """
    A fine-tune's checkpoint: a plain GPT checkpoint (build_checkpoint) of the grown GPT, so
    sample.py and the other scripts read it, plus the head, task, label map, special tokens and
    source model, then extra.
    """
    # 'best_val_loss' is train.py's key, kept for generic tools; a fine-tune is judged by val_acc
    # instead
    return build_checkpoint(model.gpt, iter_num, 1e9, config, tokenizer, provenance,
                            head=model.head.state_dict(), task=model.task, label_map=label_map,
                            special_tokens=special, source_model=source_model, **extra)


def model_from_finetune_checkpoint(ckpt, dropout=0.0):
    """ The FinetuneModel (GPT + head) saved in a finetune.py checkpoint, on the CPU. """
    if not ckpt.get('task') or 'head' not in ckpt:
        raise UserError(
            "this checkpoint has no fine-tuned task head; fine-tune it first (python finetune.py "
            "--train_file=...)")
    gpt = model_from_checkpoint(ckpt, dropout=dropout)
    head = TaskHead(gpt.config.n_embd, ckpt['head']['linear.weight'].size(0), dropout, 'linear.bias'
                    in ckpt['head'])
    head.load_state_dict(ckpt['head'])
    return FinetuneModel(gpt, head, ckpt['task'])


# -----------------------------------------------------------------------------
# evaluation and prediction

# num_threads=0: the thread count of the forward-only passes (val accuracy, predictions) is
# re-checked every `interval` batches (machine.ThreadRetuner), rarely: a round costs a few batches
# on a count that may be 5x slower under load
PREDICTION_RETUNING = dict(interval=100, probe=4, window=50)

@torch.no_grad()
def evaluate(model, encoded, labels, special, batch_size, device, ctx, indices=None, num_batches=0,
             threads=None):
    """
    Accuracy pieces over examples (this rank's indices): (n_correct, n_seen, summed task loss,
    predictions as (index, class id, probabilities)). num_batches > the batches of indices adds
    forwards of one example, left out of the results, so that every rank can run the same number
    (for models whose forwards are collectives). threads: a machine.AutoThreads (num_threads=0 on
    a CPU), timed on the first batch and re-checked over the batches.
    """
    was_training = model.training
    model.eval()
    indices = list(range(len(encoded))) if indices is None else list(indices)
    correct = 0
    loss_sum = 0.0
    preds = []
    starts = range(0, len(indices), batch_size)
    if threads is not None and indices:
        first = make_batch([encoded[j] for j in indices[:batch_size]], None, special, device)

        def forward():
            with ctx:
                model(first['idx'], first['extract_pos'], first['choice_mask'])
        threads.choose(forward, flops=2 * model.gpt.get_num_params() * first['idx'].numel())
        starts = threads.over(starts)
    for i in starts:
        chunk = indices[i:i + batch_size]
        batch = make_batch([encoded[j] for j in chunk],
                           None if labels is None else [labels[j] for j in chunk], special, device)
        with ctx:
            logits, _ = model(batch['idx'], batch['extract_pos'], batch['choice_mask'])
        pred = logits.argmax(-1)
        if batch['labels'] is not None:
            correct += int((pred == batch['labels']).sum())
            loss_sum += float(F.cross_entropy(logits, batch['labels'], reduction='sum'))
        preds.extend(
            zip(chunk, pred.tolist(), _rounded_probs(logits, batch['choice_mask'], model.task)))
    padding = make_batch([encoded[0]], None, special, device) if encoded else None
    for _ in range(num_batches - math.ceil(len(indices) / batch_size)):
        with ctx:
            model(padding['idx'], padding['extract_pos'], padding['choice_mask'])
    model.train(was_training)
    return correct, len(indices), loss_sum, preds


def evaluate_val(model, data, special, batch_size, ctx, dist_info, threads=None):
    """
    (correct, seen, summed task loss) over data's validation examples, summed over the ranks, each
    of which scores a strided share with the plain model (its forwards are no collectives; still,
    every rank runs as many batches as the one with the most, so this stays safe if the model is
    ever a wrapped one).
    """
    n_val = len(data.val_encoded)
    world = dist_info.world_size
    # of the rank with the most examples
    most_batches = math.ceil(math.ceil(n_val / world) / batch_size)
    correct, seen, loss_sum, _ = evaluate(model, data.val_encoded, data.val_labels, special,
                                          batch_size, dist_info.device, ctx,
                                          range(dist_info.rank, n_val, world),
                                          num_batches=most_batches, threads=threads)
    return tuple(all_reduce_sum([correct, seen, loss_sum], dist_info))


def _rounded_probs(logits, choice_mask, task):
    """
    Each example's class (or choice) probabilities, rounded for the JSON output; real choices only.
    """
    probs = logits.softmax(-1).tolist()
    if task == 'multiple_choice':
        probs = [[p for p, real in zip(row, mask) if real]
                 for row, mask in zip(probs, choice_mask.tolist())]
    return [[round(p, 6) for p in row] for row in probs]


def write_predictions(model, ckpt_info, special, tokenizer, device, ctx, path, out_path,
                      batch_size, threads=None):
    """
    Predictions of model for every example of path, one JSON line each (the input plus prediction),
    computed batch_size examples at a time (threads: evaluate's).
    """
    task = ckpt_info['task']
    examples = read_jsonl(path, task, labeled=False)
    encoded = encode_examples(examples, task, tokenizer, special, model.gpt.config.block_size, path)
    _, _, _, preds = evaluate(model, encoded, None, special, batch_size, device, ctx,
                              threads=threads)
    id_to_label = {i: label for label, i in (ckpt_info['label_map'] or {}).items()}
    lines = []
    for (j, p, probs) in preds:
        out = dict(examples[j]['record'])
        out['prediction'] = p if task == 'multiple_choice' else id_to_label.get(p, p)
        out['probs'] = probs
        lines.append(json.dumps(out))
    text = "\n".join(lines) + "\n"
    # never a half-written predictions file
    atomic_write(out_path, lambda f: f.write(text), binary=False)
    print(f"wrote {len(lines)} predictions to {out_path}")


def predict_with_checkpoint(spec, dist_info):
    """
    finetune.py --predict_file without --train_file (spec: a PredictSpec): predictions of the
    fine-tuned checkpoint init_from names (its out_dir or ckpt.pt), written by rank 0 to predict_out
    (else predictions.jsonl beside the checkpoint). Under torchrun rank 0 alone reads the checkpoint
    and predicts; the others wait for its verdict, so all end together, with its exit code.
    """
    master_decides(dist_info, lambda: _predict(spec, dist_info))


def _predict(spec, dist_info):
    path = checkpoint_path(spec.init_from, spec.out_dir)
    if path is None:
        raise UserError(
            f"--predict_file without --train_file needs --init_from to be a fine-tuned out_dir or "
            f"ckpt.pt; {spec.init_from} is not one")
    out_path = predictions_path(spec.predict_out, os.path.dirname(path))
    check_output(out_path, 'predict_out', spec.overwrite,
                 inputs={'predict_file': spec.predict_file}, output_kind='predictions')
    ckpt = load_checkpoint(path)
    model = model_from_finetune_checkpoint(ckpt)
    # what predicting reads
    require_entries(ckpt, path, ('tokenizer', 'special_tokens', 'label_map'))
    if spec.task and spec.task != ckpt['task']:
        raise UserError(f"--task={spec.task} but {path} was fine-tuned for {ckpt['task']}; "
                        f"drop --task")
    model.to(dist_info.device)
    model.eval()
    set_weights(model.gpt, spec.weights)  # the task head stays float32: it is one small matrix
    _, ctx = precision(dist_info.device, spec.dtype)
    threads = auto_threads(dist_info.device, spec.num_threads, 'prediction batch',
                           **PREDICTION_RETUNING)
    write_predictions(model, ckpt, ckpt['special_tokens'], load_tokenizer(ckpt['tokenizer']),
                      device=dist_info.device, ctx=ctx, path=spec.predict_file, out_path=out_path,
                      batch_size=spec.eval_batch_size or spec.batch_size, threads=threads)


def predictions_path(predict_out, directory):
    """ Where finetune.py writes predictions: predict_out, else directory/predictions.jsonl. """
    return predict_out or os.path.join(directory, 'predictions.jsonl')
