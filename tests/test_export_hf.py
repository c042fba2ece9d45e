"""
export_hf.py: the exported directory loads in transformers (model, tokenizer, pipeline) offline and
computes exactly our logits; re-importing it with GPT.from_pretrained gives back the same model.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO, save_test_checkpoint

from model import EXPORT_ACTIVATIONS, GPT, HF_ACTIVATIONS, GPTConfig
from nanogpt_plus.checkpoint import init_model
from nanogpt_plus.hf_export import export, hf_config, hf_state_dict
from nanogpt_plus.tokenizer import CharTokenizer, GPT2Tokenizer, load_tokenizer


def tiny_gpt(seed=0, **kw):
    torch.manual_seed(seed)
    args = dict(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=50304, bias=True, gelu='tanh')
    args.update(kw)
    model = GPT(GPTConfig(**args))
    with torch.no_grad():  # random LayerNorm parameters too, so a dropped or misplaced one shows
        for name, p in model.named_parameters():
            if '.ln_' in name or 'ln_f' in name:
                p.add_(0.1 * torch.randn_like(p))
            elif name.endswith('.bias'):
                p.normal_(0.0, 0.02)
    return model.eval()


def load_hf(hf_dir):
    from transformers import GPT2LMHeadModel
    hf, loading = GPT2LMHeadModel.from_pretrained(hf_dir, output_loading_info=True)
    # nothing missing (lm_head comes from the tie), nothing unexpected
    assert not loading['missing_keys'] and not loading['unexpected_keys'] and not loading['mismatched_keys'], loading
    return hf.eval()


@pytest.mark.parametrize('bias,gelu', [(True, 'tanh'), (False, 'none')])
def test_export_reimport_and_transformers_logits(tmp_path, bias, gelu):
    model = tiny_gpt(bias=bias, gelu=gelu)
    hf_dir = str(tmp_path / 'hf')
    export(model, {'kind': 'gpt2'}, hf_dir)

    cfg = json.load(open(os.path.join(hf_dir, 'config.json')))
    assert cfg['vocab_size'] == 50304 and cfg['n_positions'] == 64 and cfg['n_layer'] == 2
    assert cfg['activation_function'] == EXPORT_ACTIVATIONS[gelu]
    assert cfg['tie_word_embeddings'] is True

    idx = torch.randint(0, 50257, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, _ = model(idx, idx)  # with targets: logits of every position
        # re-import through the same mapping table: identical weights, identical logits
        back = GPT.from_pretrained(hf_dir).eval()
        assert back.config.vocab_size == 50304 and back.config.gelu == gelu
        torch.testing.assert_close(back(idx, idx)[0], ours, rtol=0, atol=0)
        # transformers' own implementation on the exported directory
        hf = load_hf(hf_dir)
        torch.testing.assert_close(hf(idx).logits, ours, rtol=1e-5, atol=1e-5)
        if not bias:
            sd = hf.state_dict()
            assert torch.count_nonzero(sd['transformer.h.0.attn.c_attn.bias']) == 0
            assert torch.count_nonzero(sd['transformer.ln_f.bias']) == 0

    # the same greedy continuation (ours: top_k=1 leaves only the argmax to sample)
    prompt = idx[:1, :8]
    with torch.no_grad():
        ours_gen = model.generate(prompt, 12, top_k=1)
        hf_gen = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, do_sample=False,
                             pad_token_id=50256)
    assert torch.equal(ours_gen, hf_gen)


def test_conv1d_layout_and_zero_biases():
    from transformers import GPT2LMHeadModel
    model = tiny_gpt(bias=False, gelu='none')
    sd = hf_state_dict(model)
    C = model.config.n_embd
    # Conv1D stores (in, out): the transpose of nn.Linear's (out, in)
    assert sd['transformer.h.1.attn.c_attn.weight'].shape == (C, 3 * C)
    assert torch.equal(sd['transformer.h.1.mlp.c_fc.weight'], model.transformer.h[1].mlp.c_fc.weight.t())
    assert sd['transformer.h.1.mlp.c_fc.bias'].shape == (4 * C,)
    assert sd['transformer.h.0.ln_1.bias'].shape == (C,)
    # bias=False: the biases GPT-2 has anyway are zeros, so they change nothing
    for name in ('transformer.h.1.mlp.c_fc.bias', 'transformer.h.0.ln_1.bias', 'transformer.h.0.attn.c_proj.bias',
                 'transformer.ln_f.bias'):
        assert torch.count_nonzero(sd[name]) == 0, name
    assert 'lm_head.weight' not in sd  # tied to wte
    assert all(t.is_contiguous() for t in sd.values())
    # exactly the tensors (names and shapes) of transformers' GPT-2 with the exported config, bar the tied head
    theirs = {k: v.shape for k, v in GPT2LMHeadModel(hf_config(model.config)).state_dict().items()}
    assert {k: v.shape for k, v in sd.items()} == {k: v for k, v in theirs.items() if k != 'lm_head.weight'}
    # the export names are the inverse of the import's
    assert all(HF_ACTIVATIONS[v] == k for k, v in EXPORT_ACTIVATIONS.items())


@pytest.mark.slow
def test_cli_export_gpt2_tokenizer_and_pipeline(tmp_path):
    """ End to end: a checkpoint -> export_hf.py -> AutoTokenizer + pipeline('text-generation'), offline. """
    from transformers import AutoTokenizer, pipeline
    model = tiny_gpt(vocab_size=50257)
    out_dir, hf_dir = tmp_path / 'out', tmp_path / 'hf'
    save_test_checkpoint(model, GPT2Tokenizer().meta(), os.path.join(out_dir, 'ckpt.pt'))
    r = subprocess.run([sys.executable, 'export_hf.py', f'--out_dir={out_dir}', f'--hf_dir={hf_dir}'],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    line = json.loads(r.stdout.strip().splitlines()[-1])
    assert line['hf_dir'] == str(hf_dir) and line['files'] == sorted(os.listdir(hf_dir))
    expected = {'config.json', 'model.safetensors', 'vocab.json', 'merges.txt', 'tokenizer.json', 'README.md'}
    assert expected <= set(line['files'])
    assert f"source: `{os.path.join(out_dir, 'ckpt.pt')}`" in open(os.path.join(hf_dir, 'README.md')).read()

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    assert tok.encode("Hello world") == [15496, 995]
    text = "The quick brown fox, 1234 ünïcödé <|endoftext|>"
    assert tok.encode(text) == GPT2Tokenizer().encode(text)
    assert tok.eos_token_id == 50256

    gen = pipeline('text-generation', model=str(hf_dir), device='cpu')
    out = gen("Hello world", max_new_tokens=6, do_sample=False)[0]['generated_text']
    # the pipeline's greedy text is our greedy continuation, decoded
    prompt = torch.tensor([[15496, 995]])
    with torch.no_grad():
        ours = model.generate(prompt, 6, top_k=1)[0].tolist()
    assert out == GPT2Tokenizer().decode(ours)


def test_char_model_export_with_char_tokenizer(tmp_path):
    from transformers import AutoTokenizer
    tok = CharTokenizer.from_text("hello world\nthe quick brown fox é!")
    model = tiny_gpt(vocab_size=tok.vocab_size, block_size=32)
    hf_dir = str(tmp_path / 'hf')
    export(model, tok.meta(), hf_dir)
    cfg = json.load(open(os.path.join(hf_dir, 'config.json')))
    assert cfg['vocab_size'] == tok.vocab_size and cfg['eos_token_id'] is None
    assert 'character level' in open(os.path.join(hf_dir, 'README.md')).read()

    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    text = "the fox\né hello!"
    ids = hf_tok.encode(text)
    assert ids == tok.encode(text)
    assert hf_tok.decode(ids) == text

    idx = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(load_hf(hf_dir)(idx).logits, model(idx, idx)[0], rtol=1e-5, atol=1e-5)

    # our scripts loading the exported directory decode with the character vocabulary, not GPT-2 BPE
    _, tokenizer_meta, _ = init_model(hf_dir)
    assert tokenizer_meta['kind'] == 'char'
    assert load_tokenizer(tokenizer_meta).encode(text) == tok.encode(text)
