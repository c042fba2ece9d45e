# evaluate the base gpt2-medium (350M) on the val split of the dataset (default: openwebtext)
# n_layer=24, n_head=16, n_embd=1024
batch_size = 8
eval_iters = 500  # use more iterations to get good estimate
eval_only = True
wandb_log = False
init_from = 'gpt2-medium'
