"""
nanogpt_plus/runtime.py: run_main's endings (exit codes, the process group torn down once), the code digest that
tells uncommitted changes apart, and same_start: what each script starts from, and a checkpoint's difference between
the nodes named by each node's iteration.
"""
import json
import os
import re
import shutil

import pytest

from helpers import TINY_VOCAB, TORCHRUN, git, project_frames, run_python, train_args, train_here
from nanogpt_plus.errors import PeerFailed, UserError
from nanogpt_plus.files import file_digest
from nanogpt_plus.process_group import _first_difference
from nanogpt_plus.runtime import SAME_START, checkpoint_difference, code_digest, run_main, same_start


def test_run_main_tears_the_process_group_down_after_main(tmp_path, capsys):
    import torch.distributed as dist

    # a script's main() that joined a process group (as init_distributed does under torchrun)
    def main():
        dist.init_process_group('gloo', init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    run_main(main)
    # no script does it itself: run_main does, once main() has returned
    assert not dist.is_initialized()

    def failing():
        dist.init_process_group('gloo', init_method=f"file://{tmp_path / 'store2'}", rank=0, world_size=1)
        raise UserError("a setting is wrong")
    with pytest.raises(SystemExit) as e:
        run_main(failing)
    assert e.value.code == 2 and capsys.readouterr().err == "error: a setting is wrong\n"


def test_a_users_error_is_left_in_torchruns_error_file(tmp_path, monkeypatch, capsys):
    """ Under torchrun (TORCHELASTIC_ERROR_FILE set) the one line goes into the worker's error file too. """
    def fails(error):
        def main():
            raise error
        return main

    monkeypatch.delenv('TORCHELASTIC_ERROR_FILE', raising=False)
    with pytest.raises(SystemExit):
        run_main(fails(UserError("a setting is wrong")))
    assert os.listdir(tmp_path) == []  # not under torchrun: no file anywhere
    path = tmp_path / 'error.json'
    monkeypatch.setenv('TORCHELASTIC_ERROR_FILE', str(path))
    for error, line in ((UserError("a setting is wrong"), "error: a setting is wrong"),
                        # another rank's: the failed rank's line, exit code 2 alike
                        (PeerFailed("rank 0 failed", 2, line="out is taken"), "error: out is taken")):
        with pytest.raises(SystemExit) as e:
            run_main(fails(error))
        assert e.value.code == 2
        # torch's ErrorHandler format, without a call stack (which the summary would show instead)
        record = json.loads(path.read_text())['message']
        assert record['message'] == line and set(record['extraInfo']) == {'timestamp'}
        path.unlink()
    capsys.readouterr()
    with pytest.raises(SystemExit):  # a bug's traceback is the worker's log's, not the file's
        run_main(fails(RuntimeError("a bug")))
    assert not path.exists()


def test_torchruns_summary_names_the_refusal(dataset, tmp_path):
    """
    The docs' torchrun command into the quick start's out_dir, with another architecture: every rank stops with
    exit code 2, and torchrun's failure summary names the refusal's line as the root cause (its own traceback
    stays: docs/distributed.md), where it said "To enable traceback see ..."; no worker traceback.
    """
    out = tmp_path / "out"
    train_here(dataset, out, max_iters=2, eval_interval=2)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = run_python(TORCHRUN + ["--standalone", "--nproc_per_node=2", "train.py",
                               *train_args(dataset, out, max_iters=2, eval_interval=2, n_layer=3)],
                   timeout=300, env=env)
    assert r.returncode != 0
    line = re.search(r"^error: (.*already holds the checkpoint.*)$", r.stderr, re.M).group(1)
    assert f"--out_dir={tmp_path / 'out-2'}" in line
    root_cause = r.stderr.split("Root Cause (first observed failure):")[1]
    assert re.search(r"^  exitcode  : 2 ", root_cause, re.M), r.stderr[-3000:]
    assert f"  traceback : error: {line}\n" in root_cause, r.stderr[-3000:]
    assert "To enable traceback" not in r.stderr
    assert not project_frames(r.stderr), r.stderr[-3000:]


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
    # init_from's weights: named as such, not as a checkpoint resumed
    line = _first_difference([(None, h, n, '', {'weights': state(3, path='src/ckpt.pt')}, 'files') for h, n in
                              PLACES[:2]] + [(None, h, n, '', {'weights': state(3, '9:cd', 'src/ckpt.pt')}, 'files')
                                             for h, n in PLACES[2:]], {'weights': SAME_START['weights']})
    assert line.startswith("the ranks differ in the weights init_from starts from: the copies of src/ckpt.pt "
                           "differ ("), line
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


@pytest.mark.parametrize('raised,code', [(None, 0), (UserError('x'), 2), (RuntimeError('bug'), 1)])
def test_each_rank_records_its_exit_code_where_the_job_asks(tmp_path, monkeypatch, capsys, raised, code):
    """ scripts/slurm_train.sh requeues from these files (75: resumable), never from its log's lines. """
    from nanogpt_plus.runtime import EXIT_CODES_DIR

    def main():
        if raised is not None:
            raise raised
    monkeypatch.setenv(EXIT_CODES_DIR, str(tmp_path))
    monkeypatch.setenv('RANK', '3')
    try:
        run_main(main)
    except SystemExit as e:
        assert e.code == code
    assert os.listdir(tmp_path) == ['rank-3'] and (tmp_path / 'rank-3').read_text() == f"{code}\n"
    capsys.readouterr()


@pytest.mark.parametrize("failure", ["torch", "python"])
def test_a_failed_cpu_allocation_is_one_line_and_exit_2(failure, tmp_path, capsys):
    """ Only torch.OutOfMemoryError (CUDA's) was caught: the CPU allocator's RuntimeError or a MemoryError
    anywhere (a resume with a huge batch_size, millions of samples) ended in a traceback. """
    import torch

    def main():
        if failure == "torch":
            torch.empty(10**13)  # 40 TB: refused by the allocator on any machine
        raise MemoryError()
    with pytest.raises(SystemExit) as e:
        run_main(main)
    err = capsys.readouterr().err.strip().splitlines()
    asked = "37,252.9 GiB" if failure == "torch" else "memory"
    assert e.value.code == 2 and err == [
        f"error: this machine could not allocate {asked} (out of CPU memory); use a smaller --batch_size, "
        f"--block_size or model (sample.py: fewer --num_samples), or a machine with more memory"]
    assert os.listdir(tmp_path) == []
