"""Which RoPE each layer of a transformers model applies, and `rope_from_hf_config` on top of it.

Most models apply one RoPE everywhere. Gemma 3 and OLMo 3 give sliding-window layers their own theta;
Cohere 2 and EXAONE 4 rotate only their sliding layers; SmolLM3 leaves every 4th layer without RoPE.
For those, `rope_from_hf_config` never picks one silently: the caller names a `layer_type`, or asks
`layer_ropes` for one entry per layer.

    >>> rope = rope_from_hf_config({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
    ...                             "rope_theta": 500000.0})
    >>> rope.head_dim, rope.rotary_dim, rope.base, rope.pairing
    (16, 16, 500000.0, 'split_half')
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..errors import Raw, fail
from ..rope.spec import Rope
from .conventions import (MISSING, NON_ROPE_MODEL_TYPES, Convention, config_int, config_to_dict, convention,
                          layer_type_list, positional_layer, text_config)
from .rope import build_rope, rope_type_of

__all__ = ["rope_from_hf_config", "layer_ropes", "rope_by_layer_type"]

_LAYER_TYPES = ("full_attention", "sliding_attention")
_Params = tuple[Any, str]  # (a rope-parameter dict or None for a NoPE layer; where it was read)


def _text(config: Any) -> tuple[dict[str, Any], Convention]:
    """The text config and its `Convention`; non-RoPE and unknown model types are refused."""
    cfg = text_config(config_to_dict(config))
    model_type = cfg.get("model_type")
    if model_type in NON_ROPE_MODEL_TYPES:
        fail("config['model_type']", "a model that uses RoPE",
             Raw(f"{model_type!r}, which uses {NON_ROPE_MODEL_TYPES[model_type]}"))
    if model_type is None:
        fail("config['model_type']", "a model type name such as 'llama' (every transformers config.json has one)",
             MISSING)
    conv = convention(cfg)
    if conv.refused is not None:
        fail("config['model_type']", "a model whose rotation posenc models",
             Raw(f"{model_type!r}, which applies {conv.refused}"))
    if conv.alibi_key is not None and cfg.get(conv.alibi_key):
        fail(f"config['{conv.alibi_key}']", "false (this config uses ALiBi, not RoPE: see posenc.alibi_slopes)",
             cfg[conv.alibi_key])
    return cfg, conv


def _layer_params(cfg: dict[str, Any], conv: Convention) -> dict[str | None, _Params]:
    """`{layer type (None: every layer): (params, where)}` as the config gives them; a Gemma 3 / OLMo 3 style
    model (`conv.local_theta`) has both layer types, resolved when built (`_local_params`)."""
    scaling, params = cfg.get("rope_scaling"), cfg.get("rope_parameters")
    for key, value in (("rope_scaling", scaling), ("rope_parameters", params)):
        if value is not None and not isinstance(value, Mapping):
            fail(f"config['{key}']", "a dict of rope parameters or null", value)
    # one dict per layer type (or per branch: DeepSeek-V4's "main" / "compress"): every value a dict or null
    nested = bool(params) and all(isinstance(v, Mapping) or v is None for v in params.values())
    if nested:
        layers = {k: (None if v is None else dict(v), f"config['rope_parameters']['{k}']") for k, v in params.items()}
    elif conv.local_theta is None:
        return {None: (dict(scaling or params or conv.default_params), "config['rope_scaling']" if scaling else "config['rope_parameters']")}
    elif params:
        fail("config['rope_parameters']", f"one dict per layer type {list(_LAYER_TYPES)} ({cfg['model_type']} has "
             "per-layer RoPE)", Raw(f"a flat dict with keys {sorted(params)}"))
    else:
        layers = {}
    if conv.local_theta is not None:
        for name in _LAYER_TYPES:
            layers.setdefault(name, (None, f"config['rope_parameters']['{name}']"))
    return layers


def _local_params(cfg: dict[str, Any], conv: Convention, name: str, given: dict[str, Any] | None) -> _Params:
    """Gemma 3 / OLMo 3 (config classes' convert_rope_params_to_dict): 4.x rope_scaling and rope_theta go to the
    full-attention layers; the sliding layers run the default rope at their own theta.

    Raises:
        PosencError: a 4.x `type` key merged into the full-attention dict; a top-level rope_theta for sliding
            layers whose theta the config does not name (4.x and 5.x apply different ones).
    """
    scaling, top_theta = cfg.get("rope_scaling"), cfg.get("rope_theta")
    if name == "full_attention":
        full = dict(given or {"rope_type": "default"})
        if scaling:
            full = {**full, **scaling}
            if scaling.get("rope_type") is None and rope_type_of(scaling, "config['rope_scaling']", conv) != "default":
                fail("config['rope_scaling']['type']", f"'rope_type' ({cfg['model_type']} merges rope_scaling into "
                     "its full-attention rope dict, where transformers 5.x reads only 'rope_type' and would silently "
                     "run unscaled)", scaling["type"])
        full.setdefault("rope_theta", conv.default_theta if top_theta is None else top_theta)
        return full, "config['rope_scaling']" if scaling else "config['rope_parameters']['full_attention']"
    key, local_default = conv.local_theta
    sliding = dict(given or {"rope_type": "default"})
    if "rope_theta" not in sliding:
        local = cfg.get(key) if key is not None else None
        if local is None and key is None and top_theta is not None and top_theta != local_default:
            fail("config['rope_theta']", f"{local_default} or 5.x rope_parameters per layer type for the "
                 f"sliding-window layers of {cfg['model_type']} (transformers 4.x applied rope_theta there too, 5.x "
                 f"applies {local_default}; posenc will not guess)", top_theta)
        sliding["rope_theta"] = local_default if local is None else local
    return sliding, "config['rope_parameters']['sliding_attention']"


def _rotating(cfg: Mapping[str, Any], conv: Convention, layer_type: str | None, index: int | None) -> bool:
    """Whether a layer of this type (and index, when known) applies RoPE at all."""
    if not positional_layer(layer_type):  # linear attention, mamba, conv, mlp layers: no positions
        return False
    if conv.rope_flag is not None and cfg.get(conv.rope_flag[0]) != conv.rope_flag[1]:
        return False  # Zamba 2 without use_mem_rope, Granite 4 hybrids without position_embedding_type "rope"
    windowed = cfg.get("sliding_window", 4096) is not None  # Cohere2Config / Exaone4Config default 4096
    if conv.nope == "full":  # Cohere 2: only sliding layers rotate, and only when a window is set
        return layer_type == "sliding_attention" and windowed
    if conv.nope == "full_if_windowed":  # EXAONE 4
        return not windowed or layer_type != "full_attention"
    if conv.nope == "no_rope_layers" and index is not None:  # SmolLM3
        listed = cfg.get("no_rope_layers")
        if isinstance(listed, (list, tuple)) and index < len(listed):
            return bool(listed[index])
        return (index + 1) % config_int(cfg, "no_rope_layer_interval", default=4) != 0
    return True


def _nope_layers(cfg: Mapping[str, Any], conv: Convention, layer_type: str | None) -> list[int] | None:
    """SmolLM3: the layer indices (of `layer_type`, if given) without RoPE; None when the count is unknown."""
    if conv.nope != "no_rope_layers":
        return []
    listed = cfg.get("no_rope_layers")
    count = len(listed) if isinstance(listed, (list, tuple)) else cfg.get("num_hidden_layers")
    if count is None:
        return None
    count = config_int({"num_hidden_layers": count}, "num_hidden_layers")
    types = layer_type_list(cfg, count)
    return [i for i in range(count) if not _rotating(cfg, conv, None, i)
            and (layer_type is None or types is None or types[i] == layer_type)]


def _layer_cfg(cfg: dict[str, Any], name: str | None) -> dict[str, Any]:
    """`cfg` with the head_dim of the layers of type `name` where it differs per layer (Gemma 4's full-attention
    layers: `per_layer_config` {layer index: {"head_dim": ...}}, or config.json's `global_head_dim`)."""
    per, types = cfg.get("per_layer_config"), layer_type_list(cfg)
    if name is None or not types:
        return cfg
    if isinstance(per, Mapping) and per:
        try:
            by_index = {int(k): v for k, v in per.items()}
        except (TypeError, ValueError):
            fail("config['per_layer_config']", "a dict keyed by layer index", Raw(f"keys {sorted(map(str, per))}"))
        dims = {(by_index.get(i) or {}).get("head_dim") for i, t in enumerate(types) if t == name}
        if len(dims) > 1:
            fail("config['per_layer_config']", f"one head_dim for every {name} layer (posenc builds one Rope per "
                 "layer type)", Raw(f"head_dim {sorted(map(str, dims))}"))
        dim = next(iter(dims), None)
    else:
        dim = cfg.get("global_head_dim") if name == "full_attention" else None
    return cfg if dim is None else {**cfg, "head_dim": dim}


def _builders(cfg: dict[str, Any], conv: Convention) -> dict[str | None, Callable[[], Rope | None]]:
    """`{layer type: () -> Rope or None (no RoPE)}`, built on demand (an unused layer type's error stays silent)."""
    layers = _layer_params(cfg, conv)
    types = layer_type_list(cfg)
    names: list[str | None] = list(dict.fromkeys(types)) if types else [k for k in layers if k is not None]
    if not names:
        names = list(_LAYER_TYPES) if conv.nope in ("full", "full_if_windowed") else [None]

    def builder(name: str | None) -> Callable[[], Rope | None]:
        def build() -> Rope | None:
            if not _rotating(cfg, conv, name, None):
                return None
            keys = dict(conv.rope_keys)
            key = keys.get(name, keys.get(None)) if keys else name  # DeepSeek-V4: a table per branch
            if keys and key not in layers:
                fail(f"config['rope_parameters']['{key}']", f"a dict of rope parameters for the {key!r} branch "
                     f"(the {name} layers of {cfg['model_type']} read it)", MISSING)
            if key not in layers and None not in layers:
                fail(f"config['rope_parameters']['{name}']", "a dict of rope parameters for this layer type (this "
                     f"config keys its rope parameters by {sorted(map(str, layers))}, which are not its layer types: "
                     "a table per attention branch, which posenc.hf does not model; build each Rope from its dict)",
                     MISSING)
            params, where = layers.get(key, layers.get(None))
            if conv.local_theta is not None and key in _LAYER_TYPES:
                params, where = _local_params(cfg, conv, key, params)
            return None if params is None else build_rope(_layer_cfg(cfg, name), conv, params, where)
        return build

    return {name: builder(name) for name in names}


def rope_by_layer_type(config: Any) -> dict[str | None, Rope | None]:
    """`{layer type: Rope, or None where that type applies no RoPE}`; one entry keyed None for uniform models.

    Raises:
        PosencError: as `rope_from_hf_config`, for any layer type.
    """
    cfg, conv = _text(config)
    return {name: build() for name, build in _builders(cfg, conv).items()}


def layer_ropes(config: Any) -> tuple[Rope | None, ...]:
    """One entry per decoder layer: the `Rope` it applies, or None for a layer without RoPE (NoPE).

    Raises:
        PosencError: a missing `num_hidden_layers`, a `layer_types` list of another length, or any error of
            `rope_from_hf_config`.
    """
    cfg, conv = _text(config)
    count = config_int(cfg, "num_hidden_layers", "n_layer", "n_layers", "num_layers")
    types = layer_type_list(cfg, count)
    if types is not None and len(types) != count:
        fail("config['layer_types']", f"{count} entries (num_hidden_layers)", Raw(f"{len(types)} entries"))
    builders = _builders(cfg, conv)
    by_type = {name: build() for name, build in builders.items()}
    out = []
    for i in range(count):
        name = types[i] if types is not None else None
        rope = by_type[name] if name in by_type else by_type[next(iter(by_type))]
        out.append(rope if _rotating(cfg, conv, name, i) else None)
    return tuple(out)


def _describe(rope: Rope | None) -> str:
    if rope is None:
        return "no RoPE"
    return f"base {rope.base:g}, {rope.scaling.name}"  # type: ignore[attr-defined]


def rope_from_hf_config(config: Any, *, layer_type: str | None = None) -> Rope:
    """Build the `Rope` that transformers applies for a model config (dict or `PretrainedConfig`).

    Args:
        config: a config.json dict (4.x or 5.x keys; vision-language configs may nest `text_config`) or a
            transformers `PretrainedConfig`.
        layer_type: the attention type of the layers asked about ("full_attention" / "sliding_attention");
            required when the model's layers differ (Gemma 3, OLMo 3, Cohere 2, EXAONE 4).
    Returns:
        A `Rope` whose `head_dim` is the width `apply` takes (DeepSeek MLA: `qk_rope_head_dim`).
    Raises:
        PosencError: unknown or non-RoPE model types, unknown rope types, missing or foreign keys, invalid values,
            no `layer_type` for a model whose layers differ, a layer type without RoPE.

        >>> cfg = {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
        ...        "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
        >>> rope_from_hf_config(cfg, layer_type="sliding_attention").base
        10000.0
        >>> rope_from_hf_config(cfg, layer_type="full_attention").scaling
        Linear(factor=8.0)
    """
    cfg, conv = _text(config)
    if layer_type is not None and not isinstance(layer_type, str):
        fail("layer_type", "a layer type name such as 'full_attention', or None", layer_type)
    builders = _builders(cfg, conv)
    named = sorted(k for k in builders if k is not None)
    if layer_type is not None and layer_type not in builders:
        if None not in builders or layer_type not in set(_LAYER_TYPES) | set(cfg.get("layer_types") or []):
            fail("layer_type", f"one of {named or list(_LAYER_TYPES)} or None", layer_type)
    nope = _nope_layers(cfg, conv, layer_type)
    if nope is None or nope:
        which = "every no_rope_layer_interval-th layer" if nope is None else f"layers {nope}"
        fail("config['no_rope_layers']", f"every layer to apply RoPE (this {cfg['model_type']} config applies none in "
             f"{which}: use posenc.hf.layer_ropes(config) for one Rope or None per layer)", cfg.get("no_rope_layers"))
    if layer_type is not None:
        rope = builders[layer_type if layer_type in builders else None]()
        if rope is None:
            fail("layer_type", f"a layer type that uses RoPE ({cfg['model_type']} {layer_type} layers use no "
                 "positional encoding)", layer_type)
        return rope
    ropes = {name: build() for name, build in builders.items() if positional_layer(name)}
    distinct = set(ropes.values())
    if len(distinct) == 1 and None not in distinct:
        return next(iter(distinct))  # type: ignore[return-value]
    if not distinct or distinct == {None}:
        fail("config", f"a model that applies RoPE somewhere (no layer of this {cfg['model_type']} config does)",
             Raw(f"{conv.rope_flag[0]}={cfg.get(conv.rope_flag[0])!r}" if conv.rope_flag is not None
                 else f"sliding_window={cfg.get('sliding_window')!r}"))
    per_type = "; ".join(f"{k}: {_describe(v)}" for k, v in sorted(ropes.items(), key=lambda kv: str(kv[0])))
    fail("layer_type", f"one of {named} (this {cfg['model_type']} config applies a different RoPE per layer type: "
         f"{per_type}; posenc.hf.layer_ropes(config) gives one per layer)", None)
