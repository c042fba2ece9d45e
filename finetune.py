"""
GPT-1-style supervised fine-tuning: a pretrained GPT plus a linear head on the final hidden state of the
Extract token, trained with L3 = L2 + lm_loss_weight * L1 (the task's cross-entropy plus the auxiliary
language-modelling loss, lambda = 0.5 in the paper), for a few epochs over a labelled JSONL file.

Tasks and their JSONL fields (one example per line), with GPT-1's input transformations
(s = Start, $ = Delim, e = Extract, three new learned tokens appended after the model's vocabulary, padded
rows included, so they never share an id with the tokenizer's tokens):
    classification   {"text", "label"}                   s text e                        -> linear head
    entailment       {"premise", "hypothesis", "label"}  s premise $ hypothesis e        -> linear head
    similarity       {"text1", "text2", "label"}         s a $ b e  and  s b $ a e, summed -> linear head
    multiple_choice  {"context", "choices", "label"}     s context $ choice_i e for each i -> one scalar
                                                         each, softmax over the choices
Labels of the first three are class ids or strings (the map is stored in the checkpoint); the label of
multiple_choice is the index of the right choice (or its text).

Fine-tune a model trained with train.py (its out_dir), GPT-2 weights or a local HF directory (the texts are
encoded with the model's tokenizer: GPT-2 BPE, a character vocabulary, or the bpe tokenizer.json it was
trained with):
$ python finetune.py --task=classification --init_from=out-shakespeare-char --out_dir=out-ft \\
      --train_file=train.jsonl --val_file=val.jsonl
$ python finetune.py config/finetune_classification.py --init_from=gpt2 --train_file=... --val_file=...
$ python finetune.py ... --init_from=scratch --dataset=shakespeare_char   # no pretraining, for comparison

With DDP (each rank gets its DistributedSampler share of every global batch):
$ torchrun --standalone --nproc_per_node=2 finetune.py ... --device=cpu

Resume an interrupted fine-tune (Ctrl-C or SIGTERM saves out_dir/ckpt_last.pt and exits with code 75):
$ python finetune.py ... --out_dir=out-ft --init_from=resume
A new fine-tune into an out_dir that holds one is refused unless --overwrite=True; one run at a time per out_dir.

Predict labels for unlabelled JSONL with a fine-tuned model (or after training, with the best model):
$ python finetune.py --init_from=out-ft --predict_file=test.jsonl --predict_out=predictions.jsonl

out_dir/ckpt.pt holds the best model (by val accuracy) with its head, label map, special tokens and
tokenizer; the last line printed is JSON: {"task": ..., "val_acc": best val accuracy, ...}.
"""

import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F
from torch.utils.data import DistributedSampler

from configurator import configure
from nanogpt_plus.checkpoint import check_tokenizer_fits, checkpoint_path, init_model, load_checkpoint, save_checkpoint
from nanogpt_plus.finetuning import (TASKS, FinetuneModel, TaskData, TaskHead, add_special_tokens, configure_optimizers,
                                     evaluate, finetune_checkpoint, head_outputs, load_task_data, make_batch,
                                     model_from_finetune_checkpoint, write_predictions)
from nanogpt_plus.outdir import claim_out_dir, refuse_overwrite
from nanogpt_plus.parallel import accumulation_per_rank, all_reduce_sum, grad_sync_context, wrap_model
from nanogpt_plus.runtime import (DistInfo, Interrupted, UserError, destroy_distributed, device_type_of,
                                  init_distributed, precision, provenance, run_main)
from nanogpt_plus.settings import (check_choice, check_model_shape, check_non_negative, check_not_empty, check_positive,
                                   check_range, check_system)
from nanogpt_plus.tokenizer import load_tokenizer
from nanogpt_plus.training import (GracefulExit, MetricsLogger, compute_setup, fit_block_size, gather_rng_states,
                                   make_grad_scaler, optimizer_step, out_of_memory_error, restore_training_state,
                                   set_learning_rate, tensors_finite)
