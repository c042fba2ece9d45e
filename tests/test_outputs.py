"""
nanogpt_plus/outputs.py, every rule on where a script may write: eval.py --output_file, finetune.py --predict_out
and export_hf.py --hf_dir never replace a checkpoint, a dataset's files, a directory holding them or a file the run
reads, unless --overwrite=True; a file output replaces only an earlier output of its kind; a run's out_dir (a new
run refused over an earlier one, the lock against a second run, stale locks, things in the way, an unwritable or
full disk) and a live run's out_dir taking no other output; no prepare script writes where another kind of dataset,
another dataset or a training run lies, unless --overwrite=True.
"""
import fcntl
import json
import multiprocessing
import os
import pickle
import re
import runpy
import shlex
import shutil
import socket
import stat
import sys
import time

import numpy as np
import pytest
import torch

import eval as eval_script
import export_hf
import finetune
import train
from helpers import (
    REPO,
    SINGLE,
    assert_one_line_error,
    config,
    dead_pid,
    dead_runs_temp,
    exit_code,
    make_task,
    one_error_line,
    one_line,
    run,
    run_script,
    run_train,
    save_test_checkpoint,
    start_python,
    train_args,
    write_jsonl,
)
from model import GPT, GPTConfig
from nanogpt_plus.dataloader import TokenWindowLoader
from nanogpt_plus.dataset import find_shards, split_files
from nanogpt_plus.dataset.shards import write_shard
from nanogpt_plus.errors import UserError
from nanogpt_plus.hf_export import export
from nanogpt_plus.outputs import (
    LOCK_NAME,
    RAW,
    RUN_FILES,
    SHARDS,
    OutDirLock,
    OutDirSpec,
    check_out_dir,
    check_output,
    prepare_out_dir,
    preparing,
    refuse_overwrite,
)
from nanogpt_plus.tokenizer import CharTokenizer

CHARS = "abcdefghijklmnopqrstuvwxyz ."


def snapshot(*paths):
    """ {path: bytes} of files, to show that a refused run left them exactly as they were. """
    return {p: open(p, 'rb').read() for p in paths}


def assert_refused(setting, kept, fn, *args, **kwargs):
    """ fn(*args, **kwargs) raises one line naming --setting and the way out; the kept files are unchanged. """
    before = snapshot(*kept)
    with pytest.raises(UserError, match=rf"^--{setting}=.*; pass another --{setting}, or --overwrite=True") as e:
        fn(*args, **kwargs)
    assert '\n' not in str(e.value)
    assert snapshot(*kept) == before


@pytest.fixture
def files(tmp_path):
    """ A run's out_dir, a dataset directory, earlier outputs of each script, and a folder of plain text. """
    out, data, hf, text = (tmp_path / n for n in ('out', 'data', 'hf', 'text'))
    for d in (out, data, hf, text):
        d.mkdir()
    torch.save({'model': {}}, out / 'ckpt.pt')
    torch.save({'w': torch.zeros(2)}, out / 'weights.ckpt')  # torch.save's zip under another name
    torch.save({'w': torch.zeros(2)}, out / 'legacy.weights', _use_new_zipfile_serialization=False)
    np.arange(100, dtype=np.uint16).tofile(data / 'train.bin')
    write_shard(str(data / 'mine_val_000000.bin'), np.arange(100, dtype=np.uint16))
    (data / 'meta.json').write_text('{"kind": "char"}')
    (data / 'meta.pkl').write_bytes(pickle.dumps({'vocab_size': 3}))
    (data / 'tokenizer.json').write_text('{}')
    # earlier outputs, as eval.py and finetune.py write them
    (out / 'eval.json').write_text('{"task": "loss", "metrics": {"loss": 2.0}, "source": "out/ckpt.pt"}\n')
    (out / 'predictions.jsonl').write_text('{"text": "a", "prediction": 1, "probs": [0.4, 0.6]}\n')
    for name in ('config.json', 'model.safetensors', 'tokenizer.json'):
        (hf / name).write_text('{}')
    (text / 'tokenizer.json').write_text('{}')  # not beside token files: nobody's dataset
    (text / 'a.jsonl').write_text('{"text": "a"}\n')
    return {k: str(v) for k, v in dict(out=out, data=data, hf=hf, text=text, root=tmp_path).items()}


@pytest.mark.usefixtures('one_thread')
def test_the_rule_of_check_output(files, capsys):
    out = files['out']
    data = files['data']
    hf = files['hf']
    text = files['text']
    protected = [f'{out}/ckpt.pt', f'{out}/weights.ckpt', f'{out}/legacy.weights', f'{data}/train.bin',
                 f'{data}/mine_val_000000.bin', f'{data}/meta.json', f'{data}/meta.pkl', f'{data}/tokenizer.json']
    for path in protected:
        assert_refused('output_file', [path], check_output, path, 'output_file', False)
        check_output(path, 'output_file', True)  # --overwrite=True: allowed, and said on stderr
        assert f"--output_file={path} would replace" in capsys.readouterr().err
    # a .pt name is a checkpoint's even before it exists (finetune.py writes ckpt.pt after checking predict_out)
    assert_refused('predict_out', [], check_output, f'{out}/best.pt', 'predict_out', False)
    # a file the run reads
    assert_refused('predict_out', [f'{text}/a.jsonl'], check_output, f'{text}/a.jsonl', 'predict_out', False,
                   inputs={'predict_file': f'{text}/a.jsonl', 'val_file': ''})
    # directories that hold a checkpoint or a dataset, or the model being read
    for directory in (out, data):
        assert_refused('hf_dir', [], check_output, directory, 'hf_dir', False, kind='directory')
    assert_refused('hf_dir', [], check_output, hf, 'hf_dir', False, kind='directory', inputs={'init_from': hf})

    # what may be replaced: earlier outputs of the same script, new paths, files of no dataset
    for path in (f'{out}/eval.json', f'{out}/predictions.jsonl', f'{text}/tokenizer.json', f'{out}/new/x.json'):
        check_output(path, 'output_file', False)
    earlier = ('config.json', 'model.safetensors')  # what an earlier export holds
    os.mkdir(f'{files["root"]}/empty')
    for directory in (hf, f'{files["root"]}/empty', f'{out}/hf', f'{files["root"]}/new/hf'):
        check_output(directory, 'hf_dir', False, kind='directory', inputs={'init_from': out}, earlier=earlier)
    assert capsys.readouterr().err == ''
    # ... but not a directory of other files, whose README.md, config.json, ... an export would replace
    assert_refused('hf_dir', [f'{text}/tokenizer.json'], check_output, text, 'hf_dir', False, kind='directory',
                   earlier=earlier)


