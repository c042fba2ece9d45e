"""
Settings for every entry point, with nanoGPT's command-line UX (its "Poor Man's Configurator") made
strict. A script declares its settings and their defaults as a dict and calls configure():

$ python train.py config/train_shakespeare_char.py --device=cpu --max_iters=200

A config file is plain Python whose top-level assignments override the defaults; then each --key=value
overrides again (values parsed with ast.literal_eval, else kept as strings). Unlike nanoGPT, nothing is
exec'd into the caller's globals, an unknown key or a value of the wrong type is an error that names it,
and errors end in one sentence and exit code 2 instead of a traceback. The result is a dict of every setting
whose `given` attribute says which ones a config file or the command line set (a resumed run keeps the
checkpoint's architecture for the rest).

Usage:
    from configurator import configure
    config = configure({'batch_size': 12, 'out_dir': 'out'}, doc=__doc__)   # reads sys.argv[1:]
    'batch_size' in config.given                                               # set by the user?
"""

import ast
import difflib
import os
import sys
import types


class ConfigError(Exception):
    """ A bad config file or command-line argument; the message says which and what to do. """


class Settings(dict):
    """
    The settings of a run: a plain dict (dict(settings) and saving it give one) plus `given`, the frozenset
    of keys a config file or a --key=value set, so a script can tell a choice from a default.
    """

    def __init__(self, values, given=()):
        super().__init__(values)
        self.given = frozenset(given)


def _closest(key, valid):
    close = difflib.get_close_matches(key, list(valid), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _check_type(key, value, default, source):
    """ Return value if it fits the default's type (an int where a float is expected is fine). """
    if default is None or value is None:
        return value
    expected = type(default)
    if expected is float and type(value) is int:
        return float(value)
    if type(value) is not expected:
        raise ConfigError(f"{source}: {key} expects {expected.__name__}, got {type(value).__name__} ({value!r})")
    return value


def _read_config_file(path):
    """ The top-level settings assigned by a Python config file, run in its own namespace. """
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} not found; pass an existing file such as "
                          f"config/train_shakespeare_char.py")
    with open(path, encoding="utf-8") as f:
        source = f.read()
    namespace = {"__file__": os.path.abspath(path), "__name__": "__config__"}
    try:
        exec(compile(source, path, "exec"), namespace)
    except SyntaxError as e:
        raise ConfigError(f"config file {path} has a syntax error on line {e.lineno}: {e.msg}") from None
    except Exception as e:  # NameError, ImportError, ZeroDivisionError, ...: the file's own code failed
        raise ConfigError(f"config file {path} failed on line {_failing_line(e, path)} "
                          f"({type(e).__name__}: {e}); fix that line") from None
    # keep plain settings; skip imports, helpers and dunders
    return source, {k: v for k, v in namespace.items()
                    if not k.startswith("_") and not isinstance(v, (types.ModuleType, types.FunctionType, type))}


def _failing_line(error, path):
    """ The line of the config file where error was raised (the deepest frame in that file), or '?'. """
    line = "?"
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _parse_value(text, default):
    """
    The value of --key=text: a Python literal where text is one (3, 1e-3, True, None, (0.9, 0.95), 'x'),
    else text itself, so --device=cuda needs no quotes. A string setting always gets a string:
    --out_dir=123 means the directory '123'.
    """
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):  # a bare word, an expression, an empty value: not a literal
        return text
    if isinstance(default, str) and not isinstance(value, str):
        return text
    return value


def parse_config(defaults, argv):
    """ defaults overridden by argv (config files and --key=value, in order) as Settings; raises ConfigError. """
    config, given = dict(defaults), set()
    for arg in argv:
        if not arg.startswith("--"):
            # anything without the leading -- names a config file
            source, settings = _read_config_file(arg)
            print(f"Overriding config with {arg}:")
            print(source)
            for key, value in settings.items():
                if key not in defaults:
                    raise ConfigError(f"unknown setting '{key}' in {arg}{_closest(key, defaults)}")
                config[key] = _check_type(key, value, defaults[key], arg)
                given.add(key)
            continue
        if "=" not in arg:
            raise ConfigError(f"malformed argument '{arg}': use --key=value")
        key, text = arg[2:].split("=", 1)
        if key not in defaults:
            raise ConfigError(f"unknown setting '{key}'{_closest(key, defaults)}")
        config[key] = _check_type(key, _parse_value(text, defaults[key]), defaults[key], f"--{key}")
        given.add(key)
        print(f"Overriding: {key} = {config[key]!r}")
    return Settings(config, given)


def format_settings(defaults):
    width = max(len(k) for k in defaults) if defaults else 0
    return "\n".join(f"  --{k.ljust(width)} = {v!r}" for k, v in defaults.items())


def configure(defaults, argv=None, doc=None):
    """
    parse_config on sys.argv[1:] for a script: -h/--help prints the doc and every setting with its default.
    A ConfigError propagates; runtime.run_main, around every script's main(), prints it as one line, exit 2.
    """
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        if doc:
            print(doc.strip() + "\n")
        print("settings (config files and --key=value override them, in order):")
        print(format_settings(defaults))
        sys.exit(0)
    return parse_config(defaults, argv)
