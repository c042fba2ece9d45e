"""
DCLM's CORE score (Li et al. 2024, DataComp-LM, arxiv.org/abs/2406.11794) as nanochat measures a
base model: in-context tasks (22 in DCLM's "core" set), each one's accuracy centred on its random
baseline, (acc - b) / (1 - b), so that guessing scores 0 and a perfect model 1; CORE is the mean of
the centred accuracies. eval.py --task=core is the command line for it.

The eval bundle is DCLM's as nanochat packages it (eval_bundle.zip, unzipped):
    core.yaml            icl_tasks: a list of {label, dataset_uri, num_fewshot: [k],
                         icl_task_type, continuation_delimiter (default ' ')}
    eval_data/...        the JSONL file of each task (dataset_uri, relative to eval_data/; one
                         that starts with eval_data/ is relative to the bundle: task_file)
    eval_meta_data.csv   a row per task: its 'Eval Task' label and 'Random baseline' (percent)

An example of each task type, and how it is scored (the few-shot examples, drawn from the same
task, come first, each followed by a blank line):
    multiple_choice    {query, choices, gold}: one prompt per choice, query + delimiter +
                       choice; the choice whose own tokens (after the prefix all prompts share)
                       have the lowest mean loss is the model's answer
    schema             {context_options, continuation, gold}: one prompt per context option,
                       option + delimiter + continuation; the lowest mean loss of the tokens all
                       prompts end with (the continuation) picks the option
    language_modeling  {context, continuation}: right when the continuation is the model's
                       greedy continuation of the context (its trailing spaces dropped)
A choice the model can't tell from another (the same tokens) or with no tokens of its own is no
answer: wrong, whatever gold is (correct_examples).

These follow nanochat's nanochat/core_eval.py and scripts/base_eval.py: every prompt starts with
the tokenizer's end-of-text token as nanochat's starts with its BOS (a character vocabulary has
none: no start token); the lines of a task file are shuffled by random.Random(1337) before
--max_examples keeps the first N; example i's few-shot examples are random.Random(1234 + i).sample
of the others kept. A prompt longer than the model's block_size keeps its last block_size + 1
tokens (the last one is only a target). docs/evaluation.md says where the figures agree with
nanochat's and where they can't.

Usage:
    from nanogpt_plus.evaluation import core
    directory = core.bundle_dir('')               # data/core/eval_bundle, downloaded once
    tasks = core.read_bundle(directory)           # [CoreTask], every file checked
    result = core.evaluate_core(model, tokenizer, tasks, batch_size=16, device='cuda')
    result['core'], result['tasks']['hellaswag_zeroshot']['centered']
    # eval.py's whole task (the bundle found, the split's bits per byte with a dataset)
    core.evaluate_bundle(model, tokenizer_meta, '', dataset='fineweb', device='cuda')
"""

import csv
import io
import math
import os
import random
import shutil
import stat
import zipfile
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from nanogpt_plus.dataset import REPO_DIR
from nanogpt_plus.errors import TokenizerError, UserError, printable
from nanogpt_plus.evaluation import download, loss_files, loss_task, make_row, score_examples
from nanogpt_plus.files import read_jsonl
from nanogpt_plus.tokenizer import load_tokenizer

# nanochat's copy of DCLM's bundle (scripts/base_eval.py's EVAL_BUNDLE_URL)
BUNDLE_URL = "https://karpathy-public.s3.us-west-2.amazonaws.com/eval_bundle.zip"
DOWNLOAD_TIMEOUT_S = 30
# the most a downloaded bundle may unpack to, by its zip's own sizes (which zipfile holds each file
# to): DCLM's unpacks to ~0.1 GB; a 1 MB zip of 1 GiB of zeros is refused before it is unpacked
MAX_BUNDLE_BYTES = 2 * 2**30
TASK_TYPES = ('multiple_choice', 'schema', 'language_modeling')
# the bundle's own files beside its eval_data/ (what every rank compares of it too)
BUNDLE_FILES = ('core.yaml', 'eval_meta_data.csv')
# the fields an example of each type must have
ITEM_KEYS = {
    'multiple_choice': ('query', 'choices', 'gold'),
    'schema': ('context_options', 'continuation', 'gold'),
    'language_modeling': ('context', 'continuation'),
}
SHUFFLE_SEED = 1337  # the order --max_examples takes the first examples of
FEWSHOT_SEED = 1234  # example i draws its few-shot examples with seed FEWSHOT_SEED + i
# the tasks of the full bundle: a CORE of fewer doesn't compare with the references
DCLM_CORE_TASKS = 22
# YAML's merge key (<<: *base), whose keys an entry may give again on purpose
MERGE_TAG = 'tag:yaml.org,2002:merge'
BUNDLE_HINT = ("pass --core_dir=DIR, DCLM's eval bundle as nanochat ships it (eval_bundle.zip "
               "unzipped: core.yaml, eval_data/, eval_meta_data.csv)")

