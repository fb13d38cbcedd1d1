"""Test helper: the config of a tiny random model of a causal-LM model type (tests/helpers/transformers_zoo.py),
built from its config class: hidden 64, 2 layers, 4 heads (2 KV heads), head_dim 16 (or the smallest head giving
the family's partial rotary factor an even width), vocabulary 128; a composite config's text_config at these sizes
and its vision / audio parts small. `zoo_config(model_type, rope)` gives a rope rule to the config class as a user
would (per layer type where the config is keyed by layer type), or raises `NotApplicable` saying why the family
has no such option. Nothing here comes from posenc.
"""

from __future__ import annotations

import copy

VOCAB = 128
SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, intermediate_size=96, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
# sizes of mixtures, MLA, linear attention and other parts, small enough for a CPU test (when the config has them)
PARTS = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_local_experts=4,
             n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
             first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
             v_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, intermediate_size_mlp=96, sliding_window=8, attention_chunk_size=8,
             num_kv_shared_layers=0, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
             laurel_rank=8, altup_num_inputs=2, rope_scaling=None,
             # Mamba-2 mixers (Bamba, Falcon-H1, GraniteMoeHybrid): heads x head dim = expand x hidden
             mamba_n_heads=4, mamba_d_head=32, mamba_d_ssm=128, mamba_d_state=16, mamba_chunk_size=16)
# per family: hybrids whose layer pattern is not `layer_types` (or whose default has no attention layer in the first
# two) get one recurrent / linear layer and one attention layer (GraniteMoeHybrid: its RoPE variant); ZAYA's class
# accepts only one expert per token; sizes the other keys do not set (Moshi's ffn_dim, Inkling's unpadded vocabulary,
# DeepSeek-V4's head and output rank, Qwen4-exp's indexer, None by default); Cohere Compass's class has no rope dicts by default, its rotary reads one per
# layer type
FAMILY = {"bamba": dict(attn_layer_indices=[1]), "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
          "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"], position_embedding_type="rope"),
          "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
          "zaya": dict(num_experts_per_tok=1), "moshi": dict(ffn_dim=96, audio_vocab_size=64),
          "inkling2_text": dict(unpadded_vocab_size=VOCAB), "deepseek_v4": dict(head_dim=16, o_lora_rank=16),
          **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"), dict(indexer_n_heads=2, indexer_kv_heads=1,
                                                               indexer_head_dim=16, indexer_budget=8,
                                                               indexer_compress_ratio=2)),
          "longcat_flash": dict(head_dim=PARTS["qk_rope_head_dim"]),  # its rotary's width (as in its checkpoints)
          "cohere_compass_text": dict(rope_parameters={t: {"rope_type": "default", "rope_theta": 10000.0}
                                                       for t in ("full_attention", "sliding_attention")})}
# config classes whose __post_init__ derives values from fields that their aliases (attribute_map) would set only
# after it: Zamba2's hybrid_layer_ids from layers_block_type, DBRX's ffn_config.hidden_size from d_model
BY_FIELD = ("zamba2", "dbrx")
# sub-configs by (model type, name): their sizes, and what DBRX checkpoints carry that its config class omits or
# defaults to what its modeling code cannot run (transformers 5.24: DbrxAttention reads attn_config.rope_theta, a
# field DbrxAttentionConfig lacks, and clamps by clip_qkv, None by default)
PART_EXTRA = {("dbrx", "attn_config"): dict(rope_theta=500000.0, kv_n_heads=2, clip_qkv=8.0),
              ("dbrx", "ffn_config"): dict(ffn_hidden_size=96, moe_num_experts=4, moe_top_k=2)}
# a composite config's other parts (vision, audio...): only their size, their inputs are never given
SMALL_PART = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_layers=1, depth=1,
                  num_attention_heads=2, num_heads=2, num_key_value_heads=2, embed_dim=32, out_hidden_size=64,
                  projection_dim=32, vision_output_dim=32, num_global_layers=1, hidden_sizes=[32], depths=[1])


class NotApplicable(Exception):
    """A check the family has no such option for (its config class refuses the rule, or its rotating layers
    use a rule the check's rule cannot replace); the message says why."""


