#!/bin/bash
# train.py on several machines under SLURM: one task per node runs torchrun, which starts that
# node's GPU processes. Submit it, and it starts the run, or continues it when out_dir holds its
# checkpoint (a requeued job):
#   sbatch scripts/slurm_train.sh                    # config/train_gpt2.py into /shared/runs/gpt2
#   CONFIG=config/train_gpt2_fineweb.py OUT_DIR=/shared/runs/fw sbatch scripts/slurm_train.sh \
#       --batch_size=16
# Two minutes before the time limit SLURM sends SIGTERM to every process of the job's step (torchrun
# and its workers): they stop together, save, and exit 75; this script then requeues the job, which
# resumes. out_dir must be on a file system every node sees (a resume reads the checkpoint on every
# rank). docs/training.md ("Many machines") says why each step is as it is.
#SBATCH --nodes=2 --ntasks-per-node=1 --gpus-per-node=8 --cpus-per-task=32
#SBATCH --signal=TERM@120
#SBATCH --requeue
#SBATCH --open-mode=append
set -u -o pipefail

# every value in a line is printed ${value@Q} (quoted, a newline or a terminal escape as $'\n'): a
# value can't split a line or forge one
fail() {
    echo "error: $*" >&2
    exit 2
}

# what this script reads of SLURM's environment: without it, one line
for name in SLURM_JOB_ID SLURM_JOB_NODELIST SLURM_NNODES; do
    if [ -z "${!name:-}" ]; then
        fail "$name is not set: submit this script with sbatch" \
            "(or run it inside a SLURM allocation)"
    fi
done
if [[ ! $SLURM_JOB_ID =~ ^[0-9]+$ ]]; then
    fail "SLURM_JOB_ID=${SLURM_JOB_ID@Q} is not a job number: submit this script with sbatch"
fi

