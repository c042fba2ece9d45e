"""
Issue 42's refusals: auto_resume against overwrite and against the init_from that didn't start
the run (item 5), non-finite float settings (6), the tracebacks for user input (10: NaN settings,
dist_timeout, a train.bin that is a directory, a checkpoint's counters and optimizer groups), the
memory a first step really holds (11), a requeued job whose run is complete (12: exit 0), and the
small ones (bench.py's advice, the float16 line, wandb missing, orphan sidecars).
"""

import os
import shutil

import pytest
import torch

import bench
import finetune
import sample
import train
from configurator import parse_config
from helpers import run_python, train_args
from model import GPTConfig
from nanogpt_plus.checkpoint import load_checkpoint, save_checkpoint, snapshot_checkpoint
from nanogpt_plus.errors import NothingToDo, UserError
from nanogpt_plus.machine import check_model_memory, resolve_dtype
from nanogpt_plus.metrics import MetricsLogger

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

SHORT = dict(max_iters=3, eval_interval=3, lr_decay_iters=3, warmup_iters=1)


def run_train(capsys, args):
    train.main(args)
    return capsys.readouterr().out


@pytest.fixture(scope='module')
def finished(tiny_dataset, tmp_path_factory):
    """The out_dir of a complete 2-layer run (max_iters=3: its checkpoint is at iter 4)."""
    out_dir = tmp_path_factory.mktemp('finished')
    train.main(train_args(tiny_dataset, out_dir, **SHORT))
    return out_dir


def copy_run(run_dir, to):
    shutil.copytree(run_dir, to, ignore=shutil.ignore_patterns('run.lock'))
    return str(to)


# -----------------------------------------------------------------------------
# 5. auto_resume against overwrite, and against an init_from that didn't start the run


def test_auto_resume_with_overwrite_is_refused_in_train_and_finetune():
    message = (
        r"auto_resume=True continues the run in out_dir and overwrite=True starts it over; give one"
    )
    with pytest.raises(UserError, match=message):
        train.check_settings(
            parse_config(train.DEFAULTS, ["--auto_resume=True", "--overwrite=True"])
        )
    with pytest.raises(UserError, match=message):
        finetune.check_settings(
            parse_config(finetune.DEFAULTS, ["--auto_resume=True", "--overwrite=True"])
        )


def test_auto_resume_refuses_a_run_that_init_from_did_not_start(
    dataset, finished, tmp_path, capsys
):
    # out_dir holds a 1-layer run; init_from names the 2-layer run `finished`
    other = tmp_path / 'other'
    train.main(train_args(dataset, other, n_layer=1, **dict(SHORT, max_iters=2)))
    capsys.readouterr()
    with pytest.raises(
        UserError,
        match=rf"auto_resume=True but {other}/ckpt.pt is not a run that "
        rf"init_from={finished} started: it has n_layer=1, {finished}/ckpt.pt "
        rf"n_layer=2; pass another --out_dir",
    ):
        train.main(
            train_args(dataset, other, init_from=str(finished), auto_resume=True, max_iters=6)
        )


def test_auto_resume_of_a_run_started_from_weights_says_which_wins(
    dataset, finished, tmp_path, capsys
):
    out_dir = tmp_path / 'from_weights'
    args = dict(SHORT, init_from=str(finished), auto_resume=True)
    out = run_train(capsys, train_args(dataset, out_dir, **args))
    assert "Initializing from the weights" in out and "resuming it" not in out
    out = run_train(
        capsys, train_args(dataset, out_dir, **dict(args, max_iters=5, lr_decay_iters=5))
    )
    assert (
        f"auto_resume=True: {out_dir} holds this run's checkpoint; resuming it "
        f"(init_from={finished} is how it started)"
    ) in out
    assert load_checkpoint(str(out_dir / 'ckpt.pt'))['iter_num'] == 6


# -----------------------------------------------------------------------------
# 6 and 10. non-finite float settings, from a config file or the command line, in every script

NAN_SETTINGS = (
    'skip_loss_z',
    'skip_grad_z',
    'min_lr',
    'weight_decay',
    'grad_clip',
    'learning_rate',
    'beta2',
    'dropout',
    'muon_lr',
    'muon_momentum',
    'cooldown_frac',
    'logit_softcap',
)


@pytest.mark.parametrize('key', NAN_SETTINGS)
def test_a_nan_from_a_config_file_is_refused_naming_the_setting(tmp_path, key):
    config = tmp_path / 'nan.py'
    config.write_text(f"{key} = float('nan')\n")
    with pytest.raises(
        UserError,
        match=rf"^{key} must be a finite number, got nan; change --{key} \(or the "
        rf"config file that sets it\)$",
    ):
        train.check_settings(parse_config(train.DEFAULTS, [str(config)]))


