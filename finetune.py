"""
GPT-1-style supervised fine-tuning: a pretrained GPT plus a linear head on the final hidden state of
the Extract token, trained with L3 = L2 + lm_loss_weight * L1 (the task's cross-entropy plus the
auxiliary language-modelling loss, lambda = 0.5 in the paper), for a few epochs over a labelled
JSONL file. Tasks and their JSONL fields: classification {"text", "label"}, entailment {"premise",
"hypothesis", "label"}, similarity {"text1", "text2", "label"}, multiple_choice {"context",
"choices", "label"}; their input transformations, the labels and the learning rate:
docs/finetuning.md.

Fine-tune a model of train.py (its out_dir), GPT-2 or a local HF directory, texts in the model's
tokenizer:
$ python finetune.py --task=classification --init_from=out-shakespeare-char-cpu --out_dir=out-ft \\
      --train_file=train.jsonl --val_file=val.jsonl
$ python finetune.py config/finetune_classification.py --init_from=gpt2 --train_file=... --val_file=...
$ python finetune.py ... --init_from=scratch --dataset=shakespeare_char   # no pretraining
$ torchrun --standalone --nproc_per_node=2 finetune.py ... --device=cpu   # DDP: each rank a share of each batch
$ python finetune.py ... --out_dir=out-ft --init_from=resume   # after Ctrl-C/SIGTERM (exit code 75)
$ python finetune.py --init_from=out-ft --predict_file=test.jsonl --predict_out=predictions.jsonl

out_dir/ckpt.pt holds the best model (by val accuracy) with its head, label map, special tokens and
tokenizer, ckpt_last.pt the latest training state; the last line printed is JSON: {"task": ...,
"val_acc": best val accuracy, ...}.
"""
# first, before torch is imported (seconds): from here on a signal ends the run in one line, exit
# code 75 or 0
from nanogpt_plus.signals import FINISH_AND_SAVE, GracefulExit, early_exit_request

# until the settings say which work this is, a signal's line says what it does to each
UNDECIDED = ("a fine-tune finishes its step, then saves a checkpoint; predictions alone (--predict_file "
             "without --train_file) stop at once")
EXIT_REQUEST = early_exit_request(__name__, notice=UNDECIDED)

import dataclasses
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import torch
from torch.nn import functional as F
from torch.utils.data import DistributedSampler

from configurator import Group, Schema, Setting, read_settings
from nanogpt_plus import finetuning, settings
from nanogpt_plus import optimizer as opt
from nanogpt_plus.checkpoint import (
    CHECKPOINT,
    LAST,
    Checkpointer,
    checkpoint_path,
    load_checkpoint,
    restore_training_state,
)
from nanogpt_plus.dataset import find_dataset
from nanogpt_plus.distributed import (
    GROUP_SETTINGS,
    accumulation_per_rank,
    all_reduce_sum,
    every_rank,
    grad_sync_context,
    master_decides,
    same_everywhere,
    start,
    wrap_model,
)
from nanogpt_plus.errors import Interrupted, UserError, out_of_memory_error
from nanogpt_plus.init_from import FIXED_BY_SOURCE, ModelSource, ModelSpec, check_new_model_fits, init_model
from nanogpt_plus.machine import auto_threads, compute_setup, device_type_of, resolve_device
from nanogpt_plus.metrics import MetricsLogger, WandbSpec
from nanogpt_plus.outputs import check_new_run, check_output, claim_out_dir
from nanogpt_plus.runtime import SAME_START, provenance, run_main, same_start
from nanogpt_plus.settings import non_negative, positive
from nanogpt_plus.weight_formats import WEIGHTS

# num_threads=0: the training steps' thread count is re-checked every `interval` steps, each other
# candidate timed on `probe` of them (machine.ThreadRetuner), as train.py does
THREAD_RETUNING = dict(interval=250, probe=8, window=50)

