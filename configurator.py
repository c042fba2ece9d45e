"""
Settings for every entry point, with nanoGPT's command-line UX (its "Poor Man's Configurator") made
strict. A script declares its settings as a Schema (each Setting with its default, type, allowed
values and a one-line help, on its name's line; nanogpt_plus/settings.py holds what several scripts
share) and calls configure(), or read_settings() where a process group hears one verdict:

$ python train.py config/train_shakespeare_char.py --device=cpu --max_iters=200
$ python train.py --help          # the script's doc, then every setting with its default and help

A config file is plain Python whose top-level assignments override the defaults; then each
--key=value overrides again (values parsed with ast.literal_eval, else kept as strings). Unlike
nanoGPT, nothing is exec'd into the caller's globals, an unknown key or a value of the wrong type
(None included, where the setting has no "None" meaning) is an error that names it, and errors end
in one sentence and exit code 2 instead of a traceback. The result is a frozen Settings: a dict of
every setting, read as attributes (config.batch_size), whose `given` attribute says which ones a
config file or the command line set (a resumed run keeps the checkpoint's architecture for the
rest). A plain dict of defaults works too (the scripts in scripts/): each value then keeps its
default's type.

Usage:
    from configurator import Group, Schema, Setting, configure
    SETTINGS = Schema(Group('run', batch_size=Setting(12, "sequences per batch", low=1)))
    config = configure(SETTINGS, doc=__doc__)        # reads sys.argv[1:]
    SETTINGS.check(config)                           # types, choices and ranges: one UserError naming the setting
    config.batch_size                                # 12, or what the user gave
    'batch_size' in config.given                     # set by the user?
"""

import ast
import dataclasses
import difflib
import math
import os
import sys
import types

from nanogpt_plus.errors import ConfigError, UserError
from nanogpt_plus.files import refuse_special_file


class Settings(dict):
    """
    The settings of a run, frozen once read: a dict (dict(settings) and saving it give a plain one),
    read as attributes (cfg.batch_size, which grep finds) or items, plus `given`, the frozenset of
    keys a config file or a --key=value set, so a script can tell a choice from a default. Nothing
    writes to it after it is read: item or attribute assignment, update, pop, setdefault, clear are
    refused. A value the run derives (what a resumed checkpoint imposes) makes a new Settings
    (replaced), so the one the user gave stays as it was read.
    """

    def __init__(self, values, given=()):
        super().__init__(values)
        shadowed = [k for k in self if hasattr(dict, k) or k in ('given', 'select', 'chosen', 'replaced')]
        if shadowed:  # cfg.items would be the dict's method, not the setting
            raise ValueError(f"setting {shadowed[0]} has the name of a method of Settings; rename it")
        object.__setattr__(self, 'given', frozenset(given))

    def __getattr__(self, name):
        # only for names that are no attribute of the object itself: a setting
        try:
            return self[name]
        except KeyError:
            raise AttributeError(f"no setting {name!r}") from None

    def _refuse(self, *args, **kwargs):
        raise TypeError("the settings are frozen once read: a value derived from them goes into a new "
                        "Settings (settings.replaced({...})) or beside them, never into them")

    __setitem__ = __delitem__ = __setattr__ = __delattr__ = __ior__ = _refuse
    update = pop = popitem = setdefault = clear = _refuse

    def __reduce__(self):
        # copy and pickle rebuild it through __init__ (the dict's way would set item after item)
        return (Settings, (dict(self), self.given))

    def replaced(self, values):
        """
        A new Settings: these with values (a dict of settings it has) in place of theirs, the same
        `given`; self is unchanged. How a script holds the run's settings beside the user's (a
        resume's architecture, a fine-tuning rate worked out from the model).
        """
        unknown = [k for k in values if k not in self]
        if unknown:
            raise KeyError(f"no setting {unknown[0]!r} to replace")
        return Settings({**self, **values}, self.given)

    def select(self, spec):
        """
        The values of one topic: spec is a dataclass whose fields are named as settings (a data
        spec, an LR schedule), built from those settings alone. A component is handed this, never
        the whole settings.
        """
        return spec(**{f.name: self[f.name] for f in dataclasses.fields(spec)})

    def chosen(self, names):
        """ {name: value} of those of names that a config file or the command line set. """
        return {k: self[k] for k in names if k in self.given}


