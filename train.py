"""
Train a GPT on a prepared dataset, in one process (CPU, CUDA or MPS) or in several under torchrun: DDP (a
full copy of the model per process) or FSDP2 (the model sharded over them). nanoGPT's commands work as-is.

One device (a GPU, Apple silicon or the CPU):
$ python train.py config/train_shakespeare_char.py
$ python train.py config/train_shakespeare_char_cpu.py        # nanoGPT's laptop command, ~minutes

DDP over the 4 GPUs of one machine:
$ torchrun --standalone --nproc_per_node=4 train.py

DDP over processes on the CPU (gloo):
$ torchrun --standalone --nproc_per_node=2 train.py config/train_shakespeare_char_cpu.py --device=cpu

Shard the weights, gradients and optimizer state over the processes instead (FSDP2), when weights plus AdamW
state don't fit one GPU (e.g. finetuning gpt2-xl on 24 GB cards):
$ torchrun --standalone --nproc_per_node=4 train.py config/finetune_shakespeare.py --parallelism=fsdp

DDP over two machines with 8 GPUs each: start the first (the master, reachable at 10.0.0.1), then the other
$ torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --master_addr=10.0.0.1 --master_port=1234 train.py
$ torchrun --nproc_per_node=8 --nnodes=2 --node_rank=1 --master_addr=10.0.0.1 --master_port=1234 train.py
(put NCCL_IB_DISABLE=1 in front of both when there is no InfiniBand between the machines)

Continue a run that stopped (Ctrl-C, preemption, crash) from its last checkpoint, bitwise as if it hadn't:
$ python train.py config/train_shakespeare_char.py --init_from=resume
A run stopped by SIGTERM/SIGINT saves first and exits with code 75 ("interrupted, resumable"); a finished one 0.

How it is built: setup() makes a Run (model, optimizer, data, checkpointer: fixed for the whole run) and a
TrainState (what changes every iteration); iteration() is one step of the loop, written out top to bottom.
The pieces live in nanogpt_plus/: the Checkpointer decides when and where to save, PeriodicTasks runs the
in-loop HellaSwag and samples, settings.py declares every setting (python train.py --help).
"""

import functools
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from configurator import configure
from model import GPT
from nanogpt_plus.checkpoint import adopt_resumed_run, build_checkpoint, init_training_model
from nanogpt_plus.checkpointer import Checkpointer, prepare_out_dir, restore_training_state, resume_point
from nanogpt_plus.dataloader import TokenWindowLoader
from nanogpt_plus.dataset import padded_tokenizer_size, training_data
from nanogpt_plus.device import check_model_memory, compute_setup, device_type_of
from nanogpt_plus.distributed import accumulation_per_rank, every_rank, fail_everywhere, init_distributed
from nanogpt_plus.errors import Interrupted, UserError, out_of_memory_error
from nanogpt_plus.evaluation import estimate_loss
from nanogpt_plus.metrics import MetricsLogger
from nanogpt_plus.optimizer import (make_grad_scaler, make_optimizer, read_step, set_learning_rate, skip_update,
                                    take_update, unscale_and_clip)
from nanogpt_plus.outdir import claim_out_dir
from nanogpt_plus.parallel import grad_sync_context, local_param_count, wrap_model
from nanogpt_plus.periodic import PeriodicTasks
from nanogpt_plus.runtime import provenance, run_main
from nanogpt_plus.settings import (ADAMW, DATA, INLOOP, IO, LR_DECAY, MODEL, SPIKE_GUARD, SYSTEM, WANDB, Schema,
                                   check_model_shape)
from nanogpt_plus.signals import GracefulExit
from nanogpt_plus.spike_guard import SpikeGuard
from nanogpt_plus.threads import choose_threads

