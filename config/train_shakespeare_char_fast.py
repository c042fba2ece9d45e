# The laptop Shakespeare model (config/train_shakespeare_char_cpu.py: the same data, size and batch) trained
# with the modern recipe: Muon for the Blocks' matrices, rotary positions, QK-norm and a warmup-stable-decay
# schedule, for 400 iterations instead of 2000. On a 2-core AMD EPYC it reaches the nanoGPT recipe's final
# val loss (~1.89 on the whole val split) in about a third of its training time; the figures and what each
# option buys are in README.md ("Faster recipes") and come from `python scripts/bench_recipes.py`.
#   python train.py config/train_shakespeare_char_fast.py

out_dir = 'out-shakespeare-char-fast'
eval_interval = 100
eval_iters = 20
log_interval = 10
always_save_checkpoint = False

wandb_log = False
wandb_project = 'shakespeare-char'
wandb_run_name = 'mini-gpt-cpu-fast'

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 12
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
pos = 'rope'  # rotary positions instead of the learned wpe table
# RMS-normalised queries and keys: Muon's larger steps keep the attention scores bounded
qk_norm = True

# Muon (its own rate, muon_lr=0.02) for the hidden matrices, AdamW at learning_rate for the embedding and gains
optimizer = 'muon'
learning_rate = 1e-3
min_lr = 1e-4
beta2 = 0.99
max_iters = 400
lr_decay_iters = 400
warmup_iters = 50
lr_schedule = 'wsd'  # flat after the warmup, then a straight line down over the last 40%
cooldown_frac = 0.4

device = 'cpu'
compile = False