# checkpoint.py's names, in a fine-tune's roles
BEST_CKPT = CHECKPOINT  # the best model so far (by val accuracy), with its head
LAST_CKPT = LAST  # the latest training state, for --init_from=resume

# -----------------------------------------------------------------------------
# The settings and their defaults: GPT-1's fine-tuning recipe (batch 32, 3 epochs, dropout 0.1,
# warmup over 0.2% of training, lambda 0.5, lr 6.25e-5 scaled to the width); `python finetune.py
# --help` prints them with their help. A setting other entry points share has its type, range and
# help in nanogpt_plus/settings.py and its default here.
FINETUNING = Group(
    'fine-tuning (GPT-1)',
    task=Setting('', "classification | entailment | similarity | multiple_choice ('' = the "
                     "checkpoint's, when predicting or resuming)"),
    train_file=Setting('', "JSONL with labels"),
    val_file=Setting('', "JSONL with labels; the accuracy after every epoch picks the model kept "
                         "as ckpt.pt"),
    predict_file=Setting('', "JSONL without (or with ignored) labels: write predictions of the "
                             "best model"),
    predict_out=Setting('', "where the predictions go ('' = out_dir/predictions.jsonl)"),
    epochs=positive(3, "passes over the training file"),
    lm_loss_weight=Setting(0.5, "lambda in L3 = L2 + lambda * L1 (the auxiliary LM loss); 0 turns "
                                "it off", low=0),
    warmup_frac=Setting(0.002, "warm up over this fraction of all steps, then decay to min_lr by "
                               "the last step", low=0.0, high=1.0),
    eval_batch_size=non_negative(0, "examples per forward pass in evaluation; 0 = batch_size"),
    # predictions only (--predict_file without --train_file); shared with sample.py and eval.py
    weights=settings.weights('float32', choices=WEIGHTS),
)
IO = Group(
    'I/O',
    out_dir=settings.out_dir('out-finetune'),
    log_interval=settings.log_interval(10),
    overwrite=settings.overwrite(False),
    init_from=settings.init_from('scratch'),
    auto_resume=settings.auto_resume(False),
)
DATA = Group(
    'data',
    dataset=settings.dataset('openwebtext'),
    gradient_accumulation_steps=settings.gradient_accumulation_steps(1),
    batch_size=settings.batch_size(32),
    block_size=Setting(0, "0 = the source model's; smaller crops a pretrained model (a resume "
                          "keeps its own)", low=0),
)
ADAMW = Group(
    'adamw optimizer',
    learning_rate=Setting(0.0, "the peak learning rate; 0 = scaled from the model's width: 6.25e-5 "
                               "x (768 / n_embd) ** 1.5, GPT-1's rate at GPT-1's width (a resume: "
                               "the rate it used)", low=0),
    weight_decay=settings.weight_decay(0.01),
    beta1=settings.beta1(0.9),
    beta2=settings.beta2(0.999),
    grad_clip=settings.grad_clip(1.0),
)
LR_DECAY = Group(
    'learning rate decay',
    decay_lr=settings.decay_lr(True),
    min_lr=settings.min_lr(0.0),
)
WANDB = Group(
    'wandb logging',
    wandb_log=settings.wandb_log(False),
    wandb_project=settings.wandb_project('finetune'),
    wandb_run_name=settings.wandb_run_name('finetune'),
)
# the model (init_from=scratch; weights fix the architecture, dropout is this run's)
MODEL = Group(
    'model',
    n_layer=settings.n_layer(12),
    n_head=settings.n_head(12),
    n_embd=settings.n_embd(768),
    dropout=settings.dropout(0.1),
    bias=settings.bias(False),
    gelu=settings.gelu('none'),
    attention=settings.attention('flash'),
    pos=settings.pos('learned'),
    norm=settings.norm('layernorm'),
    qk_norm=settings.qk_norm(False),
    mlp_act=settings.mlp_act('gelu'),
    logit_softcap=settings.logit_softcap(0.0),
    tie_embeddings=settings.tie_embeddings(True),
)
SYSTEM = Group(
    'system',
    backend=settings.backend('auto'),
    dist_timeout=settings.dist_timeout(0),
    join_timeout=settings.join_timeout(120),
    device=settings.device('auto'),
    dtype=settings.dtype('auto'),
    compile=settings.compile(False),
    activation_checkpointing=settings.activation_checkpointing(False),
    num_threads=settings.num_threads(0),
    seed=settings.seed(1337),
)
DEFAULTS = Schema(FINETUNING, IO, DATA, MODEL, ADAMW, LR_DECAY, WANDB, SYSTEM)
# -----------------------------------------------------------------------------


