"""
nanogpt_plus/checkpoint.py, the checkpoint file: nanoGPT's keys and weights-only loading, atomic saves that survive
a crash or a full disk, corrupt, unsafe and edited checkpoints refused in one line, memory-mapped loading, nanoGPT's
own checkpoints resumed, snapshots (copies, going back to one keeps the line it leaves), the cadence and retention
of saves (checkpoint_interval, keep_checkpoints, the final save, only an evaluated model as the best), a new run
never taking an earlier run's checkpoints, and a checkpoint name taken by a directory refused before any step.
"""
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import finetune
import train
from configurator import parse_config
from helpers import (
    SHORT,
    SINGLE,
    TINY,
    copy_run,
    exit_code,
    iter_losses,
    one_error_line,
    resume_args,
    run_script,
    run_train,
    run_with_file_size_limit,
    tiny_args,
    train_args,
    train_here,
    train_out,
)
from helpers import TINY_VOCAB as VOCAB
from model import GPT, NANOGPT_MODEL_ARGS, GPTConfig
from nanogpt_plus import checkpoint as checkpoint_mod
from nanogpt_plus.checkpoint import Checkpointer, load_checkpoint, save_checkpoint, snapshot_checkpoint
from nanogpt_plus.errors import UserError
from nanogpt_plus.metrics import read_metrics


def test_checkpoint_is_nanogpt_compatible_and_weights_only(dataset, tmp_path, capsys):
    train_out(capsys, tiny_args(dataset, tmp_path))
    ckpt = torch.load(tmp_path / "ckpt.pt", map_location="cpu", weights_only=True)
    for key in ("model", "optimizer", "model_args", "iter_num", "best_val_loss", "config"):
        assert key in ckpt
    assert tuple(sorted(ckpt["model_args"])) == tuple(sorted(NANOGPT_MODEL_ARGS))
    assert not any(k.startswith("_orig_mod.") or k.startswith("module.") for k in ckpt["model"])
    # the final save: 13 steps done
    assert ckpt["iter_num"] == 13 and ckpt["config"]["dataset"] == dataset
    assert ckpt["tokenizer"]["kind"] == "char" and ckpt["tokenizer"]["vocab_size"] == VOCAB
    # what nanoGPT's sample.py does with it: GPTConfig(**model_args), strip prefixes, load_state_dict
    model = GPT(GPTConfig(**ckpt["model_args"]))
    model.load_state_dict(ckpt["model"])
    summary = json.load(open(tmp_path / "ckpt.json"))
    assert summary["iter_num"] == 13 and summary["model_args"]["n_layer"] == 2


def test_atomic_checkpoint_survives_crash_mid_save(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.pt"
    model = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, block_size=8, vocab_size=10))
    good = {"model": model.state_dict(), "model_args": model.config.model_args(), "iter_num": 1}
    save_checkpoint(good, str(path))
    real_save = torch.save

    def crashing_save(obj, f):
        real_save(obj, f)
        f.write(b"partial")
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(checkpoint_mod.torch, "save", crashing_save)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(dict(good, iter_num=2), str(path))
    monkeypatch.undo()
    assert load_checkpoint(str(path))["iter_num"] == 1  # the old checkpoint is intact
    assert sorted(os.listdir(tmp_path)) == ["ckpt.json", "ckpt.pt"]  # no temp files left behind


def test_corrupt_and_unsafe_checkpoints_are_refused(tmp_path):
    path = tmp_path / "ckpt.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(UserError, match="corrupt"):
        load_checkpoint(str(path))

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))
    torch.save({"model": {}, "model_args": {}, "x": Evil()}, path)
    with pytest.raises(UserError, match=r"pickled Python object \(\S*system\) that loading could run as code") as e:
        load_checkpoint(str(path))
    # our words, not torch's advice to switch the safety off
    assert "weights_only" not in str(e.value)
    assert not (tmp_path / "pwned").exists()
    with pytest.raises(UserError, match="no checkpoint at"):
        load_checkpoint(str(tmp_path / "missing.pt"))


