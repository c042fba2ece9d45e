#!/usr/bin/env bash
# The CUDA check, in one go, for a machine with an NVIDIA GPU (the CPU-only test suite skips all of this):
#   1. the GPU-marked tests: bf16 and fp16+GradScaler training, fused AdamW, torch.compile, nccl DDP and
#      FSDP with 1 process, KV-cache sampling on CUDA, bench.py's MFU against the GPU's peak
#   2. with 2+ GPUs: FSDP and DDP on 2 GPUs give the same losses (tests/test_fsdp.py's check, on nccl)
#   3. bench.py for GPT-2 124M (batch 12 x 1024, bf16, compiled): ms/iter and MFU, like nanoGPT's bench.py
# Usage:
#   bash scripts/gpu_check.sh            # ~5-10 minutes, most of it compiling
#   SKIP_BENCH=1 bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

python - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA GPU visible to PyTorch " + torch.__version__ + "; nothing to check")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x "
      f"{torch.cuda.get_device_name()}, bf16: {torch.cuda.is_bf16_supported()}")
PY

echo "== 1. GPU-marked tests"
python -m pytest -q -m gpu tests/

NGPU=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$NGPU" -ge 2 ]; then
  echo "== 2. FSDP vs DDP on 2 GPUs (nccl)"
  OUT=$(mktemp -d)
  python - "$OUT" <<'PY'
import json, sys, numpy as np
d = sys.argv[1]
t = np.tile(np.arange(20), 3000).astype(np.uint16)
t[:54000].tofile(f"{d}/train.bin"); t[54000:].tofile(f"{d}/val.bin")
json.dump({"kind": "char", "vocab_size": 20, "stoi": {}, "itos": {}}, open(f"{d}/meta.json", "w"))
PY
  COMMON="--dataset=$OUT --n_layer=2 --n_head=2 --n_embd=64 --block_size=32 --batch_size=8 \
    --gradient_accumulation_steps=4 --max_iters=10 --eval_interval=5 --eval_iters=4 --dtype=float32 --compile=False"
  for P in ddp fsdp; do
    torchrun --standalone --nproc_per_node=2 train.py $COMMON --parallelism=$P --out_dir="$OUT/$P" \
      | grep -E "^iter [0-9]+: loss" | sed -E 's/, time.*//' > "$OUT/$P.txt"
  done
  python - "$OUT" <<'PY'
import sys
d = sys.argv[1]
a, b = (open(f"{d}/{p}.txt").read().split("\n") for p in ("ddp", "fsdp"))
worst = max(abs(float(x.split()[-1]) - float(y.split()[-1])) for x, y in zip(a, b) if x and y)
print(f"DDP vs FSDP losses over {len([x for x in a if x])} iterations: max difference {worst:.2e}")
sys.exit(0 if worst < 2e-3 else "FSDP and DDP losses differ")
PY
fi

if [ "${SKIP_BENCH:-0}" != "1" ]; then
  echo "== 3. bench.py: GPT-2 124M, batch 12 x 1024, bf16, compile (synthetic tokens unless openwebtext is prepared)"
  REAL=False
  [ -f data/openwebtext/train.bin ] && REAL=True
  python bench.py --real_data=$REAL --batch_size=12 --block_size=1024 --dtype=bfloat16 --compile=True \
    | grep -Ev "^[0-9]+/[0-9]+ loss"
  echo "== 3b. the same, eager (no compile)"
  python bench.py --real_data=$REAL --batch_size=12 --block_size=1024 --dtype=bfloat16 --compile=False \
    | grep -Ev "^[0-9]+/[0-9]+ loss"
fi
echo "gpu_check.sh: all CUDA checks passed"
