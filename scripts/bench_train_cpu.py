"""
End-to-end CPU training speed: our train.py against a nanoGPT baseline, on nanoGPT's laptop command
(shakespeare_char, block_size=64, batch_size=12, 4 layers x 4 heads x 128, dropout 0, no compile).

nanoGPT itself is not a dependency, so the baseline (--mode=nanogpt) is nanoGPT's train.py training loop
reproduced step for step on our model.py: exact erf GELU, scaled_dot_product_attention, the AdamW
nanoGPT builds on the CPU (not fused; PyTorch's default there is the per-tensor for-loop), nanoGPT's
get_batch (np.memmap recreated per batch, torch.stack of per-row slices), loss.item() every iteration
(log_interval=1), torch's default thread count, checkpoints whenever val improves. Same model weights
init, same schedule, same evaluation (eval_iters=20 every 250 iterations).

--mode=compare (the default) runs the baseline and `python train.py config/train_shakespeare_char_cpu.py`
as subprocesses, alternating them `rounds` times (so machine load hits both alike), parses their
"iter N: ... time Xms" lines and prints the median (and mean) ms/iter of each run, the ratio of the
medians, and the final val loss.

--mode=floor asks how fast this step could be at all: it records every matrix multiply of one training
step (forward and backward) and replays them alone, timed alternately with whole steps of ours and of
nanoGPT's loop in one process. The matmuls run at close to the CPU's best fp32 matmul speed already, so
nanoGPT's time divided by theirs bounds the speed-up any fp32 implementation of this step can reach here.

Usage:
$ python scripts/bench_train_cpu.py                               # 2 rounds x 300 iterations each
$ python scripts/bench_train_cpu.py --max_iters=2000 --rounds=1   # the full laptop run: speed + val loss
$ python scripts/bench_train_cpu.py --mode=nanogpt --max_iters=50 # just the baseline loop
$ python scripts/bench_train_cpu.py --mode=floor                  # matmul floor vs whole steps
"""
# first, before torch is imported (seconds): a signal from here on stops the script in one line
# and exit code 130, a signal during the imports once they are done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch

from configurator import Group, Schema, Setting, configure
from nanogpt_plus.checkpoint import CHECKPOINT
from nanogpt_plus.runtime import run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULTS = Schema(Group(
    'benchmark',
    mode=Setting('compare', "'compare', 'nanogpt' (the baseline loop), 'ours' (train.py) or 'floor' (see above)",
                 choices=('compare', 'nanogpt', 'ours', 'floor')),
    max_iters=Setting(300, "training iterations of each run", low=1),
    rounds=Setting(2, "compare: how many times the two runs alternate", low=1),
    baseline_threads=Setting(0, "torch threads for the baseline; 0 = torch's default, as nanoGPT", low=0),
    ours_args=Setting('', "extra --key=value arguments for train.py, space-separated (e.g. '--num_threads=1')"),
    out_dir=Setting('', "where the runs go ('' = a temporary directory)"),
    dataset=Setting('shakespeare_char', "a prepared dataset: name under data/ or a directory", not_empty=True),
))

# nanoGPT's laptop command (README): python train.py config/train_shakespeare_char.py --device=cpu
# --compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4
# --n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0
LAPTOP = dict(eval_interval=250, eval_iters=20, log_interval=1, always_save_checkpoint=False,
              dataset='shakespeare_char',
              gradient_accumulation_steps=1, batch_size=12, block_size=64, n_layer=4, n_head=4, n_embd=128,
              dropout=0.0, bias=False, learning_rate=1e-3, max_iters=2000, lr_decay_iters=2000, min_lr=1e-4,
              beta1=0.9, beta2=0.99, warmup_iters=100, weight_decay=1e-1, grad_clip=1.0, decay_lr=True)
ITER_LINE = re.compile(r"^iter (\d+): loss ([\d.]+), time ([\d.]+)ms")
EVAL_LINE = re.compile(r"^step (\d+): train loss ([\d.]+), val loss ([\d.]+)")


