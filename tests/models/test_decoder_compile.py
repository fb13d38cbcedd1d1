"""A cached decode step of `posenc.models.Decoder` traces under `torch.compile(fullgraph=True)` (issue 21).

What is compiled: the decoder's own forward with the cache as an argument, `step(tok, mask, cache) =
model(tok, attention_mask=mask, cache=cache)`; the prefill runs eager. `fullgraph=True` turns any graph
break (a host sync such as `.item()`, `bool(tensor)`, `torch.equal`) into an error; no `capture_scalar_outputs`.

The number of graphs is bounded by three, whatever the length: the first step is traced with static
sizes, the second marks the read width (`KVCache.read_width`, a host-side int) and a growing
`attention_mask` dynamic (torch's automatic dynamic shapes), and the step whose width reaches `capacity`
gets one more graph (the full-width slice specialises). After those, steps at any width (after a
rollback, after the cache fills) reuse them.

Backends: "aot_eager" (dynamo + AOT autograd's functionalization of the in-place cache writes, run with
eager kernels) in the default run: the logits equal the eager steps bit for bit, as the kernels and their
order are the same. Inductor is the slow test (minutes of compile on the 2-core CI machine); its fused
kernels round differently, so it is held to the float32 TOL.
"""

import os

import pytest
import torch

from tests.helpers.tolerances import assert_close
from posenc import ALiBi, T5RelativeBias

CFG = {"vocab_size": 50, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
       "intermediate_size": 48, "rope_scaling": {"rope_type": "yarn", "factor": 2.0,
                                                 "original_max_position_embeddings": 16},
       "max_position_embeddings": 32}  # YaRN: a length-independent scaling (dynamic NTK would need a sync)
PROMPT = torch.tensor([[3, 4, 5, 6], [0, 7, 8, 9]])
PROMPT_MASK = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])  # row 1 left-padded


BIASES = {"alibi": lambda: ALiBi(4), "t5": lambda: T5RelativeBias(4, num_buckets=8, max_distance=16)}


def model_and_caches(layers, store, block_size, capacity, bias=None):
    from posenc.models import Decoder

    encoding = None if bias is None else BIASES[bias]()  # None: the config's RoPE
    model = Decoder.from_hf_config({**CFG, "num_hidden_layers": layers}, encoding=encoding, seed=0).eval()
    caches = [model.new_cache(2, capacity, store=store, block_size=block_size) for _ in range(2)]
    for cache in caches:  # the prefill, eager, into the cache the compiled steps use and the reference
        model(PROMPT, attention_mask=PROMPT_MASK, cache=cache)
    return model, caches


def steps(model, compiled, caches, n, check, full_mask):
    """`n` decode steps, compiled on caches[0] and eager on caches[1]; `check(got, expected)` each logit."""
    for i in range(n):
        tok = torch.tensor([[7 + i], [11 + i]])
        lengths = caches[1].lengths
        mask = torch.ones(2, 1, dtype=torch.long)
        if full_mask:  # transformers' form: [b, cached + 1], the past columns left-padded, counting each row's tokens
            w = int(lengths.max())
            past = torch.arange(w)[None, :] >= w - lengths[:, None]  # [b, w]
            mask = torch.cat((past.long(), mask), 1)  # [b, w + 1]
        got = compiled(tok, mask, caches[0])
        expected = model(tok, attention_mask=mask, cache=caches[1])
        check(got, expected)
    assert torch.equal(caches[0].positions, caches[1].positions)
    assert torch.equal(caches[0].lengths, caches[1].lengths)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        check(a, b)


def bit_exact(got, expected):
    assert torch.equal(got, expected), (got - expected).abs().max()


@pytest.mark.parametrize("store,block_size,full_mask,bias", [
    ("rotated", None, False, None), ("unrotated", None, True, None), ("rotated", 4, False, None),
    ("rotated", None, False, "alibi"), ("rotated", 4, True, "t5")],
    ids=["rotated", "unrotated-hf-mask", "paged-rotated", "alibi", "t5-paged-hf-mask"])
@torch.no_grad()
def test_a_compiled_decode_step_equals_eager_in_at_most_three_graphs(store, block_size, full_mask, bias):
    from torch._dynamo.utils import counters

    model, caches = model_and_caches(1, store, block_size, 8, bias)  # [4, 3] tokens held

    def step(tok, mask, cache):
        return model(tok, attention_mask=mask, cache=cache)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # a graph break raises
    steps(model, compiled, caches, 4, bit_exact, full_mask)  # widths 5..8: static, dynamic, full capacity
    graphs = counters["stats"]["unique_graphs"]
    assert graphs <= 3, dict(counters["stats"])
    for cache in caches:
        cache.rollback(3)  # back to widths the dynamic graph covers
    steps(model, compiled, caches, 3, bit_exact, full_mask)
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])  # nothing new to compile


@torch.no_grad()
def test_a_bad_token_in_a_compiled_step_raises_and_changes_nothing():
    """Under compile the value checks are `torch._assert_async` in the graph: a RuntimeError with the check's text."""
    model, caches = model_and_caches(1, "rotated", None, capacity=8)
    torch._dynamo.reset()
    compiled = torch.compile(lambda tok, cache: model(tok, cache=cache), fullgraph=True, backend="aot_eager")
    compiled(torch.tensor([[1], [2]]), caches[0])
    before = [caches[0].positions.clone(), caches[0].lengths.clone()] + [x.clone() for x in caches[0].k]
    with pytest.raises(RuntimeError, match=r"input_ids: expected token ids in \[0, vocab_size=50\)"):
        compiled(torch.tensor([[50], [2]]), caches[0])
    after = [caches[0].positions, caches[0].lengths] + caches[0].k
    assert all(torch.equal(a, b) for a, b in zip(before, after))


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("POSENC_SLOW"), reason="slow (inductor compiles): set POSENC_SLOW=1 to run")
@pytest.mark.parametrize("store,block_size", [("rotated", None), ("unrotated", None), ("rotated", 4)])
@torch.no_grad()
def test_inductor_decode_steps_match_eager_within_tol(store, block_size):
    from torch._dynamo.utils import counters

    model, caches = model_and_caches(2, store, block_size, capacity=9)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(lambda tok, mask, cache: model(tok, attention_mask=mask, cache=cache), fullgraph=True)
    steps(model, compiled, caches, 5, assert_close, full_mask=False)
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])
