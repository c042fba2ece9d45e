"""
Zero-shot evaluation, GPT-2's thesis: a plain language model scored on tasks it was never trained for.

Tasks:
  loss       exact mean loss / perplexity over a whole token file (val.bin of the dataset by default), in
             non-overlapping block_size windows or a sliding window (--stride); plus bits per byte
  hellaswag  completion multiple choice (JSONL with ctx, endings, label): acc (lowest total loss of the
             ending) and acc_norm (lowest mean loss per ending token)
  lambada    last-word prediction (JSONL with text): acc (the whole last word is the greedy continuation)
             and ppl (perplexity of the last word)

Usage:
    python eval.py --init_from=resume --out_dir=out-shakespeare-char --task=loss
    python eval.py --init_from=gpt2 --task=hellaswag                  # downloads the validation set once
    python eval.py --init_from=gpt2 --task=lambada --data_file=lambada_test.jsonl --max_examples=500
    torchrun --standalone --nproc_per_node=8 eval.py --init_from=gpt2 --task=hellaswag

The last line printed is one line of JSON: {"task": ..., "metrics": {...}, "num_examples": ..., ...};
--output_file=PATH writes the same JSON to a file.
"""

import json
import math
import os
import urllib.request
from contextlib import nullcontext

import numpy as np
import torch
from torch.nn import functional as F

from configurator import configure
from nanogpt_plus.checkpoint import describe_source, init_model
from nanogpt_plus.dataloader import dataset_dir, open_tokens
from nanogpt_plus.files import atomic_write
from nanogpt_plus.files import read_jsonl as read_jsonl_records
from nanogpt_plus.runtime import UserError, destroy_distributed, init_distributed, precision, provenance, run_main
from nanogpt_plus.tokenizer import load_tokenizer, read_dataset_meta

DEFAULTS = dict(
    init_from='resume',  # 'resume' (ckpt.pt in out_dir), a training out_dir or ckpt.pt, gpt2*, or a local HF dir
    out_dir='out',
    task='loss',  # loss | hellaswag | lambada
    data_file='',  # the token file (loss) or JSONL (hellaswag, lambada); '' = the default for the task
    dataset='',  # loss: data/<dataset>/<split>.bin; '' = the dataset the checkpoint was trained on
    split='val',
    stride=0,  # loss: 0 = non-overlapping block_size windows; S = sliding window, every token scored once
    batch_size=16,  # sequences per forward pass (choices of several examples are batched together)
    max_examples=0,  # 0 = all; else the first N examples (loss: windows), for quick runs
    device='auto',
    dtype='auto',  # auto = bfloat16 on GPUs that support it, float32 on CPU
    compile=False,
    output_file='',  # also write the result JSON here
    seed=1337,
)
TASKS = ('loss', 'hellaswag', 'lambada')
# the files the public harnesses use: HellaSwag's validation split and OpenAI's LAMBADA test set (GPT-2 paper)
DATA_URLS = {
    'hellaswag': 'https://raw.githubusercontent.com/rowanz/hellaswag/master/data/hellaswag_val.jsonl',
    'lambada': 'https://openaipublic.blob.core.windows.net/gpt-2/data/lambada_test.jsonl',
}
DOWNLOAD_TIMEOUT_S = 10
REPO_DIR = os.path.dirname(os.path.abspath(__file__))


# -----------------------------------------------------------------------------
# scoring: a row is (tokens, n_target): the model reads tokens[:-1] and predicts tokens[1:], and only the
# last n_target predictions count. Every task is a list of examples, each a few rows.

def make_row(context, target, block_size):
    """ The row scoring target after context, cropped from the left to fit block_size. """
    tokens = list(context) + list(target)
    tokens = tokens[-(block_size + 1):]  # inputs tokens[:-1] are at most block_size long
    return tokens, min(len(target), len(tokens) - 1)


