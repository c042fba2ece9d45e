"""
GPT-2 (124M) on FineWeb-Edu in the spirit of modded-nanogpt's speedrun: config/train_gpt2_fineweb.py's data,
model size, batch and evaluation, trained with the modern options instead of GPT-2's recipe, for a third of its
steps. The target is the same as that recipe's, a FineWeb val loss <= 3.28.

Its rates and schedule are the CPU proxies' winners (config/train_shakespeare_fast.py, and the FineWeb-like
run of scripts/bench_recipes.py --mode=fineweb), carried to 768 wide and 524,288 tokens per step by the rule in
docs/recipes.md ("From the CPU to GPT-2 124M"):
  - steps: a third of the GPT-2 recipe's (the proxies needed 0.30x and 0.32x of nanoGPT's steps for its loss):
    6,358 x 524,288 = 3.33B tokens, a third of llm.c's 10B;
  - Muon's rate as it is (0.02): its update is orthogonalised and scaled by its shape, so it carries across width;
  - AdamW's rate (the embedding, the head, the gains) as 1/width from the proxies' 8e-3 at 128 wide: 1.3e-3;
  - beta1 0.8; warmup-stable-decay with a 5.5% warmup and the last half a straight line down to lr/80.
This config has not run on a GPU yet; `python scripts/bench_recipes.py --mode=speedrun` is the check (README.md,
"Faster recipes").

Prepare the shards first (python data/fineweb/prepare.py), then:
$ torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_speedrun.py
$ python train.py config/train_gpt2_speedrun.py --max_iters=300 --eval_interval=100   # a short check, 1 GPU
"""

out_dir = 'out-gpt2-speedrun'

dataset = 'fineweb'
data_order = 'sequential'

# 64 x 1024 tokens x 8 micro-batches = 524,288 tokens per step, as config/train_gpt2_fineweb.py
batch_size = 64
block_size = 1024
gradient_accumulation_steps = 8

# the model: GPT-2 124M's size, the modern architecture; no biases (bias=False is faster and loses nothing)
n_layer = 12
n_head = 12
n_embd = 768
bias = False
dropout = 0.0
pos = 'rope'
norm = 'rmsnorm'
qk_norm = True
mlp_act = 'relu2'
logit_softcap = 15.0
tie_embeddings = False

# Muon for the 48 Block matrices; AdamW for the embedding, the head and the gains (docs/recipes.md's rule)
optimizer = 'muon'
muon_lr = 0.02
muon_momentum = 0.95
muon_weight_decay = 0.0
learning_rate = 1.3e-3  # 8e-3 x 128 / 768
min_lr = 1.6e-5  # learning_rate / 80, as 1e-4 for 8e-3
weight_decay = 0.0
beta1 = 0.8
beta2 = 0.95
grad_clip = 1.0

# warmup-stable-decay: 5.5% warmup, the peak rate, then a straight line down over the last half
max_iters = 6358
lr_decay_iters = 6358
warmup_iters = 350
lr_schedule = 'wsd'
cooldown_frac = 0.5

# measured every 250 steps as config/train_gpt2_fineweb.py, so the two runs' curves compare step for step
eval_interval = 250
eval_iters = 160
hellaswag_interval = 250
log_interval = 10
always_save_checkpoint = True
keep_checkpoints = 4

dtype = 'bfloat16'
compile = True
