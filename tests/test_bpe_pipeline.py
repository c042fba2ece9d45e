"""
The pipeline with the bpe tokenizer kind: the loader's uint16/uint32 token files, the padded model vocabulary,
train.py -> checkpoint (self-contained) -> sample.py / eval.py / bench.py, tokenizer mismatches refused, llm.c's
uint32 shards, and an exact resume of a 20k-vocabulary model. Datasets come from tests/helpers.py's bpe helpers.
"""
import hashlib
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

import bench
import eval as eval_script
import helpers
import sample
import train
from helpers import (
    bpe_corpus_text,
    iter_losses,
    save_test_checkpoint,
    synthetic_bpe_json,
    train_args,
    write_bpe_dataset,
)
from model import GPT, GPTConfig
from nanogpt_plus.bpe import BPETokenizer, tokenizer_fingerprint
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.dataloader import TokenSource, open_token_file
from nanogpt_plus.dataset import read_dataset_meta, split_files
from nanogpt_plus.dataset.shards import read_header, write_shard
from nanogpt_plus.engine import generate
from nanogpt_plus.errors import UserError
from nanogpt_plus.evaluation import evaluate, periodic, task_examples
from nanogpt_plus.init_from import model_vocab_size
from nanogpt_plus.runtime import run_main

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
# the shortest train.py run
tiny_args = dict(num_threads=1, max_iters=1, eval_interval=1, eval_iters=2)
# one token past 65,535 in synthetic_bpe_json(70000): its three-byte merges come last
HIGH_IDS = "\x00\x00\x01"


def run_script(module, monkeypatch, capsys, *args):
    """ sample.py / eval.py in this process on the CPU; returns what they printed on stdout. """
    helpers.run_script(module, monkeypatch, '--device=cpu', *args)
    return capsys.readouterr().out


@pytest.fixture(scope="module")
def small_bpe(tmp_path_factory):
    """ (a 300-token synthetic BPE, whose vocabulary pads to 320; a dataset of 20,000 characters in it). Its few
    merges join a zero byte with another, so every character beyond ASCII takes several tokens. """
    tok = BPETokenizer(synthetic_bpe_json(300))
    return tok, write_bpe_dataset(tmp_path_factory.mktemp("bpe300"), tok, bpe_corpus_text()[:20000])


@pytest.fixture(scope="module")
def bpe512_run(bpe512, tmp_path_factory):
    """ (tokenizer, out_dir): train.py's checkpoint of a short run on a copy of the bpe512 dataset. """
    tok, data = bpe512
    root = tmp_path_factory.mktemp("bpe512_run")
    shutil.copytree(data, root / "data")
    train.main(train_args(str(root / "data"), root / "out", **tiny_args))
    return tok, str(root / "out")


@pytest.fixture(scope="module")
def uint32_data(tmp_path_factory):
    """ (tokenizer of 70,000 tokens, dataset of raw uint32 train.bin/val.bin, the same tokens as llm.c uint32
    shards with the meta.json and tokenizer.json beside them). The text holds ids past 65,535. """
    tok = BPETokenizer(synthetic_bpe_json(70000))
    text = bpe_corpus_text()[:40000].replace("\n\n", f"\n{HIGH_IDS}\n")
    raw = write_bpe_dataset(tmp_path_factory.mktemp("bpe70k"), tok, text)
    shards = tmp_path_factory.mktemp("bpe70k_shards")
    for split in ("train", "val"):
        write_shard(str(shards / f"mine_{split}_000000.bin"), np.fromfile(os.path.join(raw, f"{split}.bin"),
                                                                        dtype=np.uint32))
    for name in ("meta.json", "tokenizer.json"):
        shutil.copy(os.path.join(raw, name), shards / name)
    return tok, raw, str(shards)


# -----------------------------------------------------------------------------
# the loader's token dtype and the model's vocabulary

