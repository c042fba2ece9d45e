"""
Export a trained model to one GGUF file, the format llama.cpp (llama-cli, llama-server), ollama and LM
Studio run: llama.cpp's 'gpt2' architecture, with the model's own tokenizer (GPT-2's BPE, a bpe
model's tokenizer.json, or a character vocabulary), so that llama.cpp turns text into the ids the model
was trained on. Rotary positions, RMSNorm, QK-norm, ReLU^2 and a logit soft cap are refused (llama.cpp's
gpt2 can't compute them; export_hf.py can).

Usage:
    python export_gguf.py --out_dir=out --gguf_file=out/model.gguf --gguf_type=f32
    llama-completion -m out/model.gguf -p "Hello" -n 64          # docs/export.md: llama-cli, llama-server, ollama
    python export_gguf.py --init_from=gpt2 --gguf_file=gpt2-q8_0.gguf --gguf_type=q8_0

gguf_type: f32 (exact weights), f16 (half the file) or q8_0 (about a quarter: 8-bit blocks of 32 with a
scale each); the norms, biases and position table stay float32 in every type, as llama.cpp's converter
keeps them. docs/export.md gives what each costs in agreement with the float32 model.

gguf_file may be new or an earlier export of this script (which is replaced); any other existing file
(someone's GGUF file, a checkpoint) is refused unless --overwrite=True. The file appears complete or
not at all (written under a temp name, renamed at the end).
"""
# first, before torch is imported (seconds): from here on a signal stops the work in one line and
# exit code 130 (it can't resume; no file is left half-written), or is only said once it is done
from nanogpt_plus.signals import early_exit_request

early_exit_request(__name__, resumable=False)

import json
import os

from configurator import Group, Schema, Setting, configure
from nanogpt_plus import settings
from nanogpt_plus.gguf_export import GGUF_TYPES, check_architecture, export_gguf, exported_here
from nanogpt_plus.init_from import describe_source, init_model
from nanogpt_plus.outputs import check_output
from nanogpt_plus.runtime import run_main

# the writing is nanogpt_plus/gguf_export.py's; this script reads the settings and loads the model

# -----------------------------------------------------------------------------
# the settings and their defaults (`python export_gguf.py --help` prints them with their help); a
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
    gguf_file=Setting('', "the GGUF file to write; '' = <out_dir>/model-<gguf_type>.gguf"),
    gguf_type=Setting('f32', "the weight matrices' type: 'f32' (exact), 'f16' (half the file) or "
                             "'q8_0' (8-bit blocks, about a quarter)", choices=GGUF_TYPES),
)
DEFAULTS = Schema(IO, EXPORT)
# -----------------------------------------------------------------------------


def main():
    cfg = configure(DEFAULTS, doc=__doc__)
    DEFAULTS.check(cfg)
    gguf_file = cfg.gguf_file or os.path.join(cfg.out_dir, f'model-{cfg.gguf_type}.gguf')
    # before the model is loaded: a new file or an earlier export of ours, never a checkpoint, a dataset's
    # file, the model read, another GGUF file or a file in a live run's out_dir
    check_output(gguf_file, 'gguf_file', cfg.overwrite, inputs={'init_from': cfg.init_from},
                 output_kind='GGUF file of export_gguf.py', recognise=exported_here)
    model, tokenizer_meta, _ = init_model(cfg.init_from, cfg.out_dir)
    source = describe_source(cfg.init_from, cfg.out_dir)
    check_architecture(model.config, source)
    if model.config.gelu == 'none':
        print("note: the model uses the exact GELU (nanoGPT's); llama.cpp computes GPT-2's tanh approximation, "
              "so its logits differ from ours slightly (0.005 at most on the quick start's model, docs/export.md)")
    print(f"exporting {source} to {gguf_file} ({cfg.gguf_type})", flush=True)
    size = export_gguf(model, tokenizer_meta, gguf_file, gguf_type=cfg.gguf_type, source=source)
    print(f"exported {source} to {gguf_file} ({cfg.gguf_type}, {size / 2**20:.1f} MiB)")
    print(json.dumps({'gguf_file': gguf_file, 'gguf_type': cfg.gguf_type, 'bytes': size}))


if __name__ == "__main__":
    run_main(main)
