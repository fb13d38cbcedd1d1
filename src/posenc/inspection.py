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
from importlib import resources
from pathlib import Path
from typing import Any

from .errors import PosencError, Raw, choice, fail, integer, prefix, real
from . import hf
from .hf import KVFacts, config_to_dict, kv_cache_facts, max_positions
from .hf.conventions import convention
from .rope import scaling as sc
from .rope.spec import Rope

__all__ = ["load_config", "load_preset", "inspect_source", "preset_names", "parse_lengths", "kv_cache_facts", "kv_bytes", "element_bytes", "kv_label", "rope_facts", "inspect_model",
           "max_tokens", "target_lengths", "length_label", "DTYPE_BYTES", "KVFacts"]

DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int4": 0.5}  # int4: without quantisation scales
GIB = 2**30
MAX_TOKENS = 2**32  # 4096m tokens: a length beyond it is a typo, not a model (the longest contexts are ~10m)


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
        return load_preset(name), f"preset {name}"
    if path.suffix == ".json" or "/" in model_or_config or "\\" in model_or_config:  # meant as a path
        fail("MODEL_OR_CONFIG", "an existing config.json or directory", Raw(f"{model_or_config!r} (file not found)"))
    fail("MODEL_OR_CONFIG", f"a config.json, a directory holding one, or a preset ({', '.join(preset_names())})",
         model_or_config)


def load_preset(name: str) -> dict[str, Any]:
    """The config.json dict of a bundled model (`preset_names()` lists them), ready for `from_hf_config`.

        >>> cfg = load_preset("llama-3.2-1b")
        >>> cfg["model_type"], cfg["rope_scaling"]["rope_type"]
        ('llama', 'llama3')

    Args:
        name: a preset name such as "llama-3.1-8b" (case-insensitive).
    Returns:
        A fresh dict (changing it does not change the preset).
    Raises:
        PosencError: no such preset.
    """
    names = preset_names()
    if not isinstance(name, str) or name.lower() not in names:
        fail("name", f"a bundled preset ({', '.join(names)})", name)
    return json.loads((resources.files("posenc") / "presets" / f"{name.lower()}.json").read_text())


