"""
Many machines (a topic across rooms: the many-node verdicts): two torchrun agents as two nodes, each running in its
own copy of the repository (no shared disk), and 2 gloo ranks on one node where one rank meets something the other
doesn't. Every run ends on every node within a minute, finished or with one clear line; none hangs. What fails on
one node before the process group forms (a config file, a refused setting, an output path), a failure rank 0 (or any
one rank) meets alone mid-run, and what every node must start from alike (the data's tokens and tokenizer, the
code's uncommitted changes, eval.py's and finetune.py's checkpoint and files, a checkpoint one node lacks or has
older), compared content included.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
import torch

from helpers import (
    REPO,
    SPACED_SYMBOLS,
    TINY_VOCAB,
    TORCHRUN,
    git,
    iter_losses,
    project_frames,
    run_python,
    start_python,
    train_args,
    write_hellaswag,
)
from nanogpt_plus.checkpoint import load_checkpoint

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


# the tiny dataset's tokens as characters, a space among them (HellaSwag needs it)
SYMBOLS = SPACED_SYMBOLS


def free_port():
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def node_copy(dst, dataset):
    """ A working copy of the repository for one node (what a node's own disk holds), with the dataset in it. """
    dst.mkdir(parents=True)
    for name in ('train.py', 'finetune.py', 'eval.py', 'model.py', 'configurator.py'):
        shutil.copy(os.path.join(REPO, name), dst / name)
    shutil.copytree(os.path.join(REPO, 'nanogpt_plus'), dst / 'nanogpt_plus',
                    ignore=shutil.ignore_patterns('__pycache__'))
    shutil.copytree(dataset, dst / 'data' / 'tiny')
    stoi = {ch: i for i, ch in enumerate(SYMBOLS)}
    (dst / 'data' / 'tiny' / 'meta.json').write_text(json.dumps(
        {"kind": "char", "vocab_size": TINY_VOCAB, "stoi": stoi, "itos": {i: c for c, i in stoi.items()}}))
    return dst


def two_nodes(copies, args, timeout=60, script='train.py', node_args=None, meanwhile=None, node_env=None):
    """
    script under two torchrun agents (--nnodes=2, one process each), each in its own copy; both must end.
    node_args: per node, arguments after args (what differs between the nodes' command lines). meanwhile(procs):
    what the test does while they run (it may read their stdout). node_env: per node, more environment variables.
    """
    port = free_port()
    node_args = node_args or [[], []]
    node_env = node_env or [{}, {}]
    procs = [start_python(TORCHRUN + ['--nnodes=2', '--nproc_per_node=1', f'--node_rank={i}',
                                      '--master_addr=127.0.0.1', f'--master_port={port}', script, *args,
                                      *node_args[i]], cwd=copy, env=dict(ENV, **node_env[i]),
                          start_new_session=True)
             for i, copy in enumerate(copies)]
    began = time.time()
    results = []
    try:
        if meanwhile is not None:
            meanwhile(procs)
        for p in procs:
            out, err = p.communicate(timeout=max(1, timeout - (time.time() - began)))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                # its workers too: a hang must not outlive the test
                os.killpg(p.pid, signal.SIGKILL)
                p.communicate()
    assert len(results) == 2, f"a node was still running after {timeout} s"
    return results


def tiny(out_dir, **settings):
    return train_args('data/tiny', out_dir, num_threads=1, **settings)


# how another node's line begins when rank 0 alone read or wrote what failed (process_group.master_decides)
RANK_0_SAID = "on node 0 (rank 0, whose files these are): "


def assert_one_line_on_each_node(results, *words, code=2):
    """
    Both nodes ended with the same exit code and each printed the same one `error:` line, holding words
    (node 1's naming node 0 first where rank 0 alone read or wrote what failed).
    """
    assert all(r.returncode != 0 for r in results), [r.returncode for r in results]
    lines = [[line for line in r.stderr.splitlines() if line.startswith('error: ')] for r in results]
    assert [len(node) for node in lines] == [1, 1], (lines, results[0].stderr[-2000:], results[1].stderr[-2000:])
    assert lines[0] == [lines[1][0].replace(RANK_0_SAID, '')], lines
    for w in words:
        assert w in lines[0][0], lines[0][0]


# -----------------------------------------------------------------------------
# two nodes without a shared disk

def test_hellaswag_file_on_one_node_only_is_scored_on_both(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    # the default path, on node 0 only
    write_hellaswag(nodes[0] / 'data' / 'hellaswag' / 'hellaswag_val.jsonl')
    results = two_nodes(nodes, tiny('out', max_iters=4, eval_interval=4, hellaswag_interval=2))
    assert [r.returncode for r in results] == [0, 0], results[0].stderr[-2000:] + results[1].stderr[-2000:]
    assert "hellaswag 2: acc_norm" in results[0].stdout and "hellaswag 4: acc_norm" in results[0].stdout


def test_resume_with_out_dir_on_one_node_only_is_one_line_on_both(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    first = run_python(['train.py', *tiny('out', max_iters=3)], cwd=nodes[0], env=ENV, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    results = two_nodes(nodes, tiny('out', max_iters=6, init_from='resume'))
    assert all(r.returncode != 0 for r in results)
    assert_one_line_on_each_node(results, "there is no checkpoint at out/ckpt.pt",
                                 "every node must have the same files at the same paths")
    # no worker traceback (torchrun's own launcher prints one of its ChildFailedError: frames of its files only)
    assert not any(project_frames(r.stderr, node) for node, r in zip(nodes, results)), results[1].stderr[-3000:]


# -----------------------------------------------------------------------------
# 2 gloo ranks on one node: what one rank meets, every rank stops for

TWO_RANKS = TORCHRUN + ['--standalone', '--nproc_per_node=2']


def launch(script, args, timeout=90, env=None, cwd=REPO):
    return run_python(TWO_RANKS + [script, *args], cwd=cwd, timeout=timeout, env=dict(ENV, **(env or {})))


def test_a_bad_token_id_met_by_one_rank_stops_every_rank_with_one_line(tiny_dataset, tmp_path):
    d = tmp_path / 'data'
    shutil.copytree(tiny_dataset, d)
    tokens = np.fromfile(d / 'train.bin', dtype=np.uint16)
    # sequential order, batch 4 x 16: micro-batch k reads tokens [64k, 64k + 65) and goes to rank k % 2; the
    # batches of iteration i+1 are fetched during iteration i. Put an id the model has no embedding for where only
    # micro-batch 5 reads it: rank 1's, fetched during iteration 1
    tokens[5 * 64 + 10] = TINY_VOCAB + 3
    tokens.tofile(d / 'train.bin')
    # the per-batch check (splits over 64M tokens) instead of the start-up scan of the whole file
    r = launch('train.py', train_args(str(d), tmp_path / 'out', data_order='sequential', num_threads=1,
                                      eval_interval=100),
               env={'NANOGPT_PLUS_SCAN_TOKENS': '0'})
    assert r.returncode != 0
    errors = [line for line in r.stderr.splitlines() if line.startswith('error: ')]
    assert len(errors) == 1 and f"holds token ids up to {TINY_VOCAB + 3}" in errors[0], r.stderr[-3000:]
    # both stopped at the agreement, together
    assert 'another process of this run is gone' not in r.stderr
    # iteration 1 fetched the bad batch and finished; no step used it
    assert max(iter_losses(r.stdout)) == 1


def test_finetune_rank0_cannot_write_stops_every_rank_with_one_line(tmp_path):
    from helpers import make_source, make_task
    src = make_source(tmp_path / 'src')
    train_file, val_file = make_task(tmp_path, 'classification', n_train=32, n_val=8)
    # a directory where rank 0 must write the file
    (tmp_path / 'ft' / 'ckpt_last.pt').mkdir(parents=True)
    began = time.time()
    r = launch('finetune.py', ['--task=classification', f'--init_from={src}', f'--train_file={train_file}',
                               f'--val_file={val_file}', f'--out_dir={tmp_path / "ft"}', '--device=cpu',
                               '--batch_size=8', '--gradient_accumulation_steps=2', '--epochs=1'], timeout=60)
    assert time.time() - began < 45 and r.returncode != 0
    # refused when rank 0 claims the out_dir, before any step, and said once (test_distributed's
    # train.py test makes the save itself fail mid-run)
    # (lines that start with it: torchrun's summary repeats it as each rank's "traceback")
    said = [line for line in r.stderr.splitlines() if line.startswith('error: ')]
    assert len(said) == 1 and "ckpt_last.pt is not a file (a directory or another kind of file" in said[0], \
        r.stderr[-3000:]
    # no worker traceback (torchrun's own is no frame of ours)
    assert not project_frames(r.stderr), r.stderr[-3000:]


def test_sigterm_during_in_loop_hellaswag_stops_between_batches(tiny_dataset, tmp_path):
    data = node_copy(tmp_path / 'node', tiny_dataset) / 'data' / 'tiny'
    # a pass of a minute or more on these cores
    hs = write_hellaswag(tmp_path / 'hs.jsonl', n=20000)
    proc = start_python(TWO_RANKS + ['train.py', *train_args(str(data), tmp_path / 'out', num_threads=1,
                                                             hellaswag_interval=5, hellaswag_file=str(hs),
                                                             batch_size=2)],
                        env=ENV, start_new_session=True)
    try:
        # the pass at iteration 0 begins right after set-up: signal it once both ranks are in it
        deadline = time.time() + 90
        for line in proc.stdout:
            if line.startswith('provenance: ') or time.time() > deadline:  # the end of set-up
                break
        time.sleep(3)
        signalled = time.time()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        took = time.time() - signalled
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert took < 20, f"the ranks took {took:.0f} s to stop after SIGTERM"
    assert 'stopped cleanly' in out and 'hellaswag 0: acc_norm' not in out, err[-2000:]
    # the state before iteration 0
    assert load_checkpoint(str(tmp_path / 'out' / 'ckpt.pt'))['iter_num'] == 0


def test_resuming_on_more_ranks_gives_the_new_ranks_their_own_rng(dataset, tmp_path):
    out = tmp_path / 'out'
    one = run_python(['train.py', *train_args(dataset, out, max_iters=2, dropout=0.1,
                                                                   num_threads=1)], env=ENV, timeout=120)
    assert one.returncode == 0, one.stderr[-2000:]
    assert len(load_checkpoint(str(out / 'ckpt.pt'))['rng']) == 1
    two = launch('train.py', train_args(dataset, out, max_iters=4, dropout=0.1, num_threads=1, init_from='resume'))
    assert two.returncode == 0, two.stderr[-3000:]
    assert "ranks 1 and up got their own, drawn from rank 0's" in two.stdout
    rng = load_checkpoint(str(out / 'ckpt.pt'))['rng']
    # distinct dropout streams
    assert len(rng) == 2 and not torch.equal(rng[0]['torch'], rng[1]['torch'])


# -----------------------------------------------------------------------------
# every node runs the same run or none does (issue 33)

def test_a_stale_checkpoint_on_one_node_is_refused_on_both(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    first = run_python(['train.py', *tiny('out', max_iters=3)], cwd=nodes[0], env=ENV, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    # the docs' advice once (ckpt.pt copied to every node's out_dir), then node 0's run went on alone
    shutil.copytree(nodes[0] / 'out', nodes[1] / 'out')
    more = run_python(['train.py', *tiny('out', max_iters=5, init_from='resume')], cwd=nodes[0], env=ENV,
                      timeout=120)
    assert more.returncode == 0, more.stderr[-2000:]
    began = time.time()
    results = two_nodes(nodes, tiny('out', max_iters=8, init_from='resume'))
    assert time.time() - began < 60
    assert_one_line_on_each_node(results, "differ in checkpoint: out/ckpt.pt is at iter 6 on node 0 (",
                                 "iter 4 on node 1 (", "newer one: copy it over out/ckpt.pt on node 1")
    # nothing trained, node 0's checkpoint unchanged
    assert not iter_losses(results[0].stdout) and load_checkpoint(str(nodes[0] / 'out' / 'ckpt.pt'))['iter_num'] == 6


def test_settings_that_differ_between_nodes_are_refused_on_both(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    results = two_nodes(nodes, tiny('out'), node_args=[['--max_iters=6'], ['--max_iters=3']])
    assert_one_line_on_each_node(results, "the ranks differ in settings: max_iters=6 on rank 0 on",
                                 "but 3 on rank 1 on", "start every node with the same command line")
    assert not (nodes[0] / 'out' / 'ckpt.pt').exists()


def test_a_token_file_that_differs_on_one_node_is_refused_on_both(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    train_bin = nodes[1] / 'data' / 'tiny' / 'train.bin'
    np.fromfile(train_bin, dtype=np.uint16)[:30000].tofile(train_bin)  # valid, but cut short
    results = two_nodes(nodes, tiny('out', max_iters=2))
    assert_one_line_on_each_node(results, "the ranks differ in dataset: train=[54000] on rank 0 on",
                                 "but [30000] on rank 1 on", "give every node the same copy of the dataset")


def test_a_token_file_that_differs_only_in_its_middle_is_refused_on_both(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    # one valid token changed in the middle of node 1's train.bin: same size, same first and last 256 KiB (all
    # the digest compared before; the run trained silently different)
    train_bin = nodes[1] / 'data' / 'tiny' / 'train.bin'
    tokens = np.fromfile(train_bin, dtype=np.uint16)
    tokens[tokens.size // 2] = (tokens[tokens.size // 2] + 1) % TINY_VOCAB
    tokens.tofile(train_bin)
    assert_one_line_on_each_node(two_nodes(nodes, tiny('out', max_iters=2)), "the ranks differ in tokens: train.bin=",
                                 "rank 1 on", "give every node the same copy of each file")
    assert not (nodes[0] / 'out' / 'ckpt.pt').exists()


def test_a_bad_token_id_in_a_small_split_of_one_node_is_one_verdict(tiny_dataset, tmp_path):
    from nanogpt_plus.files import sampled_digest
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    # a train.bin of 18 MB on both nodes (under the 64M tokens scanned whole at set-up, over the 16 MiB the digest
    # reads whole), node 1's with a bad id between two of the digest's sampled blocks: only the scan at set-up
    # finds it
    tokens = np.tile(np.fromfile(nodes[0] / 'data' / 'tiny' / 'train.bin', dtype=np.uint16), 167)
    for node in nodes:
        tokens.tofile(node / 'data' / 'tiny' / 'train.bin')
    size, block = tokens.nbytes, 1 << 14
    # past block 127's end, before block 128
    between = round(127 * (size - block) / 255) + block + 1000
    tokens[between // 2] = TINY_VOCAB + 7
    tokens.tofile(nodes[1] / 'data' / 'tiny' / 'train.bin')
    assert sampled_digest(nodes[0] / 'data' / 'tiny' / 'train.bin') == \
        sampled_digest(nodes[1] / 'data' / 'tiny' / 'train.bin')
    results = two_nodes(nodes, tiny('out', max_iters=2))
    assert_one_line_on_each_node(results, f"holds token ids up to {TINY_VOCAB + 7}", "[rank 1 on",
                                 "every node must have the same files at the same paths")


def test_finetune_inputs_missing_on_one_node_are_one_verdict(tmp_path):
    from helpers import make_source, make_task
    nodes = [node_copy(tmp_path / f'node{i}', os.path.join(REPO, 'tests')) for i in range(2)]
    for node in nodes:
        make_source(node / 'src')
    train_file, val_file = make_task(nodes[0], 'classification', n_train=16, n_val=8)
    common = ['--task=classification', '--init_from=src', f'--val_file={os.path.basename(val_file)}',
              '--device=cpu', '--batch_size=8', '--epochs=1', '--out_dir=ft']
    # the training file on node 0 only
    results = two_nodes(nodes, common + [f'--train_file={os.path.basename(train_file)}'], script='finetune.py')
    assert_one_line_on_each_node(results, "--train_file=classification_train.jsonl: there is no file at that path "
                                          "on this machine", "[rank 1 on")
    # the model on node 0 only: not "don't know how to load"
    shutil.rmtree(nodes[1] / 'src')
    shutil.copy(train_file, nodes[1])
    shutil.copy(val_file, nodes[1])
    results = two_nodes(nodes, common + [f'--train_file={os.path.basename(train_file)}'], script='finetune.py')
    assert_one_line_on_each_node(results, "init_from=src: there is nothing at that path on this machine")


def test_finetune_predictions_under_torchrun_are_rank_0s(tmp_path):
    from helpers import make_source, make_task
    nodes = [node_copy(tmp_path / f'node{i}', os.path.join(REPO, 'tests')) for i in range(2)]
    for node in nodes:
        make_source(node / 'src')
    train_file, val_file = make_task(nodes[0], 'classification', n_train=16, n_val=8)
    fine = run_python(['finetune.py', '--task=classification', '--init_from=src', f'--train_file={train_file}',
                       f'--val_file={val_file}', '--device=cpu', '--batch_size=8', '--epochs=1', '--out_dir=ft'],
                      cwd=nodes[0], env=ENV, timeout=120)
    assert fine.returncode == 0, fine.stderr[-2000:]
    shutil.copytree(nodes[0] / 'ft', nodes[1] / 'ft')
    predict = ['--init_from=ft', f'--predict_file={os.path.basename(val_file)}', '--device=cpu']
    # the file to predict on node 0 only: one verdict, at once (no wait in torchrun's exit barrier)
    began = time.time()
    results = two_nodes(nodes, predict, script='finetune.py')
    assert time.time() - began < 45
    assert_one_line_on_each_node(results, "--predict_file=classification_val.jsonl: there is no file")
    shutil.copy(val_file, nodes[1])
    results = two_nodes(nodes, predict, script='finetune.py')
    assert [r.returncode for r in results] == [0, 0], results[1].stderr[-2000:]
    # rank 0 alone
    assert "wrote 8 predictions" in results[0].stdout and "wrote" not in results[1].stdout


def test_eval_inputs_on_one_node_only_are_one_verdict(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    first = run_python(['train.py', *tiny('out', max_iters=2)], cwd=nodes[0], env=ENV, timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    evaluate = ['--init_from=resume', '--out_dir=out', '--device=cpu', '--max_examples=2']
    results = two_nodes(nodes, evaluate, script='eval.py')  # the checkpoint on node 0 only
    assert_one_line_on_each_node(results, "no checkpoint at out/ckpt.pt", "[rank 1 on")
    shutil.copytree(nodes[0] / 'out', nodes[1] / 'out')
    # a HellaSwag file on node 0 only (the default one, downloaded by every node that lacks it, is found or
    # fetched in the same verdict)
    write_hellaswag(nodes[0] / 'hs.jsonl')
    results = two_nodes(nodes, evaluate + ['--task=hellaswag', '--data_file=hs.jsonl'], script='eval.py')
    assert_one_line_on_each_node(results, "no data file at hs.jsonl", "[rank 1 on")


# torchrun's report of a failed worker: "  exitcode  : 2 (pid: ...)"
WORKER_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.M)


def nodes_with_sample(tmp_path, dataset):
    """ Two node copies (node_copy) that hold sample.py too. """
    nodes = [node_copy(tmp_path / f'node{i}', dataset) for i in range(2)]
    for node in nodes:
        shutil.copy(f'{REPO}/sample.py', node / 'sample.py')
    return nodes


def ended_alike(nodes, args, *words, script='train.py', code=2, meanwhile=None, **per_node):
    """
    script on both nodes: both end within a minute, each with one `error:` line holding words, and
    every worker of both nodes with exit code `code` (torchrun's report of each failed worker).
    per_node: two_nodes' node_args, node_env. Returns the results.
    """
    began = time.time()
    results = two_nodes(nodes, args, script=script, meanwhile=meanwhile, **per_node)
    assert time.time() - began < 60, f"the nodes took {time.time() - began:.0f} s"
    assert_one_line_on_each_node(results, *words)
    codes = [WORKER_EXIT.findall(r.stderr) for r in results]
    assert codes == [[str(code)], [str(code)]], (codes, *(r.stderr[-2000:] for r in results))
    return results


def trained(nodes, copy=True):
    """ A tiny run's checkpoint in node 0's out/ (and node 1's, a copy, where copy). """
    first = run_python(['train.py', *tiny('out', max_iters=2)], cwd=nodes[0], env=ENV,
                       timeout=120)
    assert first.returncode == 0, first.stderr[-2000:]
    if copy:
        shutil.copytree(nodes[0] / 'out', nodes[1] / 'out')


# -----------------------------------------------------------------------------
# what fails before the process group forms: the group is formed all the same, then one verdict

SCRIPT_ARGS = {
    'train.py': tiny('out', max_iters=2),
    'eval.py': ['--init_from=resume', '--out_dir=out', '--device=cpu'],
    'sample.py': ['--init_from=resume', '--out_dir=out', '--device=cpu', '--max_new_tokens=4'],
    'finetune.py': ['--task=classification', '--init_from=src', '--train_file=t.jsonl',
                    '--device=cpu'],
}


@pytest.mark.slow
@pytest.mark.parametrize('script', list(SCRIPT_ARGS))
def test_a_config_file_on_one_node_only_is_one_verdict(tiny_dataset, tmp_path, script):
    nodes = nodes_with_sample(tmp_path, tiny_dataset)
    (nodes[0] / 'config').mkdir()
    (nodes[0] / 'config' / 'x.py').write_text("seed = 1337\n")
    # node 1 can't read its settings: its group is formed from the command line's device
    ended_alike(nodes, ['config/x.py', *SCRIPT_ARGS[script]], "config file config/x.py not found",
                "[rank 1 on", script=script)


@pytest.mark.slow
def test_a_config_file_every_rank_lacks_is_said_once_per_node(tmp_path):
    # 2 processes on one node, which both fail the same check: one line, both exit 2
    r = launch('train.py', [str(tmp_path / 'missing.py'), '--device=cpu'], timeout=60)
    said = [line for line in r.stderr.splitlines() if line.startswith('error: ')]
    assert len(said) == 1 and said[0].startswith("error: config file"), r.stderr[-3000:]
    assert WORKER_EXIT.findall(r.stderr) == ['2', '2'], r.stderr[-3000:]


@pytest.mark.slow
def test_a_setting_one_node_refuses_is_one_verdict(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    # the same config file's name, another content on node 1
    for node, beta2 in zip(nodes, (0.99, 1.5)):
        (node / 'config').mkdir()
        (node / 'config' / 'x.py').write_text(f"beta2 = {beta2}\n")
    ended_alike(nodes, ['config/x.py', *tiny('out', max_iters=2)], "beta2 must be",
                "[rank 1 on")
    assert not (nodes[0] / 'out').exists()


@pytest.mark.slow
def test_eval_output_file_is_checked_by_rank_0_which_writes_it(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    trained(nodes)
    evaluate = ['--init_from=resume', '--out_dir=out', '--device=cpu', '--max_examples=2',
                '--output_file=res/eval.json']
    # a file where rank 0's output directory would be: refused before the model is read, on both
    (nodes[0] / 'res').write_text("not a directory\n")
    ended_alike(nodes, evaluate, "--output_file=res/eval.json is inside", "which is a file",
                script='eval.py')
    # the same on node 1 only: rank 0 writes the file, node 1's disk is no matter
    (nodes[0] / 'res').unlink()
    (nodes[1] / 'res').write_text("not a directory\n")
    results = two_nodes(nodes, evaluate, script='eval.py')
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    assert '"task": "loss"' in (nodes[0] / 'res' / 'eval.json').read_text()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="a node without CUDA: this machine has it")
@pytest.mark.parametrize('refused, words', [
    ('--device=cuda', "device 'cuda' was asked for but CUDA is not available"),
    ('--backend=nccl', "--backend=nccl needs CUDA, and this node's device is cpu"),
])
def test_a_node_whose_device_or_backend_fails_still_joins_and_ends_every_node(tiny_dataset, tmp_path, refused,
                                                                              words):
    # the real-world case: one node whose driver is broken. It joins with gloo on the CPU and says why, instead
    # of raising before joining while node 0 waits in init_process_group
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    results = ended_alike(nodes, tiny('out', max_iters=2), words, "[rank 1 on", node_args=[[], [refused]])
    # no file is the matter: the line doesn't send the user looking for one
    assert "same files" not in results[0].stderr
    assert not (nodes[0] / 'out').exists()


@pytest.mark.slow
def test_a_worker_that_dies_before_joining_ends_the_other_node_in_one_line(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    # node 1's worker is killed in its first moments, before train.py can handle a signal (the issue's SIGTERM
    # 0.1 s in, or kill -9): it never joins the process group
    (nodes[1] / 'train.py').write_text("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n")
    began = time.time()
    results = two_nodes(nodes, tiny('out', max_iters=2, join_timeout=10))
    assert time.time() - began < 90
    # torchrun's agents both exit 1 (its code for any failed worker); node 0's worker with the one line
    assert [r.returncode for r in results] == [1, 1]
    said = [line for line in results[0].stderr.splitlines() if line.startswith('error: ')]
    assert said == ["error: node 1 never joined the process group (rank 1, waited 10 s): its process ended or "
                    "stalled before joining; see node 1's log (torchrun's summary there says how its worker "
                    "ended), then start the run again on every node (--join_timeout=S waits longer for a node "
                    "that is slow to start)"], results[0].stderr[-3000:]
    assert WORKER_EXIT.findall(results[0].stderr) == ['2']
    # node 1's log: torchrun's own summary of its worker's end (nothing of ours ran there)
    assert WORKER_EXIT.findall(results[1].stderr) == ['-9'], results[1].stderr[-2000:]


@pytest.mark.slow
@pytest.mark.parametrize('value, what', [('989 TFLOPS', 'a number of FLOP/s above 0'),
                                         ('0', 'a number of FLOP/s above 0')])
def test_a_bad_environment_variable_on_one_node_is_one_verdict(tiny_dataset, tmp_path, value, what):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    results = ended_alike(nodes, tiny('out', max_iters=2),
                          f"the environment variable NANOGPT_PEAK_FLOPS='{value}' is not {what}", "[rank 1 on",
                          node_env=[{}, {'NANOGPT_PEAK_FLOPS': value}])
    assert "same files" not in results[0].stderr
    assert not (nodes[0] / 'out').exists()


# -----------------------------------------------------------------------------
# sample.py: one verdict on what each rank reads

@pytest.mark.slow
def test_sample_with_the_checkpoint_on_one_node_only_is_one_verdict(tiny_dataset, tmp_path):
    nodes = nodes_with_sample(tmp_path, tiny_dataset)
    trained(nodes, copy=False)
    # the prompts in config files: torchrun takes a --start=... for its own --start_method
    for node in nodes:
        (node / 'config').mkdir()
        (node / 'config' / 'abc.py').write_text("start = 'abc'\n")
        (node / 'config' / 'file.py').write_text("start = 'FILE:prompt.txt'\n")
    sample = ['config/abc.py', *SCRIPT_ARGS['sample.py']]
    ended_alike(nodes, sample, "no checkpoint at out/ckpt.pt", "[rank 1 on", script='sample.py')
    # a prompt file on node 0 only: the same
    shutil.copytree(nodes[0] / 'out', nodes[1] / 'out')
    (nodes[0] / 'prompt.txt').write_text("abc")
    ended_alike(nodes, ['config/file.py', *SCRIPT_ARGS['sample.py']],
                "start=FILE:prompt.txt: no such file", "[rank 1 on", script='sample.py')
    # everything on both nodes: each samples
    results = two_nodes(nodes, sample, script='sample.py')
    assert [r.returncode for r in results] == [0, 0], [r.stderr[-2000:] for r in results]
    # nanoGPT's 10 samples each (the same seed on every rank)
    samples = [len(re.findall(r'^abc', r.stdout, re.M)) for r in results]
    assert samples == [10, 10], [r.stdout for r in results]


@pytest.mark.slow
def test_sample_with_another_runs_checkpoint_on_one_node_is_refused_on_both(tiny_dataset, tmp_path):
    nodes = nodes_with_sample(tmp_path, tiny_dataset)
    trained(nodes)
    # node 1's ckpt.pt: another run's, of the same settings and another seed
    other = run_python(['train.py', *tiny('other', max_iters=2, seed=7)], cwd=nodes[1], env=ENV, timeout=120)
    assert other.returncode == 0, other.stderr[-2000:]
    shutil.copy(nodes[1] / 'other' / 'ckpt.pt', nodes[1] / 'out' / 'ckpt.pt')
    for node in nodes:
        (node / 'config').mkdir()
        (node / 'config' / 'abc.py').write_text("start = 'abc'\n")
    ended_alike(nodes, ['config/abc.py', *SCRIPT_ARGS['sample.py']], "the ranks differ in checkpoint",
                script='sample.py')
    # the same checkpoint, but a prompt file that differs
    shutil.copy(nodes[0] / 'out' / 'ckpt.pt', nodes[1] / 'out' / 'ckpt.pt')
    for node, prompt in zip(nodes, ('abc', 'cba')):
        (node / 'prompt.txt').write_text(prompt)
        (node / 'config' / 'file.py').write_text("start = 'FILE:prompt.txt'\n")
    ended_alike(nodes, ['config/file.py', *SCRIPT_ARGS['sample.py']], "the ranks differ in data",
                "prompt file", script='sample.py')


def workers_of(proc, timeout=60):
    """ The worker processes proc (a torchrun agent) started, once it has one. """
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = []
        for thread in os.listdir(f'/proc/{proc.pid}/task'):
            try:
                with open(f'/proc/{proc.pid}/task/{thread}/children') as f:
                    found += [int(pid) for pid in f.read().split()]
            except FileNotFoundError:
                pass
        if found:
            return found
        time.sleep(0.2)
    raise AssertionError("torchrun started no worker")


def signal_node_1_once(started, delay, sig=signal.SIGTERM, agent=False, stream='stdout'):
    """
    meanwhile for two_nodes: once node 0's stream has a line starting with `started` (both nodes are then in
    the work), wait delay seconds and send sig to node 1's worker (or, agent=True, to its torchrun agent).
    """
    def act(procs):
        worker = workers_of(procs[1])[0]
        deadline = time.time() + 90
        for line in getattr(procs[0], stream):
            if line.startswith(started) or time.time() > deadline:
                break
        time.sleep(delay)
        os.kill(procs[1].pid if agent else worker, sig)
    return act


def stopped_together(results, code):
    """ Both nodes' workers ended with code, each node's log with the line of where the signal came. """
    codes = [WORKER_EXIT.findall(r.stderr) for r in results]
    assert codes == [[str(code)], [str(code)]], (codes, *(r.stderr[-3000:] for r in results))
    for r in results:
        assert "stopped by SIGTERM (received by rank 1 (node 1); every process of the run stopped with it)" \
            in r.stderr, r.stderr[-3000:]


@pytest.mark.slow
def test_sigterm_to_one_node_during_eval_stops_both_between_batches(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    trained(nodes)
    # a loss evaluation of minutes: 50 times the val split, a window per batch
    for node in nodes:
        val = np.fromfile(node / 'data' / 'tiny' / 'val.bin', dtype=np.uint16)
        np.tile(val, 50).tofile(node / 'data' / 'tiny' / 'val.bin')
    began = time.time()
    results = two_nodes(nodes, ['--init_from=resume', '--out_dir=out', '--device=cpu', '--batch_size=1',
                                '--num_threads=1', '--dataset=data/tiny'], script='eval.py', timeout=90,
                        meanwhile=signal_node_1_once('provenance', 5))
    assert time.time() - began < 90
    stopped_together(results, 130)
    assert [r.returncode for r in results] == [1, 1]  # torchrun's code for any failed worker


@pytest.mark.slow
def test_sigterm_to_one_node_during_sampling_stops_both(tiny_dataset, tmp_path):
    nodes = nodes_with_sample(tmp_path, tiny_dataset)
    trained(nodes)
    began = time.time()
    # --prompt: torchrun takes a --start=... for its own --start_method
    results = two_nodes(nodes, [*SCRIPT_ARGS['sample.py'], '--prompt=abc', '--max_new_tokens=100000',
                                '--num_threads=1'],
                        script='sample.py', timeout=90, meanwhile=signal_node_1_once('sampling ', 2, stream='stderr'))
    # both end at once: node 0's worker stops too (130), so its torchrun skips the exit barrier (300 s) that a
    # worker which ended well (0) would wait in for node 1's agent
    assert time.time() - began < 90
    stopped_together(results, 130)


@pytest.mark.slow
def test_kill_9_of_one_nodes_agent_stops_and_saves_on_both(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    began = time.time()
    # a run of minutes; node 1's torchrun is killed once training is under way
    results = two_nodes(nodes, tiny('out', max_iters=100000, eval_interval=100000, log_interval=50),
                        timeout=90, meanwhile=signal_node_1_once('provenance', 3, sig=signal.SIGKILL,
                                                                         agent=True))
    assert time.time() - began < 90
    # node 1's worker, orphaned, sees its agent gone: every rank stops at one iteration and saves (75), so node
    # 0's torchrun ends at once instead of waiting 300 s in its exit barrier for the agent that is gone
    assert "the torchrun agent of a node is gone (killed, or it crashed): all processes stop here and save a " \
        "checkpoint" in results[0].stderr, results[0].stderr[-3000:]
    assert WORKER_EXIT.findall(results[0].stderr) == ['75'], results[0].stderr[-3000:]
    assert results[0].returncode == 1 and results[1].returncode == -signal.SIGKILL
    assert load_checkpoint(str(nodes[0] / 'out' / 'ckpt.pt'))['iter_num'] > 0
    # node 1's log says why its run ended too (its agent can't)
    assert "stopped with every node: rank 0 saved iteration" in results[1].stdout, results[1].stdout[-2000:]


# -----------------------------------------------------------------------------
# a failure one rank meets alone is said on every node

@pytest.mark.slow
def test_a_hellaswag_file_rank_0_lacks_is_said_on_both_nodes(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    write_hellaswag(nodes[1] / 'hs.jsonl')  # rank 0 reads it and sends it to the others
    results = ended_alike(nodes, tiny('out', max_iters=4, hellaswag_interval=2, hellaswag_file='hs.jsonl'),
                          "hs.jsonl")
    # node 1 has the file: its line says whose file was missing
    assert f"error: {RANK_0_SAID}" in results[1].stderr


@pytest.mark.slow
def test_an_out_dir_rank_0_refuses_is_said_on_both_nodes(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    # an earlier run in node 0's out/, which a new run must not replace
    trained(nodes, copy=False)
    earlier = load_checkpoint(str(nodes[0] / 'out' / 'ckpt.pt'))['iter_num']
    results = ended_alike(nodes, tiny('out', max_iters=4, seed=7),
                          "out already holds the checkpoint ckpt.pt")
    assert not iter_losses(results[0].stdout)
    assert load_checkpoint(str(nodes[0] / 'out' / 'ckpt.pt'))['iter_num'] == earlier


@pytest.mark.slow
def test_a_checkpoint_rank_0_cannot_write_is_said_on_both_nodes(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]

    def block_the_save(procs):
        # a directory where rank 0 writes the checkpoint, put there once the run has started (one
        # there before is refused when the out_dir is claimed): the save at the last iteration fails
        for line in procs[0].stdout:
            if line.startswith('iter 0:'):
                break
        (nodes[0] / 'out' / 'ckpt.pt').mkdir()
    ended_alike(nodes, tiny('out', max_iters=100, lr_decay_iters=100, eval_interval=100),
                "could not write the checkpoint out/ckpt.pt", meanwhile=block_the_save)


@pytest.mark.slow
def test_a_bad_token_id_met_by_rank_1_mid_run_is_said_on_both_nodes(tiny_dataset, tmp_path,
                                                                     monkeypatch):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    for node in nodes:  # the same file on both nodes
        train_bin = node / 'data' / 'tiny' / 'train.bin'
        tokens = np.fromfile(train_bin, dtype=np.uint16)
        # sequential order, batch 4 x 16: micro-batch k reads tokens [64k, 64k + 65) and goes to
        # rank k % 2
        tokens[5 * 64 + 10] = TINY_VOCAB + 3
        tokens.tofile(train_bin)
    # the per-batch check (splits over 64M tokens) instead of the start-up scan of the whole file
    monkeypatch.setitem(ENV, 'NANOGPT_PLUS_SCAN_TOKENS', '0')
    results = ended_alike(nodes, tiny('out', data_order='sequential', eval_interval=100),
                          f"holds token ids up to {TINY_VOCAB + 3}")
    assert 'another process of this run is gone' not in results[0].stderr + results[1].stderr


# -----------------------------------------------------------------------------
# eval.py's result that rank 0 can't write at the end

@pytest.mark.slow
def test_eval_output_file_rank_0_cannot_write_is_one_verdict(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    trained(nodes)
    # a write that fails only at the end (as on a full disk): a name longer than a file system takes
    # passes the checks at start, and no file of it can be made
    name = 'r' * 300 + '.json'
    evaluate = ['--init_from=resume', '--out_dir=out', '--device=cpu', '--max_examples=2',
                f'--output_file={name}']
    results = ended_alike(nodes, evaluate, f"could not write --output_file={name}",
                          '"task": "loss"', script='eval.py')
    # the evaluation ran (its result is in the line); no one printed it as done
    assert not any('"task": "loss"' in r.stdout for r in results)


def nodes_of(tmp_path, dataset):
    return [node_copy(tmp_path / f'node{i}', dataset) for i in range(2)]


def one_verdict(nodes, args, *words, script='train.py'):
    """
    Run args on the two nodes: both must end within a minute, with the same exit code, each with the same one
    `error:` line holding words. Returns that line.
    """
    began = time.time()
    results = two_nodes(nodes, args, script=script)
    assert time.time() - began < 60
    assert results[0].returncode == results[1].returncode, [r.returncode for r in results]
    assert_one_line_on_each_node(results, *words)
    return next(line for line in results[0].stderr.splitlines() if line.startswith('error: '))


def train_on(node, *settings, **more):
    r = run_python(['train.py', *tiny('out', **dict(settings, **more))], cwd=node, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


# -----------------------------------------------------------------------------
# the data's content and tokenizer, not only its numbers of tokens

def test_token_files_of_the_same_size_but_other_content_are_refused_on_both(tiny_dataset, tmp_path):
    nodes = nodes_of(tmp_path, tiny_dataset)
    data = nodes[1] / 'data' / 'tiny'
    # the same text encoded with another vocabulary (the symbols numbered backwards): every file keeps its size
    for name in ('train.bin', 'val.bin'):
        tokens = np.fromfile(data / name, dtype=np.uint16)
        (TINY_VOCAB - 1 - tokens).astype(np.uint16).tofile(data / name)
    stoi = {ch: TINY_VOCAB - 1 - i for i, ch in enumerate(SYMBOLS)}
    meta = {"kind": "char", "vocab_size": TINY_VOCAB, "stoi": stoi, "itos": {i: c for c, i in stoi.items()}}
    (data / 'meta.json').write_text(json.dumps(meta))
    one_verdict(nodes, tiny('out', max_iters=2), "the ranks differ in tokenizer: 'char (20 tokens) ",
                "rank 1 on", "give every node the same prepared dataset")
    # the same tokenizer on both nodes, other tokens of the same size in train.bin (another preparation)
    shutil.copy(nodes[0] / 'data' / 'tiny' / 'meta.json', data / 'meta.json')
    shutil.copy(nodes[0] / 'data' / 'tiny' / 'val.bin', data / 'val.bin')
    line = one_verdict(nodes, tiny('out', max_iters=2), "the ranks differ in tokens: train.bin='108000:",
                       "rank 1 on", "give every node the same copy of each file")
    assert 'val.bin' not in line
    assert not (nodes[0] / 'out' / 'ckpt.pt').exists()


def test_copies_at_one_commit_with_other_uncommitted_changes_are_refused_on_both(tiny_dataset, tmp_path):
    nodes = nodes_of(tmp_path, tiny_dataset)
    # outside a git checkout the .py files themselves are compared
    with open(nodes[1] / 'model.py', 'a') as f:
        f.write("\n# node 1's own change\n")
    one_verdict(nodes, tiny('out', max_iters=2), "the ranks differ in code: 'no git checkout: .py files ",
                "commit or undo the changes and check out the same commit")
    # one commit, cloned to the other node; then each node its own change (both '+dirty')
    shutil.rmtree(nodes[1])
    git(nodes[0], 'init', '-q')
    git(nodes[0], 'add', '--', '*.py')  # the sources, not the caches of the run above
    git(nodes[0], 'commit', '-q', '-m', 'the run')
    shutil.copytree(nodes[0], nodes[1])
    with open(nodes[0] / 'train.py', 'a') as f:
        f.write("\n# node 0's own change\n")
    with open(nodes[1] / 'model.py', 'a') as f:
        f.write("\n# node 1's own change\n")
    one_verdict(nodes, tiny('out', max_iters=2), "the ranks differ in code: 'git: uncommitted changes ",
                "check out the same commit on every node")
    # the same change on both: one run
    shutil.copy(nodes[0] / 'model.py', nodes[1] / 'model.py')
    shutil.copy(nodes[0] / 'train.py', nodes[1] / 'train.py')
    results = two_nodes(nodes, tiny('out', max_iters=2))
    assert [r.returncode for r in results] == [0, 0], results[1].stderr[-2000:]


# -----------------------------------------------------------------------------
# eval.py and finetune.py compare what train.py does

def test_eval_compares_the_checkpoint_and_the_token_files(tiny_dataset, tmp_path):
    nodes = nodes_of(tmp_path, tiny_dataset)
    train_on(nodes[0], max_iters=2)
    shutil.copytree(nodes[0] / 'out', nodes[1] / 'out')
    train_on(nodes[0], max_iters=4, init_from='resume')
    evaluate = ['--init_from=resume', '--out_dir=out', '--device=cpu', '--max_examples=4']
    # 5: a stale checkpoint on node 1 (it would score another model: a mixed loss)
    one_verdict(nodes, evaluate, "the ranks differ in checkpoint: out/ckpt.pt is at iter 5 on node 0",
                "iter 3 on node 1", "node 0 (", "has the newer one: copy it over out/ckpt.pt on node 1",
                script='eval.py')
    # 7: the same checkpoint, a shorter val.bin on node 1
    shutil.copy(nodes[0] / 'out' / 'ckpt.pt', nodes[1] / 'out' / 'ckpt.pt')
    val_bin = nodes[1] / 'data' / 'tiny' / 'val.bin'
    np.fromfile(val_bin, dtype=np.uint16)[:4000].tofile(val_bin)
    one_verdict(nodes, evaluate, "the ranks differ in data: val.bin='12000:", "but '8000:",
                "give every node the same copy of each file", script='eval.py')
    # a HellaSwag file with other examples on node 1
    shutil.copy(nodes[0] / 'data' / 'tiny' / 'val.bin', val_bin)
    write_hellaswag(nodes[0] / 'hs.jsonl', seed=1)
    write_hellaswag(nodes[1] / 'hs.jsonl', seed=2)
    one_verdict(nodes, evaluate + ['--task=hellaswag', '--data_file=hs.jsonl'], "the ranks differ in data: "
                "data_file=", script='eval.py')
    # everything alike: one score
    shutil.copy(nodes[0] / 'hs.jsonl', nodes[1] / 'hs.jsonl')
    results = two_nodes(nodes, evaluate, script='eval.py')
    assert [r.returncode for r in results] == [0, 0], results[1].stderr[-2000:]
    assert json.loads(results[0].stdout.strip().splitlines()[-1])['task'] == 'loss'


def test_finetune_compares_the_source_weights_and_the_task_files(tmp_path):
    from helpers import make_source, make_task
    nodes = [node_copy(tmp_path / f'node{i}', os.path.join(REPO, 'tests')) for i in range(2)]
    for i, node in enumerate(nodes):
        make_source(node / 'src', seed=i)  # 5: other weights under the same name, both at iter 0
    train_file, val_file = make_task(nodes[0], 'classification', n_train=16, n_val=8)
    shutil.copy(val_file, nodes[1])
    # 7: fewer rows on node 1
    rows = open(train_file).read().splitlines(keepends=True)
    (nodes[1] / os.path.basename(train_file)).write_text(''.join(rows[:12]))
    common = ['--task=classification', '--init_from=src', '--train_file=classification_train.jsonl',
              '--val_file=classification_val.jsonl', '--device=cpu', '--batch_size=8', '--epochs=1',
              '--out_dir=ft']
    one_verdict(nodes, common,
                "the ranks differ in the weights init_from starts from: the copies of src/ckpt.pt differ (",
                "(iter 0) on node 0 (", "(iter 0) on node 1 (", "copy the one to start from to every node",
                script='finetune.py')
    shutil.copy(nodes[0] / 'src' / 'ckpt.pt', nodes[1] / 'src' / 'ckpt.pt')
    line = one_verdict(nodes, common, "the ranks differ in data: train_file='", script='finetune.py')
    assert 'val_file' not in line  # the same 8 validation rows on both
    assert not (nodes[0] / 'ft' / 'ckpt.pt').exists()


# -----------------------------------------------------------------------------
# a checkpoint one node lacks, or has older, is said so, with the advice that keeps the newer one

def test_auto_resume_with_the_checkpoint_on_one_node_names_the_node_that_lacks_it(tiny_dataset, tmp_path):
    nodes = nodes_of(tmp_path, tiny_dataset)
    train_on(nodes[0], max_iters=2)
    line = one_verdict(nodes, tiny('out', max_iters=4, auto_resume=True),
                       "the ranks differ in checkpoint: out/ckpt.pt is on node 0 (", "(iter 3) but not on node 1 (",
                       "copy it from node 0 (")
    assert 'same command line' not in line
    # node 0's checkpoint untouched, node 1 still without one
    assert load_checkpoint(str(nodes[0] / 'out' / 'ckpt.pt'))['iter_num'] == 3
    assert not (nodes[1] / 'out' / 'ckpt.pt').exists()


def test_a_stale_checkpoint_on_node_0_says_node_1s_is_the_newer(tiny_dataset, tmp_path):
    nodes = nodes_of(tmp_path, tiny_dataset)
    train_on(nodes[0], max_iters=2)
    shutil.copytree(nodes[0] / 'out', nodes[1] / 'out')
    # node 1 went on alone: rank 0's copy is the older
    train_on(nodes[1], max_iters=5, init_from='resume')
    line = one_verdict(nodes, tiny('out', max_iters=8, init_from='resume'),
                       "the ranks differ in checkpoint: out/ckpt.pt is at iter 3 on node 0 (",
                       "iter 6 on node 1 (", "node 1 (", "has the newer one: copy it over out/ckpt.pt on node 0")
    assert "rank 0's" not in line
    assert load_checkpoint(str(nodes[1] / 'out' / 'ckpt.pt'))['iter_num'] == 6
