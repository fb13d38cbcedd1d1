"""Rows that compare an engine with itself: `relativity`, `prefill-decode`, `batch-padding`.

Each compares two computations that must give the same logits when positions are handled right, so
the threshold is float32 noise: `LOGIT_TOL` (1e-4 in float32). Two correct float32 implementations of
SmolLM2 differ by 5.5e-5 over 200 tokens and prefill vs decode by 6.1e-5 (measured on the embedded model); a position that is
off by one, or keys carrying the wrong rotation, move logits by 1e-2 to 1 and more.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from ...cache.quant.formats import kv_format
from .common import Budget, Row, Subject, boundary_rules, fmt, max_diff, spread, top1_agree, within, worst

__all__ = ["relativity", "prefill_decode", "batch_padding", "LOGIT_TOL", "logit_tol", "kv_tol", "reference",
           "SPREAD_RATIO", "KV_EFFECT_FACTOR"]

LOGIT_TOL = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 0.25, torch.float16: 0.05}
# A quantized KV cache (`verify --kv-dtype`): the references of the cached comparisons run through a fresh
# cache of the same format (`reference`), so both sides carry its codes. They still differ by more than
# float noise: quantization is discontinuous, so a float-noise difference flips a code at a rounding
# boundary and the flip spreads through the layers; keys quantized after RoPE round differently at shifted
# positions. Each comparison therefore allows float noise + KV_EFFECT_FACTOR x the format's effect on its
# reference (that reference vs the same forward without a cache, on the same tokens, measured before the
# comparison): a correct cached run and its reference each lie within about that effect of the float
# computation, so within twice it of each other. The price: a quantized cache hides position faults
# smaller than that (reported as `kv_effect` beside every threshold).
KV_EFFECT_FACTOR = 2.0
# float32 angle rounding: |error| <= p * 2**-24 rad at position p (posenc.rope.tables), which moves the
# logits of a shifted copy by at most SENSITIVITY * p * 2**-24; SENSITIVITY bounds |d logit / d angle|.
SENSITIVITY = 64.0
# The compared logits must depend on the tokens: an engine returning the same logits for every input
# agrees with itself everywhere. Real text moves the logits of SmolLM2 by 24 between positions, the
# tests' random model by 8; SPREAD_RATIO x the tolerance (1e-3 in float32, 2.5 in bfloat16) is far below.
SPREAD_RATIO = 10.0
# ...and explicit positions must be honoured: the same tokens with a gap of GAP positions in the middle
# change the later half's logits (their distances to the first half change) by >= HONOURED_RATIO x the
# tolerance. An engine that ignores position_ids computes the shifted copies at 0.. and would pass.
GAP, HONOURED_RATIO = 37, 100.0


def informative_of(spreads: list[float], tol: float) -> tuple[float, bool, dict[str, str]]:
    """`(smallest spread, it is >= SPREAD_RATIO * tol, the threshold)` over the row's reference forwards."""
    s = min(spreads) if spreads and not any(math.isnan(v) for v in spreads) else math.nan
    return s, within(SPREAD_RATIO * tol, s), {"logit_spread": f">= {fmt(SPREAD_RATIO * tol)} (the logits depend on "
                                                                 "the tokens)"}


def logit_tol(dtype: torch.dtype) -> float:
    """Logit noise of two computations in `dtype`."""
    return LOGIT_TOL.get(dtype, 1e-4)


def kv_tol(subject: Subject, effect: float) -> float:
    """Noise allowed between a cached run and its `reference`: `logit_tol` plus, under `verify --kv-dtype`,
    KV_EFFECT_FACTOR x `effect` (the format's effect on that reference)."""
    return logit_tol(subject.dtype) + (KV_EFFECT_FACTOR * effect if _kv(subject) else 0.0)


def _kv(subject: Subject) -> bool:
    return getattr(subject, "kv_dtype", None) is not None