# -----------------------------------------------------------------------------
# the settings and their defaults: GPT-2 small (124M parameters) on OpenWebText, nanoGPT's recipe. Each one is
# declared in nanogpt_plus/settings.py with its type and help; `python train.py --help` lists them all
DEFAULTS = Schema(IO, INLOOP, WANDB, DATA, MODEL, ADAMW, SPIKE_GUARD, LR_DECAY, SYSTEM)
# -----------------------------------------------------------------------------


@dataclass
class Run:
    """ What setup() builds once and the loop only reads. """
    cfg: dict
    dist_info: object  # distributed.DistInfo: rank, world size, device
    ctx: object  # the autocast context of forward passes (a no-op in float32)
    model: torch.nn.Module  # what trains: the GPT, compiled and/or in DDP, or sharded in place (FSDP)
    raw_model: GPT  # the plain GPT inside `model`: checkpoints, MFU
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # enabled for float16 only
    train_loader: TokenWindowLoader  # the one stream of training batches, in data_order (its state is checkpointed)
    eval_loaders: dict  # {'train': ..., 'val': ...}: fixed streams, rewound before every evaluation
    checkpointer: Checkpointer  # when and where ckpt.pt is written; it keeps the best val loss
    tasks: PeriodicTasks  # in-loop HellaSwag and samples
    logger: MetricsLogger
    tokenizer_meta: dict  # from init_model, stored in every checkpoint
    provenance: dict  # versions, git commit, device: printed at start-up, stored in every checkpoint
    grad_accum: int  # micro-steps per optimizer step in this process
    tokens_per_iter: int
    peak_flops: float  # the device's peak FLOP/s for MFU (None on ranks other than 0, which don't report it)
    thread_retuner: object = None  # CPU with num_threads=0: a threads.ThreadRetuner re-checking the thread count


@dataclass
class TrainState:
    """ What changes from one iteration to the next. """
    spike_guard: SpikeGuard  # the running loss / grad norm statistics and the count of skipped updates
    iter_num: int = 0
    local_iter_num: int = 0  # iterations run by this process (0 again after a resume)
    running_mfu: float = -1.0  # -1 until this process has run 5 iterations, then a moving average
    loader_state: dict = None  # the training loader before this iteration's batches: a checkpoint resumes there
    batch: tuple = None  # (X, Y) of this iteration's first micro-step
    lap_start: float = 0.0  # time.time() at the end of the previous iteration


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    # SIGINT/SIGTERM set a flag from here on: one during set-up (minutes for a big model) stops the run after it
    exit_request = GracefulExit().install()
    try:
        cfg = configure(DEFAULTS, argv, doc=__doc__)
        check_settings(cfg)
        dist_info = init_distributed(cfg['device'], cfg['backend'])  # torchrun's ranks, or a single process
        if cfg['init_from'] == 'resume':  # the checkpoint's architecture becomes the run's; a finished run is refused
            # on every rank with one verdict: a node whose disk lacks the checkpoint stops them all, in one line
            every_rank(dist_info, lambda: adopt_resumed_run(cfg, resume_point(cfg['out_dir'], cfg['resume_from'])))
        # rank 0 holds out_dir/run.lock for the whole run, set-up included (released however the run ends)
        with claim_out_dir(cfg['out_dir'], dist_info, prepare=lambda: prepare_out_dir(cfg, 'train.py', argv)):
            finished = train(cfg, dist_info, exit_request)
    finally:
        exit_request.uninstall()
    if not finished:
        raise Interrupted()  # saved and resumable: exit code 75


