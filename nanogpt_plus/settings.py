"""
What the entry points' settings share. Each script declares every setting it reads at its top, name
and default on one line (train.py: nanoGPT's, in nanoGPT's order), with configurator.py's Group and
Setting; what several scripts use has its type, range and help declared here once, as a Shared
setting whose default each script writes: batch_size=settings.batch_size(12), n_layer=
settings.n_layer(12). The data/*/prepare.py scripts' shared settings are here too (num_proc,
cache_dir, ...). Also here: train.py's checks between settings (check_training: n_embd divisible
by n_head, min_lr not above learning_rate, ...); Schema.check checks each value alone.

The lists of choices live beside the code that acts on them (dataloader.ORDERS, machine.DTYPES,
...); this table imports them, and only the scripts import this table. A choice list of code that
nanoGPT's laptop command does not load (weight_formats.WEIGHTS, engine.MODES) is imported by the
scripts that declare that setting, not here.

Usage (a script's top):
    from nanogpt_plus import settings
    DATA = Group('data', batch_size=settings.batch_size(12), block_size=positive(1024, "tokens"))
    MODEL = Group('model', n_layer=settings.n_layer(12), n_head=settings.n_head(12))
    DEFAULTS = Schema(DATA, MODEL)
    cfg = configure(DEFAULTS, argv, doc=__doc__)
    DEFAULTS.check(cfg)
"""

import os

from configurator import Setting
from model import ATTENTIONS, MODERN_CHOICES
from nanogpt_plus.dataloader import ORDERS
from nanogpt_plus.distributed import BACKENDS
from nanogpt_plus.errors import UserError
from nanogpt_plus.machine import DTYPES
from nanogpt_plus.optimizer import OPTIMIZERS


def positive(default, help):
    """ A count or size: >= 1. """
    return Setting(default, help, low=1)


def non_negative(default, help):
    """ >= 0 (0 usually means "off" or "all"). """
    return Setting(default, help, low=0)


def flag(default, help):
    return Setting(default, help, kind=bool)


# -----------------------------------------------------------------------------
# the settings several entry points share

class Shared:
    """
    A setting several entry points use, each with a default of its own (train.py's batch_size is 12,
    finetune.py's 32): its type, range and help, declared here once. A script declares it as
    batch_size=settings.batch_size(12): the Setting with that default.
    """

    def __init__(self, kind, help, **accepts):
        self.kind = kind
        self.help = help
        self.accepts = accepts

    def __call__(self, default, **accepts):
        """ The Setting with this default; accepts: what the script adds (the choices of a list this
        table doesn't import: weights=settings.weights('float32', choices=WEIGHTS)). """
        return Setting(default, self.help, kind=self.kind, **self.accepts, **accepts)


# I/O: train.py, finetune.py, sample.py, eval.py, export_hf.py, export_gguf.py
out_dir = Shared(str, "the run's directory: ckpt.pt, metrics.jsonl, run.lock (init_from='resume' "
                      "reads it)", not_empty=True)
log_interval = Shared(int, "print and log the loss every N iterations", low=1)
overwrite = Shared(bool, "True: an output may replace what is otherwise refused: an earlier run's "
                         "checkpoints in out_dir; a checkpoint, a dataset's files or an input "
                         "named by output_file, hf_dir, gguf_file or predict_out")
init_from = Shared(str, "'scratch', 'resume' (out_dir's run), gpt2*, a Hugging Face GPT-2 "
                        "directory, or a ckpt.pt / training out_dir", not_empty=True)
auto_resume = Shared(bool, "True: resume the run in out_dir when its checkpoint is there (a "
                           "requeued job), else start from init_from")

# wandb logging: train.py, finetune.py
wandb_log = Shared(bool, "True: send the metrics to Weights & Biases too")
wandb_project = Shared(str, "the wandb project")
wandb_run_name = Shared(str, "the run's name in the wandb project")

# data: train.py, finetune.py, bench.py (eval.py: batch_size)
dataset = Shared(str, "a name under data/ or a directory: nanoGPT's train.bin/val.bin, or llm.c "
                      "token shards", not_empty=True)
