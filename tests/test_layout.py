"""
The shape of the code (a topic across rooms): the package has no import cycle (function-level imports included) and no
chain of imports more than 11 modules deep, errors.py is a leaf, no entry point imports another, a script declares its
settings at its top, checkpoint file names are written in checkpoint.py alone, few long lines, the laptop command
imports only the modules it uses, tests share helpers through tests/helpers.py, not conftest, and every test file is
named for a module, a script or one of a few topics.
"""
import ast
import glob
import os

import pytest

from helpers import REPO, run_python

ENTRY_POINTS = ['train', 'sample', 'bench', 'eval', 'finetune', 'export_hf', 'export_gguf']


TOP_LEVEL = ['model', 'configurator']  # the front-door modules the package imports


def our_modules():
    """ {module name: path} of the package and the top-level modules it imports. """
    modules = {name: os.path.join(REPO, f"{name}.py") for name in TOP_LEVEL}
    for path in glob.glob(os.path.join(REPO, 'nanogpt_plus', '**', '*.py'), recursive=True):
        rel = os.path.relpath(path, REPO)[:-len('.py')].replace(os.sep, '.')
        modules[rel[:-len('.__init__')] if rel.endswith('.__init__') else rel] = path
    return modules


def imports_of(path, known):
    """ The modules of `known` that the file imports anywhere in it (inside functions too). """
    found = set()
    for node in ast.walk(ast.parse(open(path, encoding='utf-8').read())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            # `from nanogpt_plus import machine` imports nanogpt_plus.machine
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        found |= {n for n in names if n in known}
    return found


def test_no_import_cycle_anywhere_in_the_package():
    modules = our_modules()
    graph = {m: imports_of(p, modules) - {m} for m, p in modules.items()}
    # a cycle through the package's __init__ (which imports nothing) can't happen: the parent of every module
    state = {}

    def visit(m, stack):
        state[m] = 'open'
        for n in sorted(graph[m]):
            if state.get(n) == 'open':
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(n):] + [n]))
            if n not in state:
                visit(n, stack + [n])
        state[m] = 'done'
    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def script_files():
    """ The scripts: the entry points, the prepare scripts and scripts/*.py (nothing imports them). """
    return ([os.path.join(REPO, f"{name}.py") for name in ENTRY_POINTS]
            + sorted(glob.glob(os.path.join(REPO, 'data', '*', 'prepare.py')))
            + sorted(glob.glob(os.path.join(REPO, 'scripts', '*.py'))))


def longest_chain(module, graph, memo):
    """ The longest chain of our imports from module down to a module that imports nothing of ours. """
    if module not in memo:
        memo[module] = [module] + max((longest_chain(m, graph, memo) for m in sorted(graph[module])), key=len,
                                      default=[])
    return memo[module]


# the house's height: nanochat's package stands 5 modules deep; ours was 15 before its rooms were set by topic
MAX_IMPORT_DEPTH = 11


def test_no_chain_of_imports_is_more_than_11_modules_deep():
    """ From any script down to a module that imports nothing of ours (function-level imports included). """
    modules = our_modules()
    graph = {m: imports_of(p, modules) - {m} for m, p in modules.items()}
    memo = {}
    for path in script_files():
        below = [longest_chain(m, graph, memo) for m in sorted(imports_of(path, modules))]
        chain = [os.path.relpath(path, REPO)] + max(below, key=len, default=[])
        assert len(chain) <= MAX_IMPORT_DEPTH, " -> ".join(chain)


def test_checkpoint_file_names_are_written_only_in_checkpoint_py():
    """
    ckpt.pt, ckpt_best.pt, ckpt_last.pt, the ckpt_<iter>.pt snapshots and their sidecars are named in
    nanogpt_plus/checkpoint.py alone: no other code (scripts/ included) builds one from a string. Help texts,
    docstrings and messages may still say them.
    """
    import re
    name = re.compile(r'^ckpt[\w*{}-]*\.(pt|json)$')
    found = []
    for path in python_files():
        rel = os.path.relpath(path, REPO)
        if rel == os.path.join('nanogpt_plus', 'checkpoint.py') or rel.startswith('tests' + os.sep):
            continue
        tree = ast.parse(open(path, encoding='utf-8').read())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings \
                    and name.match(node.value):
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
            # an f-string that builds one: f'ckpt_{i}.pt'
            if isinstance(node, ast.JoinedStr) and isinstance(node.values[0], ast.Constant) \
                    and str(node.values[0].value).startswith('ckpt') \
                    and str(getattr(node.values[-1], 'value', '')).endswith(('.pt', '.json')):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    for path in glob.glob(os.path.join(REPO, 'scripts', '*.sh')):
        for number, line in enumerate(open(path, encoding='utf-8'), 1):
            if re.search(r'ckpt[\w*-]*\.pt', line) and not line.lstrip().startswith('#'):
                found.append(f"{os.path.relpath(path, REPO)}:{number}: {line.strip()}")
    assert not found, found


