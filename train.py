"""
Train a GPT on a prepared dataset: in one process (CPU, CUDA or MPS), or in several under torchrun
with DDP or FSDP2 (--parallelism=fsdp). nanoGPT's commands work as-is; several machines and SLURM:
docs/training.md.

$ python train.py config/train_shakespeare_char.py
$ python train.py config/train_shakespeare_char_cpu.py     # nanoGPT's laptop command, ~minutes
$ torchrun --standalone --nproc_per_node=4 train.py        # DDP over the 4 GPUs of one machine
$ torchrun --standalone --nproc_per_node=2 train.py config/train_shakespeare_char_cpu.py --device=cpu
$ python train.py config/train_shakespeare_char.py --init_from=resume   # continue a stopped run

A run stopped by SIGTERM/SIGINT/SIGHUP saves first and exits with code 75 ("interrupted,
resumable"); a finished one 0. How it is built: setup() makes a Run (model, optimizer, data,
checkpointer: fixed for the whole run) and a TrainState (what changes every iteration);
iteration() is one step of the loop, written out top to bottom, and checkpoint() is what a ckpt.pt
holds. The settings are declared below; --help lists them.
"""
# first, before torch is imported (seconds): from here on a signal ends the run in one line, with
# exit code 75
from nanogpt_plus.signals import GracefulExit, early_exit_request

EXIT_REQUEST = early_exit_request(__name__)

import functools
import json
import math
import sys
import time
from dataclasses import dataclass

import torch

from configurator import Group, Schema, Setting, read_settings
from model import GPT
from nanogpt_plus import distributed, progress, settings
from nanogpt_plus import optimizer as opt
from nanogpt_plus.checkpoint import Checkpointer, CheckpointPolicy, restore_training_state, rng_state, set_rng_state
from nanogpt_plus.dataloader import DataSpec, TokenWindowLoader, training_data
from nanogpt_plus.distributed import grad_sync_context, local_param_count, wrap_model
from nanogpt_plus.errors import Interrupted, UserError, non_finite_loss, out_of_memory_error
from nanogpt_plus.init_from import (
    FIXED_BY_SOURCE,
    ModelSource,
    ModelSpec,
    ResumeSpec,
    check_new_model_fits,
    init_training_model,
    padded_tokenizer_size,
    resume_refusal,
    source_settings,
)
from nanogpt_plus.machine import choose_threads, compute_setup, device_type_of
from nanogpt_plus.metrics import MetricsLogger, WandbSpec
from nanogpt_plus.outputs import OutDirSpec, claim_out_dir, prepare_out_dir
from nanogpt_plus.reference import ReferenceCheck
from nanogpt_plus.runtime import SAME_START, provenance, run_main, same_start
from nanogpt_plus.settings import flag, non_negative, positive

