"""Model facts beyond RoPE read from a transformers config: which position scheme, how long, how big the
KV cache is per token, and the sizes of a Llama-family decoder. Part of the one adapter that knows
transformers' config keys (`posenc.hf`).

    >>> facts = kv_cache_facts({"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32,
    ...                         "num_hidden_layers": 32})
    >>> facts.kind, facts.layers, facts.elements
    ('mha', 32, 8192)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import boolean, fail, integer, real
from .conventions import NON_ROPE_MODEL_TYPES, config_int, config_to_dict, convention, head_dim, layer_type_list, text_config

__all__ = ["KVFacts", "kv_cache_facts", "max_positions", "original_max_positions", "position_scheme",
           "scheme_facts", "decoder_sizes", "layer_types", "layer_windows"]

ENCODER_ONLY = {"bert", "roberta", "distilbert", "electra", "deberta", "deberta-v2"}


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    """The value of the first alias key that is set (transformers' attribute_map names)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def max_positions(config: Any) -> int | None:
    """The longest sequence the config declares (max_position_embeddings or its older names), or None."""
    cfg = text_config(config_to_dict(config))
    value = _first(cfg, "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def original_max_positions(config: Any) -> int | None:
    """A top-level `original_max_position_embeddings` (the trained length of a scaled model), or None."""
    value = text_config(config_to_dict(config)).get("original_max_position_embeddings")
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def layer_types(config: Any) -> list[str] | None:
    """The per-layer attention types (`layer_types`), if the config lists them."""
    types = text_config(config_to_dict(config)).get("layer_types")
    return list(types) if isinstance(types, list) else None


def position_scheme(config: Any) -> str:
    """"rope", "alibi", "t5" or "learned_absolute"."""
    cfg = text_config(config_to_dict(config))
    model_type = cfg.get("model_type")
    attn = cfg.get("attn_config") if isinstance(cfg.get("attn_config"), dict) else {}
    alibi_key = convention(cfg).alibi_key
    if (alibi_key is not None and cfg.get(alibi_key)) or attn.get("alibi"):
        return "alibi"
    if model_type in NON_ROPE_MODEL_TYPES:
        text = NON_ROPE_MODEL_TYPES[model_type]
        return "alibi" if text.startswith("ALiBi") else ("t5" if text.startswith("T5") else "learned_absolute")
    return "rope"


def scheme_facts(config: Any) -> dict[str, Any]:
    """Heads plus the scheme's own parameters (T5 buckets and distance, a learned table's rows)."""
    cfg = text_config(config_to_dict(config))
    facts: dict[str, Any] = {"heads": _first(cfg, "num_attention_heads", "n_head", "n_heads", "num_heads")}
    scheme = position_scheme(cfg)
    if scheme == "t5":
        facts["num_buckets"] = cfg.get("relative_attention_num_buckets", 32)
        facts["max_distance"] = cfg.get("relative_attention_max_distance", 128)
    elif scheme == "learned_absolute":
        facts["table_rows"] = max_positions(cfg)
    return facts


@dataclass(frozen=True)
class KVFacts:
    """What one token costs in the KV cache: `elements` numbers per token per layer, and each layer's window."""

    kind: str  # "mha", "gqa", "mqa", "mla" or "none"
    layers: int
    kv_heads: int
    head_dim: int
    elements: int  # cached numbers per token per layer (K and V together)
    windows: tuple[int | None, ...]  # per layer: sliding-window size, None = keeps every token
    notes: tuple[str, ...]
    layer_elements: tuple[int, ...] | None = None  # per layer, where layers differ (Gemma 4's global head_dim)


def layer_windows(config: Any, layers: int | None = None) -> tuple[int | None, ...]:
    """Per layer, the sliding-window size (None = the layer sees every earlier token), as transformers reads
    `sliding_window`, `use_sliding_window`, `layer_types`, Qwen2's `max_window_layers` and Gemma's patterns."""
    cfg = text_config(config_to_dict(config))
    if layers is None:
        layers = config_int(cfg, "num_hidden_layers", "n_layer", "n_layers", "num_layers")
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return (None,) * layers
    window = integer("config['sliding_window']", window, min=1, what="None or a positive integer")
    types = layer_type_list(cfg, layers)  # given, or the config class's rule (Gemma 2/3, Cohere 2, OLMo 3, Qwen, ...)
    if types is not None and len(types) == layers:
        return tuple(window if t == "sliding_attention" else None for t in types)
    return (window,) * layers


def kv_cache_facts(config: Any) -> KVFacts:
    """How many numbers each token adds to the KV cache of each layer, and each layer's window.

    Args:
        config: a config.json dict or a transformers `PretrainedConfig`.
    Returns:
        `KVFacts`; MLA models (DeepSeek-V2/V3) cache the compressed latent `kv_lora_rank + qk_rope_head_dim`.
    Raises:
        PosencError: missing layer, head or width keys.
    """
    cfg = text_config(config_to_dict(config))
    model_type = cfg.get("model_type")
    if model_type in ENCODER_ONLY:
        return KVFacts("none", 0, 0, 0, 0, (), (f"{model_type} is encoder-only: it keeps no KV cache",))
    decoder = "num_decoder_layers" if model_type in ("t5", "mt5") else "num_hidden_layers"
    layers = config_int(cfg, decoder, "num_hidden_layers", "n_layer", "n_layers", "num_layers")
    heads = config_int(cfg, "num_attention_heads", "n_head", "n_heads", "num_heads")
    windows = layer_windows(cfg, layers)
    notes = []
    if any(w is not None for w in windows):
        slid = sum(w is not None for w in windows)
        notes.append(f"{slid} of {layers} layers use a sliding window of {max(w or 0 for w in windows)} tokens;"
                     " their cache is assumed to keep only the last window (a rolling cache)")
    if cfg.get("kv_lora_rank") and cfg.get("qk_rope_head_dim"):
        latent, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        full = heads * (int(cfg.get("qk_nope_head_dim", 0)) + rope + int(cfg.get("v_head_dim", 0)))
        notes.append(f"MLA: caches the compressed latent ({latent}) + the shared rotary key ({rope}) per token and layer,"
                     f" as DeepSeek's own inference code does; a cache of decompressed K and V (transformers'"
                     f" eager DynamicCache) holds {full} numbers per token and layer, {full / (latent + rope):.1f}x more")
        return KVFacts("mla", layers, 1, latent + rope, latent + rope, windows, tuple(notes))
    width = head_dim(cfg)  # the one derivation of head_dim, with the config classes' defaults
    kv_heads = _first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    attn = cfg.get("attn_config") if isinstance(cfg.get("attn_config"), dict) else {}
    if convention(cfg).legacy_multi_query and not cfg.get("new_decoder_architecture"):
        kv_heads = 1 if cfg.get("multi_query", True) else heads
    elif attn.get("attn_type") == "multiquery_attention":
        kv_heads = 1
    elif attn.get("kv_n_heads"):
        kv_heads = attn["kv_n_heads"]
    kv_heads = heads if kv_heads is None else int(kv_heads)
    kind = "mha" if kv_heads == heads else ("mqa" if kv_heads == 1 else "gqa")
    per_layer = _layer_elements(cfg, layers, kv_heads, width)
    if per_layer is not None:
        notes.append(f"layers differ in KV width: {sorted(set(per_layer))} numbers per token (per_layer_config / "
                     "global_head_dim); the head_dim shown is the most common one")
    if model_type in ("t5", "mt5"):
        notes.append("encoder-decoder: decoder self-attention cache only; the cross-attention cache adds the same per"
                     " encoder token")
    if cfg.get("num_kv_shared_layers") or cfg.get("kv_source_layers") is not None:
        from .branches import kv_sources  # a layer that reads an earlier layer's keys and values stores none

        sources = kv_sources(cfg)
        if any(s is not None for s in sources):
            base = per_layer or (2 * kv_heads * width,) * layers
            per_layer = tuple(0 if s is not None else e for e, s in zip(base, sources))
            notes.append(f"{sum(s is not None for s in sources)} of {layers} layers reuse an earlier layer's keys and "
                         "values (num_kv_shared_layers / kv_source_layers): they add nothing to the cache")
    return KVFacts(kind, layers, kv_heads, width, 2 * kv_heads * width, windows, tuple(notes), per_layer)


def _layer_elements(cfg: dict[str, Any], layers: int, kv_heads: int, width: int) -> tuple[int, ...] | None:
    """K and V numbers per token of each layer where they differ between layers (Gemma 4: `per_layer_config`
    {layer index: {"head_dim", "num_key_value_heads"}}, or config.json's `global_head_dim` for full attention)."""
    per, types = cfg.get("per_layer_config"), layer_type_list(cfg, layers)
    if isinstance(per, dict) and per:
        try:
            rows = {int(k): v or {} for k, v in per.items()}
        except (TypeError, ValueError):
            fail("config['per_layer_config']", "a dict keyed by layer index", sorted(map(str, per)))
        dims = [(rows.get(i, {}).get("num_key_value_heads") or kv_heads, rows.get(i, {}).get("head_dim") or width)
                for i in range(layers)]
    elif cfg.get("global_head_dim") is not None and types is not None:
        glob = (config_int(cfg, "num_global_key_value_heads", default=kv_heads), config_int(cfg, "global_head_dim"))
        dims = [glob if t == "full_attention" else (kv_heads, width) for t in types]
    else:
        return None
    return tuple(2 * h * d for h, d in dims) if len(set(dims)) > 1 else None


def decoder_sizes(config: Any) -> dict[str, Any]:
    """The keyword arguments of `posenc.models.Decoder` (sizes and flags) from a Llama-family config.

    Raises:
        PosencError: missing or invalid sizes, a non-SwiGLU activation, a bad sliding window, non-bool flags.
    """
    cfg = config_to_dict(config)
    gelu = cfg.get("model_type") in ("gemma2", "gemma3_text")  # GeGLU from hidden_activation (posenc.hf.arch)
    if not gelu and cfg.get("hidden_act", "silu") != "silu":
        fail("config['hidden_act']", "'silu' (SwiGLU MLP)", cfg.get("hidden_act"))
    heads = config_int(cfg, "num_attention_heads")
    sizes: dict[str, Any] = dict(
        vocab_size=config_int(cfg, "vocab_size"), hidden_size=config_int(cfg, "hidden_size"),
        num_layers=config_int(cfg, "num_hidden_layers"), num_heads=heads,
        intermediate_size=config_int(cfg, "intermediate_size_mlp", default=16384) if cfg.get("model_type") == "llama4_text"
        else config_int(cfg, "intermediate_size"),  # Llama 4's dense layers: intermediate_size_mlp
        num_kv_heads=config_int(cfg, "num_key_value_heads", default=heads),
        head_dim=head_dim(cfg))
    sizes["layer_windows"] = layer_windows(cfg, sizes["num_layers"])
    sizes["rms_norm_eps"] = real("config['rms_norm_eps']", cfg.get("rms_norm_eps", 1e-6), ge=0.0, lt=1.0)
    conv = convention(cfg)
    for arg, key in (("tie_word_embeddings", "tie_word_embeddings"), ("mlp_bias", "mlp_bias"),
                     ("attention_bias", conv.o_bias), ("qkv_bias", conv.qkv_bias)):
        # a family's fixed bias, or its config key
        sizes[arg] = key if isinstance(key, bool) else boolean(f"config['{key}']", cfg.get(key, False))
    return sizes
