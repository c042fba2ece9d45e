#!/usr/bin/env bash
# The CUDA check, in one go, for a machine with NVIDIA GPUs (the CPU-only test suite skips all of this). It runs
# what users run, train.py's CUDA defaults (dtype=auto, compile on), on one GPU and, with N >= 2 GPUs, on
# K = min(N, 4) nccl ranks:
#   1. the GPU-marked tests (pytest -m gpu). With one GPU: training with bf16 and with fp16 + GradScaler, fused
#      AdamW, DDP and FSDP + compile under torchrun with 1 nccl process, resumes on CUDA, KV-cache sampling,
#      bench.py's MFU against the GPU's own peak, GPT-2 124M's activation checkpointing and out-of-memory message.
#      With 2+ GPUs also tests/test_gpu.py's *_on_k_ranks tests on K ranks: DDP and FSDP with bf16 and compile
#      against one rank, FSDP == DDP in fp32, a resume across ranks, the spike guard, in-loop HellaSwag under
#      compile, SIGTERM to torchrun (every worker exits 75 after "stopped cleanly"; the checkpoint resumes)
#   2. bench.py, GPT-2 124M (batch 12 x 1024, dtype=auto, compiled): its ms/iter and MFU
#   3. train.py, GPT-2 124M under torchrun with K processes (1 with one GPU), 12 x 1024 random tokens per GPU and
#      step: its own ms/iter and MFU (medians of its last 20 `iter` lines), printed next to bench.py's; on an
#      H100/H200 a bench.py MFU under MFU_FLOOR (30 %) fails the check
# A step fails when its command fails, and also when it passes without showing anything: GPU tests skipped for a
# reason this machine doesn't have (the only ones accepted: a second GPU or bf16 that it lacks), no multi-rank
# test run on 2+ GPUs, or a benchmark without a finite loss on every step and plausible figures. The script
# stops at the first failing step, names it on stderr and exits non-zero. Its last line says what passed:
# "all CUDA checks passed" needs 2+ GPUs; with one GPU it says (on stderr too) that the multi-rank paths were
# NOT checked, and exits 0, since the single-GPU results still count.
# Time (estimates: step 3 and the multi-rank tests have never run): one H200 about 6-9 minutes, most of it
# compiling (steps 2 and 3 about 1-1.5 each); with 2+ GPUs about 5-8 minutes more for the multi-rank tests'
# 13 torchrun runs of a tiny model.
# A lent H200 runs one command for at most 10 minutes, so each step gets what is left of BUDGET_S (570 s with
# one GPU, 1500 with more; 0 = no limit) and a step that runs out fails, named, instead of the whole lease.
# Usage:
#   bash scripts/gpu_check.sh
#   SKIP_BENCH=1 bash scripts/gpu_check.sh          # the tests only (step 1)
#   MFU_FLOOR=35 BUDGET_S=0 bash scripts/gpu_check.sh
set -Eeuo pipefail
cd "$(dirname "$0")/.."

STEP="0. CUDA visible to PyTorch"
BUDGET_S=${BUDGET_S:-}
on_error() {  # $1: the failing command's exit code
  # once, from the script itself: not again from the subshell of a pipeline that runs a function
  if [ "$BASH_SUBSHELL" -gt 0 ]; then return; fi
  local why=""
  if [ "$1" -eq 124 ]; then why=", out of time: BUDGET_S=$BUDGET_S s, 0 = no limit"; fi
  if [ "$1" -eq 137 ]; then why=", killed: out of time (BUDGET_S=$BUDGET_S s) or of memory"; fi
  echo "gpu_check.sh: FAILED at step \"$STEP\" (exit $1$why); not all CUDA checks passed" >&2
}
trap 'on_error $?' ERR
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
MFU_FLOOR=${MFU_FLOOR:-30}