# published CORE scores a run can be held against: (model, CORE, where the figure comes from).
# Neither the DCLM paper nor OpenAI gives GPT-2's; nanochat measured them on the Hugging Face
# weights with its own harness (this one's definition) and published them at commit 92d63d4
REFERENCES = (
    ('GPT-2 124M', 0.1139, "nanochat dev/estimate_gpt3_core.ipynb (nanochat's harness)"),
    ('GPT-2 Medium 355M', 0.1849, "nanochat dev/estimate_gpt3_core.ipynb (nanochat's harness)"),
    ('GPT-2 Large 774M', 0.2146, "nanochat dev/estimate_gpt3_core.ipynb (nanochat's harness)"),
    ('GPT-2 XL 1558M', 0.256525, "nanochat README.md, dev/LEADERBOARD.md: the leaderboard's "
                                 "'time to GPT-2' threshold"),
)


@dataclass(frozen=True)
class CoreTask:
    """ One task of a bundle, as core.yaml and eval_meta_data.csv describe it. """
    label: str
    task_type: str  # one of TASK_TYPES
    num_fewshot: int
    delimiter: str  # between the context and the continuation
    path: str  # its JSONL file
    baseline: float  # the random baseline, a percentage


# -----------------------------------------------------------------------------
# the bundle: where it is, and reading it with one-line refusals

def default_bundle_dir():
    """ Where the downloaded bundle is kept: data/core/eval_bundle in this repo. """
    return os.path.join(REPO_DIR, 'data', 'core', 'eval_bundle')


def bundle_dir(core_dir=''):
    """ core_dir when given (it must exist), else the downloaded bundle (fetched once). """
    if core_dir:
        if not os.path.isdir(core_dir):
            raise UserError(f"no eval bundle directory at {core_dir}; {BUNDLE_HINT}")
        return core_dir
    target = default_bundle_dir()
    if not os.path.isdir(target):
        # a file where the bundle or its folder goes is the user's: said before any download
        for path in (os.path.dirname(target), target):
            if os.path.lexists(path) and not os.path.isdir(path):
                raise UserError(f"{path} is a file, not the directory the eval bundle is kept in; "
                                f"move it away, or {BUNDLE_HINT}")
        download_bundle(BUNDLE_URL, target)
    return target


def links_in(archive):
    """ The names of an archive's entries that are symbolic links (their mode, in the top bits). """
    return [info.filename for info in archive.infolist()
            if stat.S_ISLNK(info.external_attr >> 16)]


