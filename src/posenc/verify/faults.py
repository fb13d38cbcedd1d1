"""The self-test: each failure mode of the seed injected into posenc's own engine, as a wrapper.

Every fault wraps a clean engine (or its factory) from outside; nothing in the library changes. The
self-test runs the clean engine through every row, then each faulty engine through the row that must
catch it, and reports both: a row that passes a broken engine is a defect of the row.

    >>> sorted(FAULTS)[:3]
    ['bf16-angles', 'dynamic-padded-width', 'flat-mrope']
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from .checks.multimodal import flat_positions

__all__ = ["FAULTS", "Fault", "faulty_factory", "rewrite_rule"]


class Wrapped:
    """An engine that delegates to `inner`; subclasses change `forward`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def new_cache(self, batch_size: int, capacity: int) -> Any:
        return self.inner.new_cache(batch_size, capacity)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        return self.inner.forward(input_ids, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _filled(cache: Any) -> bool:
    return cache is not None and int(cache.lengths.max()) > 0


class OffByOneDecode(Wrapped):
    """Derived positions: the first decode step after a prefill lands one position too far."""

    def forward(self, input_ids, *, attention_mask=None, cache=None, position_ids=None):
        if position_ids is None and _filled(cache) and not getattr(cache, "_decoded", False):
            cache._decoded = True
            position_ids = cache.next_positions()[:, None] + 1 + torch.arange(input_ids.shape[1])
        return self.inner.forward(input_ids, attention_mask=attention_mask, cache=cache, position_ids=position_ids)


class PaddingDrift(Wrapped):
    """Derived decode positions count physical columns (padding included), as prefill did not."""

    def forward(self, input_ids, *, attention_mask=None, cache=None, position_ids=None):
        t = input_ids.shape[1]
        if cache is not None:
            seen = getattr(cache, "_columns", 0)
            if position_ids is None and _filled(cache):
                position_ids = (seen + torch.arange(t))[None].expand(input_ids.shape[0], t)
            cache._columns = seen + t
        return self.inner.forward(input_ids, attention_mask=attention_mask, cache=cache, position_ids=position_ids)


class ReusedRotatedKeys(Wrapped):
    """A prefix prefilled at explicit positions s.. is computed at 0.. and its rotated keys are relabelled s.."""

    def forward(self, input_ids, *, attention_mask=None, cache=None, position_ids=None):
        if cache is None or position_ids is None or _filled(cache):
            return self.inner.forward(input_ids, attention_mask=attention_mask, cache=cache, position_ids=position_ids)
        pos = position_ids.expand(input_ids.shape[0], -1)
        offset = pos[:, :1]  # [b, 1]
        out = self.inner.forward(input_ids, attention_mask=attention_mask, cache=cache, position_ids=pos - offset)
        cache.positions += torch.where(cache.positions >= 0, offset, 0)  # keys stay rotated at 0..
        return out


class PositionsIgnored(Wrapped):
    """Explicit position_ids dropped: the engine always derives its own (shifted copies run at 0..)."""

    def forward(self, input_ids, *, attention_mask=None, cache=None, position_ids=None):
        return self.inner.forward(input_ids, attention_mask=attention_mask, cache=cache)


class PositionsOffPast(Wrapped):
    """Explicit positions from `PAST` on land one position too far (a table or offset bug past a point)."""

    PAST = 2048

    def forward(self, input_ids, *, attention_mask=None, cache=None, position_ids=None):
        if position_ids is not None:
            position_ids = position_ids + (position_ids >= self.PAST).long()
        return self.inner.forward(input_ids, attention_mask=attention_mask, cache=cache, position_ids=position_ids)


class NaNLogits(Wrapped):
    """Every logit NaN: it compares False with every bound, so a row that tests `diff > tol` passes it."""

    def forward(self, input_ids, **kwargs):
        return torch.full_like(self.inner.forward(input_ids, **kwargs), float("nan"))


class NarrowVocab(Wrapped):
    """Only the first 10 columns of the vocabulary: narrow tensors compare equal with narrow tensors."""

    def forward(self, input_ids, **kwargs):
        return self.inner.forward(input_ids, **kwargs)[..., :10]


def _short_table(rope: Any, rows: int) -> Any:
    """The same Rope whose cos/sin table has `rows` = L0 * factor rows and is read past its end (vLLM
    0.32's YaRN on CPU): position p >= rows gets row p - rows, what an unchecked kernel would read."""
    base_cls = type(rope)

    class ShortTableRope(base_cls):  # type: ignore[misc, valid-type]
        def cos_sin(self, position_ids, **kwargs):
            return super().cos_sin(torch.where(position_ids >= rows, position_ids % rows, position_ids), **kwargs)

    return ShortTableRope(**{f.name: getattr(rope, f.name) for f in dataclasses.fields(rope)})


def _clamped_table(rope: Any, rows: int) -> Any:
    """The same Rope whose cos/sin table has `rows` rows and clamps: position p >= rows gets row rows - 1."""
    base_cls = type(rope)

    class ClampedRope(base_cls):  # type: ignore[misc, valid-type]
        def cos_sin(self, position_ids, **kwargs):
            return super().cos_sin(position_ids.clamp(max=rows - 1), **kwargs)

    return ClampedRope(**{f.name: getattr(rope, f.name) for f in dataclasses.fields(rope)})


def rewrite_rule(name: str, rule: dict | None) -> dict | None:
    """The rule a faulty engine actually runs instead of `rule` (None: unchanged)."""
    if rule is None:
        return None
    kind = rule.get("rope_type")
    if name == "short-context-damage" and kind == "dynamic":
        return {"rope_type": "linear", "factor": rule["factor"]}
    if name == "yarn-no-attention-factor" and kind == "yarn":
        return {**rule, "attention_factor": 1.0}
    if name == "theta-dropped" and "rope_theta" in rule:  # the dict's theta ignored: the config's is used
        return {k: v for k, v in rule.items() if k != "rope_theta"}
    if name == "linear-as-dynamic" and kind == "linear":
        return {**rule, "rope_type": "dynamic"}
    if name == "yarn-truncate-ignored" and kind == "yarn":
        return {k: v for k, v in rule.items() if k != "truncate"}
    if name == "longrope-allocated-context" and kind == "longrope":  # allocated 8192 > L0: always long
        return {**rule, "short_factor": list(rule["long_factor"])}
    return rule


def _low_precision(rope: Any) -> Any:
    """The same Rope, but positions, frequencies and angles in bfloat16 (the classic autocast bug)."""
    base_cls = type(rope)

    class BF16Rope(base_cls):  # type: ignore[misc, valid-type]
        def cos_sin(self, position_ids, *, seq_len=None, precision="float32", allow_negative=False,
                    compute_dtype=None):
            inv, factor = self.inv_freq(self.seq_len_for(position_ids, seq_len))
            angle = position_ids.to(torch.bfloat16)[..., None] * inv.to(torch.bfloat16)  # [..., r/2] in bf16
            return (angle.cos() * factor).float(), (angle.sin() * factor).float()

    return BF16Rope(**{f.name: getattr(rope, f.name) for f in dataclasses.fields(rope)})


def _length_read(rope: Any, state: dict[str, Any], shift: int = 0) -> Any:
    """The same Rope, but a length-dependent rule sees `state["seq_len"]` (set by `LengthFromBatch` before each
    forward) instead of the row's own length, or the row's length + `shift` (a switch one token early or late)."""
    base_cls = type(rope)

    class LengthRope(base_cls):  # type: ignore[misc, valid-type]
        def cos_sin(self, position_ids, *, seq_len=None, **kwargs):
            if state.get("seq_len") is not None:
                seq_len = state["seq_len"]
            elif shift:
                own = seq_len if seq_len is not None else int(position_ids.max()) + 1
                seq_len = max(1, own + shift)
            return super().cos_sin(position_ids, seq_len=seq_len, **kwargs)

    return LengthRope(**{f.name: getattr(rope, f.name) for f in dataclasses.fields(rope)})


class LengthFromBatch(Wrapped):
    """A full forward's length-dependent table from the batch, not the row: its padded width (`padded-width`)
    or its largest position + 1 (`batch-max`, transformers 5's `max(position_ids) + 1`)."""

    def __init__(self, inner: Any, state: dict[str, Any], how: str) -> None:
        super().__init__(inner)
        self.state, self.how = state, how

    def forward(self, input_ids, *, attention_mask=None, cache=None, position_ids=None):
        b, t = input_ids.shape
        mask = torch.ones(b, t, dtype=torch.long) if attention_mask is None else attention_mask.long()
        if cache is None and self.how == "padded-width":
            self.state["seq_len"] = t
        elif cache is None:
            pos = (mask.cumsum(1) - 1).clamp(min=0) if position_ids is None else position_ids.expand(b, t)
            self.state["seq_len"] = int(((pos + 1) * mask).max())
        try:
            return self.inner.forward(input_ids, attention_mask=attention_mask, cache=cache, position_ids=position_ids)
        finally:
            self.state["seq_len"] = None


LENGTH_FAULTS = {"dynamic-padded-width": ("dynamic", "padded-width"), "length-rule-batch-max": ("longrope", "batch-max")}
SWITCH_FAULTS = {"longrope-switch-early": 1, "longrope-switch-late": -1}


def _with_rope(model: Any, rope: Any) -> Any:
    model.rope = model.encoding = rope
    return model


def faulty_factory(name: str, factory: Callable[..., Any]) -> Callable[..., Any]:
    """`factory` with fault `name` injected (see FAULTS)."""
    def make(model_path: str, rope_scaling: dict | None, dtype: torch.dtype) -> Any:
        if name == "rule-ignored":
            return factory(model_path, None, dtype)
        engine = factory(model_path, rewrite_rule(name, rope_scaling), dtype)
        if name == "short-rope-table" and rope_scaling and rope_scaling.get("rope_type") == "yarn":
            rows = int(rope_scaling["original_max_position_embeddings"] * rope_scaling["factor"])
            return _with_rope(engine, _short_table(engine.rope, rows))
        if name == "swapped-pairing":
            other = "interleaved" if engine.rope.pairing == "split_half" else "split_half"
            return _with_rope(engine, dataclasses.replace(engine.rope, pairing=other))
        if name == "bf16-angles":
            return _with_rope(engine, _low_precision(engine.rope))
        if name == "table-clamped-4096":
            return _with_rope(engine, _clamped_table(engine.rope, 4096))
        kind = (rope_scaling or {}).get("rope_type")
        if name in LENGTH_FAULTS and kind == LENGTH_FAULTS[name][0]:
            state: dict[str, Any] = {}
            return LengthFromBatch(_with_rope(engine, _length_read(engine.rope, state)), state, LENGTH_FAULTS[name][1])
        if name in SWITCH_FAULTS and kind == "longrope":
            return _with_rope(engine, _length_read(engine.rope, {}, SWITCH_FAULTS[name]))
        if name == "flat-mrope":
            wrapped = Wrapped(engine)
            wrapped.mrope_position_ids = flat_positions
            return wrapped
        return {"off-by-one-decode": OffByOneDecode, "padding-drift": PaddingDrift,
                "reused-rotated-keys": ReusedRotatedKeys, "nan-logits": NaNLogits,
                "positions-ignored": PositionsIgnored, "positions-off-past-2048": PositionsOffPast,
                "narrow-vocab": NarrowVocab}.get(name, lambda e: e)(engine)
    make.__name__ = f"faulty_{name.replace('-', '_')}"
    return make


@dataclasses.dataclass(frozen=True)
class Fault:
    name: str
    row: str
    what: str


FAULTS = {f.name: f for f in (
    Fault("off-by-one-decode", "prefill-decode", "the first decode position after prefill is one too far"),
    Fault("padding-drift", "batch-padding", "decode positions count padding columns (physical indices)"),
    Fault("swapped-pairing", "pairing", "rotation pairs (i, i+d/2) swapped for adjacent (2i, 2i+1)"),
    Fault("reused-rotated-keys", "relativity", "keys rotated at 0.. reused as if rotated at s.."),
    Fault("bf16-angles", "relativity", "positions, frequencies and angles in bfloat16"),
    Fault("rule-ignored", "length-boundaries", "rope_scaling in the config but never applied"),
    Fault("short-context-damage", "short-context", "dynamic NTK implemented as linear (damages short context)"),
    Fault("flat-mrope", "multimodal", "M-RoPE coordinates flattened to 1-D token indices"),
    Fault("positions-ignored", "relativity", "explicit position_ids ignored (positions always derived)"),
    Fault("nan-logits", "relativity", "every logit NaN (passes any `diff > tol` test)"),
    Fault("narrow-vocab", "prefill-decode", "logits cut to 10 columns of the vocabulary"),
    Fault("yarn-no-attention-factor", "rules-vs-reference", "YaRN without its attention temperature 0.1 ln s + 1"),
    Fault("theta-dropped", "rules-vs-reference", "the theta inside a scaling dict ignored (the config's used)"),
    Fault("linear-as-dynamic", "rules-vs-reference", "linear position interpolation run as dynamic NTK"),
    Fault("yarn-truncate-ignored", "rules-vs-reference", "YaRN truncate=False ignored (range rounded anyway)"),
    Fault("longrope-allocated-context", "rules-vs-reference",
          "LongRoPE picks its factors from the allocated context, not the sequence length"),
    Fault("short-rope-table", "rules-vs-reference",
          "YaRN cos/sin table of L0 * factor rows read past its end (vLLM 0.32 CPU)"),
    Fault("dynamic-padded-width", "batch-padding",
          "dynamic NTK's length read from the batch's padded width, not the row's length"),
    Fault("length-rule-batch-max", "batch-padding",
          "LongRoPE's length read as the batch's largest position + 1 (rows below L0 get the long factors)"),
    Fault("longrope-switch-early", "rules-vs-reference", "LongRoPE's long factors from L0 tokens on (>= L0, not > L0)"),
    Fault("longrope-switch-late", "rules-vs-reference", "LongRoPE's long factors only past L0 + 1 tokens"),
    Fault("table-clamped-4096", "relativity", "a cos/sin table of 4096 rows: positions past it read the last row"),
    Fault("positions-off-past-2048", "relativity", "explicit positions from 2048 on one too far (a uniform shift "
                                                   "inside any window past 2048: only a probe spanning 2048 sees it)"),
)}
