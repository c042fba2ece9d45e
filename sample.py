"""
Sample from a trained model: nanoGPT's sample.py, with a KV cache, all samples drawn as one batch,
top-p (nucleus) sampling, an end-of-text stop, and streaming output.

Usage:
    python sample.py --out_dir=out-shakespeare-char-cpu
    python sample.py --init_from=gpt2 --start="What is the answer to life?" --num_samples=3 --max_new_tokens=100
    python sample.py --out_dir=out-shakespeare-char-cpu --start=FILE:prompt.txt --num_samples=1   # streams
    python sample.py --out_dir=out-shakespeare-char-cpu --mode=fast                               # much faster

init_from: 'resume' (out_dir/ckpt.pt), a training out_dir or ckpt.pt, gpt2*, or a local Hugging Face
GPT-2 directory (nanoGPT's checkpoints load too); the text is decoded with the checkpoint's
tokenizer. Each sample is printed followed by a line of '---------------': with num_samples=1 as it
is generated, else once it and those before it are done (a batch that takes more than a few seconds
reports its progress on stderr); the speed (tokens/s) goes to stderr at the end. A prompt longer
than block_size keeps its last block_size tokens. num_threads: CPU threads (0: timed, train.py's choice).

mode: what happens past the model's block_size (within it both are exact and use the KV cache):
  exact (default)  each new token is predicted from the last block_size tokens, as nanoGPT does
                   (a full forward of block_size tokens per new token)
  fast             keep the most recent block_size/2 tokens, re-prefill them and carry on with the
                   cache: ~2 token-forwards per new token; the output is no longer nanoGPT's

weights: float32 (exact), bfloat16 or int8 (weight-only, per row): fewer bytes read per token,
faster on a CPU, the held-out loss moved in the fourth decimal. Details and measurements:
docs/sampling.md.
"""
# first, before torch is imported (seconds): from here on a signal stops the work in one line and
# exit code 130 (it can't resume; no output is left half-written), or is only said once it is done
from nanogpt_plus.signals import early_exit_request

EXIT_REQUEST = early_exit_request(__name__, resumable=False)

import codecs
import os
import sys
import time
from dataclasses import dataclass

import torch

from configurator import Group, Schema, Setting, read_settings
from nanogpt_plus import settings
from nanogpt_plus.distributed import GROUP_SETTINGS, every_rank, same_everywhere, start
from nanogpt_plus.engine import MODES, check_sampling_args, generate_stream, typical_step
from nanogpt_plus.errors import TokenizerError, UserError
from nanogpt_plus.files import refuse_special_file
from nanogpt_plus.init_from import describe_source, init_model
from nanogpt_plus.machine import PTDTYPE, auto_threads, device_type_of, precision, resolve_compile
from nanogpt_plus.progress import Progress
from nanogpt_plus.runtime import SAME_START, run_main, same_start
from nanogpt_plus.settings import flag, non_negative, positive
from nanogpt_plus.tokenizer import check_tokenizer_fits, load_tokenizer
from nanogpt_plus.weight_formats import WEIGHTS, can_pack, set_weights

SEPARATOR = '---------------'
# samples drawn at once: a batch's KV cache and logits grow with it, so a larger num_samples is
# drawn in batches of this many, each printed as it is done: memory stays bounded, and a signal is
# heard between steps (num_samples=10**8 grew to 22 GB in one batch, deaf to SIGTERM). Up to it,
# one batch, as nanoGPT draws them
MAX_BATCH_SAMPLES = 64

# num_threads=0: the thread count is re-checked every `interval` tokens, each other candidate timed
# on `probe` of them (machine.ThreadRetuner). train.py's 250: a round costs a few steps on a count
# that may be 20x slower under load, so it must be rare; a 500-token sample gets one
THREAD_RETUNING = dict(interval=250, probe=8, window=50)

