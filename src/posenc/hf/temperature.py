"""Which layers of a transformers model multiply their queries by a position-dependent temperature, and how
(`posenc.rope.temperature.QueryTemperature`). Llama 4: the NoPE layers, with `attn_temperature_tuning`;
Ministral 3 / Mistral 4: every layer, with `llama_4_scaling_beta` in the rope parameters.

    >>> cfg = {"model_type": "llama4_text", "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 4,
    ...        "attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1}
    >>> [t is not None for t in layer_temperatures(cfg)]
    [False, False, False, True]
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import boolean, fail
from ..rope.temperature import QueryTemperature
from .conventions import config_int, config_to_dict, text_config
from .layers import layer_ropes

__all__ = ["layer_temperatures"]


def layer_temperatures(config: Any) -> tuple[QueryTemperature | None, ...]:
    """Per decoder layer, the query temperature it applies, or None.

    Raises:
        PosencError: a non-bool `attn_temperature_tuning`, bad `floor_scale` / `attn_scale` / beta values, or
            any error of `posenc.hf.layer_ropes`.
    """
    cfg = text_config(config_to_dict(config))
    layers = config_int(cfg, "num_hidden_layers", "n_layer", "n_layers", "num_layers")
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), Mapping) else {}
    beta = params.get("llama_4_scaling_beta") or (cfg.get("rope_scaling") or {}).get("llama_4_scaling_beta")
    if beta:  # Ministral 3: after RoPE, on every layer, steps of the original length
        floor = params.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if floor is None:
            fail("config['rope_parameters']['original_max_position_embeddings']",
                 "the step length of llama_4_scaling_beta's temperature", floor)
        return (QueryTemperature(beta=beta, floor_scale=floor, offset=0, log="log"),) * layers
    if not boolean("config['attn_temperature_tuning']", cfg.get("attn_temperature_tuning", False)):
        return (None,) * layers
    # Llama 4 (Llama4TextConfig defaults: floor_scale 8192, attn_scale 0.1): only the layers without RoPE
    temperature = QueryTemperature(beta=cfg.get("attn_scale", 0.1), floor_scale=cfg.get("floor_scale", 8192), offset=1)
    return tuple(temperature if rope is None else None for rope in layer_ropes(cfg))