def test_resume_from_nanogpt_checkpoint(dataset, tmp_path, capsys):
    """ A checkpoint as nanoGPT writes it (compiled: '_orig_mod.' keys; no loader/RNG/tokenizer state). """
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=VOCAB, bias=False))
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
    ckpt = {"model": {"_orig_mod." + k: v for k, v in model.state_dict().items()}, "optimizer": optimizer.state_dict(),
            "model_args": model.config.model_args(), "iter_num": 6, "best_val_loss": torch.tensor(3.0),
            # its tokenizer: the meta of the dataset it names, as nanoGPT's
            "config": {"dataset": dataset}}
    torch.save(ckpt, tmp_path / "ckpt.pt")
    train.main(tiny_args(dataset, tmp_path, init_from="resume", max_iters=8))
    captured = capsys.readouterr()
    assert "no data-loader state" in captured.err
    assert iter_losses(captured.out).keys() == {6, 7, 8}


@pytest.mark.usefixtures('one_thread')
def test_unsafe_checkpoint_is_explained_in_our_words(tmp_path):
    path = tmp_path / "ckpt.pt"
    # a numpy scalar
    torch.save({"model": {}, "model_args": {}, "best_val_loss": np.float64(1.5)}, path)
    with pytest.raises(UserError) as e:
        load_checkpoint(str(path))
    message = str(e.value)
    assert "holds a pickled Python object (numpy" in message and "multiarray.scalar" in message
    assert "only tensors and plain values" in message and "written by this project" in message
    assert "weights_only" not in message and "\n" not in message
    path.write_bytes(path.read_bytes()[:200])  # truncated: a clear one-liner of its own
    with pytest.raises(UserError, match=r"ckpt.pt is corrupt or truncated \(\w+: [^\n]*\); use another checkpoint$"):
        load_checkpoint(str(path))


@pytest.mark.usefixtures('one_thread')
def test_full_disk_while_saving_a_checkpoint(dataset, run_dir):
    before = (run_dir / "ckpt.pt").read_bytes()
    assert len(before) > 100_000  # the limit below stops the checkpoint, not the small logs
    r = run_with_file_size_limit(["train.py", *resume_args(dataset, run_dir, max_iters=9, eval_interval=9)], 100_000)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        f"error: could not write the checkpoint {run_dir / 'ckpt.pt'} (File too large); make room or fix "
        f"--out_dir, then resume from the last checkpoint with --init_from=resume")
    assert (run_dir / "ckpt.pt").read_bytes() == before  # the previous checkpoint is kept
    # a first save that fails: no checkpoint to resume from, so the line says to start again
    fresh = run_dir.parent / 'fresh'
    r = run_with_file_size_limit(["train.py", *train_args(dataset, fresh, max_iters=2, eval_interval=2)], 100_000)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].endswith(
        "make room or fix --out_dir, then start the run again (no checkpoint was saved yet)"), r.stderr[-2000:]
    assert not (fresh / 'ckpt.pt').exists()
    assert not [f for f in os.listdir(run_dir) if ".tmp." in f]  # and no temp file is left


def test_load_checkpoint_memory_maps_the_file(tmp_path):
    path = str(tmp_path / 'ckpt.pt')
    model = GPT(GPTConfig(**TINY))
    save_checkpoint({'model': model.state_dict(), 'model_args': model.config.model_args()}, path)
    ckpt = load_checkpoint(path)
    with open('/proc/self/maps') as f:
        assert any(line.rstrip().endswith(path) for line in f)  # the tensors are pages of the file
    for k, v in model.state_dict().items():
        torch.testing.assert_close(ckpt['model'][k], v)


def snapshot_names(directory):
    return sorted(n for n in os.listdir(directory) if n.startswith('ckpt_') and n.endswith('.pt'))


def files(directory):
    return {n: (directory / n).read_bytes() for n in sorted(os.listdir(directory)) if n.endswith('.pt')}


# -----------------------------------------------------------------------------
# snapshots and going back to one

