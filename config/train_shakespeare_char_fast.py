# The laptop Shakespeare model (config/train_shakespeare_char_cpu.py: the same data, size and batch) trained
# with the modern recipe: Muon for the Blocks' matrices, rotary positions, QK-norm and a warmup-stable-decay
# schedule, for 300 iterations instead of 2000. It reaches nanoGPT's laptop loss (1.898 on the whole val split
# of the real tiny Shakespeare) in under a quarter of nanoGPT's wall time on a 2-core CPU; the figures and
# what each choice buys are in docs/recipes.md and come from `python scripts/bench_recipes.py`.
#   python train.py config/train_shakespeare_char_fast.py

out_dir = 'out-shakespeare-char-fast'
eval_interval = 300  # at the start and the end: an evaluation and its save cost ~10 iterations
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

# Muon for the hidden matrices, AdamW at learning_rate for the embedding and gains. Against PyTorch's Muon
# defaults: a higher rate (0.03, not 0.02) and a shorter memory (momentum 0.9, not 0.95) suit a run of 300
# steps, and 4 Newton-Schulz steps instead of 5 cost a fifth less for the same loss
optimizer = 'muon'
muon_lr = 0.03
muon_momentum = 0.9
muon_ns_steps = 4
learning_rate = 2e-3
min_lr = 1e-4
beta2 = 0.99
max_iters = 300
lr_decay_iters = 300
warmup_iters = 20
lr_schedule = 'wsd'  # flat after the warmup, then a straight line down over the last 40%
cooldown_frac = 0.4

device = 'cpu'
compile = False
