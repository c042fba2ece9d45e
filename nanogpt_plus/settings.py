"""
Every setting of the entry points, declared once: its default, its type and what it accepts, and a one-line
help that `python <script>.py --help` prints. Each script composes the groups it uses into a Schema (its
DEFAULTS), giving its own default where it differs (finetune.py's learning rate is GPT-1's, say); the
configurator refuses a value of the wrong type as it reads it, and Schema.check refuses the rest (a choice
not offered, a value out of range) in one line naming the setting, before the script does any work. The checks
between settings (n_embd divisible by n_head, min_lr not above learning_rate) are check_model_shape and
check_training below, and the other scripts' own check_settings.

The groups follow nanoGPT's train.py: I/O, wandb logging, data, model, AdamW, learning-rate decay, system;
then the extras this project adds (in-loop evaluation, the spike guard) and the other scripts' own.

Usage:
    from nanogpt_plus import settings
    DEFAULTS = settings.Schema(settings.IO, settings.DATA, ..., learning_rate=6.25e-5)
    cfg = configure(DEFAULTS, argv, doc=__doc__)
    DEFAULTS.check(cfg)
"""

import os

from configurator import Group, Schema, Setting  # noqa: F401  (Schema: what the scripts compose)
from model import MODERN_CHOICES
from nanogpt_plus.errors import UserError

# The values a choice setting may take live here, with the settings, so that reading this table imports no part
# of the code that acts on them (the sampling engine, the weight formats, the evaluation tasks); those modules
# take their lists from here.
DTYPES = ('auto', 'float32', 'bfloat16', 'float16')
BACKENDS = ('auto', 'nccl', 'gloo')
ATTENTIONS = ('flash', 'manual')
GELUS = MODERN_CHOICES['gelu']
OPTIMIZERS = ('adamw', 'muon')
LR_SCHEDULES = ('cosine', 'wsd')
# data_order: nanoGPT's random windows, or llm.c's pass over every token (nanogpt_plus/dataloader.py)
ORDERS = ('random', 'sequential')
MODES = ('exact', 'fast')  # sample.py's mode (nanogpt_plus/engine.py)
WEIGHTS = ('float32', 'bfloat16', 'int8')  # weight formats for inference (nanogpt_plus/weights.py)
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
# train.py's, in nanoGPT's order

IO = Group(
    'I/O',
    out_dir=Setting('out', "the run's directory: ckpt.pt, metrics.jsonl, run.lock (init_from='resume' reads it)",
                    not_empty=True),
    eval_interval=positive(2000, "evaluate the train and val loss every N iterations (and checkpoint)"),
    log_interval=positive(1, "print and log the loss every N iterations"),
    eval_iters=positive(200, "batches per split in each evaluation"),
    eval_only=flag(False, "True: evaluate once at iteration 0, then exit"),
    always_save_checkpoint=flag(True, "True: save at every evaluation; False: only when the val loss improved"),
    checkpoint_interval=non_negative(0, "save the training state every N iterations; 0 = at each evaluation"),
    keep_checkpoints=non_negative(0, "K > 0: also keep the last K saves as ckpt_<iter>.pt; 0 = ckpt.pt only"),
    overwrite=flag(False, "True: an output may replace what is otherwise refused: an earlier run's checkpoints in "
                          "out_dir; a checkpoint, a dataset's files or an input named by output_file, hf_dir or "
                          "predict_out"),
    init_from=Setting('scratch', "'scratch', 'resume' (out_dir's run), gpt2*, a Hugging Face GPT-2 directory, "
                                 "or a ckpt.pt / training out_dir", not_empty=True),
    resume_from=Setting('', "with init_from='resume': go back to a snapshot, its iteration (2000) or name "
                            "(ckpt_2000.pt); '' = ckpt.pt"),
    auto_resume=flag(False, "True: resume the run in out_dir when its checkpoint is there (a requeued job), else "
                            "start from init_from"),
)

INLOOP = Group(
    'zero-shot HellaSwag and samples while training',
    hellaswag_interval=non_negative(0, "score HellaSwag (eval.py's scoring) every N iterations; 0 = off"),
    hellaswag_examples=non_negative(0, "the first N validation examples only; 0 = all 10,042"),
    hellaswag_file=Setting(HELLASWAG_FILE, "this default is downloaded once (as eval.py does), or a JSONL file "
                                           "of yours"),
    sample_interval=non_negative(0, "every N iterations print sample_tokens greedy tokens after sample_prompt; "
                                    "0 = off"),
    sample_tokens=positive(32, "tokens in each in-loop sample"),
    sample_prompt=Setting('', "'' = the end-of-text token (a character tokenizer's first character)"),
)