def test_an_inf_is_refused_too_from_the_command_line_and_in_other_scripts(tmp_path):
    with pytest.raises(UserError, match=r"^grad_clip must be a finite number, got inf"):
        train.check_settings(parse_config(train.DEFAULTS, ["--grad_clip=1e999"]))
    with pytest.raises(UserError, match=r"^min_lr must be a finite number, got -inf"):
        finetune.check_settings(parse_config(finetune.DEFAULTS, ["--min_lr=-1e999"]))
    config = tmp_path / 'hot.py'
    config.write_text("temperature = float('nan')\n")
    with pytest.raises(UserError, match=r"^temperature must be a finite number, got nan"):
        sample.DEFAULTS.check(parse_config(sample.DEFAULTS, [str(config)]))
    # finite values still pass
    train.check_settings(parse_config(train.DEFAULTS, ["--grad_clip=0.5", "--device=cpu"]))


def test_a_nan_setting_ends_train_py_and_sample_py_in_one_line(tiny_dataset, tmp_path):
    config = tmp_path / 'nan.py'
    config.write_text("learning_rate = float('nan')\n")
    r = run_python(
        ['train.py', *train_args(tiny_dataset, tmp_path / 'out'), str(config)], timeout=120
    )
    assert r.returncode == 2 and r.stderr.strip().count('\n') == 0, r.stderr[-2000:]
    assert r.stderr.startswith("error: learning_rate must be a finite number, got nan")
    config.write_text("temperature = float('nan')\n")
    r = run_python(['sample.py', str(config), '--init_from=gpt2', '--device=cpu'], timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count('\n') == 0, r.stderr[-2000:]
    assert r.stderr.startswith("error: temperature must be a finite number, got nan")
    assert not (tmp_path / 'out').exists()


# -----------------------------------------------------------------------------
# 10. the other tracebacks for user input


def test_a_dist_timeout_past_a_week_is_refused():
    for value in (10**12, 2**31, 604801):
        with pytest.raises(
            UserError, match=rf"^dist_timeout must be >= 0 and <= 604800, got {value}"
        ):
            train.check_settings(parse_config(train.DEFAULTS, [f"--dist_timeout={value}"]))
    train.check_settings(parse_config(train.DEFAULTS, ["--dist_timeout=604800", "--device=cpu"]))


def test_a_train_bin_that_is_a_directory_is_one_line(tiny_dataset, tmp_path):
    data = tmp_path / 'data'
    shutil.copytree(tiny_dataset, data)
    os.remove(data / 'train.bin')
    os.mkdir(data / 'train.bin')
    with pytest.raises(
        UserError, match=rf"^{data}/train.bin is a directory, not a token file; move it away"
    ):
        train.main(train_args(str(data), tmp_path / 'out'))


def edited_copy(run_dir, to, edit):
    """A copy of run_dir whose ckpt.pt has gone through edit(ckpt)."""
    out_dir = copy_run(run_dir, to)
    path = os.path.join(out_dir, 'ckpt.pt')
    ckpt = dict(torch.load(path, weights_only=True))
    edit(ckpt)
    save_checkpoint(ckpt, path)
    return out_dir


@pytest.mark.parametrize('value', ['twelve', None, 2.5, -1])
def test_a_checkpoint_whose_iter_num_is_not_a_count_is_one_line(dataset, finished, tmp_path, value):
    out_dir = edited_copy(finished, tmp_path / 'run', lambda ckpt: ckpt.update(iter_num=value))
    with pytest.raises(
        UserError,
        match=rf"^checkpoint {out_dir}/ckpt.pt holds iter_num={value!r}, not a count "
        rf"of steps: it was edited or written by other code",
    ):
        train.main(train_args(dataset, out_dir, **dict(SHORT, max_iters=8), init_from='resume'))


def test_a_checkpoint_whose_best_val_loss_is_not_a_number_is_one_line(dataset, finished, tmp_path):
    out_dir = edited_copy(finished, tmp_path / 'run', lambda ckpt: ckpt.update(best_val_loss='low'))
    with pytest.raises(UserError, match=r"holds best_val_loss='low', not a loss"):
        train.main(train_args(dataset, out_dir, **dict(SHORT, max_iters=8), init_from='resume'))


def test_a_checkpoint_whose_optimizer_has_other_groups_is_one_line(
    dataset, finished, tmp_path, capsys
):
    def drop_a_group(ckpt):
        ckpt['optimizer'] = dict(
            ckpt['optimizer'], param_groups=ckpt['optimizer']['param_groups'][:1]
        )

    out_dir = edited_copy(finished, tmp_path / 'run', drop_a_group)
    with pytest.raises(
        UserError,
        match=r"^the checkpoint's optimizer state does not fit this run's optimizer "
        r"\(ValueError: loaded state dict has a different number of parameter "
        r"groups\); resume from another checkpoint",
    ):
        train.main(train_args(dataset, out_dir, **dict(SHORT, max_iters=8), init_from='resume'))


# -----------------------------------------------------------------------------
# 11. the memory a first step really holds


def test_a_long_context_on_a_tiny_model_is_refused_with_a_margin(monkeypatch):
    # the case: 2 x 100000^2 bytes of masks (18.6 GiB) with 21 GiB free passed before
    monkeypatch.setenv('NANOGPT_FREE_MEMORY_GIB', '21')
    config = GPTConfig(
        n_layer=2, n_head=2, n_embd=32, block_size=100000, vocab_size=20, dropout=0.0
    )
    with pytest.raises(
        UserError,
        match=r"18.6 GiB of causal masks.*and this machine has 21.0 GiB free; use a "
        r"smaller --block_size, --batch_size or model \(a step may use 90% of",
    ):
        check_model_memory(config, batch_size=4, attention='flash', on_cpu=True)
    # dropout on a CPU: the fused attention falls back to the written-out one, (T, T) per head
    monkeypatch.setenv('NANOGPT_FREE_MEMORY_GIB', '2')
    config = GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=8192, vocab_size=65, dropout=0.0)
    check_model_memory(config, batch_size=1, attention='flash', on_cpu=True)  # measured: 0.2 GiB
    with pytest.raises(
        UserError, match=r"GiB of activations for batch_size=1"
    ):  # measured: 2.2 GiB
        check_model_memory(
            GPTConfig(**dict(vars(config), dropout=0.1)),
            batch_size=1,
            attention='flash',
            on_cpu=True,
        )