# -----------------------------------------------------------------------------
# The settings and their defaults: nanoGPT's (GPT-2 124M on OpenWebText) in its order, then ours;
# `python train.py --help` prints them with their help. A shared setting's type, range and help are
# in nanogpt_plus/settings.py, its default here.
# I/O
IO = Group(
    'I/O',
    out_dir=settings.out_dir('out'),
    eval_interval=positive(2000, "evaluate the train and val loss every N iterations (and "
                                 "checkpoint)"),
    log_interval=settings.log_interval(1),
    eval_iters=positive(200, "batches per split in each evaluation"),
    eval_only=flag(False, "True: evaluate once at iteration 0, then exit"),
    always_save_checkpoint=flag(True, "True: save at every evaluation; False: only when the val "
                                      "loss improved"),
    checkpoint_interval=non_negative(0, "save the training state every N iterations; "
                                        "0 = at each evaluation"),
    keep_checkpoints=non_negative(0, "K > 0: also keep the last K saves as ckpt_<iter>.pt; "
                                     "0 = ckpt.pt only"),
    overwrite=settings.overwrite(False),
    init_from=settings.init_from('scratch'),
    resume_from=Setting('', "with init_from='resume': go back to a snapshot, its iteration (2000) "
                            "or name (ckpt_2000.pt); '' = ckpt.pt"),
    auto_resume=settings.auto_resume(False),
    reference=Setting('', "the reference curve each evaluation is compared with: '' = the one in "
                          "config/reference/ whose data and settings match, a file of "
                          "scripts/make_reference.py's, or 'none'"),
)
# in-loop evaluation (nanogpt_plus/evaluation/periodic.py; hellaswag_file's default is evaluation.HELLASWAG_FILE,
# written out here: the evaluation code loads only when a run scores HellaSwag)
INLOOP = Group(
    'zero-shot HellaSwag and samples while training',
    hellaswag_interval=non_negative(0, "score HellaSwag (eval.py's scoring) every N "
                                       "iterations; 0 = off"),
    hellaswag_examples=non_negative(0, "the first N validation examples only; 0 = all 10,042"),
    hellaswag_file=Setting('data/hellaswag/hellaswag_val.jsonl', "this default is downloaded once (as "
                                                                 "eval.py does), or a JSONL file of yours"),
    sample_interval=non_negative(0, "every N iterations print sample_tokens greedy tokens after "
                                    "sample_prompt; 0 = off"),
    sample_tokens=positive(32, "tokens in each in-loop sample"),
    sample_prompt=Setting('', "'' = the end-of-text token (a character tokenizer's first "
                              "character)"),
)
# wandb logging
WANDB = Group(
    'wandb logging',
    wandb_log=settings.wandb_log(False),
    wandb_project=settings.wandb_project('owt'),
    wandb_run_name=settings.wandb_run_name('gpt2'),
)
# data
DATA = Group(
    'data',
    dataset=settings.dataset('openwebtext'),
    data_order=settings.data_order('random'),
    gradient_accumulation_steps=settings.gradient_accumulation_steps(5 * 8),
    batch_size=settings.batch_size(12),
    block_size=settings.block_size(1024),
)
# model
MODEL = Group(
    'model',
    n_layer=settings.n_layer(12),
    n_head=settings.n_head(12),
    n_embd=settings.n_embd(768),
    dropout=settings.dropout(0.0),
    bias=settings.bias(False),
    gelu=settings.gelu('none'),
    attention=settings.attention('flash'),
    # the modern options (config/train_*_fast.py, *_speedrun.py); the defaults are GPT-2's
    pos=settings.pos('learned'),
    norm=settings.norm('layernorm'),
    qk_norm=settings.qk_norm(False),
    mlp_act=settings.mlp_act('gelu'),
    logit_softcap=settings.logit_softcap(0.0),
    tie_embeddings=settings.tie_embeddings(True),
)
# adamw optimizer (and Muon)
ADAMW = Group(
    'adamw optimizer',
    learning_rate=settings.learning_rate(6e-4),
    max_iters=non_negative(600000, "the last iteration (training stops after it)"),
    weight_decay=settings.weight_decay(1e-1),
    beta1=settings.beta1(0.9),
    beta2=settings.beta2(0.95),
    grad_clip=settings.grad_clip(1.0),
    optimizer=settings.optimizer('adamw'),
    muon_lr=settings.muon_lr(0.02),
    muon_momentum=settings.muon_momentum(0.95),
    muon_weight_decay=settings.muon_weight_decay(0.0),
    muon_ns_steps=settings.muon_ns_steps(5),
)
# the spike guard
SPIKE_GUARD = Group(
    "the spike guard (llm.c's -sl/-sg)",
    skip_loss_z=Setting(0.0, "skip an update whose loss is more than this many standard deviations "
                             "above its mean over the last 128 steps; 0.0 = off", low=0),
    skip_grad_z=Setting(0.0, "the same for the gradient norm; 0.0 = off", low=0),
)
# learning rate decay
LR_DECAY = Group(
    'learning rate decay',
    decay_lr=settings.decay_lr(True),
    lr_schedule=Setting('cosine', "'cosine' (nanoGPT) or 'wsd': warmup, constant, then a linear "
                                  "cooldown to min_lr over the last cooldown_frac of "
                                  "lr_decay_iters", choices=opt.LR_SCHEDULES),
    cooldown_frac=Setting(0.2, "lr_schedule='wsd': the fraction of lr_decay_iters spent cooling "
                               "down", low=0.0, high=1.0),
    warmup_iters=non_negative(2000, "iterations of the linear warmup"),
    lr_decay_iters=non_negative(600000, "where the cosine ends; Chinchilla puts it at about "
                                        "max_iters"),
    min_lr=settings.min_lr(6e-5),
)

# system
SYSTEM = Group(
    'system',
    backend=settings.backend('auto'),
    dist_timeout=settings.dist_timeout(0),
    join_timeout=settings.join_timeout(120),
    parallelism=Setting('ddp', "under torchrun: 'ddp' (a full model copy per rank) or 'fsdp' (shard the "
                               "model, FSDP2)", choices=('ddp', 'fsdp')),
    device=settings.device('auto'),
    dtype=settings.dtype('auto'),
    compile=settings.compile(None),
    activation_checkpointing=settings.activation_checkpointing(False),
    num_threads=settings.num_threads(0),
    seed=settings.seed(1337),
)

DEFAULTS = Schema(IO, INLOOP, WANDB, DATA, MODEL, ADAMW, SPIKE_GUARD, LR_DECAY, SYSTEM)
# -----------------------------------------------------------------------------


