"""
The settings schema: each entry point declares its settings at its top with their defaults, types
and help, those several scripts share once in nanogpt_plus/settings.py; --help lists them; a value
of the wrong type, None included, is one line and exit 2.
"""

import ast
import glob
import os
import runpy

import pytest

import bench
import eval as eval_script
import export_hf
import finetune
import sample
import train
from configurator import ConfigError, Group, Schema, Setting, parse_config
from helpers import REPO, run_python
from nanogpt_plus import settings
from nanogpt_plus.errors import UserError

SCRIPTS = {'train': train, 'finetune': finetune, 'sample': sample, 'eval': eval_script, 'bench': bench,
           'export_hf': export_hf}

# nanoGPT's train.py settings, with their defaults there (the interface other tools and users rely on)
NANOGPT_TRAIN = dict(
    out_dir='out', eval_interval=2000, log_interval=1, eval_iters=200, eval_only=False, always_save_checkpoint=True,
    init_from='scratch', wandb_log=False, wandb_project='owt', wandb_run_name='gpt2', dataset='openwebtext',
    gradient_accumulation_steps=40, batch_size=12, block_size=1024, n_layer=12, n_head=12, n_embd=768, dropout=0.0,
    bias=False, learning_rate=6e-4, max_iters=600000, weight_decay=1e-1, beta1=0.9, beta2=0.95, grad_clip=1.0,
    decay_lr=True, warmup_iters=2000, lr_decay_iters=600000, min_lr=6e-5, backend='auto', device='auto',
    dtype='auto', compile=None)


def test_train_keeps_nanogpts_settings_and_defaults():
    assert len(NANOGPT_TRAIN) == 33
    assert {k: train.DEFAULTS[k] for k in NANOGPT_TRAIN} == NANOGPT_TRAIN
    # nanoGPT's device/dtype/compile defaults name one machine ('cuda', 'bfloat16', True); ours choose for it
    assert train.DEFAULTS.specs['compile'].none_ok


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_setting_has_a_type_and_a_one_line_help(name):
    schema = SCRIPTS[name].DEFAULTS
    assert isinstance(schema, Schema)
    for key, spec in schema.specs.items():
        assert spec.help.strip() and "\n" not in spec.help, key
        assert spec.problem(key, spec.default) is None, key  # every default is valid


@pytest.mark.parametrize("name", ['train', 'finetune', 'sample', 'eval', 'export_hf'])
def test_help_lists_every_setting_with_default_and_help(name):
    r = run_python([f"{name}.py", "--help"], timeout=120)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    for key, spec in SCRIPTS[name].DEFAULTS.specs.items():
        at = next((i for i, ln in enumerate(lines) if ln.strip().startswith(f"--{key} ")), None)
        assert at is not None, key
        assert lines[at].endswith(f"= {spec.default!r}") and lines[at + 1].strip() == spec.help, lines[at:at + 2]


def test_shared_settings_are_declared_once():
    # a setting several scripts use is one declaration (one help, type and range), whatever default
    # a script gives; but where a script gives the name a meaning of its own: finetune.py's
    # learning_rate and block_size (0 = the model's, scaled / kept), eval.py's dataset ('' = the
    # checkpoint's), export_hf.py's weights, eval.py's and finetune.py's tasks, sample.py's
    # num_threads (0 = torch's count, not a timed choice)
    own = {('finetune', 'learning_rate'), ('finetune', 'block_size'), ('eval', 'dataset'),
           ('export_hf', 'weights'), ('eval', 'task'), ('finetune', 'task'), ('sample', 'num_threads')}
    users = {key: [n for n in SCRIPTS if key in SCRIPTS[n].DEFAULTS and (n, key) not in own]
             for n in SCRIPTS for key in SCRIPTS[n].DEFAULTS}
    shared = {key for key, names in users.items() if len(names) > 1}
    assert {'out_dir', 'seed', 'dtype', 'init_from', 'batch_size', 'weight_decay'} <= shared
    for key in shared:
        specs = [SCRIPTS[n].DEFAULTS.specs[key] for n in users[key]]
        assert len({(s.help, s.kind, s.choices, s.low, s.high) for s in specs}) == 1, key
    assert finetune.DEFAULTS['weight_decay'] == 0.01 and train.DEFAULTS['weight_decay'] == 0.1
    assert sample.DEFAULTS['init_from'] == 'resume' and train.DEFAULTS['init_from'] == 'scratch'


