"""
Zero-shot evaluation scoring: loss / perplexity / bits per byte over a token file, HellaSwag and
LAMBADA. eval.py is the command line for it; anything else that scores a model on a task (a training
loop's periodic HellaSwag, say) calls the same functions, so there is one implementation of each
metric. This package is the evaluation room: these tasks here, DCLM's CORE score in evaluation/core.py
(eval.py --task=core), and train.py's in-loop HellaSwag and samples in evaluation/periodic.py.

Every task is turned into rows, a row being (tokens, n_target): the model reads tokens[:-1],
predicts tokens[1:], and only the last n_target predictions count. An example owns a few consecutive
rows (HellaSwag: one per ending; LAMBADA and the loss: one), so example k is
rows[offsets[k]:offsets[k + 1]].

Usage:
    from nanogpt_plus import evaluation
    result = evaluation.evaluate(model, 'loss', tokenizer_meta, dataset='shakespeare_char', device='cpu')
    result['metrics']       # {'loss': ..., 'perplexity': ..., 'tokens': ..., 'bits_per_byte': ..., 'bytes': ...}

    # tokenize once, score as often as needed (under torchrun, pass dist_info to split the examples)
    path = evaluation.task_data_file('hellaswag')     # downloaded once, into data/hellaswag/
    examples, n = evaluation.task_examples('hellaswag', path, tokenizer, model.config.block_size)
    evaluation.score_hellaswag(model, examples, batch_size=16, device='cuda', ctx=ctx, dist_info=dist_info)
    # -> {'correct': ..., 'correct_norm': ..., 'total': n}; evaluate_hellaswag gives the fractions
"""

import math
import os
import urllib.request
from contextlib import nullcontext

import numpy as np
import torch
from torch.nn import functional as F

from nanogpt_plus.dataloader import check_token_ids, open_token_file
from nanogpt_plus.dataset import REPO_DIR, read_dataset_meta, split_files
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import atomic_write, read_jsonl, read_response
from nanogpt_plus.progress import Progress
from nanogpt_plus.tokenizer import load_tokenizer, token_byte_lengths

TASKS = ('loss', 'hellaswag', 'lambada')
# the fields each JSONL task's records must have
TASK_KEYS = {'hellaswag': ('ctx', 'endings', 'label'), 'lambada': ('text',)}
# the files the public harnesses use: HellaSwag's validation split and OpenAI's LAMBADA test set
# (GPT-2 paper)
DATA_URLS = {
    'hellaswag':
    'https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl',
    'lambada': 'https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl',
}
DOWNLOAD_TIMEOUT_S = 10
# a whole download's limit (DOWNLOAD_TIMEOUT_S bounds each read): a trickling server is given up on
DOWNLOAD_DEADLINE_S = 900
# where the in-loop HellaSwag (train.py's hellaswag_file, whose default it is) and eval.py keep the
# download, relative to the repository
HELLASWAG_FILE = 'data/hellaswag/hellaswag_val.jsonl'


# -----------------------------------------------------------------------------
# scoring rows, batched and split across ranks

def make_row(context, target, block_size):
    """ The row scoring target after context, cropped from the left to fit block_size. """
    tokens = list(context) + list(target)
    tokens = tokens[-(block_size + 1):]  # the inputs, tokens[:-1], are then at most block_size long
    return tokens, min(len(target), len(tokens) - 1)


@torch.no_grad()
def score_rows(model, rows, indices, batch_size, device, ctx=nullcontext(), pad_to=None,
               progress=False):
    """
    Score rows[i] for i in indices, batch_size rows per forward pass. Rows are right-padded, and
    padding and context positions get target -1: they are not counted, and (attention being causal)
    padding after a row cannot change the logits of the row itself. pad_to fixes the padded length
    (one shape for torch.compile). Returns a float64 (len(indices), 3) tensor, per row: the sum of
    its per-token losses in nats, the number of scored tokens, and 1.0 if every scored token is the
    model's argmax prediction (else 0.0).
    """
    out = torch.zeros(len(indices), 3, dtype=torch.float64)
    starts = range(0, len(indices), batch_size)
    if progress:
        from tqdm import tqdm
        starts = tqdm(starts, desc='eval', unit='batch')
    for start in starts:
        batch = [rows[i] for i in indices[start:start + batch_size]]
        T = pad_to or max(len(tokens) for tokens, _ in batch) - 1
        idx = torch.zeros(len(batch), T, dtype=torch.long)
        targets = torch.full((len(batch), T), -1, dtype=torch.long)
        for b, (tokens, n_target) in enumerate(batch):
            # a list, or a slice of a token file's memmap
            tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
            n = len(tokens) - 1  # the row's input length
            idx[b, :n] = tokens[:-1]
            targets[b, n - n_target:n] = tokens[n + 1 - n_target:]
        idx = idx.to(device)
        targets = targets.to(device)
        # logits at every position; the per-token losses are taken below rather than by the model
        with ctx:
            logits, _ = model(idx, all_positions=True)  # (B, T, vocab_size)
        logits = logits.float()
        losses = F.cross_entropy(
            logits.view(-1, logits.size(-1)),
            targets.view(-1),
            ignore_index=-1,
            # (B, T), 0 where the target is -1
            reduction='none').view(targets.shape)
        scored = targets != -1
        greedy = ((logits.argmax(-1) == targets) | ~scored).all(dim=1)
        out[start:start + len(batch), 0] = losses.double().sum(dim=1).cpu()
        out[start:start + len(batch), 1] = scored.sum(dim=1).double().cpu()
        out[start:start + len(batch), 2] = greedy.double().cpu()
    return out


