"""The facts a transformers config class holds beyond a config.json dict: its defaults and its key aliases.

A config.json dict omits what its config class fills in (a default `head_dim`, a default `rope_parameters`, a
`partial_rotary_factor`, the `layer_types` pattern) and may name keys by the class's aliases (`attribute_map`:
Moonshine's `num_attention_heads` is `decoder_num_attention_heads`). For the families in the `Convention`
table those facts are data (`posenc.hf.conventions`), so posenc reads their dicts the same with or without
transformers installed. For any other model type transformers ships, the dict is read through its config class
when transformers is importable (the class is the only place those defaults are written down); without
transformers the dict is read as given, with transformers 5.x's standard keys.
"""

from __future__ import annotations

import copy
from typing import Any

__all__ = ["with_class_defaults", "with_aliases"]


def with_aliases(out: dict[str, Any], config: Any) -> dict[str, Any]:
    """`out` (a config's `to_dict()`) plus the class's alias keys (`attribute_map`) it does not spell out."""
    for alias in getattr(type(config), "attribute_map", None) or {}:
        if alias not in out:
            try:
                value = getattr(config, alias)
            except (AttributeError, ValueError):  # per-layer attributes refuse a global read
                continue
            if value is not None:
                out[alias] = value
    return out


def with_class_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` completed by its transformers config class (defaults, standardised rope parameters, aliases).

    Returns `cfg` unchanged when transformers is not importable, the model type is not one it ships, or its
    config class refuses the dict (posenc's own checks then apply to the dict as given).
    """
    model_type = cfg.get("model_type")
    try:
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        from transformers.utils import logging
    except ImportError:
        return cfg
    if model_type not in CONFIG_MAPPING_NAMES:
        return cfg
    kwargs = copy.deepcopy({k: v for k, v in cfg.items() if k != "model_type"})  # transformers edits nested dicts
    verbosity = logging.get_verbosity()
    logging.set_verbosity(logging.CRITICAL)  # the class's warnings about unused keys are not posenc's to print
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
        out = with_aliases(dict(config.to_dict()), config)
    except Exception:  # noqa: BLE001 - transformers refuses this dict: read it as given
        return cfg
    finally:
        logging.set_verbosity(verbosity)
    for key, value in cfg.items():
        out.setdefault(key, value)
    return out