def test_the_block_size_100000_run_is_refused_before_any_work(tiny_dataset, tmp_path):
    env = dict(os.environ, NANOGPT_FREE_MEMORY_GIB='21')
    r = run_python(
        ['train.py', *train_args(tiny_dataset, tmp_path / 'out', block_size=100000)],
        env=env,
        timeout=120,
    )
    assert r.returncode == 2 and r.stderr.strip().count('\n') == 0, r.stderr[-2000:]
    assert "GiB of causal masks" in r.stderr and not (tmp_path / 'out').exists()


# -----------------------------------------------------------------------------
# 12. a requeued job whose run is complete: exit 0, one line


def test_auto_resume_of_a_complete_run_is_nothing_to_do(dataset, finished, tmp_path, capsys):
    with pytest.raises(
        NothingToDo,
        match=rf"^auto_resume=True: the run in {finished} is already complete \(its "
        rf"checkpoint is at iter 4, past max_iters=3\); nothing to do$",
    ):
        train.main(train_args(dataset, finished, **SHORT, auto_resume=True))
    # without auto_resume, a resume of it is still the user's error
    with pytest.raises(UserError, match="already complete"):
        train.main(train_args(dataset, finished, **SHORT, init_from='resume'))


def test_a_requeued_complete_run_exits_0_with_one_line(tiny_dataset, finished, tmp_path):
    out_dir = copy_run(finished, tmp_path / 'run')
    before = open(os.path.join(out_dir, 'ckpt.pt'), 'rb').read()
    r = run_python(
        ['train.py', *train_args(tiny_dataset, out_dir, **SHORT, auto_resume=True)], timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == (
        f"auto_resume=True: the run in {out_dir} is already complete "
        f"(its checkpoint is at iter 4, past max_iters=3); nothing to do"
    )
    assert "resuming it" not in r.stdout and not r.stderr.strip()
    assert open(os.path.join(out_dir, 'ckpt.pt'), 'rb').read() == before


# -----------------------------------------------------------------------------
# the small ones


def test_bench_py_advises_no_setting_it_lacks(tmp_path):
    (tmp_path / 'ckpt.pt').write_bytes(b'a run')
    with pytest.raises(UserError) as refused:
        bench.check_settings(
            parse_config(bench.DEFAULTS, ["--profile=True", f"--profile_dir={tmp_path}"])
        )
    assert str(refused.value).endswith("; pass another --profile_dir") and "overwrite" not in str(
        refused.value
    )


def test_float16_on_a_cpu_is_said_for_every_script():
    with pytest.raises(
        UserError,
        match=r"^--dtype=float16 is not supported on CPU; use --dtype=bfloat16 or "
        r"float32$",
    ):
        resolve_dtype('float16', 'cpu')


def test_a_missing_wandb_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(
        __import__('sys').modules, 'wandb', None
    )  # `import wandb` fails as if not installed
    logger = MetricsLogger(
        str(tmp_path / 'metrics.jsonl'), wandb_log=True, wandb_project='p', wandb_run_name='r'
    )
    logger.close()
    err = capsys.readouterr().err
    assert (
        "warning: wandb is not installed; continuing without it (pip install wandb to log "
        "there, or --wandb_log=False)"
    ) in err and 'WANDB_MODE' not in err


def test_an_orphan_sidecar_is_removed_where_snapshots_are_pruned(tmp_path):
    (tmp_path / 'ckpt.pt').write_bytes(b'the state')
    (tmp_path / 'ckpt.json').write_text('{}')
    (tmp_path / 'ckpt_3.json').write_text(
        '{"iter_num": 3}'
    )  # its ckpt_3.pt was deleted, then a kill -9
    (tmp_path / 'notes.json').write_text('{}')
    snapshot_checkpoint(str(tmp_path), 6, keep=2)
    assert sorted(os.listdir(tmp_path)) == [
        'ckpt.json',
        'ckpt.pt',
        'ckpt_6.json',
        'ckpt_6.pt',
        'notes.json',
    ]
