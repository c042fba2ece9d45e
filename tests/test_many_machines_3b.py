"""
Many machines, round 3 (issue 43, items 3, 4, 5, 7, 9, 10): what every node must start from alike is compared,
content included, in every script that runs on several nodes: the tokens and tokenizer of the data, the code's
uncommitted changes, eval.py's and finetune.py's checkpoint and files; and a checkpoint that one node lacks or
has older is said so, naming each node's iteration and the newer one. Two torchrun agents as two nodes, each in
its own copy of the repository (tests/test_many_machines.py's harness), plus the digests and lines themselves.
"""
import json
import os
import shutil
import subprocess
import time

import numpy as np

from helpers import REPO, TINY_VOCAB, run_python, write_hellaswag
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.dataset import tokenizer_digest
from nanogpt_plus.files import file_digest
from nanogpt_plus.process_group import _first_difference
from nanogpt_plus.runtime import SAME_START, checkpoint_difference, code_digest, same_start
from test_many_machines import ENV, SYMBOLS, assert_one_line_on_each_node, node_copy, tiny, two_nodes


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
# 3: the data's content and tokenizer, not only its numbers of tokens

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


# -----------------------------------------------------------------------------
# 4: the code's uncommitted changes, not only '+dirty'

def git(cwd, *args):
    return subprocess.run(['git', '-c', 'user.name=t', '-c', 'user.email=t@example.com', *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout


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
# 5 and 7: eval.py and finetune.py compare what train.py does

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
    from test_finetune import make_source, make_task
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
    one_verdict(nodes, common, "the ranks differ in checkpoint: the copies of src/ckpt.pt differ (",
                "(iter 0) on node 0 (", "(iter 0) on node 1 (", "copy the one to start from to every node",
                script='finetune.py')
    shutil.copy(nodes[0] / 'src' / 'ckpt.pt', nodes[1] / 'src' / 'ckpt.pt')
    line = one_verdict(nodes, common, "the ranks differ in data: train_file='", script='finetune.py')
    assert 'val_file' not in line  # the same 8 validation rows on both
    assert not (nodes[0] / 'ft' / 'ckpt.pt').exists()


# -----------------------------------------------------------------------------
# 9 and 10: a checkpoint one node lacks, or has older, is said so, with the advice that keeps the newer one

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


# -----------------------------------------------------------------------------
# the digests and lines themselves (fast)

def test_file_digest_tells_contents_of_one_size_apart_from_its_ends(tmp_path):
    a, b, c = (tmp_path / n for n in 'abc')
    a.write_bytes(bytes(range(256)) * 100)
    b.write_bytes(bytes(reversed(range(256))) * 100)  # the same size
    shutil.copy(a, c)
    assert file_digest(a) == file_digest(c) and file_digest(a) != file_digest(b)
    assert file_digest(a).startswith('25600:')
    # only the ends are read: a change in the middle of a file over two spans is not seen (the price of its speed)
    data = bytearray(a.read_bytes())
    data[12800] ^= 1
    c.write_bytes(bytes(data))
    assert file_digest(c, span=4096) == file_digest(a, span=4096) and file_digest(c) != file_digest(a)


def test_tokenizer_digest_tells_vocabularies_of_one_size_apart():
    meta = {'kind': 'char', 'vocab_size': 3, 'stoi': {'a': 0, 'b': 1, 'c': 2}}
    other = dict(meta, stoi={'a': 2, 'b': 1, 'c': 0})
    assert tokenizer_digest(meta) == tokenizer_digest(json.loads(json.dumps(meta)))
    assert tokenizer_digest(meta) != tokenizer_digest(other)
    assert tokenizer_digest(meta).startswith('char (3 tokens) ')
    assert tokenizer_digest(None) is None


def test_code_digest_tells_uncommitted_changes_apart(tmp_path, monkeypatch):
    # not cached: the same checkout is read again after each change
    digest = code_digest.__wrapped__
    first = tmp_path / 'one'
    (first / 'nanogpt_plus').mkdir(parents=True)
    (first / 'model.py').write_text("x = 1\n")
    (first / 'nanogpt_plus' / 'a.py').write_text("y = 1\n")
    # no checkout: the .py files
    plain = digest(str(first))
    assert plain.startswith('no git checkout: .py files ')
    (first / 'nanogpt_plus' / 'a.py').write_text("y = 2\n")
    assert digest(str(first)) != plain
    git(first, 'init', '-q')
    git(first, 'add', '.')
    git(first, 'commit', '-q', '-m', 'one')
    assert digest(str(first)) == 'git: no uncommitted changes'
    second = tmp_path / 'two'
    shutil.copytree(first, second)
    (first / 'model.py').write_text("x = 2\n")
    (second / 'model.py').write_text("x = 3\n")
    changed = digest(str(first))
    assert changed.startswith('git: uncommitted changes ') and changed != digest(str(second))
    (second / 'model.py').write_text("x = 2\n")  # the same change: the same digest
    assert digest(str(second)) == changed
    # no git at all: the .py files again, not an error
    monkeypatch.setenv('PATH', str(tmp_path / 'nowhere'))
    assert digest(str(first)).startswith('no git checkout: .py files ')


def state(iter_num, digest='9:ab', path='out/ckpt.pt'):
    return {'path': path, 'iter_num': iter_num, 'digest': digest}


# 2 ranks on each of 2 nodes
PLACES = [('host-a', '0'), ('host-a', '0'), ('host-b', '1'), ('host-b', '1')]


def test_checkpoint_difference_names_each_nodes_iteration_and_the_newer():
    line = checkpoint_difference([state(3), state(3), state(6, '9:cd'), state(6, '9:cd')], PLACES)
    assert line == ("the ranks differ in checkpoint: out/ckpt.pt is at iter 3 on node 0 (host-a), iter 6 on "
                    "node 1 (host-b); node 1 (host-b) has the newer one: copy it over out/ckpt.pt on node 0 "
                    "(host-a) (or keep it on a shared file system), then start again")
    # three nodes: the copies that are not the newest are named; two other newest ones are the user's call
    three = [('a', '0'), ('b', '1'), ('c', '2')]
    line = checkpoint_difference([state(3), state(6, '9:cd'), state(6, '9:cd')], three)
    assert line.endswith("node 1 (b) has the newer one: copy it over out/ckpt.pt on node 0 (a) (or keep it on a "
                         "shared file system), then start again")
    assert "the copies of out/ckpt.pt differ" in checkpoint_difference(
        [state(3), state(6, '9:cd'), state(6, '9:ef')], three)
    lacking = checkpoint_difference([state(4), state(4), state(None, None), state(None, None)], PLACES)
    assert "out/ckpt.pt is on node 0 (host-a) (iter 4) but not on node 1 (host-b)" in lacking
    assert "copy it from node 0 (host-a) to out/ckpt.pt on node 1 (host-b)" in lacking
    same_iter = checkpoint_difference([state(4), state(4), state(4, '9:cd'), state(4, '9:cd')], PLACES)
    assert "the copies of out/ckpt.pt differ (9:ab (iter 4) on node 0 (host-a), 9:cd (iter 4) on node 1" \
        in same_iter
    # read from other paths (another --out_dir): the settings say why
    assert checkpoint_difference([state(4), state(4), state(4, path='o2/ckpt.pt'), state(4, path='o2/ckpt.pt')],
                                 PLACES) is None


def test_a_checkpoint_read_from_other_paths_is_left_to_the_settings():
    def outcome(host, node, checkpoint, out_dir):
        start = dict.fromkeys(SAME_START, 'same')
        return (None, host, node, '', dict(start, checkpoint=checkpoint, settings={'out_dir': out_dir}))
    outcomes = [outcome('host-a', '0', state(3), 'out'), outcome('host-b', '1', None, 'o2')]
    line = _first_difference(outcomes, SAME_START)
    assert line.startswith("the ranks differ in settings: out_dir='out' on rank 0 on host-a but 'o2' on rank 1")
    # nothing later differs: still one line, never a silent pass
    outcomes[1][4]['settings'] = {'out_dir': 'out'}
    assert _first_difference(outcomes, SAME_START).startswith("the ranks differ in checkpoint; ")


def test_same_start_reads_what_each_script_starts_from(tiny_dataset, tmp_path, monkeypatch):
    from helpers import save_test_checkpoint
    from model import GPT, GPTConfig
    monkeypatch.chdir(tmp_path)
    run = {'init_from': 'scratch', 'out_dir': 'out', 'auto_resume': True}
    # auto_resume looked for out/ckpt.pt and did not find it
    assert same_start(run)['checkpoint'] == {'path': 'out/ckpt.pt', 'iter_num': None, 'digest': None}
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=TINY_VOCAB))
    (tmp_path / 'out').mkdir()
    path = save_test_checkpoint(model, None, tmp_path / 'out' / 'ckpt.pt')
    # eval.py's init_from=resume: the checkpoint it scores, with its iteration
    start = same_start({'init_from': 'resume', 'out_dir': 'out'},
                       data={'val.bin': os.path.join(tiny_dataset, 'val.bin')},
                       data_meta={'kind': 'char', 'vocab_size': 2, 'stoi': {'a': 0, 'b': 1}})
    assert start['checkpoint'] == {'path': 'out/ckpt.pt', 'iter_num': 0, 'digest': file_digest(path)}
    assert start['weights'] is None and list(start['data']) == ['val.bin']
    assert start['data']['val.bin'].startswith('12000:')
    assert start['tokenizer'].startswith('char (2 tokens) ')
    # weights to start from (finetune.py's --init_from=<out_dir>)
    assert same_start({'init_from': 'out', 'out_dir': 'ft'})['weights']['digest'] == file_digest(path)
