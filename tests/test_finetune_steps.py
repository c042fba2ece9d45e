"""
finetune.py's optimizer steps under DDP: the global batch's example and LM-target counts come from the
sampler on every rank, not from a per-step all-reduce (which would wait for the GPU every step).
"""
import random
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from torch.utils.data import DistributedSampler

import finetune
from nanogpt_plus import finetuning
from nanogpt_plus.distributed import DistInfo
from nanogpt_plus.finetuning import global_batch_counts, n_lm_targets, step_batches
from test_finetune import SINGLE, config, make_source, make_task

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SPECIAL = {'start': 50, 'delim': 51, 'extract': 52}


def random_examples(n, seed):
    """ Encoded examples of 1 to 3 rows of different lengths (like similarity / multiple choice), with labels. """
    r = random.Random(seed)
    s = SPECIAL['start']
    d = SPECIAL['delim']
    e = SPECIAL['extract']
    encoded = [[[s] + [r.randrange(50) for _ in range(r.randrange(0, 6))] + [d]
                + [r.randrange(50) for _ in range(r.randrange(1, 6))] + [e] for _ in range(r.randrange(1, 4))]
               for _ in range(n)]
    return encoded, [r.randrange(3) for _ in range(n)]


def rank_run(encoded, labels, rank, world_size, batch_size, accum, seed=3):
    """ What train_step reads of a FinetuneRun, for one rank. """
    sampler = DistributedSampler(range(len(encoded)), num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=False)
    recipe = finetuning.Recipe(epochs=3, batch_size=batch_size, learning_rate=1e-3, min_lr=1e-4, decay_lr=True,
                               warmup_frac=0.1, weight_decay=0.01, beta1=0.9, beta2=0.999)
    return SimpleNamespace(sampler=sampler, schedule=finetuning.Schedule.for_run(len(sampler), recipe, accum),
                           data=SimpleNamespace(train_encoded=encoded, train_labels=labels,
                                                train_lm_targets=[n_lm_targets(e, SPECIAL) for e in encoded]),
                           special=SPECIAL,
                           dist_info=DistInfo(world_size > 1, rank, rank, world_size, 'cpu'))


# 23 examples: the ranks' shares are padded with repeated examples, and the last step of an epoch is partial
@pytest.mark.parametrize("world_size, batch_size, accum", [(1, 4, 2), (2, 3, 1), (2, 2, 3), (3, 2, 2), (4, 1, 1)])
def test_host_counts_equal_the_all_reduced_counts(world_size, batch_size, accum):
    encoded, labels = random_examples(23, seed=world_size)
    runs = [rank_run(encoded, labels, r, world_size, batch_size, accum) for r in range(world_size)]
    steps = runs[0].schedule.steps_per_epoch
    assert steps >= 2
    for epoch in range(3):
        for run in runs:
            run.sampler.set_epoch(epoch)
        orders = [list(run.sampler) for run in runs]
        for step in range(steps):
            state = finetune.FinetuneState(epoch=epoch, step_in_epoch=step)
            # what the all-reduce summed: every rank's micro-batches, counted by make_batch
            batches = [b for run, order in zip(runs, orders)
                       for b in step_batches(run.data, run.special, run.schedule, state.step_in_epoch, order, 'cpu')]
            reduced = (float(sum(b['labels'].numel() for b in batches)), float(sum(b['n_lm_targets'] for b in batches)))
            assert reduced[0] > 0
            for run in runs:  # each rank computes the same, alone
                assert global_batch_counts(run.data, run.sampler, run.schedule, state.step_in_epoch) == reduced


def test_train_steps_run_no_collective(tmp_path, monkeypatch):
    """ A DDP fine-tune (gloo, 1 rank): no all-reduce inside train_step, and the same result as without DDP. """
    src = make_source(tmp_path / 'src')
    train, val = make_task(tmp_path, 'similarity', n_train=40, n_val=10)
    common = dict(task='similarity', init_from=src, train_file=train, val_file=val, batch_size=4,
                  gradient_accumulation_steps=2, epochs=1)
    single = finetune.finetune(config(out_dir=str(tmp_path / 'single'), **common), SINGLE)

    dist.init_process_group('gloo', init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    in_step = []
    collectives = []
    real_train_step = finetune.train_step
    real_all_reduce = dist.all_reduce

    def train_step(*args):
        in_step.append(True)
        try:
            return real_train_step(*args)
        finally:
            in_step.pop()

    def all_reduce(*args, **kwargs):
        collectives.append(bool(in_step))
        return real_all_reduce(*args, **kwargs)

    monkeypatch.setattr(finetune, 'train_step', train_step)
    monkeypatch.setattr(dist, 'all_reduce', all_reduce)
    ddp = finetune.finetune(config(out_dir=str(tmp_path / 'ddp'), **common), DistInfo(True, 0, 0, 1, 'cpu'))
    # the log and evaluation syncs only, all outside the steps
    assert collectives and not any(collectives)
    assert ddp == dict(single, out_dir=str(tmp_path / 'ddp'))
