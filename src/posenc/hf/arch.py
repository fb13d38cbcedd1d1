"""The decoder a transformers config describes: its family as an `Arch` (`posenc.hf.family`: norms, q/k norm,
multipliers, soft-caps, per-layer RoPE / window / chunk / query temperature), or a refusal that says why, and
`decoder_config`, the keyword arguments `posenc.models.Decoder.from_hf_config` builds the decoder from.

Built: the Llama family (llama, mistral, qwen2 and types outside the tables below: Llama's `Arch` with the
config's sliding windows), and qwen3, gemma2, gemma3_text, olmo2, olmo3, granite, smollm3, llama4_text (dense layers only),
gpt_oss (attention sinks, its mixture of clamped-SwiGLU experts), ministral3 (query temperature on every layer).
Refused by name: families whose layers need more than these facts (other mixture-of-experts MLPs, fused or
parallel blocks, LayerNorm), in `REFUSED`.

    >>> cfg = {"model_type": "gemma2", "vocab_size": 10, "hidden_size": 64, "num_hidden_layers": 2,
    ...        "num_attention_heads": 2, "head_dim": 32, "intermediate_size": 8, "sliding_window": 4}
    >>> arch, rope = decoder_arch(cfg)
    >>> arch.layout, arch.windows, arch.attn_softcap, arch.embed_scale, rope.base
    ('sandwich', (4, None), 50.0, 8.0, 10000.0)
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import Raw, boolean, fail, integer, real
from ..rope.spec import Rope
from .conventions import config_int, config_to_dict, layer_type_list
from .facts import decoder_sizes, layer_windows
from .family import Arch, LayerSpec, MoESpec, llama_arch
from .layers import layer_ropes, rope_from_hf_config
from .temperature import layer_temperatures

__all__ = ["decoder_arch", "decoder_config", "FAMILIES", "REFUSED"]

FAMILIES = ("qwen3", "gemma2", "gemma3_text", "olmo2", "olmo3", "granite", "smollm3", "llama4_text", "gpt_oss",
            "ministral3")
_MOE = "a mixture-of-experts MLP (a router over expert MLPs), which the decoder does not build"
REFUSED = {
    **dict.fromkeys(("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "granitemoeshared", "phimoe",
                     "deepseek_v2", "deepseek_v3", "dbrx", "jamba", "minimax", "llama4", "glm4_moe"), _MOE),
    "qwen3_next": f"linear-attention layers beside softmax ones and {_MOE}",
    "gemma": "Gemma 1 blocks ((1 + w) norms, GeGLU, scaled embeddings), not yet described as an Arch",
    "gemma3": "a vision-language model: pass its text_config (model_type gemma3_text)",
    "phi3": "a fused qkv_proj and gate_up_proj, which the decoder's parameter names do not map",
    "cohere": "parallel attention and MLP blocks on one LayerNorm",
    "cohere2": "parallel attention and MLP blocks on one LayerNorm",
    "olmo": "a LayerNorm without weights (not an RMS norm)",
    "phi": "LayerNorm, parallel attention and MLP blocks, a dense (ungated) MLP",
    "gpt_neox": "LayerNorm, a fused query_key_value projection, parallel residuals",
    "falcon": "LayerNorm, a fused query_key_value projection, parallel attention and MLP",
    "stablelm": "LayerNorm (with biases), which is not an RMS norm",
    "starcoder2": "LayerNorm and a dense (ungated) MLP with biases",
}
# the config classes' defaults for the keys read here (transformers 5.x), for config.json dicts that omit them
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"query_pre_attn_scalar": 256, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "hidden_activation": "gelu_pytorch_tanh"},
    "gemma3_text": {"query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh"},
    "granite": {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
                "logits_scaling": 1.0},
    "llama4_text": {"use_qk_norm": True, "attention_chunk_size": 8192, "interleave_moe_layer_step": 1},
    "gpt_oss": {"num_local_experts": 128, "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0},
}


def decoder_config(config: Any, *, encoding: Any = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(config dict, keyword arguments of posenc.models.Decoder)` for `Decoder.from_hf_config`.

    Args:
        config: a config.json dict or a transformers `PretrainedConfig` (model_type defaults to "llama").
        encoding: the positional scheme to use, or None for the config's RoPE (the shared one, or None when
            each layer applies its own).
    Returns:
        The config as a dict, and the decoder's sizes and flags (`posenc.hf.facts.decoder_sizes`), `arch`
        and `encoding`.
    Raises:
        PosencError: as `decoder_sizes`, `decoder_arch` and `rope_from_hf_config`.
    """
    cfg = config_to_dict(config)
    cfg.setdefault("model_type", "llama")
    sizes = decoder_sizes(cfg)
    arch, shared = decoder_arch(cfg)
    sizes.pop("layer_windows")  # the arch holds them
    if encoding is None:
        encoding = rope_from_hf_config(cfg) if arch.family not in FAMILIES else shared
    return cfg, {**sizes, "arch": arch, "encoding": encoding}


