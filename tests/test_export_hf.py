"""
export_hf.py: a checkpoint -> export_hf.py -> AutoTokenizer + pipeline('text-generation'), offline; and a config
that is not ours refused.
"""
import json
import os

import pytest
import torch

from helpers import assert_one_line_error, run, run_python, save_test_checkpoint, tiny_gpt
from nanogpt_plus.errors import UserError
from nanogpt_plus.hf_export import EXPORT_MARK, export
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


def test_a_hugging_face_folder_this_project_did_not_write_is_replaced_only_with_overwrite(tmp_path, monkeypatch,
                                                                                         capsys):
    from transformers import GPT2Config, GPT2LMHeadModel
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, n_positions=16, vocab_size=64, bos_token_id=0,
                               eos_token_id=0)).save_pretrained(tmp_path / 'userhf')
    (tmp_path / 'userhf' / 'README.md').write_text('my card')
    capsys.readouterr()  # transformers' progress bar
    before = {n: (tmp_path / 'userhf' / n).read_bytes() for n in os.listdir(tmp_path / 'userhf')}
    out_dir = tmp_path / 'out'
    save_test_checkpoint(tiny_gpt(vocab_size=50257), GPT2Tokenizer().meta(), os.path.join(out_dir, 'ckpt.pt'))
    args = [f'--out_dir={out_dir}', f'--hf_dir={tmp_path / "userhf"}']
    code, out, err = run('export_hf.py', monkeypatch, capsys, *args)
    assert_one_line_error(
        code, err, f"--hf_dir={tmp_path / 'userhf'} would write into {tmp_path / 'userhf'}, which holds files and not "
                   f"the mark of an earlier output of this script ({EXPORT_MARK}), so they are not this project's; "
                   f"pass another --hf_dir, or --overwrite=True to write there anyway")
    assert {n: (tmp_path / 'userhf' / n).read_bytes() for n in os.listdir(tmp_path / 'userhf')} == before
    # our own export carries the mark, so exporting there again needs no --overwrite
    for _ in range(2):
        code, out, err = run('export_hf.py', monkeypatch, capsys, f'--out_dir={out_dir}', f'--hf_dir={tmp_path / "hf"}')
        assert code == 0, err
    mark = json.load(open(tmp_path / 'hf' / EXPORT_MARK))
    assert mark == {'written_by': 'nanogpt_plus export_hf.py', 'source': os.path.join(out_dir, 'ckpt.pt')}
    # --overwrite=True: the user's say; the export's files go in, the user's other files stay
    (tmp_path / 'userhf' / 'notes.txt').write_text('mine')
    code, out, err = run('export_hf.py', monkeypatch, capsys, *args, '--overwrite=True')
    assert code == 0 and 'would write into' in err, err
    assert (tmp_path / 'userhf' / 'notes.txt').read_text() == 'mine'
    assert (tmp_path / 'userhf' / 'README.md').read_text() != 'my card'
    assert (tmp_path / 'userhf' / EXPORT_MARK).exists()
