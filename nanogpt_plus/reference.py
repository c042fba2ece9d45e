"""
Reference loss curves: what a correct run of a config should print at each evaluation, measured here
over several seeds (config/reference/*.json, made by scripts/make_reference.py), and train.py's line
after each evaluation saying whether the run is within the seeds' band.

A curve belongs to the settings that shape it (curve_settings: the data, the model, the batch, the
schedule, the optimizer; not the seed, the device or the number of threads, not max_iters: a run that
stops earlier with the same schedule follows the same curve) and is keyed by the dataset's recorded
preparation, the SHA-256 of its text: the real tiny Shakespeare and the offline substitute have one curve
each.

The band at an evaluation is mean ± max(k·std, floor) of the seeds' losses there (band_of). Another seed
is another draw of the initialisation, the training batches and the evaluation batches; another CPU (AVX2
or AVX-512 kernels, 1 or 2 threads) sums in another order, its float bits differ from the first step and
its trajectory drifts away like another seed's does, so a correct run anywhere is one more draw from the
seeds' spread. With 5 seeds the sample std is itself uncertain: k=4 covers a new draw with ~98%
probability (Student's t with 4 degrees of freedom, times sqrt(1 + 1/5)), and the floor keeps the band
honest where the seeds happen to agree (iteration 0, or a short evaluation's noise of a few hundredths).

Usage:
    from nanogpt_plus.reference import ReferenceCheck
    check = ReferenceCheck.for_run(cfg, data_dir)   # prints the no-match line when nothing matches
    line = check.after_eval(iter_num, val_loss)      # 'reference: within the band ...' or None
    band = check.band_at(iter_num)                   # {'val_low':..., 'val_high':..., ...} for metrics.jsonl
"""

import glob
import json
import math
import os
import re
import statistics

from nanogpt_plus.errors import UserError
from nanogpt_plus.outputs import recorded_preparation

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REFERENCE_DIR = os.path.join(PROJECT_DIR, 'config', 'reference')
FORMAT = 'nanogpt_plus reference curve 1'
# the band: mean ± max(K * std, FLOOR) of the seeds' losses (see the module's docstring)
K = 4.0
FLOOR = 0.03
# evaluations out of the band (in all, not only in a row) before the hint
HINT_AFTER = 2
HINT = ("reference: two evaluations out of the band; common causes: the learning rate (or its schedule), "
        "the global batch (batch_size x gradient_accumulation_steps x GPUs), or other data than the "
        "reference's")

# the settings that shape a curve, by what they are (the names are train.py's)
SHAPING = {
    'model': ('n_layer', 'n_head', 'n_embd', 'block_size', 'dropout', 'bias', 'gelu', 'pos', 'norm',
              'qk_norm', 'mlp_act', 'logit_softcap', 'tie_embeddings'),
    'batch': ('global_batch', 'data_order'),
    'schedule': ('learning_rate', 'min_lr', 'warmup_iters', 'lr_decay_iters', 'decay_lr', 'lr_schedule',
                 'cooldown_frac'),
    'optimizer': ('optimizer', 'weight_decay', 'beta1', 'beta2', 'grad_clip', 'muon_lr', 'muon_momentum',
                  'muon_weight_decay', 'muon_ns_steps'),
    'start': ('init',),
}


def curve_settings(cfg):
    """
    The settings of a train.py run (a mapping of its settings) that shape its loss curve: SHAPING's, with
    the global batch in sequences per iteration (batch_size x gradient_accumulation_steps, nanoGPT's
    global count, however many processes share it) and where the model starts (a resume continues a run
    from scratch).
    """
    record = {name: cfg[name] for names in SHAPING.values() for name in names
              if name not in ('global_batch', 'init')}
    record['global_batch'] = cfg['batch_size'] * cfg['gradient_accumulation_steps']
    record['init'] = 'scratch' if cfg['init_from'] in ('scratch', 'resume') else cfg['init_from']
    return record


def data_key(data_dir):
    """
    The dataset's recorded preparation that a curve is keyed by: {'text_sha256', 'tokenizer'} from the
    'preparation' of data_dir/meta.json (prepare.py records it), or None when it doesn't record its text.
    """
    preparation = recorded_preparation(data_dir) or {}
    corpus = preparation.get('corpus') or {}
    if not isinstance(corpus, dict) or not corpus.get('text_sha256'):
        return None
    return {'text_sha256': corpus['text_sha256'], 'tokenizer': preparation.get('tokenizer')}


# -----------------------------------------------------------------------------
# the band

