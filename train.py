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

How it is built: setup() makes a Run (model, optimizer, data, logger: fixed for the whole run) and a
TrainState (what changes every iteration); train() is then the loop over the named steps below it.
"""

import json
import math
import os
import sys
import time
from dataclasses import dataclass

import torch

from configurator import configure
from model import GPT, GPT2_NAMES
from nanogpt_plus.checkpoint import (build_checkpoint, check_dataset_tokenizer, checkpoint_path, describe_source,
                                     init_model, is_hf_dir, load_checkpoint, model_config_from_checkpoint,
                                     save_checkpoint, tokenizer_known)
from nanogpt_plus.dataloader import ORDERS, TokenWindowLoader, dataset_dir, evaluation_order, split_files
from nanogpt_plus.engine import generate
from nanogpt_plus.evaluation import public_task_file, score_hellaswag, task_data_file, task_examples
from nanogpt_plus.outdir import claim_out_dir, keep_checkpoint_as, refuse_overwrite, snapshot_checkpoint
from nanogpt_plus.parallel import (accumulation_per_rank, all_reduce_mean, all_reduce_sum, full_state_dicts,
                                   grad_sync_context, local_param_count, local_parameters, wrap_model)
from nanogpt_plus.runtime import (Interrupted, UserError, destroy_distributed, device_type_of, fail_everywhere,
                                  init_distributed, master_decides, provenance, run_main)
from nanogpt_plus.settings import (check_choice, check_flag, check_model_shape, check_non_negative, check_not_empty,
                                   check_positive, check_range, check_system)
from nanogpt_plus.threads import ThreadRetuner, describe_thread_choice, tune_cpu_threads
from nanogpt_plus.tokenizer import TokenizerError, load_tokenizer, read_dataset_meta
from nanogpt_plus.training import (GracefulExit, MetricsLogger, SpikeGuard, compute_setup, fit_block_size,
                                   gather_rng_states, make_grad_scaler, out_of_memory_error, restore_training_state,
                                   set_learning_rate, skip_update, take_update, tensors_finite, unscale_and_clip)

HELLASWAG_FILE = 'data/hellaswag/hellaswag_val.jsonl'  # in the repo, where evaluation.task_data_file keeps it

# -----------------------------------------------------------------------------
# the defaults: GPT-2 small (124M parameters) on OpenWebText, nanoGPT's recipe
DEFAULTS = dict(
    # I/O
    out_dir='out',
    eval_interval=2000,
    log_interval=1,
    eval_iters=200,
    eval_only=False,  # True: evaluate once at iteration 0, then exit
    # zero-shot HellaSwag (eval.py --task=hellaswag's scoring) every N iterations, beside the val loss; 0 = off
    hellaswag_interval=0,
    hellaswag_examples=0,  # the first N validation examples only; 0 = all 10,042
    hellaswag_file=HELLASWAG_FILE,  # this default is downloaded once (as eval.py does); or a JSONL file of yours
    sample_interval=0,  # every N iterations print sample_tokens greedy tokens after sample_prompt; 0 = off
    sample_tokens=32,
    sample_prompt='',  # '' = the end-of-text token (a character tokenizer's first character)
    always_save_checkpoint=True,  # True: save at every evaluation; False: only when the val loss improved
    checkpoint_interval=0,  # save the training state every N iterations; 0 = at each evaluation, as above
    keep_checkpoints=0,  # K > 0: also keep the last K saves as ckpt_<iter>.pt beside ckpt.pt; 0 = ckpt.pt only
    overwrite=False,  # True: a new run may replace the checkpoint already in out_dir (else it is refused)
    # 'scratch', 'resume' (out_dir/ckpt.pt), 'gpt2*', a local Hugging Face GPT-2 directory, or a ckpt.pt / a
    # training out_dir (its weights, training from iter 0 like GPT-2's)
    init_from='scratch',
    # wandb logging
    wandb_log=False,  # True: send the metrics to Weights & Biases too
    wandb_project='owt',
    wandb_run_name='gpt2',  # the run's name in the wandb project
    # data
    dataset='openwebtext',  # a name under data/ or a directory: nanoGPT's train.bin/val.bin, or llm.c token shards
    # 'random' (nanoGPT's random windows) or 'sequential' (llm.c's: consecutive windows, each token once per epoch)
    data_order='random',
    gradient_accumulation_steps=5 * 8,  # micro-batches per optimizer step: a big batch in a small memory
    batch_size=12,  # sequences per micro-batch (per process)
    block_size=1024,
    # model
    n_layer=12,
    n_head=12,
    n_embd=768,
    dropout=0.0,  # 0.0 suits pretraining; fine-tuning usually wants 0.1 or more
    bias=False,  # biases in the Linear and LayerNorm layers (GPT-2 has them; without is a bit faster)
    gelu='none',  # 'none' = exact GELU (nanoGPT), 'tanh' = GPT-2's approximation (models built from scratch)
    attention='flash',  # 'flash' (scaled_dot_product_attention) or 'manual'
    # adamw optimizer
    learning_rate=6e-4,  # the peak, reached at the end of the warmup
    max_iters=600000,  # the last iteration (training stops after it)
    weight_decay=1e-1,
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,  # the largest global gradient norm; 0.0 turns clipping off
    # the spike guard (llm.c's -sl/-sg): skip an update whose loss / grad norm is more than this many standard
    # deviations above its mean over the last 128 steps; 0.0 = off
    skip_loss_z=0.0,
    skip_grad_z=0.0,
    # the learning-rate schedule: linear warmup, then cosine decay down to min_lr
    decay_lr=True,  # False: learning_rate throughout
    warmup_iters=2000,  # iterations of the linear warmup
    lr_decay_iters=600000,  # where the cosine ends; Chinchilla puts it at about max_iters
    min_lr=6e-5,  # the rate after lr_decay_iters; Chinchilla suggests about learning_rate/10
    # system
    backend='auto',  # 'auto' = nccl for CUDA, gloo for CPU; or 'nccl', 'gloo'
    parallelism='ddp',  # under torchrun: 'ddp' (a full model copy per rank) or 'fsdp' (shard the model, FSDP2)
    device='auto',  # 'auto' (cuda, else mps, else cpu), 'cpu', 'cuda', 'cuda:N', 'mps'
    dtype='auto',  # 'auto' (bfloat16 if supported, else float16 on GPUs; float32 on CPU), 'float32', 'bfloat16', 'float16'
    compile=None,  # torch.compile: None = auto (on for CUDA, where it pays for itself); True/False to force
    activation_checkpointing=False,  # True: recompute each Block in the backward pass (less memory, more compute)
    num_threads=0,  # CPU threads for torch; 0 = auto (time all cores, half, ..., 1; keep the fastest; re-check every 250 iters)
    seed=1337,
)
# -----------------------------------------------------------------------------


@dataclass
class Run:
    """ What setup() builds once and the loop only reads. """
    cfg: dict
    dist_info: object  # runtime.DistInfo: rank, world size, device
    ctx: object  # the autocast context of forward passes (a no-op in float32)
    model: torch.nn.Module  # what trains: the GPT, compiled and/or in DDP, or sharded in place (FSDP)
    raw_model: GPT  # the plain GPT inside `model`: checkpoints, MFU
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # enabled for float16 only
    train_loader: TokenWindowLoader  # the one stream of training batches, in data_order (its state is checkpointed)
    eval_loaders: dict  # {'train': ..., 'val': ...}: fixed streams, rewound before every evaluation
    logger: MetricsLogger
    tokenizer_meta: dict  # from init_model, stored in every checkpoint
    provenance: dict  # versions, git commit, device: printed at start-up, stored in every checkpoint
    grad_accum: int  # micro-steps per optimizer step in this process
    tokens_per_iter: int
    peak_flops: float  # the device's peak FLOP/s for MFU (None on ranks other than 0, which don't report it)
    thread_retuner: ThreadRetuner = None  # CPU with num_threads=0: re-checks the thread count while training
    hellaswag: tuple = None  # hellaswag_interval > 0: the validation examples, tokenized once (see load_hellaswag)
    sample_prompt: list = None  # sample_interval > 0 (and not FSDP): the prompt's token ids


@dataclass
class TrainState:
    """ What changes from one iteration to the next. """
    iter_num: int = 0
    best_val_loss: float = 1e9
    local_iter_num: int = 0  # iterations run by this process (0 again after a resume)
    running_mfu: float = -1.0  # -1 until this process has run 5 iterations, then a moving average
    loader_state: dict = None  # the training loader before this iteration's batches: a checkpoint resumes there
    batch: tuple = None  # (X, Y) of this iteration's first micro-step
    lap_start: float = 0.0  # time.time() at the end of the previous iteration
    spike_guard: SpikeGuard = None  # the running loss / grad norm statistics and the count of skipped updates


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = configure(DEFAULTS, argv, doc=__doc__)
    check_settings(cfg)
    dist_info = init_distributed(cfg['device'], cfg['backend'])  # torchrun's ranks, or a single process
    # rank 0 holds out_dir/run.lock for the whole run, set-up included (released however the run ends)
    with claim_out_dir(cfg['out_dir'], dist_info, prepare=lambda: check_overwrite(cfg, argv)):
        finished = train(cfg, dist_info)
    # not in a `finally`: a rank that failed must not enter teardown collectives (run_main exits it at once)
    destroy_distributed()
    if not finished:
        raise Interrupted()  # saved and resumable: exit code 75


def check_settings(cfg):
    """
    Every setting, before any work: the ranges, the choices, and the combinations that would otherwise
    surface deep inside the run (or, worse, not at all: a negative grad_clip trains uphill, zero accumulation
    steps never update). The checks against a resumed checkpoint are check_resume's, once it is read.
    """
    check_not_empty(cfg, 'out_dir', 'dataset', 'init_from')
    check_positive(cfg, 'batch_size', 'block_size', 'gradient_accumulation_steps', 'eval_interval', 'log_interval',
                   'eval_iters', 'sample_tokens')
    check_non_negative(cfg, 'max_iters', 'warmup_iters', 'lr_decay_iters', 'min_lr', 'weight_decay', 'seed',
                       'checkpoint_interval', 'keep_checkpoints', 'skip_loss_z', 'skip_grad_z',
                       'hellaswag_interval', 'hellaswag_examples', 'sample_interval')
    check_range(cfg, 'learning_rate', low=0.0, low_open=True)
    check_range(cfg, 'grad_clip', low=0.0)  # 0 turns clipping off
    for beta in ('beta1', 'beta2'):
        check_range(cfg, beta, low=0.0, high=1.0, high_open=True)
    check_model_shape(cfg)
    check_system(cfg)
    check_choice(cfg, 'parallelism', ('ddp', 'fsdp'))
    check_choice(cfg, 'data_order', ORDERS)
    check_flag(cfg, 'overwrite', 'activation_checkpointing')  # the settings of other parts of the run, when present
    if cfg['init_from'] == 'resume':
        resume_path = checkpoint_path('resume', cfg['out_dir'])
        if not os.path.exists(resume_path):
            raise UserError(f"init_from=resume but there is no checkpoint at {resume_path}; "
                            f"check --out_dir or start with --init_from=scratch")
        # read here, not only in build_model: the architecture settings it fixes (block_size) are used before
        # the model is built (the loaders, the tokens per iteration). Its tensors are memory-mapped, not read
        check_resume(cfg, load_checkpoint(resume_path), resume_path)


# what a checkpoint must hold to be resumed (finetune.py's and weights-only files lack the training state)
RESUME_KEYS = ('model', 'model_args', 'optimizer', 'iter_num', 'best_val_loss', 'config')
# the settings that shape the model: a resumed run has the checkpoint's, whatever the defaults say
ARCHITECTURE = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'gelu')


def check_resume(cfg, ckpt, path):
    """
    The settings against the checkpoint a run resumes from, before any work: it must be a train.py training
    checkpoint; an architecture setting the user gave must be the checkpoint's (nothing is cropped or rebuilt
    on resume, so the next save can't replace the checkpoint with another model); one not given takes the
    checkpoint's value in cfg (so the saved 'config' agrees with 'model_args'); and the run must not be over.
    """
    missing = [k for k in RESUME_KEYS if k not in ckpt]
    if missing or 'task' in ckpt:  # 'task': finetune.py's checkpoint of a model with a task head
        what = f"it has no {', '.join(repr(k) for k in missing)}" if missing else "it is a finetune.py checkpoint"
        raise UserError(f"{path} is not a train.py training checkpoint ({what}: a finetune.py out_dir or a "
                        f"weights-only file?); to train on its weights from iter 0 use --init_from={path} with "
                        f"another --out_dir")
    adopt_architecture(cfg, model_config_from_checkpoint(ckpt), path)
    # the loop trains iteration max_iters too and then stops, so the final checkpoint of a finished run has
    # iter_num = max_iters + 1; one at iter_num == max_iters still has that last step to run
    if int(ckpt['iter_num']) > cfg['max_iters']:
        raise UserError(f"the run in {cfg['out_dir']} is already complete: its checkpoint is at iter "
                        f"{int(ckpt['iter_num'])}, past max_iters={cfg['max_iters']}; to train further, resume with "
                        f"a larger --max_iters (and --lr_decay_iters to match)")


def adopt_architecture(cfg, saved, path):
    """ cfg's architecture settings become the checkpoint's (GPTConfig saved); one the user gave must agree. """
    given = getattr(cfg, 'given', cfg.keys())  # a plain dict (a test's): every setting counts as chosen
    for key in ARCHITECTURE:
        if key in given and cfg[key] != getattr(saved, key):
            raise UserError(f"--{key}={cfg[key]!r} but the checkpoint {path} has {key}={getattr(saved, key)!r}; "
                            f"a resumed run keeps the checkpoint's architecture: drop --{key} (or change it in the "
                            f"config file), or start a new run in another --out_dir")
        cfg[key] = getattr(saved, key)


def train(cfg, dist_info):
    """
    Train from init_from until iteration max_iters (or a signal), checkpointing into out_dir. Returns True
    when the run is complete (its final checkpoint saved), False when a signal stopped it (saved too).
    """
    run, state = setup(cfg, dist_info)
    exit_request = GracefulExit().install()
    try:
        while True:
            lr = set_learning_rate(run.optimizer, state.iter_num, cfg['learning_rate'], cfg['warmup_iters'],
                                   cfg['lr_decay_iters'], cfg['min_lr'], cfg['decay_lr'])
            evaluating = state.iter_num % cfg['eval_interval'] == 0
            scored = run_in_loop_tasks(run, state)  # the weights the evaluation below measures (and may save)
            saved = evaluate(run, state, lr) if evaluating else False
            if state.iter_num == 0 and cfg['eval_only']:
                return True
            if checkpoint_due(cfg, state) and not saved:
                write_checkpoint(run, state)
            lossf, grad_norm = train_step(run, state)
            dt = lap(state)
            logging_step = state.iter_num % cfg['log_interval'] == 0
            if logging_step:
                log_iteration(run, state, lossf, grad_norm, lr, dt)
            retune_threads(run, state, dt, evaluating or scored)
            state.iter_num += 1
            state.local_iter_num += 1
            if state.iter_num > cfg['max_iters']:
                # the steps since the last save are not thrown away: iter_num = max_iters + 1, the steps done
                write_checkpoint(run, state, reason=f"final, iter {state.iter_num}")
                return True
            if exit_request.should_stop(dist_info):  # every iteration: torchrun kills soon after its signal
                stop_cleanly(run, state)
                return False
    except torch.OutOfMemoryError:  # torch.cuda.OutOfMemoryError: one line that says what to change
        raise out_of_memory_error(state.iter_num, cfg['out_dir'], 'ckpt.pt') from None
    finally:
        exit_request.uninstall()
        run.logger.close()


# -----------------------------------------------------------------------------
# set-up

def setup(cfg, dist_info):
    """ Everything before the first iteration: data, model, optimizer, resumed state, logger. """
    master, device = dist_info.master, dist_info.device
    # the global batch is gradient_accumulation_steps micro-batches: each of the world_size processes runs its share
    grad_accum = accumulation_per_rank(cfg['gradient_accumulation_steps'], dist_info)
    tokens_per_iter = grad_accum * dist_info.world_size * cfg['batch_size'] * cfg['block_size']
    if master:
        print(f"tokens per iteration will be: {tokens_per_iter:,}")
    torch.manual_seed(cfg['seed'] + dist_info.rank)  # dropout differs per rank, data does not (see dataloader)
    dtype, ctx, compile_model, peak_flops = compute_setup(device, cfg['dtype'], cfg['compile'], cfg['num_threads'],
                                                          peak=master)  # only rank 0 reports MFU
    train_loader, eval_loaders = make_loaders(cfg, dist_info)
    raw_model, tokenizer_meta, ckpt = build_model(cfg, dist_info)
    for loader in (train_loader, *eval_loaders.values()):
        loader.check_vocab(raw_model.config.vocab_size)  # an id the model has no embedding for: one line
    # now, not at the first hellaswag_interval: a missing file (offline) or a bad prompt stops the run here
    hellaswag = load_hellaswag(cfg, dist_info, tokenizer_meta, raw_model.config.block_size)
    sample_prompt = sampling_prompt(cfg, dist_info, tokenizer_meta)
    model, optimizer, scaler, thread_retuner, run_provenance = prepare_training(cfg, dist_info, raw_model, dtype, ctx,
                                                                                compile_model, eval_loaders['train'])
    state = TrainState(spike_guard=SpikeGuard(cfg['skip_loss_z'], cfg['skip_grad_z']))
    if cfg['init_from'] == 'resume':
        resume(state, ckpt, optimizer, scaler, train_loader, dist_info)
    logger = MetricsLogger(os.path.join(cfg['out_dir'], 'metrics.jsonl'), enabled=master,
                           wandb_log=cfg['wandb_log'], wandb_project=cfg['wandb_project'],
                           wandb_run_name=cfg['wandb_run_name'], config=cfg, wandb_dir=cfg['out_dir'])
    logger.start(state.iter_num, cfg['init_from'])
    state.loader_state = train_loader.state_dict()
    state.batch = train_loader.next_batch()
    state.lap_start = time.time()
    run = Run(cfg=cfg, dist_info=dist_info, ctx=ctx, model=model, raw_model=raw_model, optimizer=optimizer,
              scaler=scaler, train_loader=train_loader, eval_loaders=eval_loaders, logger=logger,
              tokenizer_meta=tokenizer_meta, provenance=run_provenance, grad_accum=grad_accum,
              tokens_per_iter=tokens_per_iter, peak_flops=peak_flops, thread_retuner=thread_retuner,
              hellaswag=hellaswag, sample_prompt=sample_prompt)
    return run, state


def check_overwrite(cfg, argv):
    """
    On rank 0, with out_dir locked: a new run (not a resume) into an out_dir that holds a checkpoint is refused
    with the commands to resume it or to start over, unless --overwrite=True. eval_only runs write no checkpoint.
    """
    if cfg['init_from'] == 'resume' or cfg['eval_only'] or not os.path.isfile(os.path.join(cfg['out_dir'], 'ckpt.pt')):
        return
    if not cfg['overwrite']:
        raise refuse_overwrite(cfg['out_dir'], 'ckpt.pt', 'train.py', argv)
    print(f"overwrite=True: the earlier run's checkpoint in {cfg['out_dir']} stays until this run's first save "
          f"replaces it")


def make_loaders(cfg, dist_info):
    """
    The training loader (one stream in data_order, strided over ranks) and one fixed stream per split to
    evaluate on: the train split's at random windows (a sample of the whole training set, not just its start);
    the val split's in dataloader.evaluation_order (shards: sequentially from the start; train.bin's: random).
    """
    train_files, val_files = split_files(cfg['dataset'], 'train'), split_files(cfg['dataset'], 'val')

    def loader(files, seed, order):
        return TokenWindowLoader(files, cfg['batch_size'], cfg['block_size'], seed=seed, rank=dist_info.rank,
                                 world_size=dist_info.world_size, device=dist_info.device, dataset=cfg['dataset'],
                                 order=order)
    train_loader = loader(train_files, cfg['seed'], cfg['data_order'])
    return train_loader, {'train': loader(train_files, cfg['seed'] + 1, 'random'),
                          'val': loader(val_files, cfg['seed'] + 2, evaluation_order(val_files))}


def build_model(cfg, dist_info=None):
    """
    (the plain GPT on the CPU, its tokenizer description, the checkpoint read or None) for init_from. Under FSDP
    only rank 0 holds the full model: the other ranks build it on the meta device (no memory, no init) and
    shard_model sends them their shards of rank 0's weights.
    """
    init_from = cfg['init_from']
    on_meta = (dist_info is not None and dist_info.ddp and cfg['parallelism'] == 'fsdp' and dist_info.rank != 0)
    source = checkpoint_path(init_from, cfg['out_dir'])
    if init_from == 'resume':
        print(f"Resuming training from {cfg['out_dir']}")
    elif init_from != 'scratch' and source is not None:
        print(f"Initializing from the weights in {source} (training starts at iter 0)")
    elif init_from in GPT2_NAMES or is_hf_dir(init_from):
        print(f"Initializing from OpenAI GPT-2 weights: {init_from}")
    # the architecture comes from the weights (a new model: from the settings); dropout from the settings always
    model, tokenizer_meta, ckpt = init_model(init_from, cfg['out_dir'], dataset=cfg['dataset'], model_settings=cfg,
                                             dropout=cfg['dropout'], resume_file='ckpt.pt', on_meta=on_meta)
    # a new model has the dataset's tokenizer; weights come with their own (unless nanoGPT's left it unknown)
    if init_from != 'scratch' and tokenizer_known(ckpt):
        check_dataset_tokenizer(cfg['dataset'], tokenizer_meta, describe_source(init_from, cfg['out_dir']))
    fit_block_size(model, cfg['block_size'])  # a pretrained model can train on shorter windows than it knows
    data_vocab = (read_dataset_meta(dataset_dir(cfg['dataset'])) or {}).get('vocab_size')
    if data_vocab and int(data_vocab) > model.config.vocab_size:
        raise UserError(f"the dataset's vocabulary ({data_vocab}) is larger than the model's "
                        f"({model.config.vocab_size}); train from scratch on this dataset")
    return model, tokenizer_meta, ckpt


def prepare_training(cfg, dist_info, raw_model, dtype, ctx, compile_model, tuning_loader):
    """
    The model on its device and wrapped for training, its optimizer and GradScaler, the CPU thread choice,
    and the run's provenance. Returns (model, optimizer, scaler, thread_retuner, provenance).
    """
    device_type = device_type_of(dist_info.device)
    fsdp = dist_info.ddp and cfg['parallelism'] == 'fsdp'
    raw_model.set_attention(cfg['attention'])
    raw_model.set_activation_checkpointing(cfg['activation_checkpointing'])  # on the plain model, before wrapping
    if not fsdp:
        raw_model.to(dist_info.device)  # FSDP moves the model itself, one shard at a time
    scaler = make_grad_scaler(device_type, dtype)
    thread_retuner = None
    if device_type == 'cpu' and cfg['num_threads'] == 0:
        if fsdp:
            # the other ranks' models are on the meta device and can't run a forward: rank 0 times for them all
            thread_retuner = choose_threads_for_all(raw_model, tuning_loader, ctx, dist_info)
        else:
            thread_retuner = choose_threads(raw_model, tuning_loader, ctx, dist_info.master)
    run_provenance = dict(provenance(dist_info.device), dtype=dtype, compile=compile_model,
                          world_size=dist_info.world_size)
    if dist_info.master:
        print("provenance: " + json.dumps(run_provenance))
    # the optimizer must see the parameters the training model has: under FSDP, the sharded ones; raw_model
    # stays the plain module (sharded in place under FSDP) that checkpoints are taken from
    model = wrap_model(raw_model, dist_info, compile_model, cfg['parallelism'], dtype)
    if fsdp and dist_info.master:
        print(f"fsdp: this rank holds {local_param_count(raw_model):,} of "
              f"{raw_model.get_num_params(non_embedding=False):,} parameters")
    optimizer = raw_model.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'],
                                               (cfg['beta1'], cfg['beta2']), device_type)
    return model, optimizer, scaler, thread_retuner, run_provenance


def choose_threads(model, loader, ctx, master):
    """
    Small models run faster on fewer CPU threads than cores (per-op overhead outweighs the parallelism), so
    time the candidates on a batch of an evaluation stream (rewound before every evaluation, so the training
    stream is untouched) and keep the fastest. Returns a ThreadRetuner that re-checks while training, as
    the machine's load changes (None when there was nothing to choose).
    """
    threads, timings = tune_cpu_threads(model, *loader.next_batch(), ctx)
    if not timings:
        return None
    if master:
        print(describe_thread_choice(threads, timings))
    return ThreadRetuner(list(timings))  # the thread counts it timed


def choose_threads_for_all(model, loader, ctx, dist_info):
    """
    choose_threads on rank 0 only, its choice then set on every rank (same cores per process, same model:
    the same best count). Each rank gets its own ThreadRetuner over rank 0's candidates, as under DDP.
    """
    import torch.distributed as dist
    choice = [None, None]  # (threads, the counts timed, or None when there was nothing to choose)
    if dist_info.rank == 0:
        retuner = choose_threads(model, loader, ctx, master=True)
        choice = [torch.get_num_threads(), retuner and retuner.candidates]
    dist.broadcast_object_list(choice, src=0)
    threads, candidates = choice
    torch.set_num_threads(threads)
    return ThreadRetuner(candidates) if candidates else None


def resume(state, ckpt, optimizer, scaler, train_loader, dist_info):
    """ Continue where the checkpoint stopped: counters, optimizer, GradScaler, RNGs and the data position. """
    state.iter_num = int(ckpt['iter_num'])
    state.best_val_loss = float(ckpt['best_val_loss'])
    restore_training_state(ckpt, optimizer, scaler, dist_info)
    if ckpt.get('spike_guard'):  # its running statistics: the guard decides as the uninterrupted run would
        state.spike_guard.load_state_dict(ckpt['spike_guard'])
    if ckpt.get('loader'):
        train_loader.load_state_dict(ckpt['loader'])
    elif dist_info.master:
        print("warning: the checkpoint has no data-loader state (a nanoGPT checkpoint?); "
              "the data order after resuming will differ from an uninterrupted run", file=sys.stderr)


# -----------------------------------------------------------------------------
# the steps of one iteration

@torch.no_grad()
def estimate_loss(model, loaders, eval_iters, ctx, dist_info):
    """
    {split: mean loss over eval_iters batches} for each loader of {split: loader}; the ranks share the
    batches (rank r takes r, r + world_size, ...) and the sum is reduced over them.
    """
    model.eval()
    losses = {}
    # every rank runs the same number of forwards: under FSDP each one all-gathers weights (and DDP's first
    # broadcasts buffers), so a rank with one forward fewer would leave the others waiting. A rank whose
    # share ends early runs on past eval_iters and leaves those losses out of the sum.
    forwards = math.ceil(eval_iters / dist_info.world_size)
    for split, loader in loaders.items():
        loader.reset()  # the same batches at every evaluation, so the numbers are comparable
        total = torch.zeros((), dtype=torch.float64, device=dist_info.device)
        for k in range(forwards):
            X, Y = loader.next_batch()  # batch k * world_size + rank of the stream
            with ctx:
                _, loss = model(X, Y)
            if k * dist_info.world_size + dist_info.rank < eval_iters:
                total += loss.double()
        total, = all_reduce_sum([total.item()], dist_info)
        losses[split] = total / eval_iters
    model.train()
    return losses


def evaluate(run, state, lr):
    """
    Print and log both splits' losses, then checkpoint: with always_save_checkpoint, at every evaluation
    (unless checkpoint_interval sets the saves); without, whenever the val loss improved (the best model).
    Returns whether it saved.
    """
    cfg = run.cfg
    losses = estimate_loss(run.model, run.eval_loaders, cfg['eval_iters'], run.ctx, run.dist_info)
    if run.dist_info.master:
        print(f"step {state.iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        run.logger.log({'type': 'eval', 'iter': state.iter_num, 'train_loss': losses['train'],
                        'val_loss': losses['val'], 'lr': lr})
    if not math.isfinite(losses['val']):
        fail_everywhere(non_finite_loss(losses['val'], state.iter_num, cfg['out_dir']), run.dist_info)
    improved = losses['val'] < state.best_val_loss
    if improved:
        state.best_val_loss = losses['val']
    if state.iter_num == 0:
        return False  # iteration 0 has nothing new to save
    if not cfg['always_save_checkpoint'] and improved:
        write_checkpoint(run, state, best=True)
        return True
    if cfg['always_save_checkpoint'] and cfg['checkpoint_interval'] == 0:
        write_checkpoint(run, state)
        return True
    return False


def train_step(run, state):
    """
    One optimizer step over grad_accum micro-batches, starting with state.batch; fetches the batches of the
    next step as it goes. Returns (the step's loss: the mean over micro-batches and ranks; the grad norm before
    clipping, or None when it isn't measured), as floats, the same on every rank.
    """
    cfg = run.cfg
    step_loss = accumulate_gradients(run, state)
    grad_norm = unscale_and_clip(run.model, run.optimizer, run.scaler, cfg['grad_clip'], measure=cfg['skip_grad_z'] > 0)
    # read every iteration, in one all-reduce: the stop on a non-finite loss and the spike guard decide before
    # the update, and alike on every rank (the grad norm is the same everywhere; averaging it keeps it bitwise so)
    values = all_reduce_mean([step_loss.item()] + ([float(grad_norm)] if grad_norm is not None else []), run.dist_info)
    lossf, grad_norm = values[0], (values[1] if grad_norm is not None else None)
    if not math.isfinite(lossf):
        fail_everywhere(non_finite_loss(lossf, state.iter_num, cfg['out_dir']), run.dist_info)
    spike = state.spike_guard.check(lossf, grad_norm) if state.spike_guard.enabled else None
    if spike is None:
        take_update(run.optimizer, run.scaler)
    else:
        skip_update(run.optimizer, run.scaler)  # the weights and AdamW state stay as they were
        report_skip(run, state, spike)
    return lossf, grad_norm


def accumulate_gradients(run, state):
    """ The forward and backward passes of one step's micro-batches; returns this rank's loss (a tensor: no sync). """
    model, loader, n = run.model, run.train_loader, run.grad_accum
    step_loss = torch.zeros((), device=run.dist_info.device)
    for micro_step in range(n):
        last = micro_step == n - 1
        with grad_sync_context(model, sync=last):  # DDP: all-reduce the gradients once, after the last backward
            X, Y = state.batch
            with run.ctx:
                _, loss = model(X, Y)
                loss = loss / n  # the micro-batches' mean, not their sum, is the step's loss
            # fetch the next batch now: on a GPU it loads while the forward pass still runs
            if last:
                state.loader_state = loader.state_dict()  # a checkpoint of this step resumes at the next batch
            state.batch = loader.next_batch()
            run.scaler.scale(loss).backward()  # the scaler multiplies float16 losses so small gradients survive
        step_loss += loss.detach()
    return step_loss


def report_skip(run, state, spike):
    """ A line (every time) and a metrics record for an update the spike guard skipped (rank 0). """
    if run.dist_info.master:
        print(f"iter {state.iter_num}: skipped the update: {spike.describe()}")
        run.logger.log(dict(spike.record(state.iter_num), skipped_updates=state.spike_guard.skipped))


def lap(state):
    """ Seconds since the previous call (evaluations and checkpoints included, as nanoGPT's timing). """
    now = time.time()
    dt, state.lap_start = now - state.lap_start, now
    return dt


def log_iteration(run, state, lossf, grad_norm, lr, dt):
    """ The `iter N: loss ...` line and metrics record (rank 0) of the step's loss and grad norm (floats or None). """
    cfg = run.cfg
    if not run.dist_info.master:
        return
    if state.local_iter_num >= 5:  # the first iterations of a process are slow (allocator, caches): not in MFU
        # per device, as nanoGPT: this rank's tokens against one device's peak
        mfu = run.raw_model.estimate_mfu(cfg['batch_size'] * run.grad_accum, dt, peak_flops=run.peak_flops)
        state.running_mfu = mfu if state.running_mfu == -1.0 else 0.9 * state.running_mfu + 0.1 * mfu
    print(f"iter {state.iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {state.running_mfu*100:.2f}%")
    run.logger.log({'type': 'iter', 'iter': state.iter_num, 'loss': lossf, 'lr': lr,
                    'grad_norm': grad_norm,
                    'time_ms': dt * 1000, 'tokens_per_sec': run.tokens_per_iter / dt, 'mfu': state.running_mfu})


def retune_threads(run, state, dt, evaluated):
    """ Feed the thread retuner this iteration's time; not the first (warm-up) or one that also evaluated. """
    if run.thread_retuner is None or evaluated or state.local_iter_num == 0:
        return
    message = run.thread_retuner.observe(dt)
    if message and run.dist_info.master:
        print(f"at iter {state.iter_num}, {message}")


def non_finite_loss(value, iter_num, out_dir):
    return UserError(f"loss is {value} at iter {iter_num}; stopping without saving, so the last good "
                     f"checkpoint in {out_dir} is kept. Lower the learning rate (or use "
                     f"--dtype=bfloat16/float32) and resume with --init_from=resume")


# -----------------------------------------------------------------------------
# zero-shot HellaSwag and greedy samples while training

def load_hellaswag(cfg, dist_info, tokenizer_meta, block_size):
    """
    The HellaSwag examples the loop scores (evaluation.task_examples: eval.py's), or None when
    hellaswag_interval is 0. The default file is downloaded once, by rank 0, the others waiting to hear
    whether it worked; offline without it, every rank stops here with one line, before any training.
    """
    if cfg['hellaswag_interval'] == 0:
        return None
    path = cfg['hellaswag_file']
    if path == HELLASWAG_FILE and not os.path.exists(path):
        path = public_task_file('hellaswag')  # the repo's copy, wherever train.py runs from
        master_decides(dist_info, lambda: task_data_file('hellaswag', setting='hellaswag_file'))
    else:
        task_data_file('hellaswag', path, setting='hellaswag_file')  # a file of the user's must exist
    try:
        examples, total = task_examples('hellaswag', path, load_tokenizer(tokenizer_meta), block_size,
                                        cfg['hellaswag_examples'])
    except TokenizerError as e:  # a char-level vocabulary without the letters (or the space) of the endings
        raise UserError(f"HellaSwag ({path}) can't be scored with this model's tokenizer: {e}; or set "
                        f"--hellaswag_interval=0") from None
    if dist_info.master:
        print(f"hellaswag: {total:,} examples of {path}, scored every {cfg['hellaswag_interval']} iterations")
    return examples


def sampling_prompt(cfg, dist_info, tokenizer_meta):
    """
    The token ids of the prompt the loop's samples continue, or None when sample_interval is 0 (or under
    FSDP, where rank 0 alone holds no whole model to sample from and a batch of one would make every rank
    join each decoding step: the samples are left out, said once here).
    """
    if cfg['sample_interval'] == 0:
        return None
    if dist_info.ddp and cfg['parallelism'] == 'fsdp':
        if dist_info.master:
            print("note: sample_interval is ignored under parallelism=fsdp; sample from a checkpoint with sample.py")
        return None
    tokenizer = load_tokenizer(tokenizer_meta)
    if not cfg['sample_prompt']:
        return [tokenizer.eot_token if tokenizer.eot_token is not None else 0]
    try:
        return tokenizer.encode(cfg['sample_prompt'])
    except TokenizerError as e:
        raise UserError(f"--sample_prompt: {e}") from None


def due(interval, state):
    """ Whether a task run every `interval` iterations (0 = never) runs at this one. """
    return interval > 0 and state.iter_num % interval == 0


def run_in_loop_tasks(run, state):
    """
    HellaSwag and a sample when they are due at this iteration (before the val-loss evaluation). Returns
    whether anything ran (that iteration's time then says nothing about the training step's).
    """
    hellaswag = run.hellaswag is not None and due(run.cfg['hellaswag_interval'], state)
    sample = run.sample_prompt is not None and due(run.cfg['sample_interval'], state)
    if hellaswag:
        in_loop_hellaswag(run, state)
    if sample and run.dist_info.master:
        print_sample(run, state)
    return hellaswag or sample


def in_loop_hellaswag(run, state):
    """
    Score HellaSwag with the training model (compiled, wrapped: every rank takes its share of the examples
    and joins every forward) in eval mode under the run's autocast, print its line and log it (rank 0).
    """
    cfg = run.cfg
    pad_to = cfg['block_size'] if run.provenance['compile'] else None  # compiled: one shape, one graph
    run.model.eval()
    counts = score_hellaswag(run.model, run.hellaswag, cfg['batch_size'], run.dist_info.device, run.ctx,
                             run.dist_info, pad_to)
    run.model.train()
    correct, total = counts['correct_norm'], counts['total']
    if run.dist_info.master:
        print(f"hellaswag {state.iter_num}: acc_norm {correct / total:.4f} ({correct}/{total})")
        run.logger.log({'type': 'hellaswag', 'iter': state.iter_num, 'acc_norm': correct / total,
                        'correct': correct, 'total': total})


def print_sample(run, state):
    """ `sample N: <text>`: sample_tokens greedy tokens after the prompt, from the plain model (rank 0 only). """
    tokenizer = load_tokenizer(run.tokenizer_meta)
    idx = torch.tensor([run.sample_prompt], dtype=torch.long, device=run.dist_info.device)
    run.raw_model.eval()  # greedy: no randomness drawn, so the training RNGs (and a resume) are untouched
    out = generate(run.raw_model, idx, run.cfg['sample_tokens'], temperature=0.0, ctx=run.ctx,
                   vocab_size=tokenizer.vocab_size)
    run.raw_model.train()
    text = tokenizer.decode(out[0, idx.size(1):].tolist())
    text = text.replace('\\', '\\\\').replace('\n', '\\n').replace('\r', '\\r')  # one line
    print(f"sample {state.iter_num}: {text}")
    run.logger.log({'type': 'sample', 'iter': state.iter_num, 'text': text})


# -----------------------------------------------------------------------------
# checkpoints

def write_checkpoint(run, state, reason='', best=False):
    """
    out_dir/ckpt.pt, written by rank 0; every rank calls this (RNG states and FSDP shards are gathered), and
    every rank raises when the weights are not finite or rank 0 could not write (so none waits for the others).
    best=True: the best model so far (always_save_checkpoint=False), also kept as ckpt_best.pt.
    """
    cfg, dist_info = run.cfg, run.dist_info
    # each rank checks the weights it holds (its shards under FSDP) and the verdicts are summed: one decision
    # for all, taken before anything is gathered
    not_finite, = all_reduce_sum([0.0 if tensors_finite(local_parameters(run.raw_model)) else 1.0], dist_info)
    if not_finite:
        fail_everywhere(UserError(f"the model's weights are not finite at iter {state.iter_num}; not saving, so "
                                  f"the last good checkpoint in {cfg['out_dir']} is kept. Lower the learning rate "
                                  f"and resume"), dist_info)
    rng_states = gather_rng_states(dist_info)
    # FSDP: every rank takes part in gathering each tensor, only rank 0 keeps the full copy (None elsewhere)
    model_state, optimizer_state = full_state_dicts(run.raw_model, run.optimizer)

    def save():
        ckpt = build_checkpoint(run.raw_model, state.iter_num, state.best_val_loss, cfg, run.tokenizer_meta,
                                run.provenance, model_state=model_state, optimizer=optimizer_state,
                                loader=state.loader_state, rng=rng_states, spike_guard=state.spike_guard.state_dict(),
                                scaler=run.scaler.state_dict() if run.scaler.is_enabled() else None)
        path = os.path.join(cfg['out_dir'], 'ckpt.pt')
        try:
            if not cfg['always_save_checkpoint'] and not best:
                keep_best(cfg['out_dir'])
            print(f"saving checkpoint to {cfg['out_dir']}" + (f" ({reason})" if reason else ""))
            save_checkpoint(ckpt, path)
            if best:  # evaluate passes best only with always_save_checkpoint=False
                keep_checkpoint_as(path, os.path.join(cfg['out_dir'], 'ckpt_best.pt'))
            if cfg['keep_checkpoints'] > 0:
                overwriting = cfg['overwrite'] and cfg['init_from'] != 'resume'  # the old run's snapshots go
                snapshot_checkpoint(cfg['out_dir'], state.iter_num, cfg['keep_checkpoints'], drop_later=overwriting)
        except OSError as e:  # full disk, permissions, a directory in the way: the user's to fix
            raise UserError(f"could not write the checkpoint {path} ({e.strerror or e}); make room or fix "
                            f"--out_dir, then resume from the last checkpoint with --init_from=resume") from None
    master_decides(dist_info, save)  # rank 0 saves; all ranks learn whether it worked


def keep_best(out_dir):
    """
    Before a save that is not the best model (a checkpoint_interval save, an interrupted or final one) replaces
    ckpt.pt in always_save_checkpoint=False mode: ckpt.pt is the best model unless ckpt_best.pt already has it.
    """
    path, best_path = os.path.join(out_dir, 'ckpt.pt'), os.path.join(out_dir, 'ckpt_best.pt')
    if os.path.exists(path) and not os.path.exists(best_path):
        keep_checkpoint_as(path, best_path)
        print(f"kept the best checkpoint so far as {best_path}")


def checkpoint_due(cfg, state):
    """ checkpoint_interval=N: save the state after every N steps (not where this process began: nothing new). """
    n = cfg['checkpoint_interval']
    return n > 0 and state.iter_num % n == 0 and state.local_iter_num > 0


def stop_cleanly(run, state):
    """ After SIGINT/SIGTERM: save the state of this iteration, so --init_from=resume continues exactly here. """
    write_checkpoint(run, state, reason=f"interrupted at iter {state.iter_num}")
    if run.dist_info.master:
        print(f"stopped cleanly; continue with --init_from=resume --out_dir={run.cfg['out_dir']} (exit code 75)")


if __name__ == '__main__':
    run_main(main)
