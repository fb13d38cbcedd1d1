"""Per-model facts of transformers 5.x, in one table, and the config readers every `posenc.hf` module shares.

A model family differs from Llama only in the facts its `Convention` row states: the pairing, the config
class's defaults (theta, head_dim, partial rotary factor, original length), the key names it reads, which
layers rotate, and its attention biases. Nothing else in `posenc.hf` branches on `model_type`.

    >>> head_dim({"model_type": "qwen3", "hidden_size": 256, "num_attention_heads": 4})  # Qwen3Config's default
    128
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import Raw, fail, integer

__all__ = ["Convention", "MODEL_TYPES", "NON_ROPE_MODEL_TYPES", "convention", "config_to_dict", "text_config",
           "present_key", "config_int", "head_dim", "layer_type_list", "positional_layer", "GENERIC", "MISSING"]

MISSING = Raw("nothing (key missing)")


@dataclass(frozen=True)
class Convention:
    """How one model family applies RoPE (and lays out attention) in transformers 5.x."""

    pairing: str = "split_half"
    default_theta: float = 10000.0
    theta_key: str = "rope_theta"  # the 4.x top-level key of the base (GPT-NeoX: rotary_emb_base)
    partial: float | None = None  # default partial_rotary_factor; None: the default rope rotates the whole head
    partial_key: str = "partial_rotary_factor"  # the top-level key of the factor (GPT-NeoX: rotary_pct)
    head_dim: int | None = None  # the config class's head_dim when config.json omits it (else hidden / heads)
    head_dim_key: str | None = "head_dim"  # None: the class derives head_dim, ignoring the key (Falcon)
    rope_width: tuple[str, int] | None = None  # (key, default) of a rope slice narrower than the head (MLA)
    rotary_width: tuple[str, int] | None = None  # (key, default) of a fixed rotary width (GPT-J's rotary_dim)
    fixed_table: bool = False  # GPT-J: base 10000, no scaling, whatever the config says
    original_max: int | None = None  # a class-level original_max_position_embeddings that wins over the rope dict
    rope_types: tuple[str, ...] | None = None  # the only rope types the config class accepts (None: all)
    aliases: tuple[tuple[str, str], ...] = ()  # legacy rope type names the config class renames
    mrope: bool = False  # multi-axis RoPE over [3, b, t] positions (mrope_section, else mrope_default)
    mrope_default: tuple[int, ...] = (16, 24, 24)  # the modeling code's section when the config has none
    mrope_interleaved: bool = False  # Qwen3-VL: frequency i follows axis i % 3 within the sections (else contiguous)
    mrope_hw_alternating: bool = False  # Ernie 4.5 VL: mrope_section [s_h, s_w, s_t]; the first 2 s_h frequencies
    # alternate axis 1 (even) and axis 2 (odd), the last s_t follow axis 0 (its pre-rotated inv_freq, undone)
    local_theta: tuple[str | None, float] | None = None  # per-layer RoPE: (4.x key, default) of the sliding theta
    layer_pattern: tuple[str | None, int] | None = None  # (key, default) n: layer i is full iff (i + 1) % n == 0
    window_layers: str | None = None  # Qwen families: which layers slide once use_sliding_window is true, see
    # layer_type_list: "from_max_window_layers", "even_below_max_window_layers" or "all"
    alibi_key: str | None = None  # a flag that replaces RoPE by ALiBi (Falcon's `alibi`)
    legacy_multi_query: bool = False  # Falcon: one KV head when multi_query (default), unless new_decoder_architecture
    nope: str | None = None  # which layers apply no RoPE: "full", "full_if_windowed" or "no_rope_layers"
    rope_flag: tuple[str, Any] | None = None  # (key, value): no layer rotates unless config[key] == value
    default_params: tuple[tuple[str, Any], ...] = ()  # the config class's rope parameters when config.json has none
    qkv_bias: bool | str = "attention_bias"  # q/k/v projection bias: a constant or the config key that sets it
    o_bias: bool | str = "attention_bias"  # output projection bias: a constant or the config key
    direction: int = 1  # the sign of the rotation angle (Rope.direction; nanochat: -1)
    reads_rope_interleave: bool = True  # MLA: the attention picks its pairing by config['rope_interleave']
    ntk_alpha: bool = False  # HunYuan: a "dynamic" dict with `alpha` is static NTK-alpha (base * alpha**(d/(d-2)))
    rope_keys: tuple[tuple[str | None, str], ...] = ()  # (layer type, its rope_parameters key) where the dicts
    # are keyed by branch (DeepSeek-V4: sliding layers "main", every other type (None) "compress")
    indexer: str | None = None  # DSA lightning indexer: the pairing it rotates the leading qk_rope_head_dim channels
    # of its index_head_dim heads with (the model's table); None: no indexer (posenc.hf.branch_ropes)
    refused: str | None = None  # what posenc does not model about this family's rotation (it refuses the type)
    mscales: bool = False  # Phi-MoE: a non-default rule's cos/sin are multiplied by short_mscale (up to L0) or
    # long_mscale in place of its attention factor, and its LongRoPE table keeps the short factors at every length
    reads_class: bool = False  # a dict's other facts (defaults, aliases) come from its config class when
    # transformers is importable (posenc.hf.classes); False: this row states every default itself


_LLAMA = Convention()
# A model type outside the table: the standard keys of transformers 5.x (rope_parameters / rope_scaling,
# rope_theta, head_dim or hidden_size / num_attention_heads, partial_rotary_factor, layer_types), split-half
# pairs, and a default rope that honours partial_rotary_factor (as the rotary classes generated since 4.5x do).
GENERIC = Convention(partial=1.0, reads_class=True)
_INTERLEAVED = Convention(pairing="interleaved", partial=1.0, reads_class=True)
# DeepSeek-style MLA (a config with qk_rope_head_dim): RoPE on the rope slice only; with rope_interleave the
# attention de-interleaves that slice before a split-half rotation
GENERIC_MLA = Convention(partial=1.0, rope_width=("qk_rope_head_dim", 64), reads_class=True)
# MLA whose attention de-interleaves its rope slice whatever config['rope_interleave'] says (DeepSeek-V3.2 and the
# DSA families: they call apply_rotary_pos_emb_interleave unconditionally); their indexers differ in pairing
_MLA_ALWAYS_INTERLEAVED = dict(pairing="interleaved_to_split_half", partial=1.0, rope_width=("qk_rope_head_dim", 64),
                               reads_class=True, reads_rope_interleave=False)
_GLM = Convention(pairing="interleaved", partial=0.5, head_dim=128)
_QWEN2 = Convention(qkv_bias=True, o_bias=False, window_layers="from_max_window_layers")
_MROPE_ALIAS = (("mrope", "default"),)  # the 4.x rope type name of M-RoPE, renamed by the VL config classes
_QWEN_VL = Convention(default_theta=1_000_000.0, mrope=True, aliases=_MROPE_ALIAS, qkv_bias=True,
                      o_bias=False, window_layers="from_max_window_layers")
_GEMMA3 = Convention(default_theta=1_000_000.0, head_dim=256, local_theta=("rope_local_base_freq", 10000.0),
                     layer_pattern=("sliding_window_pattern", 6))
_DEEPSEEK = dict(rope_width=("qk_rope_head_dim", 64))
MODEL_TYPES: dict[str, Convention] = {
    **dict.fromkeys(("llama", "olmo", "olmo2", "starcoder2", "granite"), _LLAMA),
    "qwen3_moe": Convention(window_layers="all"),
    **dict.fromkeys(("mistral", "ministral"), Convention(qkv_bias=False, o_bias=False)),
    "falcon": Convention(head_dim_key=None, alibi_key="alibi", legacy_multi_query=True),
    "qwen2": _QWEN2,
    "qwen2_moe": Convention(qkv_bias="qkv_bias", o_bias=False, window_layers="even_below_max_window_layers"),
    "mixtral": Convention(default_theta=1_000_000.0, qkv_bias=False, o_bias=False),
    "qwen3": Convention(head_dim=128, window_layers="from_max_window_layers"),
    "gemma": Convention(head_dim=256),
    "gemma2": Convention(head_dim=256, layer_pattern=(None, 2)),
    "gemma3": _GEMMA3,
    "gemma3_text": _GEMMA3,
    # OLMo 3's 4.x rope_theta reaches only the full-attention layers in transformers 5.x (see rope._layer_params)
    "olmo3": Convention(default_theta=500000.0, local_theta=(None, 500000.0), layer_pattern=(None, 4)),
    "smollm3": Convention(default_theta=2_000_000.0, nope="no_rope_layers"),
    "exaone4": Convention(nope="full_if_windowed", layer_pattern=("sliding_window_pattern", 4)),
    "gpt_oss": Convention(default_theta=150000.0, head_dim=64, layer_pattern=(None, 2), default_params=(
        ("rope_type", "yarn"), ("factor", 32.0), ("beta_fast", 32.0), ("beta_slow", 1.0), ("truncate", False),
        ("original_max_position_embeddings", 4096))),
    "phi": Convention(partial=0.5),
    "phi3": Convention(partial=1.0, original_max=4096, rope_types=("default", "longrope"),
                       aliases=(("su", "longrope"), ("yarn", "longrope"))),
    "stablelm": Convention(partial=0.25),
    "persimmon": Convention(partial=0.5),
    "gpt_neox": Convention(partial=0.25, theta_key="rotary_emb_base", partial_key="rotary_pct"),
    "gptj": Convention(pairing="interleaved", rotary_width=("rotary_dim", 64), fixed_table=True, rope_types=("default",)),
    "cohere": Convention(pairing="interleaved", default_theta=500000.0),
    "cohere2": Convention(pairing="interleaved", nope="full", layer_pattern=("sliding_window_pattern", 4)),
    "glm": _GLM,
    "glm4": _GLM,
    "deepseek_v2": Convention(pairing="interleaved", **_DEEPSEEK),
    "deepseek_v3": Convention(pairing="interleaved_to_split_half", **_DEEPSEEK),
    # interleaved pairs (2i, 2i+1) on a split-half table, or an interleaved table; otherwise the generic facts
    **dict.fromkeys(("blt", "blt_global_transformer", "blt_local_decoder", "blt_local_encoder", "blt_patcher",
                     "ernie4_5", "ernie4_5_moe", "ernie4_5_vl_moe", "ernie4_5_vl_moe_text", "glm_ocr", "glm_ocr_text",
                     "helium", "moonshine", "moonshine_streaming", "openai_privacy_filter", "pe_audio_encoder", "pe_audio_video_encoder",
                     "pe_video_encoder"), _INTERLEAVED),
    **dict.fromkeys(("deepseek_v32", "axk2"), Convention(**_MLA_ALWAYS_INTERLEAVED, indexer="split_half")),
    **dict.fromkeys(("glm_moe_dsa", "dots3_note", "dots3_note_text"),
                    Convention(**_MLA_ALWAYS_INTERLEAVED, indexer="interleaved_to_split_half")),
    # Mistral Large 4: also every no_rope_layers[i] == 0 layer (default every 4th) applies no RoPE
    **dict.fromkeys(("mistral_large4", "mistral_large4_text"), Convention(
        **_MLA_ALWAYS_INTERLEAVED, indexer="interleaved_to_split_half", nope="no_rope_layers")),
    "bailing_hybrid": Convention(**_MLA_ALWAYS_INTERLEAVED),
    "phimoe": Convention(partial=1.0, reads_class=True, mscales=True),
    **dict.fromkeys(("hunyuan_v1_dense", "hunyuan_v1_moe"), Convention(partial=1.0, reads_class=True, ntk_alpha=True)),
    # DeepSeek-V4: interleaved pairs on the trailing rope slice of each head ([nope | rope]); two tables by branch
    "deepseek_v4": Convention(pairing="interleaved", partial=1.0, rope_width=("qk_rope_head_dim", 64), reads_class=True,
                              rope_keys=(("sliding_attention", "main"), (None, "compress"))),
    "codegen": Convention(pairing="interleaved", rotary_width=("rotary_dim", 64), fixed_table=True, rope_types=("default",),
                          reads_class=True),
    "cohere2_moe": Convention(pairing="interleaved", nope="full", layer_pattern=("sliding_window_pattern", 4),
                              reads_class=True),
    # Llama 4: complex multiplication on consecutive pairs; every no_rope_layers[i] == 0 layer is NoPE
    **dict.fromkeys(("llama4", "llama4_text"), Convention(pairing="interleaved", default_theta=500000.0, head_dim=128,
                                                           nope="no_rope_layers", reads_class=True)),
    # Zamba 2: its shared attention rotates only with use_mem_rope (default false)
    "zamba2": Convention(partial=1.0, head_dim_key="attention_head_dim", rope_flag=("use_mem_rope", True),
                         reads_class=True),
    # Granite 4 hybrids: the attention layers rotate only with position_embedding_type "rope" (default none)
    "granitemoehybrid": Convention(partial=1.0, rope_flag=("position_embedding_type", "rope"), reads_class=True),  # its attention concatenates two widths
    **dict.fromkeys(("hy_v4_vl", "hy_v4_vl_text"), Convention(pairing="interleaved", partial=1.0,
                                                               rope_width=("qk_rope_head_dim", 64), reads_class=True)),
    **dict.fromkeys(("ernie4_5_vl_moe", "ernie4_5_vl_moe_text"), Convention(
        pairing="interleaved", partial=1.0, mrope=True, mrope_default=(22, 22, 20), mrope_hw_alternating=True,
        reads_class=True)),
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba", "rwkv", "xlstm"), Convention(
        refused="no positional encoding at all (a recurrent / state-space model without attention layers)")),
    # multi-axis RoPE of the VL families (the modeling file's default section when the config has none)
    **dict.fromkeys(("qwen3_vl", "qwen3_vl_text", "qwen3_vl_moe", "qwen3_vl_moe_text", "qwen3_omni_moe",
                     "qwen3_omni_moe_text", "qwen3_omni_moe_thinker"),
                    Convention(partial=1.0, mrope=True, aliases=_MROPE_ALIAS, mrope_default=(24, 20, 20), mrope_interleaved=True,
                               reads_class=True)),
    # Cohere Compass: the same interleaved recomposition, per layer type; its default rope rotates the whole head
    **dict.fromkeys(("cohere_compass", "cohere_compass_text"),
                    Convention(mrope=True, mrope_default=(24, 20, 20), mrope_interleaved=True, reads_class=True)),
    **dict.fromkeys(("cosmos3_edge", "cosmos3_edge_text"),  # (its config class refuses the 4.x "mrope" name)
                    Convention(partial=1.0, mrope=True, mrope_default=(24, 20, 20), mrope_interleaved=True,
                               reads_class=True)),
    **dict.fromkeys(("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "qwen4_exp_text"),
                    Convention(partial=1.0, mrope=True, aliases=_MROPE_ALIAS, mrope_default=(11, 11, 10), mrope_interleaved=True,
                               reads_class=True)),
    **dict.fromkeys(("glm4v", "glm4v_text", "glm4v_moe", "glm4v_moe_text", "glm_image", "glm_image_text"),
                    Convention(partial=1.0, mrope=True, aliases=_MROPE_ALIAS, mrope_default=(8, 12, 12), reads_class=True)),
    **dict.fromkeys(("paddleocr_vl", "paddleocr_vl_text", "qwen2_5_omni", "qwen2_5_omni_thinker",
                     "qwen2_5_omni_text"), Convention(partial=1.0, mrope=True, aliases=_MROPE_ALIAS, reads_class=True)),
    # nanochat rotates by -theta (its rotate_half is cat(x2, -x1)): attention scores see n - m where others see m - n
    "nanochat": Convention(partial=1.0, direction=-1, reads_class=True),
    "qwen2_vl": _QWEN_VL,
    "qwen2_vl_text": _QWEN_VL,
    "qwen2_5_vl": _QWEN_VL,
    "qwen2_5_vl_text": _QWEN_VL,
}

_ALIBI = "ALiBi (posenc.alibi_slopes / posenc.alibi_bias)"
_LEARNED = "learned absolute position embeddings"
_T5 = "T5 relative position buckets (posenc.t5_relative_position_bucket)"
NON_ROPE_MODEL_TYPES = {
    **dict.fromkeys(("bloom", "mpt"), _ALIBI),
    **dict.fromkeys(("t5", "mt5", "umt5", "longt5"), _T5),
    **dict.fromkeys(("gpt2", "gpt_bigcode", "bert", "roberta", "distilbert", "opt", "gpt_neo", "xlm-roberta"), _LEARNED),
}


def convention(cfg: Mapping[str, Any]) -> Convention:
    """The table row of `cfg['model_type']` (`GENERIC` for types outside the table)."""
    row = MODEL_TYPES.get(cfg.get("model_type"))  # type: ignore[arg-type]
    if row is not None:
        return row
    if cfg.get("qk_rope_head_dim") is not None:
        return GENERIC_MLA
    return GENERIC


def positional_layer(layer_type: str | None) -> bool:
    """Whether a layer type attends over positions at all: "linear_attention" (gated delta / recurrent state),
    "mamba", "conv", "mlp", "recurrent", ... carry no positions; "hybrid" and every other "*attention" type do."""
    if layer_type in ("hybrid", "hybrid_sliding"):  # Zamba 2 / ZAYA: a recurrent block with an attention layer
        return True
    return layer_type is None or (layer_type.endswith("attention") and layer_type != "linear_attention")


def config_to_dict(config: Any) -> dict[str, Any]:
    """A plain dict from a config.json dict or a transformers `PretrainedConfig`."""
    from .classes import with_aliases, with_class_defaults

    if isinstance(config, Mapping):
        cfg = _checked_type(dict(config))
        if cfg.get("model_type") is None or cfg["model_type"] in NON_ROPE_MODEL_TYPES or not convention(cfg).reads_class:
            return cfg
        return _checked_type(with_class_defaults(cfg))
    to_dict = getattr(config, "to_dict", None)
    if config is None or not callable(to_dict):
        fail("config", "a config.json dict or a transformers PretrainedConfig", type(config))
    out = dict(to_dict())
    for key in ("head_dim", "rope_parameters", "model_type"):  # properties to_dict() may not serialise
        if key not in out and getattr(config, key, None) is not None:
            out[key] = getattr(config, key)
    return _checked_type(with_aliases(out, config))


def _checked_type(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg`, after checking its `model_type` (looked up in tables, so it must be a string) if it has one."""
    if cfg.get("model_type") is not None and not isinstance(cfg["model_type"], str):
        fail("config['model_type']", "a string such as 'llama'", cfg["model_type"])
    return cfg


