"""Training with resumable checkpoints: pre-training at L0 and the short fine-tuning at 2 L0.

A run writes `checkpoints/<name>-<key>.pt` (the state dict and the training record) into the results
folder; `key` is `config.train_key` (a hash of everything that changes the weights), so a rerun with the
same settings loads the model instead of training it, and a run interrupted midway resumes from
`<name>-<key>.partial.pt` (weights, optimiser, step, data generator), saved every `save_every` steps.
CPU training is deterministic for a fixed seed and thread count, so a resumed run equals an uninterrupted one.

    >>> lr_at(0, steps=100, lr=1.0, warmup=10, min_ratio=0.1), lr_at(99, steps=100, lr=1.0, warmup=10, min_ratio=0.1)
    (0.1, 0.1)
"""

from __future__ import annotations

import math
import pathlib
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models import Decoder
from .data import VOCAB, train_batch
from .progress import bar

__all__ = ["Schedule", "lr_at", "fit", "lm_loss"]


@dataclass(frozen=True)
class Schedule:
    """One training run: `steps` AdamW steps on `batch_size` windows of `length` tokens."""

    steps: int
    batch_size: int
    length: int
    lr: float
    warmup: int
    min_ratio: float
    grad_clip: float
    seed: int


def lr_at(step: int, *, steps: int, lr: float, warmup: int, min_ratio: float) -> float:
    """Linear warm-up over `warmup` steps, then cosine decay to `min_ratio * lr` at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    span = max(steps - 1 - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def lm_loss(model: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (nats) of `tokens [b, t + 1]`."""
    logits = model(tokens[:, :-1])  # [b, t, vocab]
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def fit(model: Decoder, stream: torch.Tensor, schedule: Schedule, checkpoint: pathlib.Path, *,
        label: str, save_every: int = 100) -> dict:
    """Train `model` in place, or load it from `checkpoint` if that run already finished.

    Args:
        model: the decoder (its current weights are the starting point).
        stream: uint8 training bytes `[n]`.
        schedule: the run's settings.
        checkpoint: final checkpoint path; `<stem>.partial.pt` beside it holds an unfinished run.
        label: progress-bar label. save_every: steps between partial saves.
    Returns:
        The training record: losses per step, final loss (mean of the last 10), seconds, whether loaded.
    """
    if checkpoint.exists():
        saved = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(saved["state"])
        return {**saved["record"], "loaded": True}
    partial = checkpoint.with_suffix(".partial.pt")
    optimizer = torch.optim.AdamW(model.parameters(), lr=schedule.lr, betas=(0.9, 0.95), weight_decay=0.0)
    generator = torch.Generator().manual_seed(schedule.seed)
    losses: list[float] = []
    start, spent = 0, 0.0
    if partial.exists():
        saved = torch.load(partial, weights_only=False)
        model.load_state_dict(saved["state"])
        optimizer.load_state_dict(saved["optimizer"])
        generator.set_state(saved["generator"])
        start, losses, spent = saved["step"], saved["losses"], saved["seconds"]
    model.train()
    t0 = time.perf_counter()
    with bar(label, schedule.steps) as tick:
        tick(start)
        for step in range(start, schedule.steps):
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, steps=schedule.steps, lr=schedule.lr, warmup=schedule.warmup,
                                    min_ratio=schedule.min_ratio)
            tokens = train_batch(stream, schedule.batch_size, schedule.length, generator)  # [b, length + 1]
            loss = lm_loss(model, tokens)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), schedule.grad_clip)
            optimizer.step()
            losses.append(float(loss.detach()))
            tick(info=f"loss {losses[-1]:.3f}")
            if (step + 1) % save_every == 0 and step + 1 < schedule.steps:
                _save(partial, dict(state=model.state_dict(), optimizer=optimizer.state_dict(),
                                    generator=generator.get_state(), step=step + 1, losses=losses,
                                    seconds=spent + time.perf_counter() - t0))
    model.eval()
    tail = losses[-10:]
    record = dict(steps=schedule.steps, final_loss=sum(tail) / len(tail), losses=losses,
                  seconds=spent + time.perf_counter() - t0, resumed_from=start)
    _save(checkpoint, dict(state=model.state_dict(), record=record))
    partial.unlink(missing_ok=True)
    return {**record, "loaded": False}


def _save(path: pathlib.Path, payload: dict) -> None:
    """Write atomically (a half-written checkpoint never replaces a good one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(payload, tmp)
    tmp.replace(path)