@dataclass
class FinetuneRun:
    """
    What stays fixed while a fine-tune runs: settings, processes, model, optimizer, data and
    schedule.
    """
    cfg: dict
    dist_info: object  # distributed.DistInfo
    task: str
    raw_model: finetuning.FinetuneModel  # the plain module: what is saved and evaluated
    model: torch.nn.Module  # raw_model wrapped for DDP (and compiled): what the training steps run
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    ctx: object  # the autocast context of the forward passes
    data: object  # finetuning.TaskData
    special: dict  # the ids of the Start, Delim and Extract tokens
    tokenizer: object
    tokenizer_meta: dict
    source_name: str  # what the fine-tune started from, kept in its checkpoints
    provenance: dict
    sampler: DistributedSampler  # this rank's share of each epoch's permutation
    schedule: finetuning.Schedule
    checkpointer: Checkpointer
    logger: MetricsLogger
    exit_request: GracefulExit
    t0: float  # when training started, for the elapsed time in the log lines
    # num_threads=0 on a CPU (machine.AutoThreads), else None: the training steps' thread count and
    # that of the val passes, each timed on its first batch and re-checked as the load changes
    threads: object = None
    eval_threads: object = None


@dataclass
class FinetuneState:
    """
    Where a fine-tune is: the counters and the record of the epochs so far, which ckpt_last.pt saves
    and
    --init_from=resume restores. last_loss and interrupted only live as long as the process.
    """
    epoch: int = 0
    step_in_epoch: int = 0
    iter_num: int = 0
    best_val_acc: float = None
    best_epoch: int = None
    history: list = field(default_factory=list)  # a record per finished epoch (losses, accuracy)
    last_loss: float = None  # the train loss of the last logged step (each epoch's last is)
    interrupted: bool = False

    @classmethod
    def from_checkpoint(cls, ckpt):
        return cls(epoch=int(ckpt['epoch']), step_in_epoch=int(ckpt['step_in_epoch']),
                   iter_num=int(ckpt['iter_num']), best_val_acc=ckpt.get('best_val_acc'),
                   best_epoch=ckpt.get('best_epoch'), history=list(ckpt.get('history') or []))

    def saved(self):
        """ The keys ckpt_last.pt holds for from_checkpoint (iter_num is every checkpoint's). """
        return {
            'epoch': self.epoch,
            'step_in_epoch': self.step_in_epoch,
            'best_val_acc': self.best_val_acc,
            'best_epoch': self.best_epoch,
            'history': self.history
        }