@pytest.mark.parametrize("arg, message", [
    ("--decay_lr=None", "decay_lr expects bool, got None"),
    ("--always_save_checkpoint=None", "always_save_checkpoint expects bool, got None"),
    ("--batch_size=None", "batch_size expects int, got None"),
    ("--learning_rate=None", "learning_rate expects float, got None"),
    ("--batch_size=3.5", "batch_size expects int, got float"),
    ("--compile=yes", "compile must be None, True or False, got 'yes'"),
])
def test_a_value_of_the_wrong_type_is_refused_where_it_is_read(arg, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(train.DEFAULTS, [arg])


def test_none_where_it_means_something_is_taken():
    assert parse_config(train.DEFAULTS, ["--compile=None"])["compile"] is None  # auto
    assert parse_config(sample.DEFAULTS, ["--top_k=None"])["top_k"] is None  # no top-k
    # a string setting: a name
    assert parse_config(train.DEFAULTS, ["--out_dir=None"])["out_dir"] == "None"


def test_config_file_values_are_checked_too(tmp_path):
    path = tmp_path / "c.py"
    path.write_text("decay_lr = None\n")
    with pytest.raises(ConfigError, match=f"{path}: decay_lr expects bool, got None"):
        parse_config(train.DEFAULTS, [str(path)])


def test_check_refuses_a_none_that_came_another_way():
    # a dict built in code (a test's, a script's) goes through the same check as the command line
    with pytest.raises(UserError, match="max_iters expects int, got None"):
        train.check_settings(dict(train.DEFAULTS, max_iters=None))
    with pytest.raises(UserError, match="epochs expects int, got None"):
        finetune.check_settings(dict(finetune.DEFAULTS, epochs=None))
    # a value of the right type but not among the choices: the check names them
    with pytest.raises(UserError, match="data_order must be 'random' or 'sequential', got 'shuffled'"):
        train.check_settings(parse_config(train.DEFAULTS, ["--data_order=shuffled"]))


@pytest.mark.parametrize("arg", ["--decay_lr=None", "--batch_size=None"])
def test_wrong_type_on_the_command_line_is_one_line_exit_2(arg, tmp_path):
    r = run_python(["train.py", arg, f"--out_dir={tmp_path}"], timeout=120)
    assert r.returncode == 2 and r.stderr.startswith("error: --") and r.stderr.strip().count("\n") == 0, r.stderr


def test_schema_composition_rules():
    a = Group('a', x=Setting(1, "x", low=0), y=Setting('s', "y"))
    schema = Schema(a)
    assert dict(schema) == {'x': 1, 'y': 's'} and schema.specs['x'].help == "x"
    with pytest.raises(ValueError, match="declared twice"):
        Schema(a, Group('b', x=Setting(2, "again")))
    with pytest.raises(TypeError):  # a script's default is written in its group, never given apart
        Schema(a, x=5)
    with pytest.raises(TypeError):
        Setting(None, "a None default needs its kind")
    # a shared declaration: each script's own default, one type, range and help
    small, big = settings.batch_size(12), settings.batch_size(32)
    assert (small.default, big.default) == (12, 32) and small.help == big.help and small.low == big.low == 1
    # compile's None (auto) stays a value whatever a script's default
    assert settings.compile(False).problem('compile', None) is None


PREPARE_SCRIPTS = sorted(glob.glob(os.path.join(REPO, 'data', '*', 'prepare.py')))


@pytest.mark.parametrize("path", [os.path.join(REPO, f"{name}.py") for name in SCRIPTS] + PREPARE_SCRIPTS)
def test_every_script_writes_every_setting_it_reads_with_its_default(path):
    """ As nanoGPT's train.py: each name and its default on one line of the script's groups (the
    type, range and help of a shared one may be nanogpt_plus/settings.py's), no group shared whole
    and no default given apart. """
    script = runpy.run_path(path, run_name='not_main')
    with open(path, encoding='utf-8') as f:
        tree = ast.parse(f.read())
    written = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, 'id', None) == 'Group':
            # name=Setting(default, ...) / name=settings.name(default)
            for keyword in node.keywords:
                default = keyword.value.args[0]
                assert default.lineno == keyword.value.lineno, keyword.arg  # on the name's line
                written[keyword.arg] = eval(compile(ast.Expression(default), path, 'eval'), script)
    assert written == dict(script['DEFAULTS'])


def test_no_package_module_imports_the_settings_table():
    """ settings.py is the scripts' (and imports the lists of choices from beside the code that acts
    on them): no module of the package reaches up to it. """
    found = []
    for path in glob.glob(os.path.join(REPO, 'nanogpt_plus', '**', '*.py'), recursive=True):
        tree = ast.parse(open(path, encoding='utf-8').read())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            module = getattr(node, 'module', None)
            if module == 'nanogpt_plus.settings' or 'nanogpt_plus.settings' in names or \
                    (module == 'nanogpt_plus' and 'settings' in names):
                found.append(os.path.relpath(path, REPO))
    assert not found, found


def test_the_hellaswag_default_is_the_evaluations_file():
    # written out in train.py (the laptop path loads no evaluation code), the same path eval.py downloads to
    from nanogpt_plus.evaluation import HELLASWAG_FILE
    assert train.DEFAULTS['hellaswag_file'] == HELLASWAG_FILE