@dataclass(frozen=True)
class LoopSettings:
    """ The settings the loop itself reads (setup() hands the others to the parts it builds). """
    out_dir: str
    eval_interval: int
    eval_iters: int
    eval_only: bool
    log_interval: int
    max_iters: int
    batch_size: int  # per micro-step: MFU's sequences
    grad_clip: float
    skip_grad_z: float  # > 0: the spike guard reads every step's grad norm


@dataclass
class Run:
    """ What setup() builds once and the loop only reads. """
    loop: LoopSettings
    schedule: opt.LRSchedule  # the learning rate of each iteration
    config_record: dict  # every setting, as each checkpoint's 'config' keeps them
    dist_info: object  # distributed.DistInfo: rank, world size, device
    ctx: object  # the autocast context of forward passes (a no-op in float32)
    model: torch.nn.Module  # what trains: the GPT, compiled, in DDP or sharded in place (FSDP)
    raw_model: GPT  # the plain GPT inside `model`: checkpoints, MFU
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # enabled for float16 only
    train_loader: TokenWindowLoader  # the one stream of training batches (checkpointed)
    eval_loaders: dict  # {'train': ..., 'val': ...}: fixed streams, rewound before every evaluation
    checkpointer: Checkpointer  # when and where ckpt.pt is written; it keeps the best val loss
    tasks: object  # periodic.PeriodicTasks (in-loop HellaSwag and samples), or None
    logger: MetricsLogger
    tokenizer_meta: dict  # the tokenizer description, stored in every checkpoint
    # {split: its bytes per token} (rank 0; None where unknown): the evaluation's bits per byte
    bytes_per_token: dict
    provenance: dict  # versions, git commit, device: printed at start-up, kept in every checkpoint
    grad_accum: int  # micro-steps per optimizer step in this process
    tokens_per_iter: int
    peak_flops: float  # the device's peak FLOP/s for MFU (rank 0 only: None on the others)
    thread_retuner: object = None  # threads.ThreadRetuner (num_threads=0 on a CPU), or None
    # reference.ReferenceCheck: the reference curve this run's settings match (rank 0's; none: says nothing)
    reference: object = None


@dataclass
class TrainState:
    """ What changes from one iteration to the next. """
    spike_guard: object = None  # spike_guard.SpikeGuard (its running statistics), or None when off
    iter_num: int = 0
    local_iter_num: int = 0  # iterations run by this process (0 again after a resume)
    running_mfu: float = None  # None until this process has run 5 iterations, then a moving average
    loader_state: dict = None  # the training loader before this iteration's batches: resumed there
    batch: tuple = None  # (X, Y) of this iteration's first micro-step
    lap_start: float = 0.0  # time.time() at the end of the previous iteration


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    # SIGINT/SIGTERM set a flag: one during set-up (minutes for a big model) stops the run after it
    exit_request = EXIT_REQUEST or GracefulExit().install()
    try:
        # the settings, read and checked by every rank, then one verdict on them: a config file one
        # node lacks stops every rank in one line, after the process group is formed
        user_cfg, failure, group = read_settings(DEFAULTS, argv, check_settings, __doc__,
                                                 distributed.GROUP_SETTINGS)
        dist_info = distributed.start(failure, **group)
        # the model's source fixes its architecture (a resume: its optimizer too; auto_resume:
        # init_from), and a finished run is refused, with one verdict: a node lacking the file stops
        # every rank in one line
        chosen = user_cfg.chosen(FIXED_BY_SOURCE)  # the user's own values of those: each must agree
        imposed, resumed = distributed.every_rank(dist_info, lambda: source_settings(
            user_cfg.select(ModelSource), chosen, resume=user_cfg.select(ResumeSpec)))
        # the run's settings: the user's as read, with what the source imposes in place of theirs,
        # built once as a new frozen Settings (user_cfg stays as given). One object rather than
        # `imposed` handed to each part: every part of the run, and each checkpoint's 'config',
        # must see the same values (a resume's n_layer in the model, the memory check, the record)
        cfg = user_cfg.replaced(imposed)
        # a resume or given weights: their model with this run's batch must fit as a new one must
        # (--batch_size=200000 used to fail in the CPU's allocator); one verdict, which every rank
        # joins even where it starts a new model (checked with the settings): a node whose
        # auto_resume found no checkpoint must reach the comparison below that says so
        distributed.every_rank(dist_info, lambda: cfg.init_from == 'scratch' or check_new_model_fits(
            cfg.select(ModelSpec), dataset=cfg.dataset, batch_size=cfg.batch_size,
            attention=cfg.attention, on_cpu=device_type_of(dist_info.device) == 'cpu'))
        # every rank starts from the same settings, commit and checkpoint, else all stop in one line
        distributed.same_everywhere(dist_info, lambda: same_start(dict(cfg), resumed), SAME_START)
        # rank 0 holds out_dir/run.lock for the whole run, set-up included (released however the run
        # ends); a new run over an earlier one is refused, suggesting a resume only where these
        # settings would resume it
        why_not_resume = functools.partial(resume_refusal, cfg.out_dir, chosen, cfg.max_iters)
        prepare = functools.partial(prepare_out_dir, cfg.select(OutDirSpec), 'train.py', argv,
                                    why_not_resume)
        with claim_out_dir(cfg.out_dir, dist_info, prepare=prepare):
            finished = train(cfg, dist_info, exit_request)
    finally:
        exit_request.uninstall()
    if not finished:
        raise Interrupted()  # saved and resumable: exit code 75


