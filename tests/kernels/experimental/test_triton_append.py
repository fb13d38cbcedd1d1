"""The fused rope + KV append (`kernels/experimental/triton_append.py`) against the reference rotation and plain
indexing, on CPU under the Triton interpreter (TRITON_INTERPRET=1) or on a GPU."""

import pytest
import torch

from tests.helpers.triton_interpret import interpreted, use_interpreter_without_a_gpu

use_interpreter_without_a_gpu()  # before the kernels are imported
triton = pytest.importorskip("triton")


@pytest.fixture(autouse=True)
def interpreted_kernels(monkeypatch):
    """Kernels decorated in interpreter mode: another test (the doctests) may have imported them without it."""
    interpreted(monkeypatch, append=True)
    yield

from tests.kernels.test_triton_rope import DEVICE, _sparse, randn, same  # noqa: E402

from posenc import PosencError, Rope  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_rope_and_kv_append(dtype):
    from posenc.kernels.experimental.triton_append import rope_append_kv

    rope = Rope(head_dim=32, rotary_dim=16, pairing="interleaved")
    k, v = randn(2, 2, 3, 32, dtype=dtype), randn(2, 2, 3, 24, dtype=dtype, seed=1)
    k_cache, v_cache = randn(2, 2, 8, 32, dtype=dtype, seed=2), randn(2, 2, 8, 24, dtype=dtype, seed=3)
    positions = torch.tensor([[40, 41, 42], [7, 8, 9]]).to(DEVICE)
    slots = torch.tensor([[5, 6, 7], [0, 1, 2]]).to(DEVICE)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    k_rot = rope.rotate(k, positions, impl="reference")
    for row in range(2):
        expected_k[row, :, slots[row]] = k_rot[row]
        expected_v[row, :, slots[row]] = v[row]
    cos, sin = rope.cos_sin(torch.arange(64).to(DEVICE))
    rope_append_kv(k, v, k_cache, v_cache, positions, slots, cos, sin, "interleaved")
    same(k_cache, expected_k), same(v_cache, expected_v)
    with pytest.raises(PosencError, match=r"slots: expected slots in \[0, 8\)"):
        rope_append_kv(k, v, k_cache, v_cache, positions, slots + 6, cos, sin, "interleaved")



def test_fused_append_into_a_cache_past_two_to_the_31_elements():
    from posenc.kernels.experimental.triton_append import rope_append_kv

    rope = Rope(head_dim=32)
    k, v = randn(3, 1, 1, 32), randn(3, 1, 1, 32, seed=1)
    k_cache, v_cache = _sparse((3, 1, 4, 32), (2**30, 128, 32, 1)), _sparse((3, 1, 4, 32), (2**30, 128, 32, 1))
    positions, slots = torch.tensor([[7], [8], [9]]), torch.tensor([[1], [2], [3]])
    cos, sin = rope.cos_sin(torch.arange(16))
    rope_append_kv(k, v, k_cache, v_cache, positions, slots, cos, sin, "split_half")
    k_rot = rope.rotate(k, positions, impl="reference")
    for row in range(3):
        same(k_cache[row, :, slots[row]], k_rot[row]), same(v_cache[row, :, slots[row]], v[row])
