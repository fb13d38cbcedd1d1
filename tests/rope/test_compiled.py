"""`torch.compile(fullgraph=True)` traces Rope.apply, Rope.apply_ and attention(encoding=rope) without graph
breaks, and a growing sequence length compiles at most twice (static first, then one dynamic graph)."""

import pytest
import torch

from posenc import Rope
from posenc.attention import attention
from posenc.rope.scaling import Llama3


def test_fullgraph_compile_of_apply_apply_and_attention():
    from torch._dynamo.utils import counters

    from posenc.kernels import cpu

    impl = "cpu" if cpu.available() else None  # the C kernel as a custom op inside the graph
    rope = Rope(head_dim=32, scaling=Llama3(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_positions=64))

    def step(q, k, v, pos):
        q2, k2 = rope.apply(q, k, pos)  # default under compile: the reference, fused by inductor
        q3, k3 = rope.apply_(q.clone(), k.clone(), pos, impl=impl)
        out = attention(q, k, v, q_positions=pos, k_positions=pos, encoding=rope)
        return q2, k2, q3, k3, out

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, fullgraph=True)  # fullgraph: any graph break raises
    for t in (3, 5, 8):  # growing lengths
        q, k, v = torch.randn(1, 4, t, 32), torch.randn(1, 2, t, 32), torch.randn(1, 2, t, 32)
        pos = torch.arange(t) + 100
        got = compiled(q, k, v, pos)
        qr, kr = rope.apply(q, k, pos, impl="reference")
        for a, b in zip(got, (qr, kr, qr, kr, attention(q, k, v, q_positions=pos, k_positions=pos, encoding=rope))):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1.3e-6)  # inductor's cos/sin: 1 ulp from eager
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])