budgeted() {  # "$@" with what is left of BUDGET_S; exit code 124 when that runs out
  if [ "$BUDGET_S" -eq 0 ]; then
    "$@"
    return
  fi
  local left=$((BUDGET_S - SECONDS))
  if [ "$left" -le 0 ]; then
    return 124
  fi
  # SIGINT, as Ctrl-C: pytest ends its session (and kills the run it waits for), torchrun passes it on to every
  # worker. --foreground leaves Ctrl-C to the terminal as without timeout
  timeout --foreground --signal=INT --kill-after=20 "$left" "$@"
}

python - "$WORK/gpus" <<'PY'
import sys, torch
if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: no CUDA GPU visible to PyTorch " + torch.__version__ + "; nothing to check")
n, name = torch.cuda.device_count(), torch.cuda.get_device_name()
bf16 = torch.cuda.is_bf16_supported(including_emulation=False)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {n} x {name}, native bf16: {bf16}")
with open(sys.argv[1], "w") as f:
    f.write(f"{n}\n{int(bf16)}\n{name}\n")
PY
{ read -r N; read -r BF16; read -r GPU_NAME; } < "$WORK/gpus"
K=$((N < 4 ? N : 4))
PROCESSES="$K process"
if [ "$K" -gt 1 ]; then PROCESSES="${K} processes"; fi
if [ -z "$BUDGET_S" ]; then
  BUDGET_S=$((N >= 2 ? 1500 : 570))
fi
if ! [[ "$BUDGET_S" =~ ^[0-9]+$ ]]; then
  echo "gpu_check.sh: BUDGET_S must be a whole number of seconds (0 = no limit), not '$BUDGET_S'" >&2
  exit 2
fi
NOT_CHECKED="multi-rank (DDP/FSDP over nccl, resume across ranks, spike guard, HellaSwag and SIGTERM under NCCL)\
 NOT checked: 1 GPU"
if [ "$N" -ge 2 ]; then
  echo "multi-rank: on $K nccl ranks ($K of the $N GPUs); time budget ${BUDGET_S} s"
else
  echo "gpu_check.sh: $NOT_CHECKED (the *_on_k_ranks tests skip; torchrun runs 1 process)" >&2
  echo "time budget: ${BUDGET_S} s"
fi

STEP="1. GPU-marked tests (dtype=auto, compile on)"
if [ "$N" -ge 2 ]; then STEP="$STEP, the *_on_k_ranks ones on $K ranks"; fi
echo "== $STEP"
# deterministic cuBLAS for the bitwise resume test (cuBLAS reads it when PyTorch creates its handle)
budgeted env CUBLAS_WORKSPACE_CONFIG=:4096:8 \
  python -m pytest -q -p no:cacheprovider -rs -m gpu tests/ --junitxml="$WORK/gpu_tests.xml"
python - "$WORK/gpu_tests.xml" "$N" "$BF16" <<'PY'
import sys
import xml.etree.ElementTree as ET
gpus, bf16 = int(sys.argv[2]), sys.argv[3] == "1"
# the skips this machine explains: a second GPU or native bf16 that it lacks
accepted = (["needs 2 CUDA GPUs"] if gpus < 2 else []) + ([] if bf16 else ["this GPU has no bfloat16"])
ran, skipped = [], []
for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    name = f"{case.get('classname')}::{case.get('name')}"
    skip = case.find("skipped")
    if skip is None:
        ran.append(name)
    else:
        skipped.append((name, skip.get("message", "")))
unexpected = [f"{name} ({why})" for name, why in skipped if not any(a in why for a in accepted)]
print(f"GPU tests: {len(ran)} ran and passed, {len(skipped)} skipped ({len(skipped) - len(unexpected)} accepted)")
for name, why in skipped:
    print(f"  skipped: {name} ({why})")
if not ran:
    sys.exit("gpu_check.sh: no GPU test ran")
if unexpected:
    sys.exit("gpu_check.sh: GPU tests skipped on a machine that should run them: " + "; ".join(unexpected))