def reference(subject: Subject, engine: Any, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """A reference forward: without a cache, or, under `verify --kv-dtype`, through a fresh cache of the format.

    A forward through a cache attends over what the cache stores (for a quantized one: decoded codes), so a
    quantized reference carries the same quantization as the cached run it is compared with, when both hold
    the same tokens (a per-channel store encodes a block of `group` tokens only when it fills: callers compare
    runs at the same fill); the rows then see position faults, not mainly the format's own error (which
    `kv_effect` reports and benchmarks/kv_quant.py measures as NLL)."""
    if not _kv(subject):
        return engine.forward(ids, **kwargs)
    return engine.forward(ids, cache=engine.new_cache(ids.shape[0], ids.shape[1]), **kwargs)


def shift_tol(dtype: torch.dtype, max_position: int) -> float:
    """Noise allowed between a sequence and its shifted copy ending at `max_position`."""
    return logit_tol(dtype) + SENSITIVITY * max_position * 2.0**-24


@torch.no_grad()
def relativity(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    """RoPE attends by relative position: the same tokens shifted by s give the same logits.

    Full forwards at positions s..s+n-1 with explicit positions, and a cached variant (prefix prefilled
    at the shifted positions, the last 8 tokens decoded after it) that catches keys rotated at one
    position and reused at another; and, against the reference, the halves of the text at 0.. and at the
    largest shift (`_far_gap`), which catches a position fault anywhere between them.
    """
    engine = subject.engine(None)
    n = budget.relativity_len
    ids = subject.text(n, offset=1000)
    base = engine.forward(ids, position_ids=torch.arange(n)[None])  # [1, n, v]
    split = n - 8
    base_tail, kv_effect = base[:, split:], 0.0
    if _kv(subject):  # the same cached run at shift 0 carries the same format; its effect sets the allowance
        base_tail = _cached_tail(engine, ids, 0, split)
        kv_effect = max_diff(base_tail, base[:, split:])
    shifts = [s for s in budget.shifts if s + n <= subject.l0]
    diffs, ratios, agree, per_shift = [], [], 1.0, {}
    for s in shifts:
        tol = shift_tol(subject.dtype, s + n)
        tol_cached = tol + kv_tol(subject, kv_effect) - logit_tol(subject.dtype)  # the tail read through the cache
        full = engine.forward(ids, position_ids=(s + torch.arange(n))[None])
        tail = _cached_tail(engine, ids, s, split)
        d_full, d_cached = max_diff(full, base), max_diff(tail, base_tail)
        per_shift[str(s)] = {"full": d_full, "cached": d_cached, "tolerance": tol, "tolerance_cached": tol_cached}
        diffs += [d_full, d_cached]
        ratios += [d_full / tol, d_cached / tol_cached]
        agree = min(agree, top1_agree(full, base), top1_agree(tail, base_tail))
        if progress:
            progress()
    ratio = worst(ratios)  # NaN-aware: a NaN anywhere fails the row
    varied, informs, needs = informative_of([spread(base)], logit_tol(subject.dtype))
    no_gaps = getattr(subject.factory, "position_gaps", None)  # None: gaps taken; else why they are refused
    if no_gaps:
        # Shifted copies alone cannot fail an engine that ignores positions: without the gap the row proves
        # nothing, so it is n/a (with what was measured), never a pass.
        return Row("relativity", None, skipped=f"n/a: needs positions with a gap ({no_gaps}); shifted copies "
                   "alone cannot show that positions are honoured",
                   measured={"max_abs_logit_diff": worst(diffs), "worst_diff_over_tolerance": ratio,
                             "top1_agreement": agree, "logit_spread": varied, "shifts": shifts},
                   details={"per_shift": per_shift})
    half, gap = n // 2, min(GAP, max(subject.l0 - n, 1))
    gapped = (torch.arange(n) + gap * (torch.arange(n) >= half))[None]  # 0..h-1, h+gap..n-1+gap
    honoured = max_diff(engine.forward(ids, position_ids=gapped)[:, half:], base[:, half:])
    needs["gap_effect"] = f">= {fmt(HONOURED_RATIO * logit_tol(subject.dtype))} (explicit positions honoured)"
    far, far_tol, far_at = _far_gap(subject, engine, ids, max(shifts, default=0))
    if far is not None:
        needs["far_gap_vs_reference"] = f"<= {fmt(far_tol)} (halves at 0.. and {far_at}..)"
    passed = bool(shifts) and within(ratio, 1.0) and informs and within(HONOURED_RATIO * logit_tol(subject.dtype),
                                                                         honoured) and (far is None or within(far, far_tol))
    return Row("relativity", passed,
               measured={"max_abs_logit_diff": worst(diffs), "worst_diff_over_tolerance": ratio,
                         "top1_agreement": agree, "logit_spread": varied, "gap_effect": honoured, "shifts": shifts,
                         **({"far_gap_vs_reference": far} if far is not None else {}),
                         **({"kv_effect": kv_effect} if _kv(subject) else {})},
               thresholds={"worst_diff_over_tolerance": "<= 1 (tolerance = "
                            f"{fmt(logit_tol(subject.dtype))} + {SENSITIVITY:g} * (s + n) * 2^-24"
                            + (f"; cached: + {KV_EFFECT_FACTOR:g} x kv_effect {fmt(kv_effect)} for kv "
                               f"{subject.kv_dtype})" if _kv(subject) else ")"), **needs},
               explanation=f"{n} tokens at positions s..s+n-1 vs 0..n-1, full and cached: equal up to float32 "
                           "noise plus the float32 angle rounding that grows with the position",
               details={"per_shift": per_shift})


def _far_gap(subject: Subject, engine: Any, ids: torch.Tensor, far_at: int) -> tuple[float | None, float, int]:
    """The engine vs the reference on the same tokens with the first half at 0.. and the second at `far_at`..
    (explicit positions): a position fault past any point between the halves changes the distance between
    them, which shifted copies alone (every position moved alike) cannot show. `(max diff or None without a
    reference or a far shift, the bound: float noise + both sides' angle rounding at the last position, far_at)`."""
    n, half = ids.shape[1], ids.shape[1] // 2
    if subject.reference is None or far_at <= half:
        return None, 0.0, far_at
    positions = (torch.arange(n) + (far_at - half) * (torch.arange(n) >= half))[None]  # 0..h-1, far_at..
    reference_engine = subject.checked(subject.reference(subject.model_path, None, subject.dtype))
    d = max_diff(engine.forward(ids, position_ids=positions), reference_engine.forward(ids, position_ids=positions))
    return d, logit_tol(subject.dtype) + 2 * SENSITIVITY * (far_at + n) * 2.0**-24, far_at


def _cached_tail(engine: Any, ids: torch.Tensor, s: int, split: int) -> torch.Tensor:
    """Logits of `ids[:, split:]` decoded through a cache after a prefill, all at positions shifted by `s`."""
    n = ids.shape[1]
    cache = engine.new_cache(1, n)
    engine.forward(ids[:, :split], cache=cache, position_ids=(s + torch.arange(split))[None])
    return engine.forward(ids[:, split:], cache=cache, position_ids=(s + torch.arange(split, n))[None])


def rules_for_decode(subject: Subject, budget: Budget) -> dict[str, dict | None]:
    l0 = min(budget.boundary_l0, 1024)  # decode crosses L0; the dynamic rule needs a full forward per step
    return {"default": None, **boundary_rules(l0, subject.theta, subject.head_dim)}


@torch.no_grad()
def _decode_vs_full(subject: Subject, engine: Any, ids: torch.Tensor, prefill: int, per_step_full: bool,
                    explicit: bool) -> tuple[float, float, list[float], float, float]:
    """Prefill `prefill` tokens, decode the rest one by one; compare each step with a full forward (`reference`).

    Returns `(max diff, top-1 agreement, per-step diffs, spread of the float forward's logits, kv effect)`; the
    kv effect (0 without `--kv-dtype`) is the largest difference between the references and float forwards."""
    n = ids.shape[1]
    cache = engine.new_cache(1, n)
    pos = (lambda a, b: torch.arange(a, b)[None]) if explicit else (lambda a, b: None)
    first = engine.forward(ids[:, :prefill], cache=cache, position_ids=pos(0, prefill))
    steps = [engine.forward(ids[:, j:j + 1], cache=cache, position_ids=pos(j, j + 1)) for j in range(prefill, n)]

    def refs(forward: Callable[[torch.Tensor], torch.Tensor], per_step: bool) -> list[torch.Tensor]:
        """`[prefill logits, step logits...]`: one full forward, or one per step (a length-dependent table)."""
        if per_step:
            return [forward(ids[:, :prefill]), *(forward(ids[:, :j + 1])[:, -1:] for j in range(prefill, n))]
        full = forward(ids)
        return [full[:, :prefill], *(full[:, j:j + 1] for j in range(prefill, n))]

    floats = refs(engine.forward, per_step_full)
    # a length-dependent table, or keys quantized per channel (a block is encoded when it fills, so a step's
    # reference holds the blocks full at that step): step j must equal a full forward over tokens 0..j
    quantized = refs(lambda x: reference(subject, engine, x), per_step_full or _blocks(subject)) if _kv(subject) \
        else floats
    effect = worst(max_diff(a, b) for a, b in zip(quantized, floats)) if _kv(subject) else 0.0
    diffs = [max_diff(s, f) for s, f in zip(steps, quantized[1:])]
    agree = top1_agree(torch.cat(steps, 1), torch.cat(quantized[1:], 1))
    varied = spread(torch.cat(floats, 1))
    return worst([max_diff(first, quantized[0]), *diffs]), agree, diffs, varied, effect


def prefill_decode(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    """Cache vs full forward for the checkpoint's rule and every length rule (decode crosses the reduced L0)."""
    per_rule, seen, spreads, effects = {}, [], [], []
    rules, not_implemented = subject.split_rules(rules_for_decode(subject, budget))
    for name, rule in rules.items():
        engine = subject.engine(rule)
        steps = budget.decode_steps
        if rule is None:
            ids, prefill = subject.text(budget.decode_prefill + steps), budget.decode_prefill
        else:
            l0 = min(budget.boundary_l0, 1024)
            ids, prefill = subject.text(l0 + steps // 2), l0 - steps // 2
        dynamic = rule is not None and rule.get("rope_type") == "dynamic"
        entry = {}
        for explicit in ((False, True) if rule is None else (False,)):
            d, agree, diffs, varied, effect = _decode_vs_full(subject, engine, ids, prefill, dynamic, explicit)
            spreads.append(varied)
            effects.append(effect)
            entry["explicit" if explicit else "derived"] = {"max_abs_logit_diff": d, "top1_agreement": agree,
                                                            "per_step": diffs, "first_position": prefill,
                                                            "tolerance": kv_tol(subject, effect),
                                                            **({"kv_effect": effect} if _kv(subject) else {})}
            seen.append(d)
        per_rule[name] = entry
        if progress:
            progress()
    failed = sorted(k for k, v in per_rule.items()
                    if not all(within(e["max_abs_logit_diff"], e["tolerance"]) for e in v.values()))
    kv_effect = {"kv_effect": worst(effects)} if _kv(subject) else {}
    varied, informs, needs = informative_of(spreads, logit_tol(subject.dtype))  # full forwards: no cache read
    return Row("prefill-decode", not failed and informs,
               measured={"max_abs_logit_diff": worst(seen), "failed_rules": failed, "logit_spread": varied,
                         **{f"{k}": worst(e["max_abs_logit_diff"] for e in v.values()) for k, v in per_rule.items()},
                         **({"not_implemented": sorted(not_implemented)} if not_implemented else {}), **kv_effect},
               thresholds={"max_abs_logit_diff": f"<= {fmt(logit_tol(subject.dtype))}" + (
                   f" + {KV_EFFECT_FACTOR:g} x the rule's kv_effect (its references through the {subject.kv_dtype} "
                   "cache vs none)" if kv_effect else "") + " per rule", **needs},
               explanation="prefill then token-by-token decode (positions derived, and explicit) vs one full "
                           "forward over the same tokens; rules decode across their (reduced) L0",
               details={"per_rule": per_rule})


def _blocks(subject: Subject) -> bool:
    """Whether the subject's cache quantizes keys per channel in blocks (`verify --kv-dtype FORMAT:pre`)."""
    if not _kv(subject):
        return False
    name, _, keys = subject.kv_dtype.partition(":")
    return keys == "pre" and kv_format(name).kind != "cast"


def _solo(engine: Any, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """One row alone through a (quantized) cache: prefill, then decode, as the batched run (a per-channel store
    encodes a block when it fills)."""
    cache = engine.new_cache(1, ids.shape[1])
    first = engine.forward(ids[:, :prefill], cache=cache)
    return torch.cat([first, *(engine.forward(ids[:, j:j + 1], cache=cache) for j in range(prefill, ids.shape[1]))], 1)


@torch.no_grad()
def batch_padding(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    """Each row of a left- or right-padded batch equals its unpadded solo run (prefill, and decode after left pads)."""
    engine = subject.engine(None)
    n, decode = budget.decode_prefill, 2
    lengths = [n, n - 5, n - 11]
    rows = [subject.text(m + decode, offset=300 * i) for i, m in enumerate(lengths)]  # each [1, m + decode]
    floats = [engine.forward(r) for r in rows]  # [1, m + decode, v]
    solo = [_solo(engine, r, m) for r, m in zip(rows, lengths)] if _kv(subject) else floats
    kv_effect = worst(max_diff(a, b) for a, b in zip(solo, floats)) if _kv(subject) else 0.0
    tol = kv_tol(subject, kv_effect)
    varied, informs, needs = informative_of([spread(r) for r in floats], logit_tol(subject.dtype))  # full forwards
    b = len(rows)
    results: dict[str, float] = {}
    for side in ("left", "right"):
        for explicit in (False, True):
            ids = torch.zeros(b, n, dtype=torch.long)
            mask = torch.zeros(b, n, dtype=torch.long)
            for i, (r, m) in enumerate(zip(rows, lengths)):
                cols = slice(n - m, n) if side == "left" else slice(0, m)
                ids[i, cols], mask[i, cols] = r[0, :m], 1
            pos = ((mask.cumsum(1) - 1).clamp(min=0)) if explicit else None  # [b, n] logical positions
            cache = engine.new_cache(b, n + decode)
            out = engine.forward(ids, attention_mask=mask, cache=cache, position_ids=pos)  # [b, n, v]
            d = worst(max_diff(out[i][mask[i].bool()], solo[i][0, :m]) for i, m in enumerate(lengths))
            if side == "left":  # decode continues every row after its own last token
                for j in range(decode):
                    step_ids = torch.stack([r[0, m + j] for r, m in zip(rows, lengths)])[:, None]  # [b, 1]
                    step_pos = torch.tensor(lengths)[:, None] + j if explicit else None
                    step = engine.forward(step_ids, attention_mask=torch.ones(b, 1, dtype=torch.long), cache=cache,
                                          position_ids=step_pos)
                    d = worst([d, *(max_diff(step[i, 0], solo[i][0, m + j]) for i, m in enumerate(lengths))])
            results[f"{side}_{'explicit' if explicit else 'derived'}"] = d
            if progress:
                progress()
    largest = worst(results.values())
    from .length_batching import batch_l0, batch_lengths, length_rule_batches

    per_rule, not_implemented, rule_tol = length_rule_batches(subject, budget, progress)
    rule_worst = {k: worst(e for key, e in v.items() if key != "per_row") for k, v in per_rule.items()}
    failed = sorted(k for k, d in rule_worst.items() if not within(d, rule_tol))
    rule_lengths, width = batch_lengths(batch_l0(subject, budget))
    return Row("batch-padding", within(largest, tol) and informs and not failed,
               measured={"max_abs_logit_diff": largest, "logit_spread": varied, **results,
                         "failed_rules": failed, **rule_worst,
                         **({"not_implemented": sorted(not_implemented)} if not_implemented else {}),
                         **({"kv_effect": kv_effect} if _kv(subject) else {})},
               thresholds={"max_abs_logit_diff": f"<= {fmt(tol)}" + (
                   f" (float noise + {KV_EFFECT_FACTOR:g} x kv_effect: the solo runs through the {subject.kv_dtype} "
                   "cache vs none)" if _kv(subject) else ""), **needs,
                   **({"length rules": f"<= {fmt(rule_tol)} per rule (float noise at {width} positions)"}
                      if per_rule else {})},
               explanation=f"3 rows of {lengths} tokens padded to {n} (left: then {decode} decode steps) vs each "
                           "row alone; positions derived by the engine and given explicitly"
                           + (f"; under {sorted(per_rule)}: rows of {rule_lengths} tokens (both sides of the "
                              f"reduced L0) padded to {width} in one batch vs each alone" if per_rule else ""),
               details={"lengths": lengths, "per_rule": per_rule, "not_implemented": not_implemented})
