"""
Zero-shot evaluation, GPT-2's thesis: a plain language model scored on tasks it was never trained for.

Tasks:
  loss       exact mean loss / perplexity over whole token files (the dataset's val.bin or val shards), in
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
import os

import torch

from configurator import configure
from nanogpt_plus.checkpoint import check_dataset_tokenizer, describe_source, init_model, tokenizer_known
from nanogpt_plus.evaluation import TASKS, evaluate, loss_files
from nanogpt_plus.files import atomic_write
from nanogpt_plus.runtime import UserError, destroy_distributed, init_distributed, precision, provenance, run_main
from nanogpt_plus.settings import check_choice, check_non_negative, check_not_empty, check_positive, check_system
from nanogpt_plus.weights import WEIGHTS, set_weights

# the scoring is nanogpt_plus/evaluation.py's (one implementation, which other code calls in-process too);
# this script reads the settings, loads the model, and prints or writes the result
DEFAULTS = dict(
    init_from='resume',  # 'resume' (ckpt.pt in out_dir), a training out_dir or ckpt.pt, gpt2*, or a local HF dir
    out_dir='out',
    task='loss',  # loss | hellaswag | lambada
    data_file='',  # the token file (loss) or JSONL (hellaswag, lambada); '' = the default for the task
    dataset='',  # loss: data/<dataset>/<split>.bin or its <split> shards; '' = the checkpoint's training dataset
    split='val',
    stride=0,  # loss: 0 = non-overlapping block_size windows; S = sliding window, every token scored once
    batch_size=16,  # sequences per forward pass (choices of several examples are batched together)
    max_examples=0,  # 0 = all; else the first N examples (loss: windows), for quick runs
    device='auto',
    dtype='auto',  # auto = bfloat16 on GPUs that support it, float32 on CPU
    weights='float32',  # how the weights are stored and read: 'float32' (exact), 'bfloat16' or 'int8' (sample.py)
    compile=False,
    output_file='',  # also write the result JSON here
    seed=1337,
)


def check_settings(cfg):
    """ The mistakes that need no model, reported before one is loaded (stride vs block_size: once it is). """
    check_not_empty(cfg, 'init_from', 'out_dir', 'split')
    check_positive(cfg, 'batch_size')
    check_non_negative(cfg, 'stride', 'max_examples', 'seed')
    check_system(cfg)
    check_choice(cfg, 'weights', WEIGHTS)
    if cfg['task'] not in TASKS:
        raise UserError(f"unknown task '{cfg['task']}'; use one of: {', '.join(TASKS)}")
    if cfg['data_file'] and not os.path.exists(cfg['data_file']):
        raise UserError(f"no data file at {cfg['data_file']}; pass --data_file=PATH to an existing file")


def check_loss_tokenizer(cfg, dataset, ckpt, tokenizer_meta, source):
    """
    The loss of a model over another tokenizer's ids is a number that means nothing: refuse token files whose
    dataset meta describes another tokenizer than the model's (train.py's check), unless the model's is only
    guessed (a nanoGPT checkpoint whose dataset has no meta here: its files' meta is then the better guess).
    """
    if tokenizer_known(ckpt):
        paths = loss_files(cfg['data_file'], dataset, cfg['split'])
        check_dataset_tokenizer(os.path.dirname(os.path.abspath(paths[0])), tokenizer_meta, source,
                                remedy="evaluate it on token files made with its tokenizer (--dataset, --data_file)")


def main():
    cfg = configure(DEFAULTS, doc=__doc__)
    check_settings(cfg)
    dist_info = init_distributed(cfg['device'])
    try:
        torch.manual_seed(cfg['seed'])
        device = dist_info.device
        _, ctx = precision(device, cfg['dtype'])
        if dist_info.master:
            print(f"provenance: {json.dumps(provenance(device))}")
        model, tokenizer_meta, ckpt = init_model(cfg['init_from'], cfg['out_dir'])
        source = describe_source(cfg['init_from'], cfg['out_dir'])
        model.to(device)
        model.eval()
        set_weights(model, cfg['weights'])  # every row of the head: a loss scores the padded ids too
        # a checkpoint's loss is measured on the dataset it was trained on unless --dataset says otherwise
        dataset = cfg['dataset'] or ((ckpt or {}).get('config') or {}).get('dataset', '')
        if cfg['task'] == 'loss':
            check_loss_tokenizer(cfg, dataset, ckpt, tokenizer_meta, source)
        # compiled, every batch is padded to block_size: one shape, so torch.compile compiles once
        pad_to = model.config.block_size if cfg['compile'] else None
        if cfg['compile']:
            model = torch.compile(model)
        result = evaluate(model, cfg['task'], tokenizer_meta, data_file=cfg['data_file'], dataset=dataset,
                          split=cfg['split'], stride=cfg['stride'], batch_size=cfg['batch_size'],
                          max_examples=cfg['max_examples'], device=device, ctx=ctx, dist_info=dist_info,
                          pad_to=pad_to, progress=dist_info.master)
        if dist_info.master:
            # the printed JSON: where the model came from goes between what was scored and on which file
            line = json.dumps({'task': result['task'], 'metrics': result['metrics'],
                               'num_examples': result['num_examples'], 'source': source,
                               'data_file': result['data_file']})
            if cfg['output_file']:
                atomic_write(cfg['output_file'], lambda f: f.write(line + '\n'), binary=False)
            print(line)
    finally:
        destroy_distributed()


if __name__ == "__main__":
    run_main(main)
