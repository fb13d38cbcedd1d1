"""Fused decode-step append in Triton: rotate new keys and write K and V into KV-cache slots, one launch.

Instead of `k = rope(k); k_cache[..., slots, :] = k; v_cache[..., slots, :] = v` (three passes over the
new keys and values, two launches at least), each program loads a block of new keys, rotates them with
the cos/sin rows of their positions and stores them, with the matching values, straight into the slots.
Experimental: no posenc call path reaches it yet (the cache appends with plain indexing); its tests check it
against the reference. Imported lazily: `import posenc` never imports triton.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...errors import fail
from ..constants import ANGLE_CODES, PAIRING_CODES, TWO_PI_PARTS
from ..triton_rope import _cos_sin, _rotate_block, block_sizes

__all__ = ["rope_append_kv"]


@triton.jit
def _append_kernel(K, V, KC, VC, COS, SIN, ROWS, SLOTS,
                   skb, skh, skt, skd, scb, sch, sct, scd, svb, svh, svt, svd, sub, suh, sut, sud,
                   HK, T, rows_b, slots_b, half, D, DV, factor, two_pi_hi, two_pi_mid, two_pi_lo,
                   BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   BLOCK_PASS: tl.constexpr, BLOCK_DV: tl.constexpr, PAIRING: tl.constexpr,
                   ANGLES: tl.constexpr, ROUND_BF16: tl.constexpr):
    pid_t = tl.program_id(0)
    b = tl.program_id(1)
    h0 = tl.program_id(2) * BLOCK_H
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = t < T
    slot = tl.load(SLOTS + b.to(tl.int64) * slots_b + t, mask=t_mask, other=0)  # [BT] cache slot of each new token
    c, s = _cos_sin(COS, SIN, ROWS, b, rows_b, t, t_mask, half, factor, two_pi_hi, two_pi_mid, two_pi_lo,
                    BLOCK_HALF, ANGLES, False)
    _rotate_block(K, KC, skb, skh, skt, skd, scb, sch, sct, scd, b, h0, HK, t, slot, t_mask,
                  c[None, :, :], s[None, :, :], half, D, BLOCK_H, BLOCK_HALF, BLOCK_PASS, PAIRING, True, ROUND_BF16)
    h = h0 + tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_DV)
    vmask = (h < HK)[:, None, None] & t_mask[None, :, None] & (j < DV)[None, None, :]
    b64, h64, t64 = b.to(tl.int64), h.to(tl.int64), t.to(tl.int64)  # int64 offsets (caches pass 2**31 elements)
    vals = tl.load(V + b64 * svb + h64[:, None, None] * svh + t64[None, :, None] * svt + j[None, None, :] * svd,
                   mask=vmask)
    tl.store(VC + b64 * sub + h64[:, None, None] * suh + slot.to(tl.int64)[None, :, None] * sut
             + j[None, None, :] * sud, vals, mask=vmask)


def rope_append_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   positions: torch.Tensor, slots: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   pairing: str = "split_half", *, angles: str = "table", factor: float = 1.0) -> None:
    """Rotate `k` at `positions` and write it and `v` into `k_cache` / `v_cache` at `slots`, in one launch.

    Args:
        k: `[b, hk, t, d]` new keys (not rotated); v: `[b, hk, t, dv]` new values.
        k_cache, v_cache: `[b, hk, s, d]` and `[b, hk, s, dv]` caches, written in place.
        positions: int64 `[t]` or `[b, t]`: table rows (angles="table") or positions (angles="float32"/"exact").
        slots: int64 `[t]` or `[b, t]`: the cache slot of each new token, in `[0, s)`.
        cos, sin: `[n, r/2]` float32 tables; for computed angles `cos` is `inv_freq [r/2]` (see `triton_rope`).
        pairing: "split_half", "interleaved" or "interleaved_to_split_half".
    Raises:
        PosencError: mismatched shapes or slots outside the cache.
    """
    b, hk, t, d = k.shape
    if v.shape[:3] != (b, hk, t) or k_cache.shape[:2] != (b, hk) or k_cache.shape[3] != d:
        fail("k_cache", f"[{b}, {hk}, s, {d}] with v [{b}, {hk}, {t}, dv]", k_cache)
    if v_cache.shape[:3] != k_cache.shape[:3] or v_cache.shape[3] != v.shape[3]:
        fail("v_cache", f"[{b}, {hk}, {k_cache.shape[2]}, {v.shape[3]}] (as k_cache, v)", v_cache)
    if k_cache.dtype != k.dtype or v_cache.dtype != v.dtype:
        fail("k_cache", f"dtypes {k.dtype} / {v.dtype} (as k / v)", k_cache)
    if not torch.compiler.is_compiling() and slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= k_cache.shape[2]):
        fail("slots", f"slots in [0, {k_cache.shape[2]})", slots)  # one host sync: no write out of bounds
    if b == 0 or t == 0:
        return
    half = cos.shape[-1] if angles == "table" else cos.shape[0]
    bt, bh, bhalf, bpass = block_sizes(half, d - 2 * half, hk, t)
    grid = (triton.cdiv(t, bt), b, triton.cdiv(hk, bh))
    batch_stride = lambda r: r.shape[-1] if r.ndim == 2 and r.shape[0] > 1 else 0  # noqa: E731
    _append_kernel[grid](
        k, v, k_cache, v_cache, cos, sin, positions, slots, *k.stride(), *k_cache.stride(), *v.stride(),
        *v_cache.stride(), hk, t, batch_stride(positions), batch_stride(slots), half, d, v.shape[3],
        float(factor), *TWO_PI_PARTS,
        BLOCK_T=bt, BLOCK_H=bh, BLOCK_HALF=bhalf, BLOCK_PASS=bpass, BLOCK_DV=triton.next_power_of_2(v.shape[3]),
        PAIRING=PAIRING_CODES[pairing], ANGLES=ANGLE_CODES[angles], ROUND_BF16=k.dtype == torch.bfloat16,
    )
