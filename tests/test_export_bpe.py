"""
bpe models through export_hf.py and finetune.py: the exported directory holds the model's own tokenizer.json,
so transformers (AutoTokenizer, GPT2LMHeadModel.generate, pipeline) encodes and generates exactly like we do,
offline; ids past the tokenizer's (a padded vocab_size) are never generated, by transformers either;
sample.py --init_from=<exported dir> gets the bpe tokenizer back; a bpe model fine-tunes (Start/Delim/Extract
after its padded vocabulary) and its fine-tuned checkpoint still samples.

Usage:
    python -m pytest tests/test_export_bpe.py -q
"""
import contextlib
import io
import json
import os
import runpy
import shutil
import sys

import pytest
import torch

import export_hf
import finetune
import sample
from helpers import REPO, bpe_corpus_text, run_script, save_test_checkpoint, train_args
from model import GPT, GPTConfig
from nanogpt_plus.bpe import EOT_TEXT
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.engine import generate
from nanogpt_plus.errors import TokenizerError, UserError
from nanogpt_plus.hf_export import export
from nanogpt_plus.hf_import import HF_TOKENIZER_META
from nanogpt_plus.init_from import init_model, model_from_checkpoint
from nanogpt_plus.tokenizer import load_tokenizer
from test_finetune import SINGLE, config, make_task, val_accuracy

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# the bpe512 tokenizer's 512 tokens and 64 rows of padding, as a vocab padded for speed has
PADDED_VOCAB = 576
# accents (é also as e + combining accent), CJK, emoji, Greek, Cyrillic, tabs, runs of spaces, a no-break space
MIXED = "naïve façade, 世界 東京 データ 🎉🚀 Ελλάδα Москва\n\ttabs  and  spaces \u00a0é (e\u0301) 😀!"
PROMPT = "Kalo mi té"


def bpe_gpt(scale, seed=0, vocab_size=PADDED_VOCAB):
    """
    A tiny GPT with PADDED_VOCAB rows. scale: the std of its weight matrices; at 1.0 (against GPT-2's 0.02) a
    random model's greedy text is varied (no token repeated over and over) and its top two logits stay well
    apart (>= 0.05 here, against ~1e-6 between our kernels and transformers'), so equal greedy tokens mean
    equal models, not luck.
    """
    torch.manual_seed(seed)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=64, vocab_size=vocab_size, bias=True))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, scale)
            elif name.endswith('.bias'):
                p.normal_(0.0, 0.1)
            else:  # LayerNorm weights: random too, so a dropped or misplaced one shows
                p.add_(0.1 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope='module')
def exported(bpe512, tmp_path_factory):
    """ (tokenizer, model, checkpoint path, export_hf.py's directory and printed lines) of a bpe model. """
    tok = bpe512[0]
    root = tmp_path_factory.mktemp('bpe_export')
    model = bpe_gpt(scale=1.0)
    ckpt = save_test_checkpoint(model, tok.meta(), root / 'out' / 'ckpt.pt')
    hf_dir = str(root / 'hf')
    printed = io.StringIO()  # capsys is function-scoped; this fixture is the module's
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(printed):
        run_script(export_hf, mp, f'--init_from={ckpt}', f'--hf_dir={hf_dir}')
    return tok, model, ckpt, hf_dir, printed.getvalue().splitlines()


def greedy_ids(model, prompt_ids, n, vocab_size):
    """ Our greedy continuation (the engine, temperature=0, only the tokenizer's ids) of prompt_ids. """
    with torch.no_grad():
        return generate(model, torch.tensor([prompt_ids]), n, temperature=0, vocab_size=vocab_size)[0].tolist()


def hf_model(hf_dir):
    from transformers import GPT2LMHeadModel
    return GPT2LMHeadModel.from_pretrained(hf_dir).eval()


def hf_greedy(hf, prompt_ids, n, **kw):
    idx = torch.tensor([prompt_ids])
    with torch.no_grad():
        return hf.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, do_sample=False,
                           **kw)[0].tolist()


# -----------------------------------------------------------------------------
# the exported directory

