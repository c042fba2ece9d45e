"""
Zero-shot evaluation, GPT-2's thesis: a plain language model scored on tasks it was never trained
for.

Tasks:
  loss       exact mean loss / perplexity over whole token files (the dataset's val.bin or val shards), in
             non-overlapping block_size windows or a sliding window (--stride); plus bits per byte
  hellaswag  completion multiple choice (JSONL with ctx, endings, label): acc (lowest total loss of the
             ending) and acc_norm (lowest mean loss per ending token)
  lambada    last-word prediction (JSONL with text): acc (the whole last word is the greedy continuation)
             and ppl (perplexity of the last word)
  core       DCLM's CORE score as nanochat measures it (nanogpt_plus/evaluation/core.py): every
             in-context task of an eval bundle (--core_dir), its accuracy and centred accuracy,
             CORE their mean; with --dataset also that split's bits per byte. Ends with a score
             card of published CORE figures

Usage:
    python eval.py --init_from=resume --out_dir=out-shakespeare-char-cpu --task=loss
    python eval.py --init_from=gpt2 --task=hellaswag                  # downloads the validation set once
    python eval.py --init_from=gpt2 --task=lambada --data_file=lambada_test.jsonl --max_examples=500
    torchrun --standalone --nproc_per_node=8 eval.py --init_from=gpt2 --task=hellaswag
    python eval.py --init_from=gpt2 --task=core --core_dir=eval_bundle --max_examples=100

The last line printed is one line of JSON: {"task": ..., "metrics": {...}, "num_examples": ...,
...};
--output_file=PATH writes the same JSON to a file (not over a checkpoint, a dataset's file or the --data_file
unless --overwrite=True; an earlier result there is simply replaced).
"""
# first, before torch is imported (seconds): from here on a signal stops the work in one line and
# exit code 130 (it can't resume; no output is left half-written), or is only said once it is done
from nanogpt_plus.signals import early_exit_request

EXIT_REQUEST = early_exit_request(__name__, resumable=False)

import functools
import json
import os
import sys

import torch

from configurator import Group, Schema, Setting, read_settings
from nanogpt_plus import settings
from nanogpt_plus.dataset import check_dataset_tokenizer, read_dataset_meta
from nanogpt_plus.distributed import GROUP_SETTINGS, every_rank, master_decides, said_once, same_everywhere, start
from nanogpt_plus.errors import UserError
from nanogpt_plus.evaluation import TASKS, core, evaluate, loss_files, task_data_file
from nanogpt_plus.files import atomic_write
from nanogpt_plus.init_from import describe_source, init_model, tokenizer_known
from nanogpt_plus.machine import auto_threads, device_type_of, precision, resolve_compile
from nanogpt_plus.outputs import check_output
from nanogpt_plus.runtime import SAME_START, provenance, run_main, same_start
from nanogpt_plus.settings import non_negative
from nanogpt_plus.weight_formats import WEIGHTS, set_weights

# num_threads=0: the thread count is re-checked every `interval` batches, each other candidate timed
# on `probe` of them (machine.ThreadRetuner); a round costs a few batches on a count that may be
# 5x slower under load, so rarely (the loss of Shakespeare's val split is ~110 batches)
THREAD_RETUNING = dict(interval=100, probe=4, window=50)

# the scoring is nanogpt_plus/evaluation's (one implementation, which other code calls in-process
# too); this script reads the settings, loads the model, and prints or writes the result

# -----------------------------------------------------------------------------
# the settings and their defaults (`python eval.py --help` prints them with their help); a
# setting other entry points share has its type, range and help in nanogpt_plus/settings.py and
# its default here
IO = Group(
    'I/O',
    out_dir=settings.out_dir('out'),
    overwrite=settings.overwrite(False),
    init_from=settings.init_from('resume'),
)
EVALUATION = Group(
    'zero-shot evaluation',
    task=Setting('loss', "loss | hellaswag | lambada | core"),
    data_file=Setting('', "the token file (loss) or JSONL (hellaswag, lambada); '' = the task's "
                          "default"),
    split=Setting('val', "loss: the split of the dataset to score", not_empty=True),
    stride=non_negative(0, "loss: 0 = non-overlapping block_size windows; S = a sliding window, "
                           "every token scored once"),
    max_examples=non_negative(0, "0 = all; else the first N examples (loss: windows), for quick "
                                 "runs"),
    core_dir=Setting('', "core: DCLM's eval bundle (core.yaml, eval_data/, eval_meta_data.csv); "
                         "'' = data/core/eval_bundle, downloaded once"),
    output_file=Setting('', "also write the result JSON here"),
    weights=settings.weights('float32', choices=WEIGHTS),  # shared with sample.py and finetune.py
)
DATA = Group(
    'data',
    dataset=Setting('', "loss: data/<dataset>/<split>.bin or its <split> shards; '' = the "
                        "checkpoint's training dataset (core: its bits per byte, only when given)"),
    batch_size=settings.batch_size(16),
)
SYSTEM = Group(
    'system',
    dist_timeout=settings.dist_timeout(0),
    join_timeout=settings.join_timeout(120),
    device=settings.device('auto'),
    dtype=settings.dtype('auto'),
    compile=settings.compile(False),
    num_threads=settings.num_threads(0),
    seed=settings.seed(1337),
)
DEFAULTS = Schema(IO, EVALUATION, DATA, SYSTEM)
# -----------------------------------------------------------------------------