def main():
    argv = sys.argv[1:]
    # the settings, read and checked by every rank, with one verdict (a config file one node lacks)
    user_cfg, failure, group = read_settings(DEFAULTS, argv, check_settings, __doc__, GROUP_SETTINGS)
    dist_info = start(failure, **group)
    # the task files are on every node, and train.py's rules give the architecture of the model
    # init_from names (0 = its block_size), with one verdict for all ranks; then all must start from
    # the same settings, code, checkpoint and task files
    imposed, resumed = every_rank(dist_info, lambda: finetuning.start(
        user_cfg.select(finetuning.TaskFiles), user_cfg.select(ModelSource),
        user_cfg.chosen(FIXED_BY_SOURCE), LAST_CKPT,
        epochs=user_cfg.epochs if user_cfg.train_file else None))
    # the fine-tune's settings: the user's with what the source imposes, a new frozen Settings
    # (user_cfg stays as given), so that every part and each checkpoint's 'config' see one set
    cfg = user_cfg.replaced(imposed)
    same_everywhere(dist_info, lambda: same_start(dict(cfg), resumed, data=finetuning.task_files(
        cfg.select(finetuning.TaskFiles)), resume_file=LAST_CKPT), SAME_START)
    if not cfg.train_file and cfg.predict_file:
        if EXIT_REQUEST is not None:  # predictions alone: nothing to save, a signal stops them
            EXIT_REQUEST.interrupt_at_once()
        return finetuning.predict_with_checkpoint(cfg.select(finetuning.PredictSpec), dist_info)
    if EXIT_REQUEST is not None:  # a fine-tune: a signal finishes the step and saves
        EXIT_REQUEST.notice = FINISH_AND_SAVE
    # the best model's predictions come after the training: their path is checked now, by rank 0,
    # which writes them (every rank learns the outcome)
    if cfg.predict_file:
        out_path = finetuning.predictions_path(cfg.predict_out, cfg.out_dir)
        master_decides(dist_info, lambda: check_output(
            out_path, 'predict_out', cfg.overwrite, output_kind='predictions',
            inputs={k: cfg[k] for k in ('train_file', 'val_file', 'predict_file')}))
    # rank 0 holds out_dir/run.lock for the whole fine-tune; a new one over an earlier one's
    # checkpoints needs
    # --overwrite=True (or continues it, with --init_from=resume, when its training state is there)
    guarded = [LAST_CKPT, BEST_CKPT] if cfg.init_from != 'resume' else []
    with claim_out_dir(cfg.out_dir, dist_info, prepare=lambda: check_new_run(
            cfg.out_dir, guarded, 'finetune.py', argv, cfg.overwrite, resume_file=LAST_CKPT)):
        result = finetune(cfg, dist_info)
    if result['interrupted']:
        raise Interrupted()  # ckpt_last.pt saved, resumable: exit code 75


def check_settings(cfg):
    """
    Every setting, before any work: types, choices and ranges (settings.py), then the combinations
    and files.
    """
    DEFAULTS.check(cfg)
    settings.check_model_shape(cfg.n_embd, cfg.n_head, cfg.pos)
    settings.check_auto_resume(cfg.auto_resume, cfg.overwrite)
    if cfg.init_from == 'scratch':  # a new model in this machine's memory, as train.py checks one
        check_new_model_fits(dataclasses.replace(cfg.select(ModelSpec), block_size=cfg.block_size or 1024),
                             dataset=cfg.dataset, batch_size=cfg.batch_size, attention=cfg.attention,
                             on_cpu=resolve_device(cfg.device) == 'cpu')
    if cfg.task and cfg.task not in finetuning.TASKS:
        raise UserError(f"unknown task '{cfg.task}': use {', '.join(finetuning.TASKS)}")
    if cfg.weights != 'float32' and cfg.train_file:
        raise UserError(
            f"weights={cfg.weights} is a format for predictions (--predict_file without --train_file); "
            f"fine-tuning trains float32 weights (--dtype=bfloat16 computes in bfloat16)")


def finetune(cfg, dist_info):
    """
    Fine-tune, evaluate after every epoch, keep the best model; returns the final result dict.
    """
    run, state = setup(cfg, dist_info)
    try:
        while state.epoch < cfg.epochs and not state.interrupted:
            run_epoch(run, state)
            if state.interrupted:
                save_last(run, state,
                          f"interrupted at epoch {state.epoch}, step {state.step_in_epoch}")
                if run.dist_info.master:
                    print(
                        f"stopped cleanly; continue with --init_from=resume --out_dir={cfg.out_dir} (exit 75)"
                    )
            else:
                end_epoch(run, state)
    except torch.OutOfMemoryError:  # torch.cuda.OutOfMemoryError: one line that says what to change
        raise out_of_memory_error(state.iter_num, run.checkpointer.path(LAST_CKPT),
                                  fsdp=False) from None
    finally:
        run.exit_request.uninstall()
        run.logger.close()
    return finish(run, state)


