"""What every check shares: the row it returns, the subject it runs on, the budgets, the rules.

A check is `check(subject, budget, progress) -> Row`. It measures numbers, compares each against a
threshold whose reason is written in `Row.explanation`, and never asserts what it did not measure.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .output import CheckedEngine, vocab_of

__all__ = ["Row", "Subject", "Budget", "BUDGETS", "boundary_rules", "short_rules", "max_diff", "worst",
           "within", "spread", "top1_agree", "token_nll"]


@dataclass
class Row:
    """One line of the validation table.

    Attributes:
        name: the row name (`relativity`, `prefill-decode`, ...).
        passed: True, False, or None when skipped.
        measured: the numbers, by name. thresholds: the bound each number is held to, by the same name.
        explanation: one line saying what was compared and why the threshold is what it is.
        details: series for plots and the JSON (per-position losses, per-depth accuracies, ...).
        skipped: the reason when the row could not run.
    """

    name: str
    passed: bool | None
    measured: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, str] = field(default_factory=dict)
    explanation: str = ""
    details: dict[str, Any] = field(default_factory=dict)
    skipped: str | None = None
    seconds: float = 0.0

    @property
    def status(self) -> str:
        return "skipped" if self.passed is None else ("pass" if self.passed else "FAIL")

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "passed": self.passed, "status": self.status, "measured": self.measured,
                "thresholds": self.thresholds, "explanation": self.explanation, "skipped": self.skipped,
                "seconds": round(self.seconds, 2), "details": self.details}


@dataclass(frozen=True)
class Budget:
    """Lengths (tokens) each check uses; `quick` < 3 min, `default` < 10 min, `full` to 16k on 2 cores."""

    name: str
    relativity_len: int = 48
    shifts: tuple[int, ...] = (3, 61, 1000)
    decode_prefill: int = 40
    decode_steps: int = 6
    boundary_l0: int = 256  # reduced original length for the length rules (L1 = 2 L0)
    short_len: int = 512
    passkey_lengths: tuple[int, ...] = (1024,)
    copy_lengths: tuple[int, ...] = (1024,)
    depths: tuple[float, ...] = (0.1, 0.5, 0.9)
    trials: int = 1


# relativity's far probe: its tokens (24 to 48) at 4090.. cross position 4096, the end of a common cos/sin table size
FAR_SHIFT = 4090

BUDGETS = {
    "quick": Budget("quick", shifts=(3, 61, 1000, FAR_SHIFT)),
    "default": Budget("default", boundary_l0=512, short_len=1024, passkey_lengths=(1024, 4096),
                      copy_lengths=(1024, 2048), shifts=(3, 61, 1000, FAR_SHIFT)),
    "full": Budget("full", boundary_l0=8192, short_len=2048, passkey_lengths=(1024, 4096, 8192, 16384),
                   copy_lengths=(1024, 4096, 8192), trials=2, shifts=(3, 61, 1000, FAR_SHIFT, 12000)),
}


class Subject:
    """The engine under test, its checkpoint and text; builds one engine per rope override.

    Args:
        factory: `FACTORY(model_path, rope_scaling, dtype)` (see `posenc.verify.engines`).
        model_path: the checkpoint path given to the factory.
        config: the checkpoint's config dict (vocab_size, max_position_embeddings, rope_theta, head_dim ...).
        text_ids: `[n]` int64 token ids of real text (or seeded random ids for a random-weight model).
        tokenizer: an object with `encode(str) -> list[int]` and `decode(list[int]) -> str`, or None.
        reference: the pairing reference factory (transformers on the same weights), or None.
        dtype: the dtype handed to the factories.
        mrope_builder: the M-RoPE position builder under test (default `posenc.mrope_position_ids`).
        trained: whether the weights are trained (default: a tokenizer was given); the bounds that describe
            a trained model (short-context magnitudes) are held only then.
    """

    def __init__(self, factory: Callable[..., Any], model_path: str, config: dict[str, Any], text_ids: torch.Tensor,
                 *, tokenizer: Any = None, reference: Callable[..., Any] | None = None,
                 dtype: torch.dtype = torch.float32, mrope_builder: Callable[..., Any] | None = None,
                 name: str = "engine", trained: bool | None = None) -> None:
        self.factory, self.model_path, self.config = factory, model_path, config
        self.text_ids, self.tokenizer, self.reference, self.dtype = text_ids, tokenizer, reference, dtype
        self.mrope_builder, self.name = mrope_builder, name
        self.kv_dtype: str | None = None  # set by build_subject for `verify --kv-dtype` (e.g. "int4:pre")
        self.trained = tokenizer is not None if trained is None else trained  # random weights: no physics bounds
        self._engines: dict[str, Any] = {}  # the two most recent (the plain one and a rule, typically)
        self.load_seconds = 0.0

    @property
    def l0(self) -> int:
        return int(self.config["max_position_embeddings"])

    @property
    def theta(self) -> float:
        params = self.config.get("rope_parameters") or {}
        return float(self.config.get("rope_theta", params.get("rope_theta", 10000.0)))

    @property
    def head_dim(self) -> int:
        return int(self.config.get("head_dim") or self.config["hidden_size"] // self.config["num_attention_heads"])

    def engine(self, rope_scaling: dict | None = None) -> Any:
        """The engine for `rope_scaling` (None: the checkpoint's rule); the two most recent are kept."""
        key = json.dumps(rope_scaling, sort_keys=True)
        if key not in self._engines:
            if len(self._engines) >= 2:
                old = self._engines.pop(next(iter(self._engines)))
                getattr(old, "close", lambda: None)()  # an engine process is stopped, not left to the GC
            start = time.perf_counter()
            self._engines[key] = self.checked(self.factory(self.model_path, rope_scaling, self.dtype))
            self.load_seconds += time.perf_counter() - start
        else:
            self._engines[key] = self._engines.pop(key)  # most recent last
        return self._engines[key]

    def checked(self, engine: Any) -> CheckedEngine:
        """`engine` with every logit it returns checked (`[b, t, vocab]`, floating, finite; see `check_logits`)."""
        return CheckedEngine(engine, vocab_of(self.config))

    @property
    def protocol(self) -> str:
        """`logits` (forward / new_cache) or `scoring` (score / generate), from the factory."""
        return getattr(self.factory, "protocol", "logits")

    def split_rules(self, rules: dict[str, dict | None]) -> tuple[dict[str, dict | None], dict[str, str]]:
        """`(rules the engine implements, {name: reason} for those it does not)`, from the factory's
        optional `rule_support(rule) -> None | reason`; engines without it claim every rule."""
        support = getattr(self.factory, "rule_support", None)
        reasons = {k: support(r) for k, r in rules.items()} if callable(support) else {}
        return ({k: r for k, r in rules.items() if not reasons.get(k)},
                {k: f"n/a: not implemented ({v})" for k, v in reasons.items() if v})

    def text(self, n: int, offset: int = 0) -> torch.Tensor:
        """`[1, n]` token ids of the text starting at `offset` (wrapping around)."""
        ids = self.text_ids
        idx = (torch.arange(n) + offset) % ids.numel()
        return ids[idx][None]


def boundary_rules(l0: int, theta: float, head_dim: int, factor: float = 2.0) -> dict[str, dict]:
    """The length rules at original length `l0` with L1 = factor * l0 (transformers' rope dicts).

    Static NTK-aware scaling has no rope_type of its own: it is the default rule with a larger theta,
    `theta * factor**(d / (d - 2))`, written out so every engine can run it.
    """
    ntk_theta = theta * factor ** (head_dim / (head_dim - 2))
    return {
        "linear": {"rope_type": "linear", "factor": factor},
        "ntk": {"rope_type": "default", "rope_theta": ntk_theta},
        "dynamic": {"rope_type": "dynamic", "factor": factor, "max_position_embeddings": l0},
        "yarn": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": l0},
        "llama3": {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": l0},
    }


def short_rules(l0: int, theta: float, head_dim: int) -> dict[str, dict]:
    """The same rules at the checkpoint's own L0 with factor 4 (the short-context regression setting)."""
    return boundary_rules(l0, theta, head_dim, factor=4.0)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| (float32 logits subtract exactly enough: the result is rounded once); NaN if any is NaN."""
    return float((a - b).abs().max())  # torch's max propagates NaN


def worst(values: Any) -> float:
    """The largest of `values`, NaN when any is NaN (Python's `max` drops a NaN that is not first); 0.0 if empty."""
    values = [float(v) for v in values]
    if any(math.isnan(v) for v in values):
        return math.nan
    return max(values, default=0.0)


def spread(logits: torch.Tensor) -> float:
    """max |logits[:, j] - logits[:, 0]| over positions j of `[b, t, v]`: how much the logits depend on the
    tokens. An engine returning the same logits for every input compares equal with itself in every
    consistency row; its spread is 0."""
    return max_diff(logits, logits[:, :1])


def within(value: float, bound: float) -> bool:
    """`value <= bound` for a finite value only: NaN and infinity never pass."""
    return math.isfinite(value) and value <= bound


def top1_agree(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of positions whose argmax agrees."""
    return float((a.argmax(-1) == b.argmax(-1)).double().mean())


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`[t - 1]` float64 NLL of each next token: logits `[1, t, v]` against ids `[1, t]` (1024 rows at a time)."""
    out = []
    for i in range(0, logits.shape[1] - 1, 1024):
        logp = torch.log_softmax(logits[0, i:min(i + 1024, logits.shape[1] - 1)].double(), dim=-1)  # [c, v]
        out.append(-logp.gather(1, ids[0, i + 1:i + 1 + logp.shape[0], None]).squeeze(1))
    return torch.cat(out)


def fmt(x: float) -> str:
    """Short number for tables."""
    if x == 0 or not math.isfinite(x):
        return str(x)
    return f"{x:.3g}" if abs(x) >= 1e-3 else f"{x:.2e}"
