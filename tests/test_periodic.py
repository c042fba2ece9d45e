"""
nanogpt_plus/evaluation/periodic.py, train.py's in-loop HellaSwag and samples: the figure at iteration N is eval.py
--task=hellaswag's on the checkpoint written at N, the printed line and the metrics record, DDP equal to one
process, a missing file stopping the run at start-up, the sample line, and none of it changing the training itself.
"""
import json
import os
import re
import runpy
import shutil
import sys

import pytest

import train
from helpers import (
    COMPILE,
    REPO,
    SPACED_SYMBOLS,
    TINY_VOCAB,
    TORCHRUN,
    iter_losses,
    run_python,
    train_args,
    write_hellaswag,
)
from nanogpt_plus import evaluation
from nanogpt_plus.errors import UserError
from nanogpt_plus.metrics import read_metrics
from nanogpt_plus.runtime import run_main

# the tiny dataset's pattern as 19 letters and a space (HellaSwag scores after a space)
SYMBOLS = SPACED_SYMBOLS


HELLASWAG_LINE = re.compile(r"^hellaswag (\d+): acc_norm (\d\.\d{4}) \((\d+)/(\d+)\)$", re.M)


SAMPLE_LINE = re.compile(r"^sample (\d+): (.*)$", re.M)


@pytest.fixture(scope="module")
def dataset(tiny_dataset, tmp_path_factory):
    """ conftest's tiny dataset (its 20-token pattern with 5% noise), its tokens read as the symbols SYMBOLS. """
    d = tmp_path_factory.mktemp("spaced_ds") / "data"
    assert len(SYMBOLS) == TINY_VOCAB
    shutil.copytree(tiny_dataset, d)
    stoi = {ch: i for i, ch in enumerate(SYMBOLS)}
    (d / "meta.json").write_text(json.dumps({"kind": "char", "vocab_size": len(SYMBOLS), "stoi": stoi,
                                             "itos": {i: ch for ch, i in stoi.items()}}))
    return str(d)


@pytest.fixture(scope="module")
def hellaswag_file(tmp_path_factory):
    """ 12 HellaSwag-format examples from the pattern: the true continuation among 3 random endings. """
    return write_hellaswag(tmp_path_factory.mktemp("hs") / "hs.jsonl")


def run_train(capsys, dataset, out_dir, **settings):
    train.main(train_args(dataset, out_dir, **settings))
    return capsys.readouterr().out


def hellaswag_lines(out):
    """ {iteration: (acc_norm as printed, correct, total)} of the `hellaswag N: ...` lines. """
    return {int(m.group(1)): (m.group(2), int(m.group(3)), int(m.group(4))) for m in HELLASWAG_LINE.finditer(out)}


def run_eval_script(monkeypatch, capsys, ckpt, data_file):
    import eval as eval_script
    monkeypatch.setattr(sys, "argv", ["eval.py", f"--init_from={ckpt}", "--device=cpu", "--task=hellaswag",
                                      f"--data_file={data_file}", "--batch_size=4"])
    eval_script.main()
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_in_loop_hellaswag_is_eval_py_on_the_checkpoint_of_that_iteration(tmp_path, dataset, hellaswag_file,
                                                                          monkeypatch, capsys, one_thread):
    out_dir = tmp_path / 'out'
    out = run_train(capsys, dataset, out_dir, hellaswag_interval=6, hellaswag_file=hellaswag_file,
                    # ckpt_6.pt, ckpt_12.pt: the saves of the evaluations at 6 and 12
                    keep_checkpoints=3)
    lines = hellaswag_lines(out)
    assert sorted(lines) == [0, 6, 12]
    assert len(HELLASWAG_LINE.findall(out)) == 3  # exactly one line per scoring
    # printed at the evaluation's point of the loop: just before its `step N:` line
    assert re.search(r"^hellaswag 6: .*\nstep 6: ", out, re.M)
    for it in (6, 12):
        result = run_eval_script(monkeypatch, capsys, out_dir / f'ckpt_{it}.pt', hellaswag_file)
        printed, correct, total = lines[it]
        assert total == result['num_examples'] == 12
        assert correct == round(result['metrics']['acc_norm'] * total)
        assert printed == f"{correct / total:.4f}"
    records = [r for r in read_metrics(str(out_dir / 'metrics.jsonl')) if r['type'] == 'hellaswag']
    assert [(r['iter'], r['correct'], r['total']) for r in records] == [(it, lines[it][1], 12) for it in (0, 6, 12)]
    assert all(r['acc_norm'] == r['correct'] / r['total'] for r in records)
    # the model learnt the pattern: more true continuations chosen (12/12 against 5/12 at iteration 0 on one
    # x86 CPU: a margin of 7 examples, not a near-tie that another CPU's kernels could flip)
    assert lines[12][1] > lines[0][1]
    # drawn beside the loss curves
    plot = runpy.run_path(os.path.join(REPO, 'scripts', 'plot_metrics.py'))['plot']
    assert plot(str(out_dir / 'metrics.jsonl'), str(tmp_path / 'm.png')) == (13, 3, 3)
    assert (tmp_path / 'm.png').read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hellaswag_examples_and_samples_leave_the_training_unchanged(tmp_path, dataset, hellaswag_file, capsys,
                                                                     one_thread):
    plain = run_train(capsys, dataset, tmp_path / 'plain')
    out = run_train(capsys, dataset, tmp_path / 'tasks', hellaswag_interval=4, hellaswag_examples=5,
                    hellaswag_file=hellaswag_file, sample_interval=6, sample_tokens=20, sample_prompt='abc')
    # no RNG drawn, train mode restored: bitwise the same run
    assert iter_losses(out) == iter_losses(plain)
    assert {it: total for it, (_, _, total) in hellaswag_lines(out).items()} == {0: 5, 4: 5, 8: 5, 12: 5}
    samples = {int(m.group(1)): m.group(2) for m in SAMPLE_LINE.finditer(out)}
    assert sorted(samples) == [0, 6, 12]
    assert all(len(text) == 20 and set(text) <= set(SYMBOLS) for text in samples.values()), samples
    # greedy after 'abc': by iteration 12 the model continues the pattern (along these 8 tokens its top two
    # logits were >= 0.3 apart, measured, far beyond the ~1e-5 by which CPUs' kernels differ)
    assert samples[12].startswith('defghijk'), samples
    records = [r for r in read_metrics(str(tmp_path / 'tasks' / 'metrics.jsonl')) if r['type'] == 'sample']
    assert [(r['iter'], r['text']) for r in records] == sorted(samples.items())