def check_settings(cfg):
    """
    Every setting, before any work: its type, choices and range, then their combinations and a new
    model's first step in this machine's memory (settings.check_training).
    """
    DEFAULTS.check(cfg)
    settings.check_training(cfg)


def train(cfg, dist_info, exit_request):
    """ Train to iteration max_iters (True: the final checkpoint is saved) or a signal (False). """
    run, state = setup(cfg, dist_info)
    try:
        # a signal during set-up: the run stops before its first step, with nothing to save
        if exit_request.should_stop(dist_info):
            if dist_info.master:
                print(
                    f"stopped before iter {state.iter_num}: a signal came during set-up; nothing new to save"
                )
            return False
        while True:
            finished = iteration(run, state, exit_request)
            if finished is not None:
                return finished
    except torch.OutOfMemoryError:  # torch.cuda.OutOfMemoryError: one line that says what to change
        raise out_of_memory_error(state.iter_num, run.checkpointer.path()) from None
    finally:
        run.logger.close()


def iteration(run, state, exit_request):
    """ One iteration: None to go on, True when the run is complete, False after a signal. """
    loop, dist_info = run.loop, run.dist_info
    build = functools.partial(checkpoint, run, state)  # what a save at this iteration holds
    # the schedule's rate for this iteration, on every parameter group (Muon's scaled to muon_lr)
    lr = opt.set_learning_rate(run.optimizer, run.schedule.rate(state.iter_num))
    # HellaSwag and a sample when due, then the train/val loss, after which the checkpointer may
    # save. A signal ends a long pass between its batches (poll: every rank agrees), and the run
    # stops here, saving this state
    poll = functools.partial(exit_request.should_stop, dist_info)
    scored = run.tasks is not None and run.tasks.run(state.iter_num, run.model, run.raw_model,
                                                     run.logger, poll)
    evaluating = state.iter_num % loop.eval_interval == 0
    val_loss = evaluate(run, state, lr, poll) if evaluating and not exit_request.agreed else None
    saved = val_loss is not None and run.checkpointer.evaluated(state.iter_num, val_loss, build)
    if exit_request.agreed:
        return stop_cleanly(run, state, build)
    if state.iter_num == 0 and loop.eval_only:
        return True
    if run.checkpointer.due(state.iter_num, state.local_iter_num) and not saved:
        run.checkpointer.save(state.iter_num, build)

    # forward and backward over the micro-batches; DDP all-reduces the gradients once, after the
    # last backward. This rank's loss of the step: a tensor, so that no micro-step waits for the device
    step_loss = torch.zeros((), device=dist_info.device)
    # a step of many micro-batches hears a signal between them too (hours, with a huge
    # gradient_accumulation_steps): it then stops as if before this iteration, at its RNG state
    rng_at_start = rng_state() if run.grad_accum > 1 else None
    for micro_step in range(run.grad_accum):
        if stop_between_micro_steps(micro_step, exit_request, dist_info):
            # the loader's resume point is this iteration's start already
            set_rng_state(rng_at_start)
            run.optimizer.zero_grad(set_to_none=True)  # no update from a part of the step
            return stop_cleanly(run, state, build)
        last = micro_step == run.grad_accum - 1
        with grad_sync_context(run.model, sync=last):
            X, Y = state.batch
            with run.ctx:
                _, loss = run.model(X, Y)
                loss = loss / run.grad_accum  # the step's loss is the micro-batches' mean
            # fetch the next batch now: on a GPU it loads while the forward pass still runs
            if last:
                # a checkpoint of this step resumes at the next batch
                state.loader_state = run.train_loader.state_dict()
            try:
                state.batch = run.train_loader.next_batch()
            except UserError as e:
                # this rank's next batch is unusable: finish the step with the other ranks, then all
                # stop at the agreement below, with this error (not one rank alone)
                exit_request.fail(e)
            # the scaler multiplies float16 losses, so that small gradients survive
            run.scaler.scale(loss).backward()
        step_loss += loss.detach()

    # unscale and clip the gradients, then take the update, or skip it when the spike guard says so
    guard = state.spike_guard
    grad_norm = opt.unscale_and_clip(run.model, run.optimizer, run.scaler, loop.grad_clip,
                                     measure=loop.skip_grad_z > 0)
    # the step's loss and grad norm as floats (a host sync and an all-reduce) only where they are
    # used: at log steps, and every step for the spike guard; a non-finite loss stops the run there,
    # before the update
    logging = state.iter_num % loop.log_interval == 0
    if logging or guard is not None:
        lossf, grad_norm = opt.read_step(step_loss, grad_norm, dist_info)
        if not math.isfinite(lossf):
            failure = non_finite_loss(lossf, state.iter_num, run.checkpointer.path())
            distributed.fail_everywhere(failure, dist_info)
    spike = guard.check(lossf, grad_norm) if guard is not None else None
    if spike is None:
        opt.take_update(run.optimizer, run.scaler)
    else:
        opt.skip_update(run.optimizer, run.scaler)  # the weights and AdamW state stay as they were
        if dist_info.master:
            print(f"iter {state.iter_num}: skipped the update: {spike.describe()}")
            run.logger.log(dict(spike.record(state.iter_num), skipped_updates=guard.skipped))

    # timing and logging: the time since the previous iteration, evaluations and saves included
    now = time.time()
    dt = now - state.lap_start
    state.lap_start = now
    if logging:
        log_iteration(run, state, lossf, grad_norm, lr, dt)
    # on a CPU with num_threads=0, ordinary iterations re-check the thread count as the load changes
    if run.thread_retuner is not None and not (evaluating or scored) and state.local_iter_num > 0:
        message = run.thread_retuner.observe(dt)
        if message and dist_info.master:
            print(f"at iter {state.iter_num}, {message}")
    state.iter_num += 1
    state.local_iter_num += 1

    # termination: after max_iters, with a final checkpoint (the steps since the last save are not
    # thrown away: iter_num = max_iters + 1, the steps done), or after SIGINT/SIGTERM. The ranks
    # agree every iteration (torchrun kills the workers soon after its signal), which also stops all
    # of them when one failed above
    stopping = exit_request.should_stop(dist_info)
    if state.iter_num > loop.max_iters:
        run.checkpointer.save(state.iter_num, build, reason=f"final, iter {state.iter_num}")
        exit_request.uninstall()  # the work is done: a signal from now on is only said
        return True
    return stop_cleanly(run, state, build) if stopping else None


