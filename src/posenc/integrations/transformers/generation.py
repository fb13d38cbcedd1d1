"""The generation hooks `patch` replaces on one model instance: Phi-3's cache drop, Qwen2-VL's positions.

- Phi-3 (LongRoPE): `Phi3ForCausalLM.prepare_inputs_for_generation` drops the whole KV cache when the
  sequence first crosses `original_max_position_embeddings` (its keys were rotated with the short factors);
  under a patch the cache policy handles that switch, so the instance gets the parent class's method back.
- Policy "recompute" under a length-dependent rule: `prepare_inputs_for_generation` is wrapped to keep
  `generate()`'s 2-d padding mask on the cache's `Record` (for a static cache it hands the decoder a prepared
  4-d mask, and a re-run over every cached token needs the padding of each; `keep_padding`).
- Qwen2-VL family: `get_rope_index` is replaced by `posenc.mrope_position_ids` (the official rule: the
  token after a vision block starts at the block's largest position + 1; transformers 5.24 starts it at
  `start + max(H, W) / merge`, which differs for videos with more frames than rows or columns).
- Qwen3-VL / Qwen3-VL-MoE / Qwen3.5 / Qwen3.5-MoE: the same, with `timestamps=True` (each video row
  (T, H, W) is T timestamped single-frame blocks); transformers agrees on every real token of a
  processor's prompt (it differs only for an image grid with T > max(H, W) / merge, and in padding slots).
"""

from __future__ import annotations

import functools
import types
from typing import Any

import torch

from ...errors import Raw, fail
from ...rope.mrope_positions import mrope_position_ids
from .policy import Record

__all__ = ["generation_fixes", "keep_padding", "official_rope_index", "innermost", "TIMESTAMP_MODEL_TYPES"]

# Top-level model types whose `get_rope_index` splits each video row into timestamped single frames.
TIMESTAMP_MODEL_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe")


def innermost(fn: Any) -> Any:
    """The function inside `fn`'s decorators (`functools.wraps` chains), or a code-less stand-in."""
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn if hasattr(fn, "__code__") else (lambda: None)


def generation_fixes(model: Any, options: Any, what: str, padding: bool = False) -> list[tuple[Any, str, Any]]:
    """`[(object, attribute, value)]` for the generation hooks of `model` (checked; nothing changed); `padding`:
    keep `generate()`'s 2-d mask on each cache's record (`keep_padding`)."""
    changes = []
    prepare = getattr(model, "prepare_inputs_for_generation", None)
    for cls in type(model).__mro__:
        method = cls.__dict__.get("prepare_inputs_for_generation")
        if method is None:
            continue
        if "original_max_position_embeddings" in innermost(method).__code__.co_names:
            prepare = super(cls, model).prepare_inputs_for_generation  # the cache-keeping generic version
            changes.append((model, "prepare_inputs_for_generation", prepare))
        break
    if padding and callable(prepare):
        changes = [c for c in changes if c[1] != "prepare_inputs_for_generation"]
        changes.append((model, "prepare_inputs_for_generation", keep_padding(prepare)))
    if options.mrope_positions == "posenc":
        owners = [m for m in model.modules() if callable(getattr(m, "get_rope_index", None))]
        timestamps = getattr(model.config, "model_type", None) in TIMESTAMP_MODEL_TYPES
        rule = functools.partial(official_rope_index, timestamps=timestamps) if timestamps else official_rope_index
        for owner in owners:
            changes.append((owner, "get_rope_index", types.MethodType(rule, owner)))
        if owners and not _vision_ids(model.config):
            fail("model", "a config with image_token_id, video_token_id and vision_start_token_id (for "
                 "posenc.mrope_position_ids; pass mrope_positions='transformers' to keep get_rope_index)", Raw(what))
    return changes


def keep_padding(prepare: Any) -> Any:
    """`prepare_inputs_for_generation` that also records the 2-d `attention_mask` it was given on the cache's
    `Record` (the decoder's re-run reads it when the inputs carry a prepared mask instead)."""

    @functools.wraps(prepare)
    def prepare_inputs_for_generation(input_ids: Any, *args: Any, **kwargs: Any) -> Any:
        inputs = prepare(input_ids, *args, **kwargs)
        mask = kwargs.get("attention_mask")
        cache = inputs.get("cache", inputs.get("past_key_values")) if isinstance(inputs, dict) else None
        if cache is not None and callable(getattr(cache, "get_seq_length", None)):
            if mask is None and isinstance(input_ids, torch.Tensor) and input_ids.ndim == 2:
                mask = input_ids.new_ones(input_ids.shape)  # generate() drops a mask without padding
            padding = mask if isinstance(mask, torch.Tensor) and mask.ndim == 2 else None
            Record.of(cache).padding = padding
        return inputs

    return prepare_inputs_for_generation


def _vision_ids(config: Any) -> dict[str, int] | None:
    names = ("image_token_id", "video_token_id", "vision_start_token_id")
    ids = {n: getattr(config, n, None) for n in names}
    return None if any(v is None for v in ids.values()) else ids


def official_rope_index(self: Any, input_ids: torch.Tensor, mm_token_type_ids: Any = None,
                        image_grid_thw: Any = None, video_grid_thw: Any = None, attention_mask: Any = None,
                        second_per_grid_ts: Any = None, *, timestamps: bool = False,
                        **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """`get_rope_index` through `posenc.mrope_position_ids`, returning transformers' `(positions, deltas)`.

    transformers adds `deltas` to `cumsum(attention_mask) - 1` (positions counting real tokens only) when
    decoding; posenc's deltas count padding, so they are shifted by each row's padding here. `timestamps`:
    the Qwen3-VL / Qwen3.5 video rule (bound by `generation_fixes` for `TIMESTAMP_MODEL_TYPES`).
    """
    config = self.config
    vision = getattr(config, "vision_config", None)
    positions, deltas = mrope_position_ids(
        input_ids, image_grid_thw=image_grid_thw, video_grid_thw=video_grid_thw,
        second_per_grid_ts=second_per_grid_ts if getattr(vision, "tokens_per_second", None) is not None else None,
        attention_mask=attention_mask, spatial_merge_size=getattr(vision, "spatial_merge_size", 2),
        tokens_per_second=getattr(vision, "tokens_per_second", None), timestamps=timestamps, **_vision_ids(config))
    if attention_mask is not None:
        deltas = deltas + input_ids.shape[1] - attention_mask.long().sum(-1, keepdim=True).to(deltas.device)
    return positions.to(input_ids.device), deltas.to(input_ids.device)