WANDB = Group(
    'wandb logging',
    wandb_log=flag(False, "True: send the metrics to Weights & Biases too"),
    wandb_project=Setting('owt', "the wandb project"),
    wandb_run_name=Setting('gpt2', "the run's name in the wandb project"),
)

DATA = Group(
    'data',
    dataset=Setting('openwebtext', "a name under data/ or a directory: nanoGPT's train.bin/val.bin, or llm.c "
                                   "token shards", not_empty=True),
    data_order=Setting('random', "'random' (nanoGPT's random windows) or 'sequential' (llm.c's: each token once "
                                 "per epoch)", choices=ORDERS),
    gradient_accumulation_steps=positive(5 * 8, "micro-batches per optimizer step (all processes together): "
                                                "a big batch in a small memory"),
    batch_size=positive(12, "sequences per micro-batch, per process"),
    block_size=positive(1024, "the context length: tokens per sequence"),
)

MODEL = Group(
    'model',
    n_layer=positive(12, "Transformer blocks"),
    n_head=positive(12, "attention heads per block"),
    n_embd=positive(768, "the width: embedding and residual-stream size"),
    dropout=Setting(0.0, "0.0 suits pretraining; fine-tuning usually wants 0.1 or more", low=0.0, high=1.0,
                    high_open=True),
    bias=flag(False, "biases in the Linear and LayerNorm layers (GPT-2 has them; without is a bit faster)"),
    gelu=Setting('none', "'none' = exact GELU (nanoGPT), 'tanh' = GPT-2's approximation (new models)",
                 choices=GELUS),
    attention=Setting('flash', "'flash' (scaled_dot_product_attention) or 'manual'", choices=ATTENTIONS),
    # the modern options (config/train_*_fast.py, *_speedrun.py); the defaults are GPT-2's
    pos=Setting('learned', "positions: 'learned' (GPT-2's wpe table) or 'rope' (rotary, on queries and keys)",
                choices=MODERN_CHOICES['pos']),
    norm=Setting('layernorm', "'layernorm' (GPT-2) or 'rmsnorm'", choices=MODERN_CHOICES['norm']),
    qk_norm=flag(False, "True: RMS-normalise each head's queries and keys before the attention scores"),
    mlp_act=Setting('gelu', "the MLP's activation: 'gelu' (see gelu) or 'relu2' (relu(x)^2)",
                    choices=MODERN_CHOICES['mlp_act']),
    logit_softcap=Setting(0.0, "C > 0: the logits become C*tanh(logits/C); 0.0 = off", low=0.0),
    tie_embeddings=flag(True, "True: the output head is the token embedding (GPT-2); False: a matrix of its own"),
)

ADAMW = Group(
    'adamw optimizer',
    learning_rate=Setting(6e-4, "the peak learning rate, reached at the end of the warmup", low=0.0,
                          low_open=True),
    max_iters=non_negative(600000, "the last iteration (training stops after it)"),
    weight_decay=Setting(1e-1, "AdamW's weight decay (of the 2-D weights only)", low=0),
    beta1=Setting(0.9, "AdamW's beta1", low=0.0, high=1.0, high_open=True),
    beta2=Setting(0.95, "AdamW's beta2", low=0.0, high=1.0, high_open=True),
    grad_clip=Setting(1.0, "the largest global gradient norm; 0.0 turns clipping off", low=0.0),
    optimizer=Setting('adamw', "'adamw' (every parameter) or 'muon' (Muon for the Blocks' matrices, AdamW at "
                               "learning_rate for the rest)", choices=OPTIMIZERS),
    muon_lr=Setting(0.02, "optimizer='muon': Muon's peak learning rate (the schedule scales it as learning_rate)",
                    low=0.0, low_open=True),
    muon_momentum=Setting(0.95, "optimizer='muon': Muon's (Nesterov) momentum", low=0.0, high=1.0, high_open=True),
    muon_weight_decay=Setting(0.0, "optimizer='muon': Muon's decoupled weight decay (p -= lr * wd * p)", low=0),
)

SPIKE_GUARD = Group(
    "the spike guard (llm.c's -sl/-sg)",
    skip_loss_z=Setting(0.0, "skip an update whose loss is more than this many standard deviations above its "
                             "mean over the last 128 steps; 0.0 = off", low=0),
    skip_grad_z=Setting(0.0, "the same for the gradient norm; 0.0 = off", low=0),
)