# micro-steps between two polls for a signal inside one iteration: a flag read with one process, an
# all-reduce of two numbers under torchrun (0.5-0.7 ms), a few ms at most next to 8 micro-steps
MICRO_STEPS_PER_POLL = 8


def stop_between_micro_steps(micro_step, exit_request, dist_info):
    """ Whether a signal stops the run before this micro-step (never before the first: the iteration's
    own poll came just before it); every rank polls at the same micro-steps. """
    if micro_step == 0:
        return False
    if dist_info.under_torchrun and micro_step % MICRO_STEPS_PER_POLL:
        return False
    return exit_request.should_stop(dist_info)


def stop_cleanly(run, state, build):
    """
    After a signal: save this iteration's state, so --init_from=resume continues exactly here.
    """
    run.checkpointer.save(state.iter_num, build, reason=f"interrupted at iter {state.iter_num}")
    if run.dist_info.master:
        print(f"stopped cleanly; continue with --init_from=resume --out_dir={run.loop.out_dir} "
              f"(exit code 75)")
    elif run.dist_info.local_rank == 0:
        # the first process of another node: its log says why the run ended too, before whatever
        # torchrun prints of its own (a signalled agent's SignalException traceback)
        print(f"stopped with every node: rank 0 saved iteration {state.iter_num} to "
              f"{run.loop.out_dir} on its node; continue with --init_from=resume (exit code 75)")
    return False


def checkpoint(run, state, gathered):
    """
    What ckpt.pt holds, built on rank 0 from what every rank gathered (saving.Gathered): nanoGPT's
    keys first, so that nanoGPT's sample.py reads it, then what the other scripts and an exact
    resume need.
    """
    return {
        # the plain GPT's weights (unsharded under FSDP), never a wrapper's '_orig_mod.' keys
        'model': gathered.model,
        'optimizer': gathered.optimizer,
        'model_args': run.raw_model.config.model_args(),  # the GPTConfig arguments nanoGPT knows
        'iter_num': state.iter_num,
        'best_val_loss': run.checkpointer.best_val_loss,
        'config': run.config_record,
        # ours: the model settings nanoGPT lacks (gelu, the modern options), the whole tokenizer (so
        # sample.py, eval.py and export_hf.py need nothing else), what produced the run
        'model_extra_args': run.raw_model.config.model_extra_args(),
        'tokenizer': run.tokenizer_meta,
        'provenance': run.provenance,
        # the rest of the training state, so that --init_from=resume continues bitwise
        'loader': state.loader_state,
        'rng': gathered.rng,  # every rank's RNG states, in rank order
        'scaler': run.scaler.state_dict() if run.scaler.is_enabled() else None,
        'spike_guard': state.spike_guard.state_dict() if state.spike_guard is not None else None,
        'wandb_id': run.logger.wandb_id,  # the wandb run a resume continues (None: wandb off)
    }


