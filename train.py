"""
This training script can be run both on a single device (CPU, CUDA or MPS) and with distributed data
parallel (DDP) across processes, GPUs and nodes, exactly like nanoGPT's.

To run on a single GPU or on the CPU, example:
$ python train.py config/train_shakespeare_char.py
$ python train.py config/train_shakespeare_char_cpu.py        # nanoGPT's laptop command, ~minutes

To run with DDP on 4 gpus on 1 node, example:
$ torchrun --standalone --nproc_per_node=4 train.py

To run with DDP on the CPU (gloo), example:
$ torchrun --standalone --nproc_per_node=2 train.py config/train_shakespeare_char_cpu.py --device=cpu

To shard the model, gradients and optimizer state over the processes instead (FSDP2; for models whose
weights + AdamW state don't fit one GPU, e.g. finetuning gpt2-xl on 24 GB cards), example:
$ torchrun --standalone --nproc_per_node=4 train.py config/finetune_shakespeare.py --parallelism=fsdp

To run with DDP on 4 gpus across 2 nodes, example:
- Run on the first (master) node with example IP 123.456.123.456:
$ torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --master_addr=123.456.123.456 --master_port=1234 train.py
- Run on the worker node:
$ torchrun --nproc_per_node=8 --nnodes=2 --node_rank=1 --master_addr=123.456.123.456 --master_port=1234 train.py
(If your cluster does not have Infiniband interconnect prepend NCCL_IB_DISABLE=1)

Resume an interrupted run (Ctrl-C, preemption, crash) exactly where its last checkpoint left it:
$ python train.py config/train_shakespeare_char.py --init_from=resume
"""

import json
import math
import os
import shutil
import sys
import time

import torch

from configurator import configure
from model import GPT, GPTConfig
from nanogpt_plus.checkpoint import (GPT2_NAMES, is_hf_dir, load_checkpoint, model_from_checkpoint,
                                     pretrained_model, pretrained_tokenizer_meta, save_checkpoint)
from nanogpt_plus.dataloader import TokenWindowLoader, dataset_dir
from nanogpt_plus.files import atomic_write
from nanogpt_plus.parallel import (accumulation_per_rank, all_reduce_mean, all_reduce_sum, full_state_dicts,
                                   grad_sync_context, local_param_count, wrap_model)
from nanogpt_plus.runtime import UserError, destroy_distributed, device_type_of, init_distributed, provenance, run_main
from nanogpt_plus.threads import ThreadRetuner, describe_thread_choice, tune_cpu_threads
from nanogpt_plus.tokenizer import read_dataset_meta
from nanogpt_plus.training import (GracefulExit, MetricsLogger, compute_setup, fit_block_size, gather_rng_states,
                                   get_lr, make_grad_scaler, optimizer_step, restore_training_state, tensors_finite)

