"""A vision tower's 2-D rotary table from its transformers config (rope type "axial"): `vision_rope(config)`.

Most towers (Qwen2-VL / Qwen2.5-VL / Qwen3-VL / Qwen3.5 / Qwen3-Omni vision, GLM-4V, GLM-OCR, PaddleOCR-VL,
Ernie 4.5 VL, EXAONE 4.5, LFM3-VL, MLCD, SAM 3, VideoLLaMA 3, ...) rotate the whole head split-half by
`[row angles | column angles]`, each axis on the ladder of a RoPE of width head_dim / 2: `AxialRope(head_dim,
base)`. The rows below are the towers whose layout differs; a tower posenc cannot express is refused by name.

    >>> rope = vision_rope({"model_type": "qwen2_vl", "vision_config": {"model_type": "qwen2_vl_vision",
    ...     "embed_dim": 1280, "num_heads": 16, "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}})
    >>> rope.head_dim, rope.base, rope.axis_order, rope.pairing
    (80, 10000.0, (0, 1), 'split_half')
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import Raw, fail, real
from ..rope.axial import AxialRope
from .conventions import MISSING, config_int, config_to_dict

__all__ = ["vision_rope", "AXIAL_LAYOUTS", "AXIAL_REFUSED"]

# vision config model type -> (axis order, pairing) where it is not ((0, 1), "split_half")
AXIAL_LAYOUTS: dict[str, tuple[tuple[int, ...], str]] = {
    "step3p5_vision": ((1, 0), "split_half"),  # Step3 vision: [column | row]
    "inkling2_vision": ((1, 0), "interleaved"),  # [column | row], each angle on channels 2i, 2i + 1
    **dict.fromkeys(("sam3_vit_model", "sam2_video", "sam3_tracker_video", "edgetam_video"),
                    ((0, 1), "interleaved")),  # SAM 3's ViT; SAM 2 / SAM 3 / EdgeTAM video memory attention
}
AXIAL_REFUSED: dict[str, str] = {
    "pixtral": "one ladder over the whole head, rows on its lower half of frequencies and columns on its upper "
               "half (not a ladder per axis)",
    "kimi_k25_vision": "column and row angles alternating frequency by frequency ([w f0, h f0, w f1, ...])",
    "gemma4_vision": "each axis rotating its own half of the head split-half ([h h | w w])",
    "minimax_m3_vl_vision": "three axes (t, h, w), each on a ladder of width 2 * (head_dim // 3 // 2)",
}
_NESTED = ("vision_config", "vision_encoder_config", "thinker_config", "vision_tower_config", "encoder_config")


def _axial_config(cfg: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The (nested) config dict whose rope parameters say "axial", depth first."""
    params = cfg.get("rope_parameters")
    if isinstance(params, Mapping) and params.get("rope_type") == "axial":
        return cfg
    for key in _NESTED:
        sub = cfg.get(key)
        if isinstance(sub, Mapping) or hasattr(sub, "to_dict"):
            found = _axial_config(config_to_dict(sub))
            if found is not None:
                return found
    return None


def vision_rope(config: Any) -> AxialRope:
    """The `AxialRope` of a vision tower, from its config or from a model config that nests it.

    Args:
        config: a config.json dict or a transformers `PretrainedConfig` (a vision config, or a model config
            with a `vision_config`).
    Returns:
        An `AxialRope`; rotate patches with `rope.rotate(x, positions)`, positions `[patches, 2]` (row, column)
        from `posenc.rope.axial.vision_patch_positions`.
    Raises:
        PosencError: no axial rope parameters, a tower whose layout posenc does not model (`AXIAL_REFUSED`), a
            head size the heads do not divide, a bad `rope_theta`.
    """
    top = config_to_dict(config)
    cfg = _axial_config(top)
    if cfg is None:
        fail("config['rope_parameters']['rope_type']", "'axial' in the config or its vision_config (a vision "
             "tower's 2-D rotary table)", MISSING)
    model_type = cfg.get("model_type")
    if model_type in AXIAL_REFUSED:
        fail("config['model_type']", "a vision tower whose 2-D rotation posenc models",
             Raw(f"{model_type!r}, which applies {AXIAL_REFUSED[model_type]}"))
    params = cfg["rope_parameters"]
    where = "config['rope_parameters']['rope_theta']"
    base = real(where, params.get("rope_theta", 10000.0), gt=0.0)
    if cfg.get("head_dim") is not None:
        head_dim = config_int(cfg, "head_dim")
    elif cfg.get("memory_attention_hidden_size") is not None:  # SAM 2 / SAM 3 video, EdgeTAM: memory attention
        width = config_int(cfg, "memory_attention_hidden_size")
        split = config_int(cfg, "memory_attention_downsample_rate") * config_int(cfg, "memory_attention_num_attention_heads")
        if width % split:
            fail("config['memory_attention_hidden_size']", "a multiple of memory_attention_downsample_rate * "
                 f"memory_attention_num_attention_heads = {split}", width)
        head_dim = width // split
    else:
        width_key = "embed_dim" if cfg.get("embed_dim") is not None else "hidden_size"
        heads_key = "num_attention_heads" if cfg.get("num_attention_heads") is not None else "num_heads"
        width, heads = config_int(cfg, width_key), config_int(cfg, heads_key)
        if width % heads:
            fail(f"config['{width_key}']", f"a multiple of {heads_key}={heads} (or an explicit head_dim)", width)
        head_dim = width // heads
    order, pairing = AXIAL_LAYOUTS.get(model_type, ((0, 1), "split_half"))
    return AxialRope(head_dim=head_dim, base=base, axis_order=order, pairing=pairing)
