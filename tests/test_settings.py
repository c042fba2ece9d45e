"""
The settings (nanogpt_plus/settings.py and each script's declarations): each entry point, dataset script and
scripts/*.py declares its settings at its top with their defaults, types and help; --help lists them; every value is
checked before any work (ranges, finite numbers, the schedule, auto_resume against overwrite), and a value of the
wrong type, None included, is one line and exit code 2.
"""
import ast
import glob
import json
import os
import runpy
import sys

import pytest

import bench
import eval as eval_script
import export_gguf
import export_hf
import finetune
import sample
import train
from configurator import ConfigError, Group, Schema, Setting, Settings, parse_config
from helpers import REPO, assert_one_line_error, run, run_python, run_train, train_args
from nanogpt_plus import settings
from nanogpt_plus.errors import UserError
from nanogpt_plus.prepare.shakespeare import TINY_SHAKESPEARE_URL
from nanogpt_plus.runtime import run_main
from nanogpt_plus.settings import default_num_proc

SCRIPTS = {'train': train, 'finetune': finetune, 'sample': sample, 'eval': eval_script, 'bench': bench,
           'export_hf': export_hf, 'export_gguf': export_gguf}


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


@pytest.mark.parametrize("name", ['train', 'finetune', 'sample', 'eval', 'export_hf', 'export_gguf'])
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


def train_settings(*args):
    """ train.py's settings for these --key=value arguments, as main() sees them. """
    return parse_config(train.DEFAULTS, list(args))


BAD_TRAIN_SETTINGS = [
    ("--batch_size=0", "batch_size must be >= 1, got 0"),
    ("--block_size=0", "block_size must be >= 1"),
    ("--gradient_accumulation_steps=0", "gradient_accumulation_steps must be >= 1"),
    ("--max_iters=-1", "max_iters must be >= 0"),
    ("--eval_interval=0", "eval_interval must be >= 1"),
    ("--log_interval=0", "log_interval must be >= 1"),
    ("--eval_iters=0", "eval_iters must be >= 1"),
    ("--learning_rate=0", "learning_rate must be > 0.0"),
    ("--min_lr=-1e-5", "min_lr must be >= 0"),
    ("--warmup_iters=-1", "warmup_iters must be >= 0"),
    ("--lr_decay_iters=-5", "lr_decay_iters must be >= 0"),
    ("--dropout=1.0", "dropout must be >= 0.0 and < 1.0, got 1.0"),
    ("--dropout=-0.1", "dropout must be >= 0.0 and < 1.0"),
    ("--grad_clip=-1", "grad_clip must be >= 0.0, got -1.0"),
    ("--weight_decay=-0.1", "weight_decay must be >= 0"),
    ("--beta1=1.0", "beta1 must be >= 0.0 and < 1.0"),
    ("--beta2=-0.5", "beta2 must be >= 0.0 and < 1.0"),
    ("--n_layer=0", "n_layer must be >= 1"),
    ("--n_head=0", "n_head must be >= 1"),
    ("--n_embd=100", r"n_embd \(100\) must be divisible by n_head \(12\)"),
    ("--gelu=relu", "gelu must be 'none' or 'tanh', got 'relu'"),
    ("--attention=fast", "attention must be 'flash' or 'manual'"),
    ("--dtype=fp8", "dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got 'fp8'"),
    ("--backend=mpi", "backend must be"),
    ("--compile=yes", "compile must be None, True or False, got 'yes'"),
    ("--parallelism=zero3", "parallelism must be 'ddp' or 'fsdp'"),
    ("--num_threads=-1", "num_threads must be >= 0"),
    ("--seed=-3", "seed must be >= 0"),
    ("--out_dir=", "out_dir must not be empty"),
]


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize("arg, message", BAD_TRAIN_SETTINGS, ids=[a for a, _ in BAD_TRAIN_SETTINGS])
def test_bad_train_setting_is_one_line(arg, message):
    with pytest.raises(UserError, match=message):
        train.check_settings(train_settings(arg))


@pytest.mark.usefixtures('one_thread')
def test_bad_setting_exits_2_before_any_work(tmp_path, capsys):
    out_dir = tmp_path / "never"
    with pytest.raises(SystemExit) as e:
        run_main(lambda: train.main(["--batch_size=0", f"--out_dir={out_dir}", "--device=cpu"]))
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: batch_size must be >= 1, got 0; change --batch_size (or the config file that sets it)"]
    assert not out_dir.exists()  # nothing was made


