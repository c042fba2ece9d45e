"""
nanogpt_plus/hf_modeling.py: a new NanoGPTForCausalLM draws GPT's own initialisation.
"""
import torch


def test_a_new_custom_model_has_gpt_2s_initialisation():
    """ NanoGPTForCausalLM(config) draws GPT's own init (residual projections scaled by 1/sqrt(2 n_layer)), not
    transformers' per-module one. """
    import math

    from nanogpt_plus.hf_modeling import NanoGPTConfig, NanoGPTForCausalLM
    torch.manual_seed(0)
    model = NanoGPTForCausalLM(NanoGPTConfig(n_layer=8, n_head=4, n_embd=256, n_positions=32, vocab_size=100,
                                             pos='rope'))
    std = torch.cat([b.attn.c_proj.weight.flatten() for b in model.gpt.transformer.h]).std().item()
    assert abs(std - 0.02 / math.sqrt(16)) < 0.0005
    assert abs(model.gpt.transformer.h[0].mlp.c_fc.weight.std().item() - 0.02) < 0.001