# -----------------------------------------------------------------------------
# the schema: every setting declared once, with its default, type, allowed values and help

class Setting:
    """
    One setting: its default, a one-line help, and what it accepts. kind: its type (the default's
    unless given; an int is accepted where a float is expected); none_ok: None is a value of its own
    ("auto", "all", "off"; True when the default is None); choices: the allowed values; low/high:
    bounds (open with low_open/high_open); not_empty: a string that must not be blank. A float is
    finite: NaN passes every bound (each comparison with it is False) and an inf (1e999 parses as
    one) is no rate, norm or fraction, so both are refused; infinite_ok=True lets a setting whose
    inf means something take one.
    """

    def __init__(self, default, help, kind=None, choices=None, low=None, high=None, low_open=False,
                 high_open=False, none_ok=None, not_empty=False, infinite_ok=False):
        if kind is None and default is None:
            raise TypeError("a setting whose default is None needs its kind")
        self.default = default
        self.help = help
        self.kind = kind if kind is not None else type(default)
        self.choices = tuple(choices) if choices is not None else None
        self.low = low
        self.high = high
        self.low_open = low_open
        self.high_open = high_open
        self.none_ok = default is None if none_ok is None else none_ok
        self.not_empty = not_empty
        self.infinite_ok = infinite_ok

    def kind_name(self):
        return self.kind.__name__ + (" or None" if self.none_ok else "")

    def convert(self, key, value, source):
        """
        value as this setting's kind (an int becomes a float where a float is expected), or a
        ConfigError.
        """
        if value is None and self.none_ok:
            return value
        if self.kind is float and type(value) is int:
            return float(value)
        if type(value) is not self.kind:
            if self.choices is not None:  # the words that say what to give
                raise ConfigError(f"{source}: {self._choice_message(key, value)}")
            got = "None" if value is None else f"{type(value).__name__} ({value!r})"
            raise ConfigError(f"{source}: {key} expects {self.kind_name()}, got {got}")
        return value

    def problem(self, key, value):
        """ Why value is not acceptable for this setting, as one line naming it, or None. """
        try:
            value = self.convert(key, value, source=f"--{key}")
        except ConfigError as e:
            return str(e)
        if self.choices is not None and value not in self.choices:
            return self._choice_message(key, value)
        if value is None:
            return None
        if self.not_empty and not str(value).strip():
            return f"{key} must not be empty; pass --{key}=<a name>"
        if isinstance(value, float) and not math.isfinite(value) and \
                (math.isnan(value) or not self.infinite_ok):
            return (f"{key} must be a finite number, got {value!r}; change --{key} (or the config "
                    f"file that sets it)")
        too_low = self.low is not None and (value <= self.low
                                            if self.low_open else value < self.low)
        too_high = self.high is not None and (value >= self.high
                                              if self.high_open else value > self.high)
        if too_low or too_high:
            return (
                f"{key} must be {self._describe_range()}, got {value!r}; change --{key} (or the config file that "
                f"sets it)")
        return None

    def _choice_message(self, key, value):
        words = [repr(c) for c in self.choices]
        listed = words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
        return f"{key} must be {listed}, got {value!r}"

    def _describe_range(self):
        """ '> 0', '>= 0 and < 1', '<= 5': the words for the bounds. """
        parts = []
        if self.low is not None:
            parts.append(f"{'>' if self.low_open else '>='} {self.low}")
        if self.high is not None:
            parts.append(f"{'<' if self.high_open else '<='} {self.high}")
        return " and ".join(parts)


class Group(dict):
    """
    Settings that belong together, in the order --help lists them: {name: Setting} with a title.
    """

    def __init__(self, title, **settings):
        super().__init__(settings)
        self.title = title


