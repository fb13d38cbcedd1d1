"""Test helper: a tiny random model of every causal-LM model type of the installed transformers that posenc's
enumeration reads (a modeling file with a rotary class, tests/helpers/hf_enumeration.py), built from its config
class: hidden 64, 2 layers, 4 heads (2 KV heads), head_dim 16, float32, seeded.

`zoo_types()` lists `(model_type, reason or None)`: None when a tiny model builds and runs a forward, else why not
(transformers itself cannot build or run it from these sizes). `zoo_model(model_type, rope=None)` builds one; `rope`
replaces the rope rule (`rope_parameters`, the layer-type dicts of per-layer models get it on their full layers).
Nothing here comes from posenc.
"""

from __future__ import annotations

import copy
import warnings

import torch

VOCAB = 128
MAX_PARAMETERS = 4_000_000
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
             laurel_rank=8, altup_num_inputs=2, rope_scaling=None)
# hybrid families whose layer pattern is not `layer_types` (or whose default has no attention layer in the first
# two): one recurrent / linear layer and one attention layer
HYBRID = {"bamba": dict(attn_layer_indices=[1]), "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
          "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
          "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1)}
# a composite config's other parts (vision, audio...): only their size, their inputs are never given
SMALL_PART = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_layers=1, depth=1,
                  num_attention_heads=2, num_heads=2, num_key_value_heads=2, embed_dim=32, out_hidden_size=64,
                  projection_dim=32, vision_output_dim=32, num_global_layers=1, hidden_sizes=[32], depths=[1])


def causal_lm_types() -> list[str]:
    """Model types with a causal-LM class and a rotary class in their modeling file."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tests.helpers.hf_enumeration import rotary_model_types

    return sorted(t for t, _ in rotary_model_types() if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


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
        why = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        raise NotApplicable(f"{type(config).__name__} refuses it: {why[-160:]}") from e


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
            kw[name] = {"model_type": sub.model_type, **{k: v for k, v in SMALL_PART.items() if k in keys}}
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
    kw.update(HYBRID.get(base.model_type, {}))
    if "head_dim" in kw:  # the family's partial rotary factor must give an even width (MiMo-V2-Flash: 0.334)
        kw["head_dim"] = next(h for h in (16, 24, 32, 48, 64) if all(int(h * f) % 2 == 0 and int(h * f) > 0
                                                                      for f in _factors(base)))
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


def zoo_model(model_type: str, rope: dict | None = None, dtype=torch.float32, seed: int = 0,
              max_positions: int | None = None):
    """A seeded random causal LM of `model_type` in eval mode (weights x4: sharper attention)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = zoo_config(model_type, rope)
    if max_positions is not None:  # dynamic NTK's L0 (a composite's text model reads its own)
        for part in {id(c): c for c in (config, config.get_text_config())}.values():
            if "max_position_embeddings" in part.to_dict():
                part.max_position_embeddings = max_positions
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.device("meta"):
                count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        except ValueError as e:  # a family without sdpa attention
            if "scaled_dot_product_attention" not in str(e):
                raise
            config._attn_implementation = "eager"
            with torch.device("meta"):
                count = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
        if count > MAX_PARAMETERS:
            raise ValueError(f"{count / 1e6:.0f}M parameters at these sizes (parts the config class does not size)")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(4.0)
    return model.to(dtype).eval()


RULES = {"linear": {"rope_type": "linear", "factor": 2.0},
         "yarn": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16},
         "llama3": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 16}}
DYNAMIC = {"rope_type": "dynamic", "factor": 2.0}
# LongRoPE at L0 16 (factors sized to the rotary width by `_sized`), for the families whose config class names
# it (Phi-3's accepts only default and longrope); Phi-MoE's rotary also reads (and its class requires) the mscales,
# equal in its checkpoints (posenc refuses unequal ones: tests/hf/test_rope_config_errors.py)
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 16}
LONGROPE_TYPES = {"phi3": LONGROPE, "phi4_multimodal": LONGROPE,
                  "phimoe": {**LONGROPE, "short_mscale": 1.2, "long_mscale": 1.2}}
CHECKS = ("logits", "greedy", "left-padded", "beam 2", "static cache", "unpatch", *RULES, "longrope",
          "dynamic recompute", "static + recompute")


