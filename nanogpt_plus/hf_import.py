"""
Hugging Face GPT-2 directories read without transformers: config.json for the architecture, then the
weights from model.safetensors (memory-mapped by safetensors) or pytorch_model.bin (torch.load,
weights_only=True, memory-mapped unless of the legacy non-zip format), renamed to ours with
model.hf_key_map (Conv1D weights transposed). Importing transformers alone takes seconds and
from_pretrained builds a second 124M-parameter model; neither is needed to read two files.
GPT.from_pretrained (model.py) stays the transformers-based reference this path is tested against.

export_hf.py's custom form (model_type 'nanogpt', for the modern options GPT-2 lacks) is read too:
our options from config.json, our tensor names under 'gpt.'. What our GPT can't compute exactly is
refused with one line: another model_type, an activation, LayerNorm epsilon or attention scaling of
its own, a missing, unexpected or misshapen tensor; and so is a config.json value of the wrong JSON
type, or a pickled object in a pytorch_model.bin (never run). An export of a char or bpe model
(export_hf.py) names its tokenizer in nanogpt_tokenizer.json, read by pretrained_tokenizer_meta.

A gpt2* name comes from the local hub cache, else is downloaded; offline (HF_HUB_OFFLINE, or no
connection to the hub within seconds) it is refused in one line at once.

Usage:
    from nanogpt_plus.hf_import import hf_config_and_weights
    config, state_dict, path = hf_config_and_weights('gpt2')   # or a local directory; then init_from.loaded_model
"""

import json
import os
import socket
import urllib.parse
import urllib.request
import zipfile

import torch

from model import GPT2_NAMES, HF_ACTIVATIONS, GPTConfig, hf_key_map
from nanogpt_plus.bpe import read_named_tokenizer
from nanogpt_plus.errors import UserError, error_line, load_error

HF_TOKENIZER_META = 'nanogpt_tokenizer.json'  # export_hf.py writes it for char and bpe models
# export_hf.py's custom form (nanogpt_plus/hf_modeling.py): its model_type, the options config.json
# holds beyond GPT-2's (with their values when absent), and the prefix of its tensors' names (ours
# otherwise)
NANOGPT_TYPE = 'nanogpt'
NANOGPT_OPTIONS = {
    'bias': True,
    'pos': 'learned',
    'norm': 'layernorm',
    'qk_norm': False,
    'logit_softcap': 0.0
}
NANOGPT_PREFIX = 'gpt.'
WEIGHT_FILES = ('model.safetensors', 'pytorch_model.bin')  # in the order transformers prefers them
# the seconds a connection to the hub may take to open before no download is tried: online one
# opens in well under a second; without a network huggingface_hub's retries take ~25 s to give up
HUB_PROBE_SECONDS = 3.0
# GPT2Config's defaults, for the keys an older config.json (the hub's own gpt2 one) leaves out
HF_DEFAULTS = dict(model_type='gpt2', activation_function='gelu_new', layer_norm_epsilon=1e-5,
                   n_inner=None, scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                   reorder_and_upcast_attn=False, tie_word_embeddings=True,
                   add_cross_attention=False, vocab_size=50257, n_positions=1024, n_embd=768,
                   n_layer=12, n_head=12)
# causal-mask buffers older transformers saved
IGNORED_SUFFIXES = ('.attn.bias', '.attn.masked_bias')
# the JSON type each key must have; anything else ("768", 768.0, null, true) is a broken file, said
# here in one line rather than as a TypeError wherever the value is first used (or, for a flag,
# silently read as truthy)
SIZE_KEYS = ('vocab_size', 'n_positions', 'n_embd', 'n_layer', 'n_head')
FLAG_KEYS = ('scale_attn_weights', 'scale_attn_by_inverse_layer_idx', 'reorder_and_upcast_attn',
             'tie_word_embeddings', 'add_cross_attention')


def hub_offline_error(name, why="offline?"):
    """ The one line for a gpt2* name that can't be had: not cached, and not downloaded (why). """
    return UserError(f"could not download '{name}' from the Hugging Face hub ({why}) and the local "
                     f"hub cache lacks it. Download it elsewhere (GPT2LMHeadModel.from_pretrained("
                     f"'{name}').save_pretrained(DIR)) and pass the local directory instead: "
                     f"init_from=DIR")


