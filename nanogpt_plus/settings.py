"""
What the entry points' settings share: each script declares its own settings at its top (train.py:
nanoGPT's, in nanoGPT's order) with configurator.py's Group and Setting; what several scripts use is
declared here once, in one of two forms:
- a shared group (MODEL, SYSTEM) with the same defaults everywhere, named in the script's Schema
  (a script passes its own default where it differs: finetune.py's dropout=0.1);
- a Shared setting (out_dir, batch_size, learning_rate, ...): its type, range and help are here, its
  default is in each script that declares it: batch_size=settings.batch_size(12).
Also here: the lists of choices, and train.py's checks between settings (check_training: n_embd
divisible by n_head, min_lr not above learning_rate, ...); Schema.check checks each value alone.

Usage (a script's top):
    from nanogpt_plus import settings
    DATA = Group('data', batch_size=settings.batch_size(12), block_size=positive(1024, "tokens"))
    DEFAULTS = Schema(DATA, settings.MODEL, settings.SYSTEM)
    cfg = configure(DEFAULTS, argv, doc=__doc__)
    DEFAULTS.check(cfg)
"""

import os

from configurator import Group, Schema, Setting  # noqa: F401  (Schema: what the scripts compose)
from model import MODERN_CHOICES
from nanogpt_plus.errors import UserError

# The values a choice setting may take live here, with the settings, so that reading this table
# imports no part of the code that acts on them (the sampling engine, the weight formats, the
# evaluation tasks); those modules take their lists from here.
DTYPES = ('auto', 'float32', 'bfloat16', 'float16')
BACKENDS = ('auto', 'nccl', 'gloo')
ATTENTIONS = ('flash', 'manual')
GELUS = MODERN_CHOICES['gelu']
OPTIMIZERS = ('adamw', 'muon')
LR_SCHEDULES = ('cosine', 'wsd')
# data_order: nanoGPT's random windows, or llm.c's pass over every token
# (nanogpt_plus/dataloader.py)
ORDERS = ('random', 'sequential')
MODES = ('exact', 'fast')  # sample.py's mode (nanogpt_plus/engine.py)
# weight formats for inference (nanogpt_plus/weight_formats.py)
WEIGHTS = ('float32', 'bfloat16', 'int8')
# where the in-loop HellaSwag and eval.py keep their download, relative to the repository
HELLASWAG_FILE = 'data/hellaswag/hellaswag_val.jsonl'


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

    def __call__(self, default):
        return Setting(default, self.help, kind=self.kind, **self.accepts)


# I/O: train.py, finetune.py, sample.py, eval.py, export_hf.py
out_dir = Shared(str, "the run's directory: ckpt.pt, metrics.jsonl, run.lock (init_from='resume' "
                      "reads it)", not_empty=True)
log_interval = Shared(int, "print and log the loss every N iterations", low=1)
overwrite = Shared(bool, "True: an output may replace what is otherwise refused: an earlier run's "
                         "checkpoints in out_dir; a checkpoint, a dataset's files or an input "
                         "named by output_file, hf_dir or predict_out")
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

# learning rate decay: train.py, finetune.py
decay_lr = Shared(bool, "linear warmup, then the lr_schedule's decay to min_lr; False: "
                        "learning_rate throughout")
min_lr = Shared(float, "the rate after lr_decay_iters; Chinchilla suggests about "
                       "learning_rate/10", low=0)

# how sample.py, eval.py and finetune.py's predictions store and read the weights
# (weight_formats.py)
WEIGHTS_SETTING = Setting('float32', "how the weights are stored and read: 'float32' (exact), "
                                     "'bfloat16' or 'int8' (weight-only, per row)", choices=WEIGHTS)

# the architecture, the same defaults everywhere (GPT-2 124M): train.py, finetune.py, bench.py
# (sample.py: attention)
MODEL = Group(
    'model',
    n_layer=positive(12, "Transformer blocks"),
    n_head=positive(12, "attention heads per block"),
    n_embd=positive(768, "the width: embedding and residual-stream size"),
    dropout=Setting(0.0,
                    "0.0 suits pretraining; fine-tuning usually wants 0.1 or more",
                    low=0.0,
                    high=1.0,
                    high_open=True),
    bias=flag(
        False,
        "biases in the Linear and LayerNorm layers (GPT-2 has them; without is a bit faster)"),
    gelu=Setting('none',
                 "'none' = exact GELU (nanoGPT), 'tanh' = GPT-2's approximation (new models)",
                 choices=GELUS),
    attention=Setting('flash',
                      "'flash' (scaled_dot_product_attention) or 'manual'",
                      choices=ATTENTIONS),
    # the modern options (config/train_*_fast.py, *_speedrun.py); the defaults are GPT-2's
    pos=Setting('learned',
                "positions: 'learned' (GPT-2's wpe table) or 'rope' (rotary, on queries and keys)",
                choices=MODERN_CHOICES['pos']),
    norm=Setting('layernorm', "'layernorm' (GPT-2) or 'rmsnorm'", choices=MODERN_CHOICES['norm']),
    qk_norm=flag(False,
                 "True: RMS-normalise each head's queries and keys before the attention scores"),
    mlp_act=Setting('gelu',
                    "the MLP's activation: 'gelu' (see gelu) or 'relu2' (relu(x)^2)",
                    choices=MODERN_CHOICES['mlp_act']),
    logit_softcap=Setting(0.0, "C > 0: the logits become C*tanh(logits/C); 0.0 = off", low=0.0),
    tie_embeddings=flag(
        True, "True: the output head is the token embedding (GPT-2); False: a matrix of its own"),
)

