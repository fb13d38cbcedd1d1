"""Rank worker for tests/distributed/test_torch_cp_blockmask.py: PyTorch's flex CP path WITH its BlockMask
(PyTorch rewrites the causal mask_mod to global indices; posenc's score_mod carries the bias)."""

import time

import torch

import posenc
from posenc.attention import attention
from posenc.distributed import shard
from posenc.distributed.testing import max_diff

SEQ = 256  # PyTorch's CP block mask needs Q_LEN % (W * 128) == 0


def run(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.attention.flex_attention import create_block_mask

    from posenc.distributed.torch_cp import flex_cp_attention, shard_buffers

    start = time.perf_counter()
    mesh = init_device_mesh("cpu", (world_size,))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, SEQ, 16, generator=g)
    k, v = (torch.randn(1, 4, SEQ, 16, generator=g) for _ in range(2))
    positions = torch.arange(SEQ)
    causal = create_block_mask(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx, 1, 1, SEQ, SEQ, device="cpu")
    torch.manual_seed(5)
    report = {}
    for name, enc in (("alibi", posenc.ALiBi(4)), ("t5", posenc.T5RelativeBias(4, bidirectional=False))):
        with torch.no_grad():
            expected = attention(q, k, v, q_positions=positions, k_positions=positions, encoding=enc)
            lq, lk, lv, lp, mask = shard_buffers(mesh, [q, k, v, positions, causal], [2, 2, 2, 0, 2])
            out = flex_cp_attention(lq, lk, lv, q_positions=lp, k_positions=lp, mesh=mesh, encoding=enc,
                                    block_mask=mask)
        report[name] = max_diff(out, shard(expected, 2, world_size, rank))
    report["seconds"] = time.perf_counter() - start
    return report
