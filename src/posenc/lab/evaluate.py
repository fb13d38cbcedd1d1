"""Perplexity by position, and the in-window control that separates extrapolation damage from text difficulty.

For windows `[n, L + 1]` of validation bytes, `token_nll` gives the NLL (nats) of every next-byte
prediction, position by position, `[n, L]`. `summarize` turns it into, per evaluation length L:

- `ppl_all`: over positions [0, L) (non-overlapping evaluation, Press et al.'s protocol);
- `ppl_in` / `ppl_out`: over positions < L0 / >= L0;
- `bands`: one perplexity per L0-wide band of positions;
- the control `ref_*`: the same tokens scored with at most L0 tokens of context (`control_nll`: windows of
  L0 tokens at stride L0/2, each token scored in the window where it has between L0/2 and L0 of context,
  at in-range positions), and `ratio_out = ppl_out / ref_out`, the damage of going past L0.

    >>> import torch
    >>> nll = torch.full((2, 8), 1.0, dtype=torch.float64)
    >>> row = summarize(nll, nll, l0=4, multiples=(1, 2))[2]
    >>> round(row["ppl_out"], 4), row["ratio_out"], [round(b, 4) for b in row["bands"]]
    (2.7183, 1.0, [2.7183, 2.7183])
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import fail
from ..models import Decoder
from .data import VOCAB

__all__ = ["forward", "token_nll", "control_nll", "summarize", "ppl"]


def ppl(nll: torch.Tensor) -> float:
    """`exp(mean NLL)` of a tensor of per-token NLLs (nats)."""
    return math.exp(float(nll.double().mean()))


@torch.no_grad()
def forward(model: Decoder, inputs: torch.Tensor, block: int | None = None) -> torch.Tensor:
    """Logits `[b, L, vocab]` of `inputs [b, L]` at positions 0 .. L - 1: one forward, or `block` tokens at a
    time through the model's KV cache (see `token_nll`)."""
    model.eval()
    if block is None:
        return model(inputs)  # [b, L, vocab]
    cache = model.new_cache(inputs.shape[0], inputs.shape[1])
    return torch.cat([model(part, cache=cache) for part in inputs.split(block, dim=1)], dim=1)  # [b, L, vocab]


@torch.no_grad()
def token_nll(model: Decoder, windows: torch.Tensor, *, batch: int = 8, block: int | None = None) -> torch.Tensor:
    """Per-position NLL `[n, L]` (float64) of windows `[n, L + 1]`, inputs at positions 0 .. L - 1.

    Args:
        model: the decoder (evaluated in eval mode, no gradient).
        windows: int64 token windows `[n, L + 1]`.
        batch: windows per forward.
        block: None for one forward over the window; an integer to feed the window through the model's
            KV cache `block` tokens at a time (what cached decoding sees: a length-dependent scaling such as
            dynamic NTK scores each block with the table of the length reached at its end; the cache's
            default policy "recompute" makes each block equal a full forward at that length).
    """
    if windows.ndim != 2 or windows.shape[1] < 2:
        fail("windows", "token windows of shape [n, L + 1] with L >= 1", windows)
    out = []
    for chunk in windows.split(batch):
        inputs, targets = chunk[:, :-1], chunk[:, 1:]  # [b, L]
        logits = forward(model, inputs, block)  # [b, L, vocab]
        nll = F.cross_entropy(logits.reshape(-1, VOCAB).float(), targets.reshape(-1), reduction="none")
        out.append(nll.view(targets.shape).double())  # [b, L]
    return torch.cat(out)


@torch.no_grad()
def control_nll(model: Decoder, windows: torch.Tensor, l0: int, *, batch: int = 8) -> torch.Tensor:
    """NLL `[n, L]` of the same tokens as `token_nll`, each predicted from at most `l0` tokens of context.

    Windows of `l0` inputs start at multiples of `l0 / 2` and use positions 0 .. l0 - 1; the first window
    scores its `l0` tokens (as the full-context evaluation does), every later one its second half.
    """
    n, length = windows.shape[0], windows.shape[1] - 1
    if l0 % 2 or l0 < 2 or length < l0:
        fail("l0", f"an even number of tokens >= 2 and <= the window's {length}", l0)
    stride = l0 // 2
    starts = list(range(0, max(length - l0, 0) + 1, stride))
    if starts[-1] + l0 < length:  # the tail: one more window ending exactly at the last token
        starts.append(length - l0)
    pieces = torch.stack([windows[:, s:s + l0 + 1] for s in starts], dim=1)  # [n, k, l0 + 1]
    nll = token_nll(model, pieces.reshape(-1, pieces.shape[-1]), batch=batch).view(n, len(starts), -1)
    out = torch.empty(n, length, dtype=torch.float64)
    out[:, :min(l0, length)] = nll[:, 0, :min(l0, length)]
    covered = l0
    for k, s in enumerate(starts[1:], start=1):  # each later window scores the positions after the last one
        first = covered - s
        out[:, covered:s + l0] = nll[:, k, first:]
        covered = s + l0
    return out


def summarize(nll: torch.Tensor, ref: torch.Tensor, l0: int, multiples: tuple[int, ...]) -> dict[int, dict]:
    """Per evaluation length (a multiple of `l0`), the perplexities described in the module docstring.

    Args:
        nll: `[n, L]` per-position NLL at the evaluated length(s); columns beyond a length are ignored for it.
        ref: `[n, L']` control NLL of the same tokens (L' >= the longest length).
        l0: the training length. multiples: lengths as multiples of l0.
    Returns:
        `{multiple: {"length", "ppl_all", "ppl_in", "ppl_out", "ref_all", "ref_out", "ratio_out", "ratio_all",
        "bands", "ref_bands", "band_ratios"}}` (the `_out` entries are None at 1x).
    """
    rows = {}
    for m in multiples:
        length = m * l0
        if nll.shape[1] < length or ref.shape[1] < length:
            fail("nll", f"at least {length} positions", nll)
        cut, rcut = nll[:, :length], ref[:, :length]
        bands = [ppl(cut[:, b * l0:(b + 1) * l0]) for b in range(m)]
        ref_bands = [ppl(rcut[:, b * l0:(b + 1) * l0]) for b in range(m)]
        row = dict(length=length, ppl_all=ppl(cut), ppl_in=ppl(cut[:, :l0]), ref_all=ppl(rcut),
                   ppl_out=None, ref_out=None, ratio_out=None, bands=bands, ref_bands=ref_bands,
                   band_ratios=[a / b for a, b in zip(bands, ref_bands)])
        row["ratio_all"] = row["ppl_all"] / row["ref_all"]
        if m > 1:
            row.update(ppl_out=ppl(cut[:, l0:]), ref_out=ppl(rcut[:, l0:]))
            row["ratio_out"] = row["ppl_out"] / row["ref_out"]
        rows[m] = row
    return rows
