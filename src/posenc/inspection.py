"""Facts about one checkpoint's positional encoding and KV cache, as plain data (what `posenc inspect` prints).

`inspect_model(cfg)` returns a JSON-ready dict: the scheme; for RoPE models the head and rotary widths,
pairing, base, scaling rule, attention factor and, per rotation pair, the wavelength in tokens before and
after scaling with the number of full turns within the original length L0 and the target length L1; and
the KV-cache memory per request and per batch. Configs come from a `config.json` path, a directory holding
one, or a bundled preset (`preset_names()`).

Memory is in GiB (2**30 bytes): LLaMA-2-7B caches 2 x 32 layers x 32 KV heads x 128 x 2 bytes = 512 KiB per
token in fp16, so 4096 tokens take 2 GiB:

    >>> cfg, _ = load_config("llama-2-7b")
    >>> kv = kv_cache_facts(cfg)
    >>> kv_bytes(kv, 4096, "fp16") / 2**30
    2.0
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import PosencError, check_positive, fail
from .hf import NON_ROPE_MODEL_TYPES, config_to_dict
from .rope import scaling as sc
from .rope.spec import Rope

__all__ = ["load_config", "preset_names", "parse_lengths", "kv_cache_facts", "kv_bytes", "rope_facts", "inspect_model",
           "max_tokens", "target_lengths", "length_label", "DTYPE_BYTES", "KVFacts"]

DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int4": 0.5}  # int4: without quantisation scales
GIB = 2**30
_ENCODER_ONLY = {"bert", "roberta", "distilbert", "electra", "deberta", "deberta-v2"}


# ---------------------------------------------------------------------------------------------- loading
def preset_names() -> list[str]:
    """The names of the bundled model configs, sorted (e.g. "llama-2-7b")."""
    folder = resources.files("posenc") / "presets"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_config(model_or_config: str) -> tuple[dict[str, Any], str]:
    """Read a model config: a path to a config.json, a directory holding one, or a bundled preset name.

    Args:
        model_or_config: the path or preset name (case-insensitive).
    Returns:
        `(config dict, where it came from)`.
    Raises:
        PosencError: no such file, directory or preset; a file that is not a JSON object.
    """
    if not isinstance(model_or_config, str) or not model_or_config:
        fail("MODEL_OR_CONFIG", "a path or a preset name", model_or_config)
    path = Path(model_or_config).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            fail("MODEL_OR_CONFIG", "a directory holding config.json", f"{model_or_config!r} without one")
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            fail("MODEL_OR_CONFIG", "a readable JSON file", f"{str(path)!r} ({e})")
        if not isinstance(cfg, dict):
            fail("MODEL_OR_CONFIG", "a JSON object (a transformers config.json)", f"{type(cfg).__name__} in {str(path)!r}")
        return cfg, str(path)
    name = model_or_config.lower()
    if name in preset_names():
        text = (resources.files("posenc") / "presets" / f"{name}.json").read_text()
        return json.loads(text), f"preset {name}"
    fail("MODEL_OR_CONFIG", f"a config.json, a directory holding one, or a preset ({', '.join(preset_names())})",
         model_or_config)


def parse_lengths(text: str) -> list[int]:
    """Token counts from "4k,32k,128k" (k = 1024, m = 1024**2) or plain integers; each must be > 0."""
    lengths = []
    for item in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", item)
        if not match:
            fail("--lengths", "comma-separated token counts such as 4k,32k,128k or 4096", text)
        value = float(match.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[match.group(2).lower()]
        if value != int(value) or value <= 0:
            fail("--lengths", "positive whole numbers of tokens", item.strip())
        lengths.append(int(value))
    return lengths


def length_label(tokens: int) -> str:
    """4096 -> "4k", 131072 -> "128k", 1048576 -> "1m", 4000 -> "4000"."""
    if tokens % 1024**2 == 0:
        return f"{tokens // 1024**2}m"
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


# ---------------------------------------------------------------------------------------------- config facts
# These read transformers' config keys; they belong with hf.py's knowledge and may move there.
def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    text = cfg.get("text_config")
    if isinstance(text, dict):
        return {**cfg, **text, "model_type": cfg.get("model_type", text.get("model_type"))}
    return cfg


def _first(cfg: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return None


def _positive_int(cfg: dict[str, Any], *keys: str) -> int:
    value = _first(cfg, *keys)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0 or int(value) != value:
        fail(f"config['{keys[0]}']", "a positive integer", "nothing (key missing)" if value is None else value)
    return int(value)


def max_positions(cfg: dict[str, Any]) -> int | None:
    """The longest sequence the config declares (max_position_embeddings or its older names), or None."""
    value = _first(_text_config(cfg), "max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


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


def _layer_windows(cfg: dict[str, Any], layers: int) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    if not window or cfg.get("use_sliding_window") is False:
        return (None,) * layers
    types = cfg.get("layer_types")
    if isinstance(types, list) and len(types) == layers:
        return tuple(window if t == "sliding_attention" else None for t in types)
    model_type = cfg.get("model_type")
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
    cfg = _text_config(config_to_dict(config))
    model_type = cfg.get("model_type")
    if model_type in _ENCODER_ONLY:
        return KVFacts("none", 0, 0, 0, 0, (), (f"{model_type} is encoder-only: it keeps no KV cache",))
    decoder = "num_decoder_layers" if model_type in ("t5", "mt5") else "num_hidden_layers"
    layers = _positive_int(cfg, decoder, "num_hidden_layers", "n_layer", "n_layers", "num_layers")
    heads = _positive_int(cfg, "num_attention_heads", "n_head", "n_heads", "num_heads")
    windows = _layer_windows(cfg, layers)
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


def kv_bytes(facts: KVFacts, tokens: int, dtype: str) -> float:
    """KV-cache bytes for one request of `tokens` tokens in `dtype` ("fp16", "bf16", "fp8", "int4", "fp32")."""
    if dtype not in DTYPE_BYTES:
        fail("dtype", f"one of {tuple(DTYPE_BYTES)}", dtype)
    cached = sum(tokens if w is None else min(tokens, w) for w in facts.windows)  # token-layers held
    return cached * facts.elements * DTYPE_BYTES[dtype]


# ---------------------------------------------------------------------------------------------- RoPE facts
def _scaling_params(scaling: Any) -> dict[str, Any]:
    params = {k: v for k, v in vars(scaling).items() if k not in ("short_factor", "long_factor")}
    if isinstance(scaling, sc.LongRoPE):
        params["short_factor"] = f"{len(scaling.short_factor)} values in [{min(scaling.short_factor):.4g}, {max(scaling.short_factor):.4g}]"
        params["long_factor"] = f"{len(scaling.long_factor)} values in [{min(scaling.long_factor):.4g}, {max(scaling.long_factor):.4g}]"
    return params


def target_lengths(rope: Rope, cfg: dict[str, Any]) -> tuple[int, int]:
    """`(L0, L1)`: the original (training) length and the target length the scaling is meant to reach.

    L0 is `original_max_position_embeddings` when the scaling or config states it; for linear scaling
    without it, `L1 / factor`; else `max_position_embeddings`. L1 is `max_position_embeddings`, or
    `L0 * factor` for dynamic NTK (whose config states only the original length).
    """
    declared = max_positions(cfg)
    scaling = rope.scaling
    original = getattr(scaling, "original_max_positions", None) or getattr(scaling, "max_positions", None)
    original = original or _first(_text_config(cfg), "original_max_position_embeddings") or declared
    if original is None:
        fail("config['max_position_embeddings']", "a positive integer (the trained length)", "nothing (key missing)")
    if isinstance(scaling, sc.Linear) and original == declared and not _first(_text_config(cfg), "original_max_position_embeddings"):
        original = int(declared / scaling.factor)  # PI: positions up to L1 land where L1 / factor did in training
    target = declared
    if isinstance(scaling, sc.DynamicNTK) or target is None:
        target = int(original * getattr(scaling, "factor", 1.0))
    return int(original), int(target)


def max_tokens(facts: KVFacts, budget_bytes: float, dtype: str, batch: int = 1) -> int | None:
    """The longest request whose cache (times `batch`) fits in `budget_bytes`; None if every layer is windowed."""
    if all(w is not None for w in facts.windows) and batch * kv_bytes(facts, 2**62, dtype) <= budget_bytes:
        return None
    low, high = 0, 2**62  # invariant: low fits, high does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if batch * kv_bytes(facts, mid, dtype) <= budget_bytes else (low, mid)
    return low


def rope_facts(rope: Rope, original: int, target: int) -> dict[str, Any]:
    """Per rotation pair: wavelength (tokens) unscaled and scaled at `target`, and full turns within each length.

    Args:
        rope: the embedding.
        original: L0, the length the model was trained at.
        target: L1, the length the scaling aims for (length-dependent rules are evaluated at L1).
    Returns:
        A dict of scalars and per-pair lists (`wavelength`, `scaled_wavelength`, `turns_l0`, `turns_l1`, `stretch`).
    """
    inv0, _ = sc.Default().inv_freq(rope.base, rope.rotary_dim)  # [r/2] the unscaled ladder
    inv1, factor = rope.inv_freq(target)  # [r/2] what the model uses at L1
    wave0 = [2 * math.pi / float(f) for f in inv0.double()]
    wave1 = [2 * math.pi / float(f) for f in inv1.double()]
    facts: dict[str, Any] = {
        "head_dim": rope.head_dim,
        "rotary_dim": rope.rotary_dim,
        "pairing": rope.pairing,
        "base": rope.base,
        "scaling": rope.scaling.name,  # type: ignore[attr-defined]
        "scaling_params": _scaling_params(rope.scaling),
        "attention_factor": rope.attention_factor,
        "attention_factor_at_l1": factor,
        "softmax_scale_factor": rope.softmax_scale_factor,
        "mrope_section": list(rope.mrope_section) if rope.mrope_section else None,
        "l0": original,
        "l1": target,
        "wavelength": wave0,
        "scaled_wavelength": wave1,
        "turns_l0": [original / w for w in wave0],
        "turns_l1": [target / w for w in wave1],
        "stretch": [b / a for a, b in zip(wave0, wave1)],
    }
    if isinstance(rope.scaling, sc.YaRN):
        facts["yarn_correction_range"] = list(rope.scaling.correction_range(rope.base, rope.rotary_dim))
        facts["yarn_ramp"] = rope.scaling.ramp(rope.base, rope.rotary_dim).tolist()
    return facts


def _ropes(cfg: dict[str, Any]) -> list[tuple[str, Rope]]:
    """`[(layers it applies to, Rope)]`: one entry, or one per layer type when they differ (Gemma 3)."""
    types = _text_config(cfg).get("layer_types")
    try:
        single = Rope.from_hf_config(cfg)
    except PosencError as e:
        if not str(e).startswith("layer_type:"):
            raise
        types = types or ["sliding_attention", "full_attention"]
        single = None
    if isinstance(types, list) and len(set(types)) > 1:
        per_type = [(t, Rope.from_hf_config(cfg, layer_type=t)) for t in dict.fromkeys(types)]  # first-seen order
        if any(rope != per_type[0][1] for _, rope in per_type):
            return [(f"{t} layers", rope) for t, rope in per_type]
        single = per_type[0][1]
    if single is None:
        single = Rope.from_hf_config(cfg, layer_type=types[0])
    return [("all layers", single)]


def _scheme(cfg: dict[str, Any]) -> str:
    model_type = cfg.get("model_type")
    attn = cfg.get("attn_config") if isinstance(cfg.get("attn_config"), dict) else {}
    if (model_type == "falcon" and cfg.get("alibi")) or attn.get("alibi"):
        return "alibi"
    if model_type in NON_ROPE_MODEL_TYPES:
        text = NON_ROPE_MODEL_TYPES[model_type]
        return "alibi" if text.startswith("ALiBi") else ("t5" if text.startswith("T5") else "learned_absolute")
    return "rope"


def inspect_model(
    config: Any,
    *,
    lengths: list[int] | None = None,
    batch: int = 1,
    dtypes: tuple[str, ...] = ("fp16", "bf16", "fp8", "int4"),
    source: str = "",
    memory_gib: float | None = None,
) -> dict[str, Any]:
    """Every fact `posenc inspect` prints, as a JSON-ready dict.

    Args:
        config: a config.json dict or a transformers `PretrainedConfig`.
        lengths: token counts for the KV-cache table (default: L0 and L1).
        batch: requests per batch.
        dtypes: cache element types, from `DTYPE_BYTES`.
        source: where the config came from (shown as is).
        memory_gib: a KV-cache budget in GiB; adds the longest request that fits per dtype at `batch`.
    Returns:
        `{"model", "source", "model_type", "scheme", "l0", "l1", "rope": [...], "scheme_facts", "kv_cache"}`.
    Raises:
        PosencError: an unsupported or inconsistent config, bad lengths, batch or dtype.
    """
    cfg = config_to_dict(config)
    if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
        fail("--batch", "a positive integer", batch)
    for dtype in dtypes:
        if dtype not in DTYPE_BYTES:
            fail("--dtypes", f"names from {tuple(DTYPE_BYTES)}", dtype)
    text = _text_config(cfg)
    scheme = _scheme(text)
    report: dict[str, Any] = {"model": cfg.get("_name_or_path") or source, "source": source,
                              "model_type": cfg.get("model_type"), "scheme": scheme, "rope": [], "scheme_facts": {}}
    l0 = l1 = max_positions(cfg)
    if scheme == "rope":
        for layers, rope in _ropes(cfg):
            l0, l1 = target_lengths(rope, cfg)
            report["rope"].append({"layers": layers, **rope_facts(rope, l0, l1)})
    else:
        report["scheme_facts"] = _other_scheme_facts(scheme, text)
    report["l0"], report["l1"] = l0, l1
    kv = kv_cache_facts(cfg)
    lengths = lengths or sorted({n for n in (l0, l1) if n}) or [4096]
    rows = [{"tokens": n, "label": length_label(n), "dtype": d, "bytes_per_request": kv_bytes(kv, n, d),
             "bytes_per_batch": batch * kv_bytes(kv, n, d)} for n in lengths for d in dtypes]
    report["kv_cache"] = {"kind": kv.kind, "layers": kv.layers, "kv_heads": kv.kv_heads, "head_dim": kv.head_dim,
                          "elements_per_token_per_layer": kv.elements, "windows": sorted({w for w in kv.windows if w}),
                          "batch": batch, "dtypes": list(dtypes), "unit": "GiB = 2**30 bytes", "notes": list(kv.notes),
                          "bytes_per_token": {d: kv_bytes(kv, 1, d) for d in dtypes}, "rows": rows}
    if memory_gib is not None:
        budget = check_positive("--memory", memory_gib) * GIB
        report["kv_cache"]["memory_gib"] = memory_gib
        report["kv_cache"]["max_tokens"] = {d: max_tokens(kv, budget, d, batch) for d in dtypes} if kv.layers else {}
    return report


def _other_scheme_facts(scheme: str, cfg: dict[str, Any]) -> dict[str, Any]:
    heads = _first(cfg, "num_attention_heads", "n_head", "n_heads", "num_heads")
    if scheme == "alibi":
        return {"heads": heads, "summary": "ALiBi: no rotation; each head adds -slope * distance to its scores"
                " (slopes 2^(-8i/n) over the heads, see posenc.alibi_slopes)"}
    if scheme == "t5":
        buckets = cfg.get("relative_attention_num_buckets", 32)
        distance = cfg.get("relative_attention_max_distance", 128)
        return {"heads": heads, "num_buckets": buckets, "max_distance": distance,
                "summary": f"T5 relative bias: {buckets} buckets (half per direction in the encoder), exact below"
                f" {buckets // 4} (encoder) / {buckets // 2} (decoder), log-spaced up to {distance}, one learned"
                " scalar per bucket and head (see posenc.t5_relative_position_bucket)"}
    table = max_positions(cfg)
    return {"heads": heads, "table_rows": table,
            "summary": f"learned absolute positions: a table of {table} rows added to the token embeddings;"
            f" positions >= {table} have no embedding"}