def test_errors_is_a_leaf():
    modules = our_modules()
    assert imports_of(modules['nanogpt_plus.errors'], modules) == set()


# the files a nanoGPT reader reads first, and the package: lines a person reads, not a count to meet
READ_FIRST = ['model.py', 'train.py', 'sample.py', 'configurator.py']


def package_files():
    return sorted(glob.glob(os.path.join(REPO, 'nanogpt_plus', '**', '*.py'), recursive=True))


def long_lines(paths, width=100):
    """ (lines over width characters, all lines) of the files together. """
    long = total = 0
    for path in paths:
        with open(path, encoding='utf-8') as f:
            lines = f.read().splitlines()
        long += sum(len(line) > width for line in lines)
        total += len(lines)
    return long, total


@pytest.mark.parametrize("name", READ_FIRST + ['nanogpt_plus'])
def test_at_most_5_percent_of_lines_run_past_100_characters(name):
    paths = package_files() if name == 'nanogpt_plus' else [os.path.join(REPO, name)]
    long, total = long_lines(paths)
    assert long <= 0.05 * total, f"{name}: {long} of {total} lines are over 100 characters"


def settings_declarations(source):
    """ The line numbers of a script's NAME = Group(...) / Schema(...) statements: its settings. """
    lines = set()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and \
                getattr(node.value.func, 'id', None) in ('Group', 'Schema'):
            lines |= set(range(node.lineno, node.end_lineno + 1))
    return lines


@pytest.mark.parametrize("script, own", [
    ('train', dict(batch_size='12', block_size='1024', learning_rate='6e-4', max_iters='600000',
                   eval_interval='2000', warmup_iters='2000', min_lr='6e-5',
                   dataset="'openwebtext'")),
    ('finetune', dict(batch_size='32', epochs='3', weight_decay='0.01', out_dir="'out-finetune'")),
    ('sample', dict(num_samples='10', max_new_tokens='500', temperature='0.8',
                    init_from="'resume'")),
    ('eval', dict(task="'loss'", batch_size='16', init_from="'resume'")),
    ('bench', dict(batch_size='12', learning_rate='1e-4', steps='20', burnin='10')),
    ('export_hf', dict(hf_dir="''", init_from="'resume'")),
    ('export_gguf', dict(gguf_file="''", gguf_type="'f32'", init_from="'resume'")),
])
def test_a_script_declares_its_settings_at_its_top(script, own):
    """ A reader finds a script's settings with their defaults in the script, one per line, as in
    nanoGPT's train.py: `batch_size=settings.batch_size(12),`, `epochs=positive(3, "..."),`. """
    with open(os.path.join(REPO, f"{script}.py"), encoding='utf-8') as f:
        source = f.read()
    lines = source.splitlines()
    declared = [lines[i - 1].lstrip() for i in sorted(settings_declarations(source))]
    for name, default in own.items():
        at = [line for line in declared if line.startswith(f"{name}=")]
        assert len(at) == 1 and f"({default}" in at[0], (name, at)


def test_no_entry_point_imports_another():
    for name in ENTRY_POINTS:
        imported = imports_of(os.path.join(REPO, f"{name}.py"), set(ENTRY_POINTS) - {name})
        assert not imported, (name, imported)


def test_tests_share_helpers_not_conftest():
    for path in glob.glob(os.path.join(REPO, 'tests', '*.py')):
        tree = ast.parse(open(path, encoding='utf-8').read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == 'conftest' or \
                    isinstance(node, ast.Import) and any(a.name == 'conftest' for a in node.names):
                pytest.fail(f"{os.path.basename(path)} imports conftest; import tests/helpers.py instead")


def python_files():
    """ Every tracked-or-not .py file of the project (the virtual environment and caches left out). """
    skip = {'.venv', '.git', '__pycache__', 'build'}
    for folder, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in skip and not d.endswith('.egg-info')]
        yield from (os.path.join(folder, f) for f in files if f.endswith('.py'))


def test_no_long_line_ends_in_a_comment():
    """ A line past 100 characters because of its trailing comment has the comment on the line above instead. """
    import io
    import tokenize
    found = []
    for path in python_files():
        with open(path, encoding='utf-8') as f:
            source = f.read()
        lines = source.split('\n')
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            row, col = token.start
            if token.type == tokenize.COMMENT and lines[row - 1][:col].strip() and len(lines[row - 1]) > 100 \
                    and 'noqa' not in token.string:
                found.append(f"{os.path.relpath(path, REPO)}:{row}")
    assert not found, found


