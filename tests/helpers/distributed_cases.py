"""What each spawned rank runs for tests/distributed/test_multirank.py (importable by the children).

One 4-rank gloo world runs every case: CP=4 on the world, CP=2 on the subgroups {0, 1} and {2, 3}.
Each case returns max |difference| numbers against single-process `posenc.attention`; the test module
only asserts on them. Inputs are drawn from fixed seeds, identical on every rank.
"""

import time

import torch

import posenc
from posenc.attention import attention
from posenc.distributed import ring_attention, shard, shard_positions, ulysses_attention
from posenc.distributed.testing import compare_attention, max_diff

SEQ = {2: 24, 4: 32}  # global lengths: multiples of 2W, odd chunk count per rank at W=2 (6 tokens)
LENGTHS = {2: [8, 4, 12], 4: [16, 8, 8]}  # packed documents, each a multiple of 2W


def _t5(bidirectional=False):
    torch.manual_seed(1234)  # the replicated table must be equal on every rank
    return posenc.T5RelativeBias(4, num_buckets=8, max_distance=20, bidirectional=bidirectional).double()


def encodings():
    """name -> encoding for 4 query heads of width 8."""
    return {
        "none": None,
        "rope": posenc.Rope(head_dim=8),
        "yarn": posenc.Rope(head_dim=8, scaling=posenc.YaRN(4.0, 8)),
        "dynamic": posenc.Rope(head_dim=8, scaling=posenc.DynamicNTK(2.0, 8)),  # length-dependent
        "alibi": posenc.ALiBi(4),
        "t5": _t5(),
    }


def _ulysses_encodings(heads):
    return {"rope": posenc.Rope(head_dim=8), "yarn": posenc.Rope(head_dim=8, scaling=posenc.YaRN(4.0, 8)),
            "alibi": posenc.ALiBi(heads), "t5": _t5_heads(heads)}


def _t5_heads(heads):
    torch.manual_seed(1234)
    return posenc.T5RelativeBias(heads, num_buckets=8, max_distance=20, bidirectional=False).double()


def _cases(rank, size, group):
    """Every (name, report) for one CP group."""
    seq = SEQ[size]
    common = dict(rank=rank, size=size, seq_len=seq, group=group)
    for layout in ("zigzag", "contiguous"):
        for name, enc in encodings().items():
            yield f"ring-{layout}-{name}", compare_attention(ring_attention, layout=layout, encoding=enc, **common)
        for name, enc in _ulysses_encodings(8).items():
            yield f"ulysses-{layout}-{name}", compare_attention(ulysses_attention, layout=layout, encoding=enc,
                                                                heads=(8, 4), **common)
    lengths = LENGTHS[size]
    for name in ("rope", "alibi", "t5"):
        enc = encodings()[name]
        yield f"packed-zigzag-{name}", compare_attention(ring_attention, encoding=enc, lengths=lengths, **common)
    yield "packed-contiguous-rope", compare_attention(ring_attention, encoding=encodings()["rope"],
                                                      layout="contiguous", lengths=lengths, **common)
    yield "ring-zigzag-alibi-window-batch2", compare_attention(ring_attention, encoding=encodings()["alibi"],
                                                               window=5, batch=2, **common)
    mask = torch.rand(2, seq, generator=torch.Generator().manual_seed(11)) > 0.3  # [b, S] padding-like holes
    yield "ring-zigzag-alibi-keymask", compare_attention(ring_attention, encoding=encodings()["alibi"], batch=2,
                                                         key_mask=mask, **common)
    yield "ulysses-contiguous-rope-keymask", compare_attention(ulysses_attention, encoding=encodings()["rope"],
                                                               heads=(8, 4), batch=2, key_mask=mask, **common)
    yield "ring-zigzag-t5-bidirectional", compare_attention(ring_attention, encoding=_t5(True), causal=False, **common)
    yield "ring-zigzag-mha-float32", compare_attention(ring_attention, encoding=encodings()["rope"], heads=(4, 4),
                                                       dtype=torch.float32, **common)
    yield "ulysses-zigzag-alibi-sdpa", compare_attention(ulysses_attention, encoding=posenc.ALiBi(8), heads=(8, 4),
                                                         impl="sdpa", **common)
    yield from _controls(rank, size, group)


