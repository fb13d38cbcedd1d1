"""A refused cache call changes nothing: random operation sequences with bad calls injected, for every store
(contiguous, paged, growing) and kv dtype (plain; int8, int4, fp8 per token after RoPE and per channel before
it; a bfloat16 cast).

The oracle is the tests' own dump of the whole cache state (tests/helpers/cache_state.py): every tensor
reachable from the cache (its bookkeeping, block tables, every store and quantized part: codes, statistics
pools, block ids, residuals, scratch slots) as raw bytes, and every int / bool counter. Around each refused call (a PosencError, or an
exception raised inside `transaction()`) the dump must be byte-identical, and the tensors the cache held
before must still be the ones it holds (nothing rebound).
"""

import pytest
import torch

import posenc
from posenc.cache import KVCache
from posenc.cache.quant import QuantizedKVCache
from tests.helpers.cache_state import dump, held

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

LAYERS, B, HEADS, D, CAP, GROUP = 2, 2, 1, 4, 12, 3
ROPE = posenc.Rope(head_dim=D)
SETTINGS = settings(max_examples=20, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
CONFIGS = ["contiguous", "contiguous-unrotated", "paged", "growable",
           *[f"{q}:{keys}" for q in ("int8", "int4", "fp8") for keys in ("token", "channel")], "bfloat16:token"]


def make(config):
    if ":" in config:
        kv_dtype, keys = config.split(":")
        return QuantizedKVCache(LAYERS, B, HEADS, D, CAP, kv_dtype=kv_dtype, group=GROUP, rope=ROPE,
                                store="unrotated" if keys == "channel" else "rotated")
    return KVCache(LAYERS, B, HEADS, D, None if config == "growable" else CAP, rope=ROPE,
                   store="unrotated" if config.endswith("unrotated") else "rotated",
                   block_size=4 if config == "paged" else None)


def new_tokens(cache, data, gen, t=None):
    """Valid positions `[b, t]` (left padding, gaps) continuing each row, a mask, token ids, keys and values."""
    t = data.draw(st.integers(1, 3), label="t") if t is None else t
    last = cache.next_positions() - 1
    room = cache.capacity - cache.lengths if not cache.growable else torch.full_like(cache.lengths, t)
    positions, mask = torch.zeros(B, t, dtype=torch.long), torch.zeros(B, t, dtype=torch.bool)
    for r in range(B):
        n = data.draw(st.integers(0, min(t, int(room[r]))), label="tokens")
        p = int(last[r])
        for j in range(t - n, t):
            p += data.draw(st.integers(1, 2), label="gap")
            positions[r, j], mask[r, j] = p, True
    kv = [(torch.randn(B, HEADS, t, D, generator=gen), torch.randn(B, HEADS, t, D, generator=gen))
          for _ in range(LAYERS)]
    return positions, mask, torch.randint(0, 50, (B, t), generator=gen), kv


def append(cache, data, gen):
    positions, mask, tokens, kv = new_tokens(cache, data, gen)
    with cache.transaction():
        slots = cache.reserve(positions, mask, tokens)
        for layer, (k, v) in enumerate(kv):
            cache.write(layer, k, v, slots)


def valid_op(cache, data, gen):
    op = data.draw(st.sampled_from(["append", "append", "append", "rollback", "reorder", "keep_recent", "clear",
                                    "grow"]), label="op")
    if op == "append":
        append(cache, data, gen)
    elif op == "rollback":
        cache.rollback(torch.tensor([data.draw(st.integers(0, int(n)), label="n") for n in cache.lengths]))
    elif op == "reorder":
        cache.reorder(torch.tensor(data.draw(st.lists(st.integers(0, B - 1), min_size=B, max_size=B), label="i")))
    elif op == "keep_recent":
        cache.keep_recent(data.draw(st.integers(1, 4), label="window"), data.draw(st.integers(0, 2), label="sinks"),
                          shift=data.draw(st.booleans(), label="shift"))
    elif op == "clear":
        cache.clear(torch.tensor(data.draw(st.lists(st.booleans(), min_size=B, max_size=B), label="rows")))
    elif data.draw(st.booleans(), label="grow"):
        cache.grow(cache.capacity + data.draw(st.integers(0, 5), label="more"))


def bad_write_in_a_forward(cache, data, gen, quantized):
    """A forward's appends in one transaction: reserve, layer 0 written, then layer 1's keys refused."""
    positions, mask, tokens, kv = new_tokens(cache, data, gen, t=data.draw(st.integers(1, 3), label="t"))
    with cache.transaction():
        slots = cache.reserve(positions, mask, tokens)
        cache.write(0, *kv[0], slots)
        k, v = kv[1]
        if quantized and data.draw(st.booleans(), label="range"):
            k = k.clone().index_fill_(2, torch.tensor([k.shape[2] - 1]), 1e6)  # beyond float16: every format refuses
        else:
            v = v[:, :, :, :-1]  # a value of the wrong width
        cache.write(1, k, v, slots)


def edit_then_fail(cache, data, gen):
    """Edits and appends inside one transaction, then an error of the caller's: all of it is undone."""
    with cache.transaction():
        append(cache, data, gen)
        cache.rollback(torch.minimum(cache.lengths, torch.ones_like(cache.lengths)))
        cache.keep_recent(2, 1, shift=True)
        cache.grow(cache.capacity + 2)
        append(cache, data, gen)
        raise KeyError("the caller's own failure")


BAD = {
    "reserve past the last position": lambda c, d, g: c.reserve(torch.zeros(B, 1, dtype=torch.long) - 1),
    "reserve more than fits": lambda c, d, g: c.reserve(c.next_positions()[:, None] + torch.arange(c.capacity + 1)),
    "reserve float tokens": lambda c, d, g: c.reserve(c.next_positions()[:, None], tokens=torch.ones(B, 1)),
    "write unreserved slots": lambda c, d, g: c.write(0, torch.ones(B, HEADS, 1, D), torch.ones(B, HEADS, 1, D),
                                                      c.lengths[:, None]),
    "rollback too far": lambda c, d, g: c.rollback(c.lengths + 1),
    "rollback negative": lambda c, d, g: c.rollback(-1),
    "reorder empty": lambda c, d, g: c.reorder(torch.tensor([], dtype=torch.long)),
    "reorder out of range": lambda c, d, g: c.reorder(torch.tensor([0, B])),
    "keep_recent window 0": lambda c, d, g: c.keep_recent(0),
    "grow smaller": lambda c, d, g: c.grow(c.capacity - 1),
    "move to other shape": lambda c, d, g: c.move(torch.zeros(B, c.capacity + 1, dtype=torch.long)),
    "retable wrong rows": lambda c, d, g: c.retable(torch.ones(B + 1, dtype=torch.long)),
    "copy_slots out of range": lambda c, d, g: c.stores[0].copy_slots(torch.tensor([0]), torch.tensor([0]),
                                                                      torch.tensor([B]), torch.tensor([0])),
}


def refused(cache, call, error=posenc.PosencError):
    before, ids = dump(cache), held(cache)
    with pytest.raises(error):
        call()
    assert held(cache) == ids, "a refused call rebound a tensor"
    after = dump(cache)
    assert after.keys() == before.keys()
    changed = [path for path in before if before[path] != after[path]]
    assert not changed, f"a refused call changed {changed}"


@pytest.mark.parametrize("config", CONFIGS)
@SETTINGS
@given(data=st.data())
def test_a_refused_call_changes_nothing(config, data):
    cache, gen = make(config), torch.Generator().manual_seed(data.draw(st.integers(0, 99), label="seed"))
    quantized = config.split(":")[0] in ("int8", "int4", "fp8")  # formats with a range to refuse
    for _ in range(data.draw(st.integers(1, 6), label="steps")):
        valid_op(cache, data, gen)
        bad = data.draw(st.sampled_from(sorted(BAD) + ["forward"] * 6 + ["edit then fail"] * 2), label="bad")
        if bad == "forward":
            refused(cache, lambda: bad_write_in_a_forward(cache, data, gen, quantized))
        elif bad == "edit then fail":
            refused(cache, lambda: edit_then_fail(cache, data, gen), KeyError)
        elif not (bad == "reserve more than fits" and cache.growable):
            refused(cache, lambda: BAD[bad](cache, data, gen))


def test_dump_sees_a_write_the_cache_does_not_show():
    """The oracle can fail: a padding write lands in the scratch slot only, and the dump sees it."""
    cache = make("int8:channel")
    before = dump(cache)
    slots = cache.reserve(torch.tensor([[0], [0]]), torch.tensor([[True], [False]]))
    cache.write(0, torch.ones(B, HEADS, 1, D), torch.ones(B, HEADS, 1, D), slots)
    after = dump(cache)
    assert {p for p in before if before[p] != after[p]} >= {"cache.positions", "cache.lengths"}
    assert any("residual" in p and before[p] != after[p] for p in before)
