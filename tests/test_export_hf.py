"""
export_hf.py: a checkpoint -> export_hf.py -> AutoTokenizer + pipeline('text-generation'), offline; and a config
that is not ours refused.
"""
import json
import os

import pytest
import torch

from helpers import run_python, save_test_checkpoint, tiny_gpt
from nanogpt_plus.errors import UserError
from nanogpt_plus.hf_export import export
from nanogpt_plus.init_from import init_model
from nanogpt_plus.tokenizer import GPT2Tokenizer


def test_cli_export_gpt2_tokenizer_and_pipeline(tmp_path):
    """ End to end: a checkpoint -> export_hf.py -> AutoTokenizer + pipeline('text-generation'), offline. """
    from transformers import AutoTokenizer, pipeline
    model = tiny_gpt(vocab_size=50257)
    out_dir = tmp_path / 'out'
    hf_dir = tmp_path / 'hf'
    save_test_checkpoint(model, GPT2Tokenizer().meta(), os.path.join(out_dir, 'ckpt.pt'))
    r = run_python(['export_hf.py', f'--out_dir={out_dir}', f'--hf_dir={hf_dir}'], timeout=120)
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


def test_custom_export_config_that_is_not_ours_is_refused(tmp_path):
    model = tiny_gpt(pos='rope')
    hf_dir = str(tmp_path / 'hf')
    export(model, {'kind': 'gpt2'}, hf_dir)
    path = os.path.join(hf_dir, 'config.json')
    cfg = json.load(open(path))
    for key, value in (('pos', 'alibi'), ('qk_norm', 'yes'), ('activation_function', 'swiglu')):
        with open(path, 'w') as f:
            json.dump(dict(cfg, **{key: value}), f)
        with pytest.raises(UserError, match=rf"config.json is not one export_hf.py writes \(.*{key}"):
            init_model(hf_dir)