# -----------------------------------------------------------------------------
# set-up

def setup(cfg, dist_info):
    """ Everything before the first iteration: data, model, optimizer, resumed state, logger. """
    master = dist_info.master
    device_type = device_type_of(dist_info.device)
    fsdp = dist_info.under_torchrun and cfg.parallelism == 'fsdp'
    # the global batch is gradient_accumulation_steps micro-batches: each of the world_size
    # processes runs its share
    grad_accum = distributed.accumulation_per_rank(cfg.gradient_accumulation_steps, dist_info)
    tokens_per_iter = grad_accum * dist_info.world_size * cfg.batch_size * cfg.block_size
    if master:
        print(f"tokens per iteration will be: {tokens_per_iter:,}")
    torch.manual_seed(cfg.seed + dist_info.rank)  # dropout differs per rank, the data does not
    # only rank 0 reports MFU, so only it measures the device's peak
    dtype, ctx, compile_model, peak_flops = compute_setup(dist_info.device, cfg.dtype,
                                                          cfg.compile, cfg.num_threads,
                                                          peak=master)
    # the dataset, worked out once, and its loaders: one verdict for all ranks
    data, train_loader, eval_loaders = training_data(cfg.select(DataSpec), dist_info)
    # the reference curve its data and settings match, or a line naming the closest; a --reference
    # file that is malformed or of other data stops every rank in one line
    reference = distributed.every_rank(dist_info, lambda: ReferenceCheck.for_run(
        dict(cfg), data.directory, cfg.reference, say=print if master else lambda line: None))

    # the model: under FSDP only rank 0 holds the full one, the others build it on the meta device
    # (no memory)
    on_meta = fsdp and dist_info.rank != 0
    # its lines (the vocab_size found, the parameter count) are rank 0's: every rank's would repeat
    with distributed.said_once(dist_info):
        raw_model, tokenizer_meta, ckpt = distributed.every_rank(
            dist_info, lambda: init_training_model(cfg.select(ModelSource), cfg.select(ModelSpec),
                                                   data, on_meta))
    tokenizer_ids = padded_tokenizer_size(raw_model.config.vocab_size, tokenizer_meta)
    # ids the model can't read: one verdict for every rank
    distributed.every_rank(
        dist_info, lambda: [
            loader.check_vocab(raw_model.config.vocab_size, tokenizer_ids)
            for loader in (train_loader, *eval_loaders.values())
        ])
    tasks = None
    if cfg.hellaswag_interval or cfg.sample_interval:
        # now, not at the first interval: a missing file (offline) or a bad prompt stops the run
        # here; only these runs import the in-loop tasks
        from nanogpt_plus.evaluation.periodic import InLoopSpec, PeriodicTasks
        tasks = PeriodicTasks(cfg.select(InLoopSpec), dist_info, tokenizer_meta=tokenizer_meta,
                              block_size=raw_model.config.block_size, ctx=ctx,
                              compiled=compile_model, fsdp=fsdp)
    raw_model.set_attention(cfg.attention)
    raw_model.set_activation_checkpointing(cfg.activation_checkpointing)  # before wrapping
    # a large vocabulary on the CPU: the loss a chunk of positions at a time, never the whole logits
    raw_model.set_chunked_loss(LOSS_CHUNK if chunk_the_loss(raw_model.config, device_type, dtype,
                                                            compile_model, fsdp) else 0)
    if not fsdp:
        raw_model.to(dist_info.device)  # FSDP moves the model itself, one shard at a time
    thread_retuner = None
    if device_type == 'cpu' and cfg.num_threads == 0:
        thread_retuner = choose_threads(raw_model, eval_loaders['train'], ctx, dist_info, fsdp=fsdp)
    # the optimizer must see the parameters the training model has: under FSDP, the sharded ones;
    # raw_model stays the plain module (sharded in place under FSDP) that checkpoints are taken from
    model = wrap_model(raw_model, dist_info, compile_model, cfg.parallelism, dtype)
    if fsdp and master:
        print(f"fsdp: this rank holds {local_param_count(raw_model):,} of "
              f"{raw_model.get_num_params(non_embedding=False):,} parameters")
    adamw = cfg.select(opt.AdamWSpec)
    muon = cfg.select(opt.MuonSpec) if cfg.optimizer == 'muon' else None  # Muon + AdamW
    with distributed.said_once(dist_info):  # nanoGPT's parameter-group lines, rank 0's only
        optimizer = opt.make_optimizer(raw_model, adamw, device_type, muon=muon)
    scaler = opt.make_grad_scaler(device_type, dtype)

    run_provenance = dict(provenance(dist_info.device), dtype=dtype, compile=compile_model,
                          world_size=dist_info.world_size)
    if master:
        print("provenance: " + json.dumps(run_provenance))
    checkpointer = Checkpointer(cfg.out_dir, dist_info, raw_model, optimizer,
                                policy=cfg.select(CheckpointPolicy),
                                replaces_a_run=cfg.overwrite and cfg.init_from != 'resume')
    state = TrainState()
    if cfg.skip_loss_z or cfg.skip_grad_z:
        from nanogpt_plus.spike_guard import SpikeGuard  # only runs with the guard on import it
        state.spike_guard = SpikeGuard(cfg.skip_loss_z, cfg.skip_grad_z)
    if cfg.init_from == 'resume':  # continue where the checkpoint stopped, exactly
        state.iter_num = int(ckpt['iter_num'])
        checkpointer.resume_best(ckpt['best_val_loss'], checkpointer.path())
        restore_training_state(ckpt, optimizer, scaler, dist_info, train_loader, state.spike_guard)
        opt.apply_settings(optimizer, adamw, muon, master)  # a --beta2 given now applies
    # a resume continues its checkpoint's wandb run; a new run (or one started over) gets a new one
    resumed = ckpt if cfg.init_from == 'resume' else None
    logger = MetricsLogger.for_run(cfg.out_dir, cfg.select(WandbSpec), config_record=dict(cfg),
                                   enabled=master, resumed=resumed)
    logger.start(state.iter_num, cfg.init_from)
    bytes_per_token = measure_bytes_per_token(eval_loaders, data, data.meta or tokenizer_meta,
                                              logger, state.iter_num) if master else {}
    state.loader_state = train_loader.state_dict()
    state.batch = train_loader.next_batch()
    state.lap_start = time.time()
    run = Run(loop=cfg.select(LoopSettings), schedule=cfg.select(opt.LRSchedule),
              config_record=dict(cfg), dist_info=dist_info, ctx=ctx, model=model,
              raw_model=raw_model, optimizer=optimizer, scaler=scaler, train_loader=train_loader,
              eval_loaders=eval_loaders, checkpointer=checkpointer, tasks=tasks, logger=logger,
              tokenizer_meta=tokenizer_meta, bytes_per_token=bytes_per_token,
              provenance=run_provenance, grad_accum=grad_accum,
              tokens_per_iter=tokens_per_iter, peak_flops=peak_flops, thread_retuner=thread_retuner,
              reference=reference)
    return run, state


