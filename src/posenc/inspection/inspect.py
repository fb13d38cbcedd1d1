"""Facts about one checkpoint's positional encoding and KV cache, as plain data (what `posenc inspect` prints).

`inspect_model(cfg)` returns a JSON-ready dict: the scheme; for RoPE models the head and rotary widths,
pairing, base, scaling rule, attention factor and, per rotation pair, the wavelength in tokens before and
after scaling with the number of full turns within the original length L0 and the target length L1; and
the KV-cache memory per request and per batch. Configs come from a `config.json` path, a directory holding
one, or a bundled preset (`preset_names()`).

This module holds the report (`inspect_model`, `inspect_source`) and the KV-cache memory arithmetic; reading
configs, presets and lengths is in `config.py`, the RoPE facts in `rope.py`, and the text rendering in `text.py`.

Memory is in GiB (2**30 bytes): LLaMA-2-7B caches 2 x 32 layers x 32 KV heads x 128 x 2 bytes = 512 KiB per
token in fp16, so 4096 tokens take 2 GiB:

    >>> cfg, _ = load_config("llama-2-7b")
    >>> kv = kv_cache_facts(cfg)
    >>> kv_bytes(kv, 4096, "fp16") / 2**30
    2.0
"""

from __future__ import annotations

from typing import Any

from ..errors import PosencError, Raw, choice, fail, integer, prefix, real
from .. import hf
from ..hf import KVFacts, config_to_dict, kv_cache_facts, max_positions
from .config import length_label, load_config
from .rope import _branch_facts, _kv_sharing, _ropes, rope_facts, target_lengths

__all__ = ["inspect_source", "inspect_model", "kv_bytes", "element_bytes", "kv_label", "max_tokens", "DTYPE_BYTES", "GIB"]

DTYPE_BYTES = {"fp32": 4.0, "fp16": 2.0, "bf16": 2.0, "fp8": 1.0, "int4": 0.5}  # int4: without quantisation scales
GIB = 2**30


# ---------------------------------------------------------------------------------------------- memory
def kv_bytes(facts: KVFacts, tokens: int, dtype: str) -> float:
    """KV-cache bytes for one request of `tokens` tokens in `dtype` ("fp16", "bf16", "fp8", "int4", "fp32"),
    or in a posenc quantized cache `"FORMAT:post"` / `"FORMAT:pre"` (see `element_bytes`)."""
    per_layer = facts.layer_elements or (facts.elements,) * len(facts.windows)
    cached = sum((tokens if w is None else min(tokens, w)) * e for w, e in zip(facts.windows, per_layer))  # numbers held
    return cached * element_bytes(facts, dtype)


def element_bytes(facts: KVFacts, dtype: str, arg: str = "dtype") -> float:
    """Bytes per cached number: `DTYPE_BYTES[dtype]` (bare elements), or what posenc's quantized cache
    stores for `"FORMAT:pre|post"` (`posenc.cache.quant.bytes_per_number`). PosencError naming `arg`."""
    if dtype in DTYPE_BYTES:
        return DTYPE_BYTES[dtype]
    from ..cache.quant.kvcache import bytes_per_number

    return bytes_per_number(dtype, max(facts.kv_heads or 1, 1), max(facts.head_dim or 1, 1), arg=arg)


def kv_label(kv_dtype: str) -> str:
    """`"int4"` -> `"int4:post"`, `"bf16:pre"` -> `"bfloat16:pre"`: a `--kv-dtype` as its table column."""
    from ..cache.quant.kvcache import kv_label as label

    return label(kv_dtype, "post")


def max_tokens(facts: KVFacts, budget_bytes: float, dtype: str, batch: int = 1) -> int | None:
    """The longest request whose cache (times `batch`) fits in `budget_bytes`; None if every layer is windowed."""
    if all(w is not None for w in facts.windows) and batch * kv_bytes(facts, 2**62, dtype) <= budget_bytes:
        return None
    low, high = 0, 2**62  # invariant: low fits, high does not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if batch * kv_bytes(facts, mid, dtype) <= budget_bytes else (low, mid)
    return low


# ---------------------------------------------------------------------------------------------- the report
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
