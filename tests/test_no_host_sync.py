"""The hot paths make no host sync: no `.item()`, `.tolist()`, `bool()`, `int()` or `float()` of a tensor.

On CUDA each of those waits for the device (and breaks CUDA-graph capture); CI has no GPU, so the proof
is on CPU: the calls are made to raise while the hot paths run (value checks then go through
`errors.assert_values`, on the device), and the same paths trace under `torch.compile(fullgraph=True)`
without `capture_scalar_outputs`.
"""

import contextlib

import pytest
import torch

from posenc import ALiBi, Rope, T5RelativeBias
from posenc.attention import attention
from posenc.rope.scaling import YaRN

SYNCS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def no_host_sync():
    """Make every host-sync method of torch.Tensor raise inside the block."""
    saved = {name: getattr(torch.Tensor, name) for name in SYNCS}

    def refuse(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"host sync: Tensor.{name}")
        return method

    try:
        for name in SYNCS:
            setattr(torch.Tensor, name, refuse(name))
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def test_the_guard_catches_a_sync():
    x = torch.tensor([1, 2])
    with no_host_sync(), pytest.raises(AssertionError, match="host sync"):
        bool((x > 0).all())
    with no_host_sync(), pytest.raises(AssertionError, match="host sync"):
        x.max().item()


def inputs(t=5, b=2):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, 4, t, 32, generator=g), torch.randn(b, 2, t, 32, generator=g),
               torch.randn(b, 2, t, 32, generator=g))
    return q, k, v, torch.arange(t) + 3


ROPES = [Rope(head_dim=32), Rope(head_dim=32, rotary_dim=16, pairing="interleaved"),
         Rope(head_dim=32, scaling=YaRN(factor=4.0, original_max_positions=64))]


@pytest.mark.parametrize("rope", ROPES, ids=["default", "partial-interleaved", "yarn"])
@pytest.mark.parametrize("impl", [None, "reference"])
def test_rope_calls_make_no_host_sync(rope, impl):
    q, k, _, pos = inputs()
    table = rope.table(64)
    expected = rope.apply(q, k, pos, impl="reference")
    with no_host_sync():
        outs = [rope.apply(q, k, pos, impl=impl), rope.apply(q, k, pos, impl=impl, table=table),
                rope.apply_(q.clone(), k.clone(), pos, impl=impl),
                rope.apply_(q.clone(), k.clone(), pos, impl=impl, table=table),
                (rope.rotate(q, pos, impl=impl), rope.rotate(k, pos, impl=impl, table=table)),
                rope.cos_sin(pos)]
        bad = torch.tensor([-1, 0, 1, 2, 3])
    for got in outs[:-1]:
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(outs[-1][0], rope.cos_sin(pos)[0])
    with pytest.raises(ValueError, match="position_ids"):  # the checks still run: off the host path
        rope.apply(q, k, bad, impl=impl)
    with pytest.raises(ValueError, match="position_ids"):
        rope.apply(q, k, pos + 100, impl=impl, table=table)


ENCODINGS = {"rope": Rope(head_dim=32), "alibi": ALiBi(4), "t5": T5RelativeBias(4, num_buckets=8, max_distance=16)}


@pytest.mark.parametrize("name", list(ENCODINGS))
@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_attention_makes_no_host_sync(name, impl):
    encoding = ENCODINGS[name]
    q, k, v, pos = inputs()
    expected = attention(q, k, v, q_positions=pos, k_positions=pos, encoding=encoding, impl=impl)
    mask = torch.ones(2, 5, dtype=torch.bool)
    mask[1, 0] = False
    expected_masked = attention(q, k, v, q_positions=pos, k_positions=pos, encoding=encoding, impl=impl, key_mask=mask)
    with no_host_sync():
        got = attention(q, k, v, q_positions=pos, k_positions=pos, encoding=encoding, impl=impl)
        got_masked = attention(q, k, v, q_positions=pos, k_positions=pos, encoding=encoding, impl=impl, key_mask=mask,
                               window=3)
    assert torch.equal(got, expected)
    assert got_masked.shape == expected_masked.shape


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_attention_traces_in_one_graph(name):
    encoding = ENCODINGS[name]
    q, k, v, pos = inputs()

    def step(q, k, v, pos):
        return attention(q, k, v, q_positions=pos, k_positions=pos, encoding=encoding, impl="sdpa")

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(q, k, v, pos)  # fullgraph: a graph break (a sync) raises
    torch.testing.assert_close(got, step(q, k, v, pos), atol=1e-5, rtol=1.3e-6)


def test_rope_calls_with_a_table_trace_in_one_graph():
    rope = Rope(head_dim=32, rotary_dim=24)
    table = rope.table(64)

    def step(q, k, pos):
        a = rope.apply(q, k, pos, table=table)
        b = rope.apply_(q.clone(), k.clone(), pos, table=table)
        return a[0], a[1], b[0], b[1]

    q, k, _, pos = inputs()
    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(q, k, pos)
    expected = rope.apply(q, k, pos, impl="reference")
    for g, e in zip(got, expected + expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1.3e-6)


DECODER = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "intermediate_size": 48}


@pytest.mark.parametrize("store", ["rotated", "unrotated"])
@pytest.mark.parametrize("block_size", [None, 4])
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@torch.no_grad()
def test_a_cached_decode_step_makes_no_host_sync(store, block_size, impl):
    """A decoder step on a fixed-capacity cache (a length-independent scaling): no sync, same logits as outside."""
    from posenc.models import Decoder

    cfg = {**DECODER, "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 16},
           "max_position_embeddings": 32}
    model = Decoder.from_hf_config(cfg, seed=0, attn_impl=impl).eval()
    ids = torch.tensor([[3, 4, 5, 6], [0, 7, 8, 9]])
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])  # left padding
    caches = [model.new_cache(2, 9, store=store, block_size=block_size) for _ in range(2)]
    for cache in caches:
        model(ids, attention_mask=mask, cache=cache)
    caches[1].reorder(torch.tensor([1, 1]))  # a fork: the step writes into a shared block (copy-on-write)
    step = torch.tensor([[11], [12]])
    expected = [model(step, cache=caches[0]), model(step, cache=caches[1])]
    for cache in caches:
        cache.rollback(1)
    with no_host_sync():
        got = [model(step, cache=caches[0]), model(step, cache=caches[1])]
        model(step + 1, cache=caches[0])  # a second step, positions continuing
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert caches[0].next_positions().tolist() == [6, 5]
    before = (caches[0].positions.clone(), caches[0].lengths.clone())
    with pytest.raises(ValueError, match=r"^input_ids: expected token ids in \[0, vocab_size=50\)"):
        model(torch.tensor([[50], [1]]), cache=caches[0])  # the checks still run (on the device in the step)
    with pytest.raises(ValueError, match=r"^position_ids: expected row 1 past its last cached position 4"):
        model(step, position_ids=torch.tensor([[7], [4]]), cache=caches[0])
    assert torch.equal(before[0], caches[0].positions) and torch.equal(before[1], caches[0].lengths)
