"""
Make a reference loss curve (config/reference/*.json, read by train.py): run `train.py <config>` once per
seed on a dataset, then write the seeds' val and train loss at every evaluation, their mean and band
(mean ± max(k·std, floor)), with the machine, torch version, command, the settings that shape the curve
and the dataset's text digest. Each seed's run goes to work_dir/seed_<n>; a finished one is reused, so an
interrupted make continues where it stopped. Runs use num_threads threads (1: comparable on any machine).

Usage:
$ python scripts/make_reference.py --config=config/train_shakespeare_char_cpu.py --seeds=5
$ python scripts/make_reference.py --config=config/train_shakespeare_char_cpu.py \
      --dataset=data/shakespeare_char --output=config/reference/shakespeare_char_cpu.tinyshakespeare.json
$ python scripts/make_reference.py --config=my_config.py --train_args="--max_iters=500"   # your own curve
"""

import os
import shlex
import sys
import time

# scripts/ is on sys.path
from benchtools import cpu_model, run_checked
from configurator import Group, Schema, Setting, configure, parse_config
from nanogpt_plus import reference
from nanogpt_plus.dataset import find_dataset
from nanogpt_plus.errors import UserError
from nanogpt_plus.metrics import read_metrics
from nanogpt_plus.outputs import recorded_preparation
from nanogpt_plus.runtime import run_main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEFAULTS = Schema(Group(
    'reference',
    config=Setting('config/train_shakespeare_char_cpu.py', "the train.py config file whose curve is measured",
                   not_empty=True),
    dataset=Setting('', "the dataset to train on (a name under data/ or a directory); '' = the config's"),
    seeds=Setting(5, "how many seeds (runs) the band is made of", low=2),
    first_seed=Setting(1, "the seeds are first_seed, first_seed + 1, ...", low=0),
    train_args=Setting('', "more train.py options for every run, e.g. '--max_iters=500'"),
    num_threads=Setting(1, "torch threads of each run", low=1),
    work_dir=Setting('out-reference', "where each seed's run goes (work_dir/seed_<n>)", not_empty=True),
    output=Setting('', "the reference file to write ('' = config/reference/<config's name>.<text digest>.json)"),
    data_name=Setting('', "words for the data in the file, e.g. 'tiny Shakespeare' ('' = the dataset's path)"),
))


def run_settings(config, dataset, train_args):
    """ train.py's settings for a run of config on dataset (the files' and options' values over its defaults). """
    sys.path.insert(0, REPO)
    import train  # its DEFAULTS: the settings and defaults every run reads
    argv = [config, *shlex.split(train_args)] + ([f'--dataset={dataset}'] if dataset else [])
    return dict(parse_config(train.DEFAULTS, argv)), argv


def train_seed(argv, seed, out_dir, num_threads):
    """ One seed's train.py run into out_dir (skipped when a finished one is there); its eval records. """
    done = os.path.join(out_dir, 'finished')
    if not os.path.exists(done):
        cmd = [sys.executable, 'train.py', *argv, f'--seed={seed}', f'--out_dir={out_dir}',
               f'--num_threads={num_threads}', '--overwrite=True', '--wandb_log=False']
        env = dict(os.environ, OMP_NUM_THREADS=str(num_threads))
        started = time.time()
        log = run_checked(cmd, f"train.py with seed {seed}", cwd=REPO, env=env)
        with open(os.path.join(out_dir, 'train.log'), 'w') as f:
            f.write(log)
        with open(done, 'w') as f:
            f.write(f"{time.time() - started:.0f} seconds\n")
        print(f"seed {seed}: done in {time.time() - started:.0f}s")
    return [r for r in read_metrics(os.path.join(out_dir, 'metrics.jsonl')) if r.get('type') == 'eval']


def header(config, cfg, argv, data, cmd_line, num_threads, data_name):
    """ What the reference file says of how it was made. """
    import torch
    key = reference.data_key(data.directory)
    if key is None:
        raise UserError(f"{data.directory}/meta.json records no text digest; prepare the dataset again with "
                        f"data/*/prepare.py (it records one) before making a reference on it")
    characters = recorded_preparation(data.directory)['corpus'].get('characters')
    return {
        'config': config,
        'command': cmd_line,
        'train_command': 'python train.py ' + ' '.join(shlex.quote(a) for a in argv) +
                         f' --seed=<seed> --num_threads={num_threads}',
        'machine': {'cpu': cpu_model(), 'threads': num_threads},
        'torch': torch.__version__,
        'data': dict(key, name=data_name or str(cfg['dataset']), characters=characters),
        'settings': reference.curve_settings(cfg),
        'evaluation': {'eval_interval': cfg['eval_interval'], 'eval_iters': cfg['eval_iters'],
                       'max_iters': cfg['max_iters']},
    }


def main():
    config = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(config)
    cfg, argv = run_settings(config.config, config.dataset, config.train_args)
    data = find_dataset(cfg['dataset'])
    made_by = 'python scripts/make_reference.py ' + ' '.join(shlex.quote(a) for a in sys.argv[1:])
    head = header(config.config, cfg, argv, data, made_by, config.num_threads, config.data_name)
    seeds = range(config.first_seed, config.first_seed + config.seeds)
    runs = {seed: train_seed(argv, seed, os.path.join(config.work_dir, f'seed_{seed}'), config.num_threads)
            for seed in seeds}
    ref = reference.build_reference(runs, head)
    output = config.output or os.path.join(
        reference.REFERENCE_DIR,
        f"{os.path.splitext(os.path.basename(config.config))[0]}.{head['data']['text_sha256'][:8]}.json")
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, 'w', encoding='utf-8') as f:
        f.write(reference.dumps(ref))
    print(f"wrote {output}: {len(ref['points'])} evaluations, {len(seeds)} seeds")


if __name__ == "__main__":
    run_main(main)