# -----------------------------------------------------------------------------
# default config values designed to train a gpt2 (124M) on OpenWebText
DEFAULTS = dict(
    # I/O
    out_dir='out',
    eval_interval=2000,
    log_interval=1,
    eval_iters=200,
    eval_only=False,  # if True, script exits right after the first eval
    always_save_checkpoint=True,  # if True, always save a checkpoint after each eval
    init_from='scratch',  # 'scratch' or 'resume' or 'gpt2*' or a local Hugging Face GPT-2 directory
    # wandb logging
    wandb_log=False,  # disabled by default
    wandb_project='owt',
    wandb_run_name='gpt2',  # 'run' + str(time.time())
    # data
    dataset='openwebtext',
    gradient_accumulation_steps=5 * 8,  # used to simulate larger batch sizes
    batch_size=12,  # if gradient_accumulation_steps > 1, this is the micro-batch size
    block_size=1024,
    # model
    n_layer=12,
    n_head=12,
    n_embd=768,
    dropout=0.0,  # for pretraining 0 is good, for finetuning try 0.1+
    bias=False,  # do we use bias inside LayerNorm and Linear layers?
    gelu='none',  # 'none' = exact GELU (nanoGPT), 'tanh' = GPT-2's approximation (models built from scratch)
    attention='flash',  # 'flash' (scaled_dot_product_attention) or 'manual'
    # adamw optimizer
    learning_rate=6e-4,  # max learning rate
    max_iters=600000,  # total number of training iterations
    weight_decay=1e-1,
    beta1=0.9,
    beta2=0.95,
    grad_clip=1.0,  # clip gradients at this value, or disable if == 0.0
    # learning rate decay settings
    decay_lr=True,  # whether to decay the learning rate
    warmup_iters=2000,  # how many steps to warm up for
    lr_decay_iters=600000,  # should be ~= max_iters per Chinchilla
    min_lr=6e-5,  # minimum learning rate, should be ~= learning_rate/10 per Chinchilla
    # system
    backend='auto',  # 'auto' = nccl for CUDA, gloo for CPU; or 'nccl', 'gloo'
    parallelism='ddp',  # under torchrun: 'ddp' (a full model copy per rank) or 'fsdp' (shard the model, FSDP2)
    device='auto',  # 'auto' (cuda, else mps, else cpu), 'cpu', 'cuda', 'cuda:N', 'mps'
    dtype='auto',  # 'auto' (bfloat16 if supported, else float16 on GPUs; float32 on CPU), 'float32', 'bfloat16', 'float16'
    compile=None,  # None = auto (on for CUDA); True/False to force; use PyTorch 2.0 to compile the model to be faster
    num_threads=0,  # CPU threads for torch; 0 = auto (time all cores, half, ..., 1; keep the fastest; re-check every 250 iters)
    seed=1337,
)
# -----------------------------------------------------------------------------


def build_model(cfg, data_meta, resume_ckpt):
    """ The plain model for init_from, and the model_args that describe it. """
    init_from = cfg['init_from']
    if init_from == 'resume':
        print(f"Resuming training from {cfg['out_dir']}")
        # force these config attributes to be equal otherwise we can't even resume training;
        # the rest of the attributes (e.g. dropout) can stay as desired from command line
        model = model_from_checkpoint(resume_ckpt, dropout=cfg['dropout'])
    elif init_from == 'scratch':
        print("Initializing a new model from scratch")
        if data_meta is not None and data_meta.get('vocab_size'):
            vocab_size = int(data_meta['vocab_size'])
            print(f"found vocab_size = {vocab_size} (inside {dataset_dir(cfg['dataset'])})")
        else:
            print("defaulting to vocab_size of GPT-2 to 50304 (50257 rounded up for efficiency)")
            vocab_size = 50304
        model = GPT(GPTConfig(n_layer=cfg['n_layer'], n_head=cfg['n_head'], n_embd=cfg['n_embd'],
                              block_size=cfg['block_size'], bias=cfg['bias'], vocab_size=vocab_size,
                              dropout=cfg['dropout'], gelu=cfg['gelu']))
    elif init_from in GPT2_NAMES or is_hf_dir(init_from):
        print(f"Initializing from OpenAI GPT-2 weights: {init_from}")
        model = pretrained_model(init_from, cfg['dropout'])
    else:
        raise UserError(f"unknown init_from '{init_from}': use scratch, resume, gpt2, gpt2-medium, gpt2-large, "
                        f"gpt2-xl or a local Hugging Face GPT-2 directory")
    # crop down the model block size if desired, using model surgery
    fit_block_size(model, cfg['block_size'])
    data_vocab = (data_meta or {}).get('vocab_size')
    if data_vocab and int(data_vocab) > model.config.vocab_size:
        raise UserError(f"the dataset's vocabulary ({data_vocab}) is larger than the model's "
                        f"({model.config.vocab_size}); train from scratch on this dataset")
    return model


def main(argv=None):
    cfg = configure(DEFAULTS, argv, doc=__doc__)
    if cfg['compile'] not in (None, True, False):
        raise UserError(f"compile must be True, False or None (auto), got {cfg['compile']!r}")
    if cfg['parallelism'] not in ('ddp', 'fsdp'):
        raise UserError(f"parallelism must be 'ddp' or 'fsdp', got {cfg['parallelism']!r}")
    if cfg['init_from'] == 'resume' and not os.path.exists(os.path.join(cfg['out_dir'], 'ckpt.pt')):
        raise UserError(f"init_from=resume but there is no checkpoint at {os.path.join(cfg['out_dir'], 'ckpt.pt')}; "
                        f"check --out_dir or start with --init_from=scratch")

    # various inits, derived attributes, I/O setup
    dist_info = init_distributed(cfg['device'], cfg['backend'])
    try:
        train(cfg, dist_info)
    finally:
        destroy_distributed()