# -----------------------------------------------------------------------------
# the settings and their defaults (`python sample.py --help` prints them with their help); a
# setting other entry points share has its type, range and help in nanogpt_plus/settings.py and
# its default here
IO = Group(
    'I/O',
    out_dir=settings.out_dir('out'),
    init_from=settings.init_from('resume'),
)
SAMPLING = Group(
    'sampling',
    start=Setting("\n", "the prompt text, or \"FILE:path\" to read it from a file "
                        "('<|endoftext|>': BPE's end of text)"),
    prompt=Setting('', "start under another name, for torchrun, which takes --start=... for its own "
                       "--start_method and refuses the command; '' = start"),
    num_samples=positive(10, f"samples to draw, in batches of up to {MAX_BATCH_SAMPLES}"),
    max_new_tokens=non_negative(500, "tokens added to each sample"),
    temperature=Setting(0.8, "divides the logits: < 1.0 sharper, > 1.0 flatter; 0 = greedy "
                             "(argmax)"),
    top_k=Setting(200, "draw only among the top_k most likely tokens (None: among all)",
                  none_ok=True),
    top_p=Setting(1.0, "nucleus sampling: keep the most likely tokens up to this probability mass "
                       "(1.0: off)", none_ok=True),
    mode=Setting('exact', "'exact' (nanoGPT's results) or 'fast' (a KV cache in the model's dtype, "
                          "see sample.py)", choices=MODES),
    stop_at_eot=flag(False, "BPE models (gpt2, bpe): end a sample at <|endoftext|>"),
    weights=settings.weights('float32', choices=WEIGHTS),  # shared with eval.py and finetune.py
)
MODEL = Group(
    'model',
    attention=settings.attention('flash'),
)
SYSTEM = Group(
    'system',
    device=settings.device('auto'),
    join_timeout=settings.join_timeout(120),
    dtype=settings.dtype('auto'),
    compile=settings.compile(False),
    num_threads=settings.num_threads(0),
    seed=settings.seed(1337),
)
DEFAULTS = Schema(IO, SAMPLING, MODEL, SYSTEM)
# -----------------------------------------------------------------------------


def say(line):
    """ A line about the run (not a sample): stderr, which keeps stdout the samples' alone. """
    print(line, file=sys.stderr, flush=True)


def prompt_setting(config):
    """
    (name, value) of the setting that gives the prompt: prompt where it is given, else start.
    Under torchrun a --start=... on the command line never reaches this script: torchrun takes it for
    a prefix of its own --start_method and ends with "ambiguous option"; --prompt=... (or start in a
    config file) passes.
    """
    return ('prompt', config.prompt) if config.prompt else ('start', config.start)


# the most of a prompt file read per token of block_size: a token of any of our tokenizers is a few
# bytes of text on average (GPT-2's BPE ~4, a character 1-4), so the last block_size * 64 bytes hold
# more tokens than the model can use; the rest would be cut after encoding anyway
PROMPT_BYTES_PER_TOKEN = 64


def read_start(start, block_size, name='start'):
    """
    The prompt text: start itself, or the contents of the file named by FILE:path: its last
    block_size * PROMPT_BYTES_PER_TOKEN bytes at most (said), since the model uses only its last
    block_size tokens; a FIFO or a device (/dev/zero, which never ends) is refused.
    """
    if not start.startswith('FILE:'):
        return start
    path = start[len('FILE:'):]
    refuse_special_file(path, f"{name}=FILE: prompt file")
    limit = block_size * PROMPT_BYTES_PER_TOKEN
    try:
        with open(path, 'rb') as f:
            size = os.fstat(f.fileno()).st_size
            if size > limit:
                f.seek(size - limit)
                say(f"note: {name}=FILE:{path} is {size:,} bytes; reading its last {limit:,} (the model "
                    f"uses only its last {block_size} tokens)")
            data = f.read(limit)
        if size > limit:  # the cut may fall inside a character: start at the next whole one
            while data and (data[0] & 0xC0) == 0x80:
                data = data[1:]
        return data.decode('utf-8')
    except FileNotFoundError:
        raise UserError(
            f"{name}=FILE:{path}: no such file; check the path of the prompt file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(
            f"{name}=FILE:{path} could not be read as UTF-8 text ({e}); pass a text file") from None


def encode_prompt(tok, text, block_size, vocab_size):
    """ The prompt's token ids, cropped to the last block_size tokens; errors name what to fix. """
    try:
        ids = tok.encode(text)
    except TokenizerError as e:
        raise UserError(f"start: {e}") from None
    if not ids:
        if tok.eot_token is None:
            raise UserError("start is empty; give the model at least one character to start from")
        ids = [tok.eot_token]  # GPT-2's unconditional samples start from <|endoftext|>
    if max(ids) >= vocab_size:
        raise UserError(
            f"the prompt has token id {max(ids)} but the model's vocabulary has only {vocab_size} "
            f"tokens; is this the right checkpoint for this tokenizer?")
    if len(ids) > block_size:
        print(
            f"warning: the prompt has {len(ids)} tokens, more than the model's block_size ({block_size}); "
            f"using its last {block_size} tokens",
            file=sys.stderr)
        ids = ids[-block_size:]
    return ids


class StreamDecoder:
    """
    Turns tokens into text as they arrive: each token's bytes (decode_bytes, which every tokenizer
    has) go through an incremental UTF-8 decoder, so a character a byte-level BPE (gpt2, bpe) splits
    over several tokens is printed once complete instead of as replacement characters; a character
    token is one whole character, printed at once.
    """

    def __init__(self, tok):
        self.tok = tok
        self.utf8 = codecs.getincrementaldecoder('utf-8')(errors='replace')

    def feed(self, token):
        return self.utf8.decode(self.tok.decode_bytes([token]))

    def flush(self):
        return self.utf8.decode(b'', final=True)


