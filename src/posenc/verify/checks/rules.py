"""`rules-vs-reference`: the engine against the reference implementation under every rule verify runs.

The length rows measure each rule's physics (it changes the logits, no jump at L0); they cannot see a
rule implemented with the wrong numbers (YaRN without its attention temperature, a dropped theta). Here
each rule (the checkpoint's own, default with NTK theta, linear, dynamic, YaRN, YaRN untruncated,
Llama-3, LongRoPE) runs on the engine and on the reference (transformers on the same weights; posenc's
decoder when testing transformers) at two lengths: L0/2 (inside the reduced L0: length-dependent rules
must use their short table) and L1 + L0/2 (crossing L0 and L1 = 2 L0: a cos/sin table of L1 rows is
read past its end); the rules that switch tables with the sequence length (dynamic NTK, LongRoPE: long
factors for more than L0 tokens) also at L0 - 1, L0 and L0 + 1 tokens, so a switch one token early or
late is seen (LongRoPE's short and long factors differ by nats). Per-token log-probabilities of the text are compared element-wise; the bound is
float32 noise: `logprob = logit - logsumexp`, two rounded terms, so twice the logit noise of a sequence
reaching position n (`shift_tol`: 1e-4 plus the float32 angle rounding 64 n 2^-24 that two independent
implementations may each carry). On SmolLM2 at L0 = 256 the faults this row must catch move logprobs by
0.17 (YaRN truncate ignored, inside L0) to 7 nats; clean engines stay below 2.3e-4.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import Budget, Row, Subject, boundary_rules, fmt
from .consistency import shift_tol

__all__ = ["rules_vs_reference", "all_rules", "token_logprobs", "LOGPROB_TOL_FACTOR", "TOP1_MIN"]

LOGPROB_TOL_FACTOR = 2.0
SWITCHING = ("dynamic", "longrope")  # rules whose table depends on the sequence length: probed at L0 - 1, L0, L0 + 1
TOP1_MIN = 0.99


def all_rules(l0: int, theta: float, head_dim: int) -> dict[str, dict | None]:
    """Every rule verify runs, at reduced original length `l0` (factor 2)."""
    rules: dict[str, dict | None] = {"default": None, **boundary_rules(l0, theta, head_dim)}
    rules["yarn-untruncated"] = {**rules["yarn"], "truncate": False}
    half = head_dim // 2  # LongRoPE: per-channel divisors; long ones ramp from 1 (fast) to 4 (slow channels)
    rules["longrope"] = {"rope_type": "longrope", "factor": 2.0, "original_max_position_embeddings": l0,
                         "short_factor": [1.0 + 0.5 * i / (half - 1) for i in range(half)],
                         "long_factor": [1.0 + 3.0 * i / (half - 1) for i in range(half)],
                         "attention_factor": 1.1}
    return rules


@torch.no_grad()
def token_logprobs(engine: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`([t - 1] float64 logprob of each next token, [t - 1] int64 top-1 prediction)` for `ids [1, t]`,
    through either protocol (logits: log_softmax of one forward; scoring: the engine's prompt logprobs)."""
    if getattr(engine, "protocol", "logits") == "scoring":
        out = engine.score([ids[0].tolist()])[0]
        return torch.from_numpy(out["logprobs"][1:].astype("float64")), torch.from_numpy(out["top1"][1:].copy())
    logits = engine.forward(ids)[0, :-1]  # [t - 1, v]
    lp = torch.log_softmax(logits.double(), dim=-1).gather(1, ids[0, 1:, None])[:, 0]
    return lp, logits.argmax(-1)


def _compare(engine: Any, reference: Any, ids: torch.Tensor) -> dict[str, float]:
    a, a1 = token_logprobs(engine, ids)
    b, b1 = token_logprobs(reference, ids)
    diff = (a - b).abs()
    worst = float(diff.max()) if bool(torch.isfinite(diff).all()) else float("inf")
    return {"max_abs_logprob_diff": worst, "at_token": int(diff.nan_to_num(float("inf")).argmax()) + 1,
            "top1_agreement": float((a1 == b1).double().mean()), "nll": float(-a.mean()),
            "reference_nll": float(-b.mean())}