def test_raw_token_files_take_their_dtype_from_meta_json(tmp_path):
    ids = np.array([0, 65535, 65536, 123456], dtype=np.uint32)
    ids.tofile(tmp_path / "train.bin")
    # no meta.json: nanoGPT's uint16
    assert open_token_file(str(tmp_path / "train.bin")).dtype == np.uint16
    assert len(open_token_file(str(tmp_path / "train.bin"))) == 8
    # a bpe meta.json: only its "dtype" is read (the tokenizer.json it names is not even opened)
    meta = {"kind": "bpe", "vocab_size": 200000, "dtype": "uint32", "tokenizer_file": "missing.json"}
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    tokens = open_token_file(str(tmp_path / "train.bin"))
    assert tokens.dtype == np.uint32 and tokens.tolist() == ids.tolist()
    assert TokenSource([str(tmp_path / "train.bin")]).read(np.array([0]), np.array([1]), 3).tolist() == \
        [[65535, 65536, 123456]]
    with open(tmp_path / "train.bin", "ab") as f:
        f.write(b"\0\0")  # half a uint32 token more
    with pytest.raises(UserError, match=r"is 18 bytes, not a whole number of uint32 tokens \(4 bytes each\)"):
        open_token_file(str(tmp_path / "train.bin"))
    (tmp_path / "meta.json").write_text(json.dumps(dict(meta, dtype="int64")))
    with pytest.raises(UserError, match="says the token files are 'int64', not one of uint16, uint32"):
        open_token_file(str(tmp_path / "train.bin"))
    # uint16 (or no dtype: nanoGPT's) for a vocabulary past 65,536: the ids were cut, or the file is uint32
    for stated in ({"dtype": "uint16"}, {}):
        (tmp_path / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "dtype"} | stated))
        with pytest.raises(UserError, match="are uint16, but its vocabulary of 200,000 tokens needs uint32"):
            open_token_file(str(tmp_path / "train.bin"))


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


# -----------------------------------------------------------------------------
# checkpoints carry their tokenizer; another tokenizer's dataset is refused

def test_sample_runs_on_a_copied_checkpoint_whose_dataset_is_gone(bpe512_run, tmp_path, monkeypatch, capsys):
    tok, out_dir = bpe512_run
    ckpt = load_checkpoint(os.path.join(out_dir, "ckpt.pt"))
    assert ckpt["model_args"]["vocab_size"] == 512 and ckpt["tokenizer"]["kind"] == "bpe"
    assert tokenizer_fingerprint(ckpt["tokenizer"]["tokenizer_json"]) == tokenizer_fingerprint(tok.json)
    os.makedirs(tmp_path / "elsewhere")
    shutil.copy(os.path.join(out_dir, "ckpt.pt"), tmp_path / "elsewhere" / "ckpt.pt")
    shutil.rmtree(ckpt["config"]["dataset"])
    prompt = "<|endoftext|>Hé 世界"  # 9 tokens, within the model's block_size of 16
    out = run_script(sample, monkeypatch, capsys, f"--init_from={tmp_path / 'elsewhere'}", f"--start={prompt}",
                     "--num_samples=2", "--max_new_tokens=6")
    samples = out.split("number of parameters", 1)[1].split("\n", 1)[1].split(sample.SEPARATOR + "\n")
    # 2 samples
    assert len(samples) == 3 and all(s.startswith(prompt) for s in samples[:2]) and samples[2] == ""
    assert sample.encode_prompt(tok, prompt, 16, 512) == [tok.eot_token] + tok.encode_ordinary(prompt[13:])


def test_a_dataset_of_another_tokenizer_is_refused_and_the_checkpoint_kept(bpe512_run, small_bpe, tiny_dataset,
                                                                            tmp_path, monkeypatch, capsys):
    _, out_dir = bpe512_run
    ckpt_path = os.path.join(out_dir, "ckpt.pt")
    before = hashlib.sha256(open(ckpt_path, "rb").read()).hexdigest()
    _, other_bpe = small_bpe
    cases = [(other_bpe, "resume", out_dir, "is tokenized with another tokenizer.json: bpe (300 tokens), the model "
                                           f"{ckpt_path} with bpe (512 tokens)"),
             (other_bpe, ckpt_path, tmp_path / "new", "another tokenizer.json: bpe (300 tokens)"),
             (tiny_dataset, "resume", out_dir, "is tokenized with char (20 tokens), the model")]
    for data, init_from, out, words in cases:
        args = train_args(data, out, init_from=init_from, **dict(tiny_args, max_iters=4))
        with pytest.raises(SystemExit) as stop:
            run_main(lambda: train.main(args))
        err = capsys.readouterr().err.strip()
        assert stop.value.code == 2 and words in err and len(err.splitlines()) == 1, err
    assert hashlib.sha256(open(ckpt_path, "rb").read()).hexdigest() == before
    # eval.py's loss on another tokenizer's token files: refused too, not a number that means nothing
    with pytest.raises(UserError, match=r"another tokenizer.json: bpe \(300 tokens\), the model .* evaluate it on "):
        run_script(eval_script, monkeypatch, capsys, f"--init_from={out_dir}", "--task=loss", f"--dataset={other_bpe}")


# -----------------------------------------------------------------------------
# sampling: bytes streamed whole, padded ids never drawn