from nanogpt_plus.weights import WEIGHTS, set_weights

BEST_CKPT = 'ckpt.pt'  # the best model so far (by val accuracy), with its head: what predictions use
LAST_CKPT = 'ckpt_last.pt'  # the latest training state, for --init_from=resume

# -----------------------------------------------------------------------------
# default config values: GPT-1's fine-tuning recipe (lr 6.25e-5, batch 32, 3 epochs, dropout 0.1,
# warmup over 0.2% of training, lambda 0.5)
DEFAULTS = dict(
    task='',  # classification | entailment | similarity | multiple_choice ('' = the checkpoint's, when predicting)
    init_from='scratch',  # a train.py out_dir or ckpt.pt, 'resume' (out_dir/ckpt_last.pt), gpt2*, an HF dir, 'scratch'
    out_dir='out-finetune',
    overwrite=False,  # True: a new fine-tune may replace the checkpoints already in out_dir (else it is refused)
    train_file='',  # JSONL with labels
    val_file='',  # JSONL with labels; accuracy after every epoch picks the checkpoint kept in out_dir/ckpt.pt
    predict_file='',  # JSONL without (or with ignored) labels: write predictions of the best model
    predict_out='',  # where the predictions go ('' = out_dir/predictions.jsonl)
    # data / tokenizer for init_from=scratch
    dataset='openwebtext',  # scratch models use this dataset's tokenizer (its char or bpe meta), else GPT-2 BPE
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
    weights='float32',  # predictions only (--predict_file, no --train_file): 'float32', 'bfloat16' or 'int8' (sample.py)
    compile=False,
    activation_checkpointing=False,  # True: recompute each Block in the backward pass (gpt2-large/xl on one GPU)
    seed=1337,
)
# -----------------------------------------------------------------------------


# -----------------------------------------------------------------------------
# what stays fixed while a fine-tune runs, and the state that moves

@dataclass
class Schedule:
    """ The optimizer steps of a fine-tune and their learning rates (warmup, then cosine decay to min_lr). """
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
    def for_run(cls, n_examples, cfg, accum):
        """ The schedule for n_examples per rank and epoch (a DistributedSampler's share). """
        steps_per_epoch = math.ceil(n_examples / (cfg['batch_size'] * accum))
        total_steps = cfg['epochs'] * steps_per_epoch
        warmup_iters = int(cfg['warmup_frac'] * total_steps)
        # decay over all steps, so the last one runs at min_lr (and never a decay phase of length 0)
        lr_decay_iters = max(total_steps - 1, warmup_iters + 1)
        return cls(cfg['batch_size'], accum, steps_per_epoch, total_steps, warmup_iters, lr_decay_iters,
                   cfg['learning_rate'], cfg['min_lr'], cfg['decay_lr'])

    @property
    def per_step(self):
        return self.batch_size * self.accum  # examples per optimizer step on this rank



@dataclass
class FinetuneRun:
    """ What stays fixed while a fine-tune runs: settings, processes, model, optimizer, data and schedule. """
    cfg: dict
    dist_info: DistInfo
    task: str
    raw_model: FinetuneModel  # the plain module: what checkpoints save and evaluation runs
    model: torch.nn.Module  # raw_model wrapped for DDP (and compiled): what the training steps run
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ctx: object  # the autocast context of the forward passes
    data: TaskData
    special: dict  # the ids of the Start, Delim and Extract tokens
    tokenizer: object
    tokenizer_meta: dict
    source_name: str  # what the fine-tune started from, kept in its checkpoints
    provenance: dict
    sampler: DistributedSampler
    schedule: Schedule
    logger: MetricsLogger
    exit_request: GracefulExit
    t0: float  # when training started, for the elapsed time in the log lines

    @property
    def master(self):
        return self.dist_info.master