LR_DECAY = Group(
    'learning rate decay',
    decay_lr=flag(True, "linear warmup, then the lr_schedule's decay to min_lr; False: learning_rate throughout"),
    lr_schedule=Setting('cosine', "'cosine' (nanoGPT) or 'wsd': warmup, constant, then a linear cooldown to "
                                  "min_lr over the last cooldown_frac of lr_decay_iters", choices=LR_SCHEDULES),
    cooldown_frac=Setting(0.2, "lr_schedule='wsd': the fraction of lr_decay_iters spent cooling down", low=0.0,
                          high=1.0),
    warmup_iters=non_negative(2000, "iterations of the linear warmup"),
    lr_decay_iters=non_negative(600000, "where the cosine ends; Chinchilla puts it at about max_iters"),
    min_lr=Setting(6e-5, "the rate after lr_decay_iters; Chinchilla suggests about learning_rate/10", low=0),
)

SYSTEM = Group(
    'system',
    backend=Setting('auto', "'auto' = nccl for CUDA, gloo for CPU; or 'nccl', 'gloo'", choices=BACKENDS),
    dist_timeout=non_negative(0, "under torchrun: seconds a rank waits in a collective before the run fails (the "
                                 "process group's timeout); 0 = PyTorch's (10 minutes for nccl, 30 for gloo). "
                                 "Raise it where a first compile or rank 0's evaluation takes longer"),
    parallelism=Setting('ddp', "under torchrun: 'ddp' (a full model copy per rank) or 'fsdp' (shard the model, "
                               "FSDP2)", choices=('ddp', 'fsdp')),
    device=Setting('auto', "'auto' (cuda, else mps, else cpu), 'cpu', 'cuda', 'cuda:N', 'mps'", not_empty=True),
    dtype=Setting('auto', "'auto' (bfloat16 if the GPU has it, else float16; float32 on CPU), 'float32', "
                          "'bfloat16', 'float16'", choices=DTYPES),
    compile=Setting(None, "torch.compile the model: None = auto (on for CUDA, where it pays for itself), "
                          "True/False to force", kind=bool, choices=(None, True, False)),
    activation_checkpointing=flag(False, "True: recompute each Block in the backward pass (less memory, more "
                                         "compute)"),
    num_threads=non_negative(0, "CPU threads for torch; 0 = auto (time all cores, half, ..., 1; keep the "
                                "fastest; re-checked while training)"),
    seed=Setting(1337, "the seed of the model's initialisation, the data order, dropout and sampling", low=0,
                 high=2 ** 32 - 1),
)


def check_model_shape(n_embd, n_head, pos):
    """ The architecture combination GPTConfig/GPT would otherwise reject deep in the build. """
    if n_embd and n_head and n_embd % n_head:
        raise UserError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head}): each head gets "
                        f"n_embd / n_head dimensions; change one of them")
    head_size = n_embd // n_head if n_embd and n_head else 0
    if pos == 'rope' and head_size % 2:
        raise UserError(f"pos='rope' turns pairs of each head's {head_size} dimensions, an odd number; choose "
                        f"n_embd and n_head so that n_embd / n_head is even")


def check_training(cfg):
    """
    train.py's checks of the combinations of its settings, once each one passed its own check
    (Schema.check): the one place that reads them all. Each check below is handed the values of its
    topic; the last one refuses a new model whose first step can't fit in this machine's memory.
    """
    check_model_shape(cfg['n_embd'], cfg['n_head'], cfg['pos'])
    if cfg['decay_lr'] and cfg['min_lr'] > cfg['learning_rate']:  # the "decay" would raise the rate
        raise UserError(f"min_lr ({cfg['min_lr']}) is above learning_rate ({cfg['learning_rate']}), so the decay "
                        f"would raise the learning rate; set --min_lr to at most learning_rate (about 1/10 of it)")
    if cfg['decay_lr']:
        check_schedule(cfg['learning_rate'], cfg['warmup_iters'], cfg['lr_decay_iters'],
                       cfg['max_iters'])
    if cfg['optimizer'] == 'muon' and cfg['parallelism'] == 'fsdp':
        raise UserError("optimizer='muon' orthogonalises whole matrices, which FSDP splits over the ranks; use "
                        "--parallelism=ddp with Muon, or --optimizer=adamw with FSDP")
    if cfg['resume_from'] and cfg['init_from'] != 'resume':
        raise UserError(f"--resume_from={cfg['resume_from']} goes back to a snapshot of the run in out_dir: it "
                        f"needs --init_from=resume")
    if cfg['init_from'] == 'scratch':  # weights that trained before have a size that fitted
        # imported here: this table of settings loads none of the code that acts on them
        from nanogpt_plus.device import resolve_device
        from nanogpt_plus.init_from import ModelSpec, check_new_model_fits
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


# -----------------------------------------------------------------------------
# the other scripts' own settings

