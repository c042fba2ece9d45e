"""
nanogpt_plus: what the entry points (train.py, sample.py, eval.py, finetune.py, export_hf.py,
bench.py and the data/*/prepare.py scripts) share, one topic per module or folder, each named for
it; docs/layout.md says what is where. Nothing here runs at import time: no network, no process
groups, no logging set-up.
"""