def _build(model_type: str, kw: dict):
    """`AutoConfig.for_model(model_type, **kw)`; keys a config class exposes as read-only properties are left to it."""
    from transformers import AutoConfig

    for _ in range(8):
        try:
            return AutoConfig.for_model(model_type, **kw)
        except AttributeError as e:
            name = str(e).split("'")[1] if "property" in str(e) else None
            aliases = [k for k, v in getattr(_class(model_type), "attribute_map", {}).items() if v == name]
            name = next((k for k in [name, *aliases] if k in kw), None)
            if name is None:
                raise
            kw.pop(name)
    raise AssertionError(f"{model_type}: read-only properties left after 8 tries: {sorted(kw)}")


def _class(model_type: str):
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def zoo_config(model_type: str, rope: dict | None = None):
    """The model type's config class at the tiny sizes (keys it does not have are left out; a composite config's
    text_config at the text sizes, its vision / audio parts at `SMALL_PART`); `rope` is given to the config class as
    a user would give it (see `_with_rule`), so the class validates it. Raises `NotApplicable` when the family has
    no such option."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    kw = _tiny_kw(base)
    config = _build(model_type, copy.deepcopy(kw))
    text = config.get_text_config()
    text_kw = kw.get("text_config", kw) if text is not config else kw
    _fit_mrope(getattr(text, "rope_parameters", None), text_kw.get("head_dim", 16), _reads_mrope(text))
    if rope is None:
        return config
    text_kw["rope_parameters"] = _with_rule(text, rope, text_kw.get("head_dim", 16))
    if "original_max_position_embeddings" in text.to_dict() and "original_max_position_embeddings" in rope:
        text_kw["original_max_position_embeddings"] = rope["original_max_position_embeddings"]  # Phi-3 reads it
    try:
        return _build(model_type, kw)
    except Exception as e:  # noqa: BLE001 (the config class refuses the rule: the family has no such option)
        why = [line.strip() for line in str(e).splitlines() if line.strip()] or [type(e).__name__]
        raise NotApplicable(f"{type(config).__name__} refuses it: {why[-1][:160]}") from e  # (the cause, last)


def _reads_mrope(config) -> bool:
    """Whether the config's modeling file reads an M-RoPE section."""
    import importlib
    import inspect

    try:
        module = importlib.import_module(type(config).__module__.replace(".configuration_", ".modeling_"))
    except ImportError:
        return False
    return "mrope_section" in inspect.getsource(module)


def _tiny_kw(base) -> dict:
    """Constructor keywords of `base`'s class at the tiny sizes: its text part at `SIZES` / `PARTS`, the other
    sub-configs (vision, audio, Dbrx's attention / mixture parts) at `SMALL_PART`."""
    subs = {name: getattr(base, name, None) for name in getattr(base, "sub_configs", {})}
    if "text_config" in subs:  # a composite: the text model is its own config
        kw = {k: v for k, v in SIZES.items() if k in _keys(base) and k != "vocab_size"}
        kw["text_config"] = {"model_type": subs.pop("text_config").model_type, **_text_kw(base.text_config)}
    else:
        kw = _text_kw(base)
    for name, sub in subs.items():
        if sub is not None and hasattr(sub, "to_dict"):
            keys = _keys(sub)
            kw[name] = {"model_type": sub.model_type, **{k: v for k, v in SMALL_PART.items() if k in keys},
                        **PART_EXTRA.get((base.model_type, name), {})}
    return kw


def _keys(config) -> set[str]:
    return set(config.to_dict()) | set(getattr(config, "attribute_map", {}))


def _text_kw(base) -> dict:
    """`SIZES` and the `PARTS` the text config has, with its layer types cut to two of them."""
    keys = _keys(base)
    kw = {k: v for k, v in {**SIZES, **PARTS}.items() if k in keys or k in SIZES}
    if "layer_types" in keys and getattr(base, "layer_types", None) is not None:
        kw["layer_types"] = list(base.layer_types[:1]) + [t for t in base.layer_types if t != base.layer_types[0]][:1]
        kw["layer_types"] = (kw["layer_types"] * 2)[:2]
    for key in ("mlp_only_layers", "no_rope_layers"):
        if key in keys and isinstance(getattr(base, key, None), list):
            kw[key] = [] if key == "mlp_only_layers" else [1, 0]
    if "qk_rope_head_dim" in keys:  # MLA: head_dim is the rope part's (the config class derives it), no GQA
        kw.pop("head_dim")
        kw["num_key_value_heads"] = kw["num_attention_heads"]
    if "rotary_dim" in keys:  # GPT-J / CodeGen: rotary channels of a head
        kw["rotary_dim"] = 8
    kw.update(FAMILY.get(base.model_type, {}))
    if base.model_type in BY_FIELD:  # the fields themselves, not their aliases (set after __post_init__)
        aliases = getattr(base, "attribute_map", {})
        kw = {aliases.get(k, k): v for k, v in kw.items()}
    if "head_dim" in kw:  # the family's partial rotary factor must give an even width (MiMo-V2-Flash: 0.334)
        factors = _factors(base)
        kw["head_dim"] = next(h for h in (kw["head_dim"], 16, 24, 32, 48, 64)
                              if all(int(h * f) % 2 == 0 and int(h * f) > 0 for f in factors))
    return kw


