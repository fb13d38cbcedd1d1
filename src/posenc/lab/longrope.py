"""A small evolutionary search for LongRoPE's per-frequency rescale factors (Ding et al. 2024, sec. 3).

Candidates are vectors lambda `[r/2]` (frequency i is divided by lambda_i), non-decreasing in i and in
`[1, 1.25 s]` as in the paper's search space. The first population holds the factors that PI, NTK-aware,
YaRN (beta_fast 32 and 8) and Llama-3 scaling imply at scale s; each generation mutates the best ones
(log-normal steps on a random half of the entries, then the running maximum to keep them non-decreasing)
and keeps the best `population`. Fitness is the perplexity at length s * L0 on windows of the TRAINING
split (never the validation windows the results are measured on).

    >>> import torch
    >>> lam = torch.tensor([3.0, 1.0, 2.0])
    >>> project(lam, 2.0).tolist()
    [2.5, 2.5, 2.5]
"""

from __future__ import annotations

import torch

from ..models import Decoder
from ..rope.scaling import Linear, Llama3, NTKAware, YaRN, default_inv_freq
from ..rope.spec import Rope
from .evaluate import ppl, token_nll
from .extension import Rule
from .schemes import with_rope

__all__ = ["project", "seed_factors", "search_factors", "search_budget"]


def project(factors: torch.Tensor, scale: float) -> torch.Tensor:
    """Clamp to `[1, 1.25 scale]` and make non-decreasing (running maximum)."""
    clamped = factors.clamp(1.0, 1.25 * scale)
    return torch.cummax(clamped, dim=0).values


def seed_factors(rope: Rope, scale: float, l0: int) -> list[torch.Tensor]:
    """lambda vectors implied by PI, NTK-aware, YaRN (beta_fast 32 and 8) and Llama-3 at this scale."""
    base_inv = default_inv_freq(rope.base, rope.rotary_dim).double()  # [r/2]
    rules = (Linear(scale), NTKAware(scale), YaRN(scale, l0), YaRN(scale, l0, beta_fast=8.0),
             Llama3(scale, 1.0, 4.0, l0))
    return [project(base_inv / rule.inv_freq(rope.base, rope.rotary_dim)[0].double(), scale) for rule in rules]


def search_factors(model: Decoder, rule: Rule, scale: int, l0: int, windows: torch.Tensor, *, population: int,
                   generations: int, seed: int, batch: int = 8, tick=None) -> dict:
    """Search LongRoPE long factors for length `scale * l0` on `windows` `[n, scale * l0 + 1]`.

    Args:
        model: the trained RoPE decoder. rule: the `longrope` rule (its attention knob is used).
        scale: target length / l0. windows: training-split windows. population, generations: search size.
        seed: mutation seed. batch: windows per forward. tick: optional progress callback, one call per candidate.
    Returns:
        `{"factors": [r/2 floats], "ppl": best search ppl, "history": best ppl after each generation,
        "evaluated": candidates scored}`.
    """
    generator = torch.Generator().manual_seed(seed)

    def fitness(factors: torch.Tensor) -> float:
        rope = Rope(head_dim=model.rope.head_dim, base=model.rope.base,
                    scaling=rule.scaling(scale, l0, tuple(float(v) for v in factors)))
        value = ppl(token_nll(with_rope(model, rope), windows, batch=batch))
        if tick is not None:
            tick()
        return value

    scored = [(fitness(f), f) for f in seed_factors(model.rope, float(scale), l0)]
    scored.sort(key=lambda item: item[0])
    history = [scored[0][0]]
    for _ in range(generations):
        parents = [f for _, f in scored[:max(2, population // 2)]]
        children = []
        for i in range(population):
            parent = parents[i % len(parents)]
            pick = torch.rand(parent.shape, generator=generator, dtype=torch.float64) < 0.5  # [r/2]
            step = torch.randn(parent.shape, generator=generator, dtype=torch.float64) * 0.15
            children.append(project(parent * torch.exp(step * pick), float(scale)))
        scored += [(fitness(c), c) for c in children]
        scored.sort(key=lambda item: item[0])
        scored = scored[:population]
        history.append(scored[0][0])
    best_ppl, best = scored[0]
    return dict(factors=[float(v) for v in best], ppl=best_ppl, history=history,
                evaluated=search_budget(population, generations))


def search_budget(population: int, generations: int) -> int:
    """Candidates one search scores (for progress bars)."""
    return 5 + generations * population
