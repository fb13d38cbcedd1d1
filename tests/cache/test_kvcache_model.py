"""Model-based tests of the cache: random operation sequences against a plain list of entries per row.

The model keeps, per row, the (position, raw key, value, token) of every cached token in a Python list;
each operation (append with left padding, chunked or single-token; rollback; reorder and fork; keep_recent
with sinks, shifted or not; move) is applied to it by hand. After every operation, every filled slot of every
layer must read as the model says: the value bit-exact, the key rotated at the entry's current position
by the 2x2 oracle (tests/helpers/oracles.py) from the Rope's own tables. The contiguous and the paged store run
the same sequence and must agree bit for bit (same arithmetic, different layout).
"""

import pytest
import torch

import posenc
from posenc.cache import KVCache
from tests.helpers.tolerances import assert_close
from tests.helpers.oracles import rotate_pairs

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

F64 = torch.float64
LAYERS, HEADS, D, DV, CAP = 2, 2, 6, 3, 11
ROPE = posenc.Rope(head_dim=D, rotary_dim=4, pairing="interleaved")
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Model:
    """Per row, a list of entries `(position, k [LAYERS, HEADS, D], v [LAYERS, HEADS, DV], token)`."""

    def __init__(self, b):
        self.rows = [[] for _ in range(b)]

    def last(self, r):
        return self.rows[r][-1][0] if self.rows[r] else -1


def append(caches, model, data, gen):
    b = len(model.rows)
    t = data.draw(st.integers(1, 4), label="t")
    positions = torch.zeros(b, t, dtype=torch.long)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for r in range(b):
        n = data.draw(st.integers(0, min(t, CAP - len(model.rows[r]))), label="tokens")  # left padding: t - n
        gaps = data.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n), label="gaps")
        p = model.last(r)
        for j, gap in enumerate(gaps):
            p += gap
            positions[r, t - n + j], mask[r, t - n + j] = p, True
    tokens = torch.randint(0, 100, (b, t), generator=gen)
    k = torch.randn(LAYERS, b, HEADS, t, D, generator=gen, dtype=F64)
    v = torch.randn(LAYERS, b, HEADS, t, DV, generator=gen, dtype=F64)
    for cache in caches:
        slots = cache.reserve(positions, mask, tokens)
        for layer in range(LAYERS):
            cache.write(layer, k[layer], v[layer], slots)
    for r in range(b):
        for j in mask[r].nonzero().flatten().tolist():
            model.rows[r].append((int(positions[r, j]), k[:, r, :, j], v[:, r, :, j], int(tokens[r, j])))


def rollback(caches, model, data, gen):
    n = [data.draw(st.integers(0, len(row)), label="n") for row in model.rows]
    for cache in caches:
        cache.rollback(torch.tensor(n))
    model.rows = [row[:len(row) - k] for row, k in zip(model.rows, n)]


def reorder(caches, model, data, gen):
    b = len(model.rows)
    index = data.draw(st.lists(st.integers(0, b - 1), min_size=b, max_size=b), label="index")  # repeats: forks
    for cache in caches:
        cache.reorder(torch.tensor(index))
    model.rows = [list(model.rows[i]) for i in index]


def keep_recent(caches, model, data, gen):
    window, sinks = data.draw(st.integers(1, 5), label="window"), data.draw(st.integers(0, 2), label="sinks")
    shift = data.draw(st.booleans(), label="shift")
    for cache in caches:
        cache.keep_recent(window, sinks, shift=shift)
    for r, row in enumerate(model.rows):
        kept = [e for i, e in enumerate(row) if i < sinks or i >= len(row) - window]
        if shift and kept:
            kept = [(kept[0][0] + i,) + e[1:] for i, e in enumerate(kept)]
        model.rows[r] = kept


def move(caches, model, data, gen):
    new = torch.full((len(model.rows), CAP), -1, dtype=torch.long)
    for r, row in enumerate(model.rows):
        gaps = data.draw(st.lists(st.integers(1, 4), min_size=len(row), max_size=len(row)), label="moves")
        p = data.draw(st.integers(0, 5), label="start") - 1
        for i, gap in enumerate(gaps):
            p += gap
            new[r, i] = p
            row[i] = (p,) + row[i][1:]
    for cache in caches:
        cache.move(new)


OPS = {"append": append, "rollback": rollback, "reorder": reorder, "keep_recent": keep_recent, "move": move}


def check(cache, model):
    b = len(model.rows)
    assert cache.lengths.tolist() == [len(row) for row in model.rows]
    for r, row in enumerate(model.rows):
        n = len(row)
        assert cache.positions[r].tolist() == [e[0] for e in row] + [-1] * (CAP - n)
        assert cache.tokens[r].tolist() == [e[3] for e in row] + [-1] * (CAP - n)
    for layer in range(LAYERS):
        keys, values = cache.read(layer, width=CAP)  # [b, hk, CAP, d]
        for r, row in enumerate(model.rows):
            n = len(row)
            assert not values[r, :, n:].any() and not keys[r, :, n:].any()  # empty slots read as zeros
            if n == 0:
                continue
            raw = torch.stack([e[1][layer] for e in row], 1)  # [hk, n, d]
            assert torch.equal(values[r, :, :n], torch.stack([e[2][layer] for e in row], 1))
            cos, sin = ROPE.cos_sin(torch.tensor([e[0] for e in row]))  # [n, r/2], the Rope's own tables
            assert_close(keys[r, :, :n], rotate_pairs(raw, cos, sin, ROPE.pairing))
    assert b == cache.batch_size