@pytest.mark.usefixtures('one_thread')
def test_outputs_that_cant_be_written_are_one_line(files, monkeypatch):
    out = files['out']
    hf = files['hf']
    with pytest.raises(UserError, match=r"^--hf_dir=.*eval.json is a file, not a directory; pass a directory"):
        check_output(f'{out}/eval.json', 'hf_dir', True, kind='directory')
    with pytest.raises(UserError, match=r"^--output_file=.*hf is a directory; pass a file path"):
        check_output(hf, 'output_file', True)
    for kind in ('file', 'directory'):  # on the way to the output: a file where a directory must be
        with pytest.raises(UserError, match=r"is inside .*eval.json, which is a file, not a directory"):
            check_output(f'{out}/eval.json/sub/x', 'output_file', True, kind=kind)
    # a directory that can't be written in
    os.chmod(hf, 0o555)
    try:
        # root may write anywhere: what access(2) says for another user, then
        if os.access(hf, os.W_OK):
            real = os.access
            monkeypatch.setattr(os, 'access', lambda p, mode: real(p, mode) and not str(p).startswith(hf))
        for kind, path in (('directory', hf), ('file', f'{hf}/eval.json'), ('directory', f'{hf}/sub')):
            with pytest.raises(UserError, match=r"this user may not write in .*hf; fix its permissions"):
                check_output(path, 'hf_dir', True, kind=kind)
    finally:
        os.chmod(hf, 0o755)


@pytest.mark.usefixtures('one_thread')
def test_export_that_fails_midway_is_one_line(tmp_path):
    # the transformers writers don't go through atomic_write: their OSErrors are said in one line too (here a
    # directory is where config.json goes, which fails for root as well as for any user)
    tok = CharTokenizer.from_text(CHARS)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=tok.vocab_size))
    (tmp_path / 'hf' / 'config.json').mkdir(parents=True)
    with pytest.raises(UserError, match=r"^could not write the Hugging Face directory .*hf \(config.json: not a "
                                        r"regular file\); the earlier files in .*hf are unchanged. Fix its "
                                        r"permissions .*export again$"):
        export(model, tok.meta(), str(tmp_path / 'hf'))
    # none of the export's files went in beside the directory in the way, and no temp is left
    assert os.listdir(tmp_path / 'hf') == ['config.json'] and os.listdir(tmp_path) == ['hf']


# -----------------------------------------------------------------------------
# the three scripts

@pytest.fixture
def char_run(tmp_path):
    """ out/ckpt.pt: a tiny character model trained on data/ (train.bin, val.bin, meta.json, tokenizer.json). """
    tok = CharTokenizer.from_text(CHARS)
    data = tmp_path / 'data'
    data.mkdir()
    ids = np.array(tok.encode("the cat sat on the mat. " * 20), dtype=np.uint16)
    ids.tofile(data / 'train.bin')
    ids.tofile(data / 'val.bin')
    (data / 'meta.json').write_text(json.dumps(tok.meta()))
    (data / 'tokenizer.json').write_text('{"a": "tokenizer of the dataset"}')
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=tok.vocab_size))
    save_test_checkpoint(model, tok.meta(), tmp_path / 'out' / 'ckpt.pt', dataset=str(data))
    return str(tmp_path / 'out'), str(data)


@pytest.mark.usefixtures('one_thread')
def test_eval_output_file(char_run, monkeypatch, capsys):
    out, data = char_run
    args = ['--init_from=resume', f'--out_dir={out}', f'--dataset={data}', '--device=cpu', '--max_examples=2']
    for target in (f'{out}/ckpt.pt', f'{data}/val.bin', f'{data}/meta.json'):
        assert_refused('output_file', [target], run_script, eval_script, monkeypatch, *args, f'--output_file={target}')
    capsys.readouterr()
    for _ in range(2):  # a re-run replaces its earlier result
        run_script(eval_script, monkeypatch, *args, f'--output_file={out}/eval.json')
        line = capsys.readouterr().out.splitlines()[-1]
        assert open(f'{out}/eval.json').read() == line + '\n'


@pytest.mark.usefixtures('one_thread')
def test_export_hf_dir(char_run, monkeypatch, capsys):
    out, data = char_run
    args = ['--init_from=resume', f'--out_dir={out}']
    # the reported case: a dataset directory's tokenizer.json was overwritten
    assert_refused('hf_dir', [f'{data}/tokenizer.json', f'{data}/meta.json'], run_script, export_hf, monkeypatch,
                   *args, f'--hf_dir={data}')
    assert sorted(os.listdir(data)) == ['meta.json', 'tokenizer.json', 'train.bin', 'val.bin']
    assert_refused('hf_dir', [f'{out}/ckpt.pt'], run_script, export_hf, monkeypatch, *args, f'--hf_dir={out}')
    for _ in range(2):  # the default <out_dir>/hf, then again over that earlier export
        run_script(export_hf, monkeypatch, *args)
        assert json.loads(capsys.readouterr().out.splitlines()[-1])['hf_dir'] == f'{out}/hf'
    # ... but not over the directory this export reads
    assert_refused('hf_dir', [f'{out}/hf/model.safetensors'], run_script, export_hf, monkeypatch,
                   f'--init_from={out}/hf', f'--hf_dir={out}/hf')
    # a directory of the user's: its README.md stays
    notes = os.path.join(os.path.dirname(out), 'notes')
    os.mkdir(notes)
    with open(os.path.join(notes, 'README.md'), 'w') as f:
        f.write('my notes')
    assert_refused('hf_dir', [os.path.join(notes, 'README.md')], run_script, export_hf, monkeypatch, *args,
                   f'--hf_dir={notes}')
    with pytest.raises(UserError, match=r"^--hf_dir=.*ckpt.json is a file, not a directory"):
        run_script(export_hf, monkeypatch, *args, f'--hf_dir={out}/ckpt.json')
    # --overwrite=True: the user asked for it
    run_script(export_hf, monkeypatch, *args, f'--hf_dir={data}', '--overwrite=True')
    assert 'model.safetensors' in os.listdir(data)


@pytest.mark.usefixtures('one_thread')
def test_finetune_predict_out(tmp_path, monkeypatch, capsys):
    train, val = make_task(tmp_path, 'classification', n_train=32, n_val=8)
    unlabeled = write_jsonl(tmp_path / 'test.jsonl', [{'text': 'abc xyz'}, {'text': 'wvu d'}])
    src = tmp_path / 'src'
    torch.manual_seed(0)
    tok = CharTokenizer.from_text(CHARS)
    save_test_checkpoint(GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=tok.vocab_size)),
                         tok.meta(), src / 'ckpt.pt')
    ft = str(tmp_path / 'ft')
    common = ['--task=classification', f'--init_from={src}', f'--out_dir={ft}', f'--train_file={train}',
              f'--val_file={val}', '--epochs=1', '--batch_size=16', '--device=cpu', f'--predict_file={unlabeled}']
    # refused before any training: over the source checkpoint, over the labelled data, over the run's own ckpt.pt
    for target in (f'{src}/ckpt.pt', train, f'{ft}/ckpt.pt'):
        kept = [target] if os.path.exists(target) else []
        assert_refused('predict_out', kept, run_script, finetune, monkeypatch, *common, f'--predict_out={target}')
        assert not os.path.exists(ft)
    finetune.finetune(config(task='classification', init_from=str(src), out_dir=ft, train_file=train, val_file=val,
                             epochs=1, predict_file=unlabeled), SINGLE)
    predict = [f'--init_from={ft}', f'--predict_file={unlabeled}', '--device=cpu']
    # predictions only: over the model they come from, over their input
    for target in (f'{ft}/ckpt.pt', unlabeled):
        assert_refused('predict_out', [target], run_script, finetune, monkeypatch, *predict, f'--predict_out={target}')
    capsys.readouterr()
    # over the training's predictions.jsonl: re-running is normal
    run_script(finetune, monkeypatch, *predict)
    assert 'wrote 2 predictions to ' + os.path.join(ft, 'predictions.jsonl') in capsys.readouterr().out