def check_settings(cfg):
    """ Every setting, before any work: its type, choices and range (settings.py), then their combinations. """
    DEFAULTS.check(cfg)
    check_model_shape(cfg)
    if cfg['init_from'] == 'scratch':  # a resumed or pretrained model has its own size, which fitted before
        check_model_memory(cfg['n_layer'], cfg['n_embd'], cfg['block_size'])
    if cfg['decay_lr'] and cfg['min_lr'] > cfg['learning_rate']:  # the "decay" would raise the rate
        raise UserError(f"min_lr ({cfg['min_lr']}) is above learning_rate ({cfg['learning_rate']}), so the decay "
                        f"would raise the learning rate; set --min_lr to at most learning_rate (about 1/10 of it)")
    if cfg['optimizer'] == 'muon' and cfg['parallelism'] == 'fsdp':
        raise UserError("optimizer='muon' orthogonalises whole matrices, which FSDP splits over the ranks; use "
                        "--parallelism=ddp with Muon, or --optimizer=adamw with FSDP")
    if cfg['resume_from'] and cfg['init_from'] != 'resume':
        raise UserError(f"--resume_from={cfg['resume_from']} goes back to a snapshot of the run in out_dir: it "
                        f"needs --init_from=resume")


def train(cfg, dist_info, exit_request):
    """
    Train from init_from until iteration max_iters (or a signal), checkpointing into out_dir. Returns True
    when the run is complete (its final checkpoint saved), False when a signal stopped it (saved too).
    """
    run, state = setup(cfg, dist_info)
    try:
        if exit_request.should_stop(dist_info):  # a signal during set-up: before the first step, nothing to save
            if dist_info.master:
                print(f"stopped before iter {state.iter_num}: a signal came during set-up; nothing new to save")
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
    """ One iteration of the loop. Returns None to go on, True when the run is complete, False after a signal. """
    cfg, dist_info = run.cfg, run.dist_info
    build = functools.partial(checkpoint, run, state)  # what a save at this iteration holds (Checkpointer.write)
    # the schedule's rate for this iteration, on every parameter group (Muon's scaled to muon_lr)
    lr = set_learning_rate(run.optimizer, state.iter_num, cfg['learning_rate'], cfg['warmup_iters'],
                           cfg['lr_decay_iters'], cfg['min_lr'], cfg['decay_lr'], cfg['lr_schedule'],
                           cfg['cooldown_frac'])
    # HellaSwag and a sample when due, then the train/val loss, after which the checkpointer may save. A signal
    # ends a long pass between its batches (poll: every rank agrees), and the run stops here, saving this state
    poll = functools.partial(exit_request.should_stop, dist_info)
    scored = run.tasks.run(state.iter_num, run.model, run.raw_model, run.logger, poll)
    evaluating, saved = state.iter_num % cfg['eval_interval'] == 0, False
    val_loss = evaluate(run, state, lr, poll) if evaluating and not exit_request.agreed else None
    if val_loss is not None:
        saved = run.checkpointer.evaluated(state.iter_num, val_loss, build)
    if exit_request.agreed:
        return stop_cleanly(run, state, build)
    if state.iter_num == 0 and cfg['eval_only']:
        return True
    if run.checkpointer.due(state.iter_num, state.local_iter_num) and not saved:
        run.checkpointer.save(state.iter_num, build)

    # forward and backward over the micro-batches; DDP all-reduces the gradients once, after the last backward
    step_loss = torch.zeros((), device=dist_info.device)  # this rank's loss: a tensor, so no sync per micro-step
    for micro_step in range(run.grad_accum):
        last = micro_step == run.grad_accum - 1
        with grad_sync_context(run.model, sync=last):
            X, Y = state.batch
            with run.ctx:
                _, loss = run.model(X, Y)
                loss = loss / run.grad_accum  # the micro-batches' mean, not their sum, is the step's loss
            # fetch the next batch now: on a GPU it loads while the forward pass still runs
            if last:
                state.loader_state = run.train_loader.state_dict()  # a checkpoint of this step resumes at the next
            try:
                state.batch = run.train_loader.next_batch()
            except UserError as e:  # this rank's next batch is unusable: finish the step with the other ranks, then
                exit_request.fail(e)  # all stop at the agreement below, with this error (not one rank alone)
            run.scaler.scale(loss).backward()  # the scaler multiplies float16 losses so small gradients survive
        step_loss += loss.detach()

    # unscale and clip the gradients, then take the update, or skip it when the spike guard says so
    grad_norm = unscale_and_clip(run.model, run.optimizer, run.scaler, cfg['grad_clip'], measure=cfg['skip_grad_z'] > 0)
    # the step's loss and grad norm as floats (a host sync and an all-reduce) only where they are used: at log
    # steps, and every step for the spike guard; a non-finite loss stops the run there, before the update
    logging, lossf = state.iter_num % cfg['log_interval'] == 0, None
    if logging or state.spike_guard.enabled:
        lossf, grad_norm = read_step(step_loss, grad_norm, dist_info)
        if not math.isfinite(lossf):
            fail_everywhere(non_finite_loss(lossf, state.iter_num, cfg['out_dir']), dist_info)
    spike = state.spike_guard.check(lossf, grad_norm) if state.spike_guard.enabled else None
    if spike is None:
        take_update(run.optimizer, run.scaler)
    else:
        skip_update(run.optimizer, run.scaler)  # the weights and AdamW state stay as they were
        report_skip(run, state, spike)

    # timing and logging (the time since the previous iteration: evaluations and saves included, as nanoGPT's)
    now = time.time()
    dt, state.lap_start = now - state.lap_start, now
    if logging:
        log_iteration(run, state, lossf, grad_norm, lr, dt)
    retune_threads(run, state, dt, evaluating or scored)
    state.iter_num += 1
    state.local_iter_num += 1

    # termination: after max_iters, with a final checkpoint (the steps since the last save are not thrown away:
    # iter_num = max_iters + 1, the steps done), or after SIGINT/SIGTERM. The ranks agree every iteration
    # (torchrun kills the workers soon after its signal), which also stops all of them when one failed above
    stopping = exit_request.should_stop(dist_info)
    if state.iter_num > cfg['max_iters']:
        run.checkpointer.save(state.iter_num, build, reason=f"final, iter {state.iter_num}")
        return True
    return stop_cleanly(run, state, build) if stopping else None