@pytest.mark.usefixtures('one_thread')
def test_snapshots_are_copies_nothing_done_to_one_name_changes_another(dataset, tmp_path):
    out = tmp_path / 'out'
    train_here(dataset, out, checkpoint_interval=3, keep_checkpoints=2, always_save_checkpoint=False)
    names = sorted(n for n in os.listdir(out) if n.endswith('.pt'))
    assert names == ['ckpt.pt', 'ckpt_12.pt', 'ckpt_13.pt', 'ckpt_best.pt'], names
    assert len({os.stat(out / n).st_ino for n in names}) == 4  # no two names share a file
    before = files(out)
    # what `cp ckpt_12.pt ckpt.pt` does: write into ckpt.pt's file
    with open(out / 'ckpt.pt', 'r+b') as f:
        f.write(before['ckpt_12.pt'])
        f.truncate()
    after = files(out)
    assert {n: after[n] == before[n] for n in before if n != 'ckpt.pt'} == {n: True for n in before if n != 'ckpt.pt'}


@pytest.mark.usefixtures('one_thread')
def test_going_back_to_a_snapshot_keeps_the_line_it_leaves(dataset, tmp_path, capsys):
    out = tmp_path / 'out'
    first = train_here(dataset, out, capsys, checkpoint_interval=2, keep_checkpoints=3, max_iters=9, lr_decay_iters=12)
    assert snapshot_names(out) == ['ckpt_10.pt', 'ckpt_6.pt', 'ckpt_8.pt']
    line = files(out)
    second = train_here(dataset, out, capsys, init_from='resume', resume_from='6', max_iters=11, lr_decay_iters=12,
                 checkpoint_interval=2, keep_checkpoints=3)
    kept = out / 'abandoned_1'
    assert f"resuming at iter 6: the later files of this run (ckpt.pt, ckpt_8.pt, ckpt_10.pt) are kept, " \
           f"unchanged, in {kept}" in second
    # byte for byte
    assert files(kept) == {n: line[n] for n in ('ckpt.pt', 'ckpt_8.pt', 'ckpt_10.pt')}
    # the new line resumed exactly at 6 (the same steps as the first line's), its snapshots are its own and the
    # keep window counts them only: ckpt_6.pt, shared history, was pruned in its turn
    a = iter_losses(first)
    b = iter_losses(second)
    assert min(b) == 6 and all(a[i] == b[i] for i in range(6, 10))
    assert snapshot_names(out) == ['ckpt_10.pt', 'ckpt_12.pt', 'ckpt_8.pt']
    assert files(kept) == {n: line[n] for n in ('ckpt.pt', 'ckpt_8.pt', 'ckpt_10.pt')}
    assert load_checkpoint(str(out / 'ckpt.pt'))['iter_num'] == 12
    # the metrics file reads as the new line's trajectory from iter 6 on
    records = [r for r in read_metrics(str(out / 'metrics.jsonl')) if r['type'] == 'iter']
    assert [r['iter'] for r in records] == list(range(12)) and records[-1]['run'] == 2


@pytest.mark.usefixtures('one_thread')
def test_a_snapshot_copied_over_ckpt_pt_by_hand_branches_off_too(dataset, tmp_path, capsys):
    out = tmp_path / 'out'
    train_here(dataset, out, capsys, checkpoint_interval=4, keep_checkpoints=4)
    # the .pt only: its ckpt.json sidecar still says 13
    shutil.copyfile(out / 'ckpt_4.pt', out / 'ckpt.pt')
    line = files(out)
    printed = train_here(dataset, out, capsys, init_from='resume', max_iters=6)
    assert "resuming at iter 4: the later files of this run (ckpt_8.pt, ckpt_12.pt, ckpt_13.pt)" in printed
    assert files(out / 'abandoned_1') == {n: line[n] for n in ('ckpt_8.pt', 'ckpt_12.pt', 'ckpt_13.pt')}


@pytest.mark.usefixtures('one_thread')
def test_resume_from_names_a_snapshot_that_exists(dataset, tmp_path):
    out = tmp_path / 'out'
    train_here(dataset, out, checkpoint_interval=4, keep_checkpoints=1)
    with pytest.raises(UserError, match=r"no snapshot .*ckpt_4.pt to resume from; .* holds ckpt_13.pt"):
        train_here(dataset, out, init_from='resume', resume_from='4')
    with pytest.raises(UserError, match="needs --init_from=resume"):
        train.check_settings(parse_config(train.DEFAULTS, ["--resume_from=4"]))


# -----------------------------------------------------------------------------
# a new run over an earlier one, and the best checkpoint

