"""
transformers classes for a GPT with a modern option that GPT2LMHeadModel can't compute (rotary
positions, RMSNorm, QK-norm, a logit soft cap). export_hf.py copies this file into the export as
modeling_nanogpt.py, beside an unchanged copy of the project's model.py, and names its two classes
in config.json's auto_map: then AutoModelForCausalLM.from_pretrained(hf_dir, trust_remote_code=True)
builds our GPT itself, the code the model was trained with, so its logits are ours. generate()
works, past the context too (each new token sees the last n_positions tokens, as our sampler does);
there is no KV cache (each new token runs the whole context again) and no padding (a batch of
prompts of one length, or one prompt at a time, as lm-eval runs).

The tensors keep our names under the prefix 'gpt.' (gpt.transformer.h.0.attn.c_attn.weight, ...); a
tied head is stored once, as gpt.transformer.wte.weight. nanogpt_plus/hf_import.py reads such a
directory back without transformers (init_from=hf_dir).
"""

import contextlib
import io

import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel, __version__
from transformers.modeling_outputs import CausalLMOutput

try:
    # in an export directory, where transformers imports this file
    from .model import GPT, HF_ACTIVATIONS, GPTConfig
except ImportError:
    # in the repository
    from model import GPT, HF_ACTIVATIONS, GPTConfig

MODEL_TYPE = 'nanogpt'
# GPT2Config's names for the sizes, as other tools (lm-eval's max_length) look them up
ATTRIBUTE_MAP = {
    'hidden_size': 'n_embd',
    'max_position_embeddings': 'n_positions',
    'num_attention_heads': 'n_head',
    'num_hidden_layers': 'n_layer'
}


class NanoGPTConfig(PretrainedConfig):
    """
    GPT2Config's sizes and activation_function, plus the options of model.GPTConfig that GPT-2
    lacks.
    """

    model_type = MODEL_TYPE
    attribute_map = ATTRIBUTE_MAP

    def __init__(self, vocab_size=50304, n_positions=1024, n_embd=768, n_layer=12, n_head=12,
                 bias=True, activation_function='gelu', pos='learned', norm='layernorm',
                 qk_norm=False, logit_softcap=0.0, tie_word_embeddings=True, **kwargs):
        self.vocab_size = vocab_size
        self.n_positions = n_positions
        self.n_embd = n_embd
        self.n_layer = n_layer
        self.n_head = n_head
        self.bias = bias
        self.activation_function = activation_function
        self.pos = pos
        self.norm = norm
        self.qk_norm = qk_norm
        self.logit_softcap = logit_softcap
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    def gpt_config(self):
        """
        The model.GPTConfig this config describes (dropout 0: an exported model is for inference
        first).
        """
        if self.activation_function not in HF_ACTIVATIONS:
            raise ValueError(f"activation_function={self.activation_function!r}: use one of "
                             f"{', '.join(HF_ACTIVATIONS)}")
        return GPTConfig(block_size=self.n_positions, vocab_size=self.vocab_size,
                         n_layer=self.n_layer, n_head=self.n_head, n_embd=self.n_embd, dropout=0.0,
                         bias=self.bias, **HF_ACTIVATIONS[self.activation_function], pos=self.pos,
                         norm=self.norm, qk_norm=self.qk_norm, logit_softcap=self.logit_softcap,
                         tie_embeddings=self.tie_word_embeddings)


def tied_weights_keys():
    """
    transformers' declaration of the tied head: a dict (head -> embedding) from 5.0, a list before.
    """
    if int(__version__.split('.')[0]) >= 5:
        return {'gpt.lm_head.weight': 'gpt.transformer.wte.weight'}
    return ['gpt.lm_head.weight']


class NanoGPTForCausalLM(PreTrainedModel, GenerationMixin):
    """
    model.GPT as a transformers causal LM: forward(input_ids, labels) -> logits (and loss);
    generate().
    """

    config_class = NanoGPTConfig
    base_model_prefix = 'gpt'
    _tied_weights_keys = tied_weights_keys()
    _supports_cache_class = False

    def __init__(self, config):
        super().__init__(config)
        with contextlib.redirect_stdout(io.StringIO()):  # GPT's "number of parameters" line
            self.gpt = GPT(config.gpt_config())
        self.post_init()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        loaded = super().from_pretrained(*args, **kwargs)
        model = loaded[0] if isinstance(loaded, tuple) else loaded  # output_loading_info=True
        # the causal masks and rotary tables follow from block_size and are never saved:
        # transformers leaves them unset when it loads, so they are built again here
        model.gpt.init_buffers()
        return loaded

    def _init_weights(self, module):
        # GPT-2's initialisation is GPT's own (its residual projections scaled by depth), not
        # transformers' per-module one; a loaded model's saved weights then replace it
        if isinstance(module, GPT):
            module.init_weights()

    def get_input_embeddings(self):
        return self.gpt.transformer.wte

    def set_input_embeddings(self, value):
        self.gpt.transformer.wte = value

    def get_output_embeddings(self):
        return self.gpt.lm_head

    def set_output_embeddings(self, value):
        self.gpt.lm_head = value

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, **kwargs):
        # no cache: every step sees the whole sequence so far, or its last n_positions tokens once
        # it is longer (a sliding window, as GPT.generate and sample.py crop), so generate() may
        # run past the context instead of failing there
        block = self.config.n_positions
        if input_ids.size(1) > block:
            input_ids = input_ids[:, -block:]
            if attention_mask is not None:
                attention_mask = attention_mask[:, -block:]
        return {'input_ids': input_ids, 'attention_mask': attention_mask}

    def forward(self, input_ids, attention_mask=None, labels=None, return_dict=None, **kwargs):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "this model has no padding support: pass prompts of one length (or one at a time), "
                "without padded positions")
        logits, _ = self.gpt(input_ids, all_positions=True)
        loss = None
        if labels is not None:
            # transformers' convention: labels are the inputs, shifted here; -100 is ignored
            shifted = labels[:, 1:].contiguous()
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(
                -1, logits.size(-1)).float(),
                                                     shifted.view(-1),
                                                     ignore_index=-100)
        return CausalLMOutput(loss=loss, logits=logits)
