"""
configurator.py: nanoGPT's UX (config file, then --key=value), but strict and with clear errors: unknown keys, wrong
types, a config file that raises or exits, and the shipped config files.
"""
import os
import runpy
import types

import pytest

import train
from configurator import ConfigError, Settings, parse_config
from helpers import REPO, exit_code, one_error_line, run_python

DEFAULTS = dict(batch_size=12, learning_rate=6e-4, out_dir='out', compile=None, decay_lr=True, betas=(0.9, 0.95))


def test_file_then_overrides_in_order(tmp_path):
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("import time\nbatch_size = 64\nout_dir = 'out-' + 'x'\n_private = 3\n")
    cfg = parse_config(DEFAULTS, [str(cfg_file), "--batch_size=32", "--learning_rate=1e-3"])
    assert cfg["batch_size"] == 32  # the command line comes after the file
    assert cfg["out_dir"] == "out-x"
    assert cfg["learning_rate"] == 1e-3
    assert cfg["decay_lr"] is True


@pytest.mark.parametrize('rank, echoed', [(None, True), ('0', True), ('1', False), ('3', False)])
def test_the_config_is_echoed_by_the_first_rank_only(tmp_path, monkeypatch, capsys, rank, echoed):
    # torchrun sets RANK in each of its processes, which all parse the same argv
    if rank is None:
        monkeypatch.delenv('RANK', raising=False)
    else:
        monkeypatch.setenv('RANK', rank)
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("batch_size = 64\n")
    cfg = parse_config(DEFAULTS, [str(cfg_file), "--learning_rate=1e-3"])
    assert cfg["batch_size"] == 64 and cfg["learning_rate"] == 1e-3  # every rank gets the settings
    out = capsys.readouterr().out
    if echoed:
        assert out == (f"Overriding config with {cfg_file}:\nbatch_size = 64\n\n"
                       "Overriding: learning_rate = 0.001\n")
    else:
        assert out == ""


def test_values_parsed_like_nanogpt():
    cfg = parse_config(DEFAULTS, ["--decay_lr=False", "--out_dir=my run", "--compile=True", "--betas=(0.8, 0.9)"])
    assert cfg["decay_lr"] is False and cfg["out_dir"] == "my run" and cfg["compile"] is True
    assert cfg["betas"] == (0.8, 0.9)
    # a string setting keeps a numeric-looking value as the string the user typed
    assert parse_config(DEFAULTS, ["--out_dir=123"])["out_dir"] == "123"
    assert parse_config(DEFAULTS, ["--out_dir=None"])["out_dir"] == "None"
    # ... a quoted string literal is unquoted, a bare word or an empty value is taken as typed
    assert parse_config(DEFAULTS, ["--out_dir='a b'"])["out_dir"] == "a b"
    assert parse_config(DEFAULTS, ["--out_dir=out-x"])["out_dir"] == "out-x"
    assert parse_config(DEFAULTS, ["--out_dir="])["out_dir"] == ""
    # a setting whose default is None takes any literal, and a bare word as a string
    assert parse_config(DEFAULTS, ["--compile=None"])["compile"] is None
    assert parse_config(DEFAULTS, ["--compile=max-autotune"])["compile"] == "max-autotune"
    # only the first '=' separates the key
    assert parse_config(DEFAULTS, ["--out_dir=a=b"])["out_dir"] == "a=b"
    # an int where a float is expected is fine, and becomes a float
    lr = parse_config(DEFAULTS, ["--learning_rate=1"])["learning_rate"]
    assert lr == 1.0 and isinstance(lr, float)


def test_unknown_key_names_it_and_suggests():
    with pytest.raises(ConfigError, match=r"unknown setting 'batch_sise'.*did you mean batch_size"):
        parse_config(DEFAULTS, ["--batch_sise=3"])


def test_unknown_key_in_file(tmp_path):
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("learning_rat = 1e-3\n")
    with pytest.raises(ConfigError, match=r"unknown setting 'learning_rat' in .*c.py.*learning_rate"):
        parse_config(DEFAULTS, [str(cfg_file)])