def hub_offline():
    """ Whether the user turned the hub off (read now: huggingface_hub reads these at import). """
    return any(os.environ.get(key, '').upper() in ('1', 'ON', 'YES', 'TRUE')
               for key in ('HF_HUB_OFFLINE', 'TRANSFORMERS_OFFLINE'))


def hub_address():
    """ (host, port) a download connects to first: the https proxy if one is set, else the hub. """
    from huggingface_hub import constants
    url = urllib.parse.urlsplit(urllib.request.getproxies().get('https') or constants.ENDPOINT)
    return url.hostname, url.port or (443 if url.scheme == 'https' else 80)


def hub_unreachable(timeout=HUB_PROBE_SECONDS):
    """ Why the hub can't be reached, or None: one TCP connection attempt of at most timeout s. """
    host, port = hub_address()
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:  # no DNS, no route, refused, timed out
        return f"offline: no connection to {host}:{port}, {error_line(e, 80)}"
    return None


def hub_path(name, filenames):
    """
    The path of the first of filenames that the hub repo name has: from the local hub cache, else
    downloaded. Without a network huggingface_hub retries for ~25 s before it fails, so a download
    is tried only when HF_HUB_OFFLINE is unset and a connection to the hub opens within seconds;
    otherwise the one line comes at once. The cache comes first even online: OpenAI's GPT-2 files
    never change, so there is nothing to re-check.
    """
    from huggingface_hub import hf_hub_download
    for filename in filenames:
        try:
            return hf_hub_download(name, filename, local_files_only=True)
        # not cached (huggingface_hub's errors vary): the next file, then the network
        except Exception:
            continue
    why = "offline: HF_HUB_OFFLINE is set" if hub_offline() else hub_unreachable()
    if why is not None:
        raise hub_offline_error(name, why)
    for filename in filenames:
        try:
            return hf_hub_download(name, filename)
        # no such file (the next one), a network error: huggingface_hub's errors vary
        except Exception:
            continue
    raise hub_offline_error(name)


def hub_files(name):
    """ (config.json, weights file) of a gpt2* name: from the hub's cache, else downloaded. """
    return hub_path(name, ('config.json',)), hub_path(name, WEIGHT_FILES)


def local_files(directory):
    """ (config.json, weights file) of a local Hugging Face directory. """
    for filename in WEIGHT_FILES:
        path = os.path.join(directory, filename)
        if os.path.exists(path):
            return os.path.join(directory, 'config.json'), path
    raise UserError(
        f"could not load a Hugging Face GPT-2 model from {directory}: it has a config.json but no "
        f"{' or '.join(WEIGHT_FILES)}; copy the weights there (a sharded checkpoint: save it again "
        f"as one file)")


def read_hf_config(path):
    """ config.json as a dict, GPT2Config's defaults filled in. """
    try:
        with open(path, encoding='utf-8') as f:
            found = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(
            f"{path} is not a readable Hugging Face config ({error_line(e)}); use an intact "
            f"config.json") from None
    if not isinstance(found, dict):
        raise UserError(
            f"{path} is not a Hugging Face config (no JSON object); use an intact config.json")
    hf = dict(HF_DEFAULTS, **found)
    wrong = mistyped(hf)
    if wrong is not None:
        key, expected = wrong
        raise UserError(
            f"{path}: {key} is {json.dumps(hf[key])[:60]}, which is not {expected}; fix the file (or "
            f"save the model again with transformers' save_pretrained)")
    return hf


def mistyped(hf):
    """
    (key, the type it needs) for the first value of a config dict whose JSON type is wrong, or None.
    """
    def size(v):  # bool is an int to Python, not to JSON
        return isinstance(v, int) and not isinstance(v, bool) and v > 0
    for key in SIZE_KEYS:
        if not size(hf[key]):
            return key, "a positive integer"
    if hf['n_inner'] is not None and not size(hf['n_inner']):
        return 'n_inner', "a positive integer or null"
    if isinstance(hf['layer_norm_epsilon'], bool) or not isinstance(hf['layer_norm_epsilon'],
                                                                    (int, float)):
        return 'layer_norm_epsilon', "a number"
    for key in FLAG_KEYS:
        if not isinstance(hf[key], bool):
            return key, "true or false"
    for key in ('model_type', 'activation_function'):
        if not isinstance(hf[key], str):
            return key, "a string"
    return None


