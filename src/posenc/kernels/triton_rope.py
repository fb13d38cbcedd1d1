"""Triton RoPE: q and k in one launch, forward and backward (rotation by -theta), tables or on-the-fly angles.

One program rotates BLOCK_T tokens x BLOCK_H heads of one batch row of q or of k (the head blocks of
k follow those of q on the grid's third axis). Angles come from
- `angles="table"`: rows of float32 cos/sin tables `[n, r/2]` picked by `rows [b?, t]`, or
- `angles="float32"`: `float32(position) * inv_freq` then cos/sin in float32 (as `posenc.rope.tables`), or
- `angles="exact"`: the phase in float64 reduced by 2*pi in three parts (the `"exact"` precision).
bfloat16 is rounded to nearest even by bit arithmetic: a compiled kernel does that anyway, and the
Triton CPU interpreter (TRITON_INTERPRET=1, used by the tests) would otherwise truncate.
Imported lazily: `import posenc` never imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .constants import ANGLE_CODES, PAIRING_CODES, TWO_PI_PARTS

__all__ = ["rotate"]


@triton.jit
def _store(ptr, value, mask, ROUND_BF16: tl.constexpr):
    if ROUND_BF16:  # round to nearest even by hand (see the module docstring)
        bits = value.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        tl.store(ptr, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
    else:
        tl.store(ptr, value.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_block(X, O, sxb, sxh, sxt, sxd, sob, soh, sot, sod, b, h0, H, t, t_out, t_mask, c, s, half, D,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_PASS: tl.constexpr,
                  PAIRING: tl.constexpr, COPY_PASS: tl.constexpr, ROUND_BF16: tl.constexpr):
    h = h0 + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK_HALF)
    mask = (h < H)[:, None, None] & t_mask[None, :, None] & (i < half)[None, None, :]  # [BH, BT, BHALF]
    # offsets in int64: b * stride and t * stride pass 2**31 elements on large tensors and KV caches
    b64, h64, t64, to64 = b.to(tl.int64), h.to(tl.int64), t.to(tl.int64), t_out.to(tl.int64)
    xrow = X + b64 * sxb + h64[:, None, None] * sxh + t64[None, :, None] * sxt
    orow = O + b64 * sob + h64[:, None, None] * soh + to64[None, :, None] * sot  # t_out: cache slots or t
    if PAIRING == 0:  # split-half: (i, i + r/2)
        ia = i
        ib = i + half
    else:  # interleaved reads: (2i, 2i + 1)
        ia = 2 * i
        ib = 2 * i + 1
    a = tl.load(xrow + ia[None, None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
    bb = tl.load(xrow + ib[None, None, :] * sxd, mask=mask, other=0.0).to(tl.float32)
    lo = a * c - bb * s  # c, s: [1, BT, BHALF]
    hi = bb * c + a * s
    if PAIRING == 1:
        oa = 2 * i
        ob = 2 * i + 1
    else:  # split-half writes (also interleaved_to_split_half)
        oa = i
        ob = i + half
    _store(orow + oa[None, None, :] * sod, lo, mask, ROUND_BF16)
    _store(orow + ob[None, None, :] * sod, hi, mask, ROUND_BF16)
    if COPY_PASS:  # out of place: channels past r/2 pairs are copied bit-identical
        j = 2 * half + tl.arange(0, BLOCK_PASS)
        pmask = (h < H)[:, None, None] & t_mask[None, :, None] & (j < D)[None, None, :]
        v = tl.load(xrow + j[None, None, :] * sxd, mask=pmask)
        tl.store(orow + j[None, None, :] * sod, v, mask=pmask)


@triton.jit
def _cos_sin(COS, SIN, ROWS, b, rows_b, t, t_mask, half, factor, two_pi_hi, two_pi_mid, two_pi_lo,
             BLOCK_HALF: tl.constexpr, ANGLES: tl.constexpr, INVERSE: tl.constexpr):
    """cos, sin `[BLOCK_T, BLOCK_HALF]` float32 of tokens `t` of batch row `b` (negated sin when INVERSE)."""
    i = tl.arange(0, BLOCK_HALF)
    tab_mask = t_mask[:, None] & (i < half)[None, :]
    row = tl.load(ROWS + b.to(tl.int64) * rows_b + t, mask=t_mask, other=0)  # [BT] table rows or positions
    if ANGLES == 0:
        c = tl.load(COS + row[:, None] * half + i[None, :], mask=tab_mask, other=0.0)
        s = tl.load(SIN + row[:, None] * half + i[None, :], mask=tab_mask, other=0.0)
    else:
        inv = tl.load(COS + i, mask=i < half, other=0.0)
        if ANGLES == 1:  # float32 phase, rounded once: checkpoint arithmetic
            theta = row.to(tl.float32)[:, None] * inv[None, :]
            c = tl.cos(theta) * factor
            s = tl.sin(theta) * factor
        else:  # exact phase: float64 product, reduced by 2*pi in three parts
            phase = row.to(tl.float64)[:, None] * inv.to(tl.float64)[None, :]
            turns = tl.floor(phase / (two_pi_hi + two_pi_mid) + 0.5)
            theta = ((phase - turns * two_pi_hi) - turns * two_pi_mid) - turns * two_pi_lo
            c = (tl.cos(theta) * factor).to(tl.float32)  # factor applied in float64, as tables.cos_sin
            s = (tl.sin(theta) * factor).to(tl.float32)
    if INVERSE:
        s = -s
    return c, s


@triton.jit
def _rope_kernel(Q, K, QO, KO, COS, SIN, ROWS,
                 sqb, sqh, sqt, sqd, oqb, oqh, oqt, oqd,
                 skb, skh, skt, skd, okb, okh, okt, okd,
                 HQ, HK, T, rows_b, half, D, factor, two_pi_hi, two_pi_mid, two_pi_lo,
                 BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                 BLOCK_PASS: tl.constexpr, PAIRING: tl.constexpr, ANGLES: tl.constexpr,
                 INVERSE: tl.constexpr, COPY_PASS: tl.constexpr, ROUND_BF16: tl.constexpr):
    pid_t = tl.program_id(0)
    b = tl.program_id(1)
    pid_h = tl.program_id(2)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    c, s = _cos_sin(COS, SIN, ROWS, b, rows_b, t, t_mask, half, factor, two_pi_hi, two_pi_mid, two_pi_lo,
                    BLOCK_HALF, ANGLES, INVERSE)
    c = c[None, :, :]  # [1, BT, BHALF]
    s = s[None, :, :]
    n_q_blocks = (HQ + BLOCK_H - 1) // BLOCK_H  # not tl.cdiv: a jit function of triton itself, decorated at
    # triton import, which breaks the interpreter when triton was imported before TRITON_INTERPRET=1
    if pid_h < n_q_blocks:
        _rotate_block(Q, QO, sqb, sqh, sqt, sqd, oqb, oqh, oqt, oqd, b, pid_h * BLOCK_H, HQ, t, t, t_mask, c, s,
                      half, D, BLOCK_H, BLOCK_HALF, BLOCK_PASS, PAIRING, COPY_PASS, ROUND_BF16)
    else:
        _rotate_block(K, KO, skb, skh, skt, skd, okb, okh, okt, okd, b, (pid_h - n_q_blocks) * BLOCK_H, HK, t,
                      t, t_mask, c, s, half, D, BLOCK_H, BLOCK_HALF, BLOCK_PASS, PAIRING, COPY_PASS, ROUND_BF16)


def block_sizes(half: int, pass_width: int, heads: int, tokens: int) -> tuple[int, int, int, int]:
    """(BLOCK_T, BLOCK_H, BLOCK_HALF, BLOCK_PASS): ~4K pairs per program on a GPU."""
    block_half = triton.next_power_of_2(max(half, 1))
    block_pass = triton.next_power_of_2(max(pass_width, 1))
    block_h = min(triton.next_power_of_2(max(heads, 1)), max(1, 4096 // block_half), 8)
    block_t = min(triton.next_power_of_2(max(tokens, 1)), max(1, 4096 // (block_half * block_h)), 64)
    return block_t, block_h, block_half, block_pass


def rotate(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor, rows: torch.Tensor, pairing: str, *, inverse: bool = False, angles: str = "table",
           factor: float = 1.0) -> None:
    """Rotate q and k (`[b, h, t, d]` views, any strides) into q_out and k_out (may be q and k) in one launch.

    Args:
        cos, sin: `[n, r/2]` float32 tables (angles="table"); for "float32"/"exact", `cos` is `inv_freq [r/2]`.
        rows: int64 `[t]` or `[b, t]`: table rows (angles="table") or positions.
        pairing: "split_half", "interleaved" or "interleaved_to_split_half".
        inverse: rotate by -theta (the backward).
        factor: the attention factor applied to computed cos/sin (tables carry it already).
    """
    b, hq, t, d = q.shape
    hk = k.shape[1]
    half = cos.shape[-1] if angles == "table" else cos.shape[0]
    copy_pass = (q_out.data_ptr() != q.data_ptr() or k_out.data_ptr() != k.data_ptr()) and d > 2 * half
    bt, bh, bhalf, bpass = block_sizes(half, d - 2 * half, max(hq, hk), t)
    grid = (triton.cdiv(t, bt), b, triton.cdiv(hq, bh) + triton.cdiv(hk, bh))
    rows_b = rows.shape[-1] if rows.ndim == 2 and rows.shape[0] > 1 else 0
    if b == 0 or t == 0:
        return
    _rope_kernel[grid](
        q, k, q_out, k_out, cos, sin, rows, *q.stride(), *q_out.stride(), *k.stride(), *k_out.stride(),
        hq, hk, t, rows_b, half, d, float(factor), *TWO_PI_PARTS,
        BLOCK_T=bt, BLOCK_H=bh, BLOCK_HALF=bhalf, BLOCK_PASS=bpass, PAIRING=PAIRING_CODES[pairing],
        ANGLES=ANGLE_CODES[angles], INVERSE=inverse, COPY_PASS=copy_pass, ROUND_BF16=q.dtype == torch.bfloat16,
    )