@pytest.mark.usefixtures('one_thread')
def test_a_file_output_replaces_only_an_earlier_output_of_its_kind(files, capsys):
    out = files['out']
    data = files['data']
    text = files['text']
    tmp = os.path.dirname(out)
    metrics = f'{out}/metrics.jsonl'
    sidecar = f'{out}/ckpt.json'
    corpus = f'{data}/input.txt'
    script = f'{tmp}/prepare.py'
    with open(metrics, 'w') as f:
        f.write('{"type": "start", "run": 1, "iter": 0}\n')
    with open(sidecar, 'w') as f:
        json.dump({'model_args': {}, 'iter_num': 3}, f)
    with open(corpus, 'w') as f:
        f.write('First Citizen:\n')
    with open(script, 'w') as f:
        f.write('print("prepare")\n')
    for kind, setting in (('eval result', 'output_file'), ('predictions', 'predict_out')):
        for path in (metrics, sidecar, corpus, script, f'{text}/a.jsonl'):
            assert_refused(setting, [path], check_output, path, setting, False, output_kind=kind)
        # the words say which file it is and whose
        with pytest.raises(UserError, match=rf"would replace {metrics}, a file of the run in {out} that is not an "
                                            rf"earlier {kind}"):
            check_output(metrics, setting, False, output_kind=kind)
        with pytest.raises(UserError, match=rf"a file of the dataset in {data} that is not an earlier {kind}"):
            check_output(corpus, setting, False, output_kind=kind)
        # --overwrite=True: the user asked for it
        check_output(metrics, setting, True, output_kind=kind)
        assert 'would replace' in capsys.readouterr().err
    # an earlier output of the same kind is replaced, one of the other kind is not
    check_output(f'{out}/eval.json', 'output_file', False, output_kind='eval result')
    check_output(f'{out}/predictions.jsonl', 'predict_out', False, output_kind='predictions')
    assert_refused('output_file', [f'{out}/predictions.jsonl'], check_output, f'{out}/predictions.jsonl',
                   'output_file', False, output_kind='eval result')
    assert_refused('predict_out', [f'{out}/eval.json'], check_output, f'{out}/eval.json', 'predict_out', False,
                   output_kind='predictions')


@pytest.mark.usefixtures('one_thread')
def test_a_runs_lock_is_never_an_output(files):
    lock = os.path.join(files['out'], 'run.lock')
    with open(lock, 'w') as f:
        f.write('{"pid": 1, "host": "h"}\n')
    for overwrite in (False, True):
        for kind in ('file', 'directory'):
            with pytest.raises(UserError, match=r"is a run's lock \(run.lock\), which no output may replace"):
                check_output(lock, 'output_file', overwrite, kind=kind, output_kind='eval result')
    assert json.load(open(lock)) == {'pid': 1, 'host': 'h'}


@pytest.mark.usefixtures('one_thread')
def test_eval_output_file_over_a_runs_files_is_refused(char_run, monkeypatch):
    out, data = char_run
    args = ['--init_from=resume', f'--out_dir={out}', f'--dataset={data}', '--device=cpu', '--max_examples=2']
    with open(f'{out}/metrics.jsonl', 'w') as f:
        f.write('{"type": "start", "run": 1, "iter": 0}\n')
    for target in (f'{out}/metrics.jsonl', f'{out}/ckpt.json'):
        assert_refused('output_file', [target], run_script, eval_script, monkeypatch, *args, f'--output_file={target}')
    with pytest.raises(UserError, match="is a run's lock"):
        run_script(eval_script, monkeypatch, *args, f'--output_file={out}/run.lock', '--overwrite=True')
    assert not os.path.exists(f'{out}/run.lock')


# -----------------------------------------------------------------------------
# overwrite protection

@pytest.mark.usefixtures('one_thread')
def test_a_scratch_run_over_a_checkpoint_is_refused_and_overwrite_replaces_it(dataset, tmp_path, capsys):
    args = train_args(dataset, tmp_path, max_iters=2, eval_interval=2)
    run_train(capsys, args)
    before = (tmp_path / "ckpt.pt").read_bytes()
    # the same command again: that run is complete, so resuming it is no advice
    assert exit_code(lambda: train.main(args)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds the checkpoint ckpt.pt (iter 3) of an earlier run" in err
    assert "--init_from=resume" not in err
    others = ' '.join(a for a in args if not a.startswith('--out_dir='))
    assert f"`python train.py {others} --out_dir={tmp_path}-2`" in err
    assert f"`python train.py {' '.join(args)} --overwrite=True`" in err
    # with more iterations it can continue, and the command it gives does
    longer = args + ["--max_iters=4"]
    assert exit_code(lambda: train.main(longer)) == 2
    resume = f"python train.py {' '.join(longer)} --init_from=resume"
    assert f"`{resume}`" in capsys.readouterr().err
    assert (tmp_path / "ckpt.pt").read_bytes() == before  # untouched
    assert not (tmp_path / LOCK_NAME).exists()  # a refused run leaves no lock behind
    out = run_train(capsys, args + ["--overwrite=True", "--max_iters=3"]).out
    assert "overwrite=True: the earlier run's checkpoint" in out
    # the new run's final save
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)["iter_num"] == 4


@pytest.mark.usefixtures('one_thread')
def test_the_refusal_over_another_architecture_suggests_what_works(dataset, tmp_path, capsys):
    """ The quick start's run, then nanoGPT's bigger config into the same out_dir: resuming can't work. """
    args = train_args(dataset, tmp_path / "out", max_iters=2, eval_interval=2)
    run_train(capsys, args)
    bigger = args + ["--n_layer=3", "--max_iters=4"]
    assert exit_code(lambda: train.main(bigger)) == 2
    err = capsys.readouterr().err
    assert "--init_from=resume" not in err
    suggested = re.search(r"write this run elsewhere with `python train\.py (.*?)`", err).group(1)
    run_train(capsys, shlex.split(suggested))
    assert torch.load(tmp_path / "out-2" / "ckpt.pt", weights_only=True)["model_args"]["n_layer"] == 3
    # the same command again: out-2 is taken now, so the refusal names the next free name
    assert exit_code(lambda: train.main(bigger)) == 2
    suggested = re.search(r"write this run elsewhere with `python train\.py (.*?)`", capsys.readouterr().err).group(1)
    assert f"--out_dir={tmp_path / 'out-3'}" in shlex.split(suggested)


