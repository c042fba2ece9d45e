#!/bin/bash
# train.py on several machines under SLURM: one task per node runs torchrun, which starts that node's GPU
# processes. Submit it, and it starts the run, or continues it when out_dir holds its checkpoint (a requeued job):
#   sbatch scripts/slurm_train.sh                                # config/train_gpt2.py into /shared/runs/gpt2
#   CONFIG=config/train_gpt2_fineweb.py OUT_DIR=/shared/runs/fw sbatch scripts/slurm_train.sh --batch_size=16
# Two minutes before the time limit SLURM sends SIGTERM to every task (torchrun), which passes it to its
# workers: they stop together, save, and exit 75; this script then requeues the job, which resumes.
# out_dir must be on a file system every node sees (a resume reads the checkpoint on every rank).
#SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 --cpus-per-task=32
#SBATCH --signal=TERM@120
#SBATCH --requeue
#SBATCH --open-mode=append
set -u -o pipefail

CONFIG=${CONFIG:-config/train_gpt2.py}
OUT_DIR=${OUT_DIR:-/shared/runs/gpt2}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
MASTER_PORT=${MASTER_PORT:-29500}
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
LOG=${LOG:-$OUT_DIR.slurm-$SLURM_JOB_ID.log}
# the time torchrun gives its workers between its SIGTERM and its SIGKILL: 30 s fixed, or --shutdown_timeout in a
# torch whose torchrun has it (added in 2026, pytorch/pytorch#172596): most of SLURM's 120 s, for the save
SHUTDOWN=""
if torchrun --help 2>&1 | grep -q -- '--shutdown[-_]timeout'; then
    SHUTDOWN="--shutdown_timeout=${SHUTDOWN_TIMEOUT:-100}"
fi
mkdir -p "$(dirname "$LOG")"

# The command runs in a shell on each node (bash -c, and \$SLURM_NODEID escaped), so that every node gets its own
# node rank: expanded here, in the batch shell, it would be 0 on every node. Settings after the script's name go
# to train.py. --auto_resume=True: a first submission starts the run, a requeued one continues it.
ARGS=$(printf ' %q' "$@")
START=$(stat -c %s "$LOG" 2>/dev/null || echo 0)
srun --kill-on-bad-exit=1 bash -c "exec torchrun --nnodes=$SLURM_NNODES --nproc_per_node=$NPROC_PER_NODE \
    --node_rank=\$SLURM_NODEID --master_addr=$MASTER_ADDR --master_port=$MASTER_PORT $SHUTDOWN \
    train.py $CONFIG --out_dir=$OUT_DIR --auto_resume=True$ARGS" 2>&1 | tee -a "$LOG"
code=$?

# every worker exits 75 after a clean stop (torchrun itself then reports 1): rank 0 said so in this job's part
# of the log; any other end (done, an error) is the job's end
if tail -c +$((START + 1)) "$LOG" | grep -q "^stopped cleanly; continue with --init_from=resume"; then
    echo "the run stopped cleanly and saved; requeueing job $SLURM_JOB_ID to continue it"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit $code