class BatchPrinter:
    """
    Collects the tokens of a batch of samples, step by step, and prints the samples in order
    (each followed by the separator line), every one as soon as it and those before it are
    finished. A sample is finished at its first stop token or at the end of the batch.
    """

    def __init__(self, tok, start_ids, num_samples, stop_token):
        self.tok = tok
        self.start_ids = start_ids
        self.num_samples = num_samples
        self.stop_token = stop_token
        self.steps = []  # (num_samples,) tokens per step, kept on the device
        self.finished = [False] * num_samples
        self.printed = 0  # samples printed so far: 0..printed-1

    def add(self, tokens, show=True):
        """ One step's (num_samples,) tokens; show: print the samples it finished. """
        self.steps.append(tokens)
        if show and self.stop_token is not None:
            # a host sync per step, which the engine's end-of-batch check already makes
            ended = (tokens == self.stop_token).tolist()
            self.finished = [f or e for f, e in zip(self.finished, ended)]
            self._print_finished()

    def finish(self):
        """ The end of the batch: print the samples not yet printed. """
        self.finished = [True] * self.num_samples
        self._print_finished()

    def generated(self):
        """ Every sample's new token ids, each ending before its first stop token. """
        if not self.steps:
            return [[] for _ in range(self.num_samples)]
        rows = torch.stack(self.steps, dim=1).tolist()
        if self.stop_token is None:
            return rows
        return [g[:g.index(self.stop_token)] if self.stop_token in g else g for g in rows]

    def _print_finished(self):
        if self.printed < self.num_samples and self.finished[self.printed]:
            rows = self.generated()
            while self.printed < self.num_samples and self.finished[self.printed]:
                print(self.tok.decode(self.start_ids + rows[self.printed]))
                print(SEPARATOR, flush=True)
                self.printed += 1


def check_settings(config):
    """
    Every setting, before a model is loaded: types, choices and counts (settings.py), the sampling
    knobs.
    """
    DEFAULTS.check(config)
    # temperature >= 0 (0 = greedy), top_k >= 1 or None, 0 < top_p <= 1: the engine's own rules
    try:
        check_sampling_args(config.temperature, config.top_k, config.top_p)
    except (ValueError, TypeError) as e:
        raise UserError(str(e)) from None


def load_inputs(config):
    """
    (model, tokenizer, the prompt's ids) of this rank: what it reads of its node's disk (the
    checkpoint, a FILE: prompt), checked.
    """
    model, tokenizer_meta, _ = init_model(config.init_from, config.out_dir)
    tok = load_tokenizer(tokenizer_meta)
    prompt_name, prompt_text = prompt_setting(config)
    check_tokenizer_fits(model.config, tokenizer_meta,
                         describe_source(config.init_from, config.out_dir))
    text = read_start(prompt_text, model.config.block_size, prompt_name)
    start_ids = encode_prompt(tok, text, model.config.block_size,
                              model.config.vocab_size)
    return model, tok, start_ids


def prompt_files(config):
    """ {name: path} of what sample.py reads besides the checkpoint: the FILE: prompt, if any. """
    _, text = prompt_setting(config)
    if text.startswith('FILE:'):
        return {'prompt file': text[len('FILE:'):]}
    return {}