def nanogpt_loop(max_iters, out_dir, threads, dataset='shakespeare_char'):
    """
    The baseline: what nanoGPT's train.py does for the laptop command, one CPU process, re-enacted on our
    model.py. Each piece costs what it costs there:
      - batches: the .bin file is opened with np.memmap for every batch, batch_size offsets are drawn with
        torch.randint from the global RNG, and x and y are stacked from per-row int64 copies;
      - the next batch is read right after the forward pass, before backward;
      - backward and step go through a GradScaler that is disabled (nanoGPT builds one whatever the dtype);
      - PyTorch's default CPU AdamW (the per-tensor for-loop, not fused); the lr is set on every group each step;
      - every iteration logs: loss.item() and, after 5 iterations, a running MFU estimate;
      - every eval_interval: eval_iters batches of each split without gradients, and a torch.save of the
        model and optimizer whenever the val loss improved (not at iteration 0).
    It prints the `step N: ...` and `iter N: ...` lines train.py prints, which run() parses.
    """
    from model import GPT, GPTConfig
    from nanogpt_plus.dataset import dataset_dir, read_dataset_meta
    # the schedule of the 2000-iteration run, cut short or not
    c = dict(LAPTOP, max_iters=max_iters, dataset=dataset)
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(1337)
    data_dir = dataset_dir(c['dataset'])
    T = c['block_size']
    B = c['batch_size']
    accum = c['gradient_accumulation_steps']

    def read_batch(split):
        # opened anew each time
        tokens = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
        starts = torch.randint(high=len(tokens) - T, size=(B,))
        x = torch.stack([torch.from_numpy(tokens[s:s + T].astype(np.int64)) for s in starts])
        y = torch.stack([torch.from_numpy(tokens[s + 1:s + 1 + T].astype(np.int64)) for s in starts])
        return x, y

    vocab_size = int(read_dataset_meta(data_dir)['vocab_size'])  # nanoGPT reads meta.pkl
    model = GPT(GPTConfig(n_layer=c['n_layer'], n_head=c['n_head'], n_embd=c['n_embd'], block_size=T,
                          bias=c['bias'], vocab_size=vocab_size, dropout=c['dropout'], gelu='none'))
    scaler = torch.amp.GradScaler('cpu', enabled=False)
    # nanoGPT's configure_optimizers: fused only on CUDA, so PyTorch's default AdamW on the CPU
    optimizer = model.configure_optimizers(c['weight_decay'], c['learning_rate'], (c['beta1'], c['beta2']), 'cpu',
                                           fused=False)

    @torch.no_grad()
    def mean_losses():
        model.eval()
        means = {name: torch.tensor([model(*read_batch(name))[1].item() for _ in range(c['eval_iters'])]).mean()
                 for name in ('train', 'val')}
        model.train()
        return means

    def lr_at(it):
        top = c['learning_rate']
        bottom = c['min_lr']
        warmup = c['warmup_iters']
        decay_end = c['lr_decay_iters']
        if it < warmup:
            return top * (it + 1) / (warmup + 1)
        if it > decay_end:
            return bottom
        progress = (it - warmup) / (decay_end - warmup)  # 0 -> 1 over the cosine
        return bottom + 0.5 * (1.0 + math.cos(math.pi * progress)) * (top - bottom)

    it = 0
    best_val = 1e9
    mfu_avg = -1.0
    X, Y = read_batch('train')
    t_prev = time.time()
    while it <= c['max_iters']:
        lr = lr_at(it) if c['decay_lr'] else c['learning_rate']
        for group in optimizer.param_groups:
            group['lr'] = lr
        if it % c['eval_interval'] == 0:
            means = mean_losses()
            print(f"step {it}: train loss {means['train']:.4f}, val loss {means['val']:.4f}")
            if means['val'] < best_val or c['always_save_checkpoint']:
                best_val = means['val']
                if it > 0:
                    state = dict(model=model.state_dict(), optimizer=optimizer.state_dict(),
                                 model_args=model.config.model_args(), iter_num=it, best_val_loss=best_val, config=c)
                    print(f"saving checkpoint to {out_dir}")
                    torch.save(state, os.path.join(out_dir, CHECKPOINT))
        for _ in range(accum):
            _, loss = model(X, Y)
            loss = loss / accum
            X, Y = read_batch('train')
            scaler.scale(loss).backward()
        if c['grad_clip'] != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), c['grad_clip'])
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        now = time.time()
        dt = now - t_prev
        t_prev = now
        if it % c['log_interval'] == 0:
            lossf = loss.item() * accum
            if it >= 5:  # this process starts at iteration 0: the first 5 iterations are warm-up
                mfu = model.estimate_mfu(B * accum, dt)
                mfu_avg = mfu if mfu_avg == -1.0 else 0.9 * mfu_avg + 0.1 * mfu
            print(f"iter {it}: loss {lossf:.4f}, time {dt*1000:.2f}ms, mfu {mfu_avg*100:.2f}%")
        it += 1