def band_of(values, k=K, floor=FLOOR):
    """ {'mean', 'std', 'half_width'} of the seeds' losses at one evaluation: mean ± max(k·std, floor). """
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {'mean': round(mean, 4), 'std': round(std, 4), 'half_width': round(max(k * std, floor), 4)}


def build_reference(runs, header, k=K, floor=FLOOR):
    """
    A reference file's content from the seeds' runs: runs is {seed: [eval records]} (each with 'iter',
    'train_loss', 'val_loss'), header the file's description (config, command, machine, data, settings).
    Only the iterations every seed evaluated are kept.
    """
    by_seed = {seed: {r['iter']: r for r in records} for seed, records in runs.items()}
    common = sorted(set.intersection(*(set(r) for r in by_seed.values())))
    seeds = sorted(by_seed)
    points = []
    for it in common:
        point = {'iter': it}
        for split in ('val', 'train'):
            values = [by_seed[s][it][f'{split}_loss'] for s in seeds]
            point[split] = dict(band_of(values, k, floor), seeds=[round(v, 4) for v in values])
        points.append(point)
    return dict(header, format=FORMAT, kind='measured', seeds=seeds,
                band={'rule': 'mean ± max(k·std, floor) of the seeds\' losses', 'k': k, 'floor': floor},
                points=points)


# -----------------------------------------------------------------------------
# reading reference files

def load_reference(path):
    """ A measured reference file, checked; one line (UserError) when it is not one. """
    def refuse(why):
        return UserError(f"reference file {path} {why}; remake it with scripts/make_reference.py "
                         f"or pass another --reference")
    try:
        with open(path, encoding='utf-8') as f:
            ref = json.load(f)
    except OSError as e:
        raise UserError(f"can't read reference file {path} ({e.strerror}); pass an existing file as "
                        f"--reference, or '' for config/reference/") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise refuse(f"is not valid JSON ({e})") from None
    if not isinstance(ref, dict) or ref.get('format') != FORMAT:
        raise refuse(f"is not a reference curve (no \"format\": \"{FORMAT}\")")
    data, shaping, points = ref.get('data'), ref.get('settings'), ref.get('points')
    if not isinstance(data, dict) or not isinstance(data.get('text_sha256'), str):
        raise refuse("names no data (data.text_sha256)")
    if not isinstance(shaping, dict) or not isinstance(points, list) or not points:
        raise refuse("lacks its settings or its points")
    for p in points:
        ok = isinstance(p, dict) and isinstance(p.get('iter'), int) and all(
            isinstance(p.get(s), dict) and all(isinstance(p[s].get(q), (int, float)) and
                                               math.isfinite(p[s][q]) for q in ('mean', 'half_width'))
            for s in ('val', 'train'))
        if not ok:
            raise refuse("has a point without an iteration and the val/train mean and half_width")
    return ref


def reference_files(directory=REFERENCE_DIR):
    """ The measured reference files in a directory (config/reference/), sorted; published.json is not one. """
    return sorted(p for p in glob.glob(os.path.join(directory, '*.json'))
                  if os.path.basename(p) != 'published.json')


def differences(mine, theirs):
    """ The curve settings that differ, as 'name (X here, Y there)', in SHAPING's order. """
    names = [n for group in SHAPING.values() for n in group]
    return [f"{n} ({mine.get(n)!r} here, {theirs.get(n)!r} there)" for n in names if mine.get(n) != theirs.get(n)]


def same_data(ref, key):
    """ Whether a reference was made on the dataset of data_key key: the same text and tokenizer. """
    return key is not None and all(ref['data'].get(k) == key[k] for k in ('text_sha256', 'tokenizer'))


def short_digest(key):
    return f"{key.get('tokenizer')} text sha256 {key.get('text_sha256', '')[:12]}"


def given_reference(path, mine, key, say):
    """ The curve of --reference=path: of this run's data (else one line), compared with whatever differs. """
    ref = load_reference(path)
    if not same_data(ref, key):
        here = short_digest(key) if key else "data whose text digest is not recorded"
        raise UserError(f"reference file {path} belongs to other data ({short_digest(ref['data'])}; this "
                        f"run's: {here}); pass a reference made on this dataset, or --reference=none")
    # the user asked for this curve: compared even where a setting differs, which is said
    diffs = differences(mine, ref['settings'])
    unlike = f" although this run differs in {', '.join(diffs[:3])}" if diffs else ""
    say(f"reference: comparing each evaluation with {path}{unlike}")
    return ref


