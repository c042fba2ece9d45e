#!/usr/bin/env bash
# The CUDA check, in one go, for a machine with an NVIDIA GPU (the CPU-only test suite skips all of this):
#   1. the GPU-marked tests: bf16 and fp16+GradScaler training, fused AdamW, torch.compile, nccl DDP and
#      FSDP with 1 process (with 2+ GPUs also FSDP == DDP on 2), KV-cache sampling on CUDA, bench.py's MFU
#   2. bench.py for GPT-2 124M (batch 12 x 1024, bf16, compiled): ms/iter and MFU, like nanoGPT's bench.py
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

if [ "${SKIP_BENCH:-0}" != "1" ]; then
  echo "== 2. bench.py: GPT-2 124M, batch 12 x 1024, bf16, compile (synthetic tokens unless openwebtext is prepared)"
  REAL=False
  [ -f data/openwebtext/train.bin ] && REAL=True
  python bench.py --real_data=$REAL --batch_size=12 --block_size=1024 --dtype=bfloat16 --compile=True \
    | grep -Ev "^[0-9]+/[0-9]+ loss"
  echo "== 2b. the same, eager (no compile)"
  python bench.py --real_data=$REAL --batch_size=12 --block_size=1024 --dtype=bfloat16 --compile=False \
    | grep -Ev "^[0-9]+/[0-9]+ loss"
fi
echo "gpu_check.sh: all CUDA checks passed"