def test_stream_decoder_prints_a_character_split_over_tokens_once_complete(small_bpe):
    tok, _ = small_bpe
    text = "é世🎉a"
    ids = tok.encode(text)
    assert len(ids) == 10  # 2 + 3 + 4 bytes + 'a': each character split into its bytes
    decoder = sample.StreamDecoder(tok)
    pieces = [decoder.feed(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == text and [p for p in pieces if p] == ["é", "世", "🎉", "a"]
    assert tok.encode("<|endoftext|>a") == [tok.eot_token, tok.encode("a")[0]]


def rigged_model(tok, block_size=8):
    """ A random GPT of tok's padded vocabulary whose padded ids (never in the data) have by far the largest
    logits everywhere: ln_f maps every position to one vector v, and the padded rows of wte/lm_head are 10 v. """
    torch.manual_seed(0)
    padded = model_vocab_size(tok.meta(), "here")
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=block_size, vocab_size=padded, bias=True))
    with torch.no_grad():
        model.transformer.ln_f.weight.zero_()
        model.transformer.ln_f.bias.fill_(1.0)
        model.lm_head.weight[tok.vocab_size:] = 10.0
    return model.eval()


def test_padded_ids_are_never_sampled(small_bpe, tmp_path, monkeypatch, capsys):
    tok, data = small_bpe
    model = rigged_model(tok)
    assert model.config.vocab_size == 320
    # the rig works: without the tokenizer's vocab_size every drawn token would be a padded id
    unrestricted = generate(model, torch.tensor([[tok.eot_token]]), 4, temperature=1.0)
    assert (unrestricted[0, 1:] >= tok.vocab_size).all()
    save_test_checkpoint(model, tok.meta(), tmp_path / "ckpt.pt", dataset=data)
    drawn = []

    def recording_stream(*args, **kwargs):
        for tokens in sample_stream(*args, **kwargs):
            drawn.extend(tokens.tolist())
            yield tokens
    sample_stream = sample.generate_stream
    monkeypatch.setattr(sample, "generate_stream", recording_stream)
    for mode in ("exact", "fast"):
        for temperature, num_samples in ((1.0, 3), (0.0, 1)):  # num_samples=1: streamed
            run_script(sample, monkeypatch, capsys, f"--init_from={tmp_path / 'ckpt.pt'}", f"--mode={mode}",
                       f"--temperature={temperature}", f"--num_samples={num_samples}", "--max_new_tokens=20",
                       "--top_k=None")
    assert len(drawn) == 2 * (3 + 1) * 20 and max(drawn) < tok.vocab_size
    # train.py's greedy sample while training, from the same weights (init_from the checkpoint)
    drawn_in_loop = []

    def recording_generate(*args, **kwargs):
        out = train_generate(*args, **kwargs)
        drawn_in_loop.extend(out[0].tolist())
        return out
    train_generate = periodic.generate  # train.py's in-loop samples
    monkeypatch.setattr(periodic, "generate", recording_generate)
    # the source model's architecture (a differing one would be refused)
    train.main(train_args(data, tmp_path / "out", init_from=str(tmp_path / "ckpt.pt"), block_size=8, n_layer=1,
                          n_embd=16, sample_interval=1, sample_tokens=12, **dict(tiny_args, max_iters=0)))
    assert "sample 0: " in capsys.readouterr().out
    # the prompt (eot) and 12 tokens
    assert len(drawn_in_loop) == 13 and max(drawn_in_loop) < tok.vocab_size


# -----------------------------------------------------------------------------
# evaluation with a bpe tokenizer

def test_eval_bits_per_byte_and_tasks_with_a_bpe_tokenizer(bpe512, tmp_path, monkeypatch, capsys):
    tok, data = bpe512
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=32, vocab_size=512)).eval()
    save_test_checkpoint(model, read_dataset_meta(data), tmp_path / "ckpt.pt", dataset=data)
    out = run_script(eval_script, monkeypatch, capsys, f"--init_from={tmp_path / 'ckpt.pt'}", "--task=loss",
                     "--batch_size=64")
    metrics = json.loads(out.strip().splitlines()[-1])["metrics"]
    val = np.fromfile(os.path.join(data, "val.bin"), dtype=np.uint16)
    # every target of the non-overlapping windows: all tokens but the first
    text = tok.decode(val[1:])
    assert "\ufffd" not in text and metrics["tokens"] == len(val) - 1
    assert metrics["bytes"] == len(text.encode("utf-8")) > metrics["tokens"]
    nll = metrics["loss"] * metrics["tokens"]
    assert metrics["bits_per_byte"] == pytest.approx(nll / math.log(2) / metrics["bytes"], rel=1e-9)
    # HellaSwag's and LAMBADA's text encoded with the bpe tokenizer
    hellaswag = tmp_path / "hs.jsonl"
    lambada = tmp_path / "lambada.jsonl"
    record = {"ctx": "Ελλάδα naïve", "endings": ["façade 🎉", "東京 データ"], "label": 1}
    hellaswag.write_text(json.dumps(record) + "\n")
    lambada.write_text(json.dumps({"text": "Москва kalo 世界"}) + "\n")
    (rows, offsets, labels), n = task_examples("hellaswag", str(hellaswag), tok, 64)
    assert n == 1 and labels == [1] and rows[1] == (tok.encode_ordinary("Ελλάδα naïve") +
                                                    tok.encode_ordinary(" 東京 データ"),
                                                    len(tok.encode_ordinary(" 東京 データ")))
    (rows, _), _ = task_examples("lambada", str(lambada), tok, 64)
    assert rows[0][0] == tok.encode_ordinary("Москва kalo") + tok.encode_ordinary(" 世界")
    for task, path, keys in (("hellaswag", hellaswag, {"acc", "acc_norm"}), ("lambada", lambada, {"acc", "ppl"})):
        result = evaluate(model, task, tok.meta(), data_file=str(path), batch_size=4)
        assert result["num_examples"] == 1 and set(result["metrics"]) == keys