def setup(cfg, dist_info):
    """
    Everything the loop needs (FinetuneRun) and the state it starts from: new, or ckpt_last.pt's.
    """
    accum = accumulation_per_rank(cfg.gradient_accumulation_steps, dist_info)
    device = dist_info.device
    resume = cfg.init_from == 'resume'
    dtype, ctx, compile_model, _ = compute_setup(device, cfg.dtype, cfg.compile,
                                                 num_threads=cfg.num_threads, peak=False)
    say = print if dist_info.master else lambda line: None
    threads = auto_threads(device, cfg.num_threads, 'training step', say=say, **THREAD_RETUNING)
    eval_threads = auto_threads(device, cfg.num_threads, 'val batch', say=say,
                                **finetuning.PREDICTION_RETUNING)
    # kept in the checkpoints
    run_provenance = dict(provenance(device), dtype=dtype, world_size=dist_info.world_size)
    if dist_info.master:
        print("provenance: " + json.dumps(run_provenance))
    if not cfg.task and not resume:  # (check_settings refused any other unknown task)
        raise UserError(f"unknown task '': pass --task=one of {', '.join(finetuning.TASKS)}")

    # the model: the same initial weights on every rank (head, new embeddings), then per-rank
    # dropout
    torch.manual_seed(cfg.seed)
    gpt, tokenizer_meta, source = load_source(cfg)
    # 0 = the rate for the source model's width, known only now: from here on the run's settings
    # are cfg with the number used, a new Settings (the one read stays as it was), which every
    # checkpoint's 'config' and the result keep
    learning_rate, how = finetuning.resolve_learning_rate(
        cfg.select(finetuning.Recipe), gpt.config.n_embd, source if resume else None)
    cfg = cfg.replaced({'learning_rate': learning_rate})
    recipe = cfg.select(finetuning.Recipe)
    if dist_info.master:
        print(f"learning rate {learning_rate:.4g} ({how})")
    task = cfg.task or source.get('task') if resume else cfg.task
    if resume and task != source.get('task'):
        raise UserError(
            f"--task={task} but the fine-tune in {cfg.out_dir} is {source.get('task')}; "
            f"drop --task to resume it")
    raw_model, special, tokenizer, data = finetuning.task_model_and_data(
        gpt, tokenizer_meta, source, task=task, spec=cfg.select(finetuning.TaskModelSpec),
        files=cfg.select(finetuning.TaskFiles))
    raw_model.to(device)
    if not cfg.val_file and dist_info.master:
        print("warning: no --val_file; the model of the last epoch is kept and val_acc is null",
              file=sys.stderr)
    torch.manual_seed(cfg.seed + dist_info.rank)  # dropout differs per rank; data order does not

    optimizer = finetuning.configure_optimizers(raw_model, recipe, device_type_of(device))
    scaler = opt.make_grad_scaler(device_type_of(device), dtype)
    model = wrap_model(raw_model, dist_info, compile_model)
    sampler = DistributedSampler(range(len(data.train_encoded)),
                                 num_replicas=dist_info.world_size,
                                 rank=dist_info.rank,
                                 shuffle=True,
                                 seed=cfg.seed,
                                 drop_last=False)
    schedule = finetuning.Schedule.for_run(len(sampler), recipe, accum)
    state = FinetuneState()
    if resume:
        restore_training_state(source, optimizer, scaler, dist_info)
        # a --beta2 given now applies
        opt.apply_settings(optimizer, cfg.select(opt.AdamWSpec), master=dist_info.master)
        state = FinetuneState.from_checkpoint(source)
        if dist_info.master:
            print(f"resuming the fine-tune at epoch {state.epoch}, step {state.step_in_epoch} of "
                  f"{schedule.steps_per_epoch}")
    # a resume continues its checkpoint's wandb run too
    logger = MetricsLogger.for_run(cfg.out_dir, cfg.select(WandbSpec), config_record=dict(cfg),
                                   enabled=dist_info.master, resumed=source if resume else None)
    logger.start(state.iter_num, cfg.init_from)
    # a resumed fine-tune still names the model it started from, not its own ckpt_last.pt
    source_name = source.get('source_model', cfg.init_from) if resume else cfg.init_from
    # ckpt.pt, ckpt_last.pt
    checkpointer = Checkpointer(cfg.out_dir, dist_info, raw_model, optimizer)
    return FinetuneRun(cfg, dist_info, task, raw_model, model, optimizer, scaler, ctx, data,
                       special, tokenizer, tokenizer_meta, source_name, run_provenance, sampler,
                       schedule, checkpointer, logger, EXIT_REQUEST or GracefulExit().install(),
                       time.time(), threads, eval_threads), state


