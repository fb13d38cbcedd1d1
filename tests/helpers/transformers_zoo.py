"""Test helper: a tiny random model of every causal-LM model type of the installed transformers that posenc's
enumeration reads (a modeling file with a rotary class, tests/helpers/hf_enumeration.py), built from its config
class at the tiny sizes (hidden 64, 2 layers, 4 heads, 2 KV heads), float32, seeded.

`zoo_model(model_type, rope=None)` builds one (its config: tests/helpers/transformers_zoo_config.py `zoo_config`;
`rope` is the rope rule, given to the config class as a user would); `conformance(model_type)` checks `patch` on it
against the unpatched model. Nothing here comes from posenc but `patch` / `unpatch` under test.
"""

from __future__ import annotations

import copy
import warnings

import torch

from tests.helpers.transformers_zoo_config import VOCAB, NotApplicable, zoo_config

__all__ = ["causal_lm_types", "zoo_model", "zoo_config", "conformance", "NotApplicable", "CHECKS", "RULES"]
MAX_PARAMETERS = 4_000_000


def causal_lm_types() -> list[str]:
    """Model types with a causal-LM class and a rotary class in their modeling file."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from tests.helpers.hf_enumeration import rotary_model_types

    return sorted(t for t, _ in rotary_model_types() if t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


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
    across L0 within 1e-4 of a fresh full forward; dynamic NTK (L0 16) under "recompute": the same, with a dynamic
    cache and with a static one (`generate(cache_implementation="static")`, left-padded batch). A rule the family
    has no form of is "n/a: why".
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
        why = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        return {"not built": f"{type(e).__name__}: {why[:160]}"}
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
            # the family ignores the rule: the check could not fail; the patched model must ignore it too
            try:
                patch(model)
                with torch.no_grad():
                    same = torch.equal(model(ids, attention_mask=mask).logits, reference)
                out[name] = ("n/a: the family ignores the rule (stock logits unchanged; patched the same)" if same
                             else "differs: the family ignores the rule, the patched model applies it")
            except posenc.PosencError as e:  # patch() refuses a rule the family ignores: nothing to compare
                out[name] = f"n/a: the family ignores the rule and patch() refuses it ({str(e)[:120]})"
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


def _static_recompute(model, ids: torch.Tensor, mask: torch.Tensor, new: int = 10) -> str:
    """A static cache under "recompute" across the rule's switch: every `generate(cache_implementation="static")`
    step within 1e-4 of the model's own forward over the whole sequence so far without a cache, at the
    positions `generate()` gives it (left-padded batch)."""
    import posenc

    try:
        run = model.generate(ids, attention_mask=mask, cache_implementation="static", max_new_tokens=new,
                             do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    except posenc.PosencError as e:
        return f"refused: {str(e)[:160]}"
    seq, t = run.sequences, ids.shape[1]
    full = torch.cat((mask, mask.new_ones(mask.shape[0], seq.shape[1] - t)), 1)
    worst = 0.0
    with torch.no_grad():
        for i, logits in enumerate(run.logits):
            m = full[:, :t + i]
            positions = (m.long().cumsum(-1) - 1).masked_fill(m == 0, 1)
            fresh = model(seq[:, :t + i], attention_mask=m, position_ids=positions, use_cache=False).logits[:, -1]
            worst = max(worst, (fresh - logits).abs().max().item())
    return "ok" if worst < 1e-4 else f"{worst:.2g} from a fresh full forward"
