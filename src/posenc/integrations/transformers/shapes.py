"""Attention rotations of another shape than `apply_rotary_pos_emb(q, k, cos, sin)`, for `patch`.

- "sincos": GPT-J and CodeGen, `apply_rotary_pos_emb(tensor, sin, cos)`: one tensor per call, `[b, t, h, r]` (the
  leading `rotary_dim` channels of q or k, before the head transpose), channels paired `(2i, 2i + 1)`
  ("interleaved"), computed as `x * cos + rotate_every_two(x) * sin`, which is posenc's interleaved rotation term
  for term (`x_even c - x_odd s`, `x_odd c + x_even s`). The sin/cos come from the rotary module (an
  `embed_positions` buffer of `torch.sin`/`torch.cos` rows, the bits of posenc's float32 table); GPT-J casts them
  to q's dtype, CodeGen keeps the buffer's (a float32 buffer rotates bf16 q and k in float32), so the rounding here
  follows the dtype the family's product runs in (bf16/fp16: tables and products rounded to it). float64 q and k
  are rotated by posenc's reference (its C kernel, once an ulp away at a few pairs per row, is now bit-identical
  to it too: tests/kernels/test_cpu.py).
- "complex": DeepSeek-V2 and Llama 4, `apply_rotary_emb(q, k, freqs_cis)`: channel pairs `(2i, 2i + 1)` read as
  complex numbers `a + ib` and multiplied in float32 by `freqs_cis = polar(1, p * inv_freq) * attention_factor`,
  `(a c - b s) + i(a s + b c)`. The angles here are posenc's (`p * angle_freq` of the layer's Rope, float32, as
  transformers computes them; `precision="exact"`: posenc's exact-phase cos/sin), and `torch.polar` takes their
  cos and sin as transformers does (the C library's `cos`/`sin`, an ulp away from `torch.cos` at some angles).
  The product itself is torch's complex product by default (`impl=None`): torch's vectorised loop computes posenc's
  interleaved rotation term for term, but where a row of pairs is narrower than a SIMD vector (DeepSeek-V2's
  4-pair `q_pe`, a strided view, on AVX-512) its scalar loop fuses a multiply-add and differs from posenc's
  kernels by an ulp, so only torch's own product is transformers' to the bit in every layout. A named `impl`
  rotates with that posenc kernel on the same cos/sin (within an ulp of transformers). q and k are rotated in
  float32 (float64 input rounded to float32 first, as `xq.float()`) and return their dtype. Llama 4's layout is
  `[b, t, h, d]`, DeepSeek-V2's `[b, h, t, r]` (its `q_pe`, `k_pe`).

The rotary module of a "complex" family returns one `ComplexPositions` (transformers' attention calls
`position_embeddings.to(device)` on it); it keeps the cos/sin rows each layer Rope computed for this forward, so
the layers that share a Rope compute them once.
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

import torch

from ...rope import dispatch
from ...rope.spec import Rope
from ...rope.tables import cos_sin
from .decoder import Options, Positions, Tables

__all__ = ["COMPLEX", "COMPLEX_LAYOUTS", "ComplexPositions", "rotary_forward", "rotations", "shaped"]

COMPLEX = "apply_rotary_emb"  # the module-level complex-number rotation of DeepSeek-V2 and Llama 4
# the layout of the q and k each complex family passes (Llama 4: before the head transpose; DeepSeek-V2: q_pe, k_pe)
COMPLEX_LAYOUTS = {"llama4_text": "bthd", "deepseek_v2": "bhtd"}  # Llama 4 VL: its text config's type
BUFFER_DTYPE = ("codegen",)  # sincos families whose product runs in the dtype of the rotary module's buffer


def rotations(model_type: str) -> set[str]:
    """The names of the other-shaped module-level rotations `patch` replaces for `model_type`."""
    return {COMPLEX} if model_type in COMPLEX_LAYOUTS else set()


class ComplexPositions(Positions):
    """`Positions` standing where a complex family's rotary module returns `freqs_cis`: `.to(device)` as a
    tensor, and the cos/sin of each layer Rope, made by the first layer that needs them."""

    __slots__ = ("rows",)

    def __init__(self, position_ids: torch.Tensor, seq_len: int | None) -> None:
        super().__init__(position_ids, seq_len)
        self.rows: dict[tuple[Rope, str], torch.Tensor] = {}

    def to(self, device: Any = None, *args: Any, **kwargs: Any) -> "ComplexPositions":
        """The positions on `device` (the attention moves `freqs_cis` to q's device)."""
        if not isinstance(device, (torch.device, str, int)) or self.position_ids.device == torch.device(device):
            return self
        return ComplexPositions(self.position_ids.to(device), self.seq_len)

    def cis(self, rope: Rope, precision: str) -> torch.Tensor:
        """`[b, t, r/2]` complex64 `cos + i sin` of `rope` at these positions, made as transformers makes `freqs_cis`."""
        key = (rope, precision)
        if key not in self.rows:
            position_ids = self.position_ids
            freq, factor = rope._ladder(rope.seq_len_for(position_ids, self.seq_len))  # the Rope's kept ladder
            if precision == "exact":
                self.rows[key] = torch.complex(*cos_sin(position_ids, freq, factor, "exact"))
            else:  # `tables.angles` without its checks (transformers' positions): as transformers computes them
                theta = position_ids[..., None].float() * freq.to(position_ids.device)
                self.rows[key] = torch.polar(torch.ones_like(theta), theta) * factor
        return self.rows[key]


class SincosPositions(Positions):
    """`Positions` of a "sincos" family, with the dtype of the sin/cos its rotary module would return (None: q's)."""

    __slots__ = ("dtype",)

    def __init__(self, position_ids: torch.Tensor, seq_len: int | None, dtype: torch.dtype | None) -> None:
        super().__init__(position_ids, seq_len)
        self.dtype = dtype


def rotary_forward(model_type: str, module: Any, table: contextvars.ContextVar) -> Callable | None:
    """The rotary module's forward under a patch for a family of another shape (None: `positions_forward`'s):
    one `ComplexPositions` where a complex family returns `freqs_cis`; `SincosPositions` twice for CodeGen."""
    if model_type in COMPLEX_LAYOUTS:
        def forward(x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> ComplexPositions:
            return ComplexPositions(position_ids, table.get())

        return forward
    if model_type in BUFFER_DTYPE and isinstance(getattr(module, "embed_positions", None), torch.Tensor):
        def forward(x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
            marker = SincosPositions(position_ids, table.get(), module.embed_positions.dtype)
            return marker, marker

        return forward
    return None


def shaped(form: str, pick: Callable[[torch.Tensor, Any], Rope], options: Options, layout: str | None,
           tables: Tables) -> Callable:
    """posenc's rotation in the signature of the family's own (`form` "sincos" or "complex"); `pick(x, positions)`
    is the layer's Rope for a tensor of that width (it checks the width and the positions); "sincos" rotates
    float32 products on the patch's held `tables`."""
    if form == "sincos":
        def apply_rotary_pos_emb(tensor: torch.Tensor, sin: Any, cos: Any = None) -> torch.Tensor:
            rope = pick(tensor, sin)  # the positions ride in place of sin (and cos)
            dtype = torch.promote_types(tensor.dtype, getattr(sin, "dtype", None) or tensor.dtype)
            rounded = dtype in (torch.bfloat16, torch.float16) and options.impl is None
            impl = "reference" if options.impl is None and tensor.dtype == torch.float64 else options.impl
            position_ids, seq_len, table = sin.position_ids, sin.seq_len, None
            if not rounded and position_ids.ndim <= 2 and sin.span()[0] >= 0:  # the held rows, as decoder.rotate
                hi = sin.span()[1]
                table = tables.table(rope, hi + 1, hi + 1 if seq_len is None else seq_len, options.precision,
                                     tensor.device)
                seq_len = None
            return rope.rotate(tensor, position_ids, layout="bthd", seq_len=seq_len, precision=options.precision,
                               impl=impl, compute_dtype=dtype if rounded else None, table=table)

        return apply_rotary_pos_emb

    def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cis: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rope = pick(xq, freqs_cis)
        if not isinstance(freqs_cis, ComplexPositions):
            freqs_cis = ComplexPositions(freqs_cis.position_ids, freqs_cis.seq_len)
        cis = freqs_cis.cis(rope, options.precision)  # [b, t, r/2]
        if options.impl is not None:  # posenc's kernel on the same cos/sin
            q, k = dispatch.rotate(xq.float(), xk.float(), cis.real.contiguous(), cis.imag.contiguous(), None,
                                   rope.pairing, impl=options.impl, layout=layout)
            return q.type_as(xq), k.type_as(xk)
        cis = cis[:, :, None, :] if layout == "bthd" else cis.unsqueeze(1)  # over the heads

        def turn(x: torch.Tensor) -> torch.Tensor:  # transformers' product, on posenc's cos/sin
            pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(pairs * cis).flatten(3).type_as(x)

        return turn(xq), turn(xk)

    return apply_rotary_emb
