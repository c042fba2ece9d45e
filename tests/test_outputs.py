"""
Where outputs may go (nanogpt_plus.outputs.check_output, issue 24): eval.py --output_file, finetune.py
--predict_out and export_hf.py --hf_dir never replace a checkpoint, a dataset's files, a directory holding them
or a file the run reads, unless --overwrite=True; an earlier output of the same script is replaced, as a re-run
does; an output that can't be written at all is one line, before any work.

Round 3 (issue 32): a file output replaces an existing file only when that file is an earlier output of the same
kind (an eval result, a predictions file), never a run's metrics.jsonl or sidecar, a corpus, a script or a
JSONL input; and a run's lock is never an output, --overwrite=True or not.
"""
import json
import os
import pickle

import numpy as np
import pytest
import torch

import eval as eval_script
import export_hf
import finetune
from helpers import run_script, save_test_checkpoint
from model import GPT, GPTConfig
from nanogpt_plus.dataset.shards import write_shard
from nanogpt_plus.errors import UserError
from nanogpt_plus.hf_export import export
from nanogpt_plus.outputs import check_output
from nanogpt_plus.tokenizer import CharTokenizer
from test_finetune import SINGLE, config, make_task, write_jsonl

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

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


def test_export_that_fails_midway_is_one_line(tmp_path):
    # the transformers writers don't go through atomic_write: their OSErrors are said in one line too (here a
    # directory is where config.json goes, which fails for root as well as for any user)
    tok = CharTokenizer.from_text(CHARS)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=tok.vocab_size))
    (tmp_path / 'hf' / 'config.json').mkdir(parents=True)
    with pytest.raises(UserError, match=r"^could not write the Hugging Face directory .*hf \(.*config.json: Is a "
                                        r"directory\); fix its permissions .*export again$"):
        export(model, tok.meta(), str(tmp_path / 'hf'))


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


def test_a_runs_lock_is_never_an_output(files):
    lock = os.path.join(files['out'], 'run.lock')
    with open(lock, 'w') as f:
        f.write('{"pid": 1, "host": "h"}\n')
    for overwrite in (False, True):
        for kind in ('file', 'directory'):
            with pytest.raises(UserError, match=r"is a run's lock \(run.lock\), which no output may replace"):
                check_output(lock, 'output_file', overwrite, kind=kind, output_kind='eval result')
    assert json.load(open(lock)) == {'pid': 1, 'host': 'h'}


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