WEIGHTS_SETTING = Setting('float32', "how the weights are stored and read: 'float32' (exact), 'bfloat16' or "
                                     "'int8' (weight-only, per row)", choices=WEIGHTS)

SAMPLING = Group(
    'sampling',
    start=Setting("\n", "the prompt text, or \"FILE:path\" to read it from a file ('<|endoftext|>': BPE's end "
                        "of text)"),
    num_samples=positive(10, "samples to draw, all in one batch"),
    max_new_tokens=non_negative(500, "tokens added to each sample"),
    temperature=Setting(0.8, "divides the logits: < 1.0 sharper, > 1.0 flatter; 0 = greedy (argmax)"),
    top_k=Setting(200, "draw only among the top_k most likely tokens (None: among all)", none_ok=True),
    top_p=Setting(1.0, "nucleus sampling: keep the most likely tokens up to this probability mass (1.0: off)",
                  none_ok=True),
    mode=Setting('exact', "'exact' (nanoGPT's results) or 'fast' (a KV cache in the model's dtype, see "
                          "sample.py)", choices=MODES),
    stop_at_eot=flag(False, "BPE models (gpt2, bpe): end a sample at <|endoftext|>"),
    weights=WEIGHTS_SETTING,
)

EVALUATION = Group(
    'zero-shot evaluation',
    task=Setting('loss', "loss | hellaswag | lambada"),
    data_file=Setting('', "the token file (loss) or JSONL (hellaswag, lambada); '' = the task's default"),
    split=Setting('val', "loss: the split of the dataset to score", not_empty=True),
    stride=non_negative(0, "loss: 0 = non-overlapping block_size windows; S = a sliding window, every token "
                           "scored once"),
    max_examples=non_negative(0, "0 = all; else the first N examples (loss: windows), for quick runs"),
    output_file=Setting('', "also write the result JSON here"),
    weights=WEIGHTS_SETTING,
)

FINETUNING = Group(
    'fine-tuning (GPT-1)',
    task=Setting('', "classification | entailment | similarity | multiple_choice ('' = the checkpoint's, when "
                     "predicting or resuming)"),
    train_file=Setting('', "JSONL with labels"),
    val_file=Setting('', "JSONL with labels; the accuracy after every epoch picks the model kept as ckpt.pt"),
    predict_file=Setting('', "JSONL without (or with ignored) labels: write predictions of the best model"),
    predict_out=Setting('', "where the predictions go ('' = out_dir/predictions.jsonl)"),
    epochs=positive(3, "passes over the training file"),
    lm_loss_weight=Setting(0.5, "lambda in L3 = L2 + lambda * L1 (the auxiliary LM loss); 0 turns it off", low=0),
    warmup_frac=Setting(0.002, "warm up over this fraction of all steps, then decay to min_lr by the last step",
                        low=0.0, high=1.0),
    eval_batch_size=non_negative(0, "examples per forward pass in evaluation; 0 = batch_size"),
    weights=WEIGHTS_SETTING,  # predictions only (--predict_file without --train_file)
)

# finetune.py's own meaning of two of train.py's settings
FINETUNE_BLOCK_SIZE = Setting(0, "0 = the source model's; smaller crops a pretrained model (a resume keeps its own)",
                              low=0)
FINETUNE_LEARNING_RATE = Setting(0.0, "the peak learning rate; 0 = scaled from the model's width: 6.25e-5 x "
                                      "(768 / n_embd) ** 1.5, GPT-1's rate at GPT-1's width (a resume: the rate it "
                                      "used)", low=0)

EXPORT = Group(
    'export',
    hf_dir=Setting('', "where to write the Hugging Face directory; '' = <out_dir>/hf"),
    weights=Setting('float32', "the dtype model.safetensors stores: 'float32' (exact) or 'bfloat16' (half the "
                               "size)"),
)

BENCH = Group(
    'what bench.py measures',
    real_data=flag(True, "True: batches of the dataset's train split; False: random tokens"),
    fused=Setting(None, "None = auto (fused AdamW where available); False = PyTorch's default AdamW for the "
                        "device", kind=bool, choices=(None, True, False)),
    burnin=non_negative(10, "untimed steps first (compilation, allocator and cache warm-up)"),
    steps=positive(20, "timed steps"),
    profile=flag(False, "True: a torch.profiler trace and op table instead of the timings"),
    profile_dir=Setting('bench_log', "where the profiler trace goes", not_empty=True),
)


def subset(group, *names):
    """ The settings `names` of a group (a script that uses some of them), in the group's order. """
    return Group(group.title, **{k: v for k, v in group.items() if k in names})
