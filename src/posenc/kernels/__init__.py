"""Fast RoPE kernels: leaves that take tensors and know nothing of `Rope` (they import no other posenc package
but `errors`). `IMPLS` names the implementations `impl=` chooses from; `posenc.rope.dispatch` picks one.

- `"reference"`: `posenc.rope.apply.apply_rope`, plain torch (the oracle; never imports a kernel).
- `"cpu"`: a C kernel (`rope_cpu.c`, `rope_tile.c`, `rope_pool.c`; launched by `cpu.py`) built at install or on
  first use (`build.py`): q and k in one pass, in place or allocating, bit-identical to the reference. The
  same library's `rope_angles.c` (`angles.py`) makes the cos/sin rows of a call without a table with
  torch's own vector cos/sin.
- `"compiled"`: the reference rotation under `torch.compile(dynamic=True)` (`posenc.rope.compiled`).
- `"triton"`: one Triton kernel for q and k (`triton_rope.py`), forward and backward, tables or
  angles computed on the fly.

`constants.py` holds what the kernels and `rope` share (pairing and dtype codes, row limits, the exact-phase
reduction); `ops.py` wraps the kernels as torch custom ops; `experimental/` holds a fused rope + KV-cache
append (`triton_append.py`) that no call path reaches yet.

The default (`impl=None`) is the fastest one available for the tensors' device: "cpu" on the CPU when
it builds, "triton" on CUDA when Triton imports, else "reference". An explicit choice never falls back:
it raises `PosencError` naming `impl`.
"""

from __future__ import annotations

IMPLS = ("reference", "cpu", "compiled", "triton")

__all__ = ["IMPLS"]
