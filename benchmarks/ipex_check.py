"""Check the IPEX providers of `posenc bench` once against posenc's reference (run it in the IPEX venv).

`PYTHONPATH=src python benchmarks/ipex_check.py` prints the largest error of each IPEX provider against
`Rope.apply(impl="reference")` per dtype, over odd and round shapes (bench's decode position 4095 included).
"""

import torch

from posenc import Rope
from posenc.bench.providers import providers

SHAPES = [(2, 4, 2, 5, 40), (3, 4, 4, 1, 4095), (1, 3, 1, 17, 0), (1, 32, 8, 256, 0)]  # b, hq, hk, t, start

if __name__ == "__main__":
    rope = Rope(head_dim=128)
    found = [p for p in providers(quick=True)[0] if p.name.startswith("ipex")]
    assert found, "intel_extension_for_pytorch does not import here"
    gen = torch.Generator().manual_seed(0)
    for p in found:
        for dtype in (torch.float32, torch.bfloat16):
            err, differ = 0.0, 0
            for b, hq, hk, t, start in SHAPES:
                q = torch.randn(b, hq, t, 128, generator=gen).to(dtype)  # [b, h, t, d]
                k = torch.randn(b, hk, t, 128, generator=gen).to(dtype)
                pos = torch.full((b, 1), start) if t == 1 else torch.arange(t) + start  # as bench builds it
                want = rope.apply(q, k, pos, impl="reference")
                got = [x.transpose(1, 2) for x in p.make(q, k, pos)()]  # [b, t, h, d] -> [b, h, t, d]
                for g, w in zip(got, want):
                    err = max(err, (g.double() - w.double()).abs().max().item())
                    differ += int((g != w).sum())
            print(f"{p.name}, {str(dtype)[6:]}: max abs error {err:.3g}, {differ} elements differ from the reference")
