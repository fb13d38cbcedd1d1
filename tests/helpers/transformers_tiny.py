"""Test helper: tiny random transformers models of the families `posenc.integrations.transformers` patches,
and the oracles the patch is measured against (transformers' own model, run without a cache).

Nothing here comes from posenc: the models are transformers' classes with random weights (seeded).
"""

from __future__ import annotations

import copy

import torch

VOCAB = 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256, attn_implementation="sdpa")


def _config(family: str, rope: dict | None, **extra):
    import transformers

    kw = {**_COMMON, **extra}
    if family == "llama":
        return transformers.LlamaConfig(**kw, rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    if family == "qwen2":
        return transformers.Qwen2Config(**kw, rope_parameters=rope or {"rope_type": "default", "rope_theta": 1e6})
    if family == "gemma3":  # per-layer RoPE: sliding layers theta 1e4, full layers 1e6 (and the scaling rule)
        full = {"rope_type": "default", "rope_theta": 1e6, **(rope or {})}
        return transformers.Gemma3TextConfig(**kw, head_dim=16, sliding_window=8,
                                              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                              rope_parameters={"full_attention": full, "sliding_attention":
                                                               {"rope_type": "default", "rope_theta": 10000.0}})
    if family == "phi3":  # partial rotary (0.5: rotary_dim 8 of head 16) and LongRoPE at L0 = 64
        half = 4
        rope = rope or {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(half)],
                        "long_factor": [2.0 + 0.5 * i for i in range(half)], "original_max_position_embeddings": 64,
                        "partial_rotary_factor": 0.5}
        return transformers.Phi3Config(**kw, rope_parameters=rope, original_max_position_embeddings=64,
                                       pad_token_id=0)
    if family == "smollm3":  # layer 2 applies no RoPE
        return transformers.SmolLM3Config(**kw, no_rope_layers=[1, 1, 0], pad_token_id=0,
                                          rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0})
    if family == "phi":  # the attention slices the rotary channels itself (q_rot = q[..., :rotary_ndims])
        kw.pop("num_key_value_heads")
        return transformers.PhiConfig(**kw, rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0,
                                                                  "partial_rotary_factor": 0.5})
    if family == "glm":  # interleaved pairing on half the head
        return transformers.GlmConfig(**kw, head_dim=16, pad_token_id=0)
    if family == "cohere":  # interleaved pairing on the whole head
        return transformers.CohereConfig(**kw, pad_token_id=0)
    if family == "qwen2_vl":
        text = {**kw, "rope_parameters": rope or {"rope_type": "default", "rope_theta": 10000.0,
                                                  "mrope_section": [2, 3, 3]}}
        text.pop("attn_implementation")
        vision = dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, patch_size=2, spatial_merge_size=2,
                      temporal_patch_size=1, in_channels=3)
        return transformers.Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=VOCAB - 3,
                                          video_token_id=VOCAB - 2, vision_start_token_id=VOCAB - 1,
                                          attn_implementation="sdpa")
    raise KeyError(family)


FAMILIES = ("llama", "qwen2", "gemma3", "phi3", "smollm3", "phi", "glm", "cohere", "qwen2_vl")


def tiny_model(family: str, rope: dict | None = None, dtype=torch.float32, seed: int = 0, **extra):
    """A seeded random `*ForCausalLM` (Qwen2-VL: `*ForConditionalGeneration`) in eval mode."""
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = _config(family, rope, **extra)
    torch.manual_seed(seed)
    cls = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
           "phi3": "Phi3ForCausalLM", "smollm3": "SmolLM3ForCausalLM", "phi": "PhiForCausalLM",
           "glm": "GlmForCausalLM", "cohere": "CohereForCausalLM", "qwen2_vl": "Qwen2VLForConditionalGeneration"}[family]
    return sharpen(getattr(transformers, cls)(config)).to(dtype).eval()


def sharpen(model):
    """Larger weights than the default init (matrices x4): sharper attention, so position errors show."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    return model


def fresh_full(model):
    """`ids -> last-token logits` of an unpatched copy of `model` run without a cache, its rotary modules
    rebuilt before every call (transformers' dynamic and LongRoPE modules keep state between calls)."""
    twin = copy.deepcopy(model)
    rotaries = {name: copy.deepcopy(m) for name, m in twin.named_modules() if name.endswith("rotary_emb")}

    @torch.no_grad()
    def full(ids, **kwargs):
        for name, m in rotaries.items():
            parent, _, attr = name.rpartition(".")
            setattr(twin.get_submodule(parent), attr, copy.deepcopy(m))
        return twin(ids, use_cache=False, **kwargs).logits[:, -1]

    return full


@torch.no_grad()
def cached_vs_full(model, full, ids, steps):
    """Greedy decode `steps` tokens one at a time through the cache after prefilling `ids`; returns
    `(max |cached - fresh full| over the steps' logits, the generated ids)`."""
    out = model(ids, use_cache=True)
    cache = out.cache
    worst = 0.0
    for _ in range(steps):
        token = out.logits[:, -1:].argmax(-1)
        ids = torch.cat((ids, token), 1)
        out = model(token, cache=cache, use_cache=True)
        worst = max(worst, (out.logits[:, -1] - full(ids)).abs().max().item())
    return worst, ids
