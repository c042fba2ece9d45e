"""
scripts/slurm_train.sh (docs/training.md, "Many machines") as sbatch runs it, on 2 nodes of this machine: stand-ins
for srun and scontrol first on PATH, the rest real (torchrun, train.py). A signal goes to every process of a task's
process group, as SLURM's --signal reaches every process of the job's step.
"""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import REPO, TINY_RUN, iter_losses, start_program
from nanogpt_plus.checkpoint import load_checkpoint
from test_many_machines import ENV, free_port

SCRIPT = os.path.join(REPO, 'scripts', 'slurm_train.sh')


FAKE_SRUN = """#!/bin/bash
# srun's stand-in: one task per node, each with its own SLURM_NODEID, all on this machine. Its
# options go to $SRUN_OPTIONS_LOG; each task runs in a process group of its own, its pid in
# $SRUN_PIDS (what a test signals). SRUN_NO_NODEID=1: tasks without SLURM_NODEID;
# SRUN_TRAILER_KB=n: n KB more output after the tasks end (what the other nodes of a large job
# print after rank 0's last line)
options=()
while [[ "$1" == --* ]]; do options+=("$1"); shift; done
echo "${options[*]}" >> "$SRUN_OPTIONS_LOG"
pids=()
for ((i = 0; i < SLURM_NNODES; i++)); do
    if [ -n "${SRUN_NO_NODEID:-}" ]; then
        env -u SLURM_NODEID SLURM_PROCID=$i setsid "$@" &
    else
        SLURM_NODEID=$i SLURM_PROCID=$i setsid "$@" &
    fi
    pids+=($!)
    echo $! >> "$SRUN_PIDS"
done
code=0
for p in "${pids[@]}"; do wait "$p" || code=$?; done
for ((k = 0; k < ${SRUN_TRAILER_KB:-0} * 16; k++)); do
    printf '%063d\\n' "$k"
done
exit $code
"""


FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") echo 127.0.0.1; echo 127.0.0.2 ;;
    requeue*) echo "$2" >> "$REQUEUED" ;;
esac
"""


# torchrun's stand-in, for the tests where it must not start: it only says that it ran
FAKE_TORCHRUN = """#!/bin/bash
echo "$*" >> "$TORCHRUN_RAN"
"""


PORT_LINE = re.compile(r"^job (\d+): 2 nodes, rank 0 on 127\.0\.0\.1 \(port (\d+)\)", re.M)


def slurm_env(tmp_path, dataset, fakes=('srun', 'scontrol'), **values):
    """
    The environment sbatch gives scripts/slurm_train.sh for job 77 on 2 nodes, the stand-ins (fakes)
    first on PATH; CONFIG is a tiny run's config file (every setting in it). values: more variables,
    or None to leave one out.
    """
    bin_dir = tmp_path / 'bin'
    bin_dir.mkdir(exist_ok=True)
    texts = {'srun': FAKE_SRUN, 'scontrol': FAKE_SCONTROL, 'torchrun': FAKE_TORCHRUN}
    for name in fakes:
        (bin_dir / name).write_text(texts[name])
        (bin_dir / name).chmod(0o755)
    config = tmp_path / 'tiny_config.py'
    settings = dict(TINY_RUN, dataset=dataset, num_threads=1)
    config.write_text(''.join(f"{key} = {value!r}\n" for key, value in settings.items()))
    env = dict(ENV, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
               SLURM_NNODES='2', SLURM_JOB_NODELIST='node[1-2]', SLURM_JOB_ID='77',
               CONFIG=str(config), OUT_DIR=str(tmp_path / 'out'), LOG=str(tmp_path / 'job.log'),
               NPROC_PER_NODE='1', MASTER_PORT=str(free_port()), SRUN_PIDS=str(tmp_path / 'pids'),
               SRUN_OPTIONS_LOG=str(tmp_path / 'srun_options'), REQUEUED=str(tmp_path / 'requeued'),
               TORCHRUN_RAN=str(tmp_path / 'torchrun_ran'))
    env.update(values)
    (tmp_path / 'pids').write_text('')
    return {key: value for key, value in env.items() if value is not None}


def slurm_job(tmp_path, dataset, *args, **values):
    """ scripts/slurm_train.sh as SLURM runs it on 2 nodes (a torchrun each), in the background. """
    env = slurm_env(tmp_path, dataset, **values)
    return start_program(['bash', SCRIPT, *args], env=env, start_new_session=True)


def children(pid):
    """ The processes pid started (of any of its threads: torchrun starts its workers from one). """
    found = []
    try:
        for thread in os.listdir(f'/proc/{pid}/task'):
            with open(f'/proc/{pid}/task/{thread}/children') as f:
                found += [int(child) for child in f.read().split()]
    except FileNotFoundError:  # it ended
        pass
    return found


def tasks(tmp_path):
    return [int(pid) for pid in (tmp_path / 'pids').read_text().split()]


def workers(tmp_path):
    """ The train.py processes each node's torchrun started. """
    return [pid for task in tasks(tmp_path) for torchrun in children(task)
            for pid in children(torchrun)]


