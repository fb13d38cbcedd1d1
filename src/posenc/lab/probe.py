"""Retrieval probe (a position scan): copy a random run of letters seen earlier in the context.

Each trial is a validation text window of L + 1 bytes in which a run of `run` random lowercase letters
is written at depth `depth` (its start at `round(depth * (L + 1 - 2 run))`: 0 = the start of the context,
1 = just before the query) and written again at the very end (the query). The model sees the first `cue`
letters of the query for free; accuracy is the fraction of the remaining `run - cue` letters whose
argmax prediction (teacher-forced) is right. Random letters cannot be guessed from the text (chance is
about 1/26), so accuracy above chance means the model found the earlier copy `distance` tokens back.

    >>> import torch
    >>> inputs, targets, scored, distance = probe_batch(torch.zeros(200, dtype=torch.uint8), 32, 0.0, run=8,
    ...                                               cue=2, trials=2, generator=torch.Generator().manual_seed(0))
    >>> inputs.shape, int(scored.sum()), distance
    (torch.Size([2, 32]), 12, 25)
"""

from __future__ import annotations

import torch

from ..errors import fail
from ..models import Decoder
from .evaluate import forward

__all__ = ["probe_batch", "probe_accuracy"]


def probe_batch(stream: torch.Tensor, length: int, depth: float, *, run: int, cue: int, trials: int,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Build `trials` probe sequences of `length` inputs.

    Returns:
        `(inputs [n, L], targets [n, L], scored [n, L] bool, distance)`: `scored` marks the query letters
        after the cue; `distance` is how many positions back the earlier copy of a scored letter lies.
    Raises:
        PosencError: a depth outside [0, 1], or a run that does not fit twice in the window.
    """
    if not 0.0 <= depth <= 1.0:
        fail("depth", "a fraction in [0, 1]", depth)
    if not 0 < cue < run or 2 * run > length + 1:
        fail("run", f"cue < run and two runs within {length + 1} tokens", (run, cue))
    starts = torch.randint(0, stream.numel() - length - 1, (trials,), generator=generator)  # [n]
    seq = stream[starts[:, None] + torch.arange(length + 1)].long()  # [n, L + 1]
    letters = torch.randint(ord("a"), ord("z") + 1, (trials, run), generator=generator)  # [n, run]
    needle = round(depth * (length + 1 - 2 * run))
    query = length + 1 - run
    seq[:, needle:needle + run] = letters
    seq[:, query:] = letters
    scored = torch.zeros(trials, length, dtype=torch.bool)
    scored[:, query + cue - 1:] = True  # input position p predicts seq[p + 1]
    return seq[:, :-1], seq[:, 1:], scored, query - needle


@torch.no_grad()
def probe_accuracy(model: Decoder, stream: torch.Tensor, length: int, depths: tuple[float, ...], *, run: int,
                   cue: int, trials: int, seed: int, batch: int = 8, block: int | None = None) -> list[dict]:
    """Accuracy per depth at one length: `[{"depth", "distance", "accuracy", "exact", "trials"}]`.

    `exact` is the fraction of trials with every scored letter right. The trials of a depth use the same
    seed for every model, so models are compared on the same texts and letters.
    """
    rows = []
    for depth in depths:
        generator = torch.Generator().manual_seed(seed + round(1000 * depth))
        inputs, targets, scored, distance = probe_batch(stream, length, depth, run=run, cue=cue, trials=trials,
                                                        generator=generator)
        hits = []
        for part in range(0, trials, batch):
            logits = forward(model, inputs[part:part + batch], block)  # [b, L, vocab]
            hits.append(logits.argmax(-1) == targets[part:part + batch])  # [b, L]
        correct = torch.cat(hits) & scored  # [n, L]
        per_trial = correct.sum(1).double() / scored.sum(1)  # [n]
        rows.append(dict(depth=depth, distance=distance, accuracy=float(per_trial.mean()),
                         exact=float((per_trial == 1).double().mean()), trials=trials))
    return rows