@torch.no_grad()
def score_rows(model, rows, indices, batch_size, device, ctx=nullcontext(), pad_to=None, progress=False):
    """
    Score rows[i] for i in indices, batch_size rows per forward (right-padded; padded positions and context
    positions get target -1, so they neither count nor, causal attention being causal, change the rest).
    Returns, per index: (sum of the per-token losses in nats, number of scored tokens, 1.0 if every scored
    token is the model's argmax prediction else 0.0), as a float64 tensor (len(indices), 3).
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
            tokens = torch.as_tensor(np.asarray(tokens, dtype=np.int64))
            n = len(tokens) - 1
            idx[b, :n] = tokens[:-1]
            targets[b, n - n_target:n] = tokens[n + 1 - n_target:]
        idx, targets = idx.to(device), targets.to(device)
        with ctx:  # every position's logits; the per-token losses are computed below, not by the model
            logits, _ = model(idx, all_positions=True)
        logits = logits.float()
        losses = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1,
                                 reduction='none').view(targets.shape)  # 0 where the target is -1
        scored = targets != -1
        greedy = ((logits.argmax(-1) == targets) | ~scored).all(dim=1)
        out[start:start + len(batch), 0] = losses.double().sum(dim=1).cpu()
        out[start:start + len(batch), 1] = scored.sum(dim=1).double().cpu()
        out[start:start + len(batch), 2] = greedy.double().cpu()
    return out


def score_examples(model, rows, example_offsets, batch_size, device, ctx=nullcontext(), dist_info=None,
                   pad_to=None, progress=False):
    """
    Score every row of every example. Example k owns rows example_offsets[k]:example_offsets[k+1]; under
    DDP example k goes to rank k % world_size, and each rank writes its rows' results into a zeroed table
    that is then summed across ranks: adding zeros is exact, so every rank ends with exactly the table one
    process would have computed (up to how batches are composed). Returns the (num_rows, 3) table.
    """
    rank, world_size = (dist_info.rank, dist_info.world_size) if dist_info and dist_info.ddp else (0, 1)
    mine = [i for k in range(rank, len(example_offsets) - 1, world_size)
            for i in range(example_offsets[k], example_offsets[k + 1])]
    table = torch.zeros(example_offsets[-1], 3, dtype=torch.float64)
    table[mine] = score_rows(model, rows, mine, batch_size, device, ctx, pad_to, progress)
    if world_size > 1:
        import torch.distributed as dist
        table = table.to(dist_info.device)
        dist.all_reduce(table, op=dist.ReduceOp.SUM)
        table = table.cpu()
    return table


# -----------------------------------------------------------------------------
# the loss over a token file

def loss_windows(num_tokens, block_size, stride=0):
    """
    (begin, end, n_scored) windows over a token file: inputs tokens[begin:end], targets tokens[begin+1:end+1],
    of which the last n_scored count. Every target tokens[1:] is scored exactly once; with a stride S <
    block_size each window after the first moves by S and scores only its last S targets, which so see at
    least block_size - S tokens of context (the usual sliding-window perplexity recipe).
    """
    stride = stride or block_size
    if not 1 <= stride <= block_size:
        raise UserError(f"stride must be between 1 and block_size ({block_size}), got {stride}; 0 means "
                        f"non-overlapping windows")
    windows, begin, scored_upto = [], 0, 0  # targets tokens[1:scored_upto + 1] are already scored
    while scored_upto < num_tokens - 1:
        end = min(begin + block_size, num_tokens - 1)
        windows.append((begin, end, end - scored_upto))
        scored_upto = end
        begin += stride
    return windows


class TokenWindows:
    """ The rows of a token file's windows, read from the memmap only when a batch needs them. """

    def __init__(self, tokens, windows):
        self.tokens, self.windows = tokens, windows

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, i):
        begin, end, n_scored = self.windows[i]
        return self.tokens[begin:end + 1], n_scored


def token_byte_lengths(tokenizer):
    """ The number of UTF-8 bytes each token id decodes to (for bits per byte). """
    if tokenizer.kind == 'char':
        lengths = np.zeros(max(tokenizer.itos) + 1, dtype=np.int64)
        for i, ch in tokenizer.itos.items():
            lengths[i] = len(ch.encode('utf-8'))
        return lengths
    enc = tokenizer.enc
    return np.array([len(enc.decode_single_token_bytes(i)) for i in range(enc.n_vocab)], dtype=np.int64)


def loss_metrics(table, num_bytes):
    nll, count = table[:, 0].sum().item(), table[:, 1].sum().item()
    metrics = {'loss': nll / count, 'perplexity': math.exp(nll / count), 'tokens': int(count)}
    if num_bytes is not None:
        metrics['bits_per_byte'] = nll / math.log(2) / num_bytes
        metrics['bytes'] = int(num_bytes)
    return metrics


