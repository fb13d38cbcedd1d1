"""Fresh outputs of the CPU kernel: large ones ask Linux for transparent huge pages, results unchanged.

An allocating rotation of a 64 MiB tensor is dominated by first-touch page faults (16,384 of them with
4 KiB pages). The kernel advises huge pages on the 2 MiB-aligned interior of outputs of at least 4 MiB
(never on its inputs, never in place); `POSENC_HUGE_PAGES=0` turns this off.
"""

from pathlib import Path

import pytest
import torch
from tests.kernels.test_cpu import randn

from posenc import Rope
from posenc.kernels import cpu

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the cpu kernel")
THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str | None:
    """The bracketed transparent-huge-page mode ("always", "madvise", "never"), or None off Linux."""
    try:
        return THP.read_text().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return None


def eligible(address: int) -> bool:
    """Whether the mapping holding `address` may get transparent huge pages (smaps' THPeligible)."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:  # a mapping's header: "start-end perms ..."
            lo, hi = (int(x, 16) for x in head.split("-"))
            mapping = lo <= address < hi
        elif mapping and line.startswith("THPeligible:"):
            return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_outputs_are_exact_with_and_without_huge_pages(dtype, monkeypatch):
    # >= 4 MiB fresh outputs also take the streaming (non-temporal) stores; odd token counts, GQA
    rope = Rope(head_dim=128)
    t = 1031 if dtype == torch.float32 else 2063
    q, k = randn(1, 9, t, 128, dtype=dtype), randn(1, 3, t, 128, dtype=dtype, seed=1)  # q: 4.5 MiB, k: 1.5 MiB
    pos = torch.arange(t) + 7
    expected = rope.apply(q, k, pos, impl="reference")
    for on in (1, 0):
        monkeypatch.setenv("POSENC_HUGE_PAGES", str(on))
        got = rope.apply(q, k, pos)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), on
        qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # bthd memory: heads inner
        got = rope.apply(qt, k, pos)
        assert torch.equal(got[0], expected[0]), on
        partial = Rope(head_dim=128, rotary_dim=64)  # streamed rotary half, pass-through half copied
        got, want = partial.apply(q, k, pos), partial.apply(q, k, pos, impl="reference")
        assert torch.equal(got[0], want[0]) and torch.equal(got[0][..., 64:], q[..., 64:]), on


@pytest.mark.skipif(thp_mode() != "madvise", reason="transparent huge pages are not in 'madvise' mode here")
def test_large_fresh_output_is_advised_and_input_is_not(monkeypatch):
    rope = Rope(head_dim=128)
    q = randn(1, 32, 4096, 128)  # 64 MiB: above glibc's largest mmap threshold, so a fresh mapping every time
    q_out, _ = rope.apply(q, q[:, :1], torch.arange(4096))
    inside = (q_out.data_ptr() + (4 << 20)) & ~((2 << 20) - 1)  # a 2 MiB-aligned address inside the output
    assert eligible(inside)
    small, _ = rope.apply(q[:, :9, :1031], q[:, :1, :1031], torch.arange(1031))  # 4.5 MiB: past the 4 MiB bound
    assert eligible((small.data_ptr() + (2 << 20)) & ~((2 << 20) - 1))
    q_inside = (q.data_ptr() + (4 << 20)) & ~((2 << 20) - 1)
    was = eligible(q_inside)  # False alone; after some earlier tests of the suite the process's heap already is
    rope.apply_(q, q[:, :1].clone(), torch.arange(4096))  # in place: the caller's memory is left alone
    assert eligible(q_inside) == was
    monkeypatch.setenv("POSENC_HUGE_PAGES", "0")
    q_out, _ = rope.apply(q, q[:, :1], torch.arange(4096))
    assert not eligible((q_out.data_ptr() + (4 << 20)) & ~((2 << 20) - 1))