@pytest.mark.parametrize("store", ["rotated", "unrotated"])
@SETTINGS
@given(data=st.data(), b=st.integers(1, 3), block_size=st.sampled_from([1, 2, 3, 4, 16]))
def test_random_operation_sequences_match_the_model(store, data, b, block_size):
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    caches = [KVCache(LAYERS, b, HEADS, D, CAP, rope=ROPE, store=store, value_dim=DV, dtype=F64),
              KVCache(LAYERS, b, HEADS, D, CAP, rope=ROPE, store=store, value_dim=DV, dtype=F64,
                      block_size=block_size)]
    model = Model(b)
    for name in data.draw(st.lists(st.sampled_from(sorted(OPS)), min_size=1, max_size=8), label="ops"):
        OPS[name](caches, model, data, gen)
        check(caches[0], model)
        for layer in range(LAYERS):  # the paged store: the same entries, bit for bit
            assert all(torch.equal(x, y) for x, y in zip(caches[0].read(layer, width=CAP),
                                                          caches[1].read(layer, width=CAP)))
        assert torch.equal(caches[0].positions, caches[1].positions)
        refs = caches[1].pages.refs
        assert refs.sum() == caches[1].pages.table.numel() and (refs >= 0).all()  # every entry counted once


# ---------------------------------------------------------------- the decoder: every step == a full recompute
CONFIG = {"vocab_size": 40, "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
          "intermediate_size": 24}


def decoder(layers):
    torch.manual_seed(0)
    return posenc.models.Decoder.from_hf_config({**CONFIG, "num_hidden_layers": layers}, seed=0).double().eval()


@pytest.mark.parametrize("layers", [1, 2])
@settings(max_examples=12, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), b=st.integers(1, 3), block_size=st.sampled_from([None, 1, 3, 4]),
       store=st.sampled_from(["rotated", "unrotated"]))
@torch.no_grad()
def test_cached_decoding_equals_a_full_recompute(layers, data, b, block_size, store):
    """Chunked prefill with left padding, decode, rollback, forks; with one layer also windows and moves
    (one layer's keys and values depend on the token alone, so a window of them is a recompute of the kept tokens)."""
    model = decoder(layers)
    cache = model.new_cache(b, CAP, store=store, block_size=block_size)
    rows = [[] for _ in range(b)]  # (token, position) per cached token
    ops = ["append", "append", "rollback", "reorder"] + (["keep_recent", "move"] if layers == 1 else [])
    for name in data.draw(st.lists(st.sampled_from(ops), min_size=1, max_size=6), label="ops"):
        if name == "append":
            t = data.draw(st.integers(1, 4), label="t")
            room = [CAP - len(row) for row in rows]
            n = [data.draw(st.integers(0 if r else min(1, room[r]), min(t, room[r])), label="n") for r in range(b)]
            mask = torch.tensor([[j >= t - k for j in range(t)] for k in n])  # [b, t], left padding
            ids = torch.randint(0, CONFIG["vocab_size"], (b, t), generator=torch.Generator().manual_seed(len(str(rows))))
            logits = model(ids, attention_mask=mask.long(), cache=cache)  # [b, t, vocab]
            for r in range(b):
                start = rows[r][-1][1] + 1 if rows[r] else 0
                rows[r] += [(int(ids[r, j]), start + i) for i, j in enumerate(range(t - n[r], t))]
                if n[r] == 0:
                    continue
                full = model(torch.tensor([[e[0] for e in rows[r]]]),
                             position_ids=torch.tensor([[e[1] for e in rows[r]]]))  # [1, len, vocab]
                assert_close(logits[r, t - n[r]:], full[0, -n[r]:])
        elif name == "rollback":
            n = [data.draw(st.integers(0, len(row)), label="n") for row in rows]
            cache.rollback(torch.tensor(n))
            rows = [row[:len(row) - k] for row, k in zip(rows, n)]
        elif name == "reorder":
            index = data.draw(st.lists(st.integers(0, b - 1), min_size=b, max_size=b), label="index")
            cache.reorder(torch.tensor(index))
            rows = [list(rows[i]) for i in index]
        elif name == "move":
            new = torch.full((b, CAP), -1, dtype=torch.long)
            for r, row in enumerate(rows):
                gaps = data.draw(st.lists(st.integers(1, 3), min_size=len(row), max_size=len(row)), label="moves")
                new[r, :len(row)] = torch.tensor(gaps, dtype=torch.long).cumsum(0) - 1
                rows[r] = [(e[0], int(p)) for e, p in zip(row, new[r])]
            cache.move(new)
        else:
            window, shift = data.draw(st.integers(1, 4), label="window"), data.draw(st.booleans(), label="shift")
            cache.keep_recent(window, 1, shift=shift)
            rows = [row[:1] + row[1:][-window:] if len(row) > window + 1 else row for row in rows]
            if shift:
                rows = [[(e[0], row[0][1] + i) for i, e in enumerate(row)] for row in rows]
        assert cache.positions.tolist() == [[e[1] for e in row] + [-1] * (CAP - len(row)) for row in rows]