@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize("keep", ['ckpt_best.pt', 'ckpt_12.pt'])
def test_a_new_run_over_any_checkpoint_is_refused(dataset, tmp_path, keep):
    out = tmp_path / 'out'
    train_here(dataset, out, checkpoint_interval=6, keep_checkpoints=2, always_save_checkpoint=False)
    for name in os.listdir(out):
        if name.endswith('.pt') and name != keep:
            os.remove(out / name)
    before = files(out)
    with pytest.raises(UserError, match=f"already holds the checkpoint {keep}"):
        train_here(dataset, out)
    assert files(out) == before


@pytest.mark.usefixtures('one_thread')
def test_only_an_evaluated_model_of_this_run_is_the_best(dataset, tmp_path):
    out = tmp_path / 'out'
    # saves every 2 iterations, evaluations every 6: most saves are of never-evaluated models
    train_here(dataset, out, checkpoint_interval=2, eval_interval=6, always_save_checkpoint=False)
    evals = {r['iter']: r['val_loss'] for r in read_metrics(str(out / 'metrics.jsonl')) if r['type'] == 'eval'}
    best = load_checkpoint(str(out / 'ckpt_best.pt'))
    # its own val loss
    assert best['iter_num'] in evals and best['best_val_loss'] == evals[best['iter_num']]
    # a new run over it (--overwrite=True) never takes the old run's files as its best
    old_best = (out / 'ckpt_best.pt').read_bytes()
    train_here(dataset, out, overwrite=True, max_iters=4, checkpoint_interval=2, eval_interval=100,
        always_save_checkpoint=False)
    assert not (out / 'ckpt_best.pt').exists() or (out / 'ckpt_best.pt').read_bytes() != old_best
    assert sorted(n for n in os.listdir(out) if n.endswith('.pt')) == ['ckpt.pt']


# -----------------------------------------------------------------------------
# checkpoint cadence and retention

@pytest.mark.usefixtures('one_thread')
def test_final_checkpoint_when_max_iters_is_not_a_multiple_of_eval_interval(dataset, tmp_path, capsys):
    full = run_train(capsys, train_args(dataset, tmp_path / "full", max_iters=10, eval_interval=3)).out
    part1 = run_train(capsys, train_args(dataset, tmp_path / "split", max_iters=7, eval_interval=3)).out
    assert f"saving checkpoint to {tmp_path / 'split'} (final, iter 8)" in part1
    ckpt = torch.load(tmp_path / "split" / "ckpt.pt", weights_only=True)
    # max_iters + 1: the steps done, iteration 7's included (not only up to iter 6)
    assert ckpt["iter_num"] == 8
    part2 = run_train(capsys, train_args(dataset, tmp_path / "split", max_iters=10, eval_interval=3,
                                        init_from="resume")).out
    assert min(iter_losses(part2)) == 8
    assert {**iter_losses(part1), **iter_losses(part2)} == iter_losses(full)


def snapshots(out_dir):
    return sorted(n for n in os.listdir(out_dir) if n.startswith("ckpt_") and n[5].isdigit())


