# nanoGPT's laptop command for the character-level Shakespeare model, as a config file:
#   python train.py config/train_shakespeare_char.py --device=cpu --compile=False --eval_iters=20
#     --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4 --n_embd=128
#     --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0
# reaches a val loss of ~1.88 in a few minutes on a laptop CPU.

# its own directory: nanoGPT's GPU recipe (train_shakespeare_char.py) writes out-shakespeare-char
out_dir = 'out-shakespeare-char-cpu'
eval_interval = 250
eval_iters = 20
log_interval = 1
always_save_checkpoint = False

wandb_log = False
wandb_project = 'shakespeare-char'
wandb_run_name = 'mini-gpt-cpu'

dataset = 'shakespeare_char'
gradient_accumulation_steps = 1
batch_size = 12
block_size = 64

n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0

learning_rate = 1e-3
max_iters = 2000
lr_decay_iters = 2000
min_lr = 1e-4
beta2 = 0.99
warmup_iters = 100

device = 'cpu'
compile = False
