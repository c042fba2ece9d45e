"""
The optimizer side of a training step, shared by train.py and finetune.py: the optimizer itself
(AdamW, or Muon with AdamW: muon.py), the learning-rate schedule (and setting it on the
optimizer), the GradScaler, and the step itself in two halves (unscale and clip, then take or skip
the update), so that the spike guard can refuse an update in between.

Usage:
    from nanogpt_plus.optimizer import AdamWSpec, LRSchedule, make_optimizer, set_learning_rate, ...
    optimizer = make_optimizer(model, cfg.select(AdamWSpec), 'cpu')   # AdamW
    optimizer = make_optimizer(model, cfg.select(AdamWSpec), 'cpu', muon=cfg.select(MuonSpec))
    schedule = LRSchedule(learning_rate=6e-4, warmup_iters=2000, lr_decay_iters=600000, min_lr=6e-5)
    lr = set_learning_rate(optimizer, schedule.rate(iter_num))
    grad_norm = unscale_and_clip(model, optimizer, scaler, grad_clip=1.0)
    take_update(optimizer, scaler)
"""

import functools
import math
from dataclasses import dataclass

import torch

from nanogpt_plus.distributed import all_reduce_mean

# the optimizer setting's choices (make_optimizer): AdamW for every parameter, or Muon for the
# Blocks' matrices and AdamW for the rest
OPTIMIZERS = ('adamw', 'muon')
# the lr_schedule setting's choices (LRSchedule.rate)
LR_SCHEDULES = ('cosine', 'wsd')


@dataclass(frozen=True)
class LRSchedule:
    """
    The learning rate of each iteration (rate): a linear ramp up to learning_rate over warmup_iters,
    then
      - 'cosine' (nanoGPT's): a half cosine from learning_rate down to min_lr that ends at
        lr_decay_iters;
      - 'wsd' (warmup-stable-decay, arXiv:2404.06395): learning_rate until the last cooldown_frac of
        lr_decay_iters, then a straight line down to min_lr at lr_decay_iters;
    and min_lr after lr_decay_iters. decay_lr=False: learning_rate throughout.
    """
    learning_rate: float
    warmup_iters: int
    lr_decay_iters: int
    min_lr: float
    decay_lr: bool = True
    lr_schedule: str = 'cosine'
    cooldown_frac: float = 0.2

    def rate(self, it):
        """ The learning rate of iteration `it`. """
        peak, low = self.learning_rate, self.min_lr
        warmup, end = self.warmup_iters, self.lr_decay_iters
        if not self.decay_lr:
            return peak
        if it < warmup:
            # never 0, so iteration 0 already learns
            return peak * (it + 1) / (warmup + 1)
        # past the decay, or no decay phase at all
        if it > end or end <= warmup:
            return low
        if self.lr_schedule == 'wsd':
            cooldown_start = max(warmup, end - self.cooldown_frac * end)
            if it < cooldown_start:
                return peak
            # 0 -> 1 over the cooldown
            progress = (it - cooldown_start) / max(end - cooldown_start, 1)
            return peak + progress * (low - peak)
        # 0 after the warmup, 1 at lr_decay_iters
        progress = (it - warmup) / (end - warmup)
        cosine = 0.5 * (1.0 + math.cos(math.pi * progress))  # from 1 down to 0
        return low + cosine * (peak - low)


def set_learning_rate(optimizer, lr):
    """
    Set the rate lr (a schedule's, LRSchedule.rate) on every parameter group and return it. A group
    with an 'lr_ratio' (Muon's: muon_lr / learning_rate) gets lr times that ratio.
    """
    for group in optimizer.param_groups:
        group['lr'] = lr * group['lr_ratio'] if 'lr_ratio' in group else lr
    return lr


@dataclass(frozen=True)
class AdamWSpec:
    """ AdamW's settings (every optimizer of train.py and finetune.py has an AdamW part). """
    learning_rate: float
    weight_decay: float
    beta1: float
    beta2: float


@dataclass(frozen=True)
class MuonSpec:
    """ Muon's settings, for optimizer='muon'. """
    muon_lr: float
    muon_momentum: float
    muon_weight_decay: float
    muon_ns_steps: int = 5


def make_optimizer(model, adamw, device_type, muon=None, fused=None):
    """
    AdamW (an AdamWSpec) over every parameter (model.configure_optimizers), or, given a MuonSpec,
    Muon over the Blocks' 2-D matrices and AdamW over the rest (MuonWithAdamW). fused: AdamW's
    kernel choice (configure_optimizers'; None = fused wherever PyTorch has it).
    """
    betas = (adamw.beta1, adamw.beta2)
    make_adamw = functools.partial(model.configure_optimizers, adamw.weight_decay,
                                   adamw.learning_rate, betas, device_type, fused)
    if muon is None:
        return make_adamw()
    from nanogpt_plus.muon import MuonWithAdamW  # only runs with optimizer='muon' import it
    return MuonWithAdamW(model, make_adamw, adamw.learning_rate, muon.muon_lr, muon.muon_momentum,
                         muon.muon_weight_decay, ns_steps=muon.muon_ns_steps,
                         float32_ns=device_type == 'cpu')