def test_the_suggested_out_dir_is_the_first_free_one(tmp_path):
    """ -2, -3, ...: the first name nothing is at (a file or a dangling link takes a name too). """
    out = tmp_path / "out"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"an earlier run's")

    def suggested():
        err = str(refuse_overwrite(str(out) + os.sep, "ckpt.pt", "train.py", [f"--out_dir={out}"], resumable=False))
        return re.search(r"write this run elsewhere with `python train\.py --out_dir=(\S*)`", err).group(1)

    assert suggested() == f"{out}-2"
    (tmp_path / "out-2").mkdir()
    (tmp_path / "out-3").write_text("a file")
    (tmp_path / "out-4").symlink_to(tmp_path / "nowhere")
    assert suggested() == f"{out}-5"


@pytest.mark.usefixtures('one_thread')
def test_why_a_resume_would_be_refused_is_asked_only_over_an_earlier_run(tmp_path):
    """ A new run into an empty out_dir never reads an earlier checkpoint (resume_refusal), one over a run does. """
    spec = OutDirSpec(out_dir=str(tmp_path), init_from='scratch', resume_from='', overwrite=False, eval_only=False)
    asked = []

    def resume_refusal():
        asked.append(True)
        return "another architecture"

    prepare_out_dir(spec, 'train.py', [], resume_refusal)
    assert asked == []
    (tmp_path / "ckpt.pt").write_bytes(b"an earlier run's")
    with pytest.raises(UserError, match="write this run elsewhere"):
        prepare_out_dir(spec, 'train.py', [], resume_refusal)
    assert asked == [True]


@pytest.mark.usefixtures('one_thread')
def test_out_dir_that_is_a_file(dataset, tmp_path):
    (tmp_path / "out").write_text("not a directory")
    with pytest.raises(UserError, match="is a file, not a directory"):
        train.main(train_args(dataset, tmp_path / "out"))


@pytest.mark.usefixtures('one_thread')
def test_a_second_run_is_refused_while_the_first_holds_the_lock_then_takes_it_over(dataset, tmp_path, capsys):
    """ A real train.py holds out_dir; a second run is refused; once it is SIGKILLed its lock is taken over. """
    args = train_args(dataset, tmp_path, max_iters=100000, lr_decay_iters=100000, eval_interval=100000)
    first = start_python(["-u", "train.py", *args], env=dict(os.environ, OMP_NUM_THREADS="1"))
    try:
        for line in first.stdout:
            if line.startswith("iter 1:"):
                break
        holder = json.loads((tmp_path / LOCK_NAME).read_text())
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname() and "train.py" in holder["command"]
        with pytest.raises(UserError, match=rf"is in use by another run \(pid {first.pid} on .*, started .*; lock "):
            train.main(train_args(dataset, tmp_path, max_iters=2))
    finally:
        first.kill()  # SIGKILL: no clean-up, run.lock stays behind
        first.communicate()
    assert (tmp_path / LOCK_NAME).exists()
    captured = run_train(capsys, train_args(dataset, tmp_path, max_iters=1))
    assert f"warning: took over the lock {tmp_path / LOCK_NAME} of a run that ended without releasing it " \
           f"(pid {first.pid} on {socket.gethostname()}" in captured.err
    assert not (tmp_path / LOCK_NAME).exists()  # released at the end


@pytest.mark.usefixtures('one_thread')
def test_a_lock_from_another_host_is_refused(tmp_path):
    (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "x"}))
    with pytest.raises(UserError, match=r"a run on elsewhere .* if it has ended, delete .*run.lock and start again"):
        OutDirLock(str(tmp_path)).acquire()


def _race_for_lock(out_dir, started, results):
    started.wait()
    try:
        lock = OutDirLock(out_dir).acquire()
    except UserError:
        results.put(False)
        return
    results.put(True)
    time.sleep(0.5)  # hold it while the others try
    lock.release()


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize("stale", [False, True])
def test_runs_starting_together_take_the_lock_once(tmp_path, stale):
    """ Four processes at the same moment, into a free out_dir or one with a dead run's lock: exactly one wins. """
    if stale:
        (tmp_path / LOCK_NAME).write_text(json.dumps({"pid": dead_pid(), "host": socket.gethostname()}))
    ctx = multiprocessing.get_context("fork")  # file operations only: no torch work in the children
    started = ctx.Event()
    results = ctx.Queue()
    procs = [ctx.Process(target=_race_for_lock, args=(str(tmp_path), started, results)) for _ in range(4)]
    for p in procs:
        p.start()
    started.set()
    outcomes = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    assert sorted(outcomes) == [False, False, False, True]
    assert not (tmp_path / LOCK_NAME).exists() and not [n for n in os.listdir(tmp_path) if ".tmp." in n]


# -----------------------------------------------------------------------------
# round 3 (issue 32): a lock replaced under a live run, a full disk, a dataset's directory

@pytest.mark.usefixtures('one_thread')
def test_a_lock_replaced_under_a_live_run_is_not_taken_over(tmp_path):
    """ eval.py --output_file=<out_dir>/run.lock replaced the live run's lock (a new file, not flocked): a second
    run found nothing holding it and took over. check_output refuses that output now; and a run.lock that is not
    a lock of ours is refused rather than taken over, so a second run never trains beside the first. """
    first = OutDirLock(str(tmp_path)).acquire()
    try:
        replaced = tmp_path / "other"
        replaced.write_text('{"task": "loss", "metrics": {"loss": 1.0}, "source": "x"}\n')
        os.replace(replaced, tmp_path / LOCK_NAME)
        with pytest.raises(UserError, match=r"run.lock is not a lock this project wrote .*; if no run uses .*, "
                                            r"delete .*run.lock and start again"):
            OutDirLock(str(tmp_path)).acquire()
        assert "task" in (tmp_path / LOCK_NAME).read_text()  # left as it was
    finally:
        first.release()  # no longer its file: not removed by it either
    assert (tmp_path / LOCK_NAME).exists()


@pytest.mark.usefixtures('one_thread')
def test_a_lock_nested_too_deeply_to_read_is_not_ours(dataset, tmp_path, capsys):
    """ 40,000 [ in run.lock: more than the JSON decoder's recursion allows. Not a lock of ours: refused, kept. """
    (tmp_path / LOCK_NAME).write_text('[' * 40000)
    assert exit_code(lambda: train.main(train_args(dataset, tmp_path, max_iters=1))) == 2
    assert one_error_line(capsys) == (f"error: {tmp_path / LOCK_NAME} is not a lock this project wrote (it holds no "
                                      f"run's pid); if no run uses {tmp_path}, delete {tmp_path / LOCK_NAME} and "
                                      f"start again")
    assert os.listdir(tmp_path) == [LOCK_NAME] and (tmp_path / LOCK_NAME).read_text() == '[' * 40000


@pytest.mark.usefixtures('one_thread')
def test_a_full_disk_while_writing_the_lock_is_one_line(tmp_path, monkeypatch):
    import errno

    from nanogpt_plus import outputs

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(outputs.os, "write", full)
    with pytest.raises(UserError, match=r"^could not write the lock .*run.lock \(No space left on device\); make "
                                        r"room on the disk"):
        OutDirLock(str(tmp_path)).acquire()
    monkeypatch.undo()
    assert os.listdir(tmp_path) == []  # no lock and no temp file left behind