# the loss of a large vocabulary on the CPU, computed LOSS_CHUNK positions at a time (GPT.set_chunked_loss):
# at GPT-2's 50,304 tokens a laptop model's step is ~25% faster on a 2-core CPU (the logits of 768 positions
# are 154 MB, made, soft-maxed and zeroed for the gradient, against 25 MB a chunk); a vocabulary of
# CHUNKED_VOCAB tokens or more
LOSS_CHUNK = 128
CHUNKED_VOCAB = 8192


def chunk_the_loss(config, device_type, dtype, compiled, fsdp):
    """
    Whether to compute the loss in chunks: a large vocabulary, trained in float32 on the CPU, eagerly
    and whole (torch.compile fuses the loss itself; FSDP shards the head).
    """
    return (config.vocab_size >= CHUNKED_VOCAB and device_type == 'cpu' and dtype == 'float32' and not compiled
            and not fsdp)


def measure_bytes_per_token(eval_loaders, data, tokenizer_meta, logger, iter_num):
    """
    {split: UTF-8 bytes per token} of the splits evaluated on, once, logged as a 'bytes_per_token'
    record: as the dataset's preparation counted them over the whole split (data.recorded_bytes),
    else measured with the tokenizer (a large split by an even sample:
    tokenizer.split_bytes_per_token); None for a split with ids the tokenizer lacks. Each
    evaluation's loss / ln 2 / this is its bits per byte, which compares across tokenizers (a char
    model's and a GPT-2 BPE model's).
    """
    counts = {split: data.recorded_bytes(split, int(loader.source.sizes.sum()))
              for split, loader in eval_loaders.items()}
    unrecorded = [split for split, count in counts.items() if count is None]
    if unrecorded:
        # a dataset prepared before its bytes were recorded, or nanoGPT's: only these runs load the
        # tokenizer
        from nanogpt_plus.tokenizer import load_tokenizer, split_bytes_per_token
        tokenizer = load_tokenizer(tokenizer_meta)
        counts.update({split: split_bytes_per_token(eval_loaders[split].source, tokenizer)
                       for split in unrecorded})
    record = {'type': 'bytes_per_token', 'iter': iter_num}
    for split, count in counts.items():
        record.update({split: count['bytes_per_token'], f'{split}_tokens_counted':
                       count['tokens_counted'], f'{split}_whole': count['whole']})
    logger.log(record)
    return {split: count['bytes_per_token'] for split, count in counts.items()}