@pytest.mark.usefixtures('one_thread')
def test_defaults_pass_and_settings_know_what_was_given(tmp_path):
    config_file = tmp_path / "c.py"
    config_file.write_text("n_layer = 12  # the default's value, but chosen\n")
    cfg = train_settings(str(config_file), "--batch_size=4", f"--out_dir={tmp_path}")
    train.check_settings(cfg)  # nanoGPT's defaults are all valid
    assert isinstance(cfg, Settings) and cfg.given == {"n_layer", "batch_size", "out_dir"}
    # what checkpoints save: a plain dict
    assert type(dict(cfg)) is dict and dict(cfg)["batch_size"] == 4


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize("check, settings, message", [
    (sample.check_settings, dict(sample.DEFAULTS, num_samples=0), "num_samples must be >= 1"),
    (sample.check_settings, dict(sample.DEFAULTS, top_k=0), "top_k must be >= 1"),
    (sample.check_settings, dict(sample.DEFAULTS, max_new_tokens=-1), "max_new_tokens must be >= 0"),
    (eval_script.check_settings, dict(eval_script.DEFAULTS, batch_size=0), "batch_size must be >= 1"),
    (eval_script.check_settings, dict(eval_script.DEFAULTS, stride=-2), "stride must be >= 0"),
    (finetune.check_settings, dict(finetune.DEFAULTS, warmup_frac=1.5), r"warmup_frac must be >= 0.0 and <= 1.0"),
    (finetune.check_settings, dict(finetune.DEFAULTS, epochs=0), "epochs must be >= 1"),
    (finetune.check_settings, dict(finetune.DEFAULTS, n_head=5), r"n_embd \(768\) must be divisible by n_head"),
    (bench.check_settings, dict(bench.DEFAULTS, dropout=1.5), "dropout must be"),
    (bench.check_settings, dict(bench.DEFAULTS, steps=0), "steps must be >= 1"),
])
def test_other_scripts_check_their_settings(check, settings, message):
    with pytest.raises(UserError, match=message):
        check(Settings(settings))  # as read_settings hands them: read as attributes


@pytest.mark.usefixtures('one_thread')
def test_min_lr_above_learning_rate_is_refused():
    with pytest.raises(UserError, match=r"min_lr \(0.01\) is above learning_rate \(0.001\)"):
        train.check_settings(parse_config(train.DEFAULTS, ["--learning_rate=1e-3", "--min_lr=1e-2"]))
    train.check_settings(parse_config(train.DEFAULTS, ["--learning_rate=1e-3", "--min_lr=1e-2", "--decay_lr=False"]))


# -----------------------------------------------------------------------------
# the schedule

@pytest.mark.usefixtures('one_thread')
def test_a_decay_that_ends_where_the_warmup_does_is_refused():
    for decay in (100, 50):
        with pytest.raises(UserError, match=rf"lr_decay_iters \({decay}\) is not past warmup_iters \(100\), so the "
                                            r"rate would drop from learning_rate to min_lr right after the warmup"):
            train.check_settings(parse_config(train.DEFAULTS, ["--warmup_iters=100", f"--lr_decay_iters={decay}"]))
    # a constant rate asks for no decay at all
    train.check_settings(parse_config(train.DEFAULTS, ["--warmup_iters=100", "--lr_decay_iters=50",
                                                       "--decay_lr=False"]))


@pytest.mark.usefixtures('one_thread')
def test_a_warmup_longer_than_the_run_is_said_with_the_rate_it_reaches(dataset, tmp_path, capsys):
    captured = run_train(capsys, train_args(dataset, tmp_path, max_iters=3, warmup_iters=9, lr_decay_iters=20,
                                            learning_rate=1e-2, num_threads=1))
    note = [line for line in captured.out.splitlines() if line.startswith('note: warmup_iters')]
    assert note == ["note: warmup_iters (9) is past max_iters (3): the learning rate rises to 0.004 at the last "
                    "iteration and never reaches learning_rate (0.01)"]
    lrs = [r['lr'] for r in map(json.loads, open(tmp_path / 'metrics.jsonl')) if r['type'] == 'iter']
    assert lrs[-1] == pytest.approx(0.004)  # what the line said, iteration 3's rate


