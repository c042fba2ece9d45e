# GPT-1-style fine-tuning of the small character-level Shakespeare model (config/train_shakespeare_char_cpu.py)
# on a task built from plays it never saw; scripts/finetune_demo.py builds the JSONL files and runs this from the
# pretrained model and from scratch, over seeds and learning rates:
#   python finetune.py config/finetune_shakespeare_plays.py --init_from=out-shakespeare-char-cpu \
#       --train_file=spelling_train.jsonl --val_file=spelling_val.jsonl --out_dir=out-ft-plays
# The model settings below only matter for --init_from=scratch, the no-pretraining baseline: they repeat
# the pretrained model's so that the two runs differ in the initial weights only. The learning rate is
# finetune.py's default for the model's width (9.2e-4 at n_embd=128; see docs/finetuning.md).

task = 'classification'
out_dir = 'out-ft-plays'
dataset = 'shakespeare_char'  # the tokenizer of a scratch model

n_layer = 4
n_head = 4
n_embd = 128
block_size = 64
bias = False
dropout = 0.1  # GPT-1's fine-tuning dropout

epochs = 3
batch_size = 32
warmup_frac = 0.05
lm_loss_weight = 0.5
log_interval = 25

device = 'cpu'
compile = False