def bits_per_byte(losses, bytes_per_token):
    """ {'<split>_bpb': loss / ln 2 / bytes per token} of the splits whose bytes are known. """
    return {f'{split}_bpb': loss / math.log(2) / bytes_per_token[split]
            for split, loss in losses.items() if bytes_per_token.get(split)}


# -----------------------------------------------------------------------------
# the steps of one iteration

def evaluate(run, state, lr, poll=None):
    """
    Both splits' losses, printed and logged (rank 0); the val loss, or None when a signal ended the
    estimate.
    """
    # this process's first evaluation is said before it starts: its first batch pays for the warm-up
    # (on a busy CPU, half a minute of silence otherwise)
    first = f" (the train and val loss at iter {state.iter_num})" if state.local_iter_num == 0 else None
    losses = estimate_loss(run.model, run.eval_loaders, eval_iters=run.loop.eval_iters, ctx=run.ctx,
                           dist_info=run.dist_info, poll=poll, announce=first)
    if losses is None:
        return None
    if run.dist_info.master:
        print(
            f"step {state.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
        )
        # then, where a reference curve matches, whether the val loss is within its band
        for line in run.reference.after_eval(state.iter_num, losses['val']):
            print(line)
        run.logger.log({'type': 'eval', 'iter': state.iter_num, 'train_loss': losses['train'],
                        'val_loss': losses['val'], **run.reference.band_at(state.iter_num),
                        **bits_per_byte(losses, run.bytes_per_token), 'lr': lr})
    if not math.isfinite(losses['val']):
        failure = non_finite_loss(losses['val'], state.iter_num, run.checkpointer.path())
        distributed.fail_everywhere(failure, run.dist_info)
    return losses['val']


@torch.no_grad()
def estimate_loss(model, loaders, eval_iters, ctx, dist_info, poll=None, announce=None):
    """ {split: the mean loss over eval_iters batches} of {split: loader}, the ranks sharing the
    batches (rank r takes r, r + world_size, ...). poll: asked after every batch; when it says stop,
    the estimate ends: None. A long one (the char model on a CPU) shows its progress (rank 0);
    announce (a string, Progress.begin's detail): say it before the first batch too. """
    model.eval()
    losses = {}
    # every rank runs the same number of forwards (under FSDP each one all-gathers weights): a rank
    # whose share ends early runs on past eval_iters and leaves those losses out of the sum
    forwards = math.ceil(eval_iters / dist_info.world_size)
    meter = progress.Progress(forwards * len(loaders), "evaluating", "batches", dist_info.master)
    if announce is not None:
        meter.begin(announce)
    for split, loader in loaders.items():
        loader.reset()  # the same batches at every evaluation, so the numbers are comparable
        total = torch.zeros((), dtype=torch.float64, device=dist_info.device)
        for k in meter.over(range(forwards)):
            X, Y = loader.next_batch()  # batch k * world_size + rank of the stream
            with ctx:
                _, loss = model(X, Y)
            if k * dist_info.world_size + dist_info.rank < eval_iters:
                total += loss.double()
            if poll is not None and poll():
                model.train()
                return None
        losses[split] = distributed.all_reduce_sum([total.item()], dist_info)[0] / eval_iters
    model.train()
    return losses


def log_iteration(run, state, lossf, grad_norm, lr, dt):
    """
    The `iter N: loss ...` line and metrics record (rank 0) of the step's loss and grad norm (floats
    or None).
    """
    if not run.dist_info.master:
        return
    # MFU per device, as nanoGPT's (this rank's tokens against one device's peak), after a process's
    # first iterations, which are slow (allocator, caches)
    if state.local_iter_num >= 5:
        sequences = run.loop.batch_size * run.grad_accum  # this rank's, per iteration
        mfu = run.raw_model.estimate_mfu(sequences, dt, peak_flops=run.peak_flops)
        state.running_mfu = mfu if state.running_mfu is None else 0.9 * state.running_mfu + 0.1 * mfu
    shown = 'n/a' if state.running_mfu is None else f"{state.running_mfu*100:.2f}%"  # n/a: not yet
    print(f"iter {state.iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {shown}")
    run.logger.log({
        'type': 'iter',
        'iter': state.iter_num,
        'loss': lossf,
        'lr': lr,
        'grad_norm': grad_norm,
        'time_ms': dt * 1000,
        'tokens_per_sec': run.tokens_per_iter / dt,
        'mfu': state.running_mfu
    })


if __name__ == '__main__':
    run_main(main)