# the package modules nanoGPT's laptop command runs on (docs/layout.md shows them in bold): nothing it does not use
# (no tokenizer: each split's bytes per token, for the bits per byte, are the ones its prepare.py recorded)
DEFAULT_PATH = {'errors', 'settings', 'runtime', 'signals', 'distributed', 'machine', 'files',
                'dataset', 'dataloader', 'checkpoint', 'init_from', 'outputs', 'optimizer', 'metrics',
                'progress', 'reference'}


@pytest.fixture(scope='module')
def prepared_char_dataset(tmp_path_factory):
    """ A character dataset as data/shakespeare_char/prepare.py makes one (its meta.json records each split's
    bytes). """
    from nanogpt_plus.prepare.shakespeare import prepare_char
    directory = str(tmp_path_factory.mktemp('laptop_char'))
    prepare_char("First Citizen:\nBefore we proceed any further, hear me speak.\n\n" * 100, directory)
    return directory


def test_the_map_in_docs_bolds_the_modules_the_laptop_command_imports():
    """ docs/layout.md's package table shows the laptop path's modules in bold: the same set as DEFAULT_PATH. """
    import re
    with open(os.path.join(REPO, 'docs', 'layout.md'), encoding='utf-8') as f:
        bold = {name.split('.')[0].rstrip('/') for name in re.findall(r'^\| \*\*`([\w/.]+)`\*\*', f.read(), re.M)}
    assert bold == DEFAULT_PATH, (sorted(bold - DEFAULT_PATH), sorted(DEFAULT_PATH - bold))


def test_the_laptop_command_imports_only_the_modules_it_uses(prepared_char_dataset, tmp_path):
    """ `python train.py config/train_shakespeare_char.py` on the CPU, a save included: these modules and no others. """
    code = ("import sys; import train; from nanogpt_plus.runtime import run_main\n"
            "sys.argv = ['train.py', *sys.argv[1:]]; run_main(train.main)\n"
            "print('modules:', ' '.join(sorted(m[13:] for m in sys.modules if m.startswith('nanogpt_plus.'))))")
    args = ['config/train_shakespeare_char.py', f'--dataset={prepared_char_dataset}', f'--out_dir={tmp_path}',
            '--device=cpu', '--compile=False', '--max_iters=2', '--eval_interval=2', '--eval_iters=1', '--n_layer=1',
            '--n_head=2', '--n_embd=16', '--block_size=16', '--batch_size=2', '--num_threads=0']
    r = run_python(['-c', code, *args], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "saving checkpoint to" in r.stdout
    loaded = set(r.stdout.split('modules:')[1].split())
    assert loaded == DEFAULT_PATH, (sorted(loaded - DEFAULT_PATH), sorted(DEFAULT_PATH - loaded))


# -----------------------------------------------------------------------------
# test files by topic: each tests/test_<name>.py is named for the room whose code its tests exercise

# the few topics that span rooms, each with its reason
TEST_TOPICS = {
    'many_machines': "the many-node verdicts: two torchrun agents as two nodes, whichever room fails on one",
    'layout': "the code's shape: its imports, lines, settings' declarations and these names",
    'docs': "the commands and code names README.md and docs/ show",
    'gpu': "the CUDA paths of every room, run by scripts/gpu_check.sh on a GPU",
}


def rooms():
    """ The names a test file may take: the package's modules and packages (and their modules), the top-level
    modules and entry points, scripts/*, and 'prepare' for data/*/prepare.py. """
    names = {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(REPO, '*.py'))}
    for path in glob.glob(os.path.join(REPO, 'nanogpt_plus', '**', '*.py'), recursive=True):
        name = os.path.splitext(os.path.basename(path))[0]
        names.add(os.path.basename(os.path.dirname(path)) if name == '__init__' else name)
    names |= {os.path.splitext(os.path.basename(p))[0] for p in glob.glob(os.path.join(REPO, 'scripts', '*'))}
    if glob.glob(os.path.join(REPO, 'data', '*', 'prepare.py')):
        names.add('prepare')
    return names - {'nanogpt_plus'}


def test_each_test_file_is_named_for_a_module_a_script_or_a_topic():
    named = {os.path.basename(p)[len('test_'):-len('.py')] for p in glob.glob(os.path.join(REPO, 'tests', 'test_*.py'))}
    strays = named - rooms() - set(TEST_TOPICS)
    assert not strays, (f"tests/test_<name>.py named for no module, script or topic: {sorted(strays)}; name each "
                        f"for the room whose code its tests exercise (or add a topic, with its reason, to TEST_TOPICS)")
    # a topic is a file's, and not a room's name
    assert set(TEST_TOPICS) <= named and not set(TEST_TOPICS) & rooms(), TEST_TOPICS