def load_source(cfg):
    """
    (gpt, tokenizer description, source checkpoint or {}) for init_from, before the special tokens:
    init_model's, with the model settings for scratch (and the dataset's tokenizer) and ckpt_last.pt
    for resume.
    """
    init_from = cfg.init_from
    if init_from not in ('scratch', 'resume'):
        source_path = checkpoint_path(init_from, cfg.out_dir)
        target = os.path.abspath(os.path.join(cfg.out_dir, BEST_CKPT))
        if source_path is not None and os.path.abspath(source_path) == target:
            raise UserError(
                f"init_from {init_from} is the checkpoint in --out_dir, which fine-tuning would "
                f"overwrite; pass a different --out_dir (or --init_from=resume to continue an "
                f"interrupted fine-tune)")
    # 0 means the source model's; scratch has none
    spec = dataclasses.replace(cfg.select(ModelSpec), block_size=cfg.block_size or 1024)
    # the tokenizer
    data = find_dataset(cfg.dataset, splits=()) if init_from == 'scratch' else None
    gpt, tokenizer_meta, source = init_model(init_from, cfg.out_dir, dataset=data, spec=spec,
                                             dropout=cfg.dropout, resume_file=LAST_CKPT)
    return gpt, tokenizer_meta, source or {}


def run_epoch(run, state):
    """
    The optimizer steps of epoch state.epoch from state.step_in_epoch on; a signal stops it early.
    """
    run.sampler.set_epoch(state.epoch)
    order = list(run.sampler)  # this rank's examples for the epoch, in order
    # the first epoch's first step only: later epochs build no timing batch
    if run.threads is not None and not run.threads.chosen and \
            state.step_in_epoch < run.schedule.steps_per_epoch:
        run.threads.choose(*timing_pass(run, state, order))
    while state.step_in_epoch < run.schedule.steps_per_epoch:
        t0 = time.perf_counter()
        lr, step_losses, grad_norm = train_step(run, state, order)
        last_of_epoch = state.step_in_epoch == run.schedule.steps_per_epoch
        if state.iter_num % run.cfg.log_interval == 0 or last_of_epoch:
            log_step(run, state, lr, step_losses, grad_norm)
        if run.threads is not None:
            run.threads.observe(time.perf_counter() - t0)
        if run.exit_request.should_stop(run.dist_info):  # every step: torchrun kills soon after
            state.interrupted = True
            return


def timing_pass(run, state, order):
    """
    (work, flops) for choosing the CPU thread count: a forward/backward of the plain model on the
    step's first micro-batch, as train_step runs it, leaving no gradients (AutoThreads restores the
    RNG that dropout draws from).
    """
    b = finetuning.step_batches(run.data, run.special, run.schedule, state.step_in_epoch, order,
                                run.dist_info.device)[0]
    lm_targets = b['lm_targets'] if run.cfg.lm_loss_weight > 0 else None

    def fwd_bwd():
        with run.ctx:
            logits, lm_sum = run.raw_model(b['idx'], b['extract_pos'], b['choice_mask'], lm_targets)
        loss = F.cross_entropy(logits, b['labels'], reduction='sum')
        (loss + lm_sum if lm_targets is not None else loss).backward()
        run.raw_model.zero_grad(set_to_none=True)
    return fwd_bwd, 6 * run.raw_model.gpt.get_num_params() * b['idx'].numel()


