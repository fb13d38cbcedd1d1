"""posenc.distributed in one process: layouts against the engines' documented definitions, and encodings
computed on a shard from global positions against the same rows of the full-sequence computation."""

import pytest
import torch
from tests.helpers.tolerances import assert_close

import posenc
from posenc import PosencError
from posenc.distributed import (HeadSlice, head_slice, shard, shard_cos_sin, shard_positions, shard_varlen, unshard,
                                unshard_index)

GRID = [(8, 2), (24, 2), (16, 4), (32, 4), (24, 3), (48, 8)]  # (seq_len, cp_size), odd chunk sizes included


def megatron_zigzag(seq_len, cp_size, cp_rank):
    """Oracle from Megatron's `get_batch_on_this_cp_rank` / TE's DualChunkSwap docstring, written out:
    view the sequence as [2 cp, S / (2 cp)], keep rows (r, 2 cp - r - 1), flatten."""
    rows = torch.arange(seq_len).view(2 * cp_size, seq_len // (2 * cp_size))
    return rows.index_select(0, torch.tensor([cp_rank, 2 * cp_size - cp_rank - 1])).reshape(-1)


def te_chunk_freqs(seq_len, cp_size, cp_rank):
    """Oracle from TransformerEngine's `_get_freqs_on_this_cp_rank`: rows [r seg, (r+1) seg) and
    [S - (r+1) seg, S - r seg) of the full table, seg = S / (2 cp)."""
    seg = seq_len // (2 * cp_size)
    return list(range(cp_rank * seg, (cp_rank + 1) * seg)) + list(
        range(seq_len - (cp_rank + 1) * seg, seq_len - cp_rank * seg))


@pytest.mark.parametrize("seq_len, cp_size", GRID)
def test_zigzag_equals_megatron_te_and_pytorch_head_tail(seq_len, cp_size):
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import _HeadTailLoadBalancer

    torch_order = _HeadTailLoadBalancer(seq_len, cp_size, "cpu")._generate_indices()[0].long()  # [S]
    per_rank = seq_len // cp_size
    for r in range(cp_size):
        mine = shard_positions(seq_len, cp_size, r)
        assert mine.dtype == torch.int64
        assert torch.equal(mine, megatron_zigzag(seq_len, cp_size, r))
        assert mine.tolist() == te_chunk_freqs(seq_len, cp_size, r)
        assert torch.equal(mine, torch_order[r * per_rank:(r + 1) * per_rank])  # PyTorch shards contiguously after


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("seq_len, cp_size", GRID)
def test_layouts_partition_the_sequence_and_unshard_inverts(layout, seq_len, cp_size, gen):
    parts = [shard_positions(seq_len, cp_size, r, layout) for r in range(cp_size)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(seq_len))
    x = torch.randn(2, 3, seq_len, 5, generator=gen)
    shards = [shard(x, 2, cp_size, r, layout) for r in range(cp_size)]
    assert all(torch.equal(s, x[:, :, p]) for s, p in zip(shards, parts))
    assert torch.equal(unshard(shards, 2, layout), x)
    assert torch.equal(torch.cat(parts)[unshard_index(seq_len, cp_size, layout)], torch.arange(seq_len))
    if layout == "contiguous":
        assert torch.equal(torch.cat(parts), torch.arange(seq_len))


def te_thd_oracle(lengths, cp_size, cp_rank):
    """TransformerEngine's THD convention: every document cut into 2 cp chunks; rank r keeps chunks r and
    2 cp - 1 - r of each document, documents in order."""
    index, start = [], 0
    for n in lengths:
        seg = n // (2 * cp_size)
        index += list(range(start + cp_rank * seg, start + (cp_rank + 1) * seg))
        index += list(range(start + n - (cp_rank + 1) * seg, start + n - cp_rank * seg))
        start += n
    return index


@pytest.mark.parametrize("lengths, cp_size", [([4, 8, 4], 2), ([8, 24, 16, 8], 4), ([6, 18], 3), ([0, 4], 2)])
def test_varlen_zigzag_is_per_document_dual_chunk_swap(lengths, cp_size):
    cu = torch.tensor([0, *lengths]).cumsum(0)
    parts = [shard_varlen(cu, cp_size, r) for r in range(cp_size)]
    starts = cu[:-1].tolist()
    for r, s in enumerate(parts):
        assert s.index.tolist() == te_thd_oracle(lengths, cp_size, r)
        assert torch.equal(s.positions, s.index - torch.tensor(starts)[s.documents])  # restart per document
        assert torch.equal(s.cu_seqlens, torch.tensor([0, *lengths]).div(cp_size, rounding_mode="floor").cumsum(0))
    assert torch.equal(torch.sort(torch.cat([s.index for s in parts])).values, torch.arange(sum(lengths)))


def test_varlen_matches_pytorch_per_document_docstring_example():
    # PyTorch's _PerDocumentHeadTailLoadBalancer docstring: documents [4, 8, 4] on 2 ranks give rank 0 the
    # rows 0, 3, 4, 5, 10, 11, 12, 15. (Its code in 2.13 orders the indices document-major instead, so that
    # a contiguous split does not give this layout; posenc follows the documented / TE layout.)
    assert shard_varlen(torch.tensor([0, 4, 12, 16]), 2, 0).index.tolist() == [0, 3, 4, 5, 10, 11, 12, 15]
    assert shard_varlen(torch.tensor([0, 4, 12, 16]), 2, 1).index.tolist() == [1, 2, 6, 7, 8, 9, 13, 14]


@pytest.mark.parametrize("call, match", [
    (lambda: shard_positions(10, 2, 0), r"^seq_len: expected a non-negative multiple of 4 \(zigzag layout over cp_size=2\), got 10$"),
    (lambda: shard_positions(10, 4, 0, "contiguous"), r"^seq_len: expected a non-negative multiple of 4 \(contiguous"),
    (lambda: shard_positions(8, 2, 2), r"^cp_rank: expected an integer in \[0, cp_size=2\), got 2$"),
    (lambda: shard_positions(8, 0, 0), r"^cp_size: expected a positive integer, got 0$"),
    (lambda: shard_positions(8, 2, 0, "ring"), r"^layout: expected one of \('zigzag', 'contiguous'\), got 'ring'$"),
    (lambda: shard_varlen(torch.tensor([0, 4, 10]), 2, 0), r"^cu_seqlens \(document 1 of length 6\): expected a non-negative multiple of 4"),
    (lambda: shard_varlen(torch.tensor([1, 4]), 2, 0), r"^cu_seqlens: expected non-decreasing cumulative lengths starting at 0, got \[1, 4\]$"),
    (lambda: shard_varlen(torch.tensor([0.0, 4.0]), 2, 0), r"^cu_seqlens: expected a 1-D integer tensor"),
    (lambda: unshard([torch.zeros(2, 3), torch.zeros(2, 4)], 1), r"^shards: expected shards of equal length along dim, got lengths \[3, 4\]$"),
    (lambda: head_slice(6, 4, 0), r"^world_size: expected a divisor of num_heads=6, got 4$"),
    (lambda: head_slice(8, 4, 4), r"^rank: expected an integer in \[0, world_size=4\), got 4$"),
    (lambda: HeadSlice(posenc.ALiBi(4), slice(2, 6)), r"^heads_slice: expected slice\(start, stop\) within the scheme's 4 heads"),
])
def test_bad_layout_arguments_raise(call, match):
    with pytest.raises(PosencError, match=match):
        call()


@pytest.mark.parametrize("rope", [
    posenc.Rope(head_dim=16),
    posenc.Rope(head_dim=16, scaling=posenc.YaRN(4.0, 16)),
    posenc.Rope(head_dim=16, scaling=posenc.DynamicNTK(2.0, 16)),  # length-dependent: global length needed
    posenc.Rope(head_dim=16, rotary_dim=8, pairing="interleaved"),
], ids=["default", "yarn", "dynamic", "partial-interleaved"])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_rope_on_a_shard_equals_the_shard_of_full_rope(rope, layout, gen):
    seq_len, cp_size = 48, 4
    full_cos, full_sin = rope.cos_sin(torch.arange(seq_len))  # [S, r/2]
    x = torch.randn(2, 3, seq_len, 16, generator=gen, dtype=torch.float64)
    full = rope.rotate(x, torch.arange(seq_len))
    for r in range(cp_size):
        ids = shard_positions(seq_len, cp_size, r, layout)
        cos, sin = shard_cos_sin(rope, seq_len, cp_size, r, layout)
        assert torch.equal(cos, full_cos[ids]) and torch.equal(sin, full_sin[ids])  # bitwise
        local = rope.rotate(shard(x, 2, cp_size, r, layout), ids, seq_len=seq_len)
        assert torch.equal(local, shard(full, 2, cp_size, r, layout))
    if rope.scaling.depends_on_length and layout == "contiguous":  # the trap: a shard's own max + 1
        ids = shard_positions(seq_len, cp_size, 0, layout)
        assert not torch.equal(rope.cos_sin(ids)[0], full_cos[ids])


def test_mrope_on_a_shard_equals_the_shard_of_full_mrope(gen):
    rope = posenc.Rope(head_dim=16, mrope_section=(2, 3, 3))
    seq_len, cp_size = 24, 2
    ids = torch.randint(0, 40, (3, 2, seq_len), generator=gen)  # [3, b, S] temporal/height/width
    cos, sin = rope.cos_sin(ids)  # [b, S, r/2]
    x = torch.randn(2, 4, seq_len, 16, generator=gen)
    full = rope.rotate(x, ids)
    for r in range(cp_size):
        local_ids = shard(ids, 2, cp_size, r)  # [3, b, S/W]
        local_cos, local_sin = rope.cos_sin(local_ids)
        assert torch.equal(local_cos, shard(cos, 1, cp_size, r)) and torch.equal(local_sin, shard(sin, 1, cp_size, r))
        assert torch.equal(rope.rotate(shard(x, 2, cp_size, r), local_ids), shard(full, 2, cp_size, r))


@pytest.mark.parametrize("scheme", [posenc.ALiBi(8), posenc.T5RelativeBias(8, bidirectional=False)], ids=["alibi", "t5"])
def test_block_bias_from_global_positions_and_head_slices(scheme):
    seq_len, cp_size = 32, 4
    full = scheme.bias(torch.arange(seq_len), torch.arange(seq_len))  # [h, S, S]
    for r in range(cp_size):
        for src in range(cp_size):  # the key block that arrived from rank `src`
            q_ids, k_ids = shard_positions(seq_len, cp_size, r), shard_positions(seq_len, cp_size, src)
            assert torch.equal(scheme.bias(q_ids, k_ids), full[:, q_ids][:, :, k_ids])
        heads = head_slice(8, cp_size, r)
        part = HeadSlice(scheme, heads)
        assert part.heads == 2
        assert torch.equal(part.bias(torch.arange(seq_len), torch.arange(seq_len)), full[heads])
        score_mod = part.score_mod(torch.arange(seq_len), torch.arange(seq_len))
        q_idx, kv_idx = torch.tensor(5), torch.tensor(3)
        for h in range(2):  # local head h reads global head heads.start + h
            got = score_mod(torch.tensor(0.0), torch.tensor(0), torch.tensor(h), q_idx, kv_idx)
            assert_close(got, full[heads.start + h, 5, 3].float())
    if isinstance(scheme, posenc.ALiBi):  # the tensor-parallel ALiBi of the same rank agrees
        assert torch.equal(posenc.ALiBi(8, rank=1, world_size=4).slopes, scheme.slopes[head_slice(8, 4, 1)])


def test_posenc_import_stays_light():
    import subprocess
    import sys

    code = "import sys, posenc; print(any(m.startswith('posenc.distributed') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


@pytest.fixture
def single_rank_group():
    """A 1-rank gloo group in this process (destroyed after), for the paths that need a group."""
    import torch.distributed as dist

    from posenc.distributed.testing import free_port

    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("gloo unavailable or a process group already exists")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("encoding", [None, posenc.Rope(head_dim=8), posenc.ALiBi(6)], ids=["none", "rope", "alibi"])
def test_one_rank_ring_and_ulysses_equal_attention(single_rank_group, encoding, gen):
    from posenc.attention import attention
    from posenc.distributed import ring_attention, ulysses_attention

    q = torch.randn(2, 6, 7, 8, generator=gen, dtype=torch.float64)  # odd length, GQA 3
    k, v = (torch.randn(2, 2, 7, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    positions = torch.tensor([3, 4, 5, 9, 10, 11, 12])  # a cache-like gap
    key_mask = torch.rand(2, 7, generator=gen) > 0.3
    kwargs = dict(q_positions=positions, k_positions=positions, encoding=encoding, key_mask=key_mask, window=4)
    expected = attention(q, k, v, **kwargs)
    assert_close(ring_attention(q, k, v, **kwargs), expected)
    assert_close(ulysses_attention(q, k, v, **kwargs), expected)


def test_ring_argument_errors(single_rank_group):
    from posenc.distributed import ring_attention

    q = torch.randn(1, 2, 4, 8)
    ids = torch.arange(4)
    with pytest.raises(PosencError, match=r"^impl: expected 'eager' \(the reference ring"):
        ring_attention(q, q, q, q_positions=ids, k_positions=ids, impl="sdpa")
    with pytest.raises(PosencError, match=r"^k_documents: expected document ids for both q and k, got None$"):
        ring_attention(q, q, q, q_positions=ids, k_positions=ids, q_documents=ids)
    with pytest.raises(PosencError, match=r"^k: expected shape \[b=1, hk, tk, d=8\]"):
        ring_attention(q, q[..., :4], q, q_positions=ids, k_positions=ids)


def test_ring_without_a_process_group_says_so():
    import torch.distributed as dist

    from posenc.distributed import ring_attention

    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(PosencError, match=r"^group: expected an initialised torch.distributed process group"):
        ring_attention(q, q, q, q_positions=torch.arange(4), k_positions=torch.arange(4))
