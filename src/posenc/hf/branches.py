"""Attention branches with their own rotary table or layout, and layers that rotate only their queries.

`rope_by_layer_type` answers "which table does a layer of this type use"; some models also rotate inside a
layer with a second table or a second pairing, or reuse keys another layer rotated:

- DeepSeek-V4: tables keyed by branch, `"main"` (sliding-window layers) and `"compress"` (compressed layers,
  their compressors and their indexer). Each rotates the *trailing* `head_dim` channels of a head
  (`[nope | rope]`) with interleaved pairs: rotate `x[..., -rope.head_dim:]`.
- DSA models (DeepSeek-V3.2, AXK2, GLM-MoE-DSA, dots3, Mistral Large 4): `"attention"`, the MLA rope slice
  (`interleaved_to_split_half` whatever `rope_interleave` says), and `"indexer"`, the lightning indexer's
  heads of `index_head_dim` channels whose *leading* `qk_rope_head_dim` rotate with the same table
  (split-half pairs in DeepSeek-V3.2 and AXK2, de-interleaved in the others).
- Gemma 3n / Gemma 4 (`num_kv_shared_layers`), Mistral Large 4 (`kv_source_layers`): layers that reuse the keys
  (already rotated) of an earlier layer and rotate only q (`kv_sources`).

    >>> cfg = {"model_type": "deepseek_v32", "hidden_size": 64, "num_attention_heads": 2, "qk_rope_head_dim": 16,
    ...        "index_head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    >>> {k: (r.head_dim, r.rotary_dim, r.pairing) for k, r in branch_ropes(cfg).items()}
    {'attention': (16, 16, 'interleaved_to_split_half'), 'indexer': (32, 16, 'split_half')}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from ..errors import Raw, fail, integer
from ..rope.spec import Rope
from .conventions import MISSING, config_int, layer_type_list
from .layers import _text, layer_ropes, rope_from_hf_config
from .rope import build_rope

__all__ = ["branch_ropes", "kv_sources"]


def branch_ropes(config: Any) -> dict[str, Rope]:
    """`{branch: Rope}` for a model whose attention rotates with more than one table or pairing.

    Args:
        config: a config.json dict or a transformers `PretrainedConfig`.
    Returns:
        DeepSeek-V4: `{"main", "compress"}`; DSA models: `{"attention", "indexer"}`; any other model:
        `{"attention": rope_from_hf_config(config)}`. Each Rope's `head_dim` is the width it rotates (see the
        module docstring for where that slice sits in the head).
    Raises:
        PosencError: as `rope_from_hf_config`; a DSA config without a valid `index_head_dim` (>= the rope
            slice), or a DeepSeek-V4 config without its branch dicts.
    """
    cfg, conv = _text(config)
    if conv.rope_keys:  # every branch from its own dict (a config may have no layer of one of them)
        params = cfg.get("rope_parameters")
        out = {}
        for _, key in conv.rope_keys:
            if not isinstance(params, Mapping) or not isinstance(params.get(key), Mapping):
                fail(f"config['rope_parameters']['{key}']", f"a dict of rope parameters ({cfg['model_type']} keys "
                     f"its tables by branch: {[k for _, k in conv.rope_keys]})", MISSING)
            out[key] = build_rope(cfg, conv, params[key], f"config['rope_parameters']['{key}']")
        return out
    attention = rope_from_hf_config(config)
    if conv.indexer is None:
        return {"attention": attention}
    width = config_int(cfg, "index_head_dim", default=128)  # the DSA config classes' default
    if width < attention.rotary_dim:
        fail("config['index_head_dim']", f"at least qk_rope_head_dim = {attention.rotary_dim} (the indexer rotates "
             "that many leading channels)", width)
    indexer = dataclasses.replace(attention, head_dim=width, pairing=conv.indexer, softmax_scale_factor=1.0)
    return {"attention": attention, "indexer": indexer}  # the indexer scores at index_head_dim**-0.5, no mscale


def _checked_sources(config: Any, listed: list[int]) -> tuple[int | None, ...]:
    """Mistral Large 4's listed sources, refused where its attention would read another layer's keys: a reusing
    layer reads the keys last stored by a layer of its kind (RoPE or NoPE), whatever the list says."""
    rotates = [rope is not None for rope in layer_ropes(config)]
    stored: dict[bool, int] = {}
    for i, source in enumerate(listed):
        if source != i and stored.get(rotates[i]) != source:
            fail(f"config['kv_source_layers'][{i}]", f"{stored.get(rotates[i])}, the last earlier layer that stores "
                 f"{'RoPE' if rotates[i] else 'NoPE'} keys (transformers reads that one for layer {i})", source)
        if source == i and i in listed[i + 1:]:
            stored[rotates[i]] = i
    return tuple(None if source == i else source for i, source in enumerate(listed))


def kv_sources(config: Any) -> tuple[int | None, ...]:
    """Per decoder layer, the earlier layer whose keys (already rotated) it reuses, or None (it rotates its own).

    Gemma 3n / Gemma 4 (`num_kv_shared_layers` = n): each of the last n layers reads the keys and values stored
    by the last layer of its own type before them, and rotates only its queries (with the same table). Mistral
    Large 4 (`kv_source_layers`): layer i reads the rotated latent keys of layer `kv_source_layers[i]` and rotates
    only its queries (its indexer keeps its own keys unless the indexer is shared too).

    Args:
        config: a config.json dict or a transformers `PretrainedConfig`.
    Returns:
        `num_hidden_layers` entries.
    Raises:
        PosencError: `num_kv_shared_layers` outside [0, num_hidden_layers), a shared layer type that no
            earlier layer produces, a `kv_source_layers` of another length or pointing forward or to a reusing layer.
    """
    cfg, _ = _text(config)
    count = config_int(cfg, "num_hidden_layers")
    listed = cfg.get("kv_source_layers")
    if isinstance(listed, (list, tuple)):  # Mistral Large 4: the source of every layer, spelled out
        if len(listed) != count:
            fail("config['kv_source_layers']", f"{count} entries (num_hidden_layers)", Raw(f"{len(listed)} entries"))
        for i, source in enumerate(listed):
            integer(f"config['kv_source_layers'][{i}]", source, min=0, max=i, what=f"a layer index in [0, {i}]")
            if listed[source] != source:
                fail(f"config['kv_source_layers'][{i}]", "a layer that computes its own keys (its own entry is "
                     "itself)", source)
        return _checked_sources(config, list(listed))
    shared = cfg.get("num_kv_shared_layers") or 0
    shared = integer("config['num_kv_shared_layers']", shared, min=0, max=count - 1,
                     what=f"an integer in [0, num_hidden_layers - 1 = {count - 1}]")
    if not shared:
        return (None,) * count
    types = layer_type_list(cfg, count) or ["full_attention"] * count
    first = count - shared
    out: list[int | None] = [None] * first
    for i in range(first, count):
        producers = [j for j in range(first) if types[j] == types[i]]
        if not producers:
            fail("config['num_kv_shared_layers']", f"a value leaving a {types[i]} layer before layer {first} (layer "
                 f"{i} reuses the keys of the last earlier layer of its type)", Raw(f"{shared} (none there)"))
        out.append(producers[-1])
    return tuple(out)