def test_wrong_type_names_key_expected_and_given(tmp_path):
    with pytest.raises(ConfigError, match=r"batch_size expects int, got float"):
        parse_config(DEFAULTS, ["--batch_size=3.5"])
    with pytest.raises(ConfigError, match=r"decay_lr expects bool, got str"):
        parse_config(DEFAULTS, ["--decay_lr=maybe"])
    cfg_file = tmp_path / "c.py"
    cfg_file.write_text("batch_size = '12'\n")
    with pytest.raises(ConfigError, match=r"batch_size expects int, got str"):
        parse_config(DEFAULTS, [str(cfg_file)])


def test_malformed_and_missing(tmp_path):
    with pytest.raises(ConfigError, match="malformed argument '--batch_size'"):
        parse_config(DEFAULTS, ["--batch_size"])
    with pytest.raises(ConfigError, match="config file .*nope.py not found"):
        parse_config(DEFAULTS, [str(tmp_path / "nope.py")])
    bad = tmp_path / "bad.py"
    bad.write_text("batch_size = (\n")
    with pytest.raises(ConfigError, match="syntax error on line"):
        parse_config(DEFAULTS, [str(bad)])


def test_a_config_file_that_is_not_a_regular_file_says_so(tmp_path, capsys):
    fifo = tmp_path / "c.py"
    os.mkfifo(fifo)  # reading it would wait for a writer forever
    for path, kind in ((str(fifo), "a FIFO (named pipe)"), (os.devnull, "a character device"),
                       (str(tmp_path), "a directory")):
        with pytest.raises(ConfigError) as e:
            parse_config(DEFAULTS, [path])
        assert str(e.value) == (f"config file {path} is {kind}, not a regular file; pass a config file such as "
                                f"config/train_shakespeare_char.py")
    # train.py given the FIFO: exit 2, that one line, nothing made (out_dir is here)
    out = tmp_path / "out"
    assert exit_code(lambda: train.main([str(fifo), "--device=cpu", f"--out_dir={out}"])) == 2
    assert "c.py is a FIFO (named pipe), not a regular file" in one_error_line(capsys)
    assert sorted(os.listdir(tmp_path)) == ["c.py"]


@pytest.mark.parametrize("args, message", [
    (["--n_layr=4"], "unknown setting 'n_layr' (did you mean n_layer"),
    (["--batch_size=x"], "batch_size expects int, got str"),
    (["--max_iters"], "malformed argument"),
    (["config/does_not_exist.py"], "not found"),
])
def test_cli_errors_are_one_line_exit_2(args, message):
    r = run_python(["train.py", *args], timeout=120)
    assert r.returncode == 2
    assert message in r.stderr
    assert "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0  # one line


def test_help_lists_settings():
    r = run_python(["train.py", "--help"], timeout=120)
    assert r.returncode == 0
    assert "--gradient_accumulation_steps" in r.stdout and "torchrun" in r.stdout


def settings_of(path):
    """ The plain settings a config file assigns, found by running it independently of configurator.py. """
    return {k: v for k, v in runpy.run_path(path).items()
            if not k.startswith("_") and not isinstance(v, (types.ModuleType, types.FunctionType, type))}