def score_examples(model, rows, example_offsets, batch_size, device, ctx=nullcontext(),
                   dist_info=None, pad_to=None, progress=False, poll=None, threads=None):
    """
    Score every row of every example; returns score_rows' table for all rows, (num_rows, 3). Under
    DDP (dist_info.under_torchrun) example k goes to rank k % world_size, whose rows' results are
    written into a zeroed table that is then summed across ranks: adding zeros is exact, so every
    rank ends with the table one process would have computed (up to how the rows were grouped into
    batches). poll: called after every batch on every rank (train.py's stop agreement); when it
    returns True the pass ends there and returns None. progress: True for a tqdm bar (eval.py's
    tasks); a string names the work for the project's progress lines instead (Progress, said
    before the first batch: "<progress>: 28 batches, starting", then how far it is when long).
    threads: a machine.AutoThreads (num_threads=0 on a CPU), which times the thread counts on this
    rank's first batch and follows the load over the batches.
    """
    rank, world_size = (dist_info.rank,
                        dist_info.world_size) if dist_info and dist_info.under_torchrun else (0, 1)

    def rows_of(r):
        return [i for k in range(r, len(example_offsets) - 1, world_size)
                for i in range(example_offsets[k], example_offsets[k + 1])]
    mine = rows_of(rank)
    table = torch.zeros(example_offsets[-1], 3, dtype=torch.float64)
    # every rank runs as many forwards as the busiest: a wrapped model's forwards (FSDP all-gathers
    # the weights in each) are collectives. The extra ones score a single row and are thrown away.
    batches = max(math.ceil(len(rows_of(r)) / batch_size) for r in range(world_size))
    steps = range(batches)
    if threads is not None and mine:
        first = mine[:batch_size]
        n_params = sum(p.numel() for p in model.parameters())
        tokens = len(first) * (pad_to or max(len(rows[i][0]) for i in first))
        threads.choose(lambda: score_rows(model, rows, first, batch_size, device, ctx, pad_to),
                       flops=2 * n_params * tokens)
        steps = threads.over(steps)
    if isinstance(progress, str):
        steps = Progress(batches, progress, 'batches').begin().over(steps)
    elif progress:
        from tqdm import tqdm
        steps = tqdm(steps, desc='eval', unit='batch')
    for b in steps:
        chunk = mine[b * batch_size:(b + 1) * batch_size]
        if chunk:
            table[chunk] = score_rows(model, rows, chunk, batch_size, device, ctx, pad_to)
        else:
            score_rows(model, rows, [0], 1, device, ctx, pad_to)
        if poll is not None and poll():
            return None
    if world_size > 1:
        import torch.distributed as dist
        table = table.to(dist_info.device)  # nccl reduces only tensors on the GPU
        dist.all_reduce(table, op=dist.ReduceOp.SUM)
        table = table.cpu()
    return table


# -----------------------------------------------------------------------------
# the loss over a split's token files

def loss_windows(num_tokens, block_size, stride=0):
    """
    (begin, end, n_scored) windows over a token file: inputs tokens[begin:end], targets
    tokens[begin+1:end+1], of which the last n_scored count. Every target tokens[1:] is scored
    exactly once; with a stride S < block_size each window after the first moves by S and scores
    only its last S targets, which so see at least block_size - S tokens of context (the usual
    sliding-window perplexity recipe).
    """
    stride = stride or block_size
    if not 1 <= stride <= block_size:
        raise UserError(
            f"stride must be between 1 and block_size ({block_size}), got {stride}; 0 means "
            f"non-overlapping windows")
    # targets tokens[1:scored_upto + 1] are already scored
    windows = []
    begin = 0
    scored_upto = 0
    while scored_upto < num_tokens - 1:
        end = min(begin + block_size, num_tokens - 1)
        windows.append((begin, end, end - scored_upto))
        scored_upto = end
        begin += stride
    return windows


