"""
What train.py does every N iterations besides training and the loss evaluation: zero-shot HellaSwag
with the training model (hellaswag_interval, eval.py's scoring) and a greedy sample after a prompt
(sample_interval), each printed as one line and logged to metrics.jsonl.

Usage:
    from nanogpt_plus.evaluation.periodic import InLoopSpec, PeriodicTasks
    # at set-up: the HellaSwag file, the prompt
    tasks = PeriodicTasks(cfg.select(InLoopSpec), dist_info, tokenizer_meta=meta, block_size=1024,
                          ctx=ctx, compiled=True)
    ran = tasks.run(iter_num, model, raw_model, logger)   # in the loop, on every rank
"""

import os
from dataclasses import dataclass

import torch

from nanogpt_plus.distributed import broadcast_object, master_decides
from nanogpt_plus.engine import generate
from nanogpt_plus.errors import TokenizerError, UserError
from nanogpt_plus.evaluation import HELLASWAG_FILE, score_hellaswag, task_data_file, task_examples
from nanogpt_plus.tokenizer import load_tokenizer


@dataclass(frozen=True)
class InLoopSpec:
    """ The settings of the tasks: how often, on what, and how much. """
    hellaswag_interval: int
    hellaswag_examples: int
    hellaswag_file: str
    sample_interval: int
    sample_tokens: int
    sample_prompt: str
    batch_size: int  # HellaSwag's examples per forward pass


class PeriodicTasks:

    def __init__(self, spec, dist_info, tokenizer_meta, block_size, ctx, compiled, fsdp=False):
        """
        Everything read before the first iteration, so that a missing HellaSwag file (offline) or a
        prompt the tokenizer can't encode stops the run at set-up with one line, not at the first
        interval. spec: an InLoopSpec; block_size: the model's; fsdp: the model is sharded
        (sampling_prompt).
        """
        self.spec = spec
        self.dist_info = dist_info
        self.ctx = ctx
        self.tokenizer_meta = tokenizer_meta
        self.pad_to = block_size if compiled else None  # compiled: one shape, one graph
        self.hellaswag = load_hellaswag(spec, dist_info, tokenizer_meta, block_size)
        self.prompt = sampling_prompt(spec, dist_info, tokenizer_meta, fsdp)

    def run(self, iter_num, model, raw_model, logger, poll=None):
        """
        HellaSwag and a sample when they are due at iter_num (before the val-loss evaluation).
        Returns whether anything ran (that iteration's time then says nothing about the training
        step's). poll: the stop agreement, asked between HellaSwag's batches (a pass over 10,042
        examples can outlast the time torchrun gives between its SIGTERM and its SIGKILL); when it
        says stop, the pass ends unscored.
        """
        hellaswag = self.hellaswag is not None and due(self.spec.hellaswag_interval, iter_num)
        sample = self.prompt is not None and due(self.spec.sample_interval, iter_num)
        if hellaswag:
            self.score_hellaswag(iter_num, model, logger, poll)
        if sample and self.dist_info.master:
            self.print_sample(iter_num, raw_model, logger)
        return hellaswag or sample

    def score_hellaswag(self, iter_num, model, logger, poll=None):
        """
        Score HellaSwag with the training model (compiled, wrapped: every rank takes its share of
        the examples and joins every forward) in eval mode under the run's autocast; print its line
        and log it (rank 0).
        """
        model.eval()
        counts = score_hellaswag(model, self.hellaswag, self.spec.batch_size, self.dist_info.device,
                                 self.ctx, self.dist_info, self.pad_to, poll=poll)
        model.train()
        if counts is None:  # stopped by a signal: no figure for this iteration
            return
        correct = counts['correct_norm']
        total = counts['total']
        if self.dist_info.master:
            print(f"hellaswag {iter_num}: acc_norm {correct / total:.4f} ({correct}/{total})")
            logger.log({'type': 'hellaswag', 'iter': iter_num, 'acc_norm': correct / total,
                        'correct': correct, 'total': total})

    def print_sample(self, iter_num, raw_model, logger):
        """
        `sample N: <text>`: sample_tokens greedy tokens after the prompt, from the plain model (rank
        0 only).
        """
        tokenizer = load_tokenizer(self.tokenizer_meta)
        idx = torch.tensor([self.prompt], dtype=torch.long, device=self.dist_info.device)
        # greedy: no randomness drawn, so the training RNGs (and a resume) are untouched
        raw_model.eval()
        out = generate(raw_model, idx, self.spec.sample_tokens, temperature=0.0, ctx=self.ctx,
                       vocab_size=tokenizer.vocab_size)
        raw_model.train()
        text = tokenizer.decode(out[0, idx.size(1):].tolist())
        text = text.replace('\\', '\\\\').replace('\n', '\\n').replace('\r', '\\r')  # one line
        print(f"sample {iter_num}: {text}")
        logger.log({'type': 'sample', 'iter': iter_num, 'text': text})


def due(interval, iter_num):
    """ Whether a task run every `interval` iterations (0 = never) runs at this one. """
    return interval > 0 and iter_num % interval == 0


def load_hellaswag(spec, dist_info, tokenizer_meta, block_size):
    """
    The HellaSwag examples the loop scores (evaluation.task_examples: eval.py's), or None when
    hellaswag_interval is 0. Rank 0 alone finds the file (downloading the default once, into the
    repo), reads and tokenizes it; every rank learns whether that worked and gets the examples over
    the process group, so the file need only be on rank 0's node (there is no shared disk between
    machines) and a rank never decides by itself whether to join a collective. Offline without it,
    every rank stops here with one line, before any training.
    """
    if spec.hellaswag_interval == 0:
        return None
    loaded = []

    def load():
        path = spec.hellaswag_file
        if path == HELLASWAG_FILE and not os.path.exists(path):
            # the repo's copy, wherever train.py runs
            path = task_data_file('hellaswag', setting='hellaswag_file')
        else:
            # a file of the user's must exist
            task_data_file('hellaswag', path, setting='hellaswag_file')
        try:
            examples, total = task_examples('hellaswag', path, load_tokenizer(tokenizer_meta),
                                            block_size, spec.hellaswag_examples)
        # a char-level vocabulary without the letters (or the space) of the endings
        except TokenizerError as e:
            raise UserError(
                f"HellaSwag ({path}) can't be scored with this model's tokenizer: {e}; or set "
                f"--hellaswag_interval=0") from None
        print(f"hellaswag: {total:,} examples of {path}, scored every {spec.hellaswag_interval} "
              f"iterations")
        loaded.append(examples)
    master_decides(dist_info, load)
    return broadcast_object(loaded[0] if loaded else None, dist_info)


def sampling_prompt(spec, dist_info, tokenizer_meta, fsdp=False):
    """
    The token ids of the prompt the loop's samples continue, or None when sample_interval is 0 (or
    under FSDP, where rank 0 alone holds no whole model to sample from and a batch of one would make
    every rank join each decoding step: the samples are left out, said once here).
    """
    if spec.sample_interval == 0:
        return None
    if fsdp:
        if dist_info.master:
            print(
                "note: sample_interval is ignored under parallelism=fsdp; sample from a checkpoint with sample.py"
            )
        return None
    tokenizer = load_tokenizer(tokenizer_meta)
    if not spec.sample_prompt:
        return [tokenizer.eot_token if tokenizer.eot_token is not None else 0]
    try:
        return tokenizer.encode(spec.sample_prompt)
    except TokenizerError as e:
        raise UserError(f"--sample_prompt: {e}") from None