@dataclass
class FinetuneState:
    """
    Where a fine-tune is: the counters and the record of the epochs so far, which ckpt_last.pt saves and
    --init_from=resume restores. last_loss and interrupted only live as long as the process.
    """
    epoch: int = 0
    step_in_epoch: int = 0
    iter_num: int = 0
    best_val_acc: float = None
    best_epoch: int = None
    history: list = field(default_factory=list)  # one record per finished epoch (train loss, val accuracy)
    last_loss: float = None  # the train loss of the last logged step (every epoch's last step is logged)
    interrupted: bool = False

    @classmethod
    def from_checkpoint(cls, ckpt):
        return cls(epoch=int(ckpt['epoch']), step_in_epoch=int(ckpt['step_in_epoch']),
                   iter_num=int(ckpt['iter_num']), best_val_acc=ckpt.get('best_val_acc'),
                   best_epoch=ckpt.get('best_epoch'), history=list(ckpt.get('history') or []))

    def saved(self):
        """ The keys ckpt_last.pt holds for from_checkpoint (iter_num is every checkpoint's). """
        return {'epoch': self.epoch, 'step_in_epoch': self.step_in_epoch, 'best_val_acc': self.best_val_acc,
                'best_epoch': self.best_epoch, 'history': self.history}


# -----------------------------------------------------------------------------
# the fine-tune: set-up, then per epoch: train steps (each logged now and then), evaluation, checkpoints

def finetune(cfg, dist_info):
    """ Fine-tune, evaluate after every epoch, keep the best model; returns the final result dict. """
    run, state = setup(cfg, dist_info)
    try:
        while state.epoch < cfg['epochs'] and not state.interrupted:
            run_epoch(run, state)
            if state.interrupted:
                save_interrupted(run, state)
            else:
                end_epoch(run, state)
    except torch.OutOfMemoryError:  # torch.cuda.OutOfMemoryError: one line that says what to change
        raise out_of_memory_error(state.iter_num, cfg['out_dir'], LAST_CKPT, fsdp=False) from None
    finally:
        run.exit_request.uninstall()
        run.logger.close()
    return finish(run, state)


def setup(cfg, dist_info):
    """ Everything the loop needs (FinetuneRun) and the state it starts from: new, or ckpt_last.pt's. """
    accum = accumulation_per_rank(cfg['gradient_accumulation_steps'], dist_info)
    device = dist_info.device
    dtype, ctx, compile_model, _ = compute_setup(device, cfg['dtype'], cfg['compile'], num_threads=0, peak=False)
    run_provenance = dict(provenance(device), dtype=dtype, world_size=dist_info.world_size)  # kept in checkpoints
    if dist_info.master:
        os.makedirs(cfg['out_dir'], exist_ok=True)
        print("provenance: " + json.dumps(run_provenance))
    resume = cfg['init_from'] == 'resume'
    if cfg['task'] not in TASKS and not (resume and not cfg['task']):
        raise UserError(f"unknown task '{cfg['task']}': pass --task=one of {', '.join(TASKS)}")

    # the model: the same initial weights on every rank (head, new embeddings), then per-rank dropout
    torch.manual_seed(cfg['seed'])
    gpt, tokenizer_meta, source = load_source(cfg)
    task = resolve_task(cfg, source)
    special, tokenizer, data = prepare_model_and_data(cfg, task, gpt, tokenizer_meta, source, dist_info.master)
    raw_model = build_finetune_model(cfg, task, gpt, data.n_classes, source if resume else None).to(device)
    torch.manual_seed(cfg['seed'] + dist_info.rank)  # dropout differs per rank; data order does not

    optimizer = configure_optimizers(raw_model, cfg, device_type_of(device))
    scaler = make_grad_scaler(device_type_of(device), dtype)
    model = wrap_model(raw_model, dist_info, compile_model)
    # epochs over a DistributedSampler: one seeded permutation per epoch (the same on every rank and for
    # every world size); rank r takes positions r, r+W, ... of it, so the micro-batches of all ranks in
    # one optimizer step together hold exactly the examples a single process would take for that step
    sampler = DistributedSampler(range(len(data.train_encoded)), num_replicas=dist_info.world_size,
                                 rank=dist_info.rank, shuffle=True, seed=cfg['seed'], drop_last=False)
    schedule = Schedule.for_run(len(sampler), cfg, accum)
    state = FinetuneState()
    if resume:
        restore_training_state(source, optimizer, scaler, dist_info)
        state = FinetuneState.from_checkpoint(source)
        if dist_info.master:
            print(f"resuming the fine-tune at epoch {state.epoch}, step {state.step_in_epoch} of "
                  f"{schedule.steps_per_epoch}")
    # a resumed fine-tune still names the model it started from, not its own ckpt_last.pt
    source_name = source.get('source_model', cfg['init_from']) if resume else cfg['init_from']
    logger = MetricsLogger(os.path.join(cfg['out_dir'], 'metrics.jsonl'), enabled=dist_info.master,
                           wandb_log=cfg['wandb_log'], wandb_project=cfg['wandb_project'],
                           wandb_run_name=cfg['wandb_run_name'], config=cfg, wandb_dir=cfg['out_dir'])
    logger.start(state.iter_num, cfg['init_from'])
    run = FinetuneRun(cfg=cfg, dist_info=dist_info, task=task, raw_model=raw_model, model=model, optimizer=optimizer,
                      scaler=scaler, ctx=ctx, data=data, special=special, tokenizer=tokenizer,
                      tokenizer_meta=tokenizer_meta, source_name=source_name, provenance=run_provenance,
                      sampler=sampler, schedule=schedule, logger=logger, exit_request=GracefulExit().install(),
                      t0=time.time())
    return run, state


