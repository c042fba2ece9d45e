"""
Many machines, round 3 (issue 43): two torchrun agents as two nodes, each in its own copy of the
repository (test_many_machines.py's harness). What fails on one node before the process group forms
(a config file, a refused setting, an output path), sample.py's inputs on one node only, and a
failure rank 0 (or any one rank) meets alone mid-run: every node ends within a minute, every worker
with the same exit code, and every node's log says why in one line.
"""
import re
import shutil
import time

import numpy as np
import pytest

import test_many_machines
from helpers import REPO, TINY_VOCAB, iter_losses, run_python, write_hellaswag
from nanogpt_plus.checkpoint import load_checkpoint
from test_many_machines import ENV, assert_one_line_on_each_node, launch, node_copy, tiny, two_nodes

# torchrun's report of a failed worker: "  exitcode  : 2 (pid: ...)"
WORKER_EXIT = re.compile(r"^\s*exitcode\s*:\s*(-?\d+)", re.M)


def nodes_with_sample(tmp_path, dataset):
    """ Two node copies (test_many_machines.node_copy) that hold sample.py too. """
    nodes = [node_copy(tmp_path / f'node{i}', dataset) for i in range(2)]
    for node in nodes:
        shutil.copy(f'{REPO}/sample.py', node / 'sample.py')
    return nodes


def ended_alike(nodes, args, *words, script='train.py', code=2, meanwhile=None):
    """
    script on both nodes: both end within a minute, each with one `error:` line holding words, and
    every worker of both nodes with exit code `code` (torchrun's report of each failed worker).
    Returns the results.
    """
    began = time.time()
    results = two_nodes(nodes, args, script=script, meanwhile=meanwhile)
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
# 1. what fails before the process group forms: the group is formed all the same, then one verdict

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
    assert r.stderr.count("error: config file") == 1, r.stderr[-3000:]
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


# -----------------------------------------------------------------------------
# 2. sample.py: one verdict on what each rank reads

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


# -----------------------------------------------------------------------------
# 6. a failure one rank meets alone is said on every node

@pytest.mark.slow
def test_a_hellaswag_file_rank_0_lacks_is_said_on_both_nodes(tiny_dataset, tmp_path):
    nodes = [node_copy(tmp_path / f'node{i}', tiny_dataset) for i in range(2)]
    write_hellaswag(nodes[1] / 'hs.jsonl')  # rank 0 reads it and sends it to the others
    ended_alike(nodes, tiny('out', max_iters=4, hellaswag_interval=2, hellaswag_file='hs.jsonl'),
                "hs.jsonl")


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
    monkeypatch.setitem(test_many_machines.ENV, 'NANOGPT_PLUS_SCAN_TOKENS', '0')
    results = ended_alike(nodes, tiny('out', data_order='sequential', eval_interval=100),
                          f"holds token ids up to {TINY_VOCAB + 3}")
    assert 'another process of this run is gone' not in results[0].stderr + results[1].stderr


# -----------------------------------------------------------------------------
# 8. eval.py's result that rank 0 can't write at the end

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