def _ids(b: int, t: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, VOCAB - 4, (b, t), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _runs(model, ids, mask):
    """`{check: output tensor, or the exception it raised}`."""
    gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    runs = {"logits": lambda: model(ids, attention_mask=mask).logits,
            "greedy": lambda: model.generate(ids[:1], **gen),
            "left-padded": lambda: model.generate(ids, attention_mask=mask, **gen),
            "beam 2": lambda: model.generate(ids, attention_mask=mask, num_beams=2, **gen),
            "static cache": lambda: model.generate(ids, attention_mask=mask, cache_implementation="static", **gen)}
    out = {}
    for name, run in runs.items():
        try:
            out[name] = run()
        except Exception as e:  # noqa: BLE001 (recorded)
            out[name] = e
    return out


def _compare(stock, ours) -> str:
    if isinstance(stock, Exception):
        return f"n/a (transformers: {type(stock).__name__})"
    if isinstance(ours, Exception):
        return f"{type(ours).__name__}: {str(ours)[:160]}"
    if stock.shape != ours.shape:
        return "differs (shape)"
    return "ok" if torch.equal(stock, ours) else f"differs ({(stock.float() - ours.float()).abs().max():.2g})"


def conformance(model_type: str) -> dict[str, str]:
    """`{check: "ok" | what went wrong}` of `patch` on a tiny model of `model_type` against the unpatched model;
    `{"refused": message}` when patch refuses it, `{"not built": reason}` when transformers cannot build or run it.

    Checks: logits torch.equal; greedy, left-padded batch, beam 2 and static-cache `generate()` identical;
    unpatch restores the logits; linear, YaRN and Llama-3 rules: logits identical; LongRoPE (L0 16, the families
    whose config class has it): logits identical below and past L0, and under policy "recompute" every cached step
    across L0 within 1e-4 of a fresh full forward; dynamic NTK (L0 16) under "recompute": the same; a static
    cache under "recompute" is refused when `generate()` starts. A rule the family has no form of is "n/a: why".
    """
    import posenc
    from posenc.integrations.transformers import patch, unpatch

    ids = _ids(2, 10)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    try:
        model = zoo_model(model_type)
        stock = _runs(model, ids, mask)
        if isinstance(stock["logits"], Exception):
            raise stock["logits"]
    except Exception as e:  # noqa: BLE001 (transformers itself: recorded as the reason)
        return {"not built": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]}"}
    try:
        patch(model)
    except posenc.PosencError as e:
        return {"refused": str(e)}
    out: dict[str, str] = {}
    try:
        ours = _runs(model, ids, mask)
        out.update({name: _compare(value, ours[name]) for name, value in stock.items()})
        unpatch(model)
        with torch.no_grad():
            out["unpatch"] = "ok" if torch.equal(model(ids, attention_mask=mask).logits, stock["logits"]) else "differs"
    except Exception as e:  # noqa: BLE001 (a crash under the patch is a result)
        out["crash"] = f"{type(e).__name__}: {str(e)[:200]}"
        return out
    with torch.no_grad():  # the unpatched model without the rule, past L0 too: a rule that changes neither is flagged
        plain = (stock["logits"], model(_ids(2, 24, seed=2)).logits)
    out.update(_rule_checks(model_type, ids, mask, plain))
    return out


def _rule_checks(model_type: str, ids: torch.Tensor, mask: torch.Tensor, plain: tuple) -> dict[str, str]:
    """The rule checks of `conformance` (a fresh model per rule; the unpatched one is the reference). `plain`: the
    unpatched model's logits without the rule on `ids` and on 24 tokens; a rule whose unpatched logits equal them
    on both did not reach the model, and its check could not fail: reported so."""
    import posenc
    from posenc.integrations.transformers import patch

    from tests.helpers.transformers_tiny import cached_vs_full, fresh_full

    longrope = {"longrope": LONGROPE_TYPES[model_type]} if model_type in LONGROPE_TYPES else {}
    out: dict[str, str] = {}
    for name, rule in {**RULES, **longrope, "dynamic recompute": DYNAMIC}.items():
        dynamic, lengthwise = name == "dynamic recompute", name in ("dynamic recompute", "longrope")
        try:
            model = zoo_model(model_type, rope=rule, max_positions=16 if dynamic else None)
        except NotApplicable as e:
            out[name] = f"n/a: {e}"
            if dynamic:
                out["static + recompute"] = "n/a: no dynamic rule"
            continue
        except Exception as e:  # noqa: BLE001 (transformers cannot build it with this rule)
            out[name] = f"n/a (transformers: {type(e).__name__}: {str(e)[:120]})"
            continue
        long_ids = _ids(2, 24, seed=2)  # past L0 (16)
        try:
            full = fresh_full(model) if lengthwise else None  # before any forward: dynamic rotaries keep state
            with torch.no_grad():
                reference = copy.deepcopy(model)(ids, attention_mask=mask).logits
                reference_long = copy.deepcopy(model)(long_ids).logits
        except Exception as e:  # noqa: BLE001 (stock fails: nothing to compare with)
            out[name] = f"n/a (transformers: {type(e).__name__}: {str(e)[:120]})"
            continue
        if torch.equal(reference, plain[0]) and torch.equal(reference_long, plain[1]):
            out[name] = "no effect: the unpatched model's logits are those without the rule"
            continue
        try:
            with torch.no_grad():
                patch(model)
                same = torch.equal(model(ids, attention_mask=mask).logits, reference)
                if name == "longrope":
                    same = same and torch.equal(model(long_ids).logits, reference_long)
                if full is None or not same:
                    out[name] = "ok" if same else "differs"
                    continue
                worst, _ = cached_vs_full(model, full, ids[:1, :10], 10)  # crosses L0 = 16
                out[name] = "ok" if worst < 1e-4 else f"{worst:.2g} from a fresh full forward"
                if dynamic:
                    out["static + recompute"] = _static_recompute(model, ids, mask)
        except posenc.PosencError as e:
            out[name] = f"refused: {str(e)[:160]}"
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {str(e)[:160]}"
    return out


def _static_recompute(model, ids: torch.Tensor, mask: torch.Tensor) -> str:
    """A static cache under "recompute" with a table that changes within its length: refused when generate() starts."""
    import posenc

    try:
        model.generate(ids, attention_mask=mask, cache_implementation="static", max_new_tokens=10, do_sample=False,
                       pad_token_id=0)
        return "ran (no table change seen)"
    except posenc.PosencError as e:
        return "refused at start" if "DynamicCache for policy='recompute'" in str(e) else f"refused: {e}"