def train(cfg, dist_info):
    master_process = dist_info.master
    device = dist_info.device
    device_type = device_type_of(device)
    # world_size number of processes will be training simultaneously, so we can scale
    # down the desired gradient accumulation iterations per process proportionally
    gradient_accumulation_steps = accumulation_per_rank(cfg['gradient_accumulation_steps'], dist_info)
    tokens_per_iter = gradient_accumulation_steps * dist_info.world_size * cfg['batch_size'] * cfg['block_size']
    if master_process:
        print(f"tokens per iteration will be: {tokens_per_iter:,}")
        os.makedirs(cfg['out_dir'], exist_ok=True)
    torch.manual_seed(cfg['seed'] + dist_info.rank)  # dropout differs per rank, data does not (see dataloader)
    dtype, ctx, compile_model, peak_flops = compute_setup(device, cfg['dtype'], cfg['compile'], cfg['num_threads'],
                                                          peak=master_process)  # only rank 0 reports MFU
    fsdp = dist_info.ddp and cfg['parallelism'] == 'fsdp'

    # data: one shared random stream for training, fixed streams for evaluation
    data_dir = dataset_dir(cfg['dataset'])
    data_meta = read_dataset_meta(data_dir)

    def loader(split, seed):
        return TokenWindowLoader(os.path.join(data_dir, f'{split}.bin'), cfg['batch_size'], cfg['block_size'],
                                 seed=seed, rank=dist_info.rank, world_size=dist_info.world_size, device=device,
                                 dataset=cfg['dataset'])
    train_loader = loader('train', cfg['seed'])
    eval_loaders = {'train': loader('train', cfg['seed'] + 1), 'val': loader('val', cfg['seed'] + 2)}

    # init these up here, can override if init_from='resume' (i.e. from a checkpoint)
    iter_num = 0
    best_val_loss = 1e9
    resume_ckpt = None
    if cfg['init_from'] == 'resume':
        resume_ckpt = load_checkpoint(os.path.join(cfg['out_dir'], 'ckpt.pt'), map_location='cpu')
        iter_num = int(resume_ckpt['iter_num'])
        best_val_loss = float(resume_ckpt['best_val_loss'])
    model = build_model(cfg, data_meta, resume_ckpt)
    model.set_attention(cfg['attention'])
    if not fsdp:
        model.to(device)  # FSDP moves the model itself, one shard at a time
    tokenizer_meta = (resume_ckpt or {}).get('tokenizer') or data_meta or {'kind': 'gpt2'}
    if cfg['init_from'] != 'scratch' and cfg['init_from'] != 'resume':
        tokenizer_meta = pretrained_tokenizer_meta(cfg['init_from'])

    # initialize a GradScaler. If enabled=False scaler is a no-op
    scaler = make_grad_scaler(device_type, dtype)

    # CPU threads: small models run faster on fewer threads than cores (per-op overhead), so time them;
    # on a batch of the evaluation stream (reset before every evaluation), not the training stream
    # (and re-checked while training, as the machine's load changes: ThreadRetuner)
    thread_retuner = None
    if device_type == 'cpu' and cfg['num_threads'] == 0:
        threads, timings = tune_cpu_threads(model, *eval_loaders['train'].next_batch(), ctx)
        if timings:
            thread_retuner = ThreadRetuner(list(timings))  # the counts it timed
            if master_process:
                print(describe_thread_choice(threads, timings))
    # what produced this run (versions, git commit, device, threads): printed now, stored in every checkpoint
    run_provenance = dict(provenance(device), dtype=dtype, compile=compile_model, world_size=dist_info.world_size)
    if master_process:
        print("provenance: " + json.dumps(run_provenance))

    # wrap (compile, DDP) or shard (FSDP) the model before the optimizer sees its parameters
    raw_model = model  # the plain GPT (sharded in place under FSDP): checkpoints, MFU and attention settings
    model = wrap_model(model, dist_info, compile_model, cfg['parallelism'])
    if fsdp and master_process:
        print(f"fsdp: this rank holds {local_param_count(raw_model):,} of "
              f"{raw_model.get_num_params(non_embedding=False):,} parameters")

    # optimizer
    optimizer = raw_model.configure_optimizers(cfg['weight_decay'], cfg['learning_rate'],
                                               (cfg['beta1'], cfg['beta2']), device_type)
    if resume_ckpt is not None:
        restore_training_state(resume_ckpt, optimizer, scaler, dist_info)
        if resume_ckpt.get('loader'):
            train_loader.load_state_dict(resume_ckpt['loader'])
        elif master_process:
            print("warning: the checkpoint has no data-loader state (a nanoGPT checkpoint?); "
                  "the data order after resuming will differ from an uninterrupted run", file=sys.stderr)
    resume_ckpt = None  # free up memory


    # helps estimate an arbitrarily accurate loss over either split using many batches
    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split, split_loader in eval_loaders.items():
            split_loader.reset()  # the same batches at every evaluation, so numbers are comparable
            total = torch.zeros((), dtype=torch.float64, device=device)
            for _ in range(dist_info.rank, cfg['eval_iters'], dist_info.world_size):  # this rank's share
                X, Y = split_loader.next_batch()
                with ctx:
                    logits, loss = model(X, Y)
                total += loss.double()
            total, = all_reduce_sum([total.item()], dist_info)
            out[split] = total / cfg['eval_iters']
        model.train()
        return out

    logger = MetricsLogger(os.path.join(cfg['out_dir'], 'metrics.jsonl'), enabled=master_process,
                           wandb_log=cfg['wandb_log'], wandb_project=cfg['wandb_project'],
                           wandb_run_name=cfg['wandb_run_name'], config=cfg, wandb_dir=cfg['out_dir'])

    def save(loader_state, reason=''):
        """ Checkpoint from rank 0 (all ranks call this: RNG states are gathered from every rank). """
        rng_states = gather_rng_states(dist_info)
        model_state, optimizer_state = full_state_dicts(raw_model, optimizer)  # FSDP: gathered on every rank
        if not master_process:
            return
        if not tensors_finite(model_state.values()):
            raise UserError(f"the model's weights are not finite at iter {iter_num}; not saving, so the last good "
                            f"checkpoint in {cfg['out_dir']} is kept. Lower the learning rate and resume")
        checkpoint = {
            'model': model_state,
            'optimizer': optimizer_state,
            'model_args': raw_model.config.model_args(),
            'model_extra_args': raw_model.config.model_extra_args(),
            'iter_num': iter_num,
            'best_val_loss': best_val_loss,
            'config': cfg,
            'tokenizer': tokenizer_meta,
            'loader': loader_state,
            'rng': rng_states,
            'scaler': scaler.state_dict() if scaler.is_enabled() else None,
            'provenance': run_provenance,
        }
        ckpt_path = os.path.join(cfg['out_dir'], 'ckpt.pt')
        if reason and not cfg['always_save_checkpoint'] and os.path.exists(ckpt_path):
            # ckpt.pt holds the best model so far; keep it before the interrupted state takes its place
            best_path = os.path.join(cfg['out_dir'], 'ckpt_best.pt')
            atomic_write(best_path, lambda f: shutil.copyfileobj(open(ckpt_path, 'rb'), f))
            print(f"kept the best checkpoint so far as {best_path}")
        print(f"saving checkpoint to {cfg['out_dir']}" + (f" ({reason})" if reason else ""))
        save_checkpoint(checkpoint, ckpt_path)

    def stop_non_finite(loss_value):
        raise UserError(f"loss is {loss_value} at iter {iter_num}; stopping without saving, so the last good "
                        f"checkpoint in {cfg['out_dir']} is kept. Lower the learning rate (or use "
                        f"--dtype=bfloat16/float32) and resume with --init_from=resume")

    # training loop
    exit_request = GracefulExit().install()
    loader_state = train_loader.state_dict()  # the loader state *before* the batch of the current iteration
    X, Y = train_loader.next_batch()  # fetch the very first batch
    t0 = time.time()
    local_iter_num = 0  # number of iterations in the lifetime of this process
    running_mfu = -1.0
    step_loss = torch.zeros((), device=device)
    try:
        while True:
            # determine and set the learning rate for this iteration
            lr = get_lr(iter_num, cfg['learning_rate'], cfg['warmup_iters'], cfg['lr_decay_iters'], cfg['min_lr']) \
                if cfg['decay_lr'] else cfg['learning_rate']
            for param_group in optimizer.param_groups:
                param_group['lr'] = lr

            # evaluate the loss on train/val sets and write checkpoints
            evaluated = iter_num % cfg['eval_interval'] == 0
            if evaluated:
                losses = estimate_loss()
                if master_process:
                    print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                    logger.log({'type': 'eval', 'iter': iter_num, 'train_loss': losses['train'],
                                'val_loss': losses['val'], 'lr': lr})
                if not math.isfinite(losses['val']):
                    stop_non_finite(losses['val'])
                if losses['val'] < best_val_loss or cfg['always_save_checkpoint']:
                    if losses['val'] < best_val_loss:
                        best_val_loss = losses['val']
                    if iter_num > 0:
                        save(loader_state)
            if iter_num == 0 and cfg['eval_only']:
                break

            # forward backward update, with optional gradient accumulation to simulate larger batch size
            # and using the GradScaler if data type is float16
            step_loss.zero_()
            for micro_step in range(gradient_accumulation_steps):
                # in DDP training we only need to sync gradients at the last micro step
                with grad_sync_context(model, micro_step == gradient_accumulation_steps - 1):
                    with ctx:
                        logits, loss = model(X, Y)
                        loss = loss / gradient_accumulation_steps  # scale the loss to account for gradient accumulation
                    # immediately async prefetch next batch while model is doing the forward pass on the GPU
                    if micro_step == gradient_accumulation_steps - 1:
                        loader_state = train_loader.state_dict()
                    X, Y = train_loader.next_batch()
                    # backward pass, with gradient scaling if training in fp16
                    scaler.scale(loss).backward()
                step_loss += loss.detach()
            grad_norm = optimizer_step(model, optimizer, scaler, cfg['grad_clip'])

            # timing and logging
            t1 = time.time()
            dt = t1 - t0
            t0 = t1
            log_step = iter_num % cfg['log_interval'] == 0
            if log_step:
                # the mean loss of this step over all micro-batches and ranks (one sync, at log time only)
                lossf, = all_reduce_mean([step_loss.item()], dist_info)
                if not math.isfinite(lossf):
                    stop_non_finite(lossf)
                if master_process:
                    if local_iter_num >= 5:  # let the training loop settle a bit
                        # per device, as nanoGPT: this rank's tokens against one device's peak
                        mfu = raw_model.estimate_mfu(cfg['batch_size'] * gradient_accumulation_steps, dt,
                                                     peak_flops=peak_flops)
                        running_mfu = mfu if running_mfu == -1.0 else 0.9 * running_mfu + 0.1 * mfu
                    print(f"iter {iter_num}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {running_mfu*100:.2f}%")
                    logger.log({'type': 'iter', 'iter': iter_num, 'loss': lossf, 'lr': lr,
                                'grad_norm': float(grad_norm) if grad_norm is not None else None,
                                'time_ms': dt * 1000, 'tokens_per_sec': tokens_per_iter / dt, 'mfu': running_mfu})
            if thread_retuner is not None and not evaluated and local_iter_num > 0:
                message = thread_retuner.observe(dt)
                if message and master_process:
                    print(f"at iter {iter_num}, {message}")
            iter_num += 1
            local_iter_num += 1

            # termination conditions
            if iter_num > cfg['max_iters']:
                break
            if exit_request.should_stop(dist_info, sync_point=log_step):  # DDP: checked at log steps
                save(loader_state, reason=f"interrupted at iter {iter_num}")
                if master_process:
                    print(f"stopped cleanly; continue with --init_from=resume --out_dir={cfg['out_dir']}")
                break
    finally:
        exit_request.uninstall()
        logger.close()


if __name__ == '__main__':
    run_main(main)