def check_settings(cfg):
    """
    The mistakes that need no model, reported before one is loaded (stride vs block_size: once it
    is; the output file: by the rank that writes it, check_output_file).
    """
    DEFAULTS.check(cfg)
    if cfg.task not in TASKS + ('core',):
        raise UserError(f"unknown task '{cfg.task}'; use one of: {', '.join(TASKS)}, core")
    if cfg.task == 'core' and cfg.data_file:
        raise UserError("--task=core reads its bundle from --core_dir, not --data_file; pass "
                        "--dataset=NAME for the bits per byte of a split")


def check_output_file(cfg):
    """ Where --output_file goes, checked now, not after an evaluation that may take hours. """
    if cfg.output_file:
        check_output(cfg.output_file, 'output_file', cfg.overwrite,
                     inputs={'data_file': cfg.data_file}, output_kind='eval result')


def write_output_file(path, line):
    """ The result's JSON line into path, whole or not at all; a failed write is one line. """
    try:
        atomic_write(path, lambda f: f.write(line + '\n'), binary=False)
    except OSError as e:  # a full disk, a directory put in its place: the user's to fix
        raise UserError(f"could not write --output_file={path} ({e.strerror or e}); the result "
                        f"was: {line}") from None


def check_loss_tokenizer(cfg, dataset, ckpt, tokenizer_meta, source):
    """
    The loss of a model over another tokenizer's ids is a number that means nothing: refuse token
    files whose dataset meta describes another tokenizer than the model's (train.py's check), unless
    the model's is only guessed (a nanoGPT checkpoint whose dataset has no meta here: its files'
    meta is then the better guess).
    """
    if tokenizer_known(ckpt):
        paths = loss_files(cfg.data_file, dataset, cfg.split)
        data_dir = os.path.dirname(os.path.abspath(paths[0]))
        check_dataset_tokenizer(
            data_dir,
            read_dataset_meta(data_dir),
            tokenizer_meta,
            source,
            remedy="evaluate it on token files made with its tokenizer (--dataset, --data_file)")


def load_inputs(cfg):
    """
    (model, tokenizer description, checkpoint, dataset, data file) of this rank: the model init_from
    names, the dataset a loss is measured on (a checkpoint's own unless --dataset says otherwise;
    its token files must be here, and speak the model's tokenizer), and a JSONL task's file (the
    public one downloaded once).
    """
    data_file = cfg.data_file
    if data_file and not os.path.exists(data_file):  # before the model is read
        raise UserError(f"no data file at {data_file}; pass --data_file=PATH to an existing file")
    if cfg.task == 'core':  # the bundle, checked before the model is read
        data_file = core.bundle_dir(cfg.core_dir)
        core.read_bundle(data_file)
    model, tokenizer_meta, ckpt = init_model(cfg.init_from, cfg.out_dir)
    dataset = cfg.dataset or ((ckpt or {}).get('config') or {}).get('dataset', '')
    if cfg.task == 'core':
        dataset = cfg.dataset  # a split's bits per byte only when asked for
    if cfg.task == 'loss' or (cfg.task == 'core' and dataset):
        token_file = '' if cfg.task == 'core' else data_file
        paths = loss_files(token_file, dataset, cfg.split)
        missing = [p for p in paths if not os.path.exists(p)]
        if missing:
            raise UserError(
                f"no token file at {missing[0]} on this machine; prepare the dataset, or pass "
                f"--dataset / --data_file")
        check_loss_tokenizer(cfg, dataset, ckpt, tokenizer_meta,
                             describe_source(cfg.init_from, cfg.out_dir))
    elif cfg.task != 'core':
        data_file = task_data_file(cfg.task, data_file)
    return model, tokenizer_meta, ckpt, dataset, data_file