def _factors(config) -> set[float]:
    """The partial rotary factors of a config's rope dicts."""
    params = getattr(config, "rope_parameters", None) or {}
    dicts = [v for v in params.values() if isinstance(v, dict)] if all(
        isinstance(v, dict) or v is None for v in params.values()) else [params]
    return {d.get("partial_rotary_factor") or 1.0 for d in dicts if d}


def _with_rule(config, rope: dict, head_dim: int) -> dict:
    """The config's rope parameters with `rope` as the rule of its rotating layers. Layer-type dicts: on the
    full-attention layers when they rotate with a replaceable rule, else on every rotating layer type (Beam's
    full layers apply no RoPE). A "proportional" dict (Gemma 4, LFM3: a whole-head table, zero frequencies past
    partial_rotary_factor) takes only its own linear factor; another rule there is not applicable (transformers
    would apply a rotary_dim-wide table to the whole head)."""
    params = copy.deepcopy(getattr(config, "rope_parameters", None) or {})
    per_layer = bool(params) and all(isinstance(v, dict) or v is None for v in params.values())
    entries = params if per_layer else {None: params}
    used = set(getattr(config, "layer_types", None) or ()) if per_layer else {None}
    rotating = {k: v for k, v in entries.items() if isinstance(v, dict) and (k in used or not used)}
    replaceable = [k for k, v in rotating.items() if v.get("rope_type") != "proportional"]
    targets = ["full_attention"] if "full_attention" in replaceable else replaceable
    if targets:
        entries.update({k: {**_kept(entries[k]), **_sized(rope, entries[k], head_dim)} for k in targets})
    elif rotating and rope.get("rope_type") == "linear":
        entries.update({k: {**v, "factor": rope["factor"]} for k, v in rotating.items()})
    else:
        kinds = sorted({str(v.get("rope_type")) for v in rotating.values()})
        raise NotApplicable(f"the rotating layers' rule is {kinds} (no {rope.get('rope_type')} form)")
    return entries if per_layer else entries[None]


def _kept(params: dict) -> dict:
    """What a replaced rule keeps of the model's rope dict: theta, the rotated channels, and what the attention
    itself reads (Ministral 3's Llama-4 query temperature: llama_4_scaling_beta and its L0)."""
    kept = ("rope_theta", "partial_rotary_factor", "mrope_section", "mrope_interleaved", "llama_4_scaling_beta",
            *(("original_max_position_embeddings",) if "llama_4_scaling_beta" in params else ()))
    return {k: v for k, v in params.items() if k in kept}


def _sized(rope: dict, params: dict, head_dim: int) -> dict:
    """LongRoPE's per-frequency factors sized to the layer's rotary_dim / 2 (distinct short and long ladders)."""
    if rope.get("rope_type") != "longrope" or "short_factor" in rope:
        return rope
    half = int(head_dim * params.get("partial_rotary_factor", 1.0)) // 2
    return {**rope, "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)]}


def _fit_mrope(params, head_dim: int, mrope: bool) -> None:
    """M-RoPE sections scaled to the tiny head (they must sum to rotary_dim / 2); `mrope`: the modeling code reads
    one, with its own default for a full-size head when the config has none (Qwen3.5: [11, 11, 10])."""
    for d in (params.values() if isinstance(params, dict) and all(isinstance(v, dict) for v in params.values())
              else [params]):
        if isinstance(d, dict) and (d.get("mrope_section") or mrope):
            half = int(head_dim * d.get("partial_rotary_factor", 1.0)) // 2
            d["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
