"""Test helper: a tiny random model of every causal-LM model type of the installed transformers that posenc's
enumeration reads (a modeling file with a rotary class, tests/helpers/hf_enumeration.py), built from its config
class: hidden 64, 2 layers, 4 heads (2 KV heads), head_dim 16, float32, seeded.

`zoo_types()` lists `(model_type, reason or None)`: None when a tiny model builds and runs a forward, else why not
(transformers itself cannot build or run it from these sizes). `zoo_model(model_type, rope=None)` builds one; `rope`
replaces the rope rule (`rope_parameters`, the layer-type dicts of per-layer models get it on their full layers).
Nothing here comes from posenc.
"""

from __future__ import annotations

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


def causal_lm_types() -> list[str]:
    """Model types with a causal-LM class and a rotary class in their modeling file."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tests.helpers.hf_enumeration import rotary_model_types

    return sorted(t for t, _ in rotary_model_types() if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def zoo_config(model_type: str, rope: dict | None = None):
    """The model type's config class at the tiny sizes (keys it does not have are left out)."""
    from transformers import AutoConfig

    base = AutoConfig.for_model(model_type)
    keys = set(base.to_dict()) | set(getattr(base, "attribute_map", {}))
    kw = {k: v for k, v in {**SIZES, **PARTS}.items() if k in keys or k in SIZES}
    if "layer_types" in keys and base.layer_types is not None:
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
    for _ in range(8):  # keys a config class exposes as read-only properties are left to it
        try:
            config = AutoConfig.for_model(model_type, **kw)
            break
        except AttributeError as e:
            name = str(e).split("'")[1] if "property" in str(e) else None
            if name not in kw:
                raise
            kw.pop(name)
    _fit_mrope(getattr(config, "rope_parameters", None), kw.get("head_dim", 16))
    if rope is not None:
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
            key = "full_attention" if "full_attention" in params else next(iter(params))
            params[key] = {**_kept(params[key]), **rope}
        else:
            config.rope_parameters = {**_kept(params or {}), **rope}
    return config


def _kept(params: dict) -> dict:
    """What a replaced rule keeps of the model's rope dict: theta and the rotated channels."""
    return {k: v for k, v in params.items() if k in ("rope_theta", "partial_rotary_factor", "mrope_section",
                                                      "mrope_interleaved")}


def _fit_mrope(params, head_dim: int) -> None:
    """M-RoPE sections scaled to the tiny head (they must sum to rotary_dim / 2)."""
    for d in (params.values() if isinstance(params, dict) and all(isinstance(v, dict) for v in params.values())
              else [params]):
        if isinstance(d, dict) and d.get("mrope_section"):
            half = int(head_dim * d.get("partial_rotary_factor", 1.0)) // 2
            d["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]


def zoo_model(model_type: str, rope: dict | None = None, dtype=torch.float32, seed: int = 0,
              max_positions: int | None = None):
    """A seeded random causal LM of `model_type` in eval mode (weights x4: sharper attention)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    config = zoo_config(model_type, rope)
    if max_positions is not None:  # dynamic NTK's L0
        config.max_position_embeddings = max_positions
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
CHECKS = ("logits", "greedy", "left-padded", "beam 2", "static cache", "unpatch", *RULES, "dynamic recompute",
          "static + recompute")


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


def _static_vs_full(model, ids, mask, new: int) -> float:
    """Worst |step logits - fresh full forward| of a static-cache `generate()`; the oracle is the model's own
    forward over the whole sequence so far without a cache, at the positions `generate()` gives it."""
    run = model.generate(ids, attention_mask=mask, cache_implementation="static", max_new_tokens=new,
                         do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    seq, t = run.sequences, ids.shape[1]
    full = torch.cat((mask, mask.new_ones(mask.shape[0], seq.shape[1] - t)), 1)
    worst = 0.0
    for i, logits in enumerate(run.logits):
        m = full[:, :t + i]
        positions = (m.long().cumsum(-1) - 1).masked_fill(m == 0, 1)
        fresh = model(seq[:, :t + i], attention_mask=m, position_ids=positions, use_cache=False).logits[:, -1]
        worst = max(worst, (fresh - logits).abs().max().item())
    return worst


def conformance(model_type: str) -> dict[str, str]:
    """`{check: "ok" | what went wrong}` of `patch` on a tiny model of `model_type` against the unpatched model;
    `{"refused": message}` when patch refuses it, `{"not built": reason}` when transformers cannot build or run it.

    Checks: logits torch.equal; greedy, left-padded batch, beam 2 and static-cache `generate()` identical;
    unpatch restores the logits; linear, YaRN and Llama-3 rules: logits and greedy identical; dynamic NTK
    (L0 16) under policy "recompute": every cached step within 1e-4 of a fresh full forward, with a dynamic
    cache and with a static one (`generate(cache_implementation="static")`, left-padded batch).
    """
    import posenc
    from posenc.integrations.transformers import patch, unpatch

    from tests.helpers.transformers_tiny import cached_vs_full, fresh_full

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
    for name, rule in {**RULES, "dynamic recompute": DYNAMIC}.items():
        try:
            model = zoo_model(model_type, rope=rule, max_positions=16 if rule is DYNAMIC else None)
            with torch.no_grad():
                reference = model(ids, attention_mask=mask).logits
                if rule is DYNAMIC:
                    full = fresh_full(model)
                    patch(model)
                    worst, _ = cached_vs_full(model, full, ids[:1, :10], 10)
                    out[name] = "ok" if worst < 1e-4 else f"{worst:.2g} from a fresh full forward"
                    try:
                        worst = _static_vs_full(model, ids, mask, 10)
                        out["static + recompute"] = "ok" if worst < 1e-4 else f"{worst:.2g} from a fresh full forward"
                    except posenc.PosencError as e:
                        out["static + recompute"] = f"refused: {str(e)[:160]}"
                    continue
                patch(model)
                out[name] = "ok" if torch.equal(model(ids, attention_mask=mask).logits, reference) else "differs"
        except posenc.PosencError as e:
            out[name] = f"refused: {str(e)[:160]}"
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {str(e)[:160]}"
    return out
