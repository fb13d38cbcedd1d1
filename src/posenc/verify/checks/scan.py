"""`position-scan`: the same evidence at head, middle and tail: passkey retrieval and the copy probe.

Passkey (Mohtashami & Jaggi's prompt, plain format): a 5-digit key at 10/50/90 % depth of filler, asked
at the end; teacher-forced, one forward per trial, scored on the 5 digits (SmolLM2 writes digits as single
tokens; the leading-space token is a format choice, not retrieval). Copy probe: 64 random tokens at a depth
of real text, repeated at the end; top-1 accuracy on tokens 2..64 of the second copy, the first copy as
control. Lengths past the checkpoint's L0 run with YaRN x(length / L0).
"""

from __future__ import annotations

import math
import random
from typing import Any

import torch

from .common import Budget, Row, Subject

__all__ = ["position_scan", "PASSKEY_MIN", "COPY_MIN", "CONTROL_MAX"]

PASSKEY_MIN = 0.8  # SmolLM2-135M: digits right in 37/37 trials at 1k-8k; 0.8 leaves one miss in five
COPY_MIN = 0.5  # measured 0.79-0.89 at 1k-4k; a broken rotation collapses copying towards the 0.00 control
COPY_MIN_LONG = 0.15  # at 8k (the edge of the trained range) 0.21-0.71 measured: held to "still copies"
CONTROL_MAX = 0.1  # the first copy cannot be predicted: above this the probe is not measuring copying

INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
         "I will quiz you about the important information there.\n")
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
QUESTION = "What is the pass key? The pass key is"


@torch.no_grad()
def logits_at(engine: Any, ids: torch.Tensor, rows: list[int], chunk: int = 1024) -> torch.Tensor:
    """Logits `[len(rows), v]` at positions `rows` of `ids [1, t]`, prefilled through a cache in chunks."""
    t = ids.shape[1]
    cache = engine.new_cache(1, t)
    out = []
    for start in range(0, t, chunk):
        logits = engine.forward(ids[:, start:start + chunk], cache=cache)  # [1, c, v]
        out += [logits[0, r - start] for r in rows if start <= r < start + logits.shape[1]]
    return torch.stack(out)


def _rule_for(subject: Subject, length: int) -> dict | None:
    if length <= subject.l0:
        return None
    return {"rope_type": "yarn", "factor": float(math.ceil(length / subject.l0)),
            "original_max_position_embeddings": subject.l0}


def _passkey(subject: Subject, length: int, depth: float, rng: random.Random) -> tuple[bool, float]:
    tok = subject.tokenizer
    key = str(rng.randint(10000, 99999))
    needle = tok.encode(f"The pass key is {key}. Remember it. {key} is the pass key.\n")
    intro, question, answer = tok.encode(INTRO), tok.encode(QUESTION), tok.encode(" " + key)
    digits = answer[-5:]
    filler = tok.encode(FILLER)
    room = length - len(intro) - len(needle) - len(question) - len(answer)
    body = (filler * (room // len(filler) + 1))[:room]
    cut = int(len(body) * depth) // len(filler) * len(filler)  # the needle goes between filler lines
    ids = torch.tensor([intro + body[:cut] + needle + body[cut:] + question + answer])
    first = ids.shape[1] - 5  # the digits' positions
    logits = logits_at(subject.engine(_rule_for(subject, ids.shape[1])), ids, list(range(first - 1, first + 4)))
    hits = (logits.argmax(-1) == torch.tensor(digits)).double()
    return bool(hits.all()), float(hits.mean())


def _copy(subject: Subject, length: int, depth: float, gen: torch.Generator) -> tuple[float, float]:
    run = torch.randint(1000, 30000, (64,), generator=gen)
    text = subject.text(length - 128, offset=int(torch.randint(0, 100000, (1,), generator=gen)))[0]
    at = int((length - 128) * depth)
    ids = torch.cat((text[:at], run, text[at:], run))[None]  # [1, length]
    second = length - 64
    rows = list(range(at, at + 63)) + list(range(second, second + 63))  # predict tokens 2..64 of each copy
    logits = logits_at(subject.engine(_rule_for(subject, length)), ids, rows)
    pred = logits.argmax(-1)
    control = float((pred[:63] == run[1:]).double().mean())
    return float((pred[63:] == run[1:]).double().mean()), control


def position_scan(subject: Subject, budget: Budget, progress: Any = None) -> Row:
    if subject.tokenizer is None:
        return Row("position-scan", None, skipped="needs a tokenizer (a trained checkpoint): passkey and copy "
                   "measure retrieval, which random weights cannot do")
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    passkey: dict[str, dict[str, float]] = {}
    copy: dict[str, dict[str, float]] = {}
    controls = []
    for length in budget.passkey_lengths:
        for depth in budget.depths:
            trials = [_passkey(subject, length, depth, rng) for _ in range(budget.trials)]
            passkey.setdefault(str(length), {})[f"{depth:.0%}"] = sum(t[0] for t in trials) / len(trials)
            if progress:
                progress()
    failed = []
    for length in budget.copy_lengths:
        for depth in budget.depths:
            runs = [_copy(subject, length, depth, gen) for _ in range(budget.trials)]
            acc = sum(r[0] for r in runs) / len(runs)
            controls += [r[1] for r in runs]
            copy.setdefault(str(length), {})[f"{depth:.0%}"] = acc
            if acc < (COPY_MIN if length <= 4096 else COPY_MIN_LONG):
                failed.append(f"copy {length} @{depth:.0%}")
            if progress:
                progress()
    scores = [v for cells in passkey.values() for v in cells.values()]
    passkey_acc = sum(scores) / len(scores)
    if passkey_acc < PASSKEY_MIN:
        failed.append("passkey")
    control = max(controls)
    if control > CONTROL_MAX:
        failed.append("copy control")
    copy_all = [v for cells in copy.values() for v in cells.values()]
    return Row("position-scan", not failed,
               measured={"passkey_digit_accuracy": passkey_acc, "copy_min_accuracy": min(copy_all),
                         "copy_mean_accuracy": sum(copy_all) / len(copy_all), "copy_control_max": control,
                         "failed": failed},
               thresholds={"passkey_digit_accuracy": f">= {PASSKEY_MIN}",
                           "copy accuracy per depth": f">= {COPY_MIN} up to 4k, >= {COPY_MIN_LONG} beyond",
                           "copy_control_max": f"<= {CONTROL_MAX}"},
               explanation="passkey (5 digits, plain prompt) and a 64-token copy at 10/50/90 % depth: a position "
                           "error at head, middle or tail shows as a miss at that depth",
               details={"passkey": passkey, "copy": copy})