# -----------------------------------------------------------------------------
# multiple choice and last-word JSONL tasks

def read_jsonl(path, required_keys):
    """ [(line number, record)] of a JSONL task file; a malformed line is an error that names it. """
    return read_jsonl_records(path, required_keys, "pass --data_file=PATH to an existing JSONL file")


def hellaswag_examples(records, tokenizer, block_size, path='data'):
    """
    rows: for each ending, context tokens then the tokens of ' ' + ending (as the standard harnesses
    tokenize it), only the ending scored. Returns (rows, example offsets, labels).
    """
    rows, offsets, labels = [], [0], []
    for lineno, rec in records:
        ctx, endings, label = rec['ctx'], rec['endings'], rec['label']
        if isinstance(label, str) and label.strip().isdigit():
            label = int(label)  # the Hugging Face copy of HellaSwag stores labels as strings
        ok = (isinstance(ctx, str) and ctx and isinstance(endings, list) and len(endings) >= 2
              and all(isinstance(e, str) and e for e in endings)
              and isinstance(label, int) and not isinstance(label, bool) and 0 <= label < len(endings))
        if not ok:
            raise UserError(f"{path} line {lineno}: expected a non-empty 'ctx' string, a list of at least 2 "
                            f"non-empty 'endings' and an integer 'label' indexing them; fix that line")
        context = tokenizer.encode_ordinary(ctx)
        for ending in endings:
            rows.append(make_row(context, tokenizer.encode_ordinary(' ' + ending), block_size))
        offsets.append(len(rows))
        labels.append(label)
    return rows, offsets, labels


def hellaswag_metrics(table, offsets, labels):
    correct = correct_norm = 0
    for k, label in enumerate(labels):
        choices = table[offsets[k]:offsets[k + 1]]
        total, mean = choices[:, 0], choices[:, 0] / choices[:, 1]
        correct += int(total.argmin().item() == label)
        correct_norm += int(mean.argmin().item() == label)
    return {'acc': correct / len(labels), 'acc_norm': correct_norm / len(labels)}


def lambada_examples(records, tokenizer, block_size, path='data'):
    """ rows: the text up to its last space, then the tokens of ' ' + last word (scored). """
    rows = []
    for lineno, rec in records:
        text = rec['text']
        context, _, word = text.rpartition(' ') if isinstance(text, str) else ('', '', '')
        if not context or not word:
            raise UserError(f"{path} line {lineno}: 'text' must be a string with some context, a space and a "
                            f"last word; fix that line")
        rows.append(make_row(tokenizer.encode_ordinary(context), tokenizer.encode_ordinary(' ' + word), block_size))
    return rows, list(range(len(rows) + 1))


def lambada_metrics(table):
    # ppl: the perplexity of the last word (per word, as in the GPT-2 paper and lm-evaluation-harness)
    return {'acc': table[:, 2].mean().item(), 'ppl': math.exp(table[:, 0].mean().item())}


def task_data_file(task, data_file):
    """ --data_file, else the task's public file, cached under data/<task>/ after one download. """
    if data_file:
        if not os.path.exists(data_file):
            raise UserError(f"no data file at {data_file}; pass --data_file=PATH to an existing file")
        return data_file
    url = DATA_URLS[task]
    path = os.path.join(REPO_DIR, 'data', task, os.path.basename(url))
    if os.path.exists(path):
        return path
    print(f"downloading {url} to {path}")
    try:
        with urllib.request.urlopen(url, timeout=DOWNLOAD_TIMEOUT_S) as response:
            content = response.read()
    except Exception as e:  # URLError, timeouts, HTTP errors: all mean "get the file another way"
        raise UserError(f"could not download {url} ({type(e).__name__}: {e}); download it elsewhere and pass "
                        f"--data_file=PATH") from None
    atomic_write(path, lambda f: f.write(content))
    return path


# -----------------------------------------------------------------------------