def train_step(run, state, order):
    """
    One optimizer step over this rank's micro-batches of the step's global batch. Returns the
    learning rate, this rank's (task loss, LM loss) of the step as tensors (no sync), and the
    gradient norm.
    """
    s = run.schedule
    cfg = run.cfg
    lr = opt.set_learning_rate(run.optimizer, s.rates.rate(state.iter_num))
    batches = finetuning.step_batches(run.data, run.special, s, state.step_in_epoch, order,
                                      run.dist_info.device)
    # normalise by the counts of the whole global batch (all micro-batches, all ranks): the gradient
    # is then exactly that of one big batch, for any world size and accumulation
    n_ex, n_tok = finetuning.global_batch_counts(run.data, run.sampler, s, state.step_in_epoch)
    step_cls = torch.zeros((), device=run.dist_info.device)
    step_lm = torch.zeros((), device=run.dist_info.device)
    for k, b in enumerate(batches):
        with grad_sync_context(run.model, k == len(batches) - 1):
            # GPT-1's L3 = L2 + lambda * L1 of the micro-batch, as its share of the global batch's
            # mean
            with run.ctx:
                logits, lm_sum = run.model(b['idx'], b['extract_pos'], b['choice_mask'],
                                           b['lm_targets'] if cfg.lm_loss_weight > 0 else None)
            cls_loss = F.cross_entropy(logits, b['labels'], reduction='sum') / n_ex
            lm_loss = lm_sum / max(n_tok, 1.0) if cfg.lm_loss_weight > 0 else None
            loss = cls_loss + cfg.lm_loss_weight * lm_loss if lm_loss is not None else cls_loss
            # DDP averages gradients over the W ranks; scale up so they add up instead
            run.scaler.scale(loss * run.dist_info.world_size).backward()
        step_cls += cls_loss.detach()
        if lm_loss is not None:
            step_lm += lm_loss.detach()
    grad_norm = opt.optimizer_step(run.model, run.optimizer, run.scaler, cfg.grad_clip)
    state.iter_num += 1
    state.step_in_epoch += 1
    return lr, (step_cls, step_lm), grad_norm


def log_step(run, state, lr, step_losses, grad_norm):
    """
    The step's losses summed over ranks (one sync, at log time only): a line and a metrics record.
    """
    step_cls, step_lm = all_reduce_sum([t.item() for t in step_losses], run.dist_info)
    state.last_loss = step_cls + run.cfg.lm_loss_weight * step_lm
    if not math.isfinite(step_cls + step_lm):
        raise UserError(
            f"the loss is {step_cls + step_lm} at step {state.iter_num}; lower the learning rate "
            f"(or use --dtype=float32)")
    if not run.dist_info.master:
        return
    dt = time.time() - run.t0
    print(
        f"epoch {state.epoch} step {state.iter_num}/{run.schedule.total_steps}: loss {state.last_loss:.4f} "
        f"(task {step_cls:.4f}, lm {step_lm:.4f}), lr {lr:.2e}, {dt:.1f}s")
    run.logger.log({
        'type': 'iter',
        'iter': state.iter_num,
        'epoch': state.epoch,
        'loss': state.last_loss,
        'task_loss': step_cls,
        'lm_loss': step_lm,
        'lr': lr,
        'grad_norm': float(grad_norm) if grad_norm is not None else None
    })