@pytest.mark.usefixtures('one_thread')
def test_auto_resume_with_overwrite_is_refused_in_train_and_finetune():
    message = (
        r"auto_resume=True continues the run in out_dir and overwrite=True starts it over; give one"
    )
    with pytest.raises(UserError, match=message):
        train.check_settings(
            parse_config(train.DEFAULTS, ["--auto_resume=True", "--overwrite=True"])
        )
    with pytest.raises(UserError, match=message):
        finetune.check_settings(
            parse_config(finetune.DEFAULTS, ["--auto_resume=True", "--overwrite=True"])
        )


# -----------------------------------------------------------------------------
# non-finite float settings, from a config file or the command line, in every script

NAN_SETTINGS = (
    'skip_loss_z',
    'skip_grad_z',
    'min_lr',
    'weight_decay',
    'grad_clip',
    'learning_rate',
    'beta2',
    'dropout',
    'muon_lr',
    'muon_momentum',
    'cooldown_frac',
    'logit_softcap',
)


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize('key', NAN_SETTINGS)
def test_a_nan_from_a_config_file_is_refused_naming_the_setting(tmp_path, key):
    config = tmp_path / 'nan.py'
    config.write_text(f"{key} = float('nan')\n")
    with pytest.raises(
        UserError,
        match=rf"^{key} must be a finite number, got nan; change --{key} \(or the "
        rf"config file that sets it\)$",
    ):
        train.check_settings(parse_config(train.DEFAULTS, [str(config)]))


@pytest.mark.usefixtures('one_thread')
def test_an_inf_is_refused_too_from_the_command_line_and_in_other_scripts(tmp_path):
    with pytest.raises(UserError, match=r"^grad_clip must be a finite number, got inf"):
        train.check_settings(parse_config(train.DEFAULTS, ["--grad_clip=1e999"]))
    with pytest.raises(UserError, match=r"^min_lr must be a finite number, got -inf"):
        finetune.check_settings(parse_config(finetune.DEFAULTS, ["--min_lr=-1e999"]))
    config = tmp_path / 'hot.py'
    config.write_text("temperature = float('nan')\n")
    with pytest.raises(UserError, match=r"^temperature must be a finite number, got nan"):
        sample.DEFAULTS.check(parse_config(sample.DEFAULTS, [str(config)]))
    # finite values still pass
    train.check_settings(parse_config(train.DEFAULTS, ["--grad_clip=0.5", "--device=cpu"]))


