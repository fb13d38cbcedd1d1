"""The one per-dtype tolerance table (atol, rtol), used by every comparison in the suite."""

import torch

TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1.3e-6),
    torch.bfloat16: (1e-2, 1.6e-2),
    torch.float16: (1e-3, 1e-3),
}


def assert_close(actual, expected, dtype=None, msg=""):
    dtype = dtype or expected.dtype
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(actual.to(expected.dtype), expected, atol=atol, rtol=rtol, msg=msg or None)
