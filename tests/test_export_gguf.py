"""
export_gguf.py: a checkpoint -> one GGUF file, and the output rules: its own earlier file replaced, anyone
else's file, a checkpoint or a live run's out_dir refused in one line (exit 2) with the file untouched, an
architecture llama.cpp can't compute refused before anything is written, a signal during the work one line and
no file at all.
"""
import fcntl
import json
import os
import re
import signal
import socket

import pytest

from helpers import PADDED_VOCAB, REPO, assert_one_line_error, run, save_test_checkpoint, start_python, tiny_gpt
from nanogpt_plus.gguf_export import SOURCE_KEY, exported_here
from nanogpt_plus.outputs import LOCK_NAME


@pytest.fixture
def bpe_run(bpe512, tmp_path):
    """ The out_dir of a bpe model's run: its ckpt.pt (vocab_size padded to 576, the 512-token tokenizer). """
    tok, _ = bpe512
    out_dir = tmp_path / 'out'
    save_test_checkpoint(tiny_gpt(vocab_size=PADDED_VOCAB), tok.meta(), out_dir / 'ckpt.pt')
    return out_dir


def export(monkeypatch, capsys, *args):
    return run('export_gguf.py', monkeypatch, capsys, *args)


def test_a_checkpoint_is_exported_and_its_earlier_file_replaced(bpe_run, monkeypatch, capsys):
    path = bpe_run / 'model-f32.gguf'  # the default name
    code, out, err = export(monkeypatch, capsys, f'--out_dir={bpe_run}')
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1]) == {'gguf_file': str(path), 'gguf_type': 'f32',
                                                         'bytes': path.stat().st_size}
    assert f"exported {bpe_run / 'ckpt.pt'} to {path} (f32, " in out
    assert "note: the model uses the exact GELU" not in out  # tiny_gpt's is GPT-2's tanh GELU
    from gguf import GGUFReader
    assert GGUFReader(str(path)).get_field(SOURCE_KEY).contents() == str(bpe_run / 'ckpt.pt')
    f32 = path.stat().st_size
    code, out, err = export(monkeypatch, capsys, f'--out_dir={bpe_run}', f'--gguf_file={path}', '--gguf_type=q8_0')
    assert code == 0 and 'warning' not in err, err
    # replaced: no --overwrite needed
    assert exported_here(str(path)) and path.stat().st_size < f32 / 2
    assert sorted(os.listdir(bpe_run)) == ['ckpt.json', 'ckpt.pt', 'model-f32.gguf']


def test_another_file_is_refused_unless_overwrite(bpe_run, monkeypatch, capsys):
    path = bpe_run.parent / 'llama.gguf'
    path.write_bytes(b'GGUF someone else\'s model')
    code, _, err = export(monkeypatch, capsys, f'--out_dir={bpe_run}', f'--gguf_file={path}')
    assert_one_line_error(code, err, f"--gguf_file={path} would replace {path}, a file that is not an earlier "
                                     f"GGUF file of export_gguf.py; pass another --gguf_file, or --overwrite=True")
    assert path.read_bytes() == b'GGUF someone else\'s model'
    code, _, err = export(monkeypatch, capsys, f'--out_dir={bpe_run}', f'--gguf_file={path}', '--overwrite=True')
    assert code == 0 and err.startswith(f"warning: --gguf_file={path} would replace"), err
    assert exported_here(str(path))


def test_the_checkpoint_itself_is_refused(bpe_run, monkeypatch, capsys):
    ckpt = bpe_run / 'ckpt.pt'
    before = ckpt.read_bytes()
    code, _, err = export(monkeypatch, capsys, f'--out_dir={bpe_run}', f'--gguf_file={ckpt}')
    assert_one_line_error(code, err, f"--gguf_file={ckpt} would replace the checkpoint {ckpt}")
    assert ckpt.read_bytes() == before


def test_a_live_runs_out_dir_is_refused_even_with_overwrite(bpe_run, monkeypatch, capsys):
    # the run's lock, held (flock) and naming another process: a live run to any other
    fd = os.open(bpe_run / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, json.dumps({'pid': 1, 'host': socket.gethostname(), 'started': 'today'}).encode())
        code, _, err = export(monkeypatch, capsys, f'--out_dir={bpe_run}', '--overwrite=True')
    finally:
        os.close(fd)
    assert_one_line_error(code, err, f"--gguf_file={bpe_run / 'model-f32.gguf'} is in the out_dir of a live run "
                                     f"(pid 1 on {socket.gethostname()}")
    assert not (bpe_run / 'model-f32.gguf').exists()


def test_an_architecture_llama_cpp_cant_compute_is_refused_before_writing(tmp_path, monkeypatch, capsys):
    out_dir = tmp_path / 'out'
    save_test_checkpoint(tiny_gpt(vocab_size=50304, pos='rope'), {'kind': 'gpt2'}, out_dir / 'ckpt.pt')
    code, out, err = export(monkeypatch, capsys, f'--out_dir={out_dir}')
    assert_one_line_error(code, err, f"{out_dir / 'ckpt.pt'} has pos='rope' (rotary positions), which "
                                     f"llama.cpp's gpt2 architecture can't compute; export it with export_hf.py")
    assert sorted(os.listdir(out_dir)) == ['ckpt.json', 'ckpt.pt'] and 'exporting' not in out


def test_an_unknown_type_is_refused(bpe_run, monkeypatch, capsys):
    code, _, err = export(monkeypatch, capsys, f'--out_dir={bpe_run}', '--gguf_type=q4_k')
    assert_one_line_error(code, err, "gguf_type must be 'f32', 'f16' or 'q8_0', got 'q4_k'")


def test_a_signal_during_the_export_leaves_no_file(tmp_path):
    """ A GPT-2 BPE model (its 50,000 merges take seconds to write): SIGTERM once the export has begun ends it
    in one line and exit code 130, with neither the file nor a temp file of it left. """
    out_dir = tmp_path / 'out'
    save_test_checkpoint(tiny_gpt(vocab_size=50304), {'kind': 'gpt2'}, out_dir / 'ckpt.pt')
    proc = start_python(['export_gguf.py', f'--out_dir={out_dir}'], cwd=REPO,
                        env=dict(os.environ, PYTHONUNBUFFERED='1'))
    for line in proc.stdout:
        if line.startswith('exporting '):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and 'Traceback' not in err, (out, err)
    assert re.search(r'SIGTERM', err) and len(err.strip().splitlines()) <= 2, err
    assert sorted(os.listdir(out_dir)) == ['ckpt.json', 'ckpt.pt']