@torch.no_grad()
def rules_vs_reference(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    if subject.reference is None:
        return Row("rules-vs-reference", None, skipped="no reference implementation available")
    l0 = min(budget.boundary_l0, subject.l0)
    lengths = (l0 // 2, 2 * l0 + l0 // 2)
    switch = (l0 - 1, l0, l0 + 1)  # where a length-dependent rule changes its table (> L0 switches)
    ids = subject.text(lengths[-1], offset=30000)
    tols = {n: LOGPROB_TOL_FACTOR * shift_tol(subject.dtype, n) for n in (*lengths, *switch)}
    rules = all_rules(l0, subject.theta, subject.head_dim)
    kept, not_implemented = subject.split_rules(rules)
    per_rule: dict[str, Any] = {}
    failed = []
    for name, rule in kept.items():
        try:
            engine = subject.engine(rule)
        except Exception as exc:  # noqa: BLE001 - a crash or refusal of one rule fails that rule only
            if type(exc).__name__ == "RuleNotImplemented":
                not_implemented[name] = str(exc)
                continue
            per_rule[name] = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            failed.append(name)
            continue
        reference = subject.reference(subject.model_path, rule, subject.dtype)
        entry = {}
        try:
            for n in sorted((*lengths, *switch)) if name in SWITCHING else lengths:
                entry[str(n)] = _compare(engine, reference, ids[:, :n])
        except Exception as exc:  # noqa: BLE001
            if getattr(exc, "refused", False):  # declined at load time: a limitation, said as such, not wrong numbers
                not_implemented[name] = f"n/a: the engine refused this configuration ({str(exc).splitlines()[0]})"
                continue
            entry["error"] = f"{type(exc).__name__}: {exc}"[:400]
        ok = "error" not in entry and all(e["max_abs_logprob_diff"] <= tols[int(n)] and
                                          e["top1_agreement"] >= TOP1_MIN for n, e in entry.items())
        per_rule[name] = entry
        if not ok:
            failed.append(name)
        if progress:
            progress()
    worst = max((e["max_abs_logprob_diff"] for v in per_rule.values() for e in v.values() if isinstance(e, dict)),
                default=0.0)
    measured: dict[str, Any] = {"max_abs_logprob_diff": worst, "failed_rules": failed, "L0": l0,
                                "lengths": list(lengths),
                                "switch_lengths": {"rules": [r for r in SWITCHING if r in per_rule], "lengths": list(switch)}}
    measured.update({f"{k}_diff": max((e["max_abs_logprob_diff"] for e in v.values() if isinstance(e, dict)),
                                      default=float("inf")) for k, v in per_rule.items()})
    if not_implemented:
        measured["not_implemented"] = sorted(not_implemented)
    return Row("rules-vs-reference", not failed if per_rule else None, measured,
               {"max_abs_logprob_diff": " and ".join(f"<= {fmt(tols[n])} at {n} tokens" for n in lengths)
                + f" (<= {fmt(tols[l0 + 1])} at {l0 - 1}, {l0}, {l0 + 1} tokens for {', '.join(SWITCHING)})",
                "top1_agreement": f">= {TOP1_MIN}"},
               explanation=f"each rule at L0 = {l0} (factor 2) on the engine and the reference, {lengths[0]} and "
                           f"{lengths[1]} tokens (inside L0; past L1), and {l0 - 1}, {l0}, {l0 + 1} tokens for the rules that "
                           f"switch at L0 ({', '.join(SWITCHING)}): per-token logprobs equal up to float32 noise"
                           + (f"; n/a (not implemented by the engine): {sorted(not_implemented)}"
                              if not_implemented else ""),
               details={"per_rule": per_rule, "not_implemented": not_implemented},
               skipped=None if per_rule else "n/a: the engine implements none of the rules")