def parse_lengths(text: str, arg: str = "--lengths") -> list[int]:
    """Token counts from "4k,32k,128k" (k = 1024, m = 1024**2) or plain integers.

    Args:
        text: the comma-separated counts.
        arg: the option's name for messages.
    Returns:
        The counts, in the order given.
    Raises:
        PosencError: empty text, a count that is not a whole number in [1, MAX_TOKENS].
    """
    lengths = []
    for item in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", item)
        if not match:
            fail(arg, "comma-separated token counts such as 4k,32k,128k or 4096", text)
        value = float(match.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[match.group(2).lower()]
        if value != int(value) or not 0 < value <= MAX_TOKENS:
            fail(arg, f"whole numbers of tokens in [1, {MAX_TOKENS}] ({length_label(MAX_TOKENS)})", item.strip())
        lengths.append(int(value))
    return lengths


def length_label(tokens: int) -> str:
    """4096 -> "4k", 131072 -> "128k", 1048576 -> "1m", 4000 -> "4000"."""
    if tokens % 1024**2 == 0:
        return f"{tokens // 1024**2}m"
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


# ---------------------------------------------------------------------------------------------- memory
def kv_bytes(facts: KVFacts, tokens: int, dtype: str) -> float:
    """KV-cache bytes for one request of `tokens` tokens in `dtype` ("fp16", "bf16", "fp8", "int4", "fp32"),
    or in a posenc quantized cache `"FORMAT:post"` / `"FORMAT:pre"` (see `element_bytes`)."""
    per_layer = facts.layer_elements or (facts.elements,) * len(facts.windows)
    cached = sum((tokens if w is None else min(tokens, w)) * e for w, e in zip(facts.windows, per_layer))  # numbers held
    return cached * element_bytes(facts, dtype)


def element_bytes(facts: KVFacts, dtype: str, arg: str = "dtype") -> float:
    """Bytes per cached number: `DTYPE_BYTES[dtype]` (bare elements), or what posenc's quantized cache
    stores for `"FORMAT:pre|post"` (`posenc.kv_cache_quant.bytes_per_number`). PosencError naming `arg`."""
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    from .kv_cache_quant import bytes_per_number

    return bytes_per_number(dtype, max(facts.kv_heads or 1, 1), max(facts.head_dim or 1, 1), arg=arg)


def kv_label(kv_dtype: str) -> str:
    """`"int4"` -> `"int4:post"`, `"bf16:pre"` -> `"bfloat16:pre"`: a `--kv-dtype` as its table column."""
    from .kv_cache_quant import kv_label as label

    return label(kv_dtype, "post")


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
    stated = hf.original_max_positions(cfg)
    original = original or stated or declared
    if original is None:
        fail("config['max_position_embeddings']", "a positive integer (the trained length)", "nothing (key missing)")
    if isinstance(scaling, sc.Linear) and original == declared and not stated:
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
    # a pair with frequency 0 (p-RoPE's upper pairs) never turns: wavelength inf, 0 turns
    wave0 = [2 * math.pi / float(f) if f > 0 else math.inf for f in inv0.double()]
    wave1 = [2 * math.pi / float(f) if f > 0 else math.inf for f in inv1.double()]
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
        "direction": rope.direction,  # -1: turns by -theta (nanochat); wavelengths and turns are the same
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
    """`[(layers it applies to, Rope)]`: one entry, or one per layer type when they differ (Gemma 3); layer types
    and single layers without RoPE (Cohere 2's global layers, SmolLM3's NoPE layers) are left out of the labels."""
    every = hf.rope_by_layer_type(cfg)
    by_type = {t: r for t, r in every.items() if r is not None}
    try:
        without = [i for i, r in enumerate(hf.layer_ropes(cfg)) if r is None]
    except PosencError:  # no layer count: per layer type only
        without = []
    uniform = len(set(by_type.values())) == 1 and len(by_type) == len(every)
    entries = [("all layers", next(iter(by_type.values())))] if uniform else [
        (f"{t} layers", r) for t, r in by_type.items()]
    if without and uniform:
        entries = [(f"all layers but {without} (no RoPE)", entries[0][1])]
    return entries


def _branch_facts(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """`[{branch, head_dim, rotary_dim, pairing, base, scaling, direction}]` for a model whose layers rotate with
    more than one table or pairing (DeepSeek-V4's main / compress, DSA indexers; `posenc.hf.branch_ropes`); []
    for every other model, and for a DSA model without one table for every layer (dots3's per-layer-type
    tables, Mistral Large 4's NoPE layers: `branch_ropes` takes that one table; the RoPE blocks show them)."""
    conv = convention(hf.text_config(cfg))
    if not conv.rope_keys and conv.indexer is None:
        return []
    if not conv.rope_keys:
        try:
            hf.rope_from_hf_config(cfg)
        except PosencError:  # a table per layer type or NoPE layers (real config errors surfaced in _ropes)
            return []
    return [{"branch": name, "head_dim": r.head_dim, "rotary_dim": r.rotary_dim, "pairing": r.pairing, "base": r.base,
             "scaling": r.scaling.name, "direction": r.direction}  # type: ignore[attr-defined]
            for name, r in hf.branch_ropes(cfg).items()]


def _kv_sharing(cfg: dict[str, Any]) -> list[list[int]]:
    """`[[layer, source layer]]` for the layers that reuse an earlier layer's rotated keys and rotate only q
    (Gemma 3n / Gemma 4 `num_kv_shared_layers`, Mistral Large 4 `kv_source_layers`; `posenc.hf.kv_sources`)."""
    text = hf.text_config(cfg)
    if not text.get("num_kv_shared_layers") and text.get("kv_source_layers") is None:
        return []
    return [[i, source] for i, source in enumerate(hf.kv_sources(cfg)) if source is not None]


def inspect_model(
    config: Any,
    *,
    lengths: list[int] | None = None,
    batch: int = 1,
    dtypes: tuple[str, ...] = ("fp16", "bf16", "fp8", "int4"),
    source: str = "",
    memory_gib: float | None = None,
    kv_dtype: str | None = None,
) -> dict[str, Any]:
    """Every fact `posenc inspect` prints, as a JSON-ready dict.

    Args:
        config: a config.json dict or a transformers `PretrainedConfig`.
        lengths: token counts for the KV-cache table (default: L0 and L1).
        batch: requests per batch.
        dtypes: cache element types, from `DTYPE_BYTES`.
        source: where the config came from (shown as is).
        memory_gib: a KV-cache budget in GiB; adds the longest request that fits per dtype at `batch`.
        kv_dtype: a posenc quantized cache format, `"int4"` or `"int4:pre"` (`kv_label`); replaces `dtypes`
            with its one column, counting codes and scales (`element_bytes`).
    Returns:
        `{"model", "source", "model_type", "scheme", "l0", "l1", "rope": [...], "branches": [...],
        "kv_sharing": [[layer, source], ...], "scheme_facts", "kv_cache"}` (branches and kv_sharing are empty
        for a model without them);
        lengths past the model's declared maximum (L1) are flagged (`beyond_max`, `max_tokens_beyond_max`).
    Raises:
        PosencError: an unsupported or inconsistent config, bad lengths, batch or dtype.
    """
    cfg = config_to_dict(config)
    batch = integer("--batch", batch, min=1)
    if not dtypes:
        fail("--dtypes", f"at least one name from {tuple(DTYPE_BYTES)}", Raw("none"))
    for dtype in dtypes:
        choice("--dtypes", dtype, tuple(DTYPE_BYTES))
    if kv_dtype is not None:
        dtypes = (kv_label(kv_dtype),)
    text = hf.text_config(cfg)
    scheme = hf.position_scheme(text)
    report: dict[str, Any] = {"model": cfg.get("_name_or_path") or source, "source": source,
                              "model_type": cfg.get("model_type"), "scheme": scheme, "rope": [], "branches": [],
                              "kv_sharing": [], "scheme_facts": {}}
    l0 = l1 = max_positions(cfg)
    if scheme == "rope":
        for layers, rope in _ropes(cfg):
            l0, l1 = target_lengths(rope, cfg)
            report["rope"].append({"layers": layers, **rope_facts(rope, l0, l1)})
        report["branches"], report["kv_sharing"] = _branch_facts(cfg), _kv_sharing(cfg)
    else:
        report["scheme_facts"] = _other_scheme_facts(scheme, text)
    report["l0"], report["l1"] = l0, l1
    kv = kv_cache_facts(cfg)
    per_element = {d: element_bytes(kv, d, "--kv-dtype") for d in dtypes}  # refuses before any table is built
    lengths = lengths or sorted({n for n in (l0, l1) if n}) or [4096]
    beyond = lambda n: bool(l1) and n is not None and n > l1  # noqa: E731  past the declared maximum
    rows = [{"tokens": n, "label": length_label(n), "dtype": d, "bytes_per_request": kv_bytes(kv, n, d),
             "bytes_per_batch": batch * kv_bytes(kv, n, d), "beyond_max": beyond(n)} for n in lengths for d in dtypes]
    report["kv_cache"] = {"kind": kv.kind, "layers": kv.layers, "kv_heads": kv.kv_heads, "head_dim": kv.head_dim,
                          "elements_per_token_per_layer": kv.elements, "windows": sorted({w for w in kv.windows if w}),
                          "batch": batch, "dtypes": list(dtypes), "unit": "GB = 2**30 bytes (GiB)", "notes": list(kv.notes),
                          "bytes_per_token": {d: kv_bytes(kv, 1, d) for d in dtypes}, "bytes_per_element": per_element,
                          "rows": rows}
    if memory_gib is not None:
        budget = real("--memory", memory_gib, gt=0) * GIB
        report["kv_cache"]["memory_gib"] = memory_gib
        report["kv_cache"]["max_tokens"] = {d: max_tokens(kv, budget, d, batch) for d in dtypes} if kv.layers else {}
        report["kv_cache"]["max_tokens_beyond_max"] = {d: beyond(n) for d, n in report["kv_cache"]["max_tokens"].items()}
    return report


def inspect_source(model_or_config: str, **options: Any) -> dict[str, Any]:
    """`load_config` then `inspect_model`, with a bad config's values named under its file or preset.

        >>> inspect_source("llama-2-7b", lengths=[4096])["kv_cache"]["rows"][0]["bytes_per_request"] / 2**30
        2.0

    Args:
        model_or_config: a config.json path, a directory holding one, or a preset name.
        options: `inspect_model`'s keyword arguments (lengths, batch, dtypes, memory_gib).
    Returns:
        The `inspect_model` report.
    Raises:
        PosencError: a bad option (named as the option, e.g. `--batch`), or a bad config value named
            by where it is, e.g. `path/config.json['rope_scaling']['factor']: expected ...`.
    """
    cfg, source = load_config(model_or_config)
    where = source.removeprefix("preset ")
    try:
        return inspect_model(cfg, source=source, **options)
    except PosencError as e:
        if e.arg is not None and e.arg.startswith("--"):  # an option, named as the user typed it
            raise
        if e.arg is not None and e.arg.startswith("config[") and e.expected is not None:  # the adapter's name
            arg = where + e.arg[len("config"):]
            raise PosencError(f"{arg}: expected {e.expected}, got {e.got}", arg=arg, expected=e.expected,
                              got=e.got) from None
        with prefix(where):
            raise


def _other_scheme_facts(scheme: str, cfg: dict[str, Any]) -> dict[str, Any]:
    facts = hf.scheme_facts(cfg)
    if scheme == "alibi":
        facts["summary"] = ("ALiBi: no rotation; each head adds -slope * distance to its scores"
                            " (slopes 2^(-8i/n) over the heads, see posenc.alibi_slopes)")
    elif scheme == "t5":
        buckets, distance = facts["num_buckets"], facts["max_distance"]
        facts["summary"] = (f"T5 relative bias: {buckets} buckets (half per direction in the encoder), exact below"
                            f" {buckets // 4} (encoder) / {buckets // 2} (decoder), log-spaced up to {distance}, one"
                            " learned scalar per bucket and head (see posenc.t5_relative_position_bucket)")
    else:
        table = facts["table_rows"]
        facts["summary"] = (f"learned absolute positions: a table of {table} rows added to the token embeddings;"
                            f" positions >= {table} have no embedding")
    return facts