def load_source(cfg):
    """
    (gpt, tokenizer description, source checkpoint or None) for init_from, before the special tokens:
    init_model's, with the model settings for scratch and ckpt_last.pt for resume.
    """
    init_from = cfg['init_from']
    if init_from not in ('scratch', 'resume'):
        source_path = checkpoint_path(init_from, cfg['out_dir'])
        target = os.path.abspath(os.path.join(cfg['out_dir'], BEST_CKPT))
        if source_path is not None and os.path.abspath(source_path) == target:
            raise UserError(f"init_from {init_from} is the checkpoint in --out_dir, which fine-tuning would "
                            f"overwrite; pass a different --out_dir (or --init_from=resume to continue an "
                            f"interrupted fine-tune)")
    model_settings = {k: cfg[k] for k in ('n_layer', 'n_head', 'n_embd', 'bias', 'dropout', 'gelu')}
    model_settings['block_size'] = cfg['block_size'] or 1024  # 0 means the source model's; scratch has none
    return init_model(init_from, cfg['out_dir'], dataset=cfg['dataset'], model_settings=model_settings,
                      dropout=cfg['dropout'], resume_file=LAST_CKPT)


def resolve_task(cfg, source):
    """ --task; when resuming, the fine-tune's own task (which --task may repeat, not change). """
    if cfg['init_from'] != 'resume':
        return cfg['task']
    task = cfg['task'] or source.get('task')
    if task != source.get('task'):
        raise UserError(f"--task={task} but the fine-tune in {cfg['out_dir']} is {source.get('task')}; "
                        f"drop --task to resume it")
    return task


def prepare_model_and_data(cfg, task, gpt, tokenizer_meta, source, master):
    """
    Crop the GPT to --block_size and add the special tokens, then read the data: the labels of the
    training file define the classes (kept from the checkpoint when resuming). Returns (special, tokenizer, data).
    """
    fit_block_size(gpt, cfg['block_size'])
    block_size = gpt.config.block_size
    if block_size < 5:
        raise UserError(f"block_size {block_size} is too small for the special tokens; use 16 or more")
    tokenizer = load_tokenizer(tokenizer_meta)
    check_tokenizer_fits(gpt.config, tokenizer_meta, cfg['init_from'])  # else special tokens would share text ids
    special = add_special_tokens(gpt, source)
    label_map = source.get('label_map') if cfg['init_from'] == 'resume' else None
    data = load_task_data(task, cfg['train_file'], cfg['val_file'], tokenizer, special, block_size, label_map)
    if not cfg['val_file'] and master:
        print("warning: no --val_file; the model of the last epoch is kept and val_acc is null", file=sys.stderr)
    return special, tokenizer, data


