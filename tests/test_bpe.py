"""
nanogpt_plus/bpe.py, the byte-level BPE tokenizer kind ('bpe'): training is deterministic, any text round-trips byte
for byte, the end-of-text token is special only where it should be; a tokenizer.json that would lose text, or that
can't be read, is refused in one line wherever it is read (prepare.py, train.py's set-up, a dataset's meta); and the
kind end to end: checkpoints that carry their tokenizer, another tokenizer's dataset refused, padded ids never
sampled, bits per byte and the tasks in its tokens, uint32 token files and llm.c shards past 65,536 tokens, and an
exact resume of a 20k-vocabulary model. Datasets come from tests/helpers.py's bpe helpers.
"""
import hashlib
import json
import math
import os
import re
import runpy
import shutil
import sys

import numpy as np
import pytest
import torch

import bench
import eval as eval_script
import helpers
import sample
import train
from helpers import (
    REPO,
    bpe_corpus_text,
    iter_losses,
    run_python,
    save_test_checkpoint,
    synthetic_bpe_json,
    train_args,
    write_bpe_dataset,
)
from model import GPT, GPTConfig
from nanogpt_plus import bpe
from nanogpt_plus.bpe import (
    EOT_TEXT,
    MIN_BPE_VOCAB,
    ROUND_TRIP_PROBE,
    BPETokenizer,
    read_tokenizer_file,
    tokenizer_fingerprint,
    train_bpe,
)
from nanogpt_plus.checkpoint import load_checkpoint
from nanogpt_plus.dataloader import TokenSource, open_token_file
from nanogpt_plus.dataset import read_dataset_meta, split_files
from nanogpt_plus.dataset.shards import read_header, write_shard
from nanogpt_plus.engine import generate
from nanogpt_plus.errors import TokenizerError, UserError
from nanogpt_plus.evaluation import evaluate, periodic, task_examples
from nanogpt_plus.init_from import model_vocab_size
from nanogpt_plus.runtime import run_main
from nanogpt_plus.tokenizer import load_tokenizer

MIXED = "Héllo, naïve façade! 世界 データ 🎉🚀 Ελλάδα Москва\n\tend\r\n\x00\x7f tail "


def paragraphs():
    return iter(bpe_corpus_text().split("\n\n"))


def test_training_is_deterministic_and_fills_the_vocabulary(bpe512):
    tok, _ = bpe512
    again = train_bpe(paragraphs(), 512, show_progress=False)
    assert again.json == tok.json
    assert tok.vocab_size == 512
    # the merges were learned from the corpus: its text takes far fewer tokens than bytes
    text = bpe_corpus_text()[:20000]
    assert len(tok.encode_ordinary(text)) < 0.6 * len(text.encode("utf-8"))


@pytest.mark.parametrize("text", [MIXED, bpe_corpus_text()[:5000], "", " ", "🎉" * 7, "\ufffd\U0010ffff"])
def test_any_text_round_trips_byte_for_byte(bpe512, text):
    tok, _ = bpe512
    ids = tok.encode_ordinary(text)
    assert tok.decode(ids) == text
    assert tok.decode_bytes(ids) == text.encode("utf-8")
    assert sum(len(tok.token_bytes(i)) for i in ids) == len(text.encode("utf-8"))
    assert tok.encode_ordinary_batch([text, text]) == [ids, ids]


def test_end_of_text_is_special_in_prompts_only(bpe512):
    tok, _ = bpe512
    assert tok.eot_token == tok.tok.token_to_id(EOT_TEXT) and tok.token_bytes(tok.eot_token) == EOT_TEXT.encode()
    text = f"one{EOT_TEXT}two"
    assert tok.eot_token in tok.encode(text)            # a prompt: the marker is the token
    assert tok.eot_token not in tok.encode_ordinary(text)  # a document: the marker is just text
    assert tok.decode(tok.encode(text)) == text == tok.decode(tok.encode_ordinary(text))


def test_a_split_character_decodes_with_replacement_then_whole(bpe512):
    tok, _ = bpe512
    ids = tok.encode_ordinary("🎉")
    assert len(ids) > 1  # not a merge of this small vocabulary: four byte tokens
    assert tok.decode(ids[:1]) == "\ufffd" and tok.decode(ids) == "🎉"