def test_shipped_configs_are_valid():
    """ Every config/*.py that train.py reads parses against train.py's settings. """
    import train
    names = ["train_shakespeare_char.py", "train_shakespeare_char_cpu.py", "train_shakespeare_char_fast.py",
             "train_shakespeare_fast.py", "train_gpt2.py", "train_gpt2_fineweb.py", "train_gpt2_speedrun.py",
             "finetune_shakespeare.py",
             "eval_gpt2.py", "eval_gpt2_medium.py", "eval_gpt2_large.py", "eval_gpt2_xl.py"]
    for name in names:
        path = os.path.join(REPO, "config", name)
        cfg = parse_config(train.DEFAULTS, [path])
        # every setting the file assigns arrives with the file's value; everything else keeps its default
        assigned, again = (settings_of(path) for _ in range(2))
        # e.g. wandb_run_name = 'ft-' + str(time.time())
        varying = {k for k in assigned if assigned[k] != again[k]}
        assert assigned and {k: cfg[k] for k in assigned if k not in varying} == \
            {k: v for k, v in assigned.items() if k not in varying}, name
        assert all(type(cfg[k]) is type(assigned[k]) for k in varying), name
        assert {k: v for k, v in cfg.items() if k not in assigned} == \
            {k: v for k, v in train.DEFAULTS.items() if k not in assigned}, name
    out_dirs = {name: parse_config(train.DEFAULTS, [os.path.join(REPO, "config", name)])["out_dir"] for name in names}
    assert out_dirs["train_shakespeare_char.py"] == "out-shakespeare-char"
    # the quick start's run and nanoGPT's GPU recipe are two runs: neither finds the other's checkpoint in its way
    assert out_dirs["train_shakespeare_char_cpu.py"] == "out-shakespeare-char-cpu"
    training = [n for n in names if n.startswith("train_")]
    assert len({out_dirs[n] for n in training}) == len(training), out_dirs
    assert out_dirs["finetune_shakespeare.py"] == "out-shakespeare"
    assert out_dirs["eval_gpt2.py"] == train.DEFAULTS["out_dir"]  # the eval configs don't set one
    cpu = parse_config(train.DEFAULTS, [os.path.join(REPO, "config", "train_shakespeare_char_cpu.py")])
    laptop = dict(block_size=64, batch_size=12, n_layer=4, n_head=4, n_embd=128, max_iters=2000,
                  lr_decay_iters=2000, dropout=0.0, eval_iters=20, log_interval=1)
    assert {k: cpu[k] for k in laptop} == laptop
    # the fast recipe trains the same model on the same batches; only the recipe differs
    fast = parse_config(train.DEFAULTS, [os.path.join(REPO, "config", "train_shakespeare_char_fast.py")])
    same = ('dataset', 'block_size', 'batch_size', 'n_layer', 'n_head', 'n_embd', 'dropout',
            'gradient_accumulation_steps')
    assert {k: fast[k] for k in same} == {k: cpu[k] for k in same}
    assert (fast['optimizer'], fast['pos'], fast['qk_norm'], fast['lr_schedule']) == ('muon', 'rope', True, 'wsd')
    # on GPT-2 tokens: the same model and batches on the BPE Shakespeare, in under a third of the baseline's 600
    bpe = parse_config(train.DEFAULTS, [os.path.join(REPO, "config", "train_shakespeare_fast.py")])
    assert bpe['dataset'] == 'shakespeare' and {k: bpe[k] for k in same[1:]} == {k: cpu[k] for k in same[1:]}
    assert bpe['optimizer'] == 'muon' and bpe['max_iters'] + 1 <= 601 / 3 and bpe['lr_decay_iters'] == bpe['max_iters']
    # the speedrun: a third of the GPT-2 recipe's steps, at its batch
    gpt2, speedrun = (parse_config(train.DEFAULTS, [os.path.join(REPO, "config", n)])
                      for n in ("train_gpt2_fineweb.py", "train_gpt2_speedrun.py"))
    assert speedrun['max_iters'] == round(gpt2['max_iters'] / 3) == speedrun['lr_decay_iters']
    tokens = ('batch_size', 'block_size', 'gradient_accumulation_steps')
    assert {k: speedrun[k] for k in tokens} == {k: gpt2[k] for k in tokens}
    xl = parse_config(train.DEFAULTS, [os.path.join(REPO, "config", "eval_gpt2_xl.py")])
    assert xl["init_from"] == "gpt2-xl" and xl["eval_only"] is True


def test_command_line_values_read_what_they_can_without_the_config_files(tmp_path):
    # what a node that can't read its config file forms its process group with (distributed.start)
    import train
    from configurator import command_line_values
    from nanogpt_plus.distributed import GROUP_SETTINGS
    argv = [str(tmp_path / 'missing.py'), '--device=cpu', '--dist_timeout=oops', '--backend=gloo',
            '--backend=nccl', '--backend=mpi', '--dist_timeout=-5', '--batch_size=3']
    # the last value given; one that is no value of the setting (its type, choices, range) leaves
    # the one before
    assert command_line_values(train.DEFAULTS, argv, GROUP_SETTINGS) == dict(
        device='cpu', backend='nccl', dist_timeout=0, join_timeout=120)
    # a script without some of them (sample.py has no backend): those it has
    plain = dict(device='auto', seed=1)
    assert command_line_values(plain, ['--device=cuda:1'], GROUP_SETTINGS) == dict(device='cuda:1')