def build_finetune_model(cfg, task, gpt, n_classes, resumed):
    """ The GPT with a new task head (or the head of the resumed checkpoint), on the CPU. """
    head = TaskHead(gpt.config.n_embd, head_outputs(task, n_classes), cfg['dropout'], bias=task != 'multiple_choice')
    if resumed is not None:
        head.load_state_dict(resumed['head'])
    gpt.set_attention(cfg['attention'])
    gpt.set_activation_checkpointing(cfg['activation_checkpointing'])
    return FinetuneModel(gpt, head, task)


def run_epoch(run, state):
    """ The optimizer steps of epoch state.epoch from state.step_in_epoch on; a signal stops it early. """
    run.sampler.set_epoch(state.epoch)
    order = list(run.sampler)  # this rank's examples for the epoch, in order
    while state.step_in_epoch < run.schedule.steps_per_epoch:
        lr, step_losses, grad_norm = train_step(run, state, order)
        last_of_epoch = state.step_in_epoch == run.schedule.steps_per_epoch
        logged = state.iter_num % run.cfg['log_interval'] == 0 or last_of_epoch
        if logged:
            log_step(run, state, lr, step_losses, grad_norm)
        if run.exit_request.should_stop(run.dist_info):  # every step: torchrun kills soon after its signal
            state.interrupted = True
            return


def train_step(run, state, order):
    """
    One optimizer step over this rank's micro-batches of the step's global batch. Returns the learning
    rate, this rank's (task loss, LM loss) of the step as tensors (no sync), and the gradient norm.
    """
    s = run.schedule
    lr = set_learning_rate(run.optimizer, state.iter_num, s.learning_rate, s.warmup_iters, s.lr_decay_iters,
                           s.min_lr, s.decay_lr)
    batches = step_batches(run, state, order)
    # normalise by the counts of the whole global batch (all micro-batches, all ranks): the
    # gradient is then exactly that of one big batch, for any world size and accumulation
    n_ex, n_tok = global_batch_counts(run, state)
    step_cls = torch.zeros((), device=run.dist_info.device)
    step_lm = torch.zeros((), device=run.dist_info.device)
    for k, b in enumerate(batches):
        with grad_sync_context(run.model, k == len(batches) - 1):
            loss, cls_loss, lm_loss = micro_batch_loss(run, b, n_ex, n_tok)
            # DDP averages gradients over the W ranks; scale up so they add up instead
            run.scaler.scale(loss * run.dist_info.world_size).backward()
        step_cls += cls_loss.detach()
        if lm_loss is not None:
            step_lm += lm_loss.detach()
    grad_norm = optimizer_step(run.model, run.optimizer, run.scaler, run.cfg['grad_clip'])
    state.iter_num += 1
    state.step_in_epoch += 1
    return lr, (step_cls, step_lm), grad_norm


def step_batches(run, state, order):
    """ This rank's micro-batches of the current step: its next batch_size x accum examples of order. """
    bs, start = run.schedule.batch_size, state.step_in_epoch * run.schedule.per_step
    micro = [order[start + m * bs: start + (m + 1) * bs] for m in range(run.schedule.accum)]
    # every rank must run the same number of forward/backward passes (DDP); the sampler pads
    # every rank to the same length, so the number of non-empty micro-batches agrees
    data = run.data
    return [make_batch([data.train_encoded[i] for i in m], [data.train_labels[i] for i in m], run.special,
                       run.dist_info.device) for m in micro if m]