def decoder_arch(config: Any) -> tuple[Arch, Rope | None]:
    """`(Arch, the shared Rope or None)` of the decoder a config describes.

    Args:
        config: a config.json dict or a transformers `PretrainedConfig` (model_type defaults to "llama").
    Returns:
        The `Arch` and the one Rope every layer shares, or None when layers differ (each `LayerSpec.rope` is then
        set). The Llama family (types outside `FAMILIES`): Llama's `Arch` with the config's sliding windows and
        None (its one Rope is `rope_from_hf_config(config)`).
    Raises:
        PosencError: a family in `REFUSED` (the message says why), Llama 4 configs with MoE layers, an
            unsupported activation, invalid multipliers or soft-caps, or any error of `posenc.hf.layer_ropes`.
    """
    cfg = config_to_dict(config)
    model_type = cfg.get("model_type") or "llama"
    if model_type in REFUSED:
        fail("config['model_type']",
             f"a family posenc's decoder builds (Llama, Mistral, Qwen 2, {', '.join(FAMILIES)})",
             Raw(f"{model_type!r}, whose layers need {REFUSED[model_type]}"))
    if model_type not in FAMILIES:
        if any(t is not None for t in layer_temperatures(cfg)):  # a query temperature the Llama blocks would drop
            fail("config['model_type']", f"a family posenc's decoder builds with its query temperature "
                 f"({', '.join(FAMILIES)})", Raw(f"{model_type!r}, whose attention scales q by position"))
        return llama_arch(layer_windows(cfg, config_int(cfg, "num_hidden_layers")), model_type), None
    defaults = _DEFAULTS.get(model_type, {})

    def get(key: str) -> Any:
        return cfg[key] if cfg.get(key) is not None else defaults.get(key)

    count = config_int(cfg, "num_hidden_layers")
    ropes, windows, temperatures = layer_ropes(cfg), layer_windows(cfg, count), layer_temperatures(cfg)
    shared = ropes[0] if len(set(ropes)) == 1 else None
    if model_type == "llama4_text":
        shared = None  # its L2 q/k norm follows the rotation: each rotating layer rotates itself
    chunks: tuple[int | None, ...] = (None,) * count
    facts: dict[str, Any] = {"family": model_type}
    if model_type in ("gemma2", "gemma3_text"):
        if get("hidden_activation") not in ("gelu_pytorch_tanh", "gelu_tanh"):
            fail("config['hidden_activation']", "'gelu_pytorch_tanh' (Gemma's GeGLU)", get("hidden_activation"))
        hidden = config_int(cfg, "hidden_size")
        scalar = real("config['query_pre_attn_scalar']", get("query_pre_attn_scalar"), gt=0.0)
        # Gemma keeps sqrt(hidden) in a float32 buffer, so a float64 model multiplies by its float32 rounding
        facts |= dict(norm="offset", layout="sandwich", activation="gelu_tanh", attn_scale=scalar**-0.5,
                      embed_scale=float(torch.tensor(hidden**0.5, dtype=torch.float32)),
                      attn_softcap=_cap(cfg, "attn_logit_softcapping", get),
                      logit_softcap=_cap(cfg, "final_logit_softcapping", get),
                      qk_norm="head" if model_type == "gemma3_text" else None)
    elif model_type == "qwen3":
        facts["qk_norm"] = "head"
    elif model_type in ("olmo2", "olmo3"):
        facts |= dict(layout="post", qk_norm="proj")
    elif model_type == "granite":
        facts |= {name: real(f"config['{key}']", get(key), gt=0.0) for name, key in (
            ("embed_scale", "embedding_multiplier"), ("residual_scale", "residual_multiplier"),
            ("attn_scale", "attention_multiplier"), ("logit_scale", "logits_scaling"))}
    elif model_type == "gpt_oss":
        facts |= dict(sinks=True, moe=MoESpec(
            num_experts=config_int(cfg, "num_local_experts", default=get("num_local_experts")),
            top_k=config_int(cfg, "num_experts_per_tok", default=get("num_experts_per_tok")),
            alpha=real("config['swiglu_alpha']", get("swiglu_alpha"), gt=0.0),
            limit=real("config['swiglu_limit']", get("swiglu_limit"), gt=0.0)))
    elif model_type == "llama4_text":
        _refuse_moe(cfg, count, get)
        facts |= dict(mlp_name="feed_forward",
                      qk_norm="l2" if boolean("config['use_qk_norm']", get("use_qk_norm")) else None)
        chunk = get("attention_chunk_size")
        types = layer_type_list(cfg, count) or []
        if chunk is not None:
            chunk = integer("config['attention_chunk_size']", chunk, min=1, what="None or an integer >= 1")
            chunks = tuple(chunk if t == "chunked_attention" else None for t in types) or chunks
    specs = tuple(LayerSpec(rope=None if shared is not None else r, window=w, chunk=c, temperature=t)
                  for r, w, c, t in zip(ropes, windows, chunks, temperatures))
    return Arch(layers=specs, **facts), shared


def _cap(cfg: dict[str, Any], key: str, get: Any) -> float | None:
    value = get(key)
    return None if value is None else real(f"config['{key}']", value, gt=0.0, what="null or a number > 0")


def _refuse_moe(cfg: dict[str, Any], count: int, get: Any) -> None:
    """Llama 4: MoE layers are `moe_layers`, else every `interleave_moe_layer_step`-th (the config class's rule)."""
    moe = cfg.get("moe_layers")
    if moe is None:
        step = integer("config['interleave_moe_layer_step']", get("interleave_moe_layer_step"), min=1)
        moe = list(range(step - 1, count, step))
    if moe:
        fail("config['moe_layers']", "no MoE layers (posenc's decoder builds Llama 4's dense layers only: set "
             "moe_layers [] or interleave_moe_layer_step above num_hidden_layers)", Raw(f"MoE layers {list(moe)}"))