def apply_settings(optimizer, adamw, muon=None, master=True):
    """
    On resume, after the optimizer's state was loaded (load_state_dict brings back the parameter
    groups as the checkpoint had them): this run's optimizer settings (its AdamWSpec, and a Muon
    optimizer's MuonSpec) on those groups, so that a changed --beta2, --weight_decay, --muon_lr,
    --muon_momentum or --muon_weight_decay is what trains from here on (and what the next
    checkpoint's optimizer and config say). AdamW's betas on every group and weight_decay on the
    groups of matrices (the vectors never decay); Muon's momentum, weight decay and rate. rank 0
    says what changed, in one line.
    """
    changed = {}

    def put(group, key, value, setting):
        old = group.get(key)
        # a list: betas as JSON would hold them
        if (tuple(old) if isinstance(old, list) else old) != value:
            changed.setdefault(setting, (old, value))
            group[key] = value

    adamw_groups = optimizer.parts['adamw'].param_groups if hasattr(
        optimizer, 'parts') else optimizer.param_groups
    for group in adamw_groups:
        put(group, 'betas', (adamw.beta1, adamw.beta2), 'betas')
        if all(p.dim() >= 2 for p in group['params']):  # the decayed group: matrices and embeddings
            put(group, 'weight_decay', adamw.weight_decay, 'weight_decay')
    if muon is not None:
        for group in optimizer.parts['muon'].param_groups:
            put(group, 'momentum', muon.muon_momentum, 'muon_momentum')
            put(group, 'weight_decay', muon.muon_weight_decay, 'muon_weight_decay')
            put(group, 'ns_steps', muon.muon_ns_steps, 'muon_ns_steps')
            put(group, 'lr_ratio', muon.muon_lr / adamw.learning_rate, 'muon_lr / learning_rate')
    if changed and master:
        print("resuming with this run's optimizer settings: " + ", ".join(
            f"{name} {old!r} -> {new!r}" for name, (old, new) in changed.items()))
    return changed


def make_grad_scaler(device_type, dtype):
    """ A GradScaler, enabled only for float16 (bf16 and fp32 don't need loss scaling). """
    return torch.amp.GradScaler(device_type if device_type == 'cuda' else 'cpu',
                                enabled=(dtype == 'float16'))


def optimizer_step(model, optimizer, scaler, grad_clip):
    """
    Unscale, clip, step, update the scaler and zero the grads; returns the grad norm tensor (or
    None).
    """
    norm = unscale_and_clip(model, optimizer, scaler, grad_clip)
    take_update(optimizer, scaler)
    return norm


def unscale_and_clip(model, optimizer, scaler, grad_clip, measure=False):
    """
    The first half of an optimizer step: unscale the float16 gradients and clip them to grad_clip.
    Returns their global norm before clipping (a tensor, the same on every rank), or None when
    grad_clip is 0 and measure is False. measure=True measures the norm without clipping (the spike
    guard needs it).
    """
    if grad_clip == 0.0 and not measure:
        return None
    scaler.unscale_(optimizer)
    if grad_clip != 0.0:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    else:
        norm = torch.nn.utils.get_total_norm(
            [p.grad for p in model.parameters() if p.grad is not None])
    if hasattr(norm, 'full_tensor'):  # FSDP: a DTensor; the same total norm on every rank
        norm = norm.full_tensor()
    return norm


def take_update(optimizer, scaler):
    """
    The second half: step (the scaler skips it if float16 gradients overflowed), update the scaler,
    zero.
    """
    scaler.step(optimizer)
    scaler.update()
    # None, not zeros: the memory is free until the next backward
    optimizer.zero_grad(set_to_none=True)


def skip_update(optimizer, scaler):
    """
    The second half of a step the spike guard refused: the weights and AdamW state stay exactly as
    they were, the gradients are dropped. A float16 scaler keeps its scale and growth count
    (new_scale=its own scale only clears the record of this iteration's unscale_, which the next
    unscale_ would refuse).
    """
    if scaler.is_enabled():
        scaler.update(new_scale=scaler.get_scale())
    optimizer.zero_grad(set_to_none=True)


def read_step(step_loss, grad_norm, dist_info):
    """
    A step's loss (this rank's micro-batch mean, a tensor) and grad norm (a tensor, or None when not
    measured) as floats, the same on every rank, in one all-reduce (and the host sync it costs): the
    loss averaged over ranks; the grad norm is already the same on every rank, and averaging it
    keeps it bitwise so.
    """
    values = all_reduce_mean([step_loss.item()] +
                             ([float(grad_norm)] if grad_norm is not None else []), dist_info)
    return values[0], (values[1] if grad_norm is not None else None)
