# evaluate the base gpt2 (124M) on the val split of the dataset (default: openwebtext)
# n_layer=12, n_head=12, n_embd=768
batch_size = 8
eval_iters = 500  # use more iterations to get good estimate
eval_only = True
wandb_log = False
init_from = 'gpt2'
