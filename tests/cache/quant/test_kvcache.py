"""QuantizedKVCache against a full recompute: random operation sequences, error within the format's bound.

The model of the cache is a list per row of (position, raw key, raw value, re-quantizations) that each
operation edits by hand; after every operation each read key must equal the raw key turned by the 2x2
oracle at its position (float64 angles), within the format's bound (tests/test_kv_quant.closed_form, from
the raw values' own range), and every value within its per-token bound. Pre-RoPE per-channel keys never
re-quantize: their bound never grows, and their codes are bit-identical across move / shift / rollback.
"""

import copy

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

import posenc
from posenc.cache.quant import QuantizedKVCache
from tests.helpers.oracles import rotate_angles
from tests.cache.quant.test_formats import closed_form

B, HK, D, DV, LAYERS, GROUP = 2, 2, 8, 6, 2, 4
ROPE = posenc.Rope(head_dim=D)
FORMATS = ("int8", "int4", "fp8", "bfloat16", "float32")


def oracle_keys(raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`raw [h, n, d]` rotated at `positions [n]` with float64 angles built here: pos * 10000**(-2j/d)."""
    inv = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # [d/2]
    return rotate_angles(raw, positions.double()[:, None] * inv)  # [h, n, d]


def pair_norm(x: torch.Tensor) -> torch.Tensor:
    """`[..., d]` -> `[..., d/2]` norms of the split-half pairs (j, j + d/2), which rotation preserves."""
    return torch.hypot(x[..., : D // 2], x[..., D // 2:])


def key_bound(fmt: str, store: str, hist: torch.Tensor, raw: torch.Tensor, requant: torch.Tensor) -> torch.Tensor:
    """Bound on the pair-norm error `[h, n, d/2]` of the keys `raw [h, n, d]` of one row.

    unrotated: channel stats over blocks of the row's history `hist [h, m, d]` (a superset of each block),
    one quantization. rotated: per-token stats over a vector within +-R (R: the token's largest pair norm,
    rotation-invariant; 1.5 R covers earlier errors), once per write and once per re-rotation (`requant [n]`).
    """
    if store == "unrotated" and fmt in ("int8", "int4", "fp8"):
        per_channel = closed_form(hist, fmt, "channel").amax(dim=1, keepdim=True)  # [h, 1, d]
        return pair_norm(per_channel).expand(*raw.shape[:2], D // 2)
    radius = pair_norm(raw).amax(dim=-1, keepdim=True) * 1.5  # [h, n, 1]
    span = torch.cat((radius, -radius), dim=-1)  # [h, n, 2]: the widest a token's channels can spread
    per_token = closed_form(span, fmt, "token").amax(dim=-1, keepdim=True)  # [h, n, 1]
    return (2**0.5 * per_token * (1 + requant[None, :, None].double())).expand(*raw.shape[:2], D // 2)


class Model:
    """Per row: positions, raw keys, raw values, re-quantization counts, and the history of raw keys."""

    def __init__(self) -> None:
        self.rows = [dict(pos=[], k=[], v=[], req=[], hist=[]) for _ in range(B)]

    def check(self, cache: QuantizedKVCache, fmt: str, store: str) -> None:
        for layer in range(LAYERS):
            keys, values = cache.read(layer)  # [b, hk, w, d]
            for r, row in enumerate(self.rows):
                n = len(row["pos"])
                assert int(cache.lengths[r]) == n and cache.positions[r, :n].tolist() == row["pos"]
                if not n:
                    continue
                raw_k = torch.stack([k[layer] for k in row["k"]], 1)  # [hk, n, d]
                raw_v = torch.stack([v[layer] for v in row["v"]], 1)  # [hk, n, dv]
                hist = torch.stack([k[layer] for k in row["hist"]], 1)
                want = oracle_keys(raw_k, torch.tensor(row["pos"]))
                err = pair_norm(keys[r, :, :n].double() - want)  # [hk, n, d/2]
                bound = key_bound(fmt, store, hist, raw_k, torch.tensor(row["req"]))
                tol = 1e-5 * (1 + want.abs().amax())  # float32 tables against float64 angles
                assert bool((err <= bound + tol).all()), f"layer {layer} row {r}: key error {float((err - bound).max())}"
                v_bound = closed_form(raw_v, fmt, "token")
                assert bool(((values[r, :, :n].double() - raw_v.double()).abs() <= v_bound).all())


def apply_op(cache, model, op, gen, store):
    kind = op[0]
    if kind == "append":
        counts = op[1]
        nxt = cache.next_positions()
        t = max(counts)
        mask = torch.arange(t)[None, :] < torch.tensor(counts)[:, None]  # [b, t], padding after each row's tokens
        positions = nxt[:, None] + torch.arange(t) + op[2]  # [b, t]
        k = torch.randn(LAYERS, B, HK, t, D, generator=gen) * 2
        k[..., 1] = k[..., 1] * 20 + 30  # an outlier channel, as in pre-RoPE keys
        v = torch.randn(LAYERS, B, HK, t, DV, generator=gen)
        slots = cache.reserve(positions, mask)
        for layer in range(LAYERS):
            cache.write(layer, k[layer], v[layer], slots)
        for r, row in enumerate(model.rows):
            for j in range(counts[r]):
                row["pos"].append(int(positions[r, j]))
                row["k"].append(k[:, r, :, j])
                row["v"].append(v[:, r, :, j])
                row["hist"].append(k[:, r, :, j])
                row["req"].append(0)
    elif kind == "rollback":
        n = [min(x, len(row["pos"])) for x, row in zip(op[1], model.rows)]
        cache.rollback(torch.tensor(n))
        for m, row in zip(n, model.rows):
            for key in ("pos", "k", "v", "req"):
                row[key] = row[key][:len(row[key]) - m]
    elif kind == "reorder":  # a fork when an index repeats
        cache.reorder(torch.tensor(op[1]))
        model.rows = [copy.deepcopy(model.rows[i]) for i in op[1]]
    elif kind in ("keep_recent", "move"):
        if kind == "keep_recent":
            window, sinks, shift = op[1], op[2], op[3]
            cache.keep_recent(window, sinks, shift=shift)
            for row in model.rows:
                n = len(row["pos"])
                kept = [j for j in range(n) if j < sinks or j >= n - window]
                for key in ("pos", "k", "v", "req"):
                    row[key] = [row[key][j] for j in kept]
            new = [[row["pos"][0] + j for j in range(len(row["pos"]))] if shift and row["pos"] else row["pos"]
                   for row in model.rows]
            moved = shift
        else:
            new = [[p + op[1] * (j + 1) for j, p in enumerate(row["pos"])] for row in model.rows]
            grid = torch.full(tuple(cache.positions.shape), -1)
            for r, pos in enumerate(new):
                grid[r, :len(pos)] = torch.tensor(pos, dtype=torch.long)
            cache.move(grid)
            moved = True
        for row, pos in zip(model.rows, new):
            if moved and store == "rotated" and row["pos"]:
                row["req"] = [q + 1 for q in row["req"]]  # decode, rotate, re-encode
            row["pos"] = pos


OPS = st.one_of(
    st.tuples(st.just("append"), st.lists(st.integers(0, 6), min_size=B, max_size=B), st.integers(0, 3)),
    st.tuples(st.just("rollback"), st.lists(st.integers(0, 5), min_size=B, max_size=B)),
    st.tuples(st.just("reorder"), st.lists(st.integers(0, B - 1), min_size=B, max_size=B)),
    st.tuples(st.just("keep_recent"), st.integers(1, 6), st.integers(0, 2), st.booleans()),
    st.tuples(st.just("move"), st.integers(0, 2)),
)


@pytest.mark.parametrize("store", ["unrotated", "rotated"])
@pytest.mark.parametrize("fmt", FORMATS)
@settings(max_examples=12, deadline=None)
@given(ops=st.lists(OPS, min_size=1, max_size=8), seed=st.integers(0, 2**16))
def test_random_operations_stay_within_the_format_bound(fmt, store, ops, seed):
    gen = torch.Generator().manual_seed(seed)
    cache = QuantizedKVCache(LAYERS, B, HK, D, None, kv_dtype=fmt, rope=ROPE, store=store, value_dim=DV, group=GROUP)
    model = Model()
    for op in [("append", [5, 3], 0)] + ops:
        apply_op(cache, model, op, gen, store)
        model.check(cache, fmt, store)
