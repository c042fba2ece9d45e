"""
GPT-2 (124M) on 10B tokens of FineWeb-Edu: the recipe of llm.c and build-nanogpt, 524,288 tokens per step for
19,073 steps (one pass over the 10B-token sample), a 715-step warm-up, val loss and HellaSwag every 250 steps.
Their runs reach a FineWeb val loss of ~3.28-3.29 and HellaSwag acc_norm ~0.29-0.30 (OpenAI's GPT-2 124M: 0.2955)
in ~1.5 h on 8 A100s; those are their figures, not measured here.

Prepare the shards first (python data/fineweb/prepare.py), then:

8 GPUs on one machine (1 micro-batch of 64 x 1024 per GPU per step):
$ torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_fineweb.py

1 GPU, the same global batch through 8 micro-batches of accumulation (~8x the time):
$ python train.py config/train_gpt2_fineweb.py

A GPU with less memory: halve batch_size and double gradient_accumulation_steps (same tokens per step), or
add --activation_checkpointing=True.
"""

out_dir = 'out-gpt2-fineweb'

# data: the llm.c shards of data/fineweb/prepare.py, each token once, in order (llm.c's loader)
dataset = 'fineweb'
data_order = 'sequential'

# 64 x 1024 tokens x 8 micro-batches = 524,288 tokens per step, for any number of GPUs that divides 8
batch_size = 64
block_size = 1024
gradient_accumulation_steps = 8

# GPT-2's own layout (biases, tanh GELU), as llm.c and build-nanogpt train it; the vocabulary padded to 50,304
n_layer = 12
n_head = 12
n_embd = 768
bias = True
gelu = 'tanh'
dropout = 0.0

# AdamW and the schedule: 6e-4 peak, linear warm-up over 715 steps, cosine down to 6e-5 at the last step
learning_rate = 6e-4
min_lr = 6e-5
warmup_iters = 715
max_iters = 19073
lr_decay_iters = 19073
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0

# measured every 250 steps: val loss over 160 x 64 x 1024 tokens (10.5M, build-nanogpt's 20 batches on each of
# 8 GPUs) from the start of the val shard, and the whole of HellaSwag's validation set
eval_interval = 250
eval_iters = 160
hellaswag_interval = 250
log_interval = 10

# a checkpoint at every evaluation; the last 4 also kept as ckpt_<iter>.pt (hard links while identical)
always_save_checkpoint = True
keep_checkpoints = 4

dtype = 'bfloat16'
compile = True
