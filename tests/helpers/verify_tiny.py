"""Test helper: a tiny random Llama saved as a transformers directory (config.json + safetensors).

Weights are drawn with initializer_range 0.2 (not 0.02) so logits are O(1): a rule that is applied then
moves them far above float32 noise, as on a trained model. Everything goes through posenc's loader.
"""

from __future__ import annotations

import torch

from posenc.verify.checks.common import FAR_SHIFT, Budget

CONFIG = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=128, max_position_embeddings=8192, rope_theta=10000.0, initializer_range=0.2,
              tie_word_embeddings=False, rms_norm_eps=1e-5)
BUDGET = Budget("test", relativity_len=24, shifts=(3, 61, 1000, FAR_SHIFT), decode_prefill=20, decode_steps=4,
                boundary_l0=64, short_len=128)


def save_tiny(folder, seed: int = 0) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    model.save_pretrained(folder)
    return str(folder)


def subject(path: str, factory, engine_name: str = "posenc"):
    from posenc.verify.runner import build_subject

    return build_subject(path, factory, engine_name=engine_name, dtype=torch.float32, tokens=4096)[0]