# the machine and the process, the same defaults everywhere but compile (False in sample.py,
# eval.py, finetune.py)
SYSTEM = Group(
    'system',
    backend=Setting('auto',
                    "'auto' = nccl for CUDA, gloo for CPU; or 'nccl', 'gloo'",
                    choices=BACKENDS),
    # at most a week: a rank waiting longer is gone, and a bigger timeout overflows the C++
    # side's milliseconds (OverflowError, or a process group that fails to start)
    dist_timeout=Setting(
        0, "under torchrun: seconds a rank waits in a collective before the run fails (the "
        "process group's timeout); 0 = PyTorch's (10 minutes for nccl, 30 for gloo). "
        "Raise it where a first compile or rank 0's evaluation takes longer", low=0,
        high=7 * 24 * 3600),
    parallelism=Setting(
        'ddp', "under torchrun: 'ddp' (a full model copy per rank) or 'fsdp' (shard the model, "
        "FSDP2)",
        choices=('ddp', 'fsdp')),
    device=Setting('auto',
                   "'auto' (cuda, else mps, else cpu), 'cpu', 'cuda', 'cuda:N', 'mps'",
                   not_empty=True),
    dtype=Setting('auto',
                  "'auto' (bfloat16 if the GPU has it, else float16; float32 on CPU), 'float32', "
                  "'bfloat16', 'float16'",
                  choices=DTYPES),
    compile=Setting(None,
                    "torch.compile the model: None = auto (on for CUDA, where it pays for itself), "
                    "True/False to force",
                    kind=bool,
                    choices=(None, True, False)),
    activation_checkpointing=flag(
        False, "True: recompute each Block in the backward pass (less memory, more "
        "compute)"),
    num_threads=non_negative(
        0, "CPU threads for torch; 0 = auto (time all cores, half, ..., 1; keep the "
        "fastest; re-checked while training)"),
    seed=Setting(1337,
                 "the seed of the model's initialisation, the data order, dropout and sampling",
                 low=0,
                 high=2**32 - 1),
)


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
    check_model_shape(cfg['n_embd'], cfg['n_head'], cfg['pos'])
    check_auto_resume(cfg['auto_resume'], cfg['overwrite'])
    if cfg['decay_lr'] and cfg['min_lr'] > cfg['learning_rate']:  # the "decay" would raise the rate
        raise UserError(
            f"min_lr ({cfg['min_lr']}) is above learning_rate ({cfg['learning_rate']}), so the decay "
            f"would raise the learning rate; set --min_lr to at most learning_rate (about 1/10 of it)"
        )
    if cfg['decay_lr']:
        check_schedule(cfg['learning_rate'], cfg['warmup_iters'], cfg['lr_decay_iters'],
                       cfg['max_iters'])
    if cfg['optimizer'] == 'muon' and cfg['parallelism'] == 'fsdp':
        raise UserError(
            "optimizer='muon' orthogonalises whole matrices, which FSDP splits over the ranks; use "
            "--parallelism=ddp with Muon, or --optimizer=adamw with FSDP")
    if cfg['resume_from'] and cfg['init_from'] != 'resume':
        raise UserError(
            f"--resume_from={cfg['resume_from']} goes back to a snapshot of the run in out_dir: it "
            f"needs --init_from=resume")
    if cfg['init_from'] == 'scratch':  # weights that trained before have a size that fitted
        # imported here: this table of settings loads none of the code that acts on them
        from nanogpt_plus.init_from import ModelSpec, check_new_model_fits
        from nanogpt_plus.machine import resolve_device
        on_cpu = resolve_device(cfg['device']) == 'cpu'
        check_new_model_fits(cfg.select(ModelSpec), dataset=cfg['dataset'],
                             batch_size=cfg['batch_size'], attention=cfg['attention'],
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


def subset(group, *names):
    """ The settings `names` of a group (a script that uses some of them), in the group's order. """
    return Group(group.title, **{k: v for k, v in group.items() if k in names})