def test_export_writes_the_models_tokenizer_json(exported):
    tok, model, ckpt, hf_dir, lines = exported
    files = json.loads(lines[-1])['files']
    assert {'config.json', 'generation_config.json', 'model.safetensors', 'tokenizer.json', 'tokenizer_config.json',
            HF_TOKENIZER_META, 'README.md'} == set(files)
    with open(os.path.join(hf_dir, 'tokenizer.json'), encoding='utf-8') as f:
        assert f.read() == tok.json  # byte for byte the tokenizer the model was trained with
    cfg = json.load(open(os.path.join(hf_dir, 'config.json')))
    assert cfg['vocab_size'] == PADDED_VOCAB and cfg['bos_token_id'] == cfg['eos_token_id'] == tok.eot_token
    settings = json.load(open(os.path.join(hf_dir, 'tokenizer_config.json')))
    assert settings['eos_token'] == settings['bos_token'] == EOT_TEXT and settings['model_max_length'] == 64
    gen = json.load(open(os.path.join(hf_dir, 'generation_config.json')))
    assert gen['suppress_tokens'] == list(range(tok.vocab_size, PADDED_VOCAB))
    assert gen['eos_token_id'] == tok.eot_token
    readme = open(os.path.join(hf_dir, 'README.md'), encoding='utf-8').read()
    assert 'byte-level BPE of 512 tokens' in readme and 'AutoTokenizer.from_pretrained' in readme
    # our own description names the file instead of holding a second copy
    meta = json.load(open(os.path.join(hf_dir, HF_TOKENIZER_META)))
    assert meta['kind'] == 'bpe' and 'tokenizer_json' not in meta and meta['tokenizer_file'] == 'tokenizer.json'
    _, back, _ = init_model(hf_dir)
    assert back == dict(meta, tokenizer_json=tok.json)


def test_auto_tokenizer_encodes_and_decodes_like_ours(exported):
    from transformers import AutoTokenizer
    tok, _, _, hf_dir, _ = exported
    hf_tok = AutoTokenizer.from_pretrained(hf_dir)
    for text in (bpe_corpus_text()[:2000], MIXED):
        ids = tok.encode_ordinary(text)
        assert hf_tok.encode(text) == ids
        assert hf_tok.decode(ids) == text
    # the end-of-text marker in a text is the special token, as in our encode (a prompt's)
    assert hf_tok.encode("ka" + EOT_TEXT + "lo") == tok.encode("ka" + EOT_TEXT + "lo")
    assert hf_tok.eos_token_id == hf_tok.bos_token_id == tok.eot_token
    assert len(hf_tok) == tok.vocab_size


def test_transformers_greedy_equals_ours(exported):
    from transformers import pipeline
    tok, model, _, hf_dir, _ = exported
    prompt = tok.encode(PROMPT)
    ours = greedy_ids(model, prompt, 30, tok.vocab_size)
    # a varied continuation (not one token repeated), and no <|endoftext|>, where transformers would stop
    assert len(set(ours[len(prompt):])) > 10 and tok.eot_token not in ours
    assert hf_greedy(hf_model(hf_dir), prompt, 30) == ours
    gen = pipeline('text-generation', model=hf_dir, device='cpu')
    out = gen(PROMPT, max_new_tokens=30, do_sample=False, return_tensors=True)
    assert out[0]['generated_token_ids'] == ours
    assert gen(PROMPT, max_new_tokens=30, do_sample=False)[0]['generated_text'] == tok.decode(ours)


def test_sample_from_the_exported_directory_equals_the_checkpoint(exported, monkeypatch, capsys):
    tok, model, ckpt, hf_dir, _ = exported
    texts = {}
    for source in (ckpt, hf_dir):
        run_script(sample, monkeypatch, f'--init_from={source}', f'--start={PROMPT}', '--temperature=0',
                   '--num_samples=2', '--max_new_tokens=30', '--device=cpu')
        texts[source] = capsys.readouterr().out
    expected = tok.decode(greedy_ids(model, tok.encode(PROMPT), 30, tok.vocab_size))
    for text in texts.values():  # after the lines that say what was loaded, the two samples
        assert text.endswith("\n" + f"{expected}\n{sample.SEPARATOR}\n" * 2)


