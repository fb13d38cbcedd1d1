"""What an engine hands back, checked where it enters verify: logits `[b, t, vocab]`, floating, finite.

An engine that returns NaN, a cut vocabulary or integer logits must fail the row, not slip through its
comparisons (NaN compares False with every bound, and a narrow tensor compares with a narrow tensor).
Every logit a row reads goes through `check_logits`; a `PosencError` from it fails the row with its message.

    >>> ids = torch.zeros(1, 2, dtype=torch.long)
    >>> check_logits(torch.zeros(1, 2, 8), ids, 8).shape
    torch.Size([1, 2, 8])
    >>> try:
    ...     check_logits(torch.zeros(1, 2, 3), ids, 8)
    ... except PosencError as e:
    ...     print(e.arg, "|", e.expected, "|", e.got)  # doctest: +NORMALIZE_WHITESPACE
    logits | a floating-point tensor of shape [1, 2, 8] ([b, t, vocab] for input_ids [1, 2]) |
        tensor of shape (1, 2, 3) and dtype torch.float32
"""

from __future__ import annotations

from typing import Any

import torch

from ...errors import PosencError, Raw, fail  # noqa: F401 (PosencError: the doctest)

__all__ = ["check_logits", "CheckedEngine", "vocab_of"]


def check_logits(logits: Any, input_ids: torch.Tensor, vocab_size: int | None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Return `logits` after checking shape `[b, t, vocab_size]`, a floating dtype and finite values.

    Args:
        logits: what the engine's forward returned.
        input_ids: `[b, t]` ids it was given. vocab_size: the checkpoint's, or None to accept any width.
        attention_mask: `[b, t]` (or `[b, cached + t]`) 0/1; padded columns carry no meaning and are not
            held to finiteness (an engine may leave NaN where a query sees no key).
    Raises:
        PosencError: `logits: expected ..., got ...` naming the shape, dtype or count of non-finite values.
    """
    b, t = input_ids.shape
    width = "vocab" if vocab_size is None else str(vocab_size)
    expected = f"a floating-point tensor of shape [{b}, {t}, {width}] ([b, t, vocab] for input_ids [{b}, {t}])"
    if not isinstance(logits, torch.Tensor):
        fail("logits", expected, type(logits))
    if logits.is_meta:  # no values to compare
        fail("logits", expected + " with values", Raw("a meta tensor"))
    if not logits.dtype.is_floating_point or logits.ndim != 3 or tuple(logits.shape[:2]) != (b, t) \
            or (vocab_size is not None and logits.shape[2] != vocab_size):
        fail("logits", expected, logits)
    finite = torch.isfinite(logits)  # [b, t, v]
    if attention_mask is not None:
        real = attention_mask[:, -t:].to(device=logits.device, dtype=torch.bool)  # [b, t]
        finite = finite | ~real[..., None]
    bad = int((~finite).sum())
    if bad:
        nan = int(torch.isnan(logits).sum())
        fail("logits", "finite values at every real (unpadded) token",
             Raw(f"{bad} non-finite of {logits.numel()} ({nan} NaN, {bad - nan} infinite)"))
    return logits


class CheckedEngine:
    """An engine whose every `forward` result passes `check_logits`; everything else is the engine's own."""

    def __init__(self, engine: Any, vocab_size: int | None) -> None:
        self.engine, self.vocab_size = engine, vocab_size

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        out = self.engine.forward(input_ids, **kwargs)
        return check_logits(out, input_ids, self.vocab_size, kwargs.get("attention_mask"))

    def new_cache(self, batch_size: int, capacity: int) -> Any:
        return self.engine.new_cache(batch_size, capacity)

    def __getattr__(self, name: str) -> Any:  # mrope_position_ids and other extras the rows look for
        if name == "engine":  # not set yet (copy, pickle): no recursion
            raise AttributeError(name)
        return getattr(self.engine, name)


def vocab_of(config: dict[str, Any]) -> int | None:
    """The checkpoint's vocabulary size, or None when the config does not say (any width accepted)."""
    v = config.get("vocab_size")
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        return None
    return v

