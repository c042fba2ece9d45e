"""
GPT-2 (124M) on FineWeb-Edu in the spirit of modded-nanogpt's speedrun: config/train_gpt2_fineweb.py's data,
model size, batch and evaluation, trained with the modern options instead of GPT-2's recipe. The target is the
same as that recipe's, a FineWeb val loss <= 3.28, in fewer tokens.

The tokens budget: 5,722 steps x 524,288 tokens = 3.0B tokens, 30% of llm.c's 10B. As we read the speedrun's
public record history (not checked here: no internet), its late-2024 records, with about this set of changes
(Muon, rotary positions, QK-norm, ReLU^2, an untied head, a logit soft cap), reached 3.28 in a few billion
tokens, before later changes this project doesn't have (value embeddings, U-net skips, sliding-window
attention, an FP8 head) took it under 1B. 3.0B is a budget chosen from that, not a measurement of ours: this
config has not run on a GPU yet. The learning rates are Muon's usual 0.02 and a conservative AdamW rate for
the embedding and head; check them with a few hundred steps against config/train_gpt2_fineweb.py at the same
step (README.md, "Faster recipes").

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

# Muon for the 48 Block matrices; AdamW for the embedding, the head and the gains
optimizer = 'muon'
muon_lr = 0.02
muon_momentum = 0.95
muon_weight_decay = 0.0
learning_rate = 3e-3
min_lr = 0.0
weight_decay = 0.0
beta1 = 0.8
beta2 = 0.95
grad_clip = 1.0

# warmup-stable-decay: a short warmup, the peak rate, and a straight line to 0 over the last 40%
max_iters = 5722
lr_decay_iters = 5722
warmup_iters = 200
lr_schedule = 'wsd'
cooldown_frac = 0.4

# measured every 250 steps as config/train_gpt2_fineweb.py, so the two runs' curves compare step for step
eval_interval = 250
eval_iters = 160
hellaswag_interval = 250
log_interval = 10
always_save_checkpoint = True
keep_checkpoints = 4

dtype = 'bfloat16'
compile = True
