"""
Settings that mean what they say, and the last tracebacks (issue 32): a schedule that contradicts itself, an
architecture setting that differs from the weights a run starts from, optimizer settings changed on resume, a
first step that can't fit in memory, a JSONL text that is not a string, an output directory where a file is,
and the smaller ones (the words of a NaN before any save, the hint for a dataset given as a path, a directory as
--input, files an earlier preparation left, an --overwrite=True fine-tune and the earlier run's ckpt_last.pt).
"""
import json
import os
import re
import signal
import time
from dataclasses import replace

import pytest
import torch

import bench
import finetune
import train
from configurator import parse_config
from helpers import iter_losses, run_script, start_python, train_args
from model import GPTConfig
from nanogpt_plus import machine
from nanogpt_plus.checkpoint import Checkpointer, load_checkpoint
from nanogpt_plus.dataloader import open_tokens
from nanogpt_plus.distributed import DistInfo
from nanogpt_plus.errors import UserError, non_finite_loss
from nanogpt_plus.machine import check_model_memory
from nanogpt_plus.prepare.corpus import expand_files, prepare_corpus
from nanogpt_plus.signals import GracefulExit
from test_finetune import make_source, make_task

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
SINGLE = DistInfo(False, 0, 0, 1, 'cpu')


def run_train(capsys, args):
    train.main(args)
    return capsys.readouterr()


# -----------------------------------------------------------------------------
# the schedule

def test_a_decay_that_ends_where_the_warmup_does_is_refused():
    for decay in (100, 50):
        with pytest.raises(UserError, match=rf"lr_decay_iters \({decay}\) is not past warmup_iters \(100\), so the "
                                            r"rate would drop from learning_rate to min_lr right after the warmup"):
            train.check_settings(parse_config(train.DEFAULTS, ["--warmup_iters=100", f"--lr_decay_iters={decay}"]))
    # a constant rate asks for no decay at all
    train.check_settings(parse_config(train.DEFAULTS, ["--warmup_iters=100", "--lr_decay_iters=50",
                                                       "--decay_lr=False"]))


def test_a_warmup_longer_than_the_run_is_said_with_the_rate_it_reaches(dataset, tmp_path, capsys):
    captured = run_train(capsys, train_args(dataset, tmp_path, max_iters=3, warmup_iters=9, lr_decay_iters=20,
                                            learning_rate=1e-2, num_threads=1))
    note = [line for line in captured.out.splitlines() if line.startswith('note: warmup_iters')]
    assert note == ["note: warmup_iters (9) is past max_iters (3): the learning rate rises to 0.004 at the last "
                    "iteration and never reaches learning_rate (0.01)"]
    lrs = [r['lr'] for r in map(json.loads, open(tmp_path / 'metrics.jsonl')) if r['type'] == 'iter']
    assert lrs[-1] == pytest.approx(0.004)  # what the line said, iteration 3's rate


# -----------------------------------------------------------------------------
# given weights keep their architecture (train.py and finetune.py)

@pytest.fixture
def trained(dataset, tmp_path_factory):
    """ A tiny train.py run's out_dir (2 layers, 32 wide, block_size 16). """
    out = tmp_path_factory.mktemp('trained')
    train.main(train_args(dataset, out, max_iters=4, eval_interval=4, num_threads=1))
    return str(out)


@pytest.mark.parametrize("setting, words", [("--n_layer=4", "--n_layer=4 but {} has n_layer=2"),
                                            ("--pos=rope", "--pos='rope' but {} has pos='learned'"),
                                            ("--tie_embeddings=False", "--tie_embeddings=False but {} has "
                                                                       "tie_embeddings=True"),
                                            ("--block_size=64", "--block_size=64 but {} has block_size=16")])
def test_init_from_weights_refuses_another_architecture(trained, dataset, tmp_path, setting, words):
    args = [f"--dataset={dataset}", f"--out_dir={tmp_path}", "--device=cpu", f"--init_from={trained}", setting]
    source = os.path.join(trained, 'ckpt.pt')
    with pytest.raises(UserError) as e:
        train.main(args)
    assert str(e.value).startswith(words.format(source) + "; a model trained from given weights keeps their "
                                   "architecture (dropout and a smaller block_size may change)")
    assert not os.path.exists(tmp_path / 'ckpt.pt')