@pytest.mark.usefixtures('one_thread')
def test_checkpoint_interval_and_keep_checkpoints(dataset, tmp_path, capsys):
    out = run_train(capsys, train_args(dataset, tmp_path, max_iters=9, eval_interval=100, checkpoint_interval=2,
                                      keep_checkpoints=2)).out
    saves = [line for line in out.splitlines() if line.startswith("saving checkpoint")]
    assert len(saves) == 5  # after 2, 4, 6, 8 steps and the final one (10); evaluations add none
    assert snapshots(tmp_path) == ["ckpt_10.json", "ckpt_10.pt", "ckpt_8.json", "ckpt_8.pt"]
    for it in (8, 10):
        assert torch.load(tmp_path / f"ckpt_{it}.pt", weights_only=True)["iter_num"] == it
    # a copy, not a hard link: a file written over one name (cp ckpt_8.pt ckpt.pt) must not change the other
    assert not os.path.samefile(tmp_path / "ckpt.pt", tmp_path / "ckpt_10.pt")
    assert (tmp_path / "ckpt.pt").read_bytes() == (tmp_path / "ckpt_10.pt").read_bytes()
    # a new run over it: the old run's snapshots (8 and 10 > its iterations) go at its first save
    (tmp_path / "ckpt_50.pt").write_bytes(b"from a run before that")
    run_train(capsys, train_args(dataset, tmp_path, max_iters=3, eval_interval=100, checkpoint_interval=2,
                                keep_checkpoints=2, overwrite=True))
    assert snapshots(tmp_path) == ["ckpt_2.json", "ckpt_2.pt", "ckpt_4.json", "ckpt_4.pt"]
    assert torch.load(tmp_path / "ckpt_2.pt", weights_only=True)["iter_num"] == 2
    # going back: resume the older snapshot; the later one is another line of the run: kept apart, never deleted
    # or counted (its name could collide with this line's)
    shutil.copyfile(tmp_path / "ckpt_2.pt", tmp_path / "ckpt.pt")
    run_train(capsys, train_args(dataset, tmp_path, max_iters=2, eval_interval=100, checkpoint_interval=2,
                                keep_checkpoints=1, init_from="resume"))
    assert snapshots(tmp_path) == ["ckpt_3.json", "ckpt_3.pt"]  # 2 pruned
    assert snapshots(tmp_path / "abandoned_1") == ["ckpt_4.json", "ckpt_4.pt"]  # 4 kept, apart


@pytest.mark.usefixtures('one_thread')
def test_checkpoint_interval_keeps_the_best_model_apart(dataset, tmp_path, capsys):
    """ always_save_checkpoint=False with checkpoint_interval: the state in ckpt.pt, the best in ckpt_best.pt. """
    out = run_train(capsys, train_args(dataset, tmp_path, max_iters=7, eval_interval=3, checkpoint_interval=2,
                                      always_save_checkpoint=False)).out
    val = {int(line.split()[1][:-1]): float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")}
    best, state = (torch.load(tmp_path / name, weights_only=True) for name in ("ckpt_best.pt", "ckpt.pt"))
    best_iter = min((v, it) for it, v in val.items() if it > 0)[1]
    assert best["iter_num"] == best_iter and abs(best["best_val_loss"] - val[best_iter]) < 1e-4
    assert state["iter_num"] == 8


# -----------------------------------------------------------------------------
# a checkpoint name taken by a directory: refused before any training

@pytest.mark.usefixtures('one_thread')
def test_auto_resume_with_ckpt_pt_a_directory_is_refused_before_any_step(dataset, tmp_path, capsys):
    (tmp_path / "ckpt.pt").mkdir()
    assert exit_code(lambda: train.main(train_args(dataset, tmp_path, auto_resume=True))) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        f"error: {tmp_path / 'ckpt.pt'} is not a file (a directory or another kind of file is in "
        f"its place), so this run could not save its checkpoint there; move it away, or pass "
        f"another --out_dir")
    assert "iter 0" not in captured.out and sorted(os.listdir(tmp_path)) == ["ckpt.pt"]


@pytest.mark.usefixtures('one_thread')
def test_finetune_with_its_checkpoint_name_a_directory_is_refused_before_any_step(
        tmp_path, monkeypatch, capsys):
    from helpers import make_source, make_task
    src = make_source(tmp_path / "src")
    train_file, val_file = make_task(tmp_path, "classification", n_train=16, n_val=4)
    out = tmp_path / "ft"
    (out / "ckpt_last.pt").mkdir(parents=True)
    args = (f"--init_from={src}", f"--out_dir={out}", f"--train_file={train_file}",
            f"--val_file={val_file}", "--task=classification", "--device=cpu", "--auto_resume=True")
    assert exit_code(lambda: run_script(finetune, monkeypatch, *args)) == 2
    assert f"error: {out / 'ckpt_last.pt'} is not a file" in one_error_line(capsys)
    assert sorted(os.listdir(out)) == ["ckpt_last.pt"]