multi_rank = [name for name in ran if "_on_k_ranks" in name]
if gpus >= 2:
    if not multi_rank:
        sys.exit(f"gpu_check.sh: no multi-rank (*_on_k_ranks) test ran, with {gpus} GPUs")
    print(f"multi-rank tests on {min(gpus, 4)} ranks: {len(multi_rank)} ran and passed")
else:
    names = sorted({name.split("::")[-1].split("[")[0] for name, _ in skipped if "_on_k_ranks" in name})
    print(f"NOT checked with 1 GPU: {len(names)} multi-rank tests: " + ", ".join(names), file=sys.stderr)
PY
echo "   ($SECONDS s so far)"

check_bench() {  # $1: bench.py's output, $2: where its figures go; fails unless they are plausible
  python - "$1" "$2" <<'PY'
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
print(f"bench.py figures: {ms:.2f} ms/iter, MFU {mfu:.2f}%, {len(losses)} finite step losses")
with open(sys.argv[2], "w") as f:
    f.write(f"{ms} {mfu}\n")
PY
}

check_train() {  # $1: train.py's output, $2: its max_iters, $3: where its figures go; fails unless plausible
  python - "$1" "$2" "$3" <<'PY'
import math, re, statistics, sys
text, max_iters = open(sys.argv[1]).read(), int(sys.argv[2])
rows = [(int(it), float(loss), float(ms), float(mfu)) for it, loss, ms, mfu
        in re.findall(r"^iter (\d+): loss (\S+), time (\S+)ms, mfu (\S+)%$", text, re.M)]
if [r[0] for r in rows] != list(range(max_iters + 1)):
    sys.exit(f"gpu_check.sh: train.py printed `iter` lines for {len(rows)} iterations, not for 0..{max_iters}")
not_finite = [r[0] for r in rows if not math.isfinite(r[1])]
if not_finite:
    sys.exit(f"gpu_check.sh: train.py's loss is not finite at iterations {not_finite[:10]}")
# the last 20: long after compiling (iteration 0) and the 5 iterations before train.py starts measuring MFU
last = rows[-20:]
ms, mfu = statistics.median([r[2] for r in last]), statistics.median([r[3] for r in last])
if not (math.isfinite(ms) and ms > 0 and 0 < mfu <= 100):
    sys.exit(f"gpu_check.sh: implausible train.py figures: {ms} ms/iter, MFU {mfu}%")
print(f"train.py figures: {ms:.2f} ms/iter, MFU {mfu:.2f}% (medians of iterations {last[0][0]}-{last[-1][0]}), "
      f"{len(rows)} finite losses")
with open(sys.argv[3], "w") as f:
    f.write(f"{ms} {mfu}\n")
PY
}

if [ "${SKIP_BENCH:-0}" != "1" ]; then
  REAL=False
  if [ -f data/openwebtext/train.bin ]; then REAL=True; fi
  STEP="2. bench.py: GPT-2 124M, batch 12 x 1024, dtype=auto, compiled, real_data=$REAL"
  echo "== $STEP"
  # the full output goes to a file for the check; the terminal gets it without the per-step loss lines
  budgeted python bench.py --real_data=$REAL --batch_size=12 --block_size=1024 --dtype=auto --compile=True 2>&1 \
    | tee "$WORK/bench.txt" | { grep -Ev "^[0-9]+/[0-9]+ loss" || true; }
  check_bench "$WORK/bench.txt" "$WORK/bench_figures"
  echo "   ($SECONDS s so far)"

  TRAIN_ITERS=40
  STEP="3. train.py: GPT-2 124M under torchrun, $PROCESSES, 12 x 1024 tokens per GPU and step, compiled"
  echo "== $STEP"
  # random GPT-2 token ids (a directory without meta.json is GPT-2's vocabulary): nothing to download, and the
  # time of a step doesn't depend on the tokens
  python - "$WORK/gpt2_random" <<'PY'