def test_init_from_weights_may_change_dropout_and_crop_and_saves_what_it_trained(trained, dataset, tmp_path, capsys):
    # no architecture setting given: the weights' (block_size too, not train.py's default of 1024)
    run_train(capsys, [f"--dataset={dataset}", f"--out_dir={tmp_path / 'a'}", "--device=cpu", "--compile=False",
                       f"--init_from={trained}", "--max_iters=1", "--eval_interval=1", "--eval_iters=1",
                       "--batch_size=2", "--warmup_iters=0", "--lr_decay_iters=2", "--num_threads=1"])
    ckpt = load_checkpoint(str(tmp_path / 'a' / 'ckpt.pt'))
    for key, value in ckpt['model_args'].items():
        if key != 'vocab_size':
            # the saved config says how the model was built
            assert ckpt['config'][key] == value, key
    assert ckpt['model_args']['n_layer'] == 2 and ckpt['model_args']['block_size'] == 16
    # dropout and a shorter context may change
    run_train(capsys, train_args(dataset, tmp_path / 'b', init_from=trained, dropout=0.1, block_size=8, max_iters=1,
                                 num_threads=1))
    ckpt = load_checkpoint(str(tmp_path / 'b' / 'ckpt.pt'))
    assert ckpt['model_args']['block_size'] == 8 and ckpt['model_args']['dropout'] == 0.1


def test_finetune_from_weights_refuses_another_architecture(tmp_path, monkeypatch):
    src = tmp_path / 'src'
    make_source(src)
    train_file, val_file = make_task(tmp_path, 'classification', n_train=16, n_val=8)
    common = ['--task=classification', f'--init_from={src}', f'--train_file={train_file}', f'--val_file={val_file}',
              '--device=cpu', f'--out_dir={tmp_path / "ft"}']
    with pytest.raises(UserError, match=rf"^--n_layer=4 but {src}/ckpt.pt has n_layer=2; a model trained from given "
                                        r"weights keeps their architecture"):
        run_script(finetune, monkeypatch, *common, '--n_layer=4')
    assert not os.path.exists(tmp_path / 'ft')


# -----------------------------------------------------------------------------
# optimizer settings given on resume are applied, and the checkpoint says so

def test_adamw_settings_given_on_resume_are_applied(dataset, tmp_path, capsys):
    run_train(capsys, train_args(dataset, tmp_path, max_iters=4, eval_interval=4, num_threads=1))
    out = run_train(capsys, train_args(dataset, tmp_path, max_iters=6, eval_interval=4, num_threads=1,
                                       init_from='resume', beta2=0.99, weight_decay=0.05)).out
    assert "resuming with this run's optimizer settings: betas (0.9, 0.95) -> (0.9, 0.99), weight_decay 0.1 -> " \
           "0.05" in out
    ckpt = load_checkpoint(str(tmp_path / 'ckpt.pt'))
    groups = ckpt['optimizer']['param_groups']
    assert [tuple(g['betas']) for g in groups] == [(0.9, 0.99)] * 2
    assert [g['weight_decay'] for g in groups] == [0.05, 0.0]  # the vectors never decay
    assert ckpt['config']['beta2'] == 0.99 and ckpt['config']['weight_decay'] == 0.05
    # an unchanged resume changes nothing and says nothing
    out = run_train(capsys, train_args(dataset, tmp_path, max_iters=7, eval_interval=4, num_threads=1,
                                       init_from='resume', beta2=0.99, weight_decay=0.05)).out
    assert "optimizer settings" not in out


def test_muon_settings_given_on_resume_are_applied(dataset, tmp_path, capsys):
    run = dict(max_iters=4, eval_interval=4, num_threads=1, optimizer='muon')
    run_train(capsys, train_args(dataset, tmp_path, **run))
    run_train(capsys, train_args(dataset, tmp_path, **dict(run, max_iters=6), init_from='resume', muon_momentum=0.9,
                                 muon_lr=0.01, muon_weight_decay=0.01))
    muon = load_checkpoint(str(tmp_path / 'ckpt.pt'))['optimizer']['muon']['param_groups'][0]
    assert muon['momentum'] == 0.9 and muon['weight_decay'] == 0.01
    # muon_lr / learning_rate (tests' learning_rate 1e-2)
    assert muon['lr_ratio'] == pytest.approx(0.01 / 1e-2)