def matching_reference(directory, mine, key, say):
    """
    The curve in directory of this run's data and settings, said at start; else None, said with the
    closest curve (the fewest differences, the data counting as one) and what differs.
    """
    candidates = [(path, load_reference(path)) for path in reference_files(directory)]
    if not candidates:
        return None
    if key is None:
        say("reference: none matches: this dataset's meta.json doesn't record its text's digest "
            "(prepare it again with data/*/prepare.py to compare with config/reference/)")
        return None
    scored = []
    for path, ref in candidates:
        diffs = [] if same_data(ref, key) else [f"the data ({short_digest(key)} here, "
                                                 f"{short_digest(ref['data'])} there)"]
        diffs += differences(mine, ref['settings'])
        scored.append((len(diffs), path, ref, diffs))
    count, path, ref, diffs = min(scored, key=lambda s: s[0])
    name = os.path.relpath(path, PROJECT_DIR)
    if count == 0:
        say(f"reference: comparing each evaluation with {name} ({len(ref['seeds'])} seeds, to iter "
            f"{ref['points'][-1]['iter']})")
        return ref
    more = " and more" if len(diffs) > 3 else ""
    say(f"reference: none matches this run; the closest, {name}, differs in {', '.join(diffs[:3])}{more}")
    return None


class ReferenceCheck:
    """
    A run's comparison with one reference curve: after_eval gives the lines to print after each evaluation,
    band_at the band recorded beside the val loss. reference None: no curve, nothing said.
    """

    def __init__(self, reference):
        self.reference = reference
        self.points = {p['iter']: p for p in reference['points']} if reference else {}
        self.out_of_band = 0  # evaluations out of the band so far
        self.hinted = False

    @classmethod
    def for_run(cls, cfg, data_dir, choice='', directory=REFERENCE_DIR, say=print):
        """
        The check of a train.py run: cfg its settings, data_dir its dataset's directory, choice its
        --reference: 'none' = no check; a file = that curve, which must be of this run's data (one line
        otherwise) and is compared with even where a setting differs (said once); '' = the curve of
        config/reference/ whose data and settings match, or none, said once with the closest curve and
        what differs.
        """
        if choice == 'none':
            return cls(None)
        mine, key = curve_settings(cfg), data_key(data_dir)
        if choice:
            return cls(given_reference(choice, mine, key, say))
        return cls(matching_reference(directory, mine, key, say))

    def band_at(self, iter_num):
        """ The band at an evaluated iteration, for metrics.jsonl ({} where the reference has no point). """
        point = self.points.get(iter_num)
        if point is None:
            return {}
        val = point['val']
        return {'ref_val_mean': val['mean'], 'ref_val_low': round(val['mean'] - val['half_width'], 4),
                'ref_val_high': round(val['mean'] + val['half_width'], 4)}

    def after_eval(self, iter_num, val_loss):
        """ The lines to print after an evaluation's line: the verdict, then the hint once (a list). """
        if self.reference is None:
            return []
        point = self.points.get(iter_num)
        if point is None:
            return [f"reference: no point at iter {iter_num} ({self._points_held()})"]
        mean, half = point['val']['mean'], point['val']['half_width']
        if val_loss > mean + half:
            verdict = f"above the band by {val_loss - (mean + half):.4f}"
        elif val_loss < mean - half:
            verdict = f"below the band by {(mean - half) - val_loss:.4f}"
        else:
            verdict = "within the band"
        self.out_of_band += verdict != "within the band"
        lines = [f"reference: val loss {verdict} ({mean:.4f} ± {half:.4f}, {len(point['val'].get('seeds', []))} "
                 f"seeds)"]
        if self.out_of_band >= HINT_AFTER and not self.hinted:
            self.hinted = True
            lines.append(HINT)
        return lines

    def _points_held(self):
        """ Words for the iterations the curve has points at. """
        iters = sorted(self.points)
        if len(iters) > 1:
            return f"the curve has one every {iters[1] - iters[0]} iterations, to iter {iters[-1]}"
        return f"the curve has one at iter {iters[0]}"


def dumps(ref):
    """ A reference as readable JSON: the header indented, each evaluation's point on its own lines. """
    points = ref['points']
    text = json.dumps(dict(ref, points='@POINTS@'), indent=1, ensure_ascii=False)
    # a list of numbers (the seeds) on one line
    text = re.sub(r'\[\n[\d\s,.]+\]', lambda m: json.dumps(json.loads(m.group(0))), text)
    lines = ',\n'.join('  ' + json.dumps(p, ensure_ascii=False) for p in points)
    return text.replace('"@POINTS@"', '[\n' + lines + '\n ]') + '\n'