def test_description_round_trip_and_fingerprint(bpe512):
    tok, _ = bpe512
    # what a checkpoint keeps survives JSON (and torch.save) intact
    meta = json.loads(json.dumps(tok.meta()))
    back = load_tokenizer(meta)
    assert isinstance(back, BPETokenizer) and back.encode_ordinary(MIXED) == tok.encode_ordinary(MIXED)
    reformatted = json.dumps(json.loads(tok.json), indent=4)
    assert tokenizer_fingerprint(reformatted) == tokenizer_fingerprint(tok.json)
    other = train_bpe(paragraphs(), 600, show_progress=False)
    assert tokenizer_fingerprint(other.json) != tokenizer_fingerprint(tok.json)


def test_too_small_and_unfillable_vocabularies_are_refused():
    with pytest.raises(TokenizerError, match=f"vocab_size={MIN_BPE_VOCAB - 1} is smaller"):
        train_bpe(iter(["some text"]), MIN_BPE_VOCAB - 1, show_progress=False)
    with pytest.raises(TokenizerError, match=r"fills only [\d,]+ of the 5,000 tokens"):
        train_bpe(iter(["a small text, a small text"]), 5000, show_progress=False)


def test_a_vocabulary_past_65536_works():
    tok = BPETokenizer(synthetic_bpe_json(70000))
    assert tok.vocab_size == 70000 and tok.eot_token == 256
    text = "\x00" * 9 + MIXED  # the three-byte tokens (ids 65,793 up) begin with two zero bytes
    ids = tok.encode_ordinary(text)
    assert max(ids) > 65535 and tok.decode(ids) == text


def _tokenizer_json_with(bpe512, change):
    spec = json.loads(bpe512[0].json)
    change(spec)
    return json.dumps(spec)


@pytest.mark.parametrize("change, message", [
    (lambda s: s["model"].update(type="WordPiece"), "is a WordPiece tokenizer, not a byte-level BPE"),
    (lambda s: s.update(pre_tokenizer={"type": "Whitespace"}), "not bytes"),
    (lambda s: s["pre_tokenizer"].update(add_prefix_space=True), "puts a space before every text"),
    (lambda s: s.update(normalizer={"type": "NFC"}), "normalizes the text"),
    (lambda s: s.update(added_tokens=[]), "has no <|endoftext|> special token"),
    (lambda s: s.pop("model"), "not a Hugging Face tokenizer.json"),
    (lambda s: s["model"]["vocab"].update({"Ж": 700}), "ids run 0..|not written in the byte-level alphabet"),
])
def test_a_tokenizer_json_that_is_not_byte_level_bpe_is_refused(bpe512, change, message):
    with pytest.raises(TokenizerError, match=message):
        BPETokenizer(_tokenizer_json_with(bpe512, change), name="x/tokenizer.json")


def test_a_corrupt_or_missing_tokenizer_file_is_one_line(tmp_path, bpe512):
    path = tmp_path / "tokenizer.json"
    path.write_text(bpe512[0].json[:1000], encoding="utf-8")
    with pytest.raises(TokenizerError, match="is not valid JSON"):
        read_tokenizer_file(str(path))
    with pytest.raises(TokenizerError, match="no tokenizer file at"):
        read_tokenizer_file(str(tmp_path / "nope.json"))
    path.write_text(bpe512[0].json, encoding="utf-8")
    # a directory holding tokenizer.json
    assert read_tokenizer_file(str(tmp_path)).json == bpe512[0].json


def test_dataset_meta_reads_the_tokenizer_in_and_checks_it(tmp_path, bpe512):
    tok = bpe512[0]
    d = write_bpe_dataset(tmp_path / "ds", tok, MIXED * 20)
    meta = read_dataset_meta(d)
    assert meta["kind"] == "bpe" and meta["tokenizer_json"] == tok.json and meta["dtype"] == "uint16"
    assert meta["tokenizer_sha256"] == hashlib.sha256(tok.json.encode()).hexdigest()
    (tmp_path / "ds" / "tokenizer.json").write_text(tok.json.replace('"ka"', '"kx"'), encoding="utf-8")
    with pytest.raises(TokenizerError, match="its sha256 differs"):
        read_dataset_meta(d)
    (tmp_path / "ds" / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="could not be read"):
        read_dataset_meta(d)