# -----------------------------------------------------------------------------
# memory, data files, output directories: one line before the work

def test_a_first_step_that_cant_fit_is_refused_before_anything_is_built(monkeypatch):
    monkeypatch.setenv('NANOGPT_FREE_MEMORY_GIB', '8')
    config = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=40000, vocab_size=65)
    # the masks (2 x 40000^2 bytes) fit; the activations of a CPU step come on top of them
    check_model_memory(config, batch_size=12, attention='flash', on_cpu=False)
    with pytest.raises(UserError, match=r"GiB of causal masks.*GiB of activations for batch_size=12\), and this "
                                        r"machine has 8.0 GiB free; use a smaller --block_size, --batch_size or"):
        check_model_memory(config, batch_size=12, attention='manual', on_cpu=True)
    # the logits of a large vocabulary count too
    with pytest.raises(UserError, match="GiB of activations"):
        check_model_memory(replace(config, block_size=8192, vocab_size=50304), batch_size=64, attention='flash',
                           on_cpu=True)
    # nanoGPT's Shakespeare: fine
    check_model_memory(replace(config, block_size=256), batch_size=12, attention='flash', on_cpu=True)


def test_the_free_memory_figure_is_pinned_in_tests_and_can_be_set(monkeypatch):
    # the suite's own pin (conftest): the GPT-2 default config passes whatever else the machine runs
    assert machine.available_host_memory() == 64 * 2**30
    train.check_settings(parse_config(train.DEFAULTS, ["--device=cpu"]))
    monkeypatch.setenv('NANOGPT_FREE_MEMORY_GIB', '2.5')
    assert machine.available_host_memory() == int(2.5 * 2**30)
    with pytest.raises(UserError, match=r"this machine has 2.5 GiB free"):
        train.check_settings(parse_config(train.DEFAULTS, ["--device=cpu"]))
    for bad in ('lots', 'nan', '1e999', '-5'):
        monkeypatch.setenv('NANOGPT_FREE_MEMORY_GIB', bad)
        with pytest.raises(UserError, match=f"NANOGPT_FREE_MEMORY_GIB='{bad}' is not a number of GiB"):
            machine.available_host_memory()
    # unset: the machine's own figure (Linux), or None
    monkeypatch.delenv('NANOGPT_FREE_MEMORY_GIB')
    assert machine.available_host_memory() is None or machine.available_host_memory() > 0


def test_a_jsonl_text_that_is_not_a_string_is_one_line(tmp_path):
    cases = {'{"text": 5}': "line 2: its 'text' field is a number (5), not text; make it a string",
             '["a", "list"]': "line 2 is a list, not an object with a 'text' field",
             '{"text": ["x"]}': "line 2: its 'text' field is a list"}
    for i, (bad, words) in enumerate(cases.items()):
        path = tmp_path / f'c{i}.jsonl'
        path.write_text('{"text": "a first document"}\n' + bad + '\n')
        with pytest.raises(UserError, match=rf"^{path} {re.escape(words)}"):
            prepare_corpus(str(tmp_path / f'out{i}'), files=str(path), tokenizer='char', progress=False)
        assert not os.path.exists(tmp_path / f'out{i}' / 'train.bin')


def test_a_directory_as_input_says_so(tmp_path):
    with pytest.raises(UserError, match=rf"^input {tmp_path} is a directory; pass its files"):
        expand_files(str(tmp_path))


def test_bench_profile_dir_that_is_a_file_is_refused_before_the_benchmark(tmp_path, capsys):
    (tmp_path / 'trace').write_text('mine')
    with pytest.raises(UserError, match=r"--profile_dir=.*trace is a file, not a directory"):
        bench.main(['--profile=True', f'--profile_dir={tmp_path / "trace"}', '--device=cpu', '--real_data=False',
                    '--n_layer=1', '--n_head=2', '--n_embd=16', '--block_size=16', '--batch_size=2'])
    assert 'ms' not in capsys.readouterr().out  # nothing was timed
    assert (tmp_path / 'trace').read_text() == 'mine'


