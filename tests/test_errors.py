"""
nanogpt_plus/errors.py: every error a user can cause ends with one exit code, and the words of a NaN loss say
whether a checkpoint was kept.
"""
import pytest
import torch

from nanogpt_plus.errors import ConfigError, Interrupted, TokenizerError, UserError, exit_code, non_finite_loss


def test_user_errors_share_one_exit_code():
    for error in (UserError("x"), ConfigError("x"), TokenizerError("x")):
        assert isinstance(error, UserError) and exit_code(error) == 2
    assert exit_code(Interrupted()) == 75 and exit_code(RuntimeError()) == 1


@pytest.mark.usefixtures('one_thread')
def test_a_nan_before_any_save_does_not_speak_of_a_kept_checkpoint(tmp_path):
    assert "no checkpoint had been saved to" in str(non_finite_loss(float('nan'), 0, str(tmp_path / 'ckpt.pt')))
    torch.save({}, tmp_path / 'ckpt.pt')
    assert "the last good checkpoint in" in str(non_finite_loss(float('nan'), 5, str(tmp_path / 'ckpt.pt')))


def test_an_error_line_shows_a_users_control_characters_escaped(capsys):
    from nanogpt_plus.errors import printable
    from nanogpt_plus.runtime import run_main
    value = "o\nstopped cleanly; continue with --init_from=resume\x1b[31m\t\u200b ünï"
    assert printable(value) == "o\\nstopped cleanly; continue with --init_from=resume\\x1b[31m\\t\\u200b ünï"

    def main():
        raise UserError(f"no dataset {value}; pass another --dataset")
    with pytest.raises(SystemExit) as e:
        run_main(main)
    assert e.value.code == 2
    assert capsys.readouterr().err == f"error: no dataset {printable(value)}; pass another --dataset\n"


def test_an_error_line_keeps_both_ends_of_a_huge_value_and_says_what_it_cut(capsys):
    """ A value of megabytes (a YAML entry, a setting) made an error line of gigabytes: bounded, both ends kept. """
    from nanogpt_plus.errors import MAX_LINE_CHARS
    from nanogpt_plus.runtime import run_main
    message = f"HEAD {'a' * 3_000_000}TAIL; pass another --dataset"

    def main():
        raise UserError(message)
    with pytest.raises(SystemExit) as e:
        run_main(main)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count('\n') == 1
    assert len(err) < MAX_LINE_CHARS + 100
    assert err.startswith("error: HEAD aaa") and err.endswith("TAIL; pass another --dataset\n")
    assert f"[... {len(message) - MAX_LINE_CHARS:,} characters cut ...]" in err