def refusal(hf):
    """ Why our GPT can't compute exactly what this HF config describes, or None. """
    if hf['model_type'] != 'gpt2':
        return f"model_type is {hf['model_type']!r}, not 'gpt2' (or 'nanogpt', export_hf.py's own)"
    if hf['activation_function'] not in HF_ACTIVATIONS:
        return f"unsupported activation_function {hf['activation_function']!r} (known: {', '.join(HF_ACTIVATIONS)})"
    if hf['layer_norm_epsilon'] != 1e-5:
        return f"layer_norm_epsilon is {hf['layer_norm_epsilon']}, ours is 1e-5"
    if hf['n_inner'] not in (None, 4 * hf['n_embd']):
        return f"n_inner is {hf['n_inner']}, ours is 4 * n_embd"
    for key, ours in (('scale_attn_weights', True), ('scale_attn_by_inverse_layer_idx', False),
                      ('reorder_and_upcast_attn', False), ('add_cross_attention', False)):
        if hf[key] != ours:
            return f"{key} is {hf[key]}, ours is {ours}"
    return None


def gpt_config(hf, source, dropout=None):
    """ Our GPTConfig for an HF config dict (GPT-2's, or an export's of model_type 'nanogpt'), or the one line
    saying why there is none. """
    dropout = 0.0 if dropout is None else dropout  # a training setting, 0 unless asked for
    if hf.get('model_type') == NANOGPT_TYPE:
        return nanogpt_config(hf, source, dropout)
    why = refusal(hf)
    if why is not None:
        raise UserError(f"{source} is not a GPT-2 this project can run exactly: {why}")
    # GPT-2 checkpoints always have biases
    return GPTConfig(n_layer=hf['n_layer'],
                     n_head=hf['n_head'],
                     n_embd=hf['n_embd'],
                     block_size=hf['n_positions'],
                     vocab_size=hf['vocab_size'],
                     bias=True,
                     **HF_ACTIVATIONS[hf['activation_function']],
                     tie_embeddings=hf['tie_word_embeddings'],
                     dropout=dropout)


def nanogpt_config(hf, source, dropout):
    """
    The GPTConfig of export_hf.py's custom form: GPT-2's sizes, and our options by their own names.
    """
    def refused(why):
        return UserError(
            f"{source}'s config.json is not one export_hf.py writes ({why}); export the model again"
        )
    options = {k: hf.get(k, default) for k, default in NANOGPT_OPTIONS.items()}
    # bool is an int to Python, not to JSON
    wrong = [k for k, v in options.items() if type(v) is not type(NANOGPT_OPTIONS[k]) and
             not (k == 'logit_softcap' and type(v) is int)]
    if hf['activation_function'] not in HF_ACTIVATIONS:
        wrong.insert(0, 'activation_function')
    if wrong:
        raise refused(f"{wrong[0]}={json.dumps(hf.get(wrong[0]))[:60]}")
    try:
        return GPTConfig(n_layer=hf['n_layer'], n_head=hf['n_head'], n_embd=hf['n_embd'],
                         block_size=hf['n_positions'], vocab_size=hf['vocab_size'], dropout=dropout,
                         **HF_ACTIVATIONS[hf['activation_function']], **options,
                         tie_embeddings=hf['tie_word_embeddings'])
    except ValueError as e:  # a value GPTConfig can't take (pos='alibi')
        raise refused(e) from None


def read_tensors(path):
    """
    {name: tensor} of a weights file, memory-mapped: only the pages that are copied out are read.
    """
    if path.endswith('.safetensors'):
        from safetensors.torch import load_file
        try:
            return load_file(path)
        except Exception as e:  # truncated, not a safetensors file: either way it can't be used
            raise UserError(
                f"{path} is corrupt or not a weights file ({error_line(e, 200)}); use an intact "
                f"copy") from None
    try:
        # mmap needs torch.save's zip format; a file of the legacy format is read the ordinary way
        tensors = torch.load(path, map_location='cpu', weights_only=True,
                             mmap=zipfile.is_zipfile(path))
    except Exception as e:  # truncated, not a weights file, a pickled object
        # the ckpt.pt reader's words for what torch.load refused (never torch's advice to load the
        # file with weights_only=False, i.e. to run its code)
        raise load_error(path, e) from None
    if not isinstance(tensors, dict) or not all(
            isinstance(t, torch.Tensor) for t in tensors.values()):
        raise UserError(
            f"{path} is not a state dict of tensors; use a Hugging Face model's pytorch_model.bin or "
            f"model.safetensors")
    return tensors