@pytest.mark.usefixtures('one_thread')
def test_an_out_dir_that_is_a_datasets_directory_is_refused(dataset, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(dataset, data)
    before = sorted(os.listdir(data))
    with pytest.raises(UserError, match=r"out_dir .*data is a dataset's directory \(it holds train.bin\)"):
        train.main(train_args(str(data), data, max_iters=1))
    assert sorted(os.listdir(data)) == before


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize("make, message", [
    (lambda out: (out / 'run.lock').mkdir(parents=True), "run.lock is not a lock file"),
    (lambda out: (out / 'metrics.jsonl').mkdir(parents=True), "metrics.jsonl is not a file"),
])
def test_an_out_dir_with_things_in_the_way_is_one_line(dataset, tmp_path, make, message):
    out = tmp_path / 'out'
    make(out)
    assert message in one_line(train_args(dataset, out, max_iters=1))


@pytest.mark.usefixtures('one_thread')
def test_an_unwritable_out_dir_is_one_line(dataset):
    if not os.path.isdir('/proc/sys'):
        pytest.skip("needs Linux's read-only /proc/sys")
    assert "could not write in out_dir /proc/sys" in one_line(train_args(dataset, '/proc/sys', max_iters=1))


TEXT = os.path.join(REPO, "data", "text", "prepare.py")


CHAR = os.path.join(REPO, "data", "shakespeare_char", "prepare.py")


GPT2 = os.path.join(REPO, "data", "shakespeare", "prepare.py")


def prepare(monkeypatch, script, *args):
    """ A data/<name>/prepare.py in this process, as a command line runs it: its exit code. """
    monkeypatch.setattr(sys, "argv", ["prepare.py", *args])
    return exit_code(runpy.run_path(script)["main"])


def contents(directory):
    """ Every file in directory (not below it) and its bytes. """
    names = sorted(os.listdir(directory))
    return {n: (directory / n).read_bytes() for n in names if (directory / n).is_file()}


@pytest.fixture
def texts(tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("to be or not to be, that is the question\n" * 60)
    other = tmp_path / "other.txt"
    other.write_text("all the world's a stage, and all the men and women merely players\n" * 40)
    return small, other


# -----------------------------------------------------------------------------
# a prepare script replaces another dataset only with --overwrite=True

@pytest.mark.usefixtures('one_thread')
def test_another_corpus_tokenizer_or_vocabulary_is_refused_and_the_same_preparation_allowed(
        tmp_path, texts, monkeypatch, capsys):
    small, other = texts
    ds = tmp_path / "ds"
    cache = f"--cache_dir={tmp_path / 'cache'}"
    assert prepare(monkeypatch, CHAR, f"--input={small}", f"--out_dir={ds}") == 0
    made = contents(ds)
    assert set(made) == {"train.bin", "val.bin", "meta.json", "meta.pkl"}
    record = json.loads(made["meta.json"])["preparation"]
    assert record["tokenizer"] == "char"
    assert record["vocabulary"]["vocab_size"] == len(set(small.read_text()))
    capsys.readouterr()
    # the flips: another tokenizer (gpt2, a trained bpe) through data/text, another text,
    # GPT-2 BPE
    refused = {
        (TEXT, f"--input={small}", "--tokenizer=gpt2", cache): "the corpus",
        (TEXT, f"--input={small}", "--tokenizer=bpe", "--vocab_size=260", cache): "the corpus",
        (CHAR, f"--input={other}"): f"then, a text of {len(other.read_text()):,} characters",
        (GPT2, f"--input={small}"): "the tokenizer char then, the tokenizer gpt2 now",
    }
    for (script, *args), words in refused.items():
        assert prepare(monkeypatch, script, *args, f"--out_dir={ds}") == 2
        line = one_error_line(capsys)
        assert line.startswith(f"error: {ds} holds another dataset: ") and words in line, line
        assert line.endswith("pass --overwrite=True to replace it, or another --out_dir")
        assert contents(ds) == made  # not a byte changed, meta.pkl still there
    # the same preparation again is a re-run: allowed, the same files
    assert prepare(monkeypatch, CHAR, f"--input={small}", f"--out_dir={ds}") == 0
    assert contents(ds) == made
    # data/text's own datasets: another vocabulary (the same corpus and tokenizer kind) is another
    # dataset too
    text_ds = tmp_path / "text_ds"
    common = (f"--input={small}", "--tokenizer=bpe", f"--out_dir={text_ds}", cache, "--num_proc=1")
    assert prepare(monkeypatch, TEXT, *common, "--vocab_size=260") == 0
    bpe = contents(text_ds)
    assert prepare(monkeypatch, TEXT, *common, "--vocab_size=260") == 0 and contents(text_ds) == bpe
    capsys.readouterr()
    assert prepare(monkeypatch, TEXT, *common, "--vocab_size=270") == 2
    assert "the tokenizer bpe of 260 tokens trained on the corpus then" in one_error_line(capsys)
    assert contents(text_ds) == bpe
    # --overwrite=True replaces it, and says so
    assert prepare(monkeypatch, TEXT, f"--input={small}", "--tokenizer=gpt2", f"--out_dir={ds}",
                   cache, "--overwrite=True") == 0
    assert f"--overwrite=True: replacing the dataset in {ds}" in capsys.readouterr().out
    assert json.loads((ds / "meta.json").read_text())["kind"] == "gpt2"
    assert not (ds / "meta.pkl").exists()


@pytest.mark.usefixtures('one_thread')
def test_a_dataset_that_records_no_preparation_is_refused(tmp_path, texts, monkeypatch, capsys,
                                                          tiny_dataset):
    """ Made by an earlier version, nanoGPT or by hand: nothing says it is the same dataset. """
    ds = tmp_path / "old"
    ds.mkdir()
    for name in ("train.bin", "val.bin", "meta.json"):  # conftest's tiny dataset, made by hand
        shutil.copy(os.path.join(tiny_dataset, name), ds / name)
    before = contents(ds)
    assert prepare(monkeypatch, CHAR, f"--input={texts[0]}", f"--out_dir={ds}") == 2
    assert "holds a dataset whose preparation is not recorded" in one_error_line(capsys)
    assert contents(ds) == before


@pytest.mark.usefixtures('one_thread')
def test_a_users_temp_named_file_survives_train_and_prepare_in_the_current_directory(
        dataset, tmp_path, texts, monkeypatch, capsys):
    work = tmp_path / "work"
    work.mkdir()
    thesis = work / ".thesis.tmp.4242"
    thesis.write_text("chapter 1")
    bin_like = work / f".train.bin.tmp.{dead_pid()}"
    bin_like.write_text("mine too")
    monkeypatch.chdir(work)
    train.main(train_args(dataset, ".", max_iters=1, eval_interval=1))  # --out_dir=.
    assert prepare(monkeypatch, CHAR, f"--input={texts[0]}", "--out_dir=.", "--overwrite=True") == 0
    assert thesis.read_text() == "chapter 1" and bin_like.read_text() == "mine too"


@pytest.mark.usefixtures('one_thread')
def test_a_refused_run_sweeps_nothing(dataset, tmp_path, capsys):
    """ The earlier run's checkpoint makes the new run a refusal: it leaves out_dir as it was. """
    args = train_args(dataset, tmp_path, max_iters=1, eval_interval=1)
    train.main(args)
    ours = dead_runs_temp(tmp_path / "ckpt.pt", dead_pid())
    ours.write_text("half a checkpoint")
    before = contents(tmp_path)
    assert exit_code(lambda: train.main(args)) == 2
    assert "already holds the checkpoint ckpt.pt" in one_error_line(capsys)
    assert contents(tmp_path) == before


# -----------------------------------------------------------------------------
# a live run's out_dir takes no output, --overwrite=True or not

def hold_lock_as_another_run(directory):
    """ run.lock flocked by a file of this process but naming another pid: a live run to others. """
    fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.write(fd, json.dumps({"pid": 1, "host": socket.gethostname(), "started": "today"}).encode())
    return fd


@pytest.mark.usefixtures('one_thread')
def test_check_output_refuses_a_live_runs_out_dir_but_not_our_own(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    fd = hold_lock_as_another_run(run)
    try:
        for path, kind in ((run, "directory"), (run / "eval.json", "file")):
            live = r"is in the out_dir of a live run \(pid 1 on .*--overwrite=True or not"
            with pytest.raises(UserError, match=live):
                check_output(str(path), "x", overwrite=True, kind=kind)
        check_output(str(run / "hf"), "hf_dir", overwrite=False, kind="directory")  # below it: fine
    finally:
        os.close(fd)
    check_output(str(run), "hf_dir", overwrite=False, kind="directory")  # the run ended
    lock = OutDirLock(str(run)).acquire()  # this process's own run: its outputs may go there
    try:
        check_output(str(run / "predictions.jsonl"), "predict_out", overwrite=False)
    finally:
        lock.release()


LOCK_HOLDER = ("import sys, time\n"
               "from nanogpt_plus.outputs import OutDirLock\n"
               "OutDirLock(sys.argv[1]).acquire()\n"
               "print('held', flush=True)\n"
               "time.sleep(300)\n")


@pytest.mark.usefixtures('one_thread')
def test_a_live_lock_refuses_prepare_and_export_even_with_overwrite(dataset, tmp_path, texts,
                                                                    monkeypatch, capsys):
    """ A real process holds the run's lock: prepare.py and export_hf.py into it change nothing. """
    run = tmp_path / "run"
    # a run's files: ckpt.pt, metrics.jsonl
    train.main(train_args(dataset, run, max_iters=1, eval_interval=1))
    holder = start_python(["-c", LOCK_HOLDER, str(run)], env=dict(os.environ, PYTHONPATH=REPO))
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        before = contents(run)
        capsys.readouterr()
        text = f"--input={texts[0]}"
        for script, args in ((TEXT, (text, "--tokenizer=char")), (CHAR, (text,))):
            assert prepare(monkeypatch, script, *args, f"--out_dir={run}", "--overwrite=True") == 2
            assert one_error_line(capsys) == (
                f"error: {run} is the out_dir of a live training run (its run.lock is held), which "
                f"no dataset may be written into, --overwrite=True or not; pass another --out_dir")
        assert exit_code(lambda: run_script(export_hf, monkeypatch, f"--out_dir={run}",
                                            f"--hf_dir={run}", "--overwrite=True")) == 2
        line = one_error_line(capsys)
        assert line.startswith(
            f"error: --hf_dir={run} is in the out_dir of a live run (pid {holder.pid} on ")
        assert contents(run) == before
    finally:
        holder.kill()
        holder.communicate()


def shard_dir(path):
    """ A directory of llm.c shards as data/fineweb/prepare.py leaves it (the tokens need not be real ones). """
    path.mkdir()
    write_shard(str(path / "edufineweb_val_000000.bin"), np.arange(100, dtype=np.uint16))
    write_shard(str(path / "edufineweb_train_000001.bin"), np.arange(100, dtype=np.uint16))
    (path / "meta.json").write_text('{"kind": "gpt2", "dtype": "uint16", "shards": []}')
    return path


def raw_dir(path):
    """ A directory holding nanoGPT's train.bin / val.bin and their meta. """
    path.mkdir()
    for split in ("train", "val"):
        np.arange(100, dtype=np.uint16).tofile(path / f"{split}.bin")
    (path / "meta.json").write_text('{"kind": "gpt2", "vocab_size": 50257, "dtype": "uint16"}')
    return path


def contents_of(path):
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_run_files_are_the_training_scripts_names(tmp_path):
    """ What makes a directory a run's is what the training scripts write: checkpoint.py's names, the lock. """
    from nanogpt_plus.checkpoint import BEST, CHECKPOINT, LAST
    from nanogpt_plus.outputs import LOCK_NAME, run_files
    assert LOCK_NAME in RUN_FILES and "metrics.jsonl" in RUN_FILES
    names = [CHECKPOINT, BEST, LAST, "ckpt_2000.pt", *RUN_FILES]
    for name in names + ["ckpt.txt", "input.txt"]:
        (tmp_path / name).write_bytes(b"x")
    assert run_files(str(tmp_path)) == sorted(names)


@pytest.mark.parametrize("writes, make, holds", [(RAW, shard_dir, "a dataset of llm.c token shards"),
                                                 (SHARDS, raw_dir, "a train.bin/val.bin dataset")])
def test_another_kind_of_dataset_is_refused_and_overwrite_replaces_it(writes, make, holds, tmp_path, capsys):
    d = make(tmp_path / "d")
    before = contents_of(d)
    with pytest.raises(UserError) as e:
        check_out_dir(str(d), writes)
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{d} holds {holds} (")
    assert message.endswith("; pass --overwrite=True to replace it, or another --out_dir")
    assert contents_of(d) == before  # nothing touched
    # overwrite: the other kind's token files and meta go, so the directory will hold one kind
    (d / "input.txt").write_text("kept")
    check_out_dir(str(d), writes, overwrite=True)
    assert sorted(os.listdir(d)) == ["input.txt"]
    assert "--overwrite=True: removed" in capsys.readouterr().out


@pytest.mark.parametrize("run_file", ["ckpt.pt", "ckpt_best.pt", "ckpt_1000.pt", "run.lock", "metrics.jsonl"])
@pytest.mark.parametrize("writes", [RAW, SHARDS])
def test_a_training_runs_out_dir_is_refused(run_file, writes, tmp_path):
    (tmp_path / run_file).write_bytes(b"x")
    with pytest.raises(UserError, match=rf"^{re.escape(str(tmp_path))} holds a training run's files \({run_file}\), "
                                        r"not a dataset; pass another --out_dir, or --overwrite=True"):
        check_out_dir(str(tmp_path), writes)
    check_out_dir(str(tmp_path), writes, overwrite=True)
    # overwrite writes beside a run's files, never removes them
    assert os.listdir(tmp_path) == [run_file]


def test_the_same_kind_again_or_a_new_directory_is_fine(tmp_path):
    check_out_dir(str(raw_dir(tmp_path / "raw")), RAW)
    check_out_dir(str(shard_dir(tmp_path / "shards")), SHARDS)
    check_out_dir(str(tmp_path / "new"), RAW)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "input.txt").write_text("text")  # a Shakespeare script's own download
    (tmp_path / "other" / "ckpt.txt").write_text("not a checkpoint")
    check_out_dir(str(tmp_path / "other"), SHARDS)


PLAY_TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n" * 30


@pytest.mark.parametrize("name", ["shakespeare_char", "shakespeare", "text", "openwebtext"])
def test_every_raw_writer_refuses_a_directory_of_shards(name, tmp_path, monkeypatch, capsys):
    (tmp_path / "in.txt").write_text(PLAY_TEXT)
    shards = shard_dir(tmp_path / "fineweb")
    before = contents_of(shards)
    source = f"--files={tmp_path / 'in.txt'}" if name == "openwebtext" else f"--input={tmp_path / 'in.txt'}"
    args = [source, f"--out_dir={shards}"] + (["--tokenizer=char"] if name == "text" else [])
    code, _, err = run(f"data/{name}/prepare.py", monkeypatch, capsys, *args)
    assert_one_line_error(code, err, f"{shards} holds a dataset of llm.c token shards (edufineweb_train_000001.bin, "
                                     f"edufineweb_val_000000.bin) and this script writes a train.bin/val.bin dataset; "
                                     f"pass --overwrite=True to replace it, or another --out_dir")
    # meta.json too: data/fineweb/prepare.py can still resume there
    assert contents_of(shards) == before


def test_the_shard_writer_refuses_a_raw_dataset_and_a_training_run(tmp_path, monkeypatch, capsys):
    raw = raw_dir(tmp_path / "raw")
    before = contents_of(raw)
    code, _, err = run("data/fineweb/prepare.py", monkeypatch, capsys, f"--out_dir={raw}")
    assert_one_line_error(code, err, f"{raw} holds a train.bin/val.bin dataset (train.bin, val.bin) and this script "
                                     f"writes a dataset of llm.c token shards; pass --overwrite=True")
    assert contents_of(raw) == before
    run_dir = tmp_path / "out"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("{}\n")
    code, _, err = run("data/fineweb/prepare.py", monkeypatch, capsys, f"--out_dir={run_dir}")
    assert_one_line_error(code, err, f"{run_dir} holds a training run's files (metrics.jsonl), not a dataset")


def test_a_shakespeare_script_refuses_a_training_runs_out_dir_before_any_download(tmp_path, monkeypatch, capsys):
    out = tmp_path / "out-shakespeare-char"
    out.mkdir()
    (out / "ckpt.pt").write_bytes(b"a checkpoint")
    code, _, err = run("data/shakespeare_char/prepare.py", monkeypatch, capsys, f"--out_dir={out}", "--url=")
    assert_one_line_error(code, err, f"{out} holds a training run's files (ckpt.pt), not a dataset")
    assert os.listdir(out) == ["ckpt.pt"]  # no input.txt saved there either


def test_preparing_again_works_and_overwrite_replaces_shards(tmp_path, monkeypatch, capsys):
    (tmp_path / "in.txt").write_text(PLAY_TEXT)
    out = tmp_path / "char"
    args = [f"--input={tmp_path / 'in.txt'}", f"--out_dir={out}"]
    for _ in range(2):  # the same kind into its own directory: no --overwrite needed
        code, _, err = run("data/shakespeare_char/prepare.py", monkeypatch, capsys, *args)
        assert code == 0, err
    first = contents_of(out)
    # a directory of shards, taken with --overwrite=True: one kind of token files after, which the loader reads
    shards = shard_dir(tmp_path / "shards")
    code, out_text, err = run("data/shakespeare_char/prepare.py", monkeypatch, capsys, args[0], f"--out_dir={shards}",
                              "--overwrite=True")
    assert code == 0, err
    assert "removed a dataset of llm.c token shards" in out_text
    assert contents_of(shards) == first
    assert find_shards(str(shards)) == ([str(shards / "train.bin")], [str(shards / "val.bin")])
    x, _ = TokenWindowLoader(split_files(str(shards), "train"), 2, 8, seed=0).next_batch()
    assert x.shape == (2, 8)


def fifo_and_link_to_it(directory):
    """ A named pipe in directory and a symbolic link to it: outputs that would hang or lose the node. """
    fifo, link = os.path.join(directory, 'pipe'), os.path.join(directory, 'pipe-link')
    os.mkfifo(fifo)
    os.symlink(fifo, link)
    return fifo, link


@pytest.mark.usefixtures('one_thread')
def test_an_output_that_is_not_a_regular_file_is_refused_in_every_script(char_run, tmp_path, monkeypatch, capsys):
    out, data = char_run
    fifo, link = fifo_and_link_to_it(str(tmp_path))
    train_file, _ = make_task(tmp_path, 'classification', n_train=8, n_val=4)
    model = ['--init_from=resume', f'--out_dir={out}', '--device=cpu']
    runs = {  # script: its settings, the output last
        'eval.py': [*model, f'--dataset={data}', '--task=loss', '--max_examples=3', '--output_file='],
        'eval.py core': [*model, '--task=core', f'--core_dir={tmp_path}/no-bundle', '--output_file='],
        'finetune.py': ['--task=classification', f'--init_from={out}', f'--out_dir={tmp_path}/ft', '--device=cpu',
                        f'--train_file={train_file}', f'--predict_file={train_file}', '--predict_out='],
        'finetune.py predict': [f'--init_from={out}', f'--predict_file={train_file}', '--predict_out='],
        'export_hf.py': ['--init_from=resume', f'--out_dir={out}', '--hf_dir='],
        'bench.py': ['--device=cpu', '--profile=True', '--profile_dir='],
        'scripts/plot_metrics.py': [f'--out_dir={out}', '--output='],
    }
    before = sorted(os.listdir(tmp_path))
    for name, args in runs.items():
        for target in (fifo, link, '/dev/null'):
            code, stdout, err = run(name.split()[0], monkeypatch, capsys, *args[:-1], args[-1] + target)
            what = 'a character device' if target == '/dev/null' else 'a FIFO (named pipe)'
            if target == link:
                what = 'a symbolic link to ' + what
            assert_one_line_error(code, err, f"{args[-1]}{target} is {what}, not a regular file")
            assert stdout == '' or 'step' not in stdout  # refused before any work
    # the pipe is still a pipe, the link still a link to it, and nothing else was made
    assert os.path.islink(link) and os.readlink(link) == fifo and stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert sorted(os.listdir(tmp_path)) == before


def test_an_output_file_at_a_symbolic_link_is_refused_and_the_link_kept(char_run, tmp_path, monkeypatch, capsys):
    out, data = char_run
    target = tmp_path / 'results' / 'run1.json'
    target.parent.mkdir()
    target.write_text('{"task": "loss", "metrics": {"loss": 2.0}, "source": "x"}\n')
    link = tmp_path / 'latest.json'
    link.symlink_to(target)
    before = target.read_bytes()
    code, _, err = run('eval.py', monkeypatch, capsys, '--init_from=resume', f'--out_dir={out}', f'--dataset={data}',
                       '--device=cpu', '--max_examples=2', f'--output_file={link}')
    assert_one_line_error(code, err, f"--output_file={link} is a symbolic link (to {target}), which an output would "
                                     f"replace; pass the path it points to")
    assert os.path.islink(link) and target.read_bytes() == before


PREPARE_CHAR = 'data/shakespeare_char/prepare.py'


@pytest.fixture
def play(tmp_path):
    text = tmp_path / 'play.txt'
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 50)
    return str(text)


def test_a_prepare_keeps_a_users_meta_files_where_there_are_no_token_files(tmp_path, play, monkeypatch, capsys):
    for name, content in (('meta.json', b'{"my": "settings"}'), ('meta.pkl', pickle.dumps({'mine': 1})),
                          ('tokenizer.json', b'{"my": "tokenizer"}')):
        u1 = tmp_path / f'u-{name}'
        u1.mkdir()
        (u1 / name).write_bytes(content)
        code, _, err = run(PREPARE_CHAR, monkeypatch, capsys, f'--input={play}', f'--out_dir={u1}')
        assert_one_line_error(code, err, f"{u1} holds {name} but no token files: files no prepare of this project "
                                         f"wrote (a meta.json of ours records its preparation), which this one would "
                                         f"replace; pass another --out_dir, or --overwrite=True to replace them")
        assert os.listdir(u1) == [name] and (u1 / name).read_bytes() == content
    # --overwrite=True: the user's say
    code, _, err = run(PREPARE_CHAR, monkeypatch, capsys, f'--input={play}', f'--out_dir={u1}', '--overwrite=True')
    assert code == 0, err
    assert {'train.bin', 'val.bin', 'meta.json'} <= set(os.listdir(u1))
    # a meta.json of ours whose token files were deleted is ours to replace
    for name in ('train.bin', 'val.bin'):
        os.remove(u1 / name)
    code, _, err = run(PREPARE_CHAR, monkeypatch, capsys, f'--input={play}', f'--out_dir={u1}')
    assert code == 0 and (u1 / 'train.bin').exists(), err


def test_two_prepares_in_one_directory_never_both_write(tmp_path, play, monkeypatch, capsys):
    out = tmp_path / 'd'
    # another prepare holds the directory (its checks done, its text being tokenized)
    with preparing(str(out)):
        code, _, err = run(PREPARE_CHAR, monkeypatch, capsys, f'--input={play}', f'--out_dir={out}')
        assert_one_line_error(code, err, f"another process is preparing a dataset in {out} right now; wait for it "
                                         f"to end, or pass another --out_dir")
        assert os.listdir(out) == []
    # once the first has ended, the next one may write
    code, _, err = run(PREPARE_CHAR, monkeypatch, capsys, f'--input={play}', f'--out_dir={out}')
    assert code == 0 and (out / 'train.bin').exists(), err
    # a refused prepare into a new directory leaves nothing either
    code, _, err = run(PREPARE_CHAR, monkeypatch, capsys, f'--input={tmp_path}/nothing.txt', f'--out_dir={tmp_path}/e')
    assert code == 2 and not (tmp_path / 'e').exists(), err


# -----------------------------------------------------------------------------
# a refused run leaves no out_dir of its own making behind

def broken_dataset(dataset, to, break_it):
    shutil.copytree(dataset, to)
    break_it(to)
    return str(to)


def _fifo_train_bin(d):
    os.remove(d / 'train.bin')
    os.mkfifo(d / 'train.bin')


def _val_id_past_the_vocabulary(d):
    ids = np.fromfile(d / 'val.bin', dtype=np.uint16)
    ids[7] = 40
    ids.tofile(d / 'val.bin')


REFUSED_DATASETS = {
    'missing': (lambda d: shutil.rmtree(d), "no token file at"),
    'a FIFO train.bin': (_fifo_train_bin, "train.bin is a FIFO (named pipe), not a regular token file"),
    'meta.json not JSON': (lambda d: (d / 'meta.json').write_text('{"kind": "char"'), "meta.json is unreadable"),
    "meta.json's kind gpt2 over characters": (
        lambda d: (d / 'meta.json').write_text('{"kind": "gpt2", "vocab_size": 20}'),
        "meta.json says kind 'gpt2' with vocab_size=20, but GPT-2's tokenizer has 50,257 tokens"),
    'an id past the vocabulary': (_val_id_past_the_vocabulary, "val.bin holds token ids up to 40"),
}


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize('case', list(REFUSED_DATASETS))
def test_a_run_refused_for_its_data_leaves_no_out_dir(case, dataset, tmp_path, capsys):
    break_it, message = REFUSED_DATASETS[case]
    data = broken_dataset(dataset, tmp_path / 'data', break_it)
    out = tmp_path / 'runs' / 'a' / 'out'  # three directories made for it, all removed again
    assert exit_code(lambda: train.main(train_args(data, out, max_iters=1))) == 2
    assert message in one_error_line(capsys)
    assert sorted(os.listdir(tmp_path)) == (['data'] if case != 'missing' else [])


@pytest.mark.usefixtures('one_thread')
def test_a_refused_run_keeps_an_out_dir_it_did_not_make_and_what_is_in_it(dataset, tmp_path, capsys, monkeypatch):
    import errno

    from nanogpt_plus import outputs
    data = broken_dataset(dataset, tmp_path / 'data', _fifo_train_bin)
    (tmp_path / 'mine').mkdir()
    assert exit_code(lambda: train.main(train_args(data, tmp_path / 'mine', max_iters=1))) == 2
    assert "not a regular token file" in one_error_line(capsys)
    assert os.listdir(tmp_path / 'mine') == []  # the user's own empty directory stays
    # a full disk while writing the lock: the new out_dir goes again
    monkeypatch.setattr(outputs.os, 'write', lambda fd, data: (_ for _ in ()).throw(
        OSError(errno.ENOSPC, "No space left on device")))
    assert exit_code(lambda: train.main(train_args(dataset, tmp_path / 'new', max_iters=1))) == 2
    assert "(No space left on device); make room on the disk" in one_error_line(capsys)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ['data', 'mine']


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize('bad', ['{"text": "abc", "label": 0}\n{"text": \n', '{"text": "abc"}\n'])
def test_a_fine_tune_refused_for_its_task_file_leaves_no_out_dir(bad, tmp_path, monkeypatch, capsys):
    from helpers import make_source
    src = make_source(tmp_path / 'src')
    train_file, val = make_task(tmp_path, 'classification', n_train=16, n_val=4)
    (tmp_path / 'bad.jsonl').write_text(bad)
    before = sorted(os.listdir(tmp_path))
    args = ['--task=classification', f'--init_from={src}', f'--out_dir={tmp_path / "ft"}', f'--val_file={val}',
            '--epochs=1', '--batch_size=8', '--device=cpu']
    code = exit_code(lambda: run_script(finetune, monkeypatch, *args, f'--train_file={tmp_path / "bad.jsonl"}'))
    assert code == 2 and 'bad.jsonl' in one_error_line(capsys)
    assert sorted(os.listdir(tmp_path)) == before