def stop_cleanly(run, state, build):
    """ After a signal: save this iteration's state, so --init_from=resume continues exactly here. """
    run.checkpointer.save(state.iter_num, build, reason=f"interrupted at iter {state.iter_num}")
    if run.dist_info.master:
        print(f"stopped cleanly; continue with --init_from=resume --out_dir={run.cfg['out_dir']} (exit code 75)")
    return False


# -----------------------------------------------------------------------------
# set-up

def setup(cfg, dist_info):
    """ Everything before the first iteration: data, model, optimizer, resumed state, logger. """
    master = dist_info.master
    # the global batch is gradient_accumulation_steps micro-batches: each of the world_size processes runs its share
    grad_accum = accumulation_per_rank(cfg['gradient_accumulation_steps'], dist_info)
    tokens_per_iter = grad_accum * dist_info.world_size * cfg['batch_size'] * cfg['block_size']
    if master:
        print(f"tokens per iteration will be: {tokens_per_iter:,}")
    torch.manual_seed(cfg['seed'] + dist_info.rank)  # dropout differs per rank, data does not (see dataloader)
    dtype, ctx, compile_model, peak_flops = compute_setup(dist_info.device, cfg['dtype'], cfg['compile'],
                                                          cfg['num_threads'], peak=master)  # only rank 0 reports MFU
    data, train_loader, eval_loaders = training_data(cfg, dist_info)  # worked out once; one verdict for all ranks
    # under FSDP only rank 0 holds the full model: the others build it on the meta device (no memory, no init)
    on_meta = dist_info.under_torchrun and cfg['parallelism'] == 'fsdp' and dist_info.rank != 0
    raw_model, tokenizer_meta, ckpt = every_rank(dist_info, lambda: init_training_model(cfg, data, on_meta))
    tokenizer_ids = padded_tokenizer_size(raw_model.config.vocab_size, tokenizer_meta)
    for loader in (train_loader, *eval_loaders.values()):
        loader.check_vocab(raw_model.config.vocab_size, tokenizer_ids)  # an id the model or tokenizer lacks: one line
    # now, not at the first hellaswag_interval: a missing file (offline) or a bad prompt stops the run here
    tasks = PeriodicTasks(cfg, dist_info, tokenizer_meta, raw_model.config.block_size, ctx, compile_model)
    model, optimizer, scaler, thread_retuner = prepare_training(cfg, dist_info, raw_model, dtype, ctx,
                                                                compile_model, eval_loaders['train'])
    run_provenance = dict(provenance(dist_info.device), dtype=dtype, compile=compile_model,
                          world_size=dist_info.world_size)
    if master:
        print("provenance: " + json.dumps(run_provenance))
    checkpointer = Checkpointer(cfg['out_dir'], dist_info, raw_model, optimizer, cfg['always_save_checkpoint'],
                                cfg['checkpoint_interval'], cfg['keep_checkpoints'],
                                replaces_a_run=cfg['overwrite'] and cfg['init_from'] != 'resume')
    state = TrainState(spike_guard=SpikeGuard(cfg['skip_loss_z'], cfg['skip_grad_z']))
    if cfg['init_from'] == 'resume':  # continue where the checkpoint stopped, exactly
        state.iter_num, checkpointer.best_val_loss = int(ckpt['iter_num']), float(ckpt['best_val_loss'])
        restore_training_state(ckpt, optimizer, scaler, dist_info, train_loader, state.spike_guard)
    logger = MetricsLogger(os.path.join(cfg['out_dir'], 'metrics.jsonl'), enabled=master,
                           wandb_log=cfg['wandb_log'], wandb_project=cfg['wandb_project'],
                           wandb_run_name=cfg['wandb_run_name'], config=cfg, wandb_dir=cfg['out_dir'])
    logger.start(state.iter_num, cfg['init_from'])
    state.loader_state = train_loader.state_dict()
    state.batch = train_loader.next_batch()
    state.lap_start = time.time()
    run = Run(cfg=cfg, dist_info=dist_info, ctx=ctx, model=model, raw_model=raw_model, optimizer=optimizer,
              scaler=scaler, train_loader=train_loader, eval_loaders=eval_loaders, checkpointer=checkpointer,
              tasks=tasks, logger=logger, tokenizer_meta=tokenizer_meta, provenance=run_provenance,
              grad_accum=grad_accum, tokens_per_iter=tokens_per_iter, peak_flops=peak_flops,
              thread_retuner=thread_retuner)
    return run, state