def scored_files(cfg, dataset, data_file):
    """
    What this rank scores, as same_start compares it: data, {name: path} (the loss task's token
    files, else the task's JSONL file), and data_meta, the token files' tokenizer description.
    """
    if cfg.task == 'core':  # the bundle's files, and the split whose bits per byte it reports
        bundle = {name: os.path.join(data_file, name) for name in core.BUNDLE_FILES}
        bundle.update({task.label: task.path for task in core.read_bundle(data_file)})
        if not dataset:
            return {'data': bundle}
        paths = loss_files('', dataset, cfg.split)
        return {'data': {**bundle, **{os.path.basename(p): p for p in paths}},
                'data_meta': read_dataset_meta(os.path.dirname(os.path.abspath(paths[0])))}
    if cfg.task != 'loss':
        return {'data': {'data_file': data_file}}
    paths = loss_files(data_file, dataset, cfg.split)
    return {'data': {os.path.basename(p): p for p in paths},
            'data_meta': read_dataset_meta(os.path.dirname(os.path.abspath(paths[0])))}


def stop_poll(dist_info):
    """
    What the evaluation asks between its batches under torchrun: a signal to any rank stops every
    rank there, with exit code 130 and a line on each node (train.py's agreement, for work that
    can't resume); None for one process, which a signal stops at once.
    """
    if EXIT_REQUEST is None or not dist_info.under_torchrun:
        return None
    EXIT_REQUEST.together()
    return lambda: EXIT_REQUEST.stop_together(dist_info)


def main():
    # the settings, with one verdict for every rank; rank 0 writes the result, and checks where
    cfg, failure, group = read_settings(DEFAULTS, sys.argv[1:], check_settings, __doc__, GROUP_SETTINGS)
    dist_info = start(failure, **group)
    # from here a signal to one rank stops every rank together, between batches
    poll = stop_poll(dist_info)
    master_decides(dist_info, lambda: check_output_file(cfg))
    torch.manual_seed(cfg.seed)
    device = dist_info.device
    _, ctx = precision(device, cfg.dtype)
    compile_model = resolve_compile(cfg.compile, device_type_of(device))  # None = auto: on CUDA
    # num_threads=0 on a CPU: timed on the first batch, then re-checked (each rank its own count)
    threads = auto_threads(device, cfg.num_threads, 'batch',
                           say=print if dist_info.master else lambda line: None, **THREAD_RETUNING)
    if dist_info.master:
        print(f"provenance: {json.dumps(provenance(device))}")
    # what each rank reads (the model, the data), with one verdict: a node that lacks a file stops
    # every rank. Rank 0 alone prints the model's set-up lines (every rank's would repeat)
    with said_once(dist_info):
        model, tokenizer_meta, ckpt, dataset, data_file = every_rank(dist_info,
                                                                     lambda: load_inputs(cfg))
    # and all of them the same: settings, code, checkpoint and data (else all stop in one line)
    scored = functools.partial(scored_files, cfg, dataset, data_file)
    same_everywhere(dist_info, lambda: same_start(dict(cfg), **scored()), SAME_START)
    source = describe_source(cfg.init_from, cfg.out_dir)
    model.to(device)
    model.eval()
    set_weights(model, cfg.weights)  # every row of the head: a loss scores the padded ids too
    # compiled, every batch is padded to block_size: one shape, so torch.compile compiles once
    pad_to = model.config.block_size if compile_model else None
    if compile_model:
        model = torch.compile(model)
    common = dict(data_file=data_file, dataset=dataset, split=cfg.split,
                  batch_size=cfg.batch_size, max_examples=cfg.max_examples, device=device,
                  ctx=ctx, dist_info=dist_info, pad_to=pad_to, progress=dist_info.master,
                  threads=threads, poll=poll)
    if cfg.task == 'core':
        result = core.evaluate_bundle(model, tokenizer_meta, **common)
    else:
        result = evaluate(model, cfg.task, tokenizer_meta, stride=cfg.stride, **common)
    # the printed JSON: where the model came from goes between what was scored and on which file
    line = json.dumps({'task': result['task'], 'metrics': result['metrics'],
                       'num_examples': result['num_examples'], 'source': source,
                       'data_file': result['data_file']})
    if cfg.output_file:  # rank 0's; every rank ends as its write did
        master_decides(dist_info, lambda: write_output_file(cfg.output_file, line))
    if dist_info.master:
        if cfg.task == 'core':  # the tasks' lines came as each was done: CORE and the card
            print('\n'.join(core.score_card(result['metrics'], source, cfg.max_examples)))
        print(line)


if __name__ == "__main__":
    run_main(main)