data_order = Shared(str, "'random' (nanoGPT's random windows) or 'sequential' (llm.c's: each token "
                         "once per epoch)", choices=ORDERS)
gradient_accumulation_steps = Shared(int, "micro-batches per optimizer step (all processes "
                                          "together): a big batch in a small memory", low=1)
batch_size = Shared(int, "sequences per micro-batch, per process", low=1)
block_size = Shared(int, "the context length: tokens per sequence", low=1)

# the optimizer: train.py, bench.py (finetune.py: AdamW's but learning_rate)
learning_rate = Shared(float, "the peak learning rate, reached at the end of the "
                              "warmup", low=0.0, low_open=True)
weight_decay = Shared(float, "AdamW's weight decay (of the 2-D weights only)", low=0)
beta1 = Shared(float, "AdamW's beta1", low=0.0, high=1.0, high_open=True)
beta2 = Shared(float, "AdamW's beta2", low=0.0, high=1.0, high_open=True)
grad_clip = Shared(float, "the largest global gradient norm; 0.0 turns clipping off", low=0.0)
optimizer = Shared(str, "'adamw' (every parameter) or 'muon' (Muon for the Blocks' matrices, AdamW "
                        "at learning_rate for the rest)", choices=OPTIMIZERS)
muon_lr = Shared(float, "optimizer='muon': Muon's peak learning rate (the schedule scales it as "
                        "learning_rate)", low=0.0, low_open=True)
muon_momentum = Shared(float, "optimizer='muon': Muon's (Nesterov) "
                              "momentum", low=0.0, high=1.0, high_open=True)
muon_weight_decay = Shared(float, "optimizer='muon': Muon's decoupled weight decay (p -= lr * wd * "
                                  "p)", low=0)
muon_ns_steps = Shared(int, "optimizer='muon': Newton-Schulz steps per orthogonalisation (PyTorch's "
                            "5; fewer are cheaper and leave the singular values further from 1)", low=1, high=10)

# learning rate decay: train.py, finetune.py
decay_lr = Shared(bool, "linear warmup, then the lr_schedule's decay to min_lr; False: "
                        "learning_rate throughout")
min_lr = Shared(float, "the rate after lr_decay_iters; Chinchilla suggests about "
                       "learning_rate/10", low=0)

# how sample.py, eval.py and finetune.py's predictions store and read the weights; its choices are
# weight_formats.WEIGHTS, which each of them passes (this table does not load the weight formats)
weights = Shared(str, "how the weights are stored and read: 'float32' (exact), 'bfloat16' or 'int8' "
                      "(weight-only, per row)")

# the architecture (GPT-2 124M's defaults in every script): train.py, finetune.py, bench.py
# (sample.py: attention)
n_layer = Shared(int, "Transformer blocks", low=1)
n_head = Shared(int, "attention heads per block", low=1)
n_embd = Shared(int, "the width: embedding and residual-stream size", low=1)
dropout = Shared(float, "0.0 suits pretraining; fine-tuning usually wants 0.1 or more", low=0.0,
                 high=1.0, high_open=True)
bias = Shared(bool, "biases in the Linear and LayerNorm layers (GPT-2 has them; without is a bit "
                    "faster)")
gelu = Shared(str, "'none' = exact GELU (nanoGPT), 'tanh' = GPT-2's approximation (new models)",
              choices=MODERN_CHOICES['gelu'])
attention = Shared(str, "'flash' (scaled_dot_product_attention) or 'manual'", choices=ATTENTIONS)
# the modern options (config/train_*_fast.py, *_speedrun.py); the defaults are GPT-2's
pos = Shared(str, "positions: 'learned' (GPT-2's wpe table) or 'rope' (rotary, on queries and "
                  "keys)", choices=MODERN_CHOICES['pos'])
norm = Shared(str, "'layernorm' (GPT-2) or 'rmsnorm'", choices=MODERN_CHOICES['norm'])
qk_norm = Shared(bool, "True: RMS-normalise each head's queries and keys before the attention "
                       "scores")
mlp_act = Shared(str, "the MLP's activation: 'gelu' (see gelu) or 'relu2' (relu(x)^2)",
                 choices=MODERN_CHOICES['mlp_act'])
