"""Replacing the RoPE rule of a transformers config: the one place a rule is written back into config keys.

`with_rope_rule(config, rule)` writes transformers 5.x's `rope_parameters` (the rule with the config's theta),
drops 4.x's `rope_scaling`, and keeps a top-level `rope_theta`; a `max_position_embeddings` key inside the rule
replaces the config's (dynamic NTK reads its L0 there, and `posenc verify` lowers it per rule).

    >>> cfg = with_rope_rule({"model_type": "llama", "rope_theta": 5e5}, {"rope_type": "yarn", "factor": 2.0})
    >>> cfg["rope_parameters"]
    {'rope_type': 'yarn', 'factor': 2.0, 'rope_theta': 500000.0}
"""

from __future__ import annotations

from typing import Any, Mapping

from ..errors import fail, integer

__all__ = ["with_rope_rule"]


def with_rope_rule(config: Mapping[str, Any], rule: Mapping[str, Any] | None, *,
                   name: str = "rope_scaling") -> dict[str, Any]:
    """A copy of the config dict `config` whose RoPE rule is `rule` (None: the config as it is).

    Args:
        config: a config.json dict of a model with one RoPE for every layer (Llama, Mistral, Qwen 2, ...).
        rule: a transformers-style rule (`{"rope_type": "yarn", "factor": 2.0, ...}`, 4.x's `type` too); its
            `rope_theta` replaces the config's, its `max_position_embeddings` the config's L0; else None.
        name: the caller's argument name, for messages.
    Returns:
        The new dict (`config` is not changed): `rope_parameters` = the rule with `rope_theta` (the rule's, else
        the config's top-level or `rope_parameters` theta; absent when neither has one).
    Raises:
        PosencError: a rule that is not a dict, a `max_position_embeddings` that is not an integer >= 1.
    """
    cfg = dict(config)
    if rule is None:
        return cfg
    if not isinstance(rule, Mapping):
        fail(name, "None or a transformers-style dict such as {'rope_type': 'yarn', 'factor': 2.0}", rule)
    params = dict(rule)
    if "max_position_embeddings" in params:
        cfg["max_position_embeddings"] = integer(f"{name}['max_position_embeddings']",
                                                 params.pop("max_position_embeddings"), min=1)
    old = cfg.pop("rope_parameters", None)
    cfg.pop("rope_scaling", None)
    theta = params.pop("rope_theta", cfg.get("rope_theta", (old or {}).get("rope_theta")))
    if "rope_type" not in params and "type" not in params:
        params["rope_type"] = "default"
    if theta is not None:
        cfg["rope_theta"] = params["rope_theta"] = theta
    cfg["rope_parameters"] = params
    return cfg