import os, sys
import numpy as np
os.makedirs(sys.argv[1])
rng = np.random.default_rng(0)
for split, n in (("train", 4_000_000), ("val", 100_000)):
    rng.integers(0, 50257, n, dtype=np.uint16).tofile(os.path.join(sys.argv[1], f"{split}.bin"))
PY
  # one micro-batch of 12 x 1024 per rank and step, as bench.py's step; evaluated only at iteration 0 (1 batch)
  budgeted python -m torch.distributed.run --standalone --nproc_per_node="$K" train.py \
      --dataset="$WORK/gpt2_random" --out_dir="$WORK/gpt2_out" --batch_size=12 --block_size=1024 \
      --gradient_accumulation_steps="$K" --max_iters=$TRAIN_ITERS --lr_decay_iters=$TRAIN_ITERS --warmup_iters=10 \
      --eval_interval=1000 --eval_iters=1 --log_interval=1 --dtype=auto --compile=True 2>&1 \
    | tee "$WORK/train.txt" | { grep -Ev "^iter [0-9]+: loss" || true; }
  check_train "$WORK/train.txt" "$TRAIN_ITERS" "$WORK/train_figures"
  echo "   ($SECONDS s so far)"

  STEP="4. the figures against the expectation"
  echo "== $STEP"
  python - "$WORK/bench_figures" "$WORK/train_figures" "$GPU_NAME" "$MFU_FLOOR" "$PROCESSES" <<'PY'
import re, sys
(bench_ms, bench_mfu), (train_ms, train_mfu) = (map(float, open(p).read().split()) for p in sys.argv[1:3])
gpu, floor = sys.argv[3], float(sys.argv[4])
train = f"train.py, its loop, torchrun with {sys.argv[5]}:"
bench = "bench.py, the step alone, 1 process:"
print(f"GPT-2 124M, 12 x 1024 tokens per GPU and step, dtype=auto, compiled, {gpu}:")
print(f"  {bench:<{len(train)}} {bench_ms:8.2f} ms/iter, MFU {bench_mfu:6.2f}%")
print(f"  {train} {train_ms:8.2f} ms/iter, MFU {train_mfu:6.2f}% (each GPU's)")
# GPT-2 124M, batch 12 x 1024, compiled bf16 on a Hopper GPU: well above 30 % of the dense bf16 peak
# (about 10.5 TFLOP per step: ~35 ms/iter at 30 % of an H100/H200's 989 TFLOP/s)
hopper = re.search(r"\bH(100|200)\b", gpu) is not None
print(f"MFU: expect > {floor:g}% on H100/H200; bench.py got {bench_mfu:.2f}% on {gpu}"
      + ("" if hopper else " (no floor for this GPU: the expectation is for H100/H200)"))
if hopper and bench_mfu < floor:
    sys.exit(f"gpu_check.sh: MFU {bench_mfu:.2f}% is below the {floor:g}% expected of GPT-2 124M on an {gpu}")
PY
  echo "   ($SECONDS s so far)"
else
  echo "== 2-4. bench.py and train.py's ms/iter: skipped (SKIP_BENCH=1)"
fi

SKIPPED=""
if [ "${SKIP_BENCH:-0}" = "1" ]; then SKIPPED=" (benchmarks skipped: SKIP_BENCH=1)"; fi
if [ "$N" -ge 2 ]; then
  if [ -n "$SKIPPED" ]; then
    echo "gpu_check.sh: CUDA checks passed in $SECONDS s, multi-rank on $K of $N GPUs$SKIPPED"
  else
    echo "gpu_check.sh: all CUDA checks passed in $SECONDS s, multi-rank on $K of $N GPUs"
  fi
else
  # said on stderr as well, so that neither stream alone hides it
  echo "gpu_check.sh: single-GPU checks passed in $SECONDS s$SKIPPED; $NOT_CHECKED" >&2
  echo "gpu_check.sh: single-GPU checks passed in $SECONDS s$SKIPPED; $NOT_CHECKED"
fi
