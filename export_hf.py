"""
Export a trained model to a Hugging Face transformers directory: config.json, model.safetensors,
generation_config.json and the tokenizer files, so that AutoModelForCausalLM / AutoTokenizer /
pipeline("text-generation") load it offline. A model of GPT-2's architecture (ReLU^2 and an untied
head included) exports as transformers' own GPT2LMHeadModel (Conv1D layout); one with rotary
positions, RMSNorm, QK-norm or a logit soft cap as model_type 'nanogpt', its code beside it
(modeling_nanogpt.py around an unchanged model.py), loaded with trust_remote_code=True. Tokenizer:
GPT-2's files for GPT-2 BPE models, the model's own tokenizer.json for a bpe model (the one its
dataset was prepared with), a small character tokenizer.json for a character-level model. Ids the
model has beyond its tokenizer's (vocab_size padded to a multiple of 64) are never generated, by our
sampler or by transformers (generation_config.json's suppress_tokens).

Usage:
    python export_hf.py --out_dir=out --hf_dir=out/hf
    python -c "from transformers import pipeline; print(pipeline('text-generation', model='out/hf')('Hello')[0])"
    lm_eval --model hf --model_args pretrained=out/hf,trust_remote_code=True --tasks lambada_openai   # docs/export.md

hf_dir may be new, empty or an earlier export (it holds nanogpt_plus_export.json, the mark every export
leaves), which is replaced whole: the new export is built beside it and swapped in, so a failure or a
signal leaves the earlier one exactly as it was. A directory holding a checkpoint, a dataset's files
or other files (a Hugging Face folder of your own), or the model's own directory, is refused unless
--overwrite=True.

weights=bfloat16 stores the weights rounded to bfloat16 (half the file; config.json says so, and
transformers loads them as bfloat16 unless told otherwise); the default float32 is exact.

GPT-2's form maps the weights with model.hf_key_map, the same table GPT.from_pretrained imports
with;
--init_from=out/hf reads either form back exactly (nanogpt_plus/hf_import.py).
"""
# first, before torch is imported (seconds): from here on a signal stops the work in one line and
# exit code 130 (it can't resume; no output is left half-written), or is only said once it is done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import json
import os

from configurator import Group, Schema, Setting, configure
from nanogpt_plus import settings
from nanogpt_plus.hf_export import EXPORT_MARK, check_export_weights, export
from nanogpt_plus.init_from import describe_source, init_model
from nanogpt_plus.outputs import check_output
from nanogpt_plus.runtime import run_main

# the writing is nanogpt_plus/hf_export.py's; this script reads the settings and loads the model

# -----------------------------------------------------------------------------
# the settings and their defaults (`python export_hf.py --help` prints them with their help); a
# setting other entry points share has its type, range and help in nanogpt_plus/settings.py and
# its default here
IO = Group(
    'I/O',
    out_dir=settings.out_dir('out'),
    overwrite=settings.overwrite(False),
    init_from=settings.init_from('resume'),
)
EXPORT = Group(
    'export',
    hf_dir=Setting('', "where to write the Hugging Face directory; '' = <out_dir>/hf"),
    weights=Setting('float32', "the dtype model.safetensors stores: 'float32' (exact) or "
                               "'bfloat16' (half the size)"),
)
DEFAULTS = Schema(IO, EXPORT)
# -----------------------------------------------------------------------------


def main():
    cfg = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(cfg)
    check_export_weights(cfg.weights)  # before the model is loaded
    hf_dir = cfg.hf_dir or os.path.join(cfg.out_dir, 'hf')
    # before the model is loaded: into a new or empty directory or an earlier export of ours (its
    # mark), not a checkpoint's or a dataset's directory, nor the model's own, nor one of other files
    # (a Hugging Face folder of the user's: its README.md, its weights would be replaced)
    check_output(hf_dir, 'hf_dir', cfg.overwrite, kind='directory',
                 inputs={'init_from': cfg.init_from}, earlier=(EXPORT_MARK,))
    model, tokenizer_meta, _ = init_model(cfg.init_from, cfg.out_dir)
    source = describe_source(cfg.init_from, cfg.out_dir)
    export(model, tokenizer_meta, hf_dir, source=source, weights=cfg.weights)
    files = sorted(os.listdir(hf_dir))
    print(f"exported {source} to {hf_dir}: {', '.join(files)}")
    print(json.dumps({'hf_dir': hf_dir, 'files': files}))


if __name__ == "__main__":
    run_main(main)