# -----------------------------------------------------------------------------
# uint32 end to end: vocabularies past 65,536

def test_uint32_dataset_trains_evaluates_and_benches(uint32_data, tmp_path, monkeypatch, capsys):
    tok, data, _ = uint32_data
    assert json.load(open(os.path.join(data, "meta.json")))["dtype"] == "uint32"
    source = TokenSource(split_files(data, "train"))
    assert int(source.tokens(0).max()) == tok.encode_ordinary(HIGH_IDS)[0] > 65535
    train.main(train_args(data, tmp_path / "out", **tiny_args))
    out = capsys.readouterr().out
    assert "found vocab_size = 70000" in out and "padded vocab_size to 70,016" in out
    losses = iter_losses(out)
    assert set(losses) == {0, 1} and all(math.isfinite(v) for v in losses.values())
    assert load_checkpoint(str(tmp_path / "out" / "ckpt.pt"))["model_args"]["vocab_size"] == 70016
    result = run_script(eval_script, monkeypatch, capsys, f"--init_from={tmp_path / 'out'}", "--task=loss",
                        "--batch_size=64", "--max_examples=8")
    metrics = json.loads(result.strip().splitlines()[-1])["metrics"]
    assert metrics["tokens"] == 8 * 16 and math.isfinite(metrics["bits_per_byte"])
    bench.main(["--device=cpu", f"--dataset={data}", "--n_layer=1", "--n_head=2", "--n_embd=16", "--block_size=16",
                "--batch_size=4", "--burnin=1", "--steps=2", "--num_threads=1"])
    assert "time per iteration: " in capsys.readouterr().out


def test_uint32_llmc_shards_train(uint32_data, tmp_path, capsys):
    tok, raw, shards = uint32_data
    header = read_header(os.path.join(shards, "mine_train_000000.bin"))
    assert (header.magic, header.version, header.dtype) == (20240801, 7, np.uint32)
    assert open_token_file(header.path).tolist() == open_token_file(os.path.join(raw, "train.bin")).tolist()
    train.main(train_args(shards, tmp_path / "out", data_order="sequential", **tiny_args))
    out = capsys.readouterr().out
    assert "padded vocab_size to 70,016" in out and set(iter_losses(out)) == {0, 1}


def test_uint32_ids_beyond_the_vocabulary_are_refused(uint32_data, tmp_path):
    _, data, _ = uint32_data
    bad = tmp_path / "bad"
    shutil.copytree(data, bad)
    np.array([1, 2, 100000] * 100, dtype=np.uint32).tofile(bad / "train.bin")
    with pytest.raises(UserError, match=r"train.bin holds token ids up to 100000, beyond the model's vocab_size "
                                        r"\(70016\)"):
        train.main(train_args(str(bad), tmp_path / "out", **tiny_args))


# -----------------------------------------------------------------------------
# exact resume with a large vocabulary

def test_a_20k_vocabulary_model_resumes_exactly(tmp_path, capsys):
    tok = BPETokenizer(synthetic_bpe_json(20000))
    data = write_bpe_dataset(tmp_path / "bpe20k", tok, bpe_corpus_text()[:30000])
    run = dict(num_threads=1, dropout=0.1, max_iters=6, eval_interval=3, lr_decay_iters=6, eval_iters=2)

    def losses(out_dir, **settings):
        train.main(train_args(data, out_dir, **dict(run, **settings)))
        return iter_losses(capsys.readouterr().out)
    full = losses(tmp_path / "full")
    first = losses(tmp_path / "split", max_iters=3)  # its final checkpoint holds 4 steps
    second = losses(tmp_path / "split", init_from="resume")
    assert min(second) == 4 and {**first, **second} == full
    a, b = (load_checkpoint(str(tmp_path / d / "ckpt.pt"))["model"] for d in ("full", "split"))
    assert a["lm_head.weight"].shape[0] == 20032 and all(torch.equal(a[k], b[k]) for k in a)