class Schema(dict):
    """
    An entry point's settings, composed of groups: {name: default} (what a DEFAULTS dict always was,
    so dict(schema) gives the plain defaults) plus `specs`, {name: Setting}. Every setting is in one
    of the script's groups, with its default there.
    """

    def __init__(self, *groups):
        specs = {}
        self.sections = []
        for group in groups:
            for name, spec in group.items():
                if name in specs:
                    raise ValueError(f"setting {name} is declared twice")
                specs[name] = spec
            self.sections.append((group.title, list(group)))
        super().__init__({name: spec.default for name, spec in specs.items()})
        self.specs = specs

    def check(self, cfg):
        """
        Every value of cfg against its Setting (type, None, choices, range): the first problem as a
        UserError.
        """
        for key, value in cfg.items():
            spec = self.specs.get(key)
            message = spec.problem(key, value) if spec is not None else None
            if message:
                raise UserError(message)

    def describe(self):
        """
        --help's list: per group, each setting with its default, and its help on the line below.
        """
        width = max(len(k) for k in self)
        lines = []
        for title, names in self.sections:
            lines.append(f"\n{title}:")
            for name in names:
                lines.append(f"  --{name.ljust(width)} = {self[name]!r}")
                lines.append(f"      {self.specs[name].help}")
        return "\n".join(lines)


def _closest(key, valid):
    close = difflib.get_close_matches(key, list(valid), n=3, cutoff=0.6)
    return f" (did you mean {', '.join(close)}?)" if close else ""


def _check_type(key, value, defaults, source):
    """
    value if it fits the setting's type (its Setting's kind, else the plain default's), else a
    ConfigError.
    """
    specs = getattr(defaults, 'specs', None)
    if specs is not None:
        return specs[key].convert(key, value, source)
    default = defaults[key]
    if default is None or value is None:  # a plain dict's None default takes any literal
        return value
    expected = type(default)
    if expected is float and type(value) is int:
        return float(value)
    if type(value) is not expected:
        raise ConfigError(
            f"{source}: {key} expects {expected.__name__}, got {type(value).__name__} ({value!r})")
    return value


def _read_config_file(path):
    """ The top-level settings assigned by a Python config file, run in its own namespace. """
    refuse_special_file(path, "config file", ConfigError)
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path} not found; pass an existing file such as "
                          f"config/train_shakespeare_char.py")
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte {e.start}); save it as UTF-8") from None
    except OSError as e:
        raise ConfigError(f"config file {path} could not be read ({e.strerror or e})") from None
    namespace = {"__file__": os.path.abspath(path), "__name__": "__config__"}
    real_exit = os._exit
    # os._exit would end the process at once, exit code 0 and no word: while the file runs it is
    # sys.exit's
    os._exit = sys.exit
    try:
        exec(compile(source, path, "exec"), namespace)
    except SyntaxError as e:
        raise ConfigError(
            f"config file {path} has a syntax error on line {e.lineno}: {e.msg}") from None
    # sys.exit() or exit() in a config file must not end the run as if it had finished
    except SystemExit as e:
        raise ConfigError(
            f"config file {path} calls exit() on line {_failing_line(e, path)}; a config file only "
            f"assigns settings: remove that call") from None
    # NameError, ImportError, ZeroDivisionError, ...: the file's own code failed
    except Exception as e:
        raise ConfigError(f"config file {path} failed on line {_failing_line(e, path)} "
                          f"({type(e).__name__}: {e}); fix that line") from None
    finally:
        os._exit = real_exit
    # keep plain settings; skip imports, helpers and dunders
    return source, {
        k: v
        for k, v in namespace.items()
        if not k.startswith("_") and not isinstance(v, (types.ModuleType, types.FunctionType, type))
    }


def _failing_line(error, path):
    """
    The line of the config file where error was raised (the deepest frame in that file), or '?'.
    """
    line = "?"
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == path:
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _parse_value(text, kind):
    """
    The value of --key=text: a Python literal where text is one (3, 1e-3, True, None, (0.9, 0.95),
    'x'), else text itself, so --device=cuda needs no quotes. A string setting (kind str) always
    gets a string:
    --out_dir=123 means the directory '123'.
    """
    try:
        value = ast.literal_eval(text)
    # a bare word, an expression, an empty value
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text
    if kind is str and not isinstance(value, str):
        return text
    return value