def end_epoch(run, state):
    """
    After the last step of an epoch: evaluate, keep the model if it is the best so far, save the
    state.
    """
    record = evaluate_epoch(run, state)
    state.history.append(record)
    run.logger.log(dict(record, type='eval'))  # (rank 0's logger writes; the others' do nothing)
    # without a val file every epoch counts as the best, so ckpt.pt is the last epoch's model
    if 'val_acc' not in record or state.best_val_acc is None or record[
            'val_acc'] > state.best_val_acc:
        state.best_val_acc, state.best_epoch = record.get('val_acc'), state.epoch  # the best so far
        path = run.checkpointer.path(BEST_CKPT)
        run.checkpointer.write(BEST_CKPT,
                               lambda gathered: checkpoint(run,
                                                           state,
                                                           epoch=state.epoch,
                                                           val_acc=state.best_val_acc,
                                                           val_loss=record.get('val_loss'),
                                                           history=state.history),
                               state.iter_num,
                               training_state=False,
                               done=f"saved the best model so far to {path}")
    state.epoch += 1
    state.step_in_epoch = 0
    save_last(run, state, f"end of epoch {state.epoch - 1}")


def evaluate_epoch(run, state):
    """
    The epoch's record: its train loss and, with a val file, the accuracy on it (each rank a strided
    share).
    """
    record = {'epoch': state.epoch, 'iter': state.iter_num, 'train_loss': state.last_loss}
    if run.data.val_encoded is None:
        return record
    correct, seen, loss_sum = finetuning.evaluate_val(
        run.raw_model, run.data, run.special, run.cfg.eval_batch_size or run.cfg.batch_size,
        run.ctx, run.dist_info, threads=run.eval_threads)
    record.update(val_acc=correct / seen, val_loss=loss_sum / seen)
    if run.dist_info.master:
        print(
            f"epoch {state.epoch}: val accuracy {correct / seen:.4f} ({int(round(correct))}/{int(round(seen))}), "
            f"val loss {loss_sum / seen:.4f}")
    return record


def checkpoint(run, state, **extra):
    """ The fine-tune's checkpoint dict at this state: the GPT, its head and labels, then extra. """
    return finetuning.finetune_checkpoint(run.raw_model, state.iter_num, run.cfg,
                                          run.tokenizer_meta, run.provenance, run.data.label_map,
                                          run.special, run.source_name,
                                          wandb_id=run.logger.wandb_id, **extra)


def save_last(run, state, reason):
    """
    out_dir/ckpt_last.pt: the full training state (all ranks call this: RNG states come from every
    rank).
    """
    scaler = run.scaler.state_dict() if run.scaler.is_enabled() else None
    path = run.checkpointer.path(LAST_CKPT)
    run.checkpointer.write(LAST_CKPT, lambda gathered: checkpoint(
        run, state, optimizer=gathered.optimizer, rng=gathered.rng, scaler=scaler, **state.saved()),
        state.iter_num, done=f"saved the training state to {path} ({reason})")


def finish(run, state):
    """
    The result dict (printed as the last line, as JSON), after predictions of the best model if
    asked.
    """
    cfg = run.cfg
    result = {'task': run.task, 'val_acc': state.best_val_acc, 'best_epoch': state.best_epoch,
              'epochs': state.epoch, 'steps': state.iter_num, 'learning_rate': cfg.learning_rate,
              'out_dir': cfg.out_dir, 'interrupted': state.interrupted}
    if cfg.predict_file and not state.interrupted and run.dist_info.master:
        best = load_checkpoint(os.path.join(cfg.out_dir, BEST_CKPT))
        best_model = finetuning.model_from_finetune_checkpoint(best).to(run.dist_info.device)
        finetuning.write_predictions(
            best_model, best, run.special, run.tokenizer, device=run.dist_info.device, ctx=run.ctx,
            path=cfg.predict_file, batch_size=cfg.eval_batch_size or cfg.batch_size,
            out_path=finetuning.predictions_path(cfg.predict_out, cfg.out_dir),
            threads=run.eval_threads)
    if run.dist_info.master:
        print(json.dumps(result))
    return result


if __name__ == '__main__':
    run_main(main)
