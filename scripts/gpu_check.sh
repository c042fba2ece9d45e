#!/usr/bin/env bash
# The CUDA check, in one go, for a machine with an NVIDIA GPU (the CPU-only test suite skips all of this).
# It runs what users run, not a CPU-test configuration:
#   1. the GPU-marked tests (tests/test_gpu.py), in train.py's default CUDA configuration (dtype=auto,
#      compile on): single-GPU training with bf16 and with fp16 + GradScaler, fused AdamW, DDP + compile and
#      FSDP + compile (bf16, and fp16) under torchrun with nccl, a resume on CUDA (bitwise in fp32 with
#      deterministic kernels; close in the default configuration), KV-cache sampling in fp32 and under bf16
#      autocast, bench.py's MFU against the GPU's own peak; with 2+ GPUs also FSDP == DDP on 2 nccl ranks
#   2. bench.py for GPT-2 124M (batch 12 x 1024, dtype=auto, compiled): ms/iter and MFU, printed next to the
#      expectation; on an H100/H200 an MFU under MFU_FLOOR (30 %) fails the check
# Multi-rank nccl needs 2+ GPUs: with one GPU the torchrun runs have 1 process, and the script says so.
# A step fails when its command fails, and also when it passes without showing anything: GPU tests that
# were skipped on this machine (the only skips accepted: a second GPU or bfloat16 that this machine lacks),
# or a bench run without a finite loss on every step, a time and an MFU in (0, 100] %, or under the floor.
# The script stops at the first failing step, names it on stderr and exits non-zero; its last line,
# "gpu_check.sh: all CUDA checks passed", is printed only when every step passed.
# Usage:
#   bash scripts/gpu_check.sh            # about 5-8 minutes on one H200, most of it compiling
#   SKIP_BENCH=1 bash scripts/gpu_check.sh
#   MFU_FLOOR=35 bash scripts/gpu_check.sh
set -Eeuo pipefail
cd "$(dirname "$0")/.."

STEP="0. CUDA visible to PyTorch"
trap 'echo "gpu_check.sh: FAILED at step \"$STEP\" (exit $?); not all CUDA checks passed" >&2' ERR
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
MFU_FLOOR=${MFU_FLOOR:-30}

python - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA GPU visible to PyTorch " + torch.__version__ + "; nothing to check")
n = torch.cuda.device_count()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {n} x {torch.cuda.get_device_name()}, "
      f"native bf16: {torch.cuda.is_bf16_supported(including_emulation=False)}")
if n < 2:
    print("multi-rank nccl: NOT checked, it needs 2+ GPUs and this machine has 1 "
          "(DDP and FSDP run under torchrun with 1 nccl process)")
else:
    print(f"multi-rank nccl: checked on 2 of the {n} GPUs (FSDP == DDP)")
PY
GPU_NAME=$(python -c "import torch; print(torch.cuda.get_device_name())")

STEP="1. GPU-marked tests (default CUDA configuration: dtype=auto, compile on)"
echo "== $STEP"
# deterministic cuBLAS for the bitwise resume test (cuBLAS reads it when PyTorch creates its handle)
CUBLAS_WORKSPACE_CONFIG=:4096:8 \
  python -m pytest -q -p no:cacheprovider -rs -m gpu tests/ --junitxml="$WORK/gpu_tests.xml"
python - "$WORK/gpu_tests.xml" <<'PY'
import sys
import xml.etree.ElementTree as ET
ACCEPTED_SKIPS = ("needs 2 CUDA GPUs", "this GPU has no bfloat16")  # what this machine may lack
ran, skipped = [], []
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    name = f"{case.get('classname')}::{case.get('name')}"
    skip = case.find("skipped")
    if skip is None:
        ran.append(name)
    else:
        skipped.append((name, skip.get("message", "")))
unexpected = [f"{name} ({why})" for name, why in skipped if not any(a in why for a in ACCEPTED_SKIPS)]
print(f"GPU tests: {len(ran)} ran and passed, {len(skipped)} skipped ({len(skipped) - len(unexpected)} accepted)")
for name, why in skipped:
    print(f"  skipped: {name} ({why})")
if not ran:
    sys.exit("gpu_check.sh: no GPU test ran")
if unexpected:
    sys.exit("gpu_check.sh: GPU tests skipped on a machine that should run them: " + "; ".join(unexpected))
PY
echo "   ($SECONDS s so far)"

check_bench() {  # $1: bench.py's output, $2: the GPU's name; fails unless the figures are plausible
  python - "$1" "$2" "$MFU_FLOOR" <<'PY'
import math, re, sys
text, gpu, floor = open(sys.argv[1]).read(), sys.argv[2], float(sys.argv[3])
losses = [float(x) for x in re.findall(r"^\d+/\d+ loss: (\S+)$", text, re.M)]
m = re.search(r"^time per iteration: (\S+)ms, MFU: (\S+)%$", text, re.M)
if not losses or not all(math.isfinite(x) for x in losses):
    sys.exit(f"gpu_check.sh: bench.py's step losses are missing or not finite: {losses}")
if m is None:
    sys.exit("gpu_check.sh: bench.py printed no 'time per iteration: ...ms, MFU: ...%' line")
ms, mfu = float(m.group(1)), float(m.group(2))
if not (math.isfinite(ms) and ms > 0 and 0 < mfu <= 100):
    sys.exit(f"gpu_check.sh: implausible bench.py figures: {ms} ms/iter, MFU {mfu}%")
print(f"bench figures: {ms:.2f} ms/iter, MFU {mfu:.2f}%, {len(losses)} finite step losses")
# GPT-2 124M, batch 12 x 1024, compiled bf16 on a Hopper GPU: well above 30 % of the dense bf16 peak
# (about 10.5 TFLOP per step: ~35 ms/iter at 30 % of an H100/H200's 989 TFLOP/s)
hopper = re.search(r"\bH(100|200)\b", gpu) is not None
print(f"MFU: expect > {floor:g}% on H100/H200; got {mfu:.2f}% on {gpu}"
      + ("" if hopper else " (no floor for this GPU: the expectation is for H100/H200)"))
if hopper and mfu < floor:
    sys.exit(f"gpu_check.sh: MFU {mfu:.2f}% is below the {floor:g}% expected of GPT-2 124M on an {gpu}")
PY
}

if [ "${SKIP_BENCH:-0}" != "1" ]; then
  REAL=False
  if [ -f data/openwebtext/train.bin ]; then REAL=True; fi
  STEP="2. bench.py: GPT-2 124M, batch 12 x 1024, dtype=auto, compiled, real_data=$REAL"
  echo "== $STEP"
  # the full output goes to a file for the check; the terminal gets it without the per-step loss lines
  python bench.py --real_data=$REAL --batch_size=12 --block_size=1024 --dtype=auto --compile=True 2>&1 \
    | tee "$WORK/bench.txt" | { grep -Ev "^[0-9]+/[0-9]+ loss" || true; }
  check_bench "$WORK/bench.txt" "$GPU_NAME"
  echo "   ($SECONDS s so far)"
else
  echo "== 2. bench.py: skipped (SKIP_BENCH=1)"
fi
echo "gpu_check.sh: all CUDA checks passed ($SECONDS s)"