def evaluate(model, task, cfg, info, device, ctx=nullcontext(), dist_info=None, progress=False):
    """ Run one task; returns the result dict that main prints as JSON. """
    block_size = model.config.block_size
    batch_size, max_examples = cfg['batch_size'], cfg['max_examples']
    pad_to = block_size if cfg.get('compile') else None  # one shape, so torch.compile compiles once
    if batch_size < 1 or max_examples < 0:
        raise UserError("batch_size must be at least 1 and max_examples at least 0 (0 = all)")
    run = dict(device=device, ctx=ctx, dist_info=dist_info, pad_to=pad_to, progress=progress)
    if task == 'loss':
        path = cfg['data_file']
        dataset = cfg['dataset'] or ((info.get('checkpoint') or {}).get('config') or {}).get('dataset', '')
        if not path:
            if not dataset:
                raise UserError("no dataset to evaluate the loss on: pass --dataset=NAME or --data_file=PATH/val.bin")
            path = os.path.join(dataset_dir(dataset), f"{cfg['split']}.bin")
        tokens = open_tokens(path, dataset or None)
        if len(tokens) < 2:
            raise UserError(f"{path} has fewer than 2 tokens; nothing to score")
        if int(tokens.max()) >= model.config.vocab_size:
            raise UserError(f"{path} holds token ids up to {int(tokens.max())}, beyond the model's vocab_size "
                            f"({model.config.vocab_size}); was it prepared with another tokenizer?")
        windows = loss_windows(len(tokens), block_size, cfg['stride'])
        if max_examples:
            windows = windows[:max_examples]
        table = score_examples(model, TokenWindows(tokens, windows), list(range(len(windows) + 1)), batch_size,
                               **run)
        # bits per byte: the tokenizer of the file (its dataset's meta) decides how many bytes the text is
        meta = read_dataset_meta(os.path.dirname(os.path.abspath(path))) or info['tokenizer']
        lengths = token_byte_lengths(load_tokenizer(meta))
        scored = np.asarray(tokens[1:windows[-1][1] + 1], dtype=np.int64)
        num_bytes = int(lengths[scored].sum()) if scored.max() < len(lengths) else None
        metrics = loss_metrics(table, num_bytes)
        num_examples = len(windows)
    elif task in ('hellaswag', 'lambada'):
        path = task_data_file(task, cfg['data_file'])
        records = read_jsonl(path, ('ctx', 'endings', 'label') if task == 'hellaswag' else ('text',))
        if max_examples:
            records = records[:max_examples]
        tokenizer = load_tokenizer(info['tokenizer'])
        if task == 'hellaswag':
            rows, offsets, labels = hellaswag_examples(records, tokenizer, block_size, path)
            metrics = hellaswag_metrics(score_examples(model, rows, offsets, batch_size, **run), offsets, labels)
        else:
            rows, offsets = lambada_examples(records, tokenizer, block_size, path)
            metrics = lambada_metrics(score_examples(model, rows, offsets, batch_size, **run))
        num_examples = len(records)
    else:
        raise UserError(f"unknown task '{task}'; use one of: {', '.join(TASKS)}")
    return {'task': task, 'metrics': metrics, 'num_examples': num_examples, 'source': info['source'],
            'data_file': path}


def main():
    cfg = configure(DEFAULTS, doc=__doc__)
    if cfg['task'] not in TASKS:  # before loading anything
        raise UserError(f"unknown task '{cfg['task']}'; use one of: {', '.join(TASKS)}")
    if cfg['data_file'] and not os.path.exists(cfg['data_file']):
        raise UserError(f"no data file at {cfg['data_file']}; pass --data_file=PATH to an existing file")
    dist_info = init_distributed(cfg['device'])
    try:
        torch.manual_seed(cfg['seed'])
        device = dist_info.device
        _, ctx = precision(device, cfg['dtype'])
        if dist_info.master:
            print(f"provenance: {json.dumps(provenance(device))}")
        model, tokenizer_meta, ckpt = init_model(cfg['init_from'], cfg['out_dir'])
        model.to(device)
        info = {'tokenizer': tokenizer_meta, 'checkpoint': ckpt, 'source': describe_source(cfg['init_from'], cfg['out_dir'])}
        model.eval()
        if cfg['compile']:
            model = torch.compile(model)
        result = evaluate(model, cfg['task'], cfg, info, device, ctx, dist_info,
                          progress=dist_info.master)
        if dist_info.master:
            line = json.dumps(result)
            if cfg['output_file']:
                atomic_write(cfg['output_file'], lambda f: f.write(line + '\n'), binary=False)
            print(line)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    run_main(main)