def global_batch_counts(run, state):
    """
    (examples, LM targets) of the current step's global batch, all ranks together, as floats: what an
    all-reduce of every rank's counts would give, without one (a collective, and the .tolist() after it,
    would wait for the GPU every step). Every rank knows every rank's share of the step from the sampler.
    """
    bs, start = run.schedule.batch_size, state.step_in_epoch * run.schedule.per_step
    sampler, data = run.sampler, run.data
    n_ex = n_tok = 0
    for order in epoch_orders(len(sampler.dataset), sampler.num_replicas, sampler.shuffle, sampler.seed,
                              sampler.drop_last, sampler.epoch):
        # the examples step_batches takes on that rank (its empty micro-batches add nothing)
        for i in order[start: start + run.schedule.accum * bs]:
            n_ex += 1  # one label per example, whatever its number of rows
            n_tok += data.train_lm_targets[i]
    return float(n_ex), float(n_tok)


@functools.lru_cache(maxsize=1)
def epoch_orders(n_examples, world_size, shuffle, seed, drop_last, epoch):
    """
    Every rank's DistributedSampler order of one epoch, computed here on any rank: the same seed and
    epoch give the same permutation everywhere, of which rank r takes positions r, r+W, ... (cached: the
    steps of an epoch all ask for the same one).
    """
    orders = []
    for rank in range(world_size):
        sampler = DistributedSampler(range(n_examples), num_replicas=world_size, rank=rank, shuffle=shuffle,
                                     seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return tuple(orders)


def micro_batch_loss(run, b, n_ex, n_tok):
    """
    GPT-1's L3 = L2 + lambda * L1 of one micro-batch as its share of the global batch's mean (n_ex
    examples, n_tok LM targets): (L3, L2, L1 or None when lm_loss_weight is 0).
    """
    lm_w = run.cfg['lm_loss_weight']
    with run.ctx:
        logits, lm_sum = run.model(b['idx'], b['extract_pos'], b['choice_mask'], b['lm_targets'] if lm_w > 0 else None)
    cls_loss = F.cross_entropy(logits, b['labels'], reduction='sum') / n_ex
    if lm_w > 0:
        lm_loss = lm_sum / max(n_tok, 1.0)
        return cls_loss + lm_w * lm_loss, cls_loss, lm_loss
    return cls_loss, cls_loss, None


def log_step(run, state, lr, step_losses, grad_norm):
    """ The step's losses summed over ranks (one sync, at log time only): a line and a metrics record. """
    step_cls, step_lm = all_reduce_sum([t.item() for t in step_losses], run.dist_info)
    state.last_loss = step_cls + run.cfg['lm_loss_weight'] * step_lm
    if not math.isfinite(step_cls + step_lm):
        raise UserError(f"the loss is {step_cls + step_lm} at step {state.iter_num}; lower the learning rate "
                        f"(or use --dtype=float32)")
    if not run.master:
        return
    dt = time.time() - run.t0
    print(f"epoch {state.epoch} step {state.iter_num}/{run.schedule.total_steps}: loss {state.last_loss:.4f} "
          f"(task {step_cls:.4f}, lm {step_lm:.4f}), lr {lr:.2e}, {dt:.1f}s")
    run.logger.log({'type': 'iter', 'iter': state.iter_num, 'epoch': state.epoch, 'loss': state.last_loss,
                    'task_loss': step_cls, 'lm_loss': step_lm, 'lr': lr,
                    'grad_norm': float(grad_norm) if grad_norm is not None else None})


def end_epoch(run, state):
    """ After the last step of an epoch: evaluate, keep the model if it is the best so far, save the state. """
    record = evaluate_epoch(run, state)
    state.history.append(record)
    if run.master:
        run.logger.log(dict(record, type='eval'))
    # without a val file every epoch counts as the best, so ckpt.pt is the last epoch's model
    if 'val_acc' not in record or state.best_val_acc is None or record['val_acc'] > state.best_val_acc:
        state.best_val_acc, state.best_epoch = record.get('val_acc'), state.epoch
        save_best(run, state, record)
    state.epoch += 1
    state.step_in_epoch = 0
    save_last(run, state, f"end of epoch {state.epoch - 1}")


def evaluate_epoch(run, state):
    """ The epoch's record: its train loss and, with a val file, the accuracy on it (each rank a strided share). """
    record = {'epoch': state.epoch, 'iter': state.iter_num, 'train_loss': state.last_loss}
    data, dist_info = run.data, run.dist_info
    if data.val_encoded is None:
        return record
    eval_bs = run.cfg['eval_batch_size'] or run.cfg['batch_size']
    # the plain model, whose forwards are no collectives; still, every rank runs as many batches (evaluate pads)
    # as the one with the most, so this stays safe if the evaluated model is ever a wrapped one
    n_val, world = len(data.val_encoded), dist_info.world_size
    most_batches = math.ceil(math.ceil(n_val / world) / eval_bs)  # of the rank with the most examples
    correct, seen, loss_sum, _ = evaluate(run.raw_model, data.val_encoded, data.val_labels, run.special, eval_bs,
                                          dist_info.device, run.ctx, range(dist_info.rank, n_val, world),
                                          num_batches=most_batches)
    correct, seen, loss_sum = all_reduce_sum([correct, seen, loss_sum], dist_info)
    record.update(val_acc=correct / seen, val_loss=loss_sum / seen)
    if run.master:
        print(f"epoch {state.epoch}: val accuracy {correct / seen:.4f} ({int(round(correct))}/{int(round(seen))}), "
              f"val loss {loss_sum / seen:.4f}")
    return record


def checkpoint(run, state, **extra):
    """ The fine-tune's checkpoint dict at this state: the GPT, its head and labels, then extra. """
    return finetune_checkpoint(run.raw_model, state.iter_num, run.cfg, run.tokenizer_meta, run.provenance,
                               run.data.label_map, run.special, run.source_name, **extra)


def save_best(run, state, record):
    """ out_dir/ckpt.pt: the model of this epoch with its val accuracy (the master rank writes it). """
    if not run.master:
        return
    path = os.path.join(run.cfg['out_dir'], BEST_CKPT)
    save_checkpoint(checkpoint(run, state, epoch=state.epoch, val_acc=state.best_val_acc,
                               val_loss=record.get('val_loss'), history=state.history), path)
    print(f"saved the best model so far to {path}")


def save_last(run, state, reason):
    """ out_dir/ckpt_last.pt: the full training state (all ranks call this: RNG states come from every rank). """
    rng_states = gather_rng_states(run.dist_info)
    if not run.master:
        return
    if not tensors_finite(run.raw_model.parameters()):
        raise UserError(f"the weights are not finite at step {state.iter_num}; not saving. Lower the learning rate")
    path = os.path.join(run.cfg['out_dir'], LAST_CKPT)
    scaler_state = run.scaler.state_dict() if run.scaler.is_enabled() else None
    save_checkpoint(checkpoint(run, state, optimizer=run.optimizer.state_dict(), rng=rng_states,
                               scaler=scaler_state, **state.saved()), path)
    print(f"saved the training state to {path} ({reason})")


def save_interrupted(run, state):
    """ A signal stopped the epoch: save the training state to resume from (no evaluation). """
    save_last(run, state, f"interrupted at epoch {state.epoch}, step {state.step_in_epoch}")
    if run.master:
        print(f"stopped cleanly; continue with --init_from=resume --out_dir={run.cfg['out_dir']} (exit code 75)")


def finish(run, state):
    """ The result dict (printed as the last line, as JSON), after predictions of the best model if asked. """
    cfg = run.cfg
    result = {'task': run.task, 'val_acc': state.best_val_acc, 'best_epoch': state.best_epoch,
              'epochs': state.epoch, 'steps': state.iter_num, 'out_dir': cfg['out_dir'],
              'interrupted': state.interrupted}
    if cfg['predict_file'] and not state.interrupted and run.master:
        best = load_checkpoint(os.path.join(cfg['out_dir'], BEST_CKPT))
        best_model = model_from_finetune_checkpoint(best).to(run.dist_info.device)
        write_predictions(best_model, best, cfg, run.special, run.tokenizer, run.dist_info.device, run.ctx,
                          cfg['predict_file'], cfg['predict_out'] or os.path.join(cfg['out_dir'], 'predictions.jsonl'))
    if run.master:
        print(json.dumps(result))
    return result


# -----------------------------------------------------------------------------
# predictions only, and the command line

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
    model.eval()
    set_weights(model.gpt, cfg['weights'])  # the task head stays float32: it is one small matrix
    _, ctx = precision(device, cfg['dtype'])
    out_path = cfg['predict_out'] or os.path.join(os.path.dirname(path), 'predictions.jsonl')
    write_predictions(model, ckpt, cfg, ckpt['special_tokens'], load_tokenizer(ckpt['tokenizer']), device, ctx,
                      cfg['predict_file'], out_path)


def check_settings(cfg):
    """ Every setting, before any work: ranges and choices (see nanogpt_plus/settings.py), then the files. """
    check_not_empty(cfg, 'out_dir', 'init_from')
    check_positive(cfg, 'epochs', 'batch_size', 'gradient_accumulation_steps', 'log_interval')
    check_non_negative(cfg, 'block_size', 'eval_batch_size', 'lm_loss_weight', 'weight_decay', 'min_lr', 'seed')
    check_range(cfg, 'learning_rate', low=0.0, low_open=True)
    check_range(cfg, 'grad_clip', low=0.0)  # 0 turns clipping off
    check_range(cfg, 'warmup_frac', low=0.0, high=1.0)
    for beta in ('beta1', 'beta2'):
        check_range(cfg, beta, low=0.0, high=1.0, high_open=True)
    check_model_shape(cfg)
    check_system(cfg)
    if cfg['task'] and cfg['task'] not in TASKS:
        raise UserError(f"unknown task '{cfg['task']}': use {', '.join(TASKS)}")
    check_choice(cfg, 'weights', WEIGHTS)
    if cfg['weights'] != 'float32' and cfg['train_file']:
        raise UserError(f"weights={cfg['weights']} is a format for predictions (--predict_file without --train_file); "
                        f"fine-tuning trains float32 weights (--dtype=bfloat16 computes in bfloat16)")
    if cfg['init_from'] == 'resume' and not os.path.exists(os.path.join(cfg['out_dir'], LAST_CKPT)):
        raise UserError(f"init_from=resume but there is no {os.path.join(cfg['out_dir'], LAST_CKPT)}; check "
                        f"--out_dir or start a new fine-tune with --init_from=<pretrained model>")


def check_overwrite(cfg, argv):
    """ On rank 0, out_dir locked: a new fine-tune into an out_dir with checkpoints needs --overwrite=True. """
    if cfg['init_from'] == 'resume':
        return
    held = [name for name in (LAST_CKPT, BEST_CKPT) if os.path.isfile(os.path.join(cfg['out_dir'], name))]
    if not held:
        return
    if not cfg['overwrite']:
        raise refuse_overwrite(cfg['out_dir'], held[0], 'finetune.py', argv, resumable=LAST_CKPT in held)
    print(f"overwrite=True: the earlier fine-tune's checkpoints in {cfg['out_dir']} stay until this one's first "
          f"saves replace them")


def main():
    argv = sys.argv[1:]
    cfg = configure(DEFAULTS, argv, doc=__doc__)
    check_settings(cfg)
    dist_info = init_distributed(cfg['device'], cfg['backend'])
    try:
        if not cfg['train_file'] and cfg['predict_file']:
            predict_only(cfg, dist_info)
        else:
            # rank 0 holds out_dir/run.lock for the whole fine-tune (released however it ends)
            with claim_out_dir(cfg['out_dir'], dist_info, prepare=lambda: check_overwrite(cfg, argv)):
                result = finetune(cfg, dist_info)
            if result['interrupted']:
                raise Interrupted()  # ckpt_last.pt saved, resumable: exit code 75
    finally:
        destroy_distributed()


if __name__ == '__main__':
    run_main(main)
