"""The lab's settings: one frozen `LabConfig`, the `quick` and `full` presets, and the checkpoint key.

Only the fields that change a trained model enter its checkpoint key (`train_key`): the corpus, the
model sizes, the scheme and the optimisation; evaluation, extension and probe settings can change
without retraining.

    >>> cfg = LabConfig.preset("quick", steps=5)
    >>> cfg.steps, cfg.lengths[-1] * cfg.l0 == cfg.max_length
    (5, True)
    >>> len(train_key(cfg, "rope", "0" * 64))
    16
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ..errors import fail

__all__ = ["LabConfig", "SCHEMES", "DEFAULT_RULES", "PRESETS", "train_key"]

SCHEMES = ("nope", "sinusoidal", "learned", "rope", "alibi", "t5")
DEFAULT_RULES = ("none", "pi", "ntk", "dynamic_ntk", "yarn", "yarn:beta_fast=8", "llama3", "longrope")


@dataclass(frozen=True)
class LabConfig:
    """Everything one `posenc lab` run does (see `posenc lab --help` for each knob).

    Args:
        corpus: "stdlib" (the Python standard library's sources) or "pydoc" (pydoc_data's English topics).
        schemes: positional schemes to train, from `SCHEMES`.
        l0: the training length L0. lengths: evaluation lengths as multiples of L0.
        hidden_size, num_layers, num_heads, intermediate_size: decoder sizes (head_dim = hidden / heads).
        steps, batch_size, lr, warmup, min_lr_ratio, grad_clip, seed: training (AdamW, cosine schedule).
        eval_windows: validation windows scored at every length. eval_batch: windows per forward.
        rules: zero-shot RoPE extension rules ("name" or "name:key=value,..."), see `extension.parse_rule`.
        longrope_factors: given LongRoPE long factors (rotary_dim / 2 numbers) instead of a search.
        search_windows, search_population, search_generations: the LongRoPE factor search (train split).
        finetune_steps, finetune_methods, finetune_lr: short fine-tuning at 2 L0 (0 steps: skipped).
        probe_trials, probe_depths, probe_run, probe_cue: the copy-retrieval probe.
    """

    corpus: str = "stdlib"
    schemes: tuple[str, ...] = SCHEMES
    l0: int = 128
    lengths: tuple[int, ...] = (1, 2, 4, 8)
    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 352
    steps: int = 300
    batch_size: int = 32
    lr: float = 2e-3
    warmup: int = 30
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    eval_windows: int = 32
    eval_batch: int = 8
    rules: tuple[str, ...] = DEFAULT_RULES
    longrope_factors: tuple[float, ...] | None = None
    search_windows: int = 8
    search_population: int = 6
    search_generations: int = 2
    finetune_steps: int = 40
    finetune_methods: tuple[str, ...] = ("none", "pi", "yarn")
    finetune_lr: float = 5e-4
    probe_trials: int = 12
    probe_depths: tuple[float, ...] = (0.0, 0.5, 1.0)
    probe_run: int = 16
    probe_cue: int = 4

    def __post_init__(self) -> None:
        for name in ("l0", "hidden_size", "num_layers", "num_heads", "intermediate_size", "steps", "batch_size",
                     "eval_windows", "eval_batch", "search_windows", "search_population", "probe_run", "probe_cue"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                fail(name, "a positive integer", value)
        for name in ("warmup", "search_generations", "finetune_steps", "probe_trials", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                fail(name, "an integer >= 0", value)
        if self.corpus not in ("stdlib", "pydoc"):
            fail("corpus", "'stdlib' or 'pydoc'", self.corpus)
        unknown = [s for s in self.schemes if s not in SCHEMES]
        if unknown or not self.schemes:
            fail("schemes", f"one or more of {SCHEMES}", list(self.schemes))
        if not self.lengths or self.lengths[0] != 1 or list(self.lengths) != sorted(set(self.lengths)) \
                or any(isinstance(m, bool) or not isinstance(m, int) or m < 1 for m in self.lengths):
            fail("lengths", "increasing integer multiples of L0 starting with 1 (e.g. 1,2,4,8)", list(self.lengths))
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            fail("hidden_size", f"a multiple of num_heads={self.num_heads} with an even head_dim", self.hidden_size)
        if self.l0 % 2:
            fail("l0", "an even number of tokens (the in-window control strides by L0 / 2)", self.l0)
        if self.probe_cue >= self.probe_run or 2 * self.probe_run > self.l0:
            fail("probe_run", f"a run longer than the cue ({self.probe_cue}) and at most L0 / 2 = {self.l0 // 2}",
                 self.probe_run)
        if any(not 0.0 <= d <= 1.0 for d in self.probe_depths) or not self.probe_depths:
            fail("probe_depths", "fractions in [0, 1]", list(self.probe_depths))
        bad = [m for m in self.finetune_methods if m not in ("none", "pi", "yarn", "ntk")]
        if bad:
            fail("finetune_methods", "a subset of none, pi, yarn, ntk", list(self.finetune_methods))
        for name in ("lr", "finetune_lr", "grad_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                fail(name, "a number > 0", value)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            fail("min_lr_ratio", "a fraction in [0, 1]", self.min_lr_ratio)
        if self.longrope_factors is not None and len(self.longrope_factors) != self.head_dim // 2:
            fail("longrope_factors", f"head_dim / 2 = {self.head_dim // 2} numbers", list(self.longrope_factors))
        from .extension import parse_rule

        for spec in self.rules:  # fail before any training, not after it
            parse_rule(spec, self.longrope_factors)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def max_length(self) -> int:
        """The longest evaluation length in tokens (the learned table's size)."""
        return self.lengths[-1] * self.l0

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "LabConfig":
        """The `quick` or `full` configuration, with any field overridden."""
        if name not in PRESETS:
            fail("preset", f"one of {tuple(PRESETS)}", name)
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# quick: minutes on 2 cores, every output produced (numbers noisy); full: the configuration the
# predictions are checked on (docs/lab.md gives its measured numbers).
PRESETS: dict[str, dict[str, Any]] = {
    "full": {},
    "quick": dict(l0=64, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=176, steps=120,
                  batch_size=16, warmup=10, eval_windows=8, eval_batch=8, search_windows=2,
                  search_population=4, search_generations=1, finetune_steps=10, probe_trials=4,
                  probe_depths=(0.0, 0.5, 1.0), probe_run=12, probe_cue=4),
}


def train_key(cfg: LabConfig, scheme: str, data_sha256: str, **more: Any) -> str:
    """16 hex digits naming a trained model: sha256 of everything that changes its weights."""
    fields = ("corpus", "l0", "hidden_size", "num_layers", "num_heads", "intermediate_size", "steps",
              "batch_size", "lr", "warmup", "min_lr_ratio", "grad_clip", "seed")
    payload = {name: getattr(cfg, name) for name in fields}
    payload.update(scheme=scheme, data=data_sha256, table=cfg.max_length if scheme == "learned" else None, **more)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
