# The laptop model on GPT-2 tokens (the BPE Shakespeare of data/shakespeare/prepare.py) with the modern recipe:
# the size, data and batch of nanoGPT's laptop run (config/train_shakespeare_char_cpu.py with
# dataset='shakespeare', 600 iterations), trained for 165 iterations instead of 600. With GPT-2's 50,304-token
# head most of a step is the head and its loss, so the gain comes from fewer steps (Muon for the Blocks'
# matrices and an 8x higher AdamW rate for what Muon doesn't take: the tied embedding/head and the gains;
# rotary positions, QK-norm, a warmup-stable-decay schedule) and from a cheaper step: on the CPU train.py
# computes the loss 128 positions at a time, never the whole logits (model.py's set_chunked_loss). The figures
# are in docs/recipes.md and come from `python scripts/bench_recipes.py`.
#   python data/shakespeare/prepare.py && python train.py config/train_shakespeare_fast.py

out_dir = 'out-shakespeare-fast'
# evaluated at the start and the end only: at 20 x 2 batches an evaluation costs ~10 steps here
eval_interval = 165
eval_iters = 20
log_interval = 10
always_save_checkpoint = False

wandb_log = False
wandb_project = 'shakespeare'
wandb_run_name = 'mini-gpt-cpu-fast'

dataset = 'shakespeare'
gradient_accumulation_steps = 1
batch_size = 12
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
pos = 'rope'
qk_norm = True

# Muon (muon_lr=0.02) for the hidden matrices; AdamW at learning_rate for the embedding (which is the head)
# and the gains: 8e-3 here, where nanoGPT's 1e-3 leaves the 6.4M-parameter embedding the slowest part to learn,
# with beta1=0.8 (the speedrun's) so its momentum follows the larger steps
optimizer = 'muon'
learning_rate = 8e-3
min_lr = 1e-4
beta1 = 0.8
beta2 = 0.99
max_iters = 165
lr_decay_iters = 165
warmup_iters = 10
lr_schedule = 'wsd'
cooldown_frac = 0.5

device = 'cpu'
compile = False