logit_softcap = Shared(float, "C > 0: the logits become C*tanh(logits/C); 0.0 = off", low=0.0)
tie_embeddings = Shared(bool, "True: the output head is the token embedding (GPT-2); False: a "
                              "matrix of its own")

# the machine and the process: train.py, finetune.py, sample.py, eval.py, bench.py (each its subset)
backend = Shared(str, "'auto' = nccl for CUDA, gloo for CPU; or 'nccl', 'gloo'", choices=BACKENDS)
# at most a week: a rank waiting longer is gone, and a bigger timeout overflows the C++ side's
# milliseconds (OverflowError, or a process group that fails to start)
dist_timeout = Shared(int, "under torchrun: seconds a rank waits in a collective before the run "
                           "fails (the process group's timeout); 0 = PyTorch's (10 minutes for "
                           "nccl, 30 for gloo). Raise it where a first compile or rank 0's "
                           "evaluation takes longer", low=0, high=7 * 24 * 3600)
# at most a week, as dist_timeout
join_timeout = Shared(int, "under torchrun: seconds a rank waits for every rank to join the process "
                           "group; a node whose worker never joins then ends every node in one line "
                           "naming it (not gloo's 30 minutes)", low=1, high=7 * 24 * 3600)
device = Shared(str, "'auto' (cuda, else mps, else cpu), 'cpu', 'cuda', 'cuda:N', 'mps'",
                not_empty=True)
dtype = Shared(str, "'auto' (bfloat16 if the GPU has it, else float16; float32 on CPU), "
                    "'float32', 'bfloat16', 'float16'", choices=DTYPES)
# None is a value of its own (auto) whatever a script's default
compile = Shared(bool, "torch.compile the model: None = auto (on for CUDA, where it pays for "
                       "itself), True/False to force", choices=(None, True, False), none_ok=True)
activation_checkpointing = Shared(bool, "True: recompute each Block in the backward pass (less "
                                        "memory, more compute)")
# the most CPU threads a script may ask torch for: 4 per logical CPU, far past the fastest count
# (oversubscribed threads only slow torch down); 100,000 crashed torch's thread pool (SIGSEGV)
MAX_THREADS = 4 * (os.cpu_count() or 1)
num_threads = Shared(int, "CPU threads for torch; 0 = auto (time all cores, half, ..., 1; keep the "
                          f"fastest; re-checked while running as the load changes); at most 4 per CPU, "
                          f"{MAX_THREADS} here", low=0, high=MAX_THREADS)
seed = Shared(int, "the seed of the model's initialisation, the data order, dropout and sampling",
              low=0, high=2**32 - 1)

# -----------------------------------------------------------------------------
# the settings the data/<name>/prepare.py scripts share (their write rules: outputs.py)

def default_num_proc():
    """ Half the CPU threads, 1 to 8: cpu_count() counts hyperthreads, and BPE encoding gains little from a
    core's second. """
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def dataset_out_dir(default, outputs):
    """ A prepare script's out_dir: its own default, and the files it writes there (the help). """
    return Setting(default, f"where {outputs} go", not_empty=True)


num_proc = Shared(int, "tokenizer worker processes (default: half the CPU threads, 1 to 8)", low=1)
text_column = Shared(str, "the column holding the documents (.jsonl / .json / .parquet / Hub "
                          "datasets)", not_empty=True)
cache_dir = Shared(str, "Hugging Face datasets cache ('' = its default, "
                        "~/.cache/huggingface/datasets)")
shuffle_seed = Shared(int, "the shuffle that picks the val documents (nanoGPT's seed)", low=0)
dataset_overwrite = Shared(bool, "True: write even where out_dir holds another dataset (which is "
                                 "replaced) or a training run's files (never a live run's)")
# data/shakespeare and data/shakespeare_char
shakespeare_input = Shared(str, "a UTF-8 text file to use instead of tiny Shakespeare")
shakespeare_url = Shared(str, "where to download tiny Shakespeare from ('' = never download)")
download_timeout = Shared(float, "seconds to wait for the download before using the offline "
                                 "substitute", low=0, low_open=True)