def catches_sigterm(pid):
    """ Whether pid has a handler of its own for SIGTERM (torchrun once started, train.py). """
    try:
        with open(f'/proc/{pid}/status') as f:
            caught = next(line for line in f if line.startswith('SigCgt:'))
    except FileNotFoundError:
        return False
    return bool(int(caught.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def wait_for(what, timeout=120):
    deadline = time.time() + timeout
    while not what():
        assert time.time() < deadline, f"waited {timeout} s for {what.__doc__}"
        time.sleep(0.02)


def signal_the_step(tmp_path):
    """ SLURM's --signal=TERM: every process of each node's task (torchrun passes it on too). """
    for pid in tasks(tmp_path):
        os.killpg(pid, signal.SIGTERM)


def finish(job, tmp_path, timeout):
    """ The job's output once it ended; a job still running after timeout is killed, all of it. """
    try:
        return job.communicate(timeout=timeout)[0]
    finally:
        if job.poll() is None:
            # the tasks run in process groups of their own, torchrun's workers in sessions
            family = workers(tmp_path)
            for group in [job.pid, *tasks(tmp_path)]:
                os.killpg(group, signal.SIGKILL)
            for pid in family:
                os.kill(pid, signal.SIGKILL)
            job.communicate()


def test_the_slurm_script_signals_every_node_requeues_and_resumes(tiny_dataset, tmp_path):
    # a long run; SLURM's --signal=TERM@120 sends SIGTERM to every task (each node's torchrun)
    job = slurm_job(tmp_path, tiny_dataset, '--max_iters=100000', '--lr_decay_iters=100000',
                    '--eval_interval=100000')
    try:
        deadline = time.time() + 120
        for line in job.stdout:
            if line.startswith('iter 3:') or time.time() > deadline:
                break
        signal_the_step(tmp_path)
    finally:
        out = finish(job, tmp_path, timeout=120)
    assert job.returncode == 0, out[-3000:]
    assert (tmp_path / 'requeued').read_text().split() == ['77']  # the job asked to run again
    assert 'requeueing job 77' in out
    # both nodes had node ranks of their own (with one for both, the agents would never meet)
    stopped = load_checkpoint(str(tmp_path / 'out' / 'ckpt.pt'))['iter_num']
    assert stopped >= 3 and len(load_checkpoint(str(tmp_path / 'out' / 'ckpt.pt'))['rng']) == 2
    # the requeued job: the same command continues the run and finishes it
    job = slurm_job(tmp_path, tiny_dataset, f'--max_iters={stopped + 2}',
                    f'--lr_decay_iters={stopped + 2}', '--eval_interval=100000')
    out = finish(job, tmp_path, timeout=180)
    assert job.returncode == 0, out[-3000:]
    resuming = f"auto_resume=True: {tmp_path / 'out'} holds this run's checkpoint; resuming it"
    assert resuming in out
    assert min(iter_losses(out)) == stopped and f"(final, iter {stopped + 3})" in out
    # no second requeue: the run is done
    assert (tmp_path / 'requeued').read_text().split() == ['77']


def test_paths_holding_code_or_spaces_run_nothing_and_no_argument_is_needed(tiny_dataset, tmp_path):
    # every setting in the config file: `sbatch scripts/slurm_train.sh` with nothing after it
    hostile = tmp_path / 'runs $(touch "$MARKER") `touch "$MARKER"`; touch "$MARKER" a b'
    hostile.mkdir()
    config = hostile / 'tiny config.py'
    slurm_env(tmp_path, tiny_dataset)  # writes the tiny config
    tiny = (tmp_path / 'tiny_config.py').read_text()
    config.write_text(tiny + "max_iters = 3\nlr_decay_iters = 3\n")
    marker = tmp_path / 'ran'
    job = slurm_job(tmp_path, tiny_dataset, CONFIG=str(config), OUT_DIR=str(hostile / 'out dir'),
                    LOG=None, MARKER=str(marker), SLURM_CPUS_PER_TASK='3')
    out = finish(job, tmp_path, timeout=180)
    assert job.returncode == 0, out[-3000:]
    assert not marker.exists()  # no path ran as code
    # the run trained in that very directory, with that config file, and the job's log is beside it
    ckpt = load_checkpoint(str(hostile / 'out dir' / 'ckpt.pt'))
    assert ckpt['iter_num'] == 4 and ckpt['model_args']['n_layer'] == TINY_RUN['n_layer']
    assert "(final, iter 4)" in (hostile / 'out dir.slurm-77.log').read_text()
    assert not (tmp_path / 'requeued').exists()
    # each node's workers get the job's CPUs (srun of SLURM 22.05+ doesn't pass them on by itself)
    assert '--cpus-per-task=3' in (tmp_path / 'srun_options').read_text().split()


def test_a_sigterm_during_set_up_requeues_the_job(tiny_dataset, tmp_path):
    job = slurm_job(tmp_path, tiny_dataset, '--max_iters=100000', '--lr_decay_iters=100000')
    try:
        def workers_handle_sigterm():
            """ both nodes' train.py to catch SIGTERM (its first lines; torch, the model: later) """
            started = workers(tmp_path)
            return len(started) == 2 and all(catches_sigterm(pid) for pid in started)
        wait_for(workers_handle_sigterm)
        signal_the_step(tmp_path)
    finally:
        out = finish(job, tmp_path, timeout=120)
    assert job.returncode == 0, out[-3000:]
    assert "stopped before iter 0: a signal came during set-up" in out
    assert (tmp_path / 'requeued').read_text().split() == ['77'], out[-3000:]
    assert 'requeueing job 77' in out


def test_a_sigterm_while_torchrun_starts_is_said_and_requeued_even_after_a_long_log(tiny_dataset,
                                                                                   tmp_path):
    # 200 KB of log after the nodes' lines (a pipe holds 64 KB): the job is requeued all the same
    job = slurm_job(tmp_path, tiny_dataset, SRUN_TRAILER_KB='200')
    try:
        def torchrun_importing():
            """ both nodes' torchrun started (neither handles SIGTERM yet: it imports torch) """
            return len([pid for task in tasks(tmp_path) for pid in children(task)]) == 2
        wait_for(torchrun_importing)
        signal_the_step(tmp_path)
    finally:
        out = finish(job, tmp_path, timeout=120)
    assert job.returncode == 0, out[-3000:]
    said = [line for line in out.splitlines() if line.startswith('stopped before train.py started')]
    assert sorted(said) == [f"stopped before train.py started: SIGTERM reached torchrun on node "
                            f"{n} while it was starting; nothing to save (exit code 75)"
                            for n in (0, 1)]
    assert (tmp_path / 'requeued').read_text().split() == ['77'], out[-3000:]
    assert out.index('requeueing job 77') - out.index(said[-1]) > 200 * 1024
    assert not (tmp_path / 'out').exists()  # train.py never ran


def port_free_below_ephemeral():
    """ A port from 10000 to 29999 (the script's default ports) that nothing listens on now. """
    while True:
        port = 10000 + int.from_bytes(os.urandom(2), 'little') % 20000
        with socket.socket() as s:
            try:
                s.bind(('127.0.0.1', port))
                return port
            except OSError:
                continue


def test_two_jobs_on_one_node_listen_on_ports_of_their_own(tiny_dataset, tmp_path):
    # MASTER_PORT unset: each job's from its job id, two jobs whose ports are free now
    ports = [port_free_below_ephemeral(), port_free_below_ephemeral()]
    while ports[1] == ports[0]:
        ports[1] = port_free_below_ephemeral()
    ids = [str(port - 10000 + 20000) for port in ports]
    dirs = [tmp_path / f'job{job_id}' for job_id in ids]
    jobs = []
    for job_id, d in zip(ids, dirs):
        d.mkdir()
        jobs.append(slurm_job(d, tiny_dataset, '--max_iters=3', '--lr_decay_iters=3',
                              SLURM_JOB_ID=job_id, MASTER_PORT=None))
    outs = [finish(job, d, timeout=240) for job, d in zip(jobs, dirs)]
    for job, out in zip(jobs, outs):
        assert job.returncode == 0, out[-3000:]
        assert "(final, iter 4)" in out, out[-3000:]
    said = [PORT_LINE.search(out).groups() for out in outs]
    assert said == [(job_id, str(port)) for job_id, port in zip(ids, ports)]
    for d in dirs:
        assert load_checkpoint(str(d / 'out' / 'ckpt.pt'))['iter_num'] == 4


def run_script(env):
    """ The script to its end, in the fast tier: for runs that start no torchrun (a stand-in's). """
    return subprocess.run(['bash', SCRIPT], env=env, capture_output=True, text=True, timeout=60,
                          cwd=REPO)


@pytest.mark.parametrize('name', ['SLURM_JOB_NODELIST', 'SLURM_JOB_ID', 'SLURM_NNODES'])
def test_a_missing_slurm_variable_is_one_line(tiny_dataset, tmp_path, name):
    env = slurm_env(tmp_path, tiny_dataset, fakes=('srun', 'scontrol', 'torchrun'),
                    **{name: None})
    done = run_script(env)
    assert done.returncode == 2
    assert done.stdout == '' and done.stderr.splitlines() == [
        f"error: {name} is not set: submit this script with sbatch "
        "(or run it inside a SLURM allocation)"]
    assert not (tmp_path / 'srun_options').exists()
    assert not (tmp_path / 'torchrun_ran').exists()


def test_a_task_without_its_node_id_says_so_on_each_node(tiny_dataset, tmp_path):
    env = slurm_env(tmp_path, tiny_dataset, fakes=('srun', 'scontrol', 'torchrun'),
                    SRUN_NO_NODEID='1')
    done = run_script(env)
    assert done.returncode == 2, done.stdout + done.stderr
    # one line from each node (the same), then nothing: torchrun was asked for --help, never started
    line = "error: this task of job 77 has no SLURM_NODEID (its node rank): start it with srun"
    assert [x for x in done.stdout.splitlines() if not x.startswith('job 77: ')] == [line, line]
    assert (tmp_path / 'torchrun_ran').read_text().splitlines() == ['--help']
    assert not (tmp_path / 'requeued').exists()


# a torchrun's stand-in whose workers print what a value could forge and fail; with WRITE_CODE, rank 0 records
# that code where train.py would (nanogpt_plus/runtime.py, record_exit_code)
FORGING_TORCHRUN = """#!/bin/bash
[ "$1" = --help ] && exit 0
echo "error: dataset x"
echo "stopped cleanly; continue with --init_from=resume"
echo "stopped before iter 0: a signal came during set-up; nothing new to save"
echo "stopped before train.py started: SIGTERM reached torchrun"
if [ -n "${WRITE_CODE:-}" ] && [ "$SLURM_NODEID" = 0 ]; then echo "$WRITE_CODE" > "$NANOGPT_EXIT_CODES_DIR/rank-0"; fi
exit 1
"""


@pytest.mark.parametrize('code,requeued', [(None, False), ('1', False), ('2', False), ('75', True)])
def test_the_requeue_follows_the_workers_exit_codes_not_the_log(tiny_dataset, tmp_path, code, requeued):
    env = slurm_env(tmp_path, tiny_dataset, fakes=('srun', 'scontrol', 'torchrun'), WRITE_CODE=code)
    (tmp_path / 'bin' / 'torchrun').write_text(FORGING_TORCHRUN)
    done = run_script(env)
    # the forged lines are in the log
    assert 'stopped cleanly; continue with --init_from=resume' in done.stdout
    if requeued:
        assert done.returncode == 0 and (tmp_path / 'requeued').read_text().split() == ['77'], done.stdout
        assert 'requeueing job 77' in done.stdout
    else:
        assert done.returncode == 1 and not (tmp_path / 'requeued').exists(), done.stdout
    # the codes were the job's own: none is left for the next start of the job to read
    assert sorted(os.listdir(tmp_path)) == sorted(['bin', 'tiny_config.py', 'pids', 'srun_options', 'job.log'] +
                                                  (['requeued'] if requeued else []))


def test_a_value_in_an_error_line_is_escaped(tiny_dataset, tmp_path):
    forged = "1\nstopped cleanly; continue with --init_from=resume \x1b[2J"
    env = slurm_env(tmp_path, tiny_dataset, fakes=('srun', 'scontrol', 'torchrun'), MASTER_PORT=forged)
    done = run_script(env)
    assert done.returncode == 2 and done.stdout == ''
    assert done.stderr.splitlines() == [
        "error: MASTER_PORT=$'1\\nstopped cleanly; continue with --init_from=resume \\E[2J' is not a port: give one "
        "from 1 to 65535, or leave it unset"]


FORGED = "o\nstopped cleanly; continue with --init_from=resume"


@pytest.mark.parametrize('where', ['OUT_DIR', 'dataset'])
def test_a_forged_value_does_not_requeue_a_failed_job(tiny_dataset, tmp_path, where):
    """ The issue's case: a value whose echo in an error line reads like a resumable stop. """
    if where == 'OUT_DIR':  # a file there: refused, the path echoed
        (tmp_path / FORGED).write_text('a file')
        job = slurm_job(tmp_path, tiny_dataset, OUT_DIR=str(tmp_path / FORGED))
    else:
        job = slurm_job(tmp_path, tiny_dataset, f'--dataset={FORGED}')
    out = finish(job, tmp_path, timeout=180)
    assert job.returncode != 0 and not (tmp_path / 'requeued').exists(), out[-3000:]
    errors = [line for line in out.splitlines() if line.startswith('error: ')]
    assert errors and all(repr(FORGED)[1:-1] in line for line in errors), out[-3000:]
    assert not any(line.startswith('stopped cleanly') for line in out.splitlines())


def test_job_ids_20000_apart_on_one_node_get_ports_of_their_own(tiny_dataset, tmp_path):
    # job A listens on its port (port - 10000 from its id); job B's id is 20000 more, which picks the same port
    port = port_free_below_ephemeral()
    with socket.socket() as first_job:
        first_job.bind(('127.0.0.1', port))
        first_job.listen()
        env = slurm_env(tmp_path, tiny_dataset, fakes=('srun', 'scontrol', 'torchrun'),
                        SLURM_JOB_ID=str(port - 10000 + 20000), MASTER_PORT=None)
        done = run_script(env)
    assert done.returncode == 0, done.stdout + done.stderr
    job_id, chosen = PORT_LINE.search(done.stdout).groups()
    # the next port nothing listens on: another than the first job's
    assert int(chosen) != port and 10000 <= int(chosen) < 30000, chosen
    ran = (tmp_path / 'torchrun_ran').read_text().splitlines()
    assert [line for line in ran if line != '--help'] == [
        line for line in ran if f'--master_port={chosen} ' in line]
    assert len(ran) == 3  # --help, then a torchrun on each node


def test_a_job_id_picks_its_port_when_free(tiny_dataset, tmp_path):
    port = port_free_below_ephemeral()
    env = slurm_env(tmp_path, tiny_dataset, fakes=('srun', 'scontrol', 'torchrun'),
                    SLURM_JOB_ID=str(port - 10000 + 40000), MASTER_PORT=None)
    done = run_script(env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert PORT_LINE.search(done.stdout).groups() == (str(port - 10000 + 40000), str(port))