def prepare_training(cfg, dist_info, raw_model, dtype, ctx, compile_model, tuning_loader):
    """
    The model on its device and wrapped for training, its optimizer and GradScaler, and the CPU thread choice.
    Returns (model, optimizer, scaler, thread_retuner).
    """
    device_type = device_type_of(dist_info.device)
    fsdp = dist_info.under_torchrun and cfg['parallelism'] == 'fsdp'
    raw_model.set_attention(cfg['attention'])
    raw_model.set_activation_checkpointing(cfg['activation_checkpointing'])  # on the plain model, before wrapping
    if not fsdp:
        raw_model.to(dist_info.device)  # FSDP moves the model itself, one shard at a time
    scaler = make_grad_scaler(device_type, dtype)
    thread_retuner = None
    if device_type == 'cpu' and cfg['num_threads'] == 0:
        thread_retuner = choose_threads(raw_model, tuning_loader, ctx, dist_info, fsdp=fsdp)
    # the optimizer must see the parameters the training model has: under FSDP, the sharded ones; raw_model
    # stays the plain module (sharded in place under FSDP) that checkpoints are taken from
    model = wrap_model(raw_model, dist_info, compile_model, cfg['parallelism'], dtype)
    if fsdp and dist_info.master:
        print(f"fsdp: this rank holds {local_param_count(raw_model):,} of "
              f"{raw_model.get_num_params(non_embedding=False):,} parameters")
    optimizer = make_optimizer(raw_model, cfg, device_type)
    return model, optimizer, scaler, thread_retuner


