"""
nanogpt_plus: what the entry points (train.py, sample.py, eval.py, finetune.py, export_hf.py,
bench.py and the data/*/prepare.py scripts) share. Each module holds one concern; see "What is
where" in README.md. Nothing here runs at import time: no network, no process groups, no logging
set-up.
"""
