"""`length-boundaries` and `short-context`: what each length rule does, measured against its physics.

length-boundaries: for linear, NTK-aware, dynamic NTK, YaRN and Llama-3 with L1 = 2 L0 (L0 lowered by
the budget so the boundary is cheap), one full forward of L1 tokens of text. Two measurements per rule:
- applied: the rule must change the logits where its formula changes the table (every rule except
  dynamic, at every length; dynamic, only once the sequence passes L0) by more than `APPLIED_RATIO`
  times float32 noise, and dynamic on a sequence of exactly L0 tokens must equal the plain model.
- no jump: mean next-token NLL in the L0/8 tokens after L0 minus the L0/8 before it, minus the same
  difference for the plain model on the same tokens (text variation cancels), within `JUMP_SIGMAS`
  standard errors (a position jump at L0 is a shift of many nats, not a fraction of one).
short-context: NLL of `short_len` tokens (inside the checkpoint's L0) with each rule at factor 4 vs
without; the bound per rule follows from which wavelengths the rule touches (see SHORT_BOUNDS).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .common import Budget, Row, Subject, boundary_rules, fmt, max_diff, short_rules, token_nll, within, worst
from .consistency import logit_tol

__all__ = ["length_boundaries", "short_context", "SHORT_BOUNDS", "APPLIED_RATIO", "JUMP_SIGMAS"]

APPLIED_RATIO = 100.0  # a rule that is applied moves logits >= 100x float32 noise
JUMP_SIGMAS = 4.0  # 4 standard errors: a false alarm once in ~16,000 windows of Gaussian noise

# short-context bounds (nats, factor 4, inside L0), stated from the physics before measuring:
SHORT_BOUNDS = {
    "dynamic": ("<=", 1e-4, "below L0 dynamic NTK is the unscaled table: identical up to float32 noise"),
    "yarn": ("<=", 0.15, "YaRN keeps wavelengths shorter than L0/32 as they were and only interpolates those "
                         "that never turn within L0, plus a 1.14 logit temperature (+0.068 measured at 2048)"),
    "llama3": ("<=", 0.15, "Llama-3 keeps wavelengths shorter than L0/4 and only divides the long ones"),
    "ntk": ("<=", 0.3, "NTK-aware raises the base 4.2x: high frequencies barely move, middle ones stretch "
                       "without a ramp, so between YaRN and linear"),
    "linear": (">=", 0.5, "PI divides every angle by 4: neighbours sit 0.25 apart, never seen in training, "
                          "so short context must be damaged (+1.6 measured at 2048); no damage = not applied"),
}


@torch.no_grad()
def length_boundaries(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    l0 = min(budget.boundary_l0, subject.l0)
    l1 = 2 * l0
    ids = subject.text(l1, offset=20000)
    tol = logit_tol(subject.dtype)
    plain = subject.engine(None).forward(ids)  # [1, l1, v]
    plain_nll = token_nll(plain, ids)  # [l1 - 1]
    w = max(8, l0 // 8)
    marks = [l0 - 1, l0, l0 + 1, l1 - 1]
    per_rule: dict[str, Any] = {}
    curves = {"default": plain_nll.tolist()}
    failed = []
    rules, not_implemented = subject.split_rules(boundary_rules(l0, subject.theta, subject.head_dim))
    for name, rule in rules.items():
        engine = subject.engine(rule)
        inside = max_diff(engine.forward(ids[:, :l0]), plain[:, :l0]) if name == "dynamic" else None
        out = engine.forward(ids)
        nll = token_nll(out, ids)
        if name == "dynamic":  # L0 tokens must use the plain table, before and after a longer sequence
            inside_after = max_diff(engine.forward(ids[:, :l0]), plain[:, :l0])
            effect = max_diff(out[:, l0:], plain[:, l0:])
            applied = within(worst([inside, inside_after]), tol) and effect >= APPLIED_RATIO * tol
        else:
            inside_after, effect = None, max_diff(out, plain)
            applied = effect >= APPLIED_RATIO * tol
        jump = float(nll[l0 - 1:l0 - 1 + w].mean() - nll[l0 - 1 - w:l0 - 1].mean())  # NLL index j predicts j+1
        base_jump = float(plain_nll[l0 - 1:l0 - 1 + w].mean() - plain_nll[l0 - 1 - w:l0 - 1].mean())
        diff = (nll - plain_nll)[l0 - 1 - w:l0 - 1 + w]
        se = float(diff[:w].var() / w + diff[w:].var() / w) ** 0.5
        excess = jump - base_jump
        ok_jump = within(abs(excess), max(JUMP_SIGMAS * se, 1e-6)) if math.isfinite(se) else False
        per_rule[name] = {"applied": applied, "effect_max_abs_logit_diff": effect, "inside_l0_diff": inside,
                          "inside_l0_diff_after_long": inside_after,
                          "jump_excess_nats": excess, "jump_se": se, "no_jump": ok_jump,
                          "nll_at": {str(p): float(nll[p - 1]) for p in marks},
                          "logit_diff_at": {str(p): max_diff(out[:, p], plain[:, p]) for p in marks},
                          "nll_mean": float(nll.mean())}
        curves[name] = nll.tolist()
        if not (applied and ok_jump):
            failed.append(name)
        if progress:
            progress()
    return Row("length-boundaries", not failed,
               measured={"L0": l0, "L1": l1, "failed_rules": failed,
                         **({"not_implemented": sorted(not_implemented)} if not_implemented else {}),
                         **{f"{k}_jump_excess": v["jump_excess_nats"] for k, v in per_rule.items()},
                         **{f"{k}_effect": v["effect_max_abs_logit_diff"] for k, v in per_rule.items()}},
               thresholds={"applied": f"effect >= {APPLIED_RATIO:g} x {fmt(tol)} (dynamic: only past L0, "
                                      f"<= {fmt(tol)} on L0 tokens)",
                           "jump_excess": f"|excess| <= {JUMP_SIGMAS:g} standard errors"},
               explanation=f"L1 = {l1} tokens with each rule at L0 = {l0} (lowered to reach the boundary "
                           "cheaply): each rule changes the logits where its formula says, and loss shows no "
                           "jump across L0",
               details={"per_rule": per_rule, "nll_curves": curves, "marks": marks})


@torch.no_grad()
def short_context(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    """Perplexity inside L0 with each rule (factor 4 at the checkpoint's L0) vs without.

    The bounds for yarn, llama3, ntk and linear describe a trained model; on random weights
    (`subject.trained` False: tests) only dynamic's exactness and linear's "it changes something" are held.
    """
    trained = subject.trained
    n = min(budget.short_len, subject.l0)
    ids = subject.text(n, offset=40000)
    base = float(token_nll(subject.engine(None).forward(ids), ids).mean())
    deltas, failed, bounds = {}, [], {}
    tol = logit_tol(subject.dtype)
    rules, not_implemented = subject.split_rules(short_rules(subject.l0, subject.theta, subject.head_dim))
    for name, rule in rules.items():
        op, bound, why = SHORT_BOUNDS[name]
        if not trained and name not in ("dynamic", "linear"):
            continue
        if not trained and name == "linear":
            bound = tol  # random weights: PI must change the NLL at all
        delta = float(token_nll(subject.engine(rule).forward(ids), ids).mean()) - base
        deltas[name] = delta
        bounds[name] = f"{op} {fmt(bound)}"
        ok = abs(delta) <= bound if op == "<=" else (delta if trained else abs(delta)) >= bound
        if not ok:
            failed.append(name)
        if progress:
            progress()
    return Row("short-context", not failed,
               measured={"nll_default": base, "tokens": n, "failed_rules": failed,
                         **({"not_implemented": sorted(not_implemented)} if not_implemented else {}),
                         **{f"{k}_delta_nll": v for k, v in deltas.items()}},
               thresholds={f"{k}_delta_nll": v for k, v in bounds.items()},
               explanation=f"NLL of {n} tokens inside L0 = {subject.l0} with each rule x4 minus without: "
                           + "; ".join(f"{k}: {SHORT_BOUNDS[k][2]}" for k in deltas),
               details={"deltas": deltas, "why": {k: SHORT_BOUNDS[k][2] for k in deltas}})
