"""The RoPE facts `posenc inspect` reports for one checkpoint, per rotation pair and per branch.

`target_lengths` finds the original length L0 and the target L1 a scaling aims for; `rope_facts` gives, per
rotation pair, the wavelength before and after scaling and the full turns within L0 and L1. The private
helpers list a config's tables per layer type (`_ropes`), its extra rotation branches (`_branch_facts`) and
the layers that reuse another layer's keys (`_kv_sharing`).

Neighbours: `posenc.inspection` (the report `inspect_model` that gathers these; it re-exports the public
names) and `posenc.inspection.config` (configs, presets and lengths).
"""

from __future__ import annotations

import math
from typing import Any

from ..errors import PosencError, fail
from .. import hf
from ..hf import max_positions
from ..hf.conventions import convention
from ..rope import scaling as sc
from ..rope.spec import Rope

__all__ = ["target_lengths", "rope_facts"]


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