def test_padded_ids_are_never_generated(bpe512, tmp_path):
    """ The padded rows made the most likely tokens: transformers still generates only the tokenizer's ids. """
    from transformers import pipeline
    tok = bpe512[0]
    model = bpe_gpt(scale=0.3, seed=1)
    with torch.no_grad():
        # ln_f's output leans towards u and the padded rows are u: their logits beat every real token's
        u = torch.nn.functional.normalize(torch.randn(32), dim=0)
        model.transformer.ln_f.bias.copy_(5 * u)
        model.transformer.wte.weight[tok.vocab_size:] = 3 * u
    hf_dir = export(model, tok.meta(), str(tmp_path / 'hf'))
    hf = hf_model(hf_dir)
    prompt = tok.encode(PROMPT)
    # generation_config.json's suppression turned off
    free = hf_greedy(hf, prompt, 20, suppress_tokens=None)
    assert all(t >= tok.vocab_size for t in free[len(prompt):])
    ours = greedy_ids(model, prompt, 20, tok.vocab_size)
    assert hf_greedy(hf, prompt, 20) == ours and max(ours) < tok.vocab_size
    gen = pipeline('text-generation', model=hf_dir, device='cpu')
    out = gen(PROMPT, max_new_tokens=20, do_sample=False, return_tensors=True)
    assert out[0]['generated_token_ids'] == ours


def test_a_replaced_tokenizer_json_is_refused(exported, tmp_path):
    tok, _, _, hf_dir, _ = exported
    copy = shutil.copytree(hf_dir, tmp_path / 'hf')
    spec = json.loads(tok.json)
    # same tokens, re-saved
    (copy / 'tokenizer.json').write_text(json.dumps(spec, indent=4), encoding='utf-8')
    with pytest.raises(TokenizerError, match="not the tokenizer .* was exported with.*re-export"):
        init_model(str(copy))


# -----------------------------------------------------------------------------
# fine-tuning a bpe model

@pytest.mark.parametrize('source', ['checkpoint', 'exported'])
def test_finetune_a_bpe_model_then_sample_it(bpe512, tmp_path, monkeypatch, capsys, source):
    tok = bpe512[0]
    model = bpe_gpt(scale=0.02)
    init_from = save_test_checkpoint(model, tok.meta(), tmp_path / 'src' / 'ckpt.pt')
    if source == 'exported':
        init_from = export(model, tok.meta(), str(tmp_path / 'hf'))
    train, val = make_task(tmp_path, 'classification', n_train=32, n_val=8)
    res = finetune.finetune(config(task='classification', init_from=init_from, out_dir=str(tmp_path / 'ft'),
                                   train_file=train, val_file=val, epochs=1), SINGLE)
    capsys.readouterr()
    ckpt = load_checkpoint(str(tmp_path / 'ft' / 'ckpt.pt'))
    assert load_tokenizer(ckpt['tokenizer']).json == tok.json
    # the special tokens come after the padded rows: no id the tokenizer has, none of the padding
    assert ckpt['special_tokens'] == {'start': PADDED_VOCAB, 'delim': PADDED_VOCAB + 1, 'extract': PADDED_VOCAB + 2}
    assert ckpt['model_args']['vocab_size'] == PADDED_VOCAB + 3
    assert res['steps'] == 2 and res['val_acc'] == pytest.approx(val_accuracy(ckpt, val, 'classification'))
    # the fine-tuned GPT samples the tokenizer's ids only (not the padding, not Start/Delim/Extract)
    run_script(sample, monkeypatch, f"--init_from={tmp_path / 'ft' / 'ckpt.pt'}", f'--start={PROMPT}',
               '--temperature=0', '--num_samples=2', '--max_new_tokens=20', '--device=cpu')
    out = capsys.readouterr().out
    ours = greedy_ids(model_from_checkpoint(ckpt).eval(), tok.encode(PROMPT), 20, tok.vocab_size)
    assert out.endswith("\n" + f"{tok.decode(ours)}\n{sample.SEPARATOR}\n" * 2)


def test_finetune_from_scratch_uses_the_bpe_dataset(bpe512, tmp_path):
    tok, data = bpe512
    train, val = make_task(tmp_path, 'classification', n_train=32, n_val=8)
    finetune.finetune(config(task='classification', init_from='scratch', dataset=data, n_layer=1, n_head=2,
                             n_embd=16, block_size=32, out_dir=str(tmp_path / 'ft'), train_file=train, val_file=val,
                             epochs=1), SINGLE)
    ckpt = load_checkpoint(str(tmp_path / 'ft' / 'ckpt.pt'))
    assert ckpt['tokenizer']['kind'] == 'bpe' and ckpt['tokenizer']['tokenizer_json'] == tok.json
    # the dataset's vocabulary, padded (scratch_model)
    model_vocab = ckpt['model_args']['vocab_size'] - 3
    assert model_vocab >= tok.vocab_size and model_vocab % 64 == 0
    assert ckpt['special_tokens'] == {'start': model_vocab, 'delim': model_vocab + 1, 'extract': model_vocab + 2}


