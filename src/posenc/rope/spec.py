"""`Rope`: a frozen description of one rotary embedding, and the calls that use it.

This file holds the fields, `from_hf_config` and the rotation calls (`rotate`, `apply`, `apply_`); `Rope`
inherits its frequencies and cos/sin tables (`inv_freq`, `cos_sin`, `table`) from `RopeTables`
(rope/spec_tables.py) and its checks (construction, call inputs) from `RopeChecks` (rope/spec_checks.py).

    >>> import torch, posenc
    >>> rope = posenc.Rope(head_dim=8, base=10000.0)
    >>> q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)     # GQA: 4 query heads, 2 key heads
    >>> q2, k2 = rope.apply(q, k, torch.arange(5))
    >>> q2.shape, k2.shape
    (torch.Size([1, 4, 5, 8]), torch.Size([1, 2, 5, 8]))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import Raw, fail
from . import route
from .aliasing import written_twice
from .apply import LAYOUTS
from .scaling import Default, Scaling
from .spec_checks import RopeChecks
from .spec_tables import RopeTables
from .table import RopeTable

__all__ = ["Rope"]

_compiling = torch.compiler.is_compiling  # bound once: the decode hot path calls it


@dataclass(frozen=True)
class Rope(RopeChecks, RopeTables):
    """One rotary position embedding.

    Args:
        head_dim: channels per q/k head that this embedding sees (for DeepSeek MLA, the rope slice).
        rotary_dim: leading channels that rotate (default: all); the rest pass through unchanged.
        base: theta, the base of the frequency ladder.
        scaling: a scaling rule from `posenc.rope.scaling` (default: none).
        pairing: "split_half", "interleaved" or "interleaved_to_split_half" (see `apply_rope`).
        mrope_section: frequencies per position axis for multi-axis RoPE (sums to rotary_dim / 2).
        mrope_interleaved: Qwen3-VL's interleaved axis assignment instead of contiguous sections.
        softmax_scale_factor: extra multiplier on the attention softmax scale that the model applies
            (DeepSeek YaRN: `mscale(factor, mscale_all_dim)**2`); 1 for every other model.
        direction: 1 (position p turns pair i by `+p * inv_freq[i]`, every model but one) or -1 (by
            `-p * inv_freq[i]`: nanochat, whose rotate_half is `cat(x2, -x1)`). It is the sign of the angles
            in every table (`cos_sin`, `table`); `inv_freq` stays the positive ladder.
    Raises:
        PosencError: odd or out-of-range widths, a non-positive or non-finite base, unknown pairings,
            sections that do not sum to rotary_dim / 2.
    """

    head_dim: int
    rotary_dim: int | None = None
    base: float = 10000.0
    scaling: Scaling = field(default_factory=Default)
    pairing: str = "split_half"
    mrope_section: tuple[int, ...] | None = None
    mrope_interleaved: bool = False
    softmax_scale_factor: float = 1.0
    direction: int = 1

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_hf_config(cls, config: Any, *, layer_type: str | None = None) -> "Rope":
        """Build from a transformers `config.json` dict or a `PretrainedConfig` (4.x and 5.x keys).

        Args:
            config: the model config.
            layer_type: for models with per-layer RoPE (Gemma 3: "sliding_attention" / "full_attention").
        Raises:
            PosencError: unknown model or rope type, missing or foreign keys, invalid values.
        """
        from ..hf import rope_from_hf_config

        return rope_from_hf_config(config, layer_type=layer_type)

    # ---------------------------------------------------------------- rotation
    def rotate(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        layout: str = "bhtd",
        seq_len: int | None = None,
        precision: str = "float32",
        allow_negative: bool = False,
        compute_dtype: torch.dtype | None = None,
        impl: str | None = None,
        table: RopeTable | None = None,
    ) -> torch.Tensor:
        """Rotate one tensor (q or k) at `position_ids`. See `apply` for the arguments."""
        self._check_x("x", x, layout)
        position_ids = self._check_positions(position_ids, x, layout, "x")
        cos, sin, rows = self._tables_for(position_ids, table, seq_len, precision, allow_negative, x)
        return route.rotate(x, None, cos, sin, rows, self.pairing, impl=impl, layout=layout,
                            compute_dtype=compute_dtype)[0]

    def apply(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        layout: str = "bhtd",
        seq_len: int | None = None,
        precision: str = "float32",
        allow_negative: bool = False,
        compute_dtype: torch.dtype | None = None,
        impl: str | None = None,
        table: RopeTable | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k at explicit logical positions (new tensors; `apply_` rotates in place).

        Args:
            q: `[b, hq, t, d]` (layout "bhtd"), `[b, t, hq, d]` ("bthd") or packed `[t, hq, d]` ("thd").
            k: the same with `hk` heads (GQA: hk may differ from hq).
            position_ids: `[t]`, `[b, t]`, or `[3, b, t]` for multi-axis RoPE; integer logical positions.
            layout: "bhtd", "bthd" or "thd".
            seq_len: length for length-dependent scalings (default `max(position_ids) + 1`, as transformers).
            precision: "float32" or "exact".
            allow_negative: accept negative positions.
            compute_dtype: the rotation's dtype (default float32, one rounding; `q.dtype` reproduces
                transformers' bf16/fp16 arithmetic bit for bit, see `apply_rope`).
            impl: "reference", "cpu", "compiled" or "triton" (see `posenc.kernels`); default None = the
                fastest available for q's device, bit-identical to the reference. A named impl never falls
                back: it raises PosencError when it cannot run these inputs.
            table: a `RopeTable` of this Rope (`rope.table(n)`), read at row p for position p: the fast
                path for repeated calls (decode). Without it the call computes the rows its positions need.
        Returns:
            `(q_rotated, k_rotated)` in the inputs' dtypes; pass-through channels bit-identical.
        Raises:
            PosencError: non-float q/k, wrong head_dim, mismatched shapes, non-integer or negative positions,
                an impl that cannot run here, a table of another Rope or positions outside it.
        """
        if (type(table) is RopeTable and table.held is not None and table.rope is self and seq_len is None
                and compute_dtype is None and (impl is None or impl == "cpu") and precision == table.precision
                and not _compiling()):  # the decode hot path (None: a call for the general path)
            out = route.rotate_held(q, k, position_ids, table.held, layout, self.head_dim, False)
            if out is not None:
                return out
        return self._apply(q, k, position_ids, False, layout, seq_len, precision, allow_negative, compute_dtype, impl, table)

    # apply's keywords, spelled out (a **options dict would cost ~0.3 us per decode call)
    def apply_(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, *, layout: str = "bhtd",
               seq_len: int | None = None, precision: str = "float32", allow_negative: bool = False,
               compute_dtype: torch.dtype | None = None, impl: str | None = None,
               table: RopeTable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate q and k in place; returns `(q, k)`.

        Like a torch in-place op: a tensor autograd saved for backward makes that backward raise after it.
        The default CPU path rewrites each element once, with no temporary (docs/performance.md).

        Args:
            q, k, position_ids: as `apply`.
            layout, seq_len, precision, allow_negative, compute_dtype, impl, table: as `apply`.
        Returns:
            `(q, k)`, rotated.
        Raises:
            PosencError: as `apply`; also q and k that share memory, or a leaf tensor that requires grad.
        """
        if (type(table) is RopeTable and table.held is not None and table.rope is self and seq_len is None
                and compute_dtype is None and (impl is None or impl == "cpu") and precision == table.precision
                and not _compiling()):  # the decode hot path, as in apply
            out = route.rotate_held(q, k, position_ids, table.held, layout, self.head_dim, True)
            if out is not None:
                return out
        return self._apply(q, k, position_ids, True, layout, seq_len, precision, allow_negative, compute_dtype, impl, table)

    def _apply(self, q, k, position_ids, inplace, layout, seq_len, precision, allow_negative, compute_dtype, impl, table):
        # apply and apply_ pass every argument by position: keyword passing is a visible share of a decode call
        self._check_x("q", q, layout)  # metadata only: values are checked in the kernel (no host sync)
        self._check_x("k", k, layout)
        qs, ks, heads = q.shape, k.shape, q.ndim + LAYOUTS[layout][2]
        if qs[:heads] != ks[:heads] or qs[heads + 1:] != ks[heads + 1:]:
            for a in range(q.ndim):
                if a != heads and qs[a] != ks[a]:
                    fail("k", f"size {qs[a]} in dim {a} (as q {tuple(qs)}; only heads may differ)", k)
        if not (q.is_cpu and k.is_cpu) and k.device != q.device:
            fail("k", f"a tensor on the device of q ({q.device})", k)
        if inplace and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
            for arg, x in (("q", q), ("k", k)):
                if x.requires_grad and x.is_leaf:
                    fail(arg, "a tensor autograd lets apply_ change (not a leaf that requires grad: use apply)",
                         Raw("a leaf tensor with requires_grad=True"))
        eager_inplace = inplace and not _compiling()  # (tensor addresses and inference flags: eager only)
        if eager_inplace and not torch.is_inference_mode_enabled() and (q.is_inference() or k.is_inference()):
            arg = "q" if q.is_inference() else "k"  # torch refuses x.mul_(2) here too
            fail(arg, "a tensor torch lets apply_ change (an inference tensor only inside torch.inference_mode(); "
                 "clone it or rotate under inference_mode)", Raw("an inference tensor outside inference mode"))
        twice = written_twice(q, k) if eager_inplace else None
        if twice == ("k", "q"):
            fail("k", "a tensor that shares no memory with q (apply_ writes both; rotate one tensor with rotate)",
                 Raw("a view of q's memory"))
        if twice:
            fail(twice[0], "a tensor whose elements are distinct memory (apply_ writes each once: clone a broadcast "
                 "or as_strided view)", Raw("a view that repeats memory"))
        position_ids = self._check_positions(position_ids, q, layout, "q")
        cos, sin, rows = self._tables_for(position_ids, table, seq_len, precision, allow_negative, q)
        return route.rotate(q, k, cos, sin, rows, self.pairing, inplace=inplace, impl=impl, layout=layout,
                            compute_dtype=compute_dtype)