def download_bundle(url, target):
    """
    Download the zip and unpack its eval_bundle/ into target: unpacked beside it under a name of
    this process, then renamed, so that a half-unpacked bundle never looks complete (and ranks
    unpacking at once on one node leave one whole copy).
    """
    content = download(url, target, "offline, download and unzip it elsewhere and pass "
                       "--core_dir=PATH/eval_bundle", timeout=DOWNLOAD_TIMEOUT_S)
    parent = os.path.dirname(target)
    scratch = os.path.join(parent, f'.unpack.{os.getpid()}')
    try:
        try:
            os.makedirs(parent, exist_ok=True)
            with zipfile.ZipFile(io.BytesIO(content)) as archive:
                check_unpacked_size(archive, url)
                # zipfile writes a link's target as a file's text: a bundle has only plain files
                links = links_in(archive)
                if links:
                    raise UserError(f"{url} holds a symbolic link ({printable(links[0])}), which an "
                                    f"eval bundle has not; {BUNDLE_HINT}")
                archive.extractall(scratch)  # zipfile drops absolute paths and '..' from names
        except zipfile.BadZipFile:
            raise UserError(f"{url} did not give a zip file; download it by hand and pass "
                            f"--core_dir=PATH/eval_bundle") from None
        except OSError as e:  # a full disk, a file-size limit (EFBIG), a folder we can't write
            raise UserError(f"could not unpack {url} into {parent} ({e.strerror or e}); nothing "
                            f"was kept. Make room (or fix the folder's permissions), or "
                            f"{BUNDLE_HINT}") from None
        unpacked = os.path.join(scratch, 'eval_bundle')
        if not os.path.isdir(unpacked):
            raise UserError(f"{url} holds no eval_bundle/ directory; {BUNDLE_HINT}")
        if not os.path.isdir(target):  # another rank of this node may have placed it meanwhile
            os.replace(unpacked, target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def check_unpacked_size(archive, url):
    """ Refuse a zip that would unpack to more than MAX_BUNDLE_BYTES (a zip bomb), before unpacking it. """
    total = sum(info.file_size for info in archive.infolist())
    if total > MAX_BUNDLE_BYTES:
        raise UserError(f"{url} would unpack to {total / 2**30:,.1f} GiB, more than an eval bundle's "
                        f"limit of {MAX_BUNDLE_BYTES / 2**30:g} GiB; nothing was unpacked: {BUNDLE_HINT}")


class AliasRefused(Exception):
    """ A YAML alias (*name) in a core.yaml: where, and its anchor's name. """

    def __init__(self, anchor, line):
        super().__init__(anchor)
        self.anchor = str(anchor)[:40]
        self.line = line


class DuplicateKey(Exception):
    """ A key given twice in one YAML mapping, at a line (from 1). """


def strict_yaml_loader():
    """
    yaml.SafeLoader (plain values only, no tags that make objects) that also refuses a key given
    twice in one mapping, where PyYAML would keep the last one silently, and every alias (*name) as
    it meets it: nine anchors of nine aliases each (the "billion laughs", 440 bytes) build a
    structure of 9^9 values, which an error echoing an entry once printed as a 2.1 GB line.
    """
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                event = self.peek_event()
                raise AliasRefused(event.anchor, event.start_mark.line + 1)
            return super().compose_node(parent, index)

        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != MERGE_TAG:
                    key = (key_node.tag, key_node.value)
                    if key in seen:
                        raise DuplicateKey(key_node.value, key_node.start_mark.line + 1)
                    seen.add(key)
            return super().construct_mapping(node, deep)

    return StrictLoader


def unreadable(path, error):
    """ The one line for a bundle file the OS won't let us read (permissions, an I/O error). """
    return UserError(f"could not read {path} ({error.strerror or error}); make it readable by "
                     f"this user, or unzip the bundle again")


def read_yaml(path):
    """ The parsed core.yaml, or one line saying why it can't be read. """
    import yaml
    if not os.path.isfile(path):
        raise UserError(f"no core.yaml in {os.path.dirname(path) or '.'}; {BUNDLE_HINT}")
    try:
        with open(path, encoding='utf-8') as f:
            return yaml.load(f, Loader=strict_yaml_loader())
    except OSError as e:
        raise unreadable(path, e) from None
    except DuplicateKey as e:
        key, line = e.args
        raise UserError(f"{path} gives the key {key!r} twice in one mapping (line {line}); keep "
                        f"one") from None
    except AliasRefused as e:
        raise UserError(f"{path} uses a YAML alias (*{e.anchor}, line {e.line}); a core.yaml has no need "
                        f"of anchors and aliases, and a few of them can expand to gigabytes: write the "
                        f"values out, or unzip the bundle again") from None
    except RecursionError:  # thousands of nested [ or {: PyYAML builds them recursively
        raise UserError(f"{path} is nested too deeply to read; fix it or unzip the bundle "
                        f"again") from None
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        where = getattr(e, 'problem_mark', None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise UserError(
            f"{path} is not valid YAML{line}; fix it or unzip the bundle again") from None


def read_baselines(path):
    """
    {task label: its 'Random baseline' cell} of eval_meta_data.csv (checked when used); a task's
    second row is refused, not taken in place of the first.
    """
    if not os.path.isfile(path):
        raise UserError(f"no eval_meta_data.csv in {os.path.dirname(path) or '.'}; {BUNDLE_HINT}")
    baselines = {}
    try:
        # utf-8-sig: a spreadsheet's byte-order mark is not part of the first column's name
        with open(path, encoding='utf-8-sig', newline='') as f:
            reader = csv.DictReader(f)
            columns = reader.fieldnames or ()
            missing = [c for c in ('Eval Task', 'Random baseline') if c not in columns]
            if missing:
                raise UserError(f"{path} has no {' or '.join(repr(c) for c in missing)} column; "
                                f"unzip the bundle again")
            for row in reader:
                label = row['Eval Task']
                if label in baselines:
                    raise UserError(f"{path} has a second row for task {printable(label)} (line "
                                    f"{reader.line_num}); keep one row per task")
                baselines[label] = row['Random baseline']
    except OSError as e:
        raise unreadable(path, e) from None
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not UTF-8 text (byte {e.object[e.start]:#04x}); save it as "
                        f"UTF-8") from None
    except csv.Error as e:  # a cell over csv.field_size_limit(), a NUL byte, ...
        # (the csv reader's own count: DictReader's stops at the last row it returned)
        raise UserError(f"{path} line {reader.reader.line_num} can't be read as CSV ({e}); fix "
                        f"that line or unzip the bundle again") from None
    return baselines


def fewshot_count(value):
    """ core.yaml's num_fewshot: a list of counts (DCLM's form; the first is used) or one count. """
    if isinstance(value, list) and value:
        value = value[0]
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    return value if ok else None


def task_file(directory, uri):
    """
    The JSONL file of a dataset_uri: relative to the bundle's eval_data/ (DCLM's 'sets/x.jsonl'),
    or, when it already starts with eval_data/ (as a person writing their own task tends to put
    it), relative to the bundle itself rather than to eval_data/eval_data/.
    """
    parts = os.path.normpath(uri).split(os.sep)
    if parts[0] == 'eval_data' and len(parts) > 1:
        return os.path.join(directory, uri)
    return os.path.join(directory, 'eval_data', uri)


def inside(path, directory):
    """ Whether path, its symbolic links followed, lies in directory (followed too). """
    real, home = os.path.realpath(path), os.path.realpath(directory)
    return os.path.commonpath([real, home]) == home


def core_task(entry, number, directory, baselines):
    """ The CoreTask of core.yaml's icl_tasks entry `number` (from 1), checked. """
    where = f"{os.path.join(directory, 'core.yaml')}: icl_tasks entry {number}"
    if not isinstance(entry, dict):
        raise UserError(f"{where} is not a mapping; fix core.yaml")
    label = entry.get('label')
    uri = entry.get('dataset_uri')
    task_type = entry.get('icl_task_type')
    delimiter = entry.get('continuation_delimiter', ' ')
    shots = fewshot_count(entry.get('num_fewshot'))
    if not (isinstance(label, str) and label and isinstance(uri, str) and uri and
            isinstance(delimiter, str) and shots is not None):
        raise UserError(f"{where} needs a 'label', a 'dataset_uri', a 'num_fewshot' (a count, or "
                        f"a list of them) and a string 'continuation_delimiter' if any; fix "
                        f"core.yaml")
    shown = printable(label)
    if task_type not in TASK_TYPES:
        raise UserError(f"{where} ({shown}) has icl_task_type {task_type!r}; this scorer knows "
                        f"{', '.join(TASK_TYPES)}")
    path = task_file(directory, uri)
    # a bundle scores its own files: not one an absolute path, '..' or a link leads elsewhere to
    if os.path.isabs(uri) or not inside(path, directory):
        raise UserError(f"{where} ({shown}) has dataset_uri {uri!r}, which leads outside the "
                        f"bundle {directory}; put the file under its eval_data/ and give its path "
                        f"from there")
    if not os.path.isfile(path):
        raise UserError(f"no data file at {printable(path)} (task {shown}); {BUNDLE_HINT}")
    meta_path = os.path.join(directory, 'eval_meta_data.csv')
    if label not in baselines:
        raise UserError(f"{meta_path} has no row for task {shown}; add its 'Random baseline'")
    try:
        baseline = float(baselines[label])
    except (TypeError, ValueError):
        baseline = math.nan
    if not 0 <= baseline < 100:  # a percentage; 100 would leave nothing to centre on
        raise UserError(f"{meta_path}: the 'Random baseline' of {shown} is {baselines[label]!r}, "
                        f"not a percentage from 0 to under 100; fix that row")
    return CoreTask(label, task_type, shots, delimiter, path, baseline)


def read_bundle(directory):
    """ The bundle's tasks in core.yaml's order, every file there and every field checked. """
    config_path = os.path.join(directory, 'core.yaml')
    config = read_yaml(config_path)
    baselines = read_baselines(os.path.join(directory, 'eval_meta_data.csv'))
    entries = config.get('icl_tasks') if isinstance(config, dict) else None
    if not isinstance(entries, list) or not entries:
        raise UserError(f"{config_path} has no 'icl_tasks' list; {BUNDLE_HINT}")
    tasks = [core_task(entry, k, directory, baselines) for k, entry in enumerate(entries, 1)]
    labels = [t.label for t in tasks]
    twice = sorted({x for x in labels if labels.count(x) > 1})
    if twice:
        raise UserError(f"{config_path} lists task {printable(twice[0])} twice; keep one entry per "
                        f"label")
    return tasks


# -----------------------------------------------------------------------------
# a task's examples and their prompts

# the scalars a prompt writes out as text (a number in a task file reads as it would print, as in
# nanochat's templates); anything else in a text field is refused
SCALARS = (str, int, float, bool)


def checked_item(task, lineno, item):
    """
    The example with its text fields as strings, or one line naming the file and line when its
    fields have the wrong shape.
    """
    def text(x):
        return isinstance(x, SCALARS)

    def texts(x):
        return isinstance(x, list) and len(x) >= 2 and all(map(text, x))

    def index(x, options):
        return (isinstance(x, int) and not isinstance(x, bool) and texts(options) and
                0 <= x < len(options))

    if task.task_type == 'multiple_choice':
        ok = text(item['query']) and texts(item['choices']) and index(item['gold'], item['choices'])
        shape = "a 'query' text, at least 2 'choices' texts and a 'gold' index of them"
    elif task.task_type == 'schema':
        ok = (texts(item['context_options']) and text(item['continuation']) and
              index(item['gold'], item['context_options']))
        shape = ("at least 2 'context_options' texts, a 'continuation' text and a 'gold' index of "
                 "the options")
    else:
        ok = (text(item['context']) and text(item['continuation']) and
              str(item['continuation']).strip())
        shape = "a 'context' text and a 'continuation' text that is not blank"
    if not ok:
        raise UserError(f"{task.path} line {lineno}: a {task.task_type} example needs {shape}; "
                        f"fix that line")
    return {key: ([str(x) for x in value] if isinstance(value, list) else
                  value if key == 'gold' else str(value))
            for key, value in item.items() if key in ITEM_KEYS[task.task_type]}


def task_items(task, max_examples=0):
    """
    [(line number, example)] of a task: its lines in the fixed shuffled order, the first
    max_examples of them when > 0 (nanochat's subsample), each checked.
    """
    records = [(lineno, checked_item(task, lineno, item)) for lineno, item in
               read_jsonl(task.path, ITEM_KEYS[task.task_type], BUNDLE_HINT)]
    random.Random(SHUFFLE_SEED).shuffle(records)
    if max_examples:
        records = records[:max_examples]
    if task.num_fewshot > len(records) - 1:
        kept = " kept by --max_examples" if max_examples else ""
        raise UserError(f"task {printable(task.label)} is {task.num_fewshot}-shot but has {len(records)} "
                        f"examples{kept}; it needs at least {task.num_fewshot + 1}"
                        + (": raise --max_examples" if max_examples else ""))
    return records


def fewshot_for(i, n, k):
    """ The indices of example i's k few-shot examples among n: a fixed draw, never i itself. """
    if k == 0:
        return []
    others = [j for j in range(n) if j != i]
    return random.Random(FEWSHOT_SEED + i).sample(others, k)


def prompts_of(task_type, item, shots, delimiter):
    """
    The texts an example is scored on: one per choice (multiple_choice) or context option (schema);
    for language_modeling the context alone and the context with its continuation.
    """
    if task_type == 'multiple_choice':
        head = ''.join(f"{s['query']}{delimiter}{s['choices'][s['gold']]}\n\n" for s in shots)
        return [f"{head}{item['query']}{delimiter}{choice}" for choice in item['choices']]
    if task_type == 'schema':
        head = ''.join(f"{s['context_options'][s['gold']]}{delimiter}{s['continuation']}\n\n"
                       for s in shots)
        return [f"{head}{option}{delimiter}{item['continuation']}"
                for option in item['context_options']]
    head = ''.join(f"{s['context'].strip()}{delimiter}{s['continuation']}\n\n" for s in shots)
    # the context's own trailing spaces go: a space would stick to the continuation's first token
    head += f"{item['context'].strip()}{delimiter}"
    # without its continuation the prompt is stripped too (a space delimiter included), so that its
    # tokens are a prefix of the full prompt's
    return [head.strip(), head + item['continuation']]


def common_length(sequences, from_end=False):
    """ How many leading (or trailing) tokens all sequences share. """
    shared = 0
    for column in zip(*(reversed(s) if from_end else s for s in sequences)):
        if any(t != column[0] for t in column):
            break
        shared += 1
    return shared


def scored_counts(task_type, token_lists):
    """
    How many final tokens of each prompt are scored: after the prefix the choices share
    (multiple_choice), the suffix the options share (schema), the continuation's tokens after the
    context's (language_modeling: only the full prompt is scored).
    """
    if task_type == 'multiple_choice':
        shared = common_length(token_lists)
        return [len(t) - shared for t in token_lists]
    if task_type == 'schema':
        return [common_length(token_lists, from_end=True)] * len(token_lists)
    return [len(token_lists[1]) - common_length(token_lists)]


def example_rows(task, item, shots, tokenizer, block_size):
    """ The rows (tokens, n_target) of an example: one per choice or option, one for an LM item. """
    start = [] if tokenizer.eot_token is None else [tokenizer.eot_token]
    prompts = prompts_of(task.task_type, item, shots, task.delimiter)
    token_lists = [start + tokenizer.encode_ordinary(p) for p in prompts]
    counts = scored_counts(task.task_type, token_lists)
    if task.task_type == 'language_modeling':
        token_lists = token_lists[1:]  # the context alone only told where the continuation starts
    return [make_row(t[:len(t) - n], t[len(t) - n:], block_size)
            for t, n in zip(token_lists, counts)]


def task_rows(task, records, tokenizer, block_size):
    """ (rows, offsets): example k owns rows[offsets[k]:offsets[k + 1]]. """
    items = [item for _, item in records]
    rows = []
    offsets = [0]
    for i, (lineno, item) in enumerate(records):
        shots = [items[j] for j in fewshot_for(i, len(items), task.num_fewshot)]
        try:
            rows.extend(example_rows(task, item, shots, tokenizer, block_size))
        except TokenizerError as e:
            raise TokenizerError(
                f"{task.path} line {lineno} (or a few-shot example of it): {e}") from None
        if task.task_type == 'language_modeling' and rows[-1][1] == 0:
            raise UserError(f"{task.path} line {lineno}: the continuation adds no tokens to the "
                            f"context; fix that line")
        offsets.append(len(rows))
    return rows, offsets


# -----------------------------------------------------------------------------
# scoring

def correct_examples(task_type, table, offsets, golds, rows):
    """
    Per example, 1.0 when the model is right: the greedy match of an LM item; otherwise gold has the
    lowest mean loss. A choice left with no tokens of its own is never picked, and when the lowest
    belongs to a row that another choice of the example shares (the same tokens: identical choices
    or options, or ones cropping made alike) the model has told nothing apart: both count as no
    answer, wrong whatever gold is. Distinct choices whose losses tie to the last bit: the first.
    """
    correct = []
    for k in range(len(offsets) - 1):
        scores = table[offsets[k]:offsets[k + 1]]
        if task_type == 'language_modeling':
            correct.append(float(scores[0, 2].item()))
            continue
        has_tokens = scores[:, 1] > 0
        mean = torch.where(has_tokens, scores[:, 0] / scores[:, 1].clamp(min=1), math.inf)
        pick = int(mean.argmin().item())
        own = rows[offsets[k]:offsets[k + 1]]
        answered = bool(has_tokens[pick]) and own.count(own[pick]) == 1
        correct.append(float(answered and pick == golds[k]))
    return correct


def centered(accuracy, baseline):
    """ The accuracy centred on a random baseline given in percent: 0 = chance, 1 = perfect. """
    chance = 0.01 * baseline
    return (accuracy - chance) / (1.0 - chance)


def core_score(centred):
    """ CORE: the mean of the tasks' centred accuracies. """
    return sum(centred) / len(centred)


def score_task(model, task, tokenizer, block_size, batch_size, max_examples=0, run=None):
    """ {'accuracy', 'centered', 'num_examples', 'num_fewshot', 'type'} of model on one task. """
    records = task_items(task, max_examples)
    rows, offsets = task_rows(task, records, tokenizer, block_size)
    table = score_examples(model, rows, offsets, batch_size, **(run or {'device': 'cpu'}))
    golds = [item.get('gold') for _, item in records]
    correct = correct_examples(task.task_type, table, offsets, golds, rows)
    accuracy = sum(correct) / len(correct)
    return {'accuracy': accuracy, 'centered': centered(accuracy, task.baseline),
            'num_examples': len(correct), 'num_fewshot': task.num_fewshot, 'type': task.task_type}


def task_line(label, scores):
    """ The line printed for one task. """
    return (f"{printable(label):<32} accuracy {scores['accuracy']:.4f}  centered {scores['centered']:+.4f}  "
            f"({scores['num_examples']} examples, {scores['num_fewshot']}-shot {scores['type']})")


def evaluate_core(model, tokenizer, tasks, batch_size, max_examples=0, device='cpu',
                  ctx=nullcontext(), dist_info=None, pad_to=None, progress=False, threads=None,
                  poll=None):
    """
    {'core', 'tasks': {label: score_task's dict}} of model on a bundle's tasks (read_bundle's), each
    task's examples split across the ranks (score_examples); progress: print each task's line as it
    is done (rank 0); threads: score_examples' (the first task's first batch is timed); poll: its
    stop agreement (eval.py's raises).
    """
    run = dict(device=device, ctx=ctx, dist_info=dist_info, pad_to=pad_to, threads=threads, poll=poll)
    scores = {}
    for task in tasks:
        scores[task.label] = score_task(model, task, tokenizer, model.config.block_size, batch_size,
                                        max_examples, run)
        if progress:
            print(task_line(task.label, scores[task.label]), flush=True)
    core = core_score([s['centered'] for s in scores.values()])
    return {'core': core, 'tasks': scores}


def score_card(metrics, source, max_examples=0):
    """
    The lines that end --task=core: the CORE line, then the score card: this model's CORE (and bits
    per byte, when measured) marked as measured here, and the published reference rows marked with
    their sources.
    """
    n_tasks = len(metrics['tasks'])
    partial = []
    if n_tasks != DCLM_CORE_TASKS:
        partial.append(f"{n_tasks} of DCLM's {DCLM_CORE_TASKS} tasks")
    if max_examples:
        partial.append(f"at most {max_examples} examples a task")
    caveat = f"; {', '.join(partial)}: not comparable with the rows below" if partial else ""
    lines = [f"CORE {metrics['core']:.6f} ({n_tasks} tasks)",
             "score card (CORE; higher is better):",
             f"  {'this model':<20} {metrics['core']:.6f}  measured here: {source}{caveat}"]
    bpb = {k: v for k, v in metrics.items() if k.endswith('_bpb')}
    for key, value in bpb.items():
        lines.append(f"  {'this model ' + key:<20} {value:.6f}  measured here (bits per byte)")
    for name, core, where in REFERENCES:
        lines.append(f"  {name:<20} {core:<8}  published: {where}")
    return lines


def evaluate_bundle(model, tokenizer_meta, data_file='', dataset='', split='val', batch_size=16,
                    max_examples=0, device='cpu', ctx=nullcontext(), dist_info=None, pad_to=None,
                    progress=False, threads=None, poll=None):
    """
    eval.py's core task, laid out as evaluation.evaluate's result: {'task': 'core', 'metrics':
    {'core', 'tasks', and <split>_bpb with a dataset}, 'num_examples', 'data_file': the bundle}.
    data_file is the bundle's directory ('': the downloaded one); with a dataset, its split's bits
    per byte too (the loss task's, over its first max_examples windows when > 0).
    """
    bundle = bundle_dir(data_file)
    run = dict(device=device, ctx=ctx, dist_info=dist_info, pad_to=pad_to, threads=threads, poll=poll)
    metrics = evaluate_core(model, load_tokenizer(tokenizer_meta), read_bundle(bundle), batch_size,
                            max_examples, progress=progress, **run)
    if dataset:
        # minutes on a CPU, after the tasks' lines: said as it starts, then how far it is (rank 0)
        said = progress and f"bits per byte of {dataset}'s {split} split"
        loss, _, _ = loss_task(model, tokenizer_meta, loss_files('', dataset, split), dataset, 0,
                               batch_size, max_examples, dict(run, progress=said))
        metrics[f'{split}_bpb'] = loss.get('bits_per_byte')
    num_examples = sum(s['num_examples'] for s in metrics['tasks'].values())
    return {'task': 'core', 'metrics': metrics, 'num_examples': num_examples, 'data_file': bundle}