def test_truncation_and_padding_saved_in_the_file_are_ignored(bpe512):
    from tokenizers import Tokenizer
    tok = bpe512[0]
    saved = Tokenizer.from_str(tok.json)
    saved.enable_truncation(max_length=4)
    saved.enable_padding(length=64, pad_id=tok.eot_token, pad_token=EOT_TEXT)
    other = BPETokenizer(saved.to_str())
    ids = tok.encode_ordinary(MIXED)
    assert len(ids) > 4 and other.encode_ordinary(MIXED) == ids and other.encode(MIXED) == tok.encode(MIXED)
    assert other.encode_ordinary_batch([MIXED, "a"]) == [ids, tok.encode_ordinary("a")]


def test_a_description_its_tokenizer_json_contradicts_is_refused(bpe512):
    for key in ("vocab_size", "eot_token"):
        meta = dict(bpe512[0].meta(), **{key: 300})
        with pytest.raises(TokenizerError, match=f"says {key}=300 but its tokenizer.json has {key}="):
            load_tokenizer(meta)


def edited(tokenizer_json, change):
    """ tokenizer_json with change(spec) applied to its parsed form. """
    spec = json.loads(tokenizer_json)
    change(spec)
    return json.dumps(spec)


def before_byte_level(step):
    """ A change putting the pre-tokenizer step `step` before the ByteLevel one (a Sequence of the two). """
    return lambda s: s.update(pre_tokenizer={"type": "Sequence", "pretokenizers": [step, s["pre_tokenizer"]]})


