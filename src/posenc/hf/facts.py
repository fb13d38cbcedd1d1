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

from ..errors import fail
from .rope import NON_ROPE_MODEL_TYPES, config_to_dict, positive_int, present_key, text_config

__all__ = ["KVFacts", "kv_cache_facts", "max_positions", "original_max_positions", "position_scheme",
           "scheme_facts", "decoder_sizes", "layer_types", "layer_windows"]

ENCODER_ONLY = {"bert", "roberta", "distilbert", "electra", "deberta", "deberta-v2"}


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    """The value of the first alias key that is set (transformers' attribute_map names)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def _positive_int(cfg: dict[str, Any], *keys: str, default: Any = None) -> int:
    """The first set alias key as a positive integer (`default` when none is set)."""
    key = present_key(cfg, *keys)
    if cfg.get(key) is None and default is not None:
        return positive_int({key: default}, key)
    return positive_int(cfg, key)


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
    if (model_type == "falcon" and cfg.get("alibi")) or attn.get("alibi"):
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


def layer_windows(config: Any, layers: int | None = None) -> tuple[int | None, ...]:
    """Per layer, the sliding-window size (None = the layer sees every earlier token), as transformers reads
    `sliding_window`, `use_sliding_window`, `layer_types`, Qwen2's `max_window_layers` and Gemma's patterns."""
    cfg = text_config(config_to_dict(config))
    if layers is None:
        layers = _positive_int(cfg, "num_hidden_layers", "n_layer", "n_layers", "num_layers")
    window = cfg.get("sliding_window")
    if window is None or cfg.get("use_sliding_window") is False:
        return (None,) * layers
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        fail("config['sliding_window']", "None or a positive integer", window)
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return tuple(window if t == "sliding_attention" else None for t in types)
    model_type = cfg.get("model_type")
    if model_type in ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe") and cfg.get("use_sliding_window"):
        first = cfg.get("max_window_layers", 28)  # transformers: layers from max_window_layers on slide
        return tuple(window if i >= first else None for i in range(layers))
    if model_type == "gemma2":  # even layers slide
        return tuple(None if i % 2 else window for i in range(layers))
    if model_type in ("gemma3", "gemma3_text"):  # every `pattern`-th layer is global
        pattern = cfg.get("sliding_window_pattern", 6)
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(layers))
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
    layers = _positive_int(cfg, decoder, "num_hidden_layers", "n_layer", "n_layers", "num_layers")
    heads = _positive_int(cfg, "num_attention_heads", "n_head", "n_heads", "num_heads")
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
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model")
    head_dim = _first(cfg, "head_dim", "d_kv")
    if head_dim is None:
        if not isinstance(hidden, int) or hidden % heads:
            fail("config['hidden_size']", f"a multiple of the {heads} attention heads", hidden)
        head_dim = hidden // heads
    kv_heads = _first(cfg, "num_key_value_heads", "num_kv_heads", "n_head_kv")
    attn = cfg.get("attn_config") if isinstance(cfg.get("attn_config"), dict) else {}
    if model_type == "falcon" and not cfg.get("new_decoder_architecture"):
        kv_heads = 1 if cfg.get("multi_query", True) else heads
    elif attn.get("attn_type") == "multiquery_attention":
        kv_heads = 1
    elif attn.get("kv_n_heads"):
        kv_heads = attn["kv_n_heads"]
    kv_heads = heads if kv_heads is None else int(kv_heads)
    kind = "mha" if kv_heads == heads else ("mqa" if kv_heads == 1 else "gqa")
    if model_type in ("t5", "mt5"):
        notes.append("encoder-decoder: decoder self-attention cache only; the cross-attention cache adds the same per"
                     " encoder token")
    return KVFacts(kind, layers, kv_heads, int(head_dim), 2 * kv_heads * int(head_dim), windows, tuple(notes))


def decoder_sizes(config: Any) -> dict[str, Any]:
    """The keyword arguments of `posenc.models.Decoder` (sizes and flags) from a Llama-family config.

    Raises:
        PosencError: missing or invalid sizes, a non-SwiGLU activation, a bad sliding window, non-bool flags.
    """
    cfg = config_to_dict(config)
    if cfg.get("hidden_act", "silu") != "silu":
        fail("config['hidden_act']", "'silu' (SwiGLU MLP)", cfg.get("hidden_act"))
    heads = _positive_int(cfg, "num_attention_heads")
    sizes: dict[str, Any] = dict(
        vocab_size=_positive_int(cfg, "vocab_size"), hidden_size=_positive_int(cfg, "hidden_size"),
        num_layers=_positive_int(cfg, "num_hidden_layers"), num_heads=heads,
        intermediate_size=_positive_int(cfg, "intermediate_size"),
        num_kv_heads=_positive_int(cfg, "num_key_value_heads", default=heads),
        head_dim=_positive_int(cfg, "head_dim") if cfg.get("head_dim") else None)
    sizes["layer_windows"] = layer_windows(cfg, sizes["num_layers"])
    eps = cfg.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps < 1:
        fail("config['rms_norm_eps']", "a number in [0, 1)", eps)
    sizes["rms_norm_eps"] = float(eps)
    for key in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
        value = cfg.get(key, False)
        if not isinstance(value, bool):
            fail(f"config['{key}']", "true or false", value)
        sizes[key] = value
    sizes["qkv_bias"] = cfg.get("model_type") == "qwen2"  # Qwen2: q/k/v biases, none on o_proj
    return sizes