# -----------------------------------------------------------------------------
# the steps of one iteration

def evaluate(run, state, lr, poll=None):
    """
    Both splits' losses, printed and logged (rank 0); a non-finite val loss stops the run. Returns the val loss
    (None when a signal ended the estimate).
    """
    losses = estimate_loss(run.model, run.eval_loaders, run.cfg['eval_iters'], run.ctx, run.dist_info, poll)
    if losses is None:
        return None
    if run.dist_info.master:
        print(f"step {state.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        run.logger.log({'type': 'eval', 'iter': state.iter_num, 'train_loss': losses['train'],
                        'val_loss': losses['val'], 'lr': lr})
    if not math.isfinite(losses['val']):
        fail_everywhere(non_finite_loss(losses['val'], state.iter_num, run.cfg['out_dir']), run.dist_info)
    return losses['val']


def checkpoint(run, state, gathered):
    """ ckpt.pt's dict (on rank 0): nanoGPT's keys, then everything an exact resume needs (Checkpointer.write). """
    scaler = run.scaler.state_dict() if run.scaler.is_enabled() else None
    return build_checkpoint(run.raw_model, state.iter_num, run.checkpointer.best_val_loss, run.cfg,
                            run.tokenizer_meta, run.provenance, model_state=gathered.model,
                            optimizer=gathered.optimizer, loader=state.loader_state, rng=gathered.rng,
                            spike_guard=state.spike_guard.state_dict(), scaler=scaler)


def report_skip(run, state, spike):
    """ A line (every time) and a metrics record for an update the spike guard skipped (rank 0). """
    if run.dist_info.master:
        print(f"iter {state.iter_num}: skipped the update: {spike.describe()}")
        run.logger.log(dict(spike.record(state.iter_num), skipped_updates=state.spike_guard.skipped))


def log_iteration(run, state, lossf, grad_norm, lr, dt):
    """ The `iter N: loss ...` line and metrics record (rank 0) of the step's loss and grad norm (floats or None). """
    if not run.dist_info.master:
        return
    if state.local_iter_num >= 5:  # the first iterations of a process are slow (allocator, caches): not in MFU
        # per device, as nanoGPT: this rank's tokens against one device's peak
        mfu = run.raw_model.estimate_mfu(run.cfg['batch_size'] * run.grad_accum, dt, peak_flops=run.peak_flops)
        state.running_mfu = mfu if state.running_mfu == -1.0 else 0.9 * state.running_mfu + 0.1 * mfu
    print(f"iter {state.iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {state.running_mfu*100:.2f}%")
    run.logger.log({'type': 'iter', 'iter': state.iter_num, 'loss': lossf, 'lr': lr, 'grad_norm': grad_norm,
                    'time_ms': dt * 1000, 'tokens_per_sec': run.tokens_per_iter / dt, 'mfu': state.running_mfu})


def retune_threads(run, state, dt, busy):
    """ Feed the thread retuner this iteration's time; not the first (warm-up) or one that also evaluated. """
    if run.thread_retuner is None or busy or state.local_iter_num == 0:
        return
    message = run.thread_retuner.observe(dt)
    if message and run.dist_info.master:
        print(f"at iter {state.iter_num}, {message}")


def non_finite_loss(value, iter_num, out_dir):
    return UserError(f"loss is {value} at iter {iter_num}; stopping without saving, so the last good "
                     f"checkpoint in {out_dir} is kept. Lower the learning rate (or use "
                     f"--dtype=bfloat16/float32) and resume with --init_from=resume")


if __name__ == '__main__':
    run_main(main)