def hf_names(tensors):
    """
    The tensors under GPT2LMHeadModel's names: the hub's own gpt2 files leave out the 'transformer.'
    prefix.
    """
    out = {}
    for name, t in tensors.items():
        if name.endswith(IGNORED_SUFFIXES):  # masks
            continue
        out[name if name.startswith(('transformer.', 'lm_head.')) else 'transformer.' + name] = t
    return out


def state_dict_from_hf(tensors, config, source, custom=False):
    """
    Our state_dict (lm_head included) from HF tensors, every tensor accounted for. The Conv1D
    weights come as transposed views; their shapes, and a tied model's saved lm_head.weight's
    equality with wte, are checked when the model takes them (init_from.loaded_model). Without a
    saved head, lm_head is wte, as transformers ties it. custom: export_hf.py's custom form, whose
    tensors are ours under 'gpt.'.
    """
    if custom:
        ours = {name[len(NANOGPT_PREFIX):] if name.startswith(NANOGPT_PREFIX) else name: t
                for name, t in tensors.items()}
        if config.tie_embeddings and 'lm_head.weight' not in ours and 'transformer.wte.weight' in ours:
            ours['lm_head.weight'] = ours['transformer.wte.weight']
        return ours
    theirs = hf_names(tensors)
    ours = {}
    saved_head = theirs.pop('lm_head.weight', None) if config.tie_embeddings else None
    for our_name, hf_name, transpose in hf_key_map(config):
        if hf_name not in theirs:
            raise UserError(
                f"{source} has no tensor {hf_name}, which its config's {config.n_layer}-layer GPT-2 "
                f"needs; use complete weights")
        t = theirs.pop(hf_name)
        ours[our_name] = t.t() if transpose else t
    if theirs:
        raise UserError(
            f"{source} holds tensors a GPT-2 has no place for ({', '.join(sorted(theirs)[:3])}); "
            f"it is another architecture")
    if config.tie_embeddings:
        ours[
            'lm_head.weight'] = ours['transformer.wte.weight'] if saved_head is None else saved_head
    return ours


def hf_config(init_from, dropout=None):
    """
    The GPTConfig alone of a gpt2* name or a local Hugging Face GPT-2 directory: config.json, its
    weights neither read nor downloaded (FSDP's ranks other than 0 build the model on the meta
    device and get their shards).
    """
    if init_from in GPT2_NAMES:
        config_path = hub_path(init_from, ('config.json',))
    else:
        config_path = os.path.join(init_from, 'config.json')
    return gpt_config(read_hf_config(config_path), init_from, dropout)


def hf_config_and_weights(init_from, dropout=None):
    """
    (GPTConfig, our state_dict, the weights file) of a gpt2* name or a local Hugging Face GPT-2
    directory.
    """
    config_path, weights_path = hub_files(init_from) if init_from in GPT2_NAMES else local_files(
        init_from)
    hf = read_hf_config(config_path)
    config = gpt_config(hf, init_from, dropout)
    custom = hf['model_type'] == NANOGPT_TYPE
    return config, state_dict_from_hf(read_tensors(weights_path), config, weights_path,
                                      custom), weights_path


def pretrained_tokenizer_meta(init_from):
    """
    The tokenizer of a pretrained model: GPT-2's, unless export_hf.py left a nanogpt_tokenizer.json
    (a char vocabulary, or a bpe description naming the directory's tokenizer.json, which is read in
    here).
    """
    meta_path = os.path.join(init_from, HF_TOKENIZER_META)
    if not (os.path.isdir(init_from) and os.path.exists(meta_path)):
        return {'kind': 'gpt2'}
    try:
        with open(meta_path, encoding='utf-8') as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(
            f"{meta_path} is unreadable ({e}); re-export the model with export_hf.py") from None
    if meta.get('kind') == 'bpe' and 'tokenizer_json' not in meta:
        meta['tokenizer_json'] = read_named_tokenizer(init_from, meta, f"{init_from} was exported",
                                                      "re-export the model with export_hf.py")
    return meta