def main():
    # under torchrun every rank samples on its own device, after one verdict on its settings and on
    # what it reads: a node that lacks the checkpoint or the prompt file stops every rank at once
    config, failure, group = read_settings(DEFAULTS, sys.argv[1:], check_settings, __doc__, GROUP_SETTINGS)
    dist_info = start(failure, **group)
    # under torchrun a signal to one rank stops every rank together, between sampling steps
    together = EXIT_REQUEST is not None and dist_info.under_torchrun
    if together:
        EXIT_REQUEST.together()

    device = dist_info.device
    # num_threads=0 on a CPU: the count is timed on a sampling step once the model is ready, and
    # re-checked every 250 tokens (THREAD_RETUNING)
    threads = auto_threads(device, config.num_threads, 'sampling step', say=say, **THREAD_RETUNING)
    dtype, ctx = precision(device, config.dtype)
    # None = auto: on CUDA
    compile_model = resolve_compile(config.compile, device_type_of(device))
    torch.manual_seed(config.seed)
    if 'cuda' in device:
        torch.cuda.manual_seed(config.seed)

    model, tok, start_ids = every_rank(dist_info, lambda: load_inputs(config))
    # and all of them the same: the checkpoint (what it is, not only that it exists), the prompt
    # file, the code and settings; else every rank stops in one line
    same_everywhere(dist_info, lambda: same_start(dict(config), data=prompt_files(config)), SAME_START)
    model.to(device)
    model.eval()
    model.set_attention(config.attention)
    source = describe_source(config.init_from, config.out_dir)
    # the head scores only the tokenizer's ids: a padded vocabulary's extra rows are never sampled.
    # float32 on a CPU is packed for oneDNN, unless torch.compile is to choose the kernels (it packs
    # weights its own way)
    pack = can_pack(device, PTDTYPE[dtype]) and not compile_model
    set_weights(model, config.weights, pack=pack, vocab_size=tok.vocab_size)
    stop_token = None
    if config.stop_at_eot:
        if tok.eot_token is None:
            print(
                "warning: stop_at_eot does nothing for a character-level model (it has no end-of-text "
                "token)",
                file=sys.stderr)
        else:
            stop_token = tok.eot_token
    print(f"sampling {source} on {device} ({dtype}, "
          f"{config.weights} weights), mode={config.mode}", file=sys.stderr)
    if compile_model:
        model = torch.compile(model, dynamic=True)  # the cache makes shapes change every step

    # one sample is streamed as its tokens arrive; several are printed as they finish: all at
    # once at the end of their batch unless a stop token ends some earlier. A long wait for them (a
    # minute for nanoGPT's 10 x 500 tokens on a busy CPU) is reported on stderr instead
    stream = config.num_samples == 1
    if stream:
        sys.stdout.write(tok.decode(start_ids))
        sys.stdout.flush()
    # one generator for every batch: the same seed gives the same samples
    generator = torch.Generator(device=device).manual_seed(config.seed)
    if threads is not None:
        prompt = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...]
        threads.choose(*typical_step(model, prompt.repeat(min(config.num_samples, MAX_BATCH_SAMPLES), 1),
                                     config.max_new_tokens, config.mode, ctx))
    # under torchrun: every rank's call after each step; raises Stopped on all of them at a signal
    agree = (lambda done=False: EXIT_REQUEST.stop_together(dist_info, done=done)) if together else None
    t0 = time.perf_counter()
    n = 0
    for first in range(0, config.num_samples, MAX_BATCH_SAMPLES):
        batch = Batch(min(MAX_BATCH_SAMPLES, config.num_samples - first), config.num_samples, stream)
        n += sample_batch(model, tok, start_ids, batch, config, generator, stop_token, threads, ctx,
                          agree=agree)
    dt = time.perf_counter() - t0  # .tolist() waited for the device
    print(f"generated {n} tokens in {dt:.2f} s ({n / max(dt, 1e-9):.1f} tokens/s)", file=sys.stderr)


@dataclass
class Batch:
    size: int  # samples drawn together
    num_samples: int  # of the whole run
    stream: bool  # one sample, printed token by token


def sample_batch(model, tok, start_ids, batch, config, generator, stop_token, threads, ctx, agree=None):
    """
    Draw and print one batch of samples; the number of tokens it generated. agree: under torchrun,
    the stop agreement every rank makes after each step (a rank whose samples all ended early keeps
    agreeing until every rank's batch is done).
    """
    device = generator.device
    # the prompt's ids, one copy per sample: x is (batch.size, T)
    x = torch.tensor(start_ids, dtype=torch.long, device=device)[None, ...].repeat(batch.size, 1)
    decoder = StreamDecoder(tok)
    printer = BatchPrinter(tok, start_ids, batch.size, stop_token)
    several = "" if batch.size == batch.num_samples else f" (of {batch.num_samples:,})"
    meter = Progress(config.max_new_tokens, f"sampling {batch.size} samples in one batch{several}",
                     "tokens each", show=not batch.stream, file=sys.stderr)
    tokens_per_step = generate_stream(model, x, config.max_new_tokens,
                                      temperature=config.temperature, top_k=config.top_k,
                                      top_p=config.top_p, generator=generator, mode=config.mode,
                                      stop_token=stop_token, vocab_size=tok.vocab_size, ctx=ctx)
    if threads is not None:
        # each step's time is fed to the retuner: the count follows the load
        tokens_per_step = threads.over(tokens_per_step)
    for tokens in meter.over(tokens_per_step):
        printer.add(tokens, show=not batch.stream)
        if batch.stream and (token := tokens[0].item()) != stop_token:
            sys.stdout.write(decoder.feed(token))
            sys.stdout.flush()
        if agree is not None:
            agree()
    while agree is not None and not agree(done=True):
        pass
    generated = printer.generated()
    if batch.stream:
        print(decoder.flush())
        print(SEPARATOR)
    else:
        printer.finish()
    sys.stdout.flush()
    return sum(len(g) for g in generated)


if __name__ == "__main__":
    run_main(main)
