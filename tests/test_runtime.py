"""
nanogpt_plus.machine's choices that depend on the GPU, checked on the CPU by standing in for torch.cuda, and
runtime.run_main's endings: exit codes, and the process group torn down once, by run_main.
"""
from types import SimpleNamespace

import pytest
import torch

from nanogpt_plus.errors import ConfigError, Interrupted, TokenizerError, UserError, exit_code
from nanogpt_plus.machine import resolve_dtype
from nanogpt_plus.runtime import run_main


def fake_gpu(monkeypatch, major, emulates_bf16):
    """ torch.cuda as is_bf16_supported sees it on a GPU of compute capability `major`. """
    monkeypatch.setattr(torch.version, 'hip', None)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'current_device', lambda: 0)
    monkeypatch.setattr(torch.cuda, 'get_device_properties', lambda device: SimpleNamespace(major=major))
    # where a bf16 tensor can be made although there are no bf16 tensor cores (V100, T4): emulation
    monkeypatch.setattr(torch.cuda, '_check_bf16_tensor_supported', lambda device: emulates_bf16)


@pytest.mark.parametrize("major, expected", [(7, 'float16'), (8, 'bfloat16'), (9, 'bfloat16')])
def test_auto_dtype_takes_bf16_only_where_it_is_native(monkeypatch, major, expected):
    """ V100/T4 (sm 7.x) emulate bf16, which torch counts as supported by default: they get fp16 + a GradScaler. """
    fake_gpu(monkeypatch, major, emulates_bf16=True)
    assert torch.cuda.is_bf16_supported()  # the default answer counts the emulation
    assert resolve_dtype('auto', 'cuda') == expected
    assert resolve_dtype('auto', 'cuda:1') == expected


def test_auto_dtype_asks_for_native_bf16(monkeypatch):
    calls = []

    def is_bf16_supported(including_emulation=True):
        calls.append(including_emulation)
        return including_emulation  # a GPU that only emulates bf16

    monkeypatch.setattr(torch.cuda, 'is_bf16_supported', is_bf16_supported)
    assert resolve_dtype('auto', 'cuda') == 'float16'
    assert calls == [False]
    assert resolve_dtype('auto', 'cpu') == 'float32' and calls == [False]  # the CPU never asks


def test_explicit_dtypes_are_kept(monkeypatch):
    fake_gpu(monkeypatch, 7, emulates_bf16=True)
    # asked for: the user's choice, emulated or not
    assert resolve_dtype('bfloat16', 'cuda') == 'bfloat16'
    assert resolve_dtype('float16', 'cuda') == 'float16'
    assert resolve_dtype('float32', 'cuda') == 'float32'


def test_user_errors_share_one_exit_code():
    for error in (UserError("x"), ConfigError("x"), TokenizerError("x")):
        assert isinstance(error, UserError) and exit_code(error) == 2
    assert exit_code(Interrupted()) == 75 and exit_code(RuntimeError()) == 1


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


# -----------------------------------------------------------------------------
# machines without Triton (Windows with CUDA) and Apple's MPS, as those machines report themselves

def no_triton(monkeypatch):
    """ importlib as it answers where the triton package is not installed (torch on Windows). """
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'triton' else find_spec(name, *a))


def test_compile_on_cuda_without_triton_runs_eager_or_is_refused(monkeypatch, capsys):
    from nanogpt_plus.machine import resolve_compile, triton_installed
    # auto compiles on CUDA where Triton is
    assert resolve_compile(None, 'cuda', triton=True) is True
    no_triton(monkeypatch)
    assert not triton_installed()
    # auto: eager, in one line that says why and what to do
    assert resolve_compile(None, 'cuda') is False
    out = capsys.readouterr().out
    assert out.count('\n') == 1 and out.startswith("compile: torch.compile on CUDA needs Triton, which is not "
                                                   "installed; running without compile (install it")
    # asked for: refused before any work
    with pytest.raises(UserError, match=r"^--compile=True on CUDA needs Triton, which is not installed; install it "
                                        r"\(pip install triton; on Windows: pip install triton-windows\)"):
        resolve_compile(True, 'cuda')
    # the CPU's compile needs no Triton (C++ code), and compile=False asks for nothing
    assert resolve_compile(True, 'cpu') is True and resolve_compile(False, 'cuda') is False
    assert resolve_compile(None, 'cpu') is False and not capsys.readouterr().out


def test_float16_training_on_mps_is_refused_in_one_line(monkeypatch, tmp_path, capsys, tiny_dataset):
    import train
    from helpers import train_args
    from nanogpt_plus.machine import compute_setup
    with pytest.raises(UserError, match=r"^--dtype=float16 training on MPS is not supported"):
        compute_setup('mps', 'float16', None, num_threads=1, peak=False)
    # train.py on a Mac: MPS there, float16 asked for; refused before the model is built
    monkeypatch.setattr(torch.backends.mps, 'is_available', lambda: True)
    with pytest.raises(UserError, match=r"^--dtype=float16 training on MPS is not supported"):
        train.main(train_args(tiny_dataset, tmp_path / 'out', device='mps', dtype='float16', max_iters=1))
    assert "number of parameters" not in capsys.readouterr().out
    assert not (tmp_path / 'out' / 'ckpt.pt').exists()
