"""Rows for scoring-protocol engines that move positions: `relativity` (through a position map) and
`chunked-prefill` (the same prompt prefilled whole and in chunks).

A serving engine derives positions itself, so relativity needs the capability `positions`: `score` and
`generate` take `positions=[offset, gap_at, gap]` and the engine's own position p becomes
`offset + p + gap * (p >= gap_at)` (vLLM: a hook on its rotary embedding). `chunked-prefill` needs the
capability `chunked_prefill`: `engine.with_chunked_prefill(tokens)` is the same engine prefilling at
most `tokens` per step. Both compare per-token logprobs of the same tokens computed two ways, and with
the reference (transformers on the same weights) given the same position ids, at the bound of
`rules.py`: twice the logit noise of a sequence reaching that position (`shift_tol`).
"""

from __future__ import annotations

from typing import Any

import torch

from .common import Budget, Row, Subject, fmt, worst
from .consistency import GAP, HONOURED_RATIO, logit_tol, shift_tol
from .rules import LOGPROB_TOL_FACTOR

__all__ = ["score_relativity", "chunked_prefill", "CHUNK", "reference_logprobs"]

CHUNK = 64  # tokens per prefill step: a multiple of vLLM's CPU block size (32); prompts take 4.6 chunks


def _max(a: Any, b: Any) -> float:
    d = (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs()
    return float(d.max()) if bool(torch.isfinite(d).all()) else float("inf")


def _tol(subject: Subject, last_position: int) -> float:
    return LOGPROB_TOL_FACTOR * shift_tol(subject.dtype, last_position)


@torch.no_grad()
def reference_logprobs(engine: Any, ids: list[int], positions: torch.Tensor | None = None) -> torch.Tensor:
    """`[t - 1]` float64 logprob of each next token of `ids` on a logits engine, at `positions [t]` (None: 0..)."""
    x = torch.tensor([ids])  # [1, t]
    logits = engine.forward(x, position_ids=None if positions is None else positions[None])[0, :-1]  # [t - 1, v]
    return torch.log_softmax(logits.double(), dim=-1).gather(1, x[0, 1:, None])[:, 0]


def _generated(engine: Any, prompt: list[int], steps: int, positions: list | None = None) -> dict[str, Any]:
    return engine.generate(prompt, steps, **({} if positions is None else {"positions": positions}))


def _same_tokens_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Max logprob difference of two greedy generations; infinite when they chose different tokens."""
    if list(a["tokens"]) != list(b["tokens"]):
        return float("inf")
    return _max(a["logprobs"], b["logprobs"])


@torch.no_grad()
def score_relativity(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    engine = subject.engine(None)
    if "positions" not in getattr(engine, "capabilities", ()):
        return Row("relativity", None, skipped="n/a: needs explicit position ids (the engine derives positions "
                                               "itself and declares no position map)")
    n, steps = budget.relativity_len, 8
    ids = subject.text(n, offset=1000)[0].tolist()
    prompt = ids[:n - steps]
    base = torch.from_numpy(engine.score([ids])[0]["logprobs"][1:])  # [n - 1]
    plain = _generated(engine, prompt, steps)
    shifts = [s for s in budget.shifts if s + n <= subject.l0]
    ref = None if subject.reference is None else subject.reference(subject.model_path, None, subject.dtype)
    per_shift, ratios = {}, []
    for s in shifts:
        tol = _tol(subject, s + n)
        shifted = torch.from_numpy(engine.score([ids], positions=[s, None, 0])[0]["logprobs"][1:])
        entry = {"full": _max(shifted, base), "cached": _same_tokens_diff(_generated(engine, prompt, steps,
                                                                                      [s, None, 0]), plain)}
        if ref is not None:
            entry["reference"] = _max(shifted, reference_logprobs(ref, ids, s + torch.arange(n)))
        ratios += [v / tol for v in entry.values()]
        per_shift[str(s)] = {**entry, "tolerance": tol}
        if progress:
            progress()
    half = n // 2
    gap = min(GAP, max(subject.l0 - n, 1))
    gapped = torch.from_numpy(engine.score([ids], positions=[0, half, gap])[0]["logprobs"][1:])
    honoured = _max(gapped[half - 1:], base[half - 1:])  # entry j predicts token j + 1
    measured: dict[str, Any] = {"max_abs_logprob_diff": worst(v for e in per_shift.values() for k, v in e.items()
                                                              if k != "tolerance"),
                                "worst_diff_over_tolerance": worst(ratios), "gap_effect": honoured, "shifts": shifts}
    if ref is not None:
        at = torch.arange(n) + gap * (torch.arange(n) >= half)  # [n]: 0..h-1, h+gap..n-1+gap
        measured["gap_reference_diff"] = _max(gapped, reference_logprobs(ref, ids, at))
        ratios.append(measured["gap_reference_diff"] / _tol(subject, n + gap))
        measured["worst_diff_over_tolerance"] = worst(ratios)
    need = HONOURED_RATIO * logit_tol(subject.dtype)
    ratio = measured["worst_diff_over_tolerance"]
    passed = bool(shifts) and ratio <= 1.0 and honoured >= need  # NaN and inf never pass
    return Row("relativity", passed, measured,
               {"worst_diff_over_tolerance": f"<= 1 (tolerance = {LOGPROB_TOL_FACTOR:g} x ({fmt(logit_tol(subject.dtype))}"
                                             " + 64 (s + n) 2^-24))",
                "gap_effect": f">= {fmt(need)} (the position map is honoured)"},
               explanation=f"{n} tokens scored at positions s..s+n-1 (the engine's position map) vs 0..n-1, and "
                           f"{steps} greedy tokens decoded after a prefix at s.. vs at 0..; both vs the reference "
                           f"at the same position ids; a gap of {gap} positions at token {half} must move the later "
                           "half",
               details={"per_shift": per_shift})


@torch.no_grad()
def chunked_prefill(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    engine = subject.engine(None)
    if "chunked_prefill" not in getattr(engine, "capabilities", ()):
        return Row("chunked-prefill", None, skipped="n/a: the engine declares no chunked prefill")
    steps, n = 8, 4 * CHUNK + 37  # a partial last chunk
    prompt = subject.text(n, offset=13000)[0].tolist()
    whole = engine.score([prompt])[0]["logprobs"][1:]
    whole_gen = _generated(engine, prompt, steps)
    chunked = engine.with_chunked_prefill(CHUNK)
    try:
        parts = chunked.score([prompt])[0]["logprobs"][1:]
        parts_gen = _generated(chunked, prompt, steps)
    finally:
        chunked.close()
    measured: dict[str, Any] = {"score_diff": _max(parts, whole), "generate_diff": _same_tokens_diff(parts_gen,
                                                                                                      whole_gen),
                                "chunk": CHUNK, "tokens": n}
    if progress:
        progress()
    if subject.reference is not None:
        ref = subject.reference(subject.model_path, None, subject.dtype)
        measured["score_reference_diff"] = _max(parts, reference_logprobs(ref, prompt))
        full = prompt + [int(t) for t in parts_gen["tokens"]]
        measured["generate_reference_diff"] = _max(parts_gen["logprobs"], reference_logprobs(ref, full)[n - 1:])
    tol = _tol(subject, n + steps)
    worst_diff = worst(v for k, v in measured.items() if k.endswith("diff"))
    return Row("chunked-prefill", worst_diff <= tol, {"max_abs_logprob_diff": worst_diff, **measured},
               {"max_abs_logprob_diff": f"<= {fmt(tol)}"},
               explanation=f"a {n}-token prompt prefilled in chunks of {CHUNK} tokens vs in one step: prompt "
                           f"logprobs and {steps} greedy tokens' logprobs, and both vs the reference")