def test_files_an_earlier_preparation_left_are_removed(tmp_path):
    corpus = tmp_path / 'c.jsonl'
    corpus.write_text(''.join(json.dumps({'text': f'document number {i} of the corpus'}) + '\n' for i in range(40)))
    out = tmp_path / 'data'
    prepare_corpus(str(out), files=str(corpus), tokenizer='bpe', vocab_size=300, progress=False)
    assert (out / 'tokenizer.json').exists()
    prepare_corpus(str(out), files=str(corpus), tokenizer='char', progress=False, overwrite=True)
    # --tokenizer=<dir> finds none
    assert not (out / 'tokenizer.json').exists() and (out / 'meta.pkl').exists()
    prepare_corpus(str(out), files=str(corpus), tokenizer='gpt2', progress=False, overwrite=True)
    assert not (out / 'meta.pkl').exists() and json.load(open(out / 'meta.json'))['kind'] == 'gpt2'


# -----------------------------------------------------------------------------
# the smaller ones

def test_a_nan_before_any_save_does_not_speak_of_a_kept_checkpoint(tmp_path):
    assert "no checkpoint had been saved to" in str(non_finite_loss(float('nan'), 0, str(tmp_path / 'ckpt.pt')))
    torch.save({}, tmp_path / 'ckpt.pt')
    assert "the last good checkpoint in" in str(non_finite_loss(float('nan'), 5, str(tmp_path / 'ckpt.pt')))


def test_a_missing_dataset_given_as_a_path_hints_no_prepare_script(tmp_path):
    with pytest.raises(UserError, match=r"no token file at .*train.bin; prepare the dataset first$"):
        open_tokens(str(tmp_path / 'train.bin'), dataset=str(tmp_path))
    with pytest.raises(UserError, match=r"run python data/mine/prepare.py first"):
        open_tokens(str(tmp_path / 'train.bin'), dataset='mine')


def test_a_new_run_with_overwrite_removes_the_earlier_runs_other_checkpoints_at_its_first_save(tmp_path):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    for name in ('ckpt.pt', 'ckpt_last.pt', 'ckpt_best.pt', 'ckpt_4.pt'):
        torch.save({'model': {}, 'model_args': {}, 'iter_num': 4}, tmp_path / name)
    checkpointer = Checkpointer(str(tmp_path), SINGLE, model, optimizer, replaces_a_run=True)
    build = lambda gathered: {'model': model.state_dict(), 'model_args': {}, 'iter_num': 1}  # noqa: E731
    checkpointer.write('ckpt.pt', build, 1, training_state=False)
    assert sorted(n for n in os.listdir(tmp_path) if n.endswith('.pt')) == ['ckpt.pt']
    torch.save({'model': {}, 'model_args': {}}, tmp_path / 'mine.pt')
    # only the first save removes anything
    checkpointer.write('ckpt_last.pt', build, 2, training_state=False)
    assert (tmp_path / 'mine.pt').exists() and load_checkpoint(str(tmp_path / 'ckpt.pt'))['iter_num'] == 1


def test_a_signal_after_the_work_is_done_ends_the_process_as_it_would_have(capsys):
    kept = GracefulExit(keep=True)
    kept.uninstall()  # the run is over: main's finally
    kept._handle(signal.SIGTERM, None)
    assert not kept.requested and "received SIGTERM after the run ended; exiting" in capsys.readouterr().err


def test_a_signal_while_torch_is_imported_ends_in_75_and_one_line(dataset, tmp_path):
    """ SIGTERM half a second after `python train.py` started (torch is still being imported): exit 75, said. """
    args = ['train.py', *train_args(dataset, tmp_path, max_iters=50, num_threads=1)]
    proc = start_python(args)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    assert "stopped before iter 0: a signal came during set-up; nothing new to save" in out
    assert not iter_losses(out) and "Traceback" not in err


def test_auto_resume_starts_a_run_then_continues_it(dataset, tmp_path, capsys):
    out = run_train(capsys, train_args(dataset, tmp_path, max_iters=3, eval_interval=3, num_threads=1,
                                       auto_resume=True)).out
    assert "Initializing a new model from scratch" in out and "resuming it" not in out
    out = run_train(capsys, train_args(dataset, tmp_path, max_iters=5, eval_interval=3, num_threads=1,
                                       auto_resume=True)).out
    assert f"auto_resume=True: {tmp_path} holds this run's checkpoint; resuming it" in out
    assert min(iter_losses(out)) == 4 and load_checkpoint(str(tmp_path / 'ckpt.pt'))['iter_num'] == 6