def parse_config(defaults, argv):
    """
    defaults overridden by argv (config files and --key=value, in order) as Settings; raises
    ConfigError.
    """
    config = dict(defaults)
    given = set()
    for arg in argv:
        if not arg.startswith("--"):
            # anything without the leading -- names a config file
            source, settings = _read_config_file(arg)
            _echo(f"Overriding config with {arg}:\n{source}")
            for key, value in settings.items():
                if key not in defaults:
                    raise ConfigError(f"unknown setting '{key}' in {arg}{_closest(key, defaults)}")
                config[key] = _check_type(key, value, defaults, arg)
                given.add(key)
            continue
        if "=" not in arg:
            raise ConfigError(f"malformed argument '{arg}': use --key=value")
        key, text = arg[2:].split("=", 1)
        if key not in defaults:
            raise ConfigError(f"unknown setting '{key}'{_closest(key, defaults)}")
        config[key] = _argument_value(defaults, key, text)
        given.add(key)
        _echo(f"Overriding: {key} = {config[key]!r}")
    return Settings(config, given)


def _argument_value(defaults, key, text):
    """ The value of --key=text, of the setting's type, or a ConfigError. """
    spec = getattr(defaults, 'specs', {}).get(key)
    kind = spec.kind if spec is not None else type(defaults[key])
    return _check_type(key, _parse_value(text, kind), defaults, f"--{key}")


def command_line_values(defaults, argv, names):
    """
    {name: value} of the settings in names: the last --name=value of argv that is one of its
    values (its type, choices and range), else the default. What a script can still tell of its
    settings when they can't all be read (a config file missing on one node of several, whose
    process group must be formed all the same, to say why on every node); config files are not
    read.
    """
    values = {name: defaults[name] for name in names if name in defaults}
    for arg in argv:
        key, equals, text = arg[2:].partition("=")
        if not arg.startswith("--") or not equals or key not in values:
            continue
        try:
            value = _argument_value(defaults, key, text)
        except ConfigError:  # not a value of it: the one before stands
            continue
        spec = getattr(defaults, 'specs', {}).get(key)
        if spec is None or spec.problem(key, value) is None:  # in its range, one of its choices
            values[key] = value
    return values


def _echo(text):
    """ Print text on the first rank only: torchrun starts one process per rank, each parsing the same argv,
    and one copy of the config is what the log needs (RANK is torchrun's; unset in a single process). """
    if os.environ.get('RANK') in (None, '', '0'):
        print(text)


def format_settings(defaults):
    """ Every setting with its default (and its help, for a Schema), as --help lists them. """
    if hasattr(defaults, 'describe'):
        return defaults.describe()
    width = max(len(k) for k in defaults) if defaults else 0
    return "\n".join(f"  --{k.ljust(width)} = {v!r}" for k, v in defaults.items())


def configure(defaults, argv=None, doc=None):
    """
    parse_config on sys.argv[1:] for a script: -h/--help prints the doc and every setting with its
    default. A ConfigError propagates; runtime.run_main, around every script's main(), prints it as
    one line, exit 2.
    """
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        if doc:
            print(doc.strip() + "\n")
        print("settings (config files and --key=value override them, in order):")
        print(format_settings(defaults))
        sys.exit(0)
    return parse_config(defaults, argv)


def read_settings(defaults, argv, check, doc=None, keep=()):
    """
    A script's settings as every process of a run reads them: (settings, failure, kept). settings:
    configure()'s (config files, then --key=value) once check(settings) passed, else None, with
    failure the exception either raised (a config file only node 0 has, a value one machine
    refuses): held, not raised, so that the process group can still be formed and every rank hear
    the one verdict (distributed.start). kept: {name: value} of the settings in keep (those the
    process group is formed with): the settings' own, or, where they could not be read, what the
    command line alone says of them (command_line_values: else their defaults). --help prints and
    exits here, as configure() does.
    """
    try:
        settings = configure(defaults, argv, doc=doc)
        check(settings)
    except Exception as e:  # a bug too: the other ranks must hear of it
        return None, e, command_line_values(defaults, argv, keep)
    return settings, None, {name: settings[name] for name in keep if name in settings}