CONFIG=${CONFIG:-config/train_gpt2.py}
OUT_DIR=${OUT_DIR:-/shared/runs/gpt2}
NPROC_PER_NODE=${NPROC_PER_NODE:-8}
if [ -n "${MASTER_PORT:-}" ]; then
    if [[ ! $MASTER_PORT =~ ^[0-9]{1,5}$ ]] || ((10#$MASTER_PORT < 1 || 10#$MASTER_PORT > 65535)); then
        fail "MASTER_PORT=${MASTER_PORT@Q} is not a port: give one from 1 to 65535, or leave it unset"
    fi
else
    # torchrun's store listens on MASTER_ADDR:MASTER_PORT: a port of this job's own (10000-29999,
    # below Linux's ephemeral ports), so that two jobs sharing a node don't meet on one port. The
    # job id picks the first port tried; ids 20000 apart pick the same one, so this shell (on
    # MASTER_ADDR's node) takes the next port that nothing listens on yet. Left: two jobs that start
    # in the same seconds may both find a port free before either's torchrun listens on it
    # (docs/training.md, "Many machines").
    MASTER_PORT=$((10000 + 10#$SLURM_JOB_ID % 20000))
    for ((tries = 0; tries < 200; tries++)); do
        # a connection that succeeds: something listens there
        if ! (exec 3<>"/dev/tcp/127.0.0.1/$MASTER_PORT") 2>/dev/null; then
            break
        fi
        MASTER_PORT=$((10000 + (MASTER_PORT - 10000 + 1) % 20000))
    done
fi
# the job's first node: the batch shell runs there, and its SLURM_NODEID is 0 (node rank 0: rank 0)
if ! hosts=$(scontrol show hostnames "$SLURM_JOB_NODELIST") || [ -z "$hosts" ]; then
    fail "scontrol names no host in SLURM_JOB_NODELIST=${SLURM_JOB_NODELIST@Q}: submit with sbatch"
fi
MASTER_ADDR=${hosts%%$'\n'*}
LOG=${LOG:-$OUT_DIR.slurm-$SLURM_JOB_ID.log}
# the time torchrun gives its workers between its SIGTERM and its SIGKILL: 30 s fixed, or
# --shutdown_timeout in a torch whose torchrun has it (added in 2026, pytorch/pytorch#172596): most
# of SLURM's 120 s, for the save
SHUTDOWN=""
if [[ $(torchrun --help 2>&1) == *--shutdown[-_]timeout* ]]; then
    SHUTDOWN="--shutdown_timeout=${SHUTDOWN_TIMEOUT:-100}"
fi
mkdir -p "$(dirname "$LOG")"
# where each rank of train.py (nanogpt_plus/runtime.py, record_exit_code) and each node's shell write
# their exit codes: the requeue is decided from them, never from the log, whose lines a value echoed
# in an error could forge. Emptied for each start of the job (a requeued one has the same id).
EXIT_CODES=$(realpath -m -- "$LOG.exit-codes")
rm -rf -- "$EXIT_CODES"
mkdir -p -- "$EXIT_CODES" || fail "could not create ${EXIT_CODES@Q}: pass a LOG in a directory this user can write"
NANOGPT_EXIT_CODES_DIR=$EXIT_CODES

# What each node runs: a fixed text, so that no value is ever read as code. The values reach it as
# exported variables, the settings after this script's name (for train.py) as its arguments. It
# runs in each node's own shell, so that $SLURM_NODEID is that node's: a static node rank, which
# puts rank 0 on the first node (MASTER_ADDR). --auto_resume=True: a first submission starts the
# run, a requeued one continues it. SLURM signals every process of the step: torchrun stops its
# workers, the shell waits for it (trap). A SIGTERM while torchrun itself starts (before it handles
# one) kills it (143): said here, a resumable stop.
# shellcheck disable=SC2016  # expanded by each node's shell, not here
NODE_TASK='
if [[ ! ${SLURM_NODEID:-} =~ ^[0-9]+$ ]]; then
    echo "error: this task of job $SLURM_JOB_ID has no SLURM_NODEID (its node rank):" \
        "start it with srun" >&2
    exit 2
fi
trap : TERM
torchrun --nnodes="$SLURM_NNODES" --nproc_per_node="$NPROC_PER_NODE" \
    --node_rank="$SLURM_NODEID" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
    ${SHUTDOWN:+"$SHUTDOWN"} train.py "$CONFIG" --out_dir="$OUT_DIR" --auto_resume=True "$@"
code=$?
if [ "$code" -eq 143 ]; then
    echo "stopped before train.py started: SIGTERM reached torchrun on node $SLURM_NODEID" \
        "while it was starting; nothing to save (exit code 75)"
    echo 75 >"$NANOGPT_EXIT_CODES_DIR/node-$SLURM_NODEID"
    exit 75
fi
exit "$code"
'
export CONFIG OUT_DIR NPROC_PER_NODE MASTER_ADDR MASTER_PORT SHUTDOWN NANOGPT_EXIT_CODES_DIR
# srun of SLURM 22.05 and later doesn't take --cpus-per-task from the job: each node's workers
# would share one CPU
srun_options=(--kill-on-bad-exit=1)
if [ -n "${SLURM_CPUS_PER_TASK:-}" ]; then
    srun_options+=("--cpus-per-task=$SLURM_CPUS_PER_TASK")
fi

echo "job $SLURM_JOB_ID: $SLURM_NNODES nodes, rank 0 on $MASTER_ADDR (port $MASTER_PORT)," \
    "out_dir ${OUT_DIR@Q}" | tee -a "$LOG"
srun "${srun_options[@]}" bash -c "$NODE_TASK" slurm_train_node "$@" 2>&1 | tee -a "$LOG"
code=${PIPESTATUS[0]}

# A stop that saved, or one before the first iteration (nothing to save), is resumable: every
# worker exits 75 (train.py), or a node's shell does when torchrun was stopped as it started. Their
# codes decide, as each wrote it in EXIT_CODES (torchrun itself exits 1 whatever its workers'
# codes); a worker killed before it could write one has not saved, so no code is no requeue. Any
# other end (done, an error) is the job's end.
resumable=0
if grep -qx -- 75 "$EXIT_CODES"/* 2>/dev/null; then
    resumable=1
fi
rm -rf -- "$EXIT_CODES"
if ((resumable)); then
    echo "the run stopped before its end, resumable; requeueing job $SLURM_JOB_ID to continue it" |
        tee -a "$LOG"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$code"
