#!/usr/bin/env bash
# The CUDA check, in one go, for a machine with an NVIDIA GPU (the CPU-only test suite skips all of this):
#   1. the GPU-marked tests: bf16 and fp16+GradScaler training, fused AdamW, torch.compile, nccl DDP and
#      FSDP with 1 process (with 2+ GPUs also FSDP == DDP on 2), KV-cache sampling on CUDA, bench.py's MFU
#   2. bench.py for GPT-2 124M (batch 12 x 1024, bf16, compiled): ms/iter and MFU, like nanoGPT's bench.py
#   2b. the same, eager
# A step fails when its command fails, and also when it passes without showing anything: GPU tests that
# were skipped on this machine (the only skips accepted: a second GPU or bfloat16 that this machine lacks),
# or a bench run without a finite loss on every step and a time and an MFU in (0, 100] %. The script stops
# at the first failing step, names it on stderr and exits non-zero; its last line,
# "gpu_check.sh: all CUDA checks passed", is printed only when every step passed.
# Usage:
#   bash scripts/gpu_check.sh            # ~5-10 minutes, most of it compiling
#   SKIP_BENCH=1 bash scripts/gpu_check.sh
set -Eeuo pipefail
cd "$(dirname "$0")/.."

STEP="0. CUDA visible to PyTorch"
trap 'echo "gpu_check.sh: FAILED at step \"$STEP\" (exit $?); not all CUDA checks passed" >&2' ERR
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

python - <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA GPU visible to PyTorch " + torch.__version__ + "; nothing to check")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x "
      f"{torch.cuda.get_device_name()}, bf16: {torch.cuda.is_bf16_supported()}")
PY

STEP="1. GPU-marked tests"
echo "== $STEP"
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
if not ran:
    sys.exit("gpu_check.sh: no GPU test ran")
if unexpected:
    sys.exit("gpu_check.sh: GPU tests skipped on a machine that should run them: " + "; ".join(unexpected))
PY

check_bench() {  # $1: bench.py's output; fails unless its figures are plausible
  python - "$1" <<'PY'
import math, re, sys
text = open(sys.argv[1]).read()
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
PY
}

if [ "${SKIP_BENCH:-0}" != "1" ]; then
  REAL=False
  if [ -f data/openwebtext/train.bin ]; then REAL=True; fi
  for COMPILE in True False; do
    STEP="2. bench.py: GPT-2 124M, batch 12 x 1024, bf16, compile=$COMPILE, real_data=$REAL"
    echo "== $STEP"
    # the full output goes to a file for the check; the terminal gets it without the per-step loss lines
    python bench.py --real_data=$REAL --batch_size=12 --block_size=1024 --dtype=bfloat16 --compile=$COMPILE 2>&1 \
      | tee "$WORK/bench_$COMPILE.txt" | { grep -Ev "^[0-9]+/[0-9]+ loss" || true; }
    check_bench "$WORK/bench_$COMPILE.txt"
  done
fi
echo "gpu_check.sh: all CUDA checks passed"