def test_a_tokenizer_larger_than_its_model_is_refused(bpe512, tmp_path):
    """ A description of 512 tokens with a 320-row model: its ids would index past the embedding table. """
    tok = bpe512[0]
    model = bpe_gpt(scale=0.02, vocab_size=320)
    with pytest.raises(UserError, match="tokenizer of .* has 512 tokens but its model only 320"):
        export(model, tok.meta(), str(tmp_path / 'hf'))
    init_from = save_test_checkpoint(model, tok.meta(), tmp_path / 'src' / 'ckpt.pt')
    train, _ = make_task(tmp_path, 'classification', n_train=8, n_val=0)
    with pytest.raises(UserError, match="has 512 tokens but its model only 320"):
        finetune.finetune(config(task='classification', init_from=init_from, out_dir=str(tmp_path / 'ft'),
                                 train_file=train), SINGLE)


# -----------------------------------------------------------------------------
# the whole chain, as a user runs it

def test_prepare_train_sample_eval_export_chain(tmp_path, monkeypatch, capsys):
    """ data/text/prepare.py (a 300-token BPE, padded to 320 rows) -> train.py -> sample.py -> eval.py ->
    export_hf.py -> transformers: the same tokenizer and the same greedy tokens at every step. """
    import eval as eval_script
    import train
    corpus = tmp_path / 'corpus'
    corpus.mkdir()
    paragraphs = bpe_corpus_text(n_words=8000).split('\n\n')
    for k in range(4):
        (corpus / f'doc{k}.txt').write_text('\n\n'.join(paragraphs[k::4]), encoding='utf-8')
    data = tmp_path / 'data'
    out = tmp_path / 'out'
    hf_dir = str(tmp_path / 'hf')
    monkeypatch.setattr(sys, 'argv', ['prepare.py', f'--input={corpus}/*.txt', '--tokenizer=bpe', '--vocab_size=300',
                                      f'--out_dir={data}', f'--cache_dir={tmp_path / "cache"}', '--num_proc=1'])
    runpy.run_path(os.path.join(REPO, 'data', 'text', 'prepare.py'), run_name='__main__')
    train.main(train_args(str(data), out, max_iters=12, block_size=64, num_threads=1))
    assert 'padded vocab_size to 320' in capsys.readouterr().out
    tok = load_tokenizer(load_checkpoint(str(out / 'ckpt.pt'))['tokenizer'])
    assert tok.vocab_size == 300 and tok.json == (data / 'tokenizer.json').read_text(encoding='utf-8')

    run_script(sample, monkeypatch, f'--out_dir={out}', f'--start={PROMPT}', '--temperature=0', '--num_samples=1',
               '--max_new_tokens=20', '--device=cpu')
    model = model_from_checkpoint(load_checkpoint(str(out / 'ckpt.pt'))).eval()
    ours = greedy_ids(model, tok.encode(PROMPT), 20, tok.vocab_size)
    assert tok.decode(ours) in capsys.readouterr().out  # sample.py streamed exactly our greedy text
    # each greedy choice clear of the runner-up (0.17 here), far above the ~1e-6 between
    with torch.no_grad():
        logits = model(torch.tensor([ours[:-1]]), torch.tensor([ours[1:]]))[0][0, -20:, :tok.vocab_size]
    # our kernels and transformers': equal tokens below aren't a tie's luck
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-4

    run_script(eval_script, monkeypatch, f'--out_dir={out}', '--task=loss', '--device=cpu')
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])['metrics']
    assert metrics['bytes'] > metrics['tokens'] and 0 < metrics['bits_per_byte'] < 8

    run_script(export_hf, monkeypatch, f'--out_dir={out}', f'--hf_dir={hf_dir}')
    from transformers import AutoTokenizer
    assert hf_greedy(hf_model(hf_dir), tok.encode(PROMPT), 20) == ours
    text = (corpus / 'doc0.txt').read_text(encoding='utf-8')[:3000] + MIXED
    assert AutoTokenizer.from_pretrained(hf_dir).encode(text) == tok.encode_ordinary(text)