def check_model_shape(n_embd, n_head, pos):
    """ The architecture combination GPTConfig/GPT would otherwise reject deep in the build. """
    if n_embd and n_head and n_embd % n_head:
        raise UserError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head}): each head gets "
                        f"n_embd / n_head dimensions; change one of them")
    head_size = n_embd // n_head if n_embd and n_head else 0
    if pos == 'rope' and head_size % 2:
        raise UserError(
            f"pos='rope' turns pairs of each head's {head_size} dimensions, an odd number; choose "
            f"n_embd and n_head so that n_embd / n_head is even")


def check_auto_resume(auto_resume, overwrite):
    """
    auto_resume=True continues the run in out_dir; overwrite=True starts it over: together, every
    requeue of a job would throw its run away (or the first start would keep the run it was told to
    replace). Refused, whichever script (train.py, finetune.py).
    """
    if auto_resume and overwrite:
        raise UserError(
            "auto_resume=True continues the run in out_dir and overwrite=True starts it over; give "
            "one of them (to start over once, run with --overwrite=True alone, then requeue with "
            "--auto_resume=True)")


def check_training(cfg):
    """
    train.py's checks of the combinations of its settings, once each one passed its own check
    (Schema.check): the one place that reads them all. Each check below is handed the values of its
    topic; the last one refuses a new model whose first step can't fit in this machine's memory.
    """
    check_model_shape(cfg.n_embd, cfg.n_head, cfg.pos)
    check_auto_resume(cfg.auto_resume, cfg.overwrite)
    if cfg.decay_lr and cfg.min_lr > cfg.learning_rate:  # the "decay" would raise the rate
        raise UserError(
            f"min_lr ({cfg.min_lr}) is above learning_rate ({cfg.learning_rate}), so the decay "
            f"would raise the learning rate; set --min_lr to at most learning_rate (about 1/10 of it)"
        )
    if cfg.decay_lr:
        check_schedule(cfg.learning_rate, cfg.warmup_iters, cfg.lr_decay_iters,
                       cfg.max_iters)
    if cfg.optimizer == 'muon' and cfg.parallelism == 'fsdp':
        raise UserError(
            "optimizer='muon' orthogonalises whole matrices, which FSDP splits over the ranks; use "
            "--parallelism=ddp with Muon, or --optimizer=adamw with FSDP")
    if cfg.resume_from and cfg.init_from != 'resume':
        raise UserError(
            f"--resume_from={cfg.resume_from} goes back to a snapshot of the run in out_dir: it "
            f"needs --init_from=resume")
    if cfg.init_from == 'scratch':  # weights that trained before have a size that fitted
        # imported here: only this check of this table needs init_from.py
        from nanogpt_plus.init_from import ModelSpec, check_new_model_fits
        from nanogpt_plus.machine import resolve_device
        on_cpu = resolve_device(cfg.device) == 'cpu'
        check_new_model_fits(cfg.select(ModelSpec), dataset=cfg.dataset,
                             batch_size=cfg.batch_size, attention=cfg.attention,
                             on_cpu=on_cpu)


def check_schedule(learning_rate, warmup_iters, lr_decay_iters, max_iters):
    """
    A learning-rate schedule with decay that contradicts itself: a decay that would end where the
    warmup does (the rate would jump from learning_rate to min_lr) is refused; a warmup longer than
    the run, common in a quick try of a config (--max_iters=20), is said plainly in one line, with
    the rate it will reach.
    """
    if lr_decay_iters <= warmup_iters:
        raise UserError(f"lr_decay_iters ({lr_decay_iters}) is not past warmup_iters "
                        f"({warmup_iters}), so the rate would drop from learning_rate to min_lr "
                        f"right after the warmup; set --lr_decay_iters to about max_iters, or "
                        f"--decay_lr=False for a constant rate")
    # said once, by rank 0 (before the process group exists: torchrun's RANK)
    if warmup_iters > max_iters and int(os.environ.get('RANK', 0)) == 0:
        peak = learning_rate * (max_iters + 1) / (warmup_iters + 1)
        print(f"note: warmup_iters ({warmup_iters}) is past max_iters ({max_iters}): the learning "
              f"rate rises to {peak:.3g} at the last iteration and never reaches learning_rate "
              f"({learning_rate:g})")