def matmul_floor(rounds=3, steps=40, threads=0, dataset='shakespeare_char'):
    """
    How fast the laptop step could possibly be in fp32 on this CPU: the matrix multiplies of one training
    step (recorded at the dispatcher, then replayed alone at the same shapes and layouts) against whole steps of ours
    and of nanoGPT's loop, timed alternately in this process. The attention kernel's own products are not
    counted, so the floor is a lower bound and the ceiling it implies an upper bound.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    from model import GPT, GPTConfig
    from nanogpt_plus.dataloader import TokenWindowLoader
    from nanogpt_plus.dataset import dataset_dir, read_dataset_meta
    from nanogpt_plus.machine import measured_matmul_flops
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(1337)
    c = LAPTOP
    data_dir = dataset_dir(dataset)
    vocab_size = int(read_dataset_meta(data_dir)['vocab_size'])
    model = GPT(GPTConfig(n_layer=c['n_layer'], n_head=c['n_head'], n_embd=c['n_embd'], block_size=c['block_size'],
                          bias=c['bias'], vocab_size=vocab_size, dropout=c['dropout']))
    loader = TokenWindowLoader(os.path.join(data_dir, 'train.bin'), c['batch_size'], c['block_size'], seed=1337)
    X, Y = loader.next_batch()
    optimizers = {name: model.configure_optimizers(c['weight_decay'], 1e-4, (c['beta1'], c['beta2']), 'cpu',
                                                   fused=fused) for name, fused in (('ours', True), ('nanogpt', False))}

    def step(name):
        _, loss = model(X, Y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), c['grad_clip'])
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=True)
        if name == 'nanogpt':
            loss.item()  # nanoGPT's log_interval=1

    for name in optimizers:
        step(name)

    # record every matrix multiply of one step (backward's too) with its operands' shapes and layouts
    aten = torch.ops.aten
    kinds = (aten.mm.default, aten.bmm.default, aten.addmm.default)
    recorded = []

    class RecordMatmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in kinds:
                recorded.append((func, [(t.shape, t.stride()) for t in args if torch.is_tensor(t)]))
            return func(*args, **(kwargs or {}))

    with RecordMatmuls():
        step('ours')
    replay = []
    flops = 0
    for func, operands in recorded:
        tensors = [torch.empty_strided(shape, stride).normal_() for shape, stride in operands]
        replay.append((func, tensors))
        # addmm's bias comes first
        a_shape = operands[-2][0]
        b_shape = operands[-1][0]
        flops += 2 * math.prod(a_shape) * b_shape[-1]

    def replay_all():
        for func, tensors in replay:
            func(*tensors)

    def timed(fn, into):
        fn()
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            into.append(time.perf_counter() - t0)

    timings = {'nanogpt': [], 'ours': [], 'matmuls': []}
    for _ in range(rounds):
        timed(lambda: step('nanogpt'), timings['nanogpt'])
        timed(lambda: step('ours'), timings['ours'])
        timed(replay_all, timings['matmuls'])
    ms = {k: statistics.median(v) * 1000 for k, v in timings.items()}
    reference = measured_matmul_flops(torch.get_num_threads())
    rate = flops / (ms['matmuls'] / 1000)
    print(f"one training step of nanoGPT's laptop model, {torch.get_num_threads()} threads, medians of "
          f"{rounds} x {steps} alternating:")
    print(f"  nanoGPT's step (for-loop AdamW, loss.item()): {ms['nanogpt']:7.2f} ms")
    print(f"  ours (fused AdamW):                           {ms['ours']:7.2f} ms  ({ms['nanogpt'] / ms['ours']:.2f}x)")
    print(f"  its {len(replay)} matmuls alone, replayed:            {ms['matmuls']:7.2f} ms  "
          f"({flops / 1e9:.2f} GFLOP at {rate / 1e9:.0f} GFLOP/s, {100 * rate / reference:.0f}% of a "
          f"1024^3 matmul's {reference / 1e9:.0f})")
    rest = ms['nanogpt'] / 1.5 - ms['matmuls']
    print(f"ceiling for any fp32 implementation at this matmul speed: {ms['nanogpt'] / ms['matmuls']:.2f}x "
          f"nanoGPT; 1.5x leaves {rest:.2f} ms for everything else (ours spends "
          f"{ms['ours'] - ms['matmuls']:.2f} ms, nanoGPT {ms['nanogpt'] - ms['matmuls']:.2f} ms)")
    return dict(ms, count=len(replay), flops=flops)


def run(cmd):
    """ Run a training subprocess; returns (median ms/iter, mean ms/iter, last val loss, wall seconds, threads). """
    t = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    wall = time.time() - t
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    times = []
    val = None
    for line in proc.stdout.splitlines():
        m = ITER_LINE.match(line)
        if m and int(m.group(1)) >= 5:  # like nanoGPT's MFU: let the loop settle first
            times.append(float(m.group(3)))
        m = EVAL_LINE.match(line)
        if m:
            val = float(m.group(3))
    threads = re.search(r"using (\d+) CPU threads", proc.stdout)
    return statistics.median(times), statistics.mean(times), val, wall, threads.group(1) if threads else 'default'


def main():
    cfg = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(cfg)
    out_dir = cfg.out_dir or tempfile.mkdtemp(prefix='bench_train_cpu_')
    os.makedirs(out_dir, exist_ok=True)
    if cfg.mode == 'floor':
        matmul_floor(threads=cfg.baseline_threads, dataset=cfg.dataset)
        return
    if cfg.mode == 'nanogpt':
        nanogpt_loop(cfg.max_iters, out_dir, cfg.baseline_threads, cfg.dataset)
        return
    base_cmd = [sys.executable, os.path.abspath(__file__), '--mode=nanogpt', f"--max_iters={cfg.max_iters}",
                f"--baseline_threads={cfg.baseline_threads}", f"--out_dir={os.path.join(out_dir, 'nanogpt')}",
                f"--dataset={cfg.dataset}"]
    ours_cmd = [sys.executable, 'train.py', 'config/train_shakespeare_char_cpu.py', f"--max_iters={cfg.max_iters}",
                f"--out_dir={os.path.join(out_dir, 'ours')}", f"--dataset={cfg.dataset}"]
    ours_cmd += cfg.ours_args.split()
    if cfg.mode == 'ours':
        os.execv(sys.executable, ours_cmd)
    print(f"load average before: {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    results = {'nanogpt': [], 'ours': []}
    for r in range(cfg.rounds):
        for name, cmd in (('nanogpt', base_cmd), ('ours', ours_cmd)):
            ms, mean, val, wall, threads = run(cmd)
            results[name].append(ms)
            print(f"round {r} {name:8s}: median {ms:7.2f} ms/iter (mean {mean:7.2f}), final val loss {val:.4f}, "
                  f"wall {wall:6.1f} s, threads {threads}, load {os.getloadavg()[0]:.2f}", flush=True)
    base = statistics.median(results['nanogpt'])
    ours = statistics.median(results['ours'])
    print(f"nanoGPT baseline: {base:.2f} ms/iter, ours: {ours:.2f} ms/iter, speed-up {base / ours:.2f}x "
          f"(median over rounds of per-run medians)")


if __name__ == '__main__':
    run_main(main)