class TokenWindows:
    """
    The rows of [(tokens, windows)] parts (a file each), sliced from the memmaps only when a batch
    needs them.
    """

    def __init__(self, parts):
        self.rows = [(tokens, window) for tokens, windows in parts for window in windows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        tokens, (begin, end, n_scored) = self.rows[i]
        return tokens[begin:end + 1], n_scored


def loss_metrics(table, num_bytes):
    """
    Mean loss and perplexity per token of score_rows' table; bits per byte when num_bytes is known.
    """
    nll = table[:, 0].sum().item()
    count = table[:, 1].sum().item()
    metrics = {'loss': nll / count, 'perplexity': math.exp(nll / count), 'tokens': int(count)}
    if num_bytes is not None:
        metrics['bits_per_byte'] = nll / math.log(2) / num_bytes
        metrics['bytes'] = int(num_bytes)
    return metrics


def evaluate_loss(model, parts, tokenizer, batch_size, device, ctx=nullcontext(), dist_info=None,
                  pad_to=None, progress=False, threads=None, poll=None):
    """
    The loss metrics of model over [(tokens, windows)] parts: a token array or memmap per file (a
    split's shards: no window spans two) and loss_windows' windows over it. tokenizer is the one the
    tokens were made with: it says how many bytes of text they are, for bits per byte. poll:
    score_examples', a stop agreement that raises (eval.py's) rather than returns True.
    """
    rows = TokenWindows(parts)
    table = score_examples(model, rows, list(range(len(rows) + 1)), batch_size, device, ctx,
                           dist_info, pad_to, progress, poll, threads=threads)
    return loss_metrics(table, scored_bytes(parts, token_byte_lengths(tokenizer)))


def scored_bytes(parts, lengths):
    """
    The UTF-8 bytes of every target some window scored; None when a file holds an id the tokenizer
    lacks.
    """
    total = 0
    for tokens, windows in parts:
        scored = np.asarray(tokens[1:windows[-1][1] + 1], dtype=np.int64)
        if scored.max() >= len(lengths):
            return None
        total += int(lengths[scored].sum())
    return total


# -----------------------------------------------------------------------------
# multiple choice (HellaSwag) and last word (LAMBADA) JSONL tasks

def read_task_records(task, path):
    """
    [(line number, record)] of a JSONL task file; a malformed line is an error that names it.
    """
    return read_jsonl(path, TASK_KEYS[task], "pass --data_file=PATH to an existing JSONL file")


def hellaswag_examples(records, tokenizer, block_size, path='data'):
    """
    One row per ending: the context's tokens, then the tokens of ' ' + ending (the way the standard
    harnesses tokenize it), only the ending scored. path names the file in errors. Returns (rows,
    offsets, labels).
    """
    rows = []
    offsets = [0]
    labels = []
    for lineno, rec in records:
        ctx = rec['ctx']
        endings = rec['endings']
        label = rec['label']
        if isinstance(label, str) and label.strip().isdigit():
            label = int(label)  # the Hugging Face copy of HellaSwag stores labels as strings
        ok = (isinstance(ctx, str) and ctx and isinstance(endings, list) and len(endings) >= 2 and
              all(isinstance(e, str) and e for e in endings) and isinstance(label, int) and
              not isinstance(label, bool) and 0 <= label < len(endings))
        if not ok:
            raise UserError(
                f"{path} line {lineno}: expected a non-empty 'ctx' string, a list of at least 2 "
                f"non-empty 'endings' and an integer 'label' indexing them; fix that line")
        context = tokenizer.encode_ordinary(ctx)
        for ending in endings:
            rows.append(make_row(context, tokenizer.encode_ordinary(' ' + ending), block_size))
        offsets.append(len(rows))
        labels.append(label)
    return rows, offsets, labels


def hellaswag_counts(table, offsets, labels):
    """ {'correct', 'correct_norm', 'total'}: the examples whose label's ending has the lowest total loss
    (correct), the lowest mean loss per token (correct_norm), and how many examples there are. """
    correct = correct_norm = 0
    for k, label in enumerate(labels):
        choices = table[offsets[k]:offsets[k + 1]]
        total = choices[:, 0]
        mean = choices[:, 0] / choices[:, 1]
        correct += int(total.argmin().item() == label)
        correct_norm += int(mean.argmin().item() == label)
    return {'correct': correct, 'correct_norm': correct_norm, 'total': len(labels)}


def hellaswag_metrics(counts):
    """ acc and acc_norm, the fractions of hellaswag_counts' counts. """
    return {
        'acc': counts['correct'] / counts['total'],
        'acc_norm': counts['correct_norm'] / counts['total']
    }


def score_hellaswag(model, examples, batch_size, device, ctx=nullcontext(), dist_info=None,
                    pad_to=None, progress=False, poll=None, threads=None):
    """
    hellaswag_counts of model on examples, hellaswag_examples' (rows, offsets, labels), the same on
    every rank (score_examples splits the examples across them). The one scoring of HellaSwag:
    eval.py's (through evaluate_hellaswag) and train.py's in-loop figure both come from here. None
    when poll stopped the pass.
    """
    rows, offsets, labels = examples
    table = score_examples(model, rows, offsets, batch_size, device, ctx, dist_info, pad_to,
                           progress, poll, threads)
    return None if table is None else hellaswag_counts(table, offsets, labels)


def evaluate_hellaswag(model, examples, batch_size, device, ctx=nullcontext(), dist_info=None,
                       pad_to=None, progress=False, threads=None, poll=None):
    """ {'acc', 'acc_norm'} of model on examples, hellaswag_examples' (rows, offsets, labels). """
    return hellaswag_metrics(score_hellaswag(model, examples, batch_size, device, ctx, dist_info,
                                             pad_to, progress, poll, threads=threads))


def lambada_examples(records, tokenizer, block_size, path='data'):
    """ One row per passage: the text up to its last space, then the tokens of ' ' + last word (scored).
    Returns (rows, offsets). """
    rows = []
    for lineno, rec in records:
        text = rec['text']
        context, _, word = text.rpartition(' ') if isinstance(text, str) else ('', '', '')
        if not context or not word:
            raise UserError(
                f"{path} line {lineno}: 'text' must be a string with some context, a space and a "
                f"last word; fix that line")
        rows.append(
            make_row(tokenizer.encode_ordinary(context), tokenizer.encode_ordinary(' ' + word),
                     block_size))
    return rows, list(range(len(rows) + 1))


def lambada_metrics(table):
    """ acc: the whole last word is the greedy continuation; ppl: the perplexity per last word (as in the GPT-2
    paper and lm-evaluation-harness, not per token). """
    return {'acc': table[:, 2].mean().item(), 'ppl': math.exp(table[:, 0].mean().item())}


def evaluate_lambada(model, examples, batch_size, device, ctx=nullcontext(), dist_info=None,
                     pad_to=None, progress=False, threads=None, poll=None):
    """ {'acc', 'ppl'} of model on examples, lambada_examples' (rows, offsets). """
    rows, offsets = examples
    return lambada_metrics(score_examples(model, rows, offsets, batch_size, device, ctx, dist_info,
                                          pad_to, progress, poll, threads=threads))


# -----------------------------------------------------------------------------
# a task end to end: find its data, build its examples, score them

def public_task_file(task):
    """
    Where the task's public file is kept once downloaded: data/<task>/<its name> in this repo.
    """
    return os.path.join(REPO_DIR, 'data', task, os.path.basename(DATA_URLS[task]))


def download(url, target, instead, timeout=DOWNLOAD_TIMEOUT_S):
    """
    The bytes at url (said as going to target), within DOWNLOAD_DEADLINE_S in all; when they can't
    be had, one line ending in instead: what to do offline.
    """
    print(f"downloading {url} to {target}")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return read_response(response, DOWNLOAD_DEADLINE_S)
    except Exception as e:  # URLError, timeouts, HTTP errors: all mean "get the file another way"
        raise UserError(f"could not download {url} ({type(e).__name__}: {e}); {instead}") from None


def task_data_file(task, data_file='', setting='data_file'):
    """
    data_file when given, else the task's public file: data/<task>/<name> in this repo, downloaded
    once. It lives here rather than in eval.py so that every caller of a JSONL task shares one
    cached copy. setting is the option the caller's user passes a file with (named in the errors).
    """
    if data_file:
        if not os.path.exists(data_file):
            raise UserError(
                f"no data file at {data_file}; pass --{setting}=PATH to an existing file")
        return data_file
    url = DATA_URLS[task]
    path = public_task_file(task)
    if os.path.exists(path):
        return path
    content = download(url, path, f"download it elsewhere and pass --{setting}=PATH")
    atomic_write(path, lambda f: f.write(content))  # never a half-downloaded file that looks cached
    return path


def task_examples(task, path, tokenizer, block_size, max_examples=0):
    """
    (examples, their number) of a JSONL task file, tokenized once: hellaswag_examples' or
    lambada_examples'. max_examples > 0 keeps the first ones only. eval.py and train.py's in-loop
    HellaSwag both build them here.
    """
    records = read_task_records(task, path)
    if max_examples:
        records = records[:max_examples]
    build = hellaswag_examples if task == 'hellaswag' else lambada_examples
    return build(records, tokenizer, block_size, path), len(records)


def loss_files(data_file, dataset, split):
    """
    The token files the loss is measured on: data_file (a token file or a directory), else the
    dataset's split.
    """
    if data_file:
        return split_files(data_file, split) if os.path.isdir(data_file) else [data_file]
    if not dataset:
        raise UserError(
            "no dataset to evaluate the loss on: pass --dataset=NAME or --data_file=PATH/val.bin")
    return split_files(dataset, split)


def loss_parts(paths, dataset, vocab_size, block_size, stride=0, max_examples=0):
    """
    [(tokens as a memmap, loss_windows over them)] per file; max_examples > 0 keeps the first
    windows only.
    """
    parts = []
    left = max_examples
    for path in paths:
        if max_examples and left <= 0:
            break  # the files after the last window kept are not even opened
        tokens = open_token_file(path, dataset or None)
        if len(tokens) < 2:
            raise UserError(f"{path} has fewer than 2 tokens; nothing to score")
        # else an embedding lookup fails deep in the model
        check_token_ids(tokens, vocab_size, path)
        windows = loss_windows(len(tokens), block_size, stride)
        if max_examples:
            windows = windows[:left]
            left -= len(windows)
        if windows:
            parts.append((tokens, windows))
    return parts


def loss_task(model, tokenizer_meta, paths, dataset, stride, batch_size, max_examples, run):
    """
    evaluate()'s loss task over token files paths: (metrics, number of windows, the data_file to
    report).
    """
    parts = loss_parts(paths, dataset, model.config.vocab_size, model.config.block_size, stride,
                       max_examples)
    # the tokenizer the files were made with (their dataset's meta, else the model's) counts their
    # bytes
    meta = read_dataset_meta(os.path.dirname(os.path.abspath(paths[0]))) or tokenizer_meta
    metrics = evaluate_loss(model, parts, load_tokenizer(meta), batch_size, **run)
    # several shards: their directory
    path = paths[0] if len(paths) == 1 else os.path.dirname(paths[0])
    return metrics, sum(len(windows) for _, windows in parts), path


def evaluate(model, task, tokenizer_meta, data_file='', dataset='', split='val', stride=0,
             batch_size=16, max_examples=0, device='cpu', ctx=nullcontext(), dist_info=None,
             pad_to=None, progress=False, threads=None, poll=None):
    """
    Run one task (see TASKS) on model, whose tokenizer tokenizer_meta describes. data_file is the
    token file (loss: or a directory of shards) or the JSONL file; '' means the dataset's
    <split>.bin or <split> shards for the loss, and the public file otherwise.
    stride is loss_windows'. max_examples > 0 keeps the first examples (loss: windows) only.
    threads: score_examples'; poll: its stop agreement, here one that raises (eval.py's: every
    rank stops at the same batch).
    Returns {'task', 'metrics', 'num_examples', 'data_file'}.
    """
    if batch_size < 1 or max_examples < 0:
        raise UserError("batch_size must be at least 1 and max_examples at least 0 (0 = all)")
    block_size = model.config.block_size
    run = dict(device=device, ctx=ctx, dist_info=dist_info, pad_to=pad_to, progress=progress,
               threads=threads, poll=poll)
    if task == 'loss':
        metrics, num_examples, path = loss_task(model, tokenizer_meta,
                                                loss_files(data_file, dataset, split), dataset,
                                                stride, batch_size, max_examples, run)
    elif task in TASK_KEYS:
        path = task_data_file(task, data_file)
        examples, num_examples = task_examples(task, path, load_tokenizer(tokenizer_meta),
                                               block_size, max_examples)
        score = evaluate_hellaswag if task == 'hellaswag' else evaluate_lambada
        metrics = score(model, examples, batch_size, **run)
    else:
        raise UserError(f"unknown task '{task}'; use one of: {', '.join(TASKS)}")
    return {'task': task, 'metrics': metrics, 'num_examples': num_examples, 'data_file': path}