def _local_positions(attn):
    """A deliberately wrong caller: passes shard-local indices instead of global positions."""
    def wrong(q, k, v, *, q_positions, k_positions, **kwargs):
        local = torch.arange(q_positions.shape[-1])
        return attn(q, k, v, q_positions=local, k_positions=local, **kwargs)
    return wrong


def _controls(rank, size, group):
    """Mistakes the tests must see as failures (so the comparison can fail)."""
    common = dict(rank=rank, size=size, seq_len=SEQ[size], group=group)
    for name in ("rope", "alibi", "t5"):
        yield (f"control-local-positions-{name}",
               compare_attention(_local_positions(ring_attention), encoding=encodings()[name], **common))
    # dynamic NTK with each shard's own length instead of the global one (contiguous rank 0 sees a short one)
    yield ("control-local-length-dynamic",
           compare_attention(_local_length(ring_attention), encoding=encodings()["dynamic"], layout="contiguous",
                             **common))


def _local_length(attn):
    def wrong(q, k, v, *, q_positions, k_positions, **kwargs):
        return attn(q, k, v, q_positions=q_positions, k_positions=k_positions,
                    seq_len=int(q_positions.max()) + 1, **kwargs)
    return wrong


def _flex_cases(rank, size, group):
    """PyTorch's FlexAttention CP path (forward: CPU flex has no backward) with posenc's score_mods."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    from posenc.distributed.torch_cp import flex_cp_attention, shard_buffers

    mesh = DeviceMesh.from_group(group, "cpu")
    seq = SEQ[size]
    report = {}
    for s in (seq, seq + size):  # seq + W is not a multiple of 2W: PyTorch silently does not balance
        positions = torch.arange(s)
        with context_parallel(mesh, buffers=[positions], buffer_seq_dims=[0], no_restore_buffers={positions}):
            report[f"context_parallel-positions-{s}"] = positions.tolist()
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 4, seq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, seq, 8, generator=g, dtype=torch.float64) for _ in range(2))
    full = torch.arange(seq)
    for name in ("alibi", "t5"):
        enc = encodings()[name]
        with torch.no_grad():
            expected = attention(q, k, v, q_positions=full, k_positions=full, encoding=enc)
            lq, lk, lv, lp = shard_buffers(mesh, [q, k, v, full], [2, 2, 2, 0])
            out = flex_cp_attention(lq, lk, lv, q_positions=lp, k_positions=lp, mesh=mesh, encoding=enc)
            report[f"flex-{name}"] = {"out": max_diff(out, shard(expected, 2, size, rank))}
            if name == "alibi":  # control: shard-local indices, as a score_mod on q_idx / kv_idx
                idx = torch.arange(lp.numel())
                wrong = flex_cp_attention(lq, lk, lv, q_positions=idx, k_positions=idx, mesh=mesh, encoding=enc)
                report[f"control-flex-local-positions-{name}"] = {"out": max_diff(wrong, shard(expected, 2, size, rank))}
    report["flex-positions"] = lp.tolist()
    return report


def run_all(rank, world_size):
    """Entry point of every rank: returns {"cp4": {...}, "cp2": {...}, "seconds": ...}."""
    import torch.distributed as dist

    start = time.perf_counter()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    results = {}
    for size, group in ((4, None), (2, pairs[rank // 2])):
        cp_rank = dist.get_rank(group)
        start_group = time.perf_counter()
        cases = dict(_cases(cp_rank, size, group))
        start_flex = time.perf_counter()
        cases.update(_flex_cases(cp_rank, size, dist.group.WORLD if group is None else group))
        cases["seconds"] = {"ring+ulysses": start_flex - start_group, "flex": time.perf_counter() - start_flex}
        cases["shard_positions"] = shard_positions(SEQ[size], size, cp_rank).tolist()
        results[f"cp{size}"] = cases
    results["seconds"] = time.perf_counter() - start
    return results


def fail_on_rank_one(rank, world_size):
    """For the spawn helper's own test: rank 1 raises, rank 0 waits in a collective."""
    import torch.distributed as dist

    if rank == 1:
        raise ValueError("rank one fails on purpose")
    dist.barrier()


def hang_on_rank_zero(rank, world_size):
    """For the spawn helper's timeout test: rank 0 waits for a message nobody sends."""
    import torch.distributed as dist

    if rank == 0:
        dist.recv(torch.zeros(1), src=1)
    return rank