def edited_copy(run_dir, to, edit):
    """A copy of run_dir whose ckpt.pt has gone through edit(ckpt)."""
    out_dir = copy_run(run_dir, to)
    path = os.path.join(out_dir, 'ckpt.pt')
    ckpt = dict(torch.load(path, weights_only=True))
    edit(ckpt)
    save_checkpoint(ckpt, path)
    return out_dir


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize('value', ['twelve', None, 2.5, -1])
def test_a_checkpoint_whose_iter_num_is_not_a_count_is_one_line(dataset, finished, tmp_path, value):
    out_dir = edited_copy(finished, tmp_path / 'run', lambda ckpt: ckpt.update(iter_num=value))
    with pytest.raises(
        UserError,
        match=rf"^checkpoint {out_dir}/ckpt.pt holds iter_num={value!r}, not a count "
        rf"of steps: it was edited or written by other code",
    ):
        train.main(train_args(dataset, out_dir, **dict(SHORT, max_iters=8), init_from='resume'))


@pytest.mark.usefixtures('one_thread')
def test_a_checkpoint_whose_best_val_loss_is_not_a_number_is_one_line(dataset, finished, tmp_path):
    out_dir = edited_copy(finished, tmp_path / 'run', lambda ckpt: ckpt.update(best_val_loss='low'))
    with pytest.raises(UserError, match=r"holds best_val_loss='low', not a loss"):
        train.main(train_args(dataset, out_dir, **dict(SHORT, max_iters=8), init_from='resume'))


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize('rng', ['abc', [{'torch': 'abc'}], [{'torch': torch.zeros(3, dtype=torch.uint8)}]])
def test_a_checkpoint_whose_rng_state_is_not_ours_is_one_line(dataset, finished, tmp_path, capsys, rng):
    out_dir = Path(edited_copy(finished, tmp_path / 'run', lambda ckpt: ckpt.update(rng=rng)))
    before = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    args = train_args(dataset, out_dir, **dict(SHORT, max_iters=8), init_from='resume')
    assert exit_code(lambda: train.main(args)) == 2
    assert one_error_line(capsys) == ("error: the checkpoint's RNG states ('rng') are not the per-rank states this "
                                      "project saves; resume from another checkpoint, or start a new run in another "
                                      "--out_dir")
    assert {p.name: p.read_bytes() for p in out_dir.iterdir()} == before  # the checkpoint as it was


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


# -----------------------------------------------------------------------------
# a checkpoint that can't be used says why: the entry it lacks, the file system's error

def _tiny_checkpoint(directory):
    from helpers import save_test_checkpoint
    from nanogpt_plus.tokenizer import CharTokenizer
    tok = CharTokenizer.from_text("abcdefgh ")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=tok.vocab_size))
    return save_test_checkpoint(model, tok.meta(), directory / 'ckpt.pt')


def _without(key):
    def edit(ckpt):
        del ckpt[key]
        return ckpt
    return edit


UNUSABLE = {
    'no model_args': (_without('model_args'), "has no 'model_args' entry; use a checkpoint written by train.py"),
    'no tokenizer': (_without('tokenizer'), "has no 'tokenizer' entry, which every checkpoint of this project holds"),
    'a list': (lambda ckpt: [ckpt['model']], "holds a list, not a checkpoint's dict of entries"),
}


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize('case', list(UNUSABLE))
def test_a_checkpoint_lacking_an_entry_names_it(case, tmp_path, monkeypatch, capsys):
    from helpers import assert_one_line_error, run
    edit, message = UNUSABLE[case]
    path = _tiny_checkpoint(tmp_path)
    torch.save(edit(dict(torch.load(path, weights_only=True))), tmp_path / 'edited.pt')
    os.replace(tmp_path / 'edited.pt', path)
    before = sorted(os.listdir(tmp_path))
    code, _, err = run('sample.py', monkeypatch, capsys, f'--out_dir={tmp_path}', '--device=cpu', '--start=abc',
                       '--num_samples=1', '--max_new_tokens=2')
    assert_one_line_error(code, err, message)
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.usefixtures('one_thread')
def test_an_unreadable_checkpoint_is_not_called_corrupt(tmp_path, monkeypatch):
    path = _tiny_checkpoint(tmp_path)

    # as a file without read permission does for a user who isn't root
    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(checkpoint_mod.torch, 'load', refused)
    with pytest.raises(UserError) as e:
        load_checkpoint(path)
    assert str(e.value) == (f"checkpoint {path} could not be read (Permission denied); check the file and its "
                            f"permissions, or use another checkpoint")
    monkeypatch.undo()
    assert load_checkpoint(path)['iter_num'] == 0
