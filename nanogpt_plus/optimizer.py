"""
The optimizer side of a training step, shared by train.py and finetune.py: the learning-rate schedule (and
setting it on the optimizer), the GradScaler, and the step itself in two halves (unscale and clip, then take
or skip the update), so that the spike guard can refuse an update in between.

Usage:
    from nanogpt_plus.optimizer import set_learning_rate, unscale_and_clip, take_update
    lr = set_learning_rate(optimizer, iter_num, 6e-4, 2000, 600000, 6e-5)
    grad_norm = unscale_and_clip(model, optimizer, scaler, grad_clip=1.0)
    take_update(optimizer, scaler)
"""

import math

import torch

from nanogpt_plus.distributed import all_reduce_mean


def get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr):
    """
    The learning rate of iteration `it`, nanoGPT's schedule: a linear ramp up to learning_rate over
    warmup_iters, a half cosine from learning_rate down to min_lr that ends at lr_decay_iters, then min_lr.
    """
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)  # never 0, so iteration 0 already learns
    if it > lr_decay_iters or lr_decay_iters <= warmup_iters:  # past the decay, or no decay phase at all
        return min_lr
    progress = (it - warmup_iters) / (lr_decay_iters - warmup_iters)  # 0 after the warmup, 1 at lr_decay_iters
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))  # from 1 down to 0
    return min_lr + cosine * (learning_rate - min_lr)


def set_learning_rate(optimizer, it, learning_rate, warmup_iters, lr_decay_iters, min_lr, decay_lr=True):
    """ Set iteration `it`'s learning rate on every parameter group and return it (no decay_lr: learning_rate). """
    lr = get_lr(it, learning_rate, warmup_iters, lr_decay_iters, min_lr) if decay_lr else learning_rate
    for group in optimizer.param_groups:
        group['lr'] = lr
    return lr


def make_grad_scaler(device_type, dtype):
    """ A GradScaler, enabled only for float16 (bf16 and fp32 don't need loss scaling). """
    return torch.amp.GradScaler(device_type if device_type == 'cuda' else 'cpu', enabled=(dtype == 'float16'))


def optimizer_step(model, optimizer, scaler, grad_clip):
    """ Unscale, clip, step, update the scaler and zero the grads; returns the grad norm tensor (or None). """
    norm = unscale_and_clip(model, optimizer, scaler, grad_clip)
    take_update(optimizer, scaler)
    return norm


def unscale_and_clip(model, optimizer, scaler, grad_clip, measure=False):
    """
    The first half of an optimizer step: unscale the float16 gradients and clip them to grad_clip. Returns
    their global norm before clipping (a tensor, the same on every rank), or None when grad_clip is 0 and
    measure is False. measure=True measures the norm without clipping (the spike guard needs it).
    """
    if grad_clip == 0.0 and not measure:
        return None
    scaler.unscale_(optimizer)
    if grad_clip != 0.0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    if hasattr(norm, 'full_tensor'):  # FSDP: a DTensor; the same total norm on every rank
        norm = norm.full_tensor()
    return norm


def take_update(optimizer, scaler):
    """ The second half: step (the scaler skips it if float16 gradients overflowed), update the scaler, zero. """
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)  # None, not zeros: the memory is free until the next backward


def skip_update(optimizer, scaler):
    """
    The second half of a step the spike guard refused: the weights and AdamW state stay exactly as they
    were, the gradients are dropped. A float16 scaler keeps its scale and growth count (new_scale=its own
    scale only clears the record of this iteration's unscale_, which the next unscale_ would refuse).
    """
    if scaler.is_enabled():
        scaler.update(new_scale=scaler.get_scale())
    optimizer.zero_grad(set_to_none=True)


def read_step(step_loss, grad_norm, dist_info):
    """
    A step's loss (this rank's micro-batch mean, a tensor) and grad norm (a tensor, or None when not measured)
    as floats, the same on every rank, in one all-reduce (and the host sync it costs): the loss averaged over
    ranks; the grad norm is already the same on every rank, and averaging it keeps it bitwise so.
    """
    values = all_reduce_mean([step_loss.item()] + ([float(grad_norm)] if grad_norm is not None else []), dist_info)
    return values[0], (values[1] if grad_norm is not None else None)
