"""
The small checks every entry point's check function is a list of: each raises a UserError with one line that
names the setting, the value it got and what it accepts, before the script does any work. The types are the
configurator's business (a setting keeps its default's type); these are the ranges and choices.

Usage:
    from nanogpt_plus.settings import check_choice, check_positive, check_range
    check_positive(cfg, 'batch_size', 'block_size')                 # each >= 1
    check_range(cfg, 'dropout', low=0.0, high=1.0, high_open=True)   # 0 <= dropout < 1
    check_choice(cfg, 'gelu', ('none', 'tanh'))
"""

from nanogpt_plus.runtime import UserError

DTYPES = ('auto', 'float32', 'bfloat16', 'float16')
BACKENDS = ('auto', 'nccl', 'gloo')
ATTENTIONS = ('flash', 'manual')
GELUS = ('none', 'tanh')


def _bad(key, value, allowed):
    return UserError(f"{key} must be {allowed}, got {value!r}; change --{key} (or the config file that sets it)")


def check_positive(cfg, *keys):
    """
    Each of keys is >= 1 (sizes and counts). A key cfg lacks, or None (where None means auto or off), is skipped,
    so one list fits every script; the same holds for the checks below.
    """
    for key in keys:
        if cfg.get(key) is not None and cfg[key] < 1:
            raise _bad(key, cfg[key], ">= 1")


def check_non_negative(cfg, *keys):
    """ Each of keys is >= 0. """
    for key in keys:
        if cfg.get(key) is not None and cfg[key] < 0:
            raise _bad(key, cfg[key], ">= 0")


def check_range(cfg, key, low=None, high=None, low_open=False, high_open=False):
    """ low <= cfg[key] <= high (< with low_open/high_open; None: no bound on that side). """
    if cfg.get(key) is None:  # absent from this script, or None where None means "off"/"auto"
        return
    value = cfg[key]
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and (value >= high if high_open else value > high)
    if too_low or too_high:
        raise _bad(key, value, _describe_range(low, high, low_open, high_open))


def _describe_range(low, high, low_open, high_open):
    """ '> 0', '>= 0 and < 1', '<= 5': the words for a range. """
    parts = []
    if low is not None:
        parts.append(f"{'>' if low_open else '>='} {low}")
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high}")
    return " and ".join(parts)


def check_choice(cfg, key, choices):
    """ cfg[key] is one of choices. """
    if key in cfg and cfg[key] not in choices:
        words = [repr(c) for c in choices]
        listed = words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
        raise UserError(f"{key} must be {listed}, got {cfg[key]!r}")


def check_flag(cfg, *keys):
    """ Each of keys is True or False (a setting whose default is None takes any literal, so say it here). """
    for key in keys:
        check_choice(cfg, key, (True, False))


def check_not_empty(cfg, *keys):
    """ Each of keys is a non-empty string (a directory or a name that must be given). """
    for key in keys:
        if key in cfg and not str(cfg[key]).strip():
            raise UserError(f"{key} must not be empty; pass --{key}=<a name>")


def check_model_shape(cfg):
    """ The architecture settings GPTConfig/GPT would otherwise reject with a ValueError deep in the build. """
    check_positive(cfg, 'n_layer', 'n_head', 'n_embd')
    check_range(cfg, 'dropout', low=0.0, high=1.0, high_open=True)
    check_choice(cfg, 'gelu', GELUS)
    check_choice(cfg, 'attention', ATTENTIONS)
    check_flag(cfg, 'bias')
    if all(k in cfg for k in ('n_embd', 'n_head')) and cfg['n_embd'] % cfg['n_head']:
        raise UserError(f"n_embd ({cfg['n_embd']}) must be divisible by n_head ({cfg['n_head']}): each head "
                        f"gets n_embd / n_head dimensions; change one of them")


def check_system(cfg):
    """ dtype, backend, compile and num_threads, as far as they can be checked without a device. """
    check_choice(cfg, 'dtype', DTYPES)
    check_choice(cfg, 'backend', BACKENDS)
    check_choice(cfg, 'compile', (None, True, False))
    check_non_negative(cfg, 'num_threads')