@pytest.mark.usefixtures('one_thread')
def test_a_nan_setting_ends_train_py_and_sample_py_in_one_line(tiny_dataset, tmp_path):
    config = tmp_path / 'nan.py'
    config.write_text("learning_rate = float('nan')\n")
    r = run_python(
        ['train.py', *train_args(tiny_dataset, tmp_path / 'out'), str(config)], timeout=120
    )
    assert r.returncode == 2 and r.stderr.strip().count('\n') == 0, r.stderr[-2000:]
    assert r.stderr.startswith("error: learning_rate must be a finite number, got nan")
    config.write_text("temperature = float('nan')\n")
    r = run_python(['sample.py', str(config), '--init_from=gpt2', '--device=cpu'], timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count('\n') == 0, r.stderr[-2000:]
    assert r.stderr.startswith("error: temperature must be a finite number, got nan")
    assert not (tmp_path / 'out').exists()


@pytest.mark.usefixtures('one_thread')
def test_a_dist_timeout_past_a_week_is_refused():
    for value in (10**12, 2**31, 604801):
        with pytest.raises(
            UserError, match=rf"^dist_timeout must be >= 0 and <= 604800, got {value}"
        ):
            train.check_settings(parse_config(train.DEFAULTS, [f"--dist_timeout={value}"]))
    train.check_settings(parse_config(train.DEFAULTS, ["--dist_timeout=604800", "--device=cpu"]))


DATA = {name: os.path.join(REPO, "data", name) for name in
        ("text", "fineweb", "openwebtext", "shakespeare", "shakespeare_char")}


# every dataset script's settings with the defaults they had as plain dicts (names and defaults are the interface)
DATA_SETTINGS = {
    "text": dict(input='', dataset='', name='', text_column='text', sample_by='document', tokenizer='bpe',
                 vocab_size=8192, val_fraction=0.1, seed=2357, num_proc=default_num_proc(), out_dir=DATA["text"],
                 cache_dir='', overwrite=False),
    "fineweb": dict(dataset='HuggingFaceFW/fineweb-edu', name='sample-10BT', files='', text_column='text',
                    streaming=False, num_proc=default_num_proc(), shard_size=10 ** 8, max_tokens=0,
                    prefix='edufineweb', tokenizer='gpt2', out_dir=DATA["fineweb"], overwrite=False),
    "openwebtext": dict(dataset='openwebtext', name='', files='', text_column='text', sample_by='paragraph',
                        num_proc=default_num_proc(), test_size=0.0005, seed=2357, total_batches=1024,
                        out_dir=DATA["openwebtext"], cache_dir='', overwrite=False),
    "shakespeare": dict(input='', out_dir=DATA["shakespeare"], url=TINY_SHAKESPEARE_URL, timeout=10.0,
                        overwrite=False),
    "shakespeare_char": dict(input='', out_dir=DATA["shakespeare_char"], url=TINY_SHAKESPEARE_URL, timeout=10.0,
                             overwrite=False),
}


# one value of the wrong type per script, and the words of its one-line error
WRONG_TYPE = {
    "data/text/prepare.py": ("--vocab_size=big", "--vocab_size: vocab_size expects int, got str ('big')"),
    "data/fineweb/prepare.py": ("--streaming=yes", "--streaming: streaming expects bool, got str ('yes')"),
    "data/openwebtext/prepare.py": ("--num_proc=2.5", "--num_proc: num_proc expects int, got float (2.5)"),
    "data/shakespeare/prepare.py": ("--timeout=soon", "--timeout: timeout expects float, got str ('soon')"),
    "data/shakespeare_char/prepare.py": ("--overwrite=yes", "--overwrite: overwrite expects bool, got str ('yes')"),
    "scripts/plot_metrics.py": ("{tmp}/config.py", "config.py: out_dir expects str, got int (3)"),
    "scripts/bench_fineweb_prepare.py": ("--size_mb=big", "size_mb expects int, got str ('big')"),
    "scripts/bench_loader.py": ("--batch_size=1.5", "batch_size expects int, got float (1.5)"),
    "scripts/bench_prepare.py": ("--seed=x", "seed expects int, got str ('x')"),
    "scripts/bench_sample.py": ("--threads=two", "threads expects int, got str ('two')"),
    "scripts/bench_tokenizer.py": ("--max_iters=many", "max_iters expects int, got str ('many')"),
    "scripts/bench_train_cpu.py": ("--rounds=None", "rounds expects int, got None"),
    "scripts/bench_weights.py": ("--repeats=3.5", "repeats expects int, got float (3.5)"),
    "scripts/finetune_demo.py": ("--pretrain_iters=lots", "pretrain_iters expects int, got str ('lots')"),
}


SCRIPT_FILES = list(WRONG_TYPE)


def schema_of(script):
    """ The script's DEFAULTS, read without running its main(). """
    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        return runpy.run_path(os.path.join(REPO, script), run_name="settings_probe")["DEFAULTS"]
    finally:
        sys.path.remove(os.path.join(REPO, "scripts"))


# -----------------------------------------------------------------------------
# Task 1: settings declared once, with help

@pytest.mark.parametrize("script", SCRIPT_FILES)
def test_every_setting_is_declared_with_a_one_line_help_and_a_valid_default(script):
    schema = schema_of(script)
    assert isinstance(schema, Schema)
    for key, spec in schema.specs.items():
        assert spec.help.strip() and "\n" not in spec.help, key
        assert spec.problem(key, spec.default) is None, key


@pytest.mark.parametrize("name", DATA_SETTINGS)
def test_dataset_scripts_keep_their_settings_and_defaults(name):
    # the names and defaults of the plain dicts these schemas replaced, plus overwrite
    assert dict(schema_of(f"data/{name}/prepare.py")) == DATA_SETTINGS[name]


@pytest.mark.parametrize("script", SCRIPT_FILES)
def test_help_lists_every_setting_with_its_default_and_help(script, monkeypatch, capsys):
    code, out, _ = run(script, monkeypatch, capsys, "--help")
    assert code == 0
    lines = out.split("\nsettings (config files")[1].splitlines()  # the list after the script's doc
    for key, spec in schema_of(script).specs.items():
        at = next((i for i, line in enumerate(lines) if line.strip().startswith(f"--{key} ")), None)
        assert at is not None, key
        assert lines[at].endswith(f"= {spec.default!r}") and lines[at + 1].strip() == spec.help, lines[at:at + 2]


@pytest.mark.parametrize("script", SCRIPT_FILES)
def test_a_value_of_the_wrong_type_is_one_line_and_exit_code_2(script, tmp_path, monkeypatch, capsys):
    (tmp_path / "config.py").write_text("out_dir = 3\n")
    arg, message = WRONG_TYPE[script]
    code, _, err = run(script, monkeypatch, capsys, arg.format(tmp=tmp_path))
    assert_one_line_error(code, err, message)


# a value of the right type that the script can't use: refused by the schema, before anything is read or written
OUT_OF_RANGE = [
    ("text", "--vocab_size=256", "vocab_size must be >= 257, got 256"),
    ("text", "--val_fraction=1.5", "val_fraction must be > 0.0 and < 1.0, got 1.5"),
    ("text", "--val_fraction=0", "val_fraction must be > 0.0 and < 1.0, got 0.0"),
    ("text", "--sample_by=sentence", "sample_by must be 'line', 'paragraph' or 'document', got 'sentence'"),
    ("text", "--num_proc=0", "num_proc must be >= 1, got 0"),
    ("openwebtext", "--test_size=1", "test_size must be > 0.0 and < 1.0, got 1.0"),
    ("openwebtext", "--sample_by=lines", "sample_by must be 'line', 'paragraph' or 'document', got 'lines'"),
    ("fineweb", "--shard_size=0", "shard_size must be >= 1 and <= 2147483647, got 0"),
    ("fineweb", "--shard_size=2147483648", "shard_size must be >= 1 and <= 2147483647, got 2147483648"),
    ("fineweb", "--max_tokens=-1", "max_tokens must be >= 0, got -1"),
    ("fineweb", "--num_proc=-2", "num_proc must be >= 1, got -2"),
    ("shakespeare", "--timeout=0", "timeout must be > 0, got 0.0"),
    ("shakespeare_char", "--timeout=-1", "timeout must be > 0, got -1.0"),
]


@pytest.mark.parametrize("name, arg, message", OUT_OF_RANGE)
def test_a_value_out_of_range_is_one_line_before_any_work(name, arg, message, tmp_path, monkeypatch, capsys):
    out = tmp_path / "out"
    code, _, err = run(f"data/{name}/prepare.py", monkeypatch, capsys, arg, f"--out_dir={out}",
                       f"--input={tmp_path / 'missing.txt'}" if name in ("text", "shakespeare", "shakespeare_char")
                       else f"--files={tmp_path / 'missing.jsonl'}")
    assert_one_line_error(code, err, message)
    assert not out.exists()


def test_the_real_command_lines(tmp_path):
    # the two paths in a fresh interpreter: --help prints the manual, exit 0; a bad choice is one line, exit 2
    r = run_python(["data/fineweb/prepare.py", "--help"], timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("FineWeb-Edu for GPT-2"), r.stderr
    assert "  --overwrite   = False\n      True: write even where out_dir holds another dataset" in r.stdout
    r = run_python(["scripts/bench_sample.py", "--which=all"], timeout=120)
    assert r.returncode == 2 and r.stderr == "error: which must be 'both', 'gpt2' or 'char', got 'all'\n", r.stderr


@pytest.mark.parametrize("script", ["train.py", "sample.py", "eval.py", "bench.py", "finetune.py"])
def test_a_thread_count_past_4_per_cpu_is_refused_in_one_line(script, tmp_path, monkeypatch, capsys):
    """ --num_threads=100000 crashed torch's thread pool (SIGSEGV) and left run.lock: refused with the
    settings, before anything is made. """
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    (out_dir / "mine.txt").write_text("kept")
    where = f"--profile_dir={out_dir}" if script == "bench.py" else f"--out_dir={out_dir}"
    code, out, err = run(script, monkeypatch, capsys, where, "--device=cpu", "--num_threads=100000")
    assert_one_line_error(code, err, f"num_threads must be >= 0 and <= {settings.MAX_THREADS}, got 100000")
    assert settings.MAX_THREADS == 4 * (os.cpu_count() or 1)
    assert os.listdir(out_dir) == ["mine.txt"]