def test_a_missing_hellaswag_file_stops_the_run_at_start_up(tmp_path, dataset, tiny_dataset, hellaswag_file,
                                                             monkeypatch, capsys):
    # offline, the default file: the download fails at once (a file:// address that isn't there), exit code 2
    monkeypatch.setitem(evaluation.DATA_URLS, 'hellaswag', (tmp_path / 'nowhere' / 'hellaswag_val.jsonl').as_uri())
    monkeypatch.setattr(evaluation, 'REPO_DIR', str(tmp_path / 'repo'))
    with pytest.raises(SystemExit) as e:
        run_main(lambda: train.main(train_args(dataset, tmp_path / 'out', hellaswag_interval=250)))
    captured = capsys.readouterr()
    assert e.value.code == 2
    assert captured.err.count('\n') == 1 and captured.err.startswith('error: could not download ')
    assert '--hellaswag_file=PATH' in captured.err
    # nothing trained or evaluated
    assert 'iter 0' not in captured.out and 'step 0' not in captured.out
    # a file of the user's that isn't there
    missing = str(tmp_path / 'mine.jsonl')
    with pytest.raises(UserError, match=f"no data file at {re.escape(missing)}; pass --hellaswag_file=PATH"):
        train.main(train_args(dataset, tmp_path / 'out', hellaswag_interval=250, hellaswag_file=missing))
    assert 'iter 0' not in capsys.readouterr().out
    # a character vocabulary without the space the endings are scored after
    with pytest.raises(UserError, match=r"can't be scored with this model's tokenizer: .* ' '"):
        train.main(train_args(tiny_dataset, tmp_path / 'out', hellaswag_interval=250, hellaswag_file=hellaswag_file))
    assert 'iter 0' not in capsys.readouterr().out


def test_negative_intervals_are_refused(tmp_path, dataset):
    for setting in ('hellaswag_interval', 'hellaswag_examples', 'sample_interval'):
        with pytest.raises(UserError, match=setting):
            train.main(train_args(dataset, tmp_path / 'out', **{setting: -1}))
    with pytest.raises(UserError, match='sample_tokens'):
        train.main(train_args(dataset, tmp_path / 'out', sample_tokens=0))


def test_ddp_hellaswag_equals_one_process(tmp_path, dataset, hellaswag_file, capsys, one_thread):
    settings = dict(max_iters=4, eval_interval=2, hellaswag_interval=2, hellaswag_file=hellaswag_file)
    single = hellaswag_lines(run_train(capsys, dataset, tmp_path / 'one', **settings))
    cmd = TORCHRUN + ['--standalone', '--nproc_per_node=2', 'train.py', '--backend=gloo'] \
        + train_args(dataset, tmp_path / 'ddp', **settings)
    r = run_python(cmd, timeout=240, env=dict(os.environ, OMP_NUM_THREADS='1'))
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(HELLASWAG_LINE.findall(r.stdout)) == 3  # rank 0 alone prints
    assert hellaswag_lines(r.stdout) == single and sorted(single) == [0, 2, 4]


def test_compiled_in_loop_hellaswag_equals_eager_and_eval_py(tmp_path, dataset, hellaswag_file, monkeypatch, capsys,
                                                              one_thread):
    settings = dict(max_iters=4, eval_interval=2, hellaswag_interval=2, hellaswag_file=hellaswag_file,
                    keep_checkpoints=3)
    eager = hellaswag_lines(run_train(capsys, dataset, tmp_path / 'eager', **settings))
    compiled = hellaswag_lines(run_train(capsys, dataset, tmp_path / 'compiled', **COMPILE, **settings))
    assert compiled == eager and sorted(eager) == [0, 2, 4]
    for it in (2, 4):
        result = run_eval_script(monkeypatch, capsys, tmp_path / 'compiled' / f'ckpt_{it}.pt', hellaswag_file)
        assert compiled[it][1] == round(result['metrics']['acc_norm'] * 12)
