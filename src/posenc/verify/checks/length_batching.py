"""batch-padding under the length-dependent rules (dynamic NTK, LongRoPE): one batch, each row vs itself alone.

Under a rule whose table depends on the sequence length, a row's logits must depend on that row's own
length only, never on the batch it shares. One batch holds two rows of lengths L0 - 8 and L0 + 24 (L0
the reduced original length, at most `MAX_L0` = 128: the rule's arithmetic is the same at any L0, and the
batches stay cheap), padded to L0 + 40, wider than its longest row; each row's real tokens must give the
logits of that row alone, left- and right-padded, positions derived and explicit.
Two faults the field ships fail it:
- the length read from the padded width (physical columns): every row gets the table of L0 + 40, so the
  row below L0 moves (on the tests' tiny model: 5.7 logits under dynamic x2; LongRoPE switches to its long
  factors);
- the length read as the batch's largest position (`max(position_ids) + 1` over the batch, as transformers
  5 computes it): the row below L0 gets the table of the longest row (7.2 logits under LongRoPE).
The bound is the float noise of a sequence reaching position n, `shift_tol` (1e-4 + 64 n 2^-24).
"""

from __future__ import annotations

from typing import Any

import torch

from .common import Budget, Subject, max_diff, worst
from .consistency import shift_tol
from .rules import all_rules

__all__ = ["LENGTH_RULES", "MAX_L0", "length_rule_batches", "batch_lengths", "batch_l0"]

LENGTH_RULES = ("dynamic", "longrope")  # the rules whose table depends on the sequence length
MAX_L0 = 128


def batch_l0(subject: Subject, budget: Budget) -> int:
    """The reduced original length of these batches."""
    return min(budget.boundary_l0, subject.l0, MAX_L0)


def batch_lengths(l0: int) -> tuple[list[int], int]:
    """`(row lengths on both sides of l0, padded width beyond the longest row)`."""
    return [l0 - 8, l0 + 24], l0 + 40


@torch.no_grad()
def length_rule_batches(subject: Subject, budget: Budget, progress: Any = None
                        ) -> tuple[dict[str, Any], dict[str, str], float]:
    """Per claimed length rule: `{rule: {"left_derived": diff, ..., "per_row": [...]}}`, the rules the engine
    lacks `{rule: reason}`, and the bound the diffs are held to."""
    l0 = batch_l0(subject, budget)
    lengths, width = batch_lengths(l0)
    rules = {k: v for k, v in all_rules(l0, subject.theta, subject.head_dim).items() if k in LENGTH_RULES}
    kept, not_implemented = subject.split_rules(rules)
    tol = shift_tol(subject.dtype, width)
    per_rule: dict[str, Any] = {}
    for name, rule in kept.items():
        engine = subject.engine(rule)
        rows = [subject.text(m, offset=5000 + 700 * i) for i, m in enumerate(lengths)]  # each [1, m]
        solo = [engine.forward(r) for r in rows]  # [1, m, v]
        entry: dict[str, Any] = {}
        per_row = [0.0] * len(lengths)
        for side in ("left", "right"):
            for explicit in (False, True):
                ids = torch.zeros(len(rows), width, dtype=torch.long)
                mask = torch.zeros(len(rows), width, dtype=torch.long)
                for i, (r, m) in enumerate(zip(rows, lengths)):
                    cols = slice(width - m, width) if side == "left" else slice(0, m)
                    ids[i, cols], mask[i, cols] = r[0], 1
                pos = (mask.cumsum(1) - 1).clamp(min=0) if explicit else None  # [b, width] logical positions
                out = engine.forward(ids, attention_mask=mask, position_ids=pos)  # [b, width, v]
                diffs = [max_diff(out[i][mask[i].bool()], solo[i][0]) for i in range(len(rows))]
                per_row = [worst([a, b]) for a, b in zip(per_row, diffs)]
                entry[f"{side}_{'explicit' if explicit else 'derived'}"] = worst(diffs)
        entry["per_row"] = dict(zip(map(str, lengths), per_row))
        per_rule[name] = entry
        if progress:
            progress()
    return per_rule, not_implemented, tol
