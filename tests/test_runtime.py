"""
nanogpt_plus/runtime.py: run_main's endings (exit codes, the process group torn down once) and the code digest that
tells uncommitted changes apart.
"""
import shutil

import pytest

from helpers import git
from nanogpt_plus.errors import UserError
from nanogpt_plus.runtime import code_digest, run_main


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