def dataset_with_tokenizer(directory, text, vocab_size=512, eot_token=0):
    """ A bpe dataset's meta files (no token files: read_dataset_meta reads none) naming the tokenizer.json text. """
    directory.mkdir()
    (directory / "tokenizer.json").write_text(text, encoding="utf-8")
    meta = {"kind": "bpe", "vocab_size": vocab_size, "eot_token": eot_token, "tokenizer_file": "tokenizer.json",
            "tokenizer_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "dtype": "uint16"}
    (directory / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    return str(directory)


# -----------------------------------------------------------------------------
# tokenizers that change the text they encode

LOSSY = {
    "whitespace-dropping pre-tokenizer": (before_byte_level({"type": "WhitespaceSplit"}),
                                          "does not give text back byte for byte"),
    "character-removing pre-tokenizer": (before_byte_level({"type": "Split", "pattern": {"Regex": "[\r\t]"},
                                                            "behavior": "Removed", "invert": False}),
                                         "does not give text back byte for byte"),
    "lowercasing normalizer": (lambda s: s.update(normalizer={"type": "Lowercase"}),
                               r"normalizes the text \(Lowercase"),
    "NFKC normalizer": (lambda s: s.update(normalizer={"type": "NFKC"}), r"normalizes the text \(NFKC"),
    "BPE dropout": (lambda s: s["model"].update(dropout=0.1), r"uses BPE dropout \(\"dropout\": 0.1\)"),
    "marked word pieces": (lambda s: s["model"].update(continuing_subword_prefix="##"), "marks pieces of words"),
    "whitespace-swallowing end-of-text": (lambda s: s["added_tokens"][0].update(rstrip=True),
                                          "swallow the whitespace around it"),
}


@pytest.mark.parametrize("case", list(LOSSY))
def test_a_tokenizer_that_changes_text_is_refused_in_one_line(case, bpe512, tmp_path):
    change, message = LOSSY[case]
    lossy = edited(bpe512[0].json, change)
    with pytest.raises(TokenizerError, match=message) as e:
        BPETokenizer(lossy, name="x/tokenizer.json")
    assert str(e.value).startswith("x/tokenizer.json ") and "\n" not in str(e.value)
    assert re.search("pass a|set \"|use --tokenizer=bpe", str(e.value))  # says what to do
    # a dataset prepared with it is refused when it is read (train.py's set-up), naming its tokenizer.json
    directory = dataset_with_tokenizer(tmp_path / "ds", lossy)
    with pytest.raises(TokenizerError, match=message) as e:
        read_dataset_meta(directory)
    assert str(e.value).startswith(str(tmp_path / "ds" / "tokenizer.json"))


def test_the_refusal_shows_where_the_text_changed(bpe512):
    lossy = edited(bpe512[0].json, before_byte_level({"type": "WhitespaceSplit"}))
    with pytest.raises(TokenizerError, match=r"\('  Hello,' came back as 'Hello,Wo'\)"):
        BPETokenizer(lossy)


def test_random_encoding_is_refused_even_when_the_model_section_hides_it(bpe512, monkeypatch):
    # the probe encodes the text several times: dropout gets caught even past the check of the model section
    monkeypatch.setattr(bpe, "_check_bpe_model", lambda model, name: None)
    with pytest.raises(TokenizerError, match="encodes the same text differently from one call to the next"):
        BPETokenizer(edited(bpe512[0].json, lambda s: s["model"].update(dropout=0.1)), name="x/tokenizer.json")


def test_the_probe_holds_every_kind_of_text_that_gets_lost():
    probe = ROUND_TRIP_PROBE
    for piece in ("  ", "   ", "\n", "\r\n", "\n\n", "\t", "é", "e\u0301", "日本語", "🎉", "\u200d", "\u2126",
                  "A", "\ufb01"):
        assert piece in probe, piece
    assert probe.startswith(" ") and probe.endswith("  \n\n") and EOT_TEXT not in probe


def test_prepare_py_refuses_a_lossy_tokenizer_file(bpe512, tmp_path, monkeypatch, capsys):
    path = tmp_path / "lossy.json"
    path.write_text(edited(bpe512[0].json, before_byte_level({"type": "WhitespaceSplit"})), encoding="utf-8")
    (tmp_path / "small.txt").write_text(bpe_corpus_text(300), encoding="utf-8")
    monkeypatch.setattr(sys, "argv", ["prepare.py", f"--input={tmp_path}/small.txt", f"--tokenizer={path}",
                                      f"--out_dir={tmp_path / 'out'}", f"--cache_dir={tmp_path / 'cache'}",
                                      "--num_proc=1"])
    with pytest.raises(SystemExit) as e:
        runpy.run_path(f"{REPO}/data/text/prepare.py", run_name="__main__")
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith(f"error: {path} does not give text back byte for byte")
    assert not (tmp_path / "out").exists()


def test_each_tokenizer_json_text_is_built_and_checked_once(bpe512, tmp_path, monkeypatch):
    checks = []
    check = bpe._check_round_trip
    monkeypatch.setattr(bpe, "_check_round_trip", lambda tok, name: (checks.append(name), check(tok, name)))
    text = json.dumps(json.loads(bpe512[0].json), indent=3)  # a text no other test builds
    (tmp_path / "tokenizer.json").write_text(text, encoding="utf-8")
    tok = read_tokenizer_file(str(tmp_path / "tokenizer.json"))  # prepare.py --tokenizer=PATH
    # its workers, sample.py
    assert load_tokenizer(tok.meta()) is tok and load_tokenizer(tok.meta()) is tok
    assert checks == [str(tmp_path / "tokenizer.json")]


# -----------------------------------------------------------------------------
# malformed tokenizer.json

MALFORMED = {
    "nested too deeply": (lambda good: "[" * 100000 + "]" * 100000, "is not valid JSON"),
    "a deeply nested object": (lambda good: '{"model": ' * 5000 + "1" + "}" * 5000, "is not valid JSON"),
    "a list for the pre-tokenizer": (lambda good: edited(good, lambda s: s.update(pre_tokenizer=[s["pre_tokenizer"]])),
                                     r"its 'pre_tokenizer' is a list"),
    "a string among the pre-tokenizer steps": (
        lambda good: edited(good, lambda s: s.update(pre_tokenizer={"type": "Sequence", "pretokenizers": ["x"]})),
        "its pre-tokenizer step is a str"),
    "a dict for added_tokens": (lambda good: edited(good, lambda s: s.update(added_tokens={EOT_TEXT: 0})),
                                r"its 'added_tokens' is a dict"),
    "a string for the normalizer": (lambda good: edited(good, lambda s: s.update(normalizer="Lowercase")),
                                    r"normalizes the text \(str\)"),
    "a vocab with string ids": (lambda good: edited(good, lambda s: s["model"]["vocab"].update({"!": "1"})),
                                r"is not a valid tokenizer.json \(Exception: invalid type: string"),
    "a vocab with fractional ids": (lambda good: edited(good, lambda s: s["model"]["vocab"].update({"!": 1.5})),
                                    r"is not a valid tokenizer.json \(Exception: invalid type: floating point"),
    "no merges": (lambda good: edited(good, lambda s: s["model"].pop("merges")), "Missing vocab/merges"),
    "no model type": (lambda good: edited(good, lambda s: s["model"].pop("type")), "no 'type' in 'model'"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_tokenizer_json_is_one_line_wherever_it_is_read(case, bpe512, tmp_path):
    make, message = MALFORMED[case]
    text = make(bpe512[0].json)
    path = tmp_path / "bad.json"
    path.write_text(text, encoding="utf-8")
    for read in (lambda: BPETokenizer(text, name=str(path)), lambda: read_tokenizer_file(str(path))):
        with pytest.raises(TokenizerError, match=message) as e:
            read()
        assert str(e.value).startswith(f"{path} ") and "\n" not in str(e.value)
    # read_named_tokenizer (a dataset's, an exported model's tokenizer.json) builds and checks what it reads
    with pytest.raises(TokenizerError, match=message) as e:
        read_dataset_meta(dataset_with_tokenizer(tmp_path / "ds", text))
    assert str(e.value).startswith(str(tmp_path / "ds" / "tokenizer.json")) and "\n" not in str(e.value)


def bad_dataset(tmp_path, bpe512, case):
    """ A bpe dataset train.py must refuse: its meta.json contradicts its tokenizer.json, or that loses text. """
    directory = write_bpe_dataset(tmp_path / case, bpe512[0], bpe_corpus_text(3000))
    meta_path = tmp_path / case / "meta.json"
    tokenizer_path = tmp_path / case / "tokenizer.json"
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if case == "contradicted":
        meta["vocab_size"] = 600
    else:
        lossy = edited(bpe512[0].json, before_byte_level({"type": "WhitespaceSplit"}))
        tokenizer_path.write_text(lossy, encoding="utf-8")
        meta["tokenizer_sha256"] = hashlib.sha256(lossy.encode("utf-8")).hexdigest()
    meta_path.write_text(json.dumps(meta), encoding="utf-8")
    return directory


@pytest.mark.parametrize("case, message", [("contradicted", "meta.json says vocab_size=600 but its tokenizer.json"),
                                           ("lossy", "tokenizer.json does not give text back byte for byte")])
def test_train_py_stops_at_set_up_in_one_line(case, message, bpe512, tmp_path):
    directory = bad_dataset(tmp_path, bpe512, case)
    r = run_python(["train.py", f"--dataset={directory}", "--device=cpu", "--n_layer=1",
                        "--n_head=1", "--n_embd=8", "--block_size=8", "--batch_size=2", "--max_iters=1",
                        f"--out_dir={tmp_path / 'out'}"], timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: {directory}/") and message in last, last
    assert "prepare.py" in last or "--tokenizer=bpe" in last, last  # and what to do
    assert not (tmp_path / "out" / "ckpt.pt").exists()


# the shortest train.py run
tiny_args = dict(num_threads=1, max_iters=1, eval_interval=1, eval_iters=2)


# one token past 65,535 in synthetic_bpe_json(70000): its three-byte merges come last
HIGH_IDS = "\x00\x00\x01"


def run_script(module, monkeypatch, capsys, *args):
    """ sample.py / eval.py in this process on the CPU; returns what they printed on stdout. """
    helpers.run_script(module, monkeypatch, '--device=cpu', *args)
    return capsys.readouterr().out


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
# checkpoints carry their tokenizer; another tokenizer's dataset is refused

@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
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

@pytest.mark.usefixtures('one_thread')
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

@pytest.mark.usefixtures('one_thread')
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


@pytest.mark.usefixtures('one_thread')
def test_uint32_llmc_shards_train(uint32_data, tmp_path, capsys):
    tok, raw, shards = uint32_data
    header = read_header(os.path.join(shards, "mine_train_000000.bin"))
    assert (header.magic, header.version, header.dtype) == (20240801, 7, np.uint32)
    assert open_token_file(header.path).tolist() == open_token_file(os.path.join(raw, "train.bin")).tolist()
    train.main(train_args(shards, tmp_path / "out", data_order="sequential", **tiny_args))
    out = capsys.readouterr().out
    assert "padded vocab_size to 70,016" in out and set(iter_losses(out)) == {0, 1}


@pytest.mark.usefixtures('one_thread')
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

@pytest.mark.usefixtures('one_thread')
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