def test_read_settings_holds_a_failure_for_the_one_verdict(tmp_path, monkeypatch):
    # a node that can't read its settings still says how to form the process group; the failure is
    # given by distributed.start: at once in a single process
    import train
    from configurator import read_settings
    from nanogpt_plus.distributed import GROUP_SETTINGS, start
    missing = str(tmp_path / 'missing.py')
    cfg, failure, group = read_settings(train.DEFAULTS, [missing, '--device=cpu'], train.check_settings,
                                        keep=GROUP_SETTINGS)
    assert cfg is None and isinstance(failure, ConfigError) and 'missing.py not found' in str(failure)
    assert group == dict(device='cpu', backend='auto', dist_timeout=0, join_timeout=120)
    monkeypatch.delenv('RANK', raising=False)
    with pytest.raises(ConfigError, match='missing.py not found'):
        start(failure, **group)
    cfg, failure, group = read_settings(train.DEFAULTS, ['--device=cpu', '--n_layer=2'], train.check_settings,
                                        keep=GROUP_SETTINGS)
    assert failure is None and cfg.n_layer == 2 and cfg.given == {'device', 'n_layer'}
    assert group == dict(device='cpu', backend='auto', dist_timeout=0, join_timeout=120)
    assert start(None, **group).device == 'cpu'


def test_settings_are_read_as_attributes_and_frozen():
    cfg = parse_config(DEFAULTS, ["--batch_size=32"])
    assert cfg.batch_size == cfg["batch_size"] == 32 and cfg.given == {"batch_size"}
    with pytest.raises(AttributeError, match="no setting 'batch_sise'"):
        cfg.batch_sise
    # nothing writes to it once read: each way of writing to a dict is refused, in one clear line
    writes = [lambda: cfg.__setitem__("batch_size", 1), lambda: setattr(cfg, "batch_size", 1),
              lambda: cfg.update(batch_size=1), lambda: cfg.pop("batch_size"), lambda: cfg.popitem(),
              lambda: cfg.setdefault("x", 1), lambda: cfg.clear(), lambda: cfg.__delitem__("batch_size"),
              lambda: delattr(cfg, "given"), lambda: cfg.__ior__({"batch_size": 1})]
    for write in writes:
        with pytest.raises(TypeError, match="the settings are frozen once read"):
            write()
    assert cfg.batch_size == 32 and len(cfg) == len(DEFAULTS)
    # a value derived from them makes new settings; these stay as read
    run = cfg.replaced({"learning_rate": 1e-3})
    assert run.learning_rate == 1e-3 and cfg.learning_rate == 6e-4 and run.given == cfg.given
    with pytest.raises(KeyError, match="no setting 'lr'"):
        cfg.replaced({"lr": 1.0})
    # a plain dict (what a checkpoint's 'config' stores), copies and pickles are the same settings
    import copy
    import pickle
    assert type(dict(cfg)) is dict and dict(cfg) == cfg
    for other in (copy.copy(cfg), copy.deepcopy(cfg), pickle.loads(pickle.dumps(cfg))):
        assert other == cfg and other.given == cfg.given and other.batch_size == 32
    # a setting can't be named like a method: cfg.items must be the dict's
    with pytest.raises(ValueError, match="setting items has the name of a method"):
        Settings(dict(items=1))


@pytest.mark.usefixtures('one_thread')
def test_a_config_file_that_exits_is_refused(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("batch_size = 4\nimport sys\nsys.exit(0)\n")
    with pytest.raises(ConfigError, match=f"config file {path} calls exit\\(\\) on line 3"):
        parse_config(train.DEFAULTS, [str(path)])
    # os._exit would end the process with exit 0 and no word: it is refused the same way, and os._exit is back
    path.write_text("batch_size = 4\nimport os\nos._exit(0)\n")
    with pytest.raises(ConfigError, match=f"config file {path} calls exit\\(\\) on line 3"):
        parse_config(train.DEFAULTS, [str(path)])
    assert os._exit.__module__ == 'posix'
    path.write_bytes("out_dir = 'caf\u00e9'\n".encode('latin-1'))
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        parse_config(train.DEFAULTS, [str(path)])


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize("body, error", [
    ("batch_size = 1 / 0\n", "ZeroDivisionError"),
    ("import not_a_module_anywhere\n", "ModuleNotFoundError"),
    ("batch_size = 4\nout_dir = undefined_name\n", "NameError"),
])
def test_config_file_that_raises_names_file_line_and_error(tmp_path, body, error):
    path = tmp_path / "bad_config.py"
    path.write_text(body)
    line = body.count("\n")  # the failing statement is the last line of each body
    with pytest.raises(ConfigError, match=rf"config file {path} failed on line {line} \({error}: .*\); fix that"):
        parse_config(train.DEFAULTS, [str(path)])
