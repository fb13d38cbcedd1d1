"""The rows for scoring-protocol engines (serving engines: vLLM, OpenAI-compatible servers).

Such an engine returns log-probabilities of the tokens it is given (and its top-1), not full logits,
and derives positions itself. Each row compares log-probabilities of the same tokens computed two ways
that must agree when positions are handled right, at the bound of `rules.py` (twice the logit noise):
- `pairing`: the text under the checkpoint's rule vs the reference implementation;
- `prefill-decode`: greedy generation's logprobs vs scoring the prompt plus the generated tokens, and vs
  the reference on the same tokens;
- `batch-padding`: three prompts of different lengths in one batch vs each alone (the engine pads);
- `prefix-caching`: the same prompt generated twice (the second reads the prefix cache) and a prompt
  sharing its first blocks: equal to the uncached run and to the reference.
`relativity` (through the engine's position map) and `chunked-prefill` are in `scoring_positions.py`.
Rows that need full logits or explicit positions say `n/a` with the reason (`NEEDS`).
"""

from __future__ import annotations

from typing import Any

import torch

from .common import Budget, Row, Subject, fmt
from .consistency import logit_tol
from .rules import LOGPROB_TOL_FACTOR, TOP1_MIN, _compare, token_logprobs
from .scoring_positions import chunked_prefill, score_relativity

__all__ = ["SCORING_CHECKS", "NEEDS", "score_pairing", "score_decode", "score_batching", "prefix_caching"]

NEEDS = {
    "length-boundaries": "full logits (a scoring engine gives logprobs of the text tokens only; "
                         "rules-vs-reference checks every rule against the reference instead)",
    "short-context": "full logits (see rules-vs-reference for every rule against the reference)",
    "position-scan": "full logits and token-level control of the cache",
    "multimodal": "M-RoPE position ids (text-only serving API)",
}


def _tol(subject: Subject) -> float:
    return LOGPROB_TOL_FACTOR * logit_tol(subject.dtype)


def _max(a: torch.Tensor, b: torch.Tensor) -> float:
    d = (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs()
    return float(d.max()) if bool(torch.isfinite(d).all()) else float("inf")


@torch.no_grad()
def score_pairing(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    if subject.reference is None:
        return Row("pairing", None, skipped="no reference implementation available")
    n = max(64, budget.decode_prefill * 4)
    ids = subject.text(n, offset=5000)
    m = _compare(subject.engine(None), subject.reference(subject.model_path, None, subject.dtype), ids)
    if progress:
        progress()
    tol = _tol(subject)
    return Row("pairing", m["max_abs_logprob_diff"] <= tol and m["top1_agreement"] >= TOP1_MIN,
               {**m, "tokens": n}, {"max_abs_logprob_diff": f"<= {fmt(tol)}", "top1_agreement": f">= {TOP1_MIN}"},
               explanation=f"{n} tokens of text: per-token logprobs of the engine vs the reference on the same "
                           "weights, float32 noise only")


@torch.no_grad()
def score_decode(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    engine = subject.engine(None)
    p, n = budget.decode_prefill, max(8, budget.decode_steps)
    prompt = subject.text(p, offset=7000)[0].tolist()
    gen = engine.generate(prompt, n)
    full = torch.tensor([prompt + [int(t) for t in gen["tokens"]]])
    scored, _ = token_logprobs(engine, full)  # [p + n - 1]
    generated = torch.from_numpy(gen["logprobs"].astype("float64"))
    d_self = _max(generated, scored[p - 1:])
    measured: dict[str, Any] = {"max_abs_logprob_diff": d_self, "generated_tokens": n}
    if progress:
        progress()
    if subject.reference is not None:
        ref, _ = token_logprobs(subject.reference(subject.model_path, None, subject.dtype), full)
        measured["reference_max_abs_logprob_diff"] = _max(generated, ref[p - 1:])
    tol = _tol(subject)
    worst = max(v for k, v in measured.items() if k.endswith("diff"))
    return Row("prefill-decode", worst <= tol, measured,
               {"max_abs_logprob_diff": f"<= {fmt(tol)} (also against the reference)"},
               explanation=f"{n} greedy tokens after a {p}-token prompt: their decode logprobs vs one prefill of "
                           "prompt + generated tokens (and the reference on the same tokens)")


@torch.no_grad()
def score_batching(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    engine = subject.engine(None)
    n = budget.decode_prefill
    prompts = [subject.text(m, offset=300 * i)[0].tolist() for i, m in enumerate((n, n - 5, n - 11))]
    together = engine.score(prompts)
    alone = [engine.score([q])[0] for q in prompts]
    d = max(_max(torch.from_numpy(a["logprobs"][1:]), torch.from_numpy(b["logprobs"][1:]))
            for a, b in zip(together, alone))
    if progress:
        progress()
    tol = _tol(subject)
    return Row("batch-padding", d <= tol, {"max_abs_logprob_diff": d, "lengths": [len(q) for q in prompts]},
               {"max_abs_logprob_diff": f"<= {fmt(tol)}"},
               explanation="three prompts of different lengths scored in one batch vs each alone (the engine "
                           "pads or packs them its own way)")


@torch.no_grad()
def prefix_caching(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    engine = subject.engine(None)
    if "prefix_caching" not in getattr(engine, "capabilities", ()):
        return Row("prefix-caching", None, skipped="n/a: the engine has no prefix cache")
    steps = 8
    prompt = subject.text(160, offset=9000)[0].tolist()
    other = prompt[:128] + subject.text(32, offset=11000)[0].tolist()  # shares 4 blocks of 32
    first, again, shared = (engine.generate(q, steps) for q in (prompt, prompt, other))
    measured: dict[str, Any] = {"repeat_max_abs_logprob_diff": _max(torch.from_numpy(first["logprobs"]),
                                                                    torch.from_numpy(again["logprobs"])),
                                "cached_tokens_repeat": again["cached_tokens"],
                                "cached_tokens_shared": shared["cached_tokens"]}
    if progress:
        progress()
    if subject.reference is not None:
        ref = subject.reference(subject.model_path, None, subject.dtype)
        for key, q, g in (("repeat", prompt, again), ("shared", other, shared)):
            full = torch.tensor([q + [int(t) for t in g["tokens"]]])
            lp, _ = token_logprobs(ref, full)
            measured[f"{key}_reference_max_abs_logprob_diff"] = _max(torch.from_numpy(g["logprobs"]), lp[len(q) - 1:])
    tol = _tol(subject)
    worst = max(v for k, v in measured.items() if k.endswith("diff"))
    if not (measured["cached_tokens_repeat"] or measured["cached_tokens_shared"]):
        # equal logprobs prove nothing about a cache that was never read: n/a, with what was measured
        return Row("prefix-caching", None, measured, skipped="n/a: the engine reported no cached tokens, so its "
                   "prefix cache was not exercised (vLLM's server reports them only with "
                   "--enable-prompt-tokens-details)")
    return Row("prefix-caching", worst <= tol, measured, {"*_diff": f"<= {fmt(tol)}"},
               explanation="generated-token logprobs (prompt logprobs bypass vLLM's prefix cache) of a prompt "
                           "run twice and of one sharing its first 128 tokens, vs the first run and the reference")


SCORING_CHECKS = {"pairing": score_pairing, "prefill-decode": score_decode, "batch-padding": score_batching,
                  "prefix-caching": prefix_caching, "relativity": score_relativity, "chunked-prefill": chunked_prefill}
