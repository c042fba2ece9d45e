# GPT-1's fine-tuning recipe (Radford et al. 2018, section 4.1) for a text-classification JSONL task
# ({"text": ..., "label": ...} per line) on GPT-2 small:
#   python finetune.py config/finetune_classification.py --train_file=train.jsonl --val_file=val.jsonl
# Swap task to entailment / similarity / multiple_choice for the other formats.

task = 'classification'
init_from = 'gpt2'  # or a train.py out_dir, or a local Hugging Face GPT-2 directory
out_dir = 'out-ft-classification'

epochs = 3
batch_size = 32
# = 6.25e-5 for GPT-2 small (768 wide, like GPT-1); scaled to the width for the others
learning_rate = 0.0
warmup_frac = 0.002  # warm up over 0.2% of training, then decay
min_lr = 0.0
dropout = 0.1
lm_loss_weight = 0.5  # lambda in L3 = L2 + lambda * L1
weight_decay = 0.01