_NESTED = ("text_config", "thinker_config", "decoder", "llm_config", "language_config", "encoder_config", "asr_config")


def _nested_text(cfg: Mapping[str, Any]) -> Any:
    """The sub-config holding the language model: `text_config`, or (omni / encoder-decoder / ASR composites
    whose top level has no attention sizes) the first of `_NESTED` present."""
    if cfg.get("text_config") is not None or cfg.get("num_attention_heads") is not None:
        return cfg.get("text_config")
    return next((cfg[k] for k in _NESTED[1:] if isinstance(cfg.get(k), Mapping) or hasattr(cfg.get(k), "to_dict")), None)


def text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Vision-language configs keep the language model's facts in `text_config` (omni models one level deeper)."""
    text = _nested_text(cfg)
    if not (isinstance(text, Mapping) or hasattr(text, "to_dict")):
        return cfg
    if _nested_text(config_to_dict(text)) is not None:
        text = text_config(config_to_dict(text))
    merged = config_to_dict(text)
    for key, value in cfg.items():
        if key != "text_config":
            merged.setdefault(key, value)
    if cfg.get("model_type"):
        merged["model_type"] = cfg["model_type"]
    return merged


def present_key(cfg: Mapping[str, Any], *keys: str) -> str:
    """The first of several alias keys present in cfg (transformers' attribute_map), else the first name."""
    return next((k for k in keys if cfg.get(k) is not None), keys[0])


def config_int(cfg: Mapping[str, Any], *keys: str, where: str = "config", default: Any = None) -> int:
    """The first set alias key of `cfg` as a positive integer (`default` when none is set and one is given)."""
    key = present_key(cfg, *keys)
    value = cfg.get(key)
    if value is None and default is not None:
        value = default
    if value is None:
        fail(f"{where}['{key}']", "a positive integer", MISSING if key not in cfg else None)
    return integer(f"{where}['{key}']", value, min=1)


def head_dim(cfg: Mapping[str, Any]) -> int:
    """Channels per attention head, as the model's config class derives them (the one place posenc does).

    `head_dim` when set; the class default when config.json omits the key (Qwen3 128, Gemma 256, GLM 128,
    gpt-oss 64); else hidden_size / num_attention_heads (also for an explicit null, and always for Falcon).
    """
    conv = convention(cfg)
    key = conv.head_dim_key
    if key is not None:
        alias = present_key(cfg, key, "d_kv", "kv_channels")  # T5 names it d_kv, JetMoE kv_channels
        if cfg.get(alias) is not None:
            return config_int(cfg, alias)
        if key not in cfg and conv.head_dim is not None:
            return conv.head_dim
        if key not in cfg and conv.reads_class:  # the config class's default, when transformers is importable
            from .classes import with_class_defaults

            filled = text_config(with_class_defaults(dict(cfg)))  # a composite's default sits in its text_config
            if filled.get(key) is not None:
                return config_int(filled, key)
    hidden_key = present_key(cfg, "hidden_size", "n_embd", "n_embed", "d_model")
    heads_key = present_key(cfg, "num_attention_heads", "n_head", "n_heads", "num_heads")
    hidden, heads = config_int(cfg, hidden_key), config_int(cfg, heads_key)
    if hidden % heads:
        fail(f"config['{hidden_key}']", f"a multiple of {heads_key}={heads} (or an explicit head_dim)", hidden)
    if key is None and cfg.get("head_dim") not in (None, hidden // heads):  # Falcon: a property, not a setting
        fail("config['head_dim']", f"{hidden_key} / {heads_key} = {hidden // heads} or no key ({cfg['model_type']} "
             "derives head_dim: transformers refuses the key)", cfg["head_dim"])
    return hidden // heads


def layer_type_list(cfg: Mapping[str, Any], layers: int | None = None) -> list[str] | None:
    """Each layer's attention type: `layer_types` as given, or the config class's default pattern; None if neither.

    Args:
        cfg: the (text) config dict.
        layers: the number of layers (default `num_hidden_layers`; None when that key is missing).
    """
    types = cfg.get("layer_types")
    if isinstance(types, (list, tuple)):
        return list(types)
    conv = convention(cfg)
    if conv.layer_pattern is None and conv.window_layers is None:
        return None
    if layers is None:
        if cfg.get("num_hidden_layers") is None:
            return None
        layers = config_int(cfg, "num_hidden_layers")
    if conv.layer_pattern is not None:
        key, every = conv.layer_pattern
        if key is not None and cfg.get(key) is not None:
            every = config_int(cfg, key)
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)]
    # Qwen: nothing slides unless use_sliding_window (default false) and a window are set
    enabled = cfg.get("use_sliding_window") is True and cfg.get("sliding_window") is not None
    first = config_int(cfg, "max_window_layers", default=28) if conv.window_layers != "all" else 0
    slides = {"all": lambda i: True, "from_max_window_layers": lambda i: i >= first,
              "even_below_max_window_layers": lambda i: i % 2 == 0 and i < first}[conv.window_layers]
    return ["sliding_attention" if enabled and slides(i) else "full_attention" for i in range(layers)]
