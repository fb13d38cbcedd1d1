"""The C kernel's worker pool and the decode hot path (`dispatch.rotate_held`), bit for bit against the reference.

The pool is started once and reused; each call takes at most `torch.get_num_threads()` threads, splits by
bytes from 128 KiB a thread, and must give the reference's bits whatever the thread count, after a change of
thread count, with concurrent callers and in a forked child. The hot path (`apply(_)` with a held table)
checks metadata only and must agree with the reference on every shape it takes, and hand everything else
(and every refusal) to the general path with nothing written.
"""

import inspect
import os
from pathlib import Path
import signal
import threading

import pytest
import torch
from tests.kernels.test_cpu import randn

from posenc import PosencError, Rope
from posenc.kernels import cpu
from posenc.rope import dispatch

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the cpu kernel")
hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies


@pytest.fixture
def threads():
    """Set torch's thread count inside a test; restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _case(dtype, seed=0):
    # GQA, odd sizes, pass-through channels, interleaved rows, bthd memory, a batch of positions: q 700 KiB and
    # k 140 KiB in float32, enough for 6 threads of 128 KiB
    rope = Rope(head_dim=72, rotary_dim=40, pairing="interleaved")
    q, k = randn(9, 7, 41, 72, dtype=dtype, seed=seed), randn(9, 7, 8, 72, dtype=dtype, seed=seed + 1)
    pos = torch.randint(0, 3000, (9, 7), generator=torch.Generator().manual_seed(seed))
    return rope, q, k, pos, rope.table(3000)


def _check(rope, q, k, pos, table, expected):
    got = rope.apply(q, k, pos, layout="bthd", table=table)
    qi, ki = q.clone(), k.clone()
    rope.apply_(qi, ki, pos, layout="bthd", table=table)
    for g in (got, (qi, ki)):
        assert torch.equal(g[0], expected[0]) and torch.equal(g[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pool_is_reused_across_calls_and_thread_counts(dtype, threads):
    rope, q, k, pos, table = _case(dtype)
    expected = rope.apply(q, k, pos, layout="bthd", impl="reference")
    threads(3)
    openmp = cpu.pool_openmp()  # parts on torch's OpenMP team: the library starts no threads of its own
    _check(rope, q, k, pos, table, expected)
    started = cpu.pool_workers()
    assert started == 0 if openmp else started >= 2  # else the caller and two workers (or more, from earlier)
    for _ in range(5):
        _check(rope, q, k, pos, table, expected)
    assert cpu.pool_workers() == started  # the same workers, not new threads per call
    for n in (7, 2, 1, 5, 3):  # more and fewer threads than the pool holds, in any order
        threads(n)
        _check(rope, q, k, pos, table, expected)
    assert cpu.pool_workers() == 0 if openmp else cpu.pool_workers() >= 5  # grown for 7 threads (6 of 128 KiB)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="no /proc here")
def test_openmp_parts_run_on_the_runtime_torch_loaded(threads):
    # one OpenMP runtime in the process: the library's libgomp.so.1 is torch's (a second pool would contend)
    if not cpu.pool_openmp():
        pytest.skip("the kernel was built without OpenMP: its own pthread pool runs the parts")
    rope, q, k, pos, table = _case(torch.float32)
    threads(2)
    _check(rope, q, k, pos, table, rope.apply(q, k, pos, layout="bthd", impl="reference"))
    runtimes = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if "libgomp" in line.split()[-1]}
    assert len(runtimes) == 1, runtimes


def test_decode_step_is_split_between_threads_bit_exact(threads):
    # a decode step (32 sequences x 32 heads of 128, one token each): 512 KiB of bfloat16, 1 MiB of float32,
    # now cut into 128 KiB parts; odd head counts and GQA beside it
    rope = Rope(head_dim=128)
    table = rope.table(4096)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        for hq, hk in ((32, 32), (31, 5)):
            q, k = randn(32, 1, hq, 128, dtype=dtype, seed=hq), randn(32, 1, hk, 128, dtype=dtype, seed=hk)
            pos = torch.randint(0, 4096, (32, 1), generator=torch.Generator().manual_seed(hq))
            expected = rope.apply(q, k, pos, layout="bthd", impl="reference")
            for n in (2, 3, 7):
                threads(n)
                _check(rope, q, k, pos, table, expected)


@pytest.mark.parametrize("held", [True, False], ids=["held", "no-table"])
def test_concurrent_callers_share_the_pool(threads, held):
    # ctypes releases the GIL: a caller that finds the pool busy runs on its own thread, with the same bits;
    # without a table the angles run on the pool too (sines and cosines apart, then the rotation)
    threads(3)
    errors = []

    def worker(seed):
        rope, q, k, pos, table = _case(torch.float32, seed)
        table = table if held else None
        expected = rope.apply(q, k, pos, layout="bthd", impl="reference")
        for _ in range(8):
            qi, ki = q.clone(), k.clone()
            rope.apply_(qi, ki, pos, layout="bthd", table=table)
            if not (torch.equal(qi, expected[0]) and torch.equal(ki, expected[1])):
                errors.append(seed)

    callers = [threading.Thread(target=worker, args=(s,)) for s in range(3)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert errors == []


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no fork here")
@pytest.mark.parametrize("held", [True, False], ids=["held", "no-table"])
def test_a_forked_child_starts_its_own_pool(threads, held):
    rope, q, k, pos, table = _case(torch.float32)
    table = table if held else None
    expected = rope.apply(q, k, pos, layout="bthd", impl="reference")
    threads(3)
    _check(rope, q, k, pos, table, expected)  # the parent's pool (or OpenMP's team) is running
    assert cpu.pool_openmp() or cpu.pool_workers() >= 2
    pid = os.fork()
    if pid == 0:  # the child: the parent's workers did not follow; a hang is killed by the alarm
        code = 1
        try:
            signal.alarm(60)
            inherited = cpu.pool_workers()  # 0: the parent's workers are not the child's
            torch.set_num_threads(1)  # torch's own OpenMP pool does not survive a fork: its ops run on one thread
            qi, ki = q.clone(), k.clone()
            torch.set_num_threads(3)  # the kernel's pool: three threads, two of them workers started in the child
            rope.apply_(qi, ki, pos, layout="bthd", table=table)
            workers = cpu.pool_workers()
            torch.set_num_threads(1)
            exact = torch.equal(qi, expected[0]) and torch.equal(ki, expected[1])
            # OpenMP is not fork-safe: in the child the parts run on the library's own pool
            code = 0 if exact and inherited == 0 and workers == 2 and not cpu.pool_openmp() else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    _check(rope, q, k, pos, table, expected)  # and the parent's pool still serves


def test_overlap_flag_refuses_meeting_ranges_and_writes_nothing():
    run = cpu.entry(torch.float32)
    table = Rope(head_dim=8).table(4)
    x = randn(1, 4, 2, 8)  # [b, h, t, d]
    rows = torch.tensor([1, 3])

    def call(q, k, flags):
        return run(cpu.pack_args(
            q.data_ptr(), q.data_ptr(), k.data_ptr(), k.data_ptr(), table.cos.data_ptr(), table.sin.data_ptr(),
            rows.data_ptr(), 1, q.shape[1], k.shape[1], 2, 8, *q.stride(), *q.stride(), *k.stride(), *k.stride(),
            4, 4, 0, cpu.DTYPES[torch.float32], cpu.PAIRING_CODES["split_half"], 1, flags))

    before = x.clone()
    for q, k in ((x[:, :3], x[:, 2:]), (x, x), (x[:, :1].expand(1, 3, 2, 8), x[:, 1:])):  # meeting ranges, broadcast
        assert call(q, k, cpu.FLAG_CHECK_OVERLAP) == cpu.OVERLAP
        assert torch.equal(x, before)
    assert call(x[:, :2], x[:, 2:], cpu.FLAG_CHECK_OVERLAP) == 0  # adjacent, disjoint: rotated
    expected = Rope(head_dim=8).apply(before[:, :2], before[:, 2:], rows, impl="reference")
    assert torch.equal(x[:, :2], expected[0]) and torch.equal(x[:, 2:], expected[1])


def test_hot_path_runs_without_the_general_router(monkeypatch):
    # with a held table these calls never reach dispatch.rotate; calls the hot path does not take do
    rope = Rope(head_dim=128)
    table = rope.table(4096)
    q, k = randn(32, 1, 32, 128, dtype=torch.bfloat16), randn(32, 1, 8, 128, dtype=torch.bfloat16, seed=1)
    cases = [torch.full((32, 1), 4095), torch.tensor([7]), torch.tensor([[9]])]  # [b, t], [t], [1, t]
    expected = [rope.apply(q, k, p, layout="bthd", impl="reference") for p in cases]
    expected_bhtd = rope.apply(q.transpose(1, 2), k.transpose(1, 2), cases[0], impl="reference")

    def general(*args, **kwargs):
        raise AssertionError("the general router ran")

    monkeypatch.setattr(dispatch, "rotate", general)
    for p, want in zip(cases, expected):
        got = rope.apply(q, k, p, layout="bthd", table=table)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        qi, ki = q.clone(), k.clone()
        assert rope.apply_(qi, ki, p, layout="bthd", table=table, impl="cpu")[0] is qi
        assert torch.equal(qi, want[0]) and torch.equal(ki, want[1])
    got = rope.apply(q.transpose(1, 2), k.transpose(1, 2), cases[0], table=table)  # bhtd views of bthd memory
    assert torch.equal(got[0], expected_bhtd[0]) and torch.equal(got[1], expected_bhtd[1])
    for call in (lambda: rope.apply(q[0], k[0], cases[1], layout="thd", table=table),  # packed layout
                 lambda: rope.apply_(q.clone(), k.clone(), cases[0], layout="bthd", table=table, impl="reference"),
                 lambda: rope.apply(q, k.float(), cases[0], layout="bthd", table=table),  # two dtypes
                 lambda: rope.apply(q, k, cases[0].int(), layout="bthd", table=table)):  # int32 positions
        with pytest.raises(AssertionError, match="general router"):
            call()


def test_a_table_holds_what_the_kernel_reads_of_it():
    # a CPU table holds its addresses, sizes and pairing code (a decode call reads no table metadata); a table
    # made by hand from strided rows holds contiguous copies (the kernel reads rows as they lie), and rotates
    # like the reference
    rope = Rope(head_dim=64, rotary_dim=48, pairing="interleaved")
    table = rope.table(100)
    assert table.held == (table.cos.data_ptr(), table.sin.data_ptr(), 100, 24, cpu.PAIRING_CODES["interleaved"])
    cos_t, sin_t = table.cos.t().contiguous().t(), table.sin.t().contiguous().t()  # column-major
    by_hand = type(table)(rope, cos_t, sin_t, None, "float32")
    assert by_hand.cos.is_contiguous() and torch.equal(by_hand.cos, table.cos) and torch.equal(by_hand.sin, table.sin)
    assert by_hand.held == (by_hand.cos.data_ptr(), by_hand.sin.data_ptr(), 100, 24, 1)
    q, k, pos = randn(2, 3, 5, 64), randn(2, 1, 5, 64, seed=1), torch.tensor([0, 7, 50, 98, 99])
    want = rope.apply(q, k, pos, impl="reference")
    for tb in (table, by_hand):
        for got in (rope.apply(q, k, pos, table=tb), rope.apply(q, k, pos, table=tb, impl="cpu")):  # held path
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        got = rope.apply(q[0].transpose(0, 1), k[0].transpose(0, 1), pos, table=tb, layout="thd")  # general path
        assert torch.equal(got[0], want[0][0].transpose(0, 1)) and torch.equal(got[1], want[1][0].transpose(0, 1))


def test_a_copied_or_pickled_table_holds_its_own_tensors():
    # held is made again for a copy: a deep copy or a pickle round trip must not read the original's memory
    # (freed here before the copy rotates)
    import copy
    import pickle

    rope = Rope(head_dim=16, pairing="interleaved")
    q, k, pos = randn(1, 2, 3, 16), randn(1, 1, 3, 16, seed=1), torch.tensor([1, 5, 30])
    want = rope.apply(q, k, pos, impl="reference")
    table = rope.table(32)
    copies = [copy.deepcopy(table), pickle.loads(pickle.dumps(table)), copy.copy(table)]
    for c in copies[:2]:
        assert c.held == (c.cos.data_ptr(), c.sin.data_ptr(), 32, 8, 1) and c.held[:2] != table.held[:2]
    assert copies[2].held == table.held and copies[2].cos is table.cos  # a shallow copy shares the tensors
    del table
    for c in copies:
        got = rope.apply(q, k, pos, table=c)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("inplace", [False, True])
def test_empty_batch_or_tokens_read_no_row(layout, inplace):
    # a batch of 0 rows with positions [0, t] (or [t]) has no row to read: the kernel read t of them from the
    # empty positions' memory (a segfault) before it looked at the batch
    rope = Rope(head_dim=64, pairing="interleaved")
    table = rope.table(100)
    empty = ((0, 3, torch.zeros(0, 3, dtype=torch.long)), (0, 3, torch.arange(3)), (2, 0, torch.zeros(2, 0, dtype=torch.long)))
    for b, t, pos in empty:
        shape_q, shape_k = ((b, 4, t, 64), (b, 2, t, 64)) if layout == "bhtd" else ((b, t, 4, 64), (b, t, 2, 64))
        q, k = torch.randn(shape_q), torch.randn(shape_k)
        for tb in (table, None):
            call = rope.apply_ if inplace else rope.apply
            got = call(q, k, pos, layout=layout, table=tb)
            assert got[0].shape == q.shape and got[1].shape == k.shape


@pytest.mark.parametrize("cos,sin,arg", [
    (torch.zeros(10, 24, dtype=torch.float64), torch.zeros(10, 24), "cos"),  # float64
    (torch.zeros(10, 32), torch.zeros(10, 32), "cos"),  # 32 columns for a rotary_dim of 48
    (torch.zeros(10, 24), torch.zeros(9, 24), "sin"),  # another shape
    (torch.zeros(10, 24), [[0.0] * 24] * 10, "sin"),  # not a tensor
    (torch.zeros(10, 2, 12), torch.zeros(10, 2, 12), "cos"),  # 3-d
    (torch.tensor(0.5), torch.tensor(0.5), "cos"),  # 0-d
    (torch.zeros(24), torch.zeros(24), "cos"),  # 1-d
])
def test_a_table_made_by_hand_is_checked(cos, sin, arg):
    rope = Rope(head_dim=64, rotary_dim=48)
    with pytest.raises(PosencError, match=f"^{arg}: expected a"):
        type(rope.table(2))(rope, cos, sin, None, "float32")


@st.composite
def held_cases(draw):
    layout = draw(st.sampled_from(["bhtd", "bthd"]))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
    pairing = draw(st.sampled_from(["split_half", "interleaved", "interleaved_to_split_half"]))
    head_dim = draw(st.sampled_from([8, 20, 64, 72, 128]))
    rotary = draw(st.sampled_from([r for r in (4, 8, 16, 20, 64, 128) if r <= head_dim]))
    b, hq, hk, t = (draw(st.integers(1, n)) for n in (4, 9, 9, 6))
    pos_shape = draw(st.sampled_from(["t", "1t", "bt"]))
    view = draw(st.sampled_from(["dense", "heads_slice", "channels_slice"]))
    inplace = draw(st.booleans())
    threads = draw(st.sampled_from([1, 2, 3]))
    seed = draw(st.integers(0, 2**16))
    return layout, dtype, pairing, head_dim, rotary, b, hq, hk, t, pos_shape, view, inplace, threads, seed


def _make(shape, view, layout, dtype, seed):
    """A tensor of `shape` (in `layout`), dense or a strided view into a larger buffer."""
    heads_axis = 1 if layout == "bhtd" else 2
    if view == "dense":
        return randn(*shape, dtype=dtype, seed=seed)
    big = list(shape)
    if view == "heads_slice":
        big[heads_axis] += 2
        return randn(*big, dtype=dtype, seed=seed).narrow(heads_axis, 1, shape[heads_axis])
    big[3] *= 2
    return randn(*big, dtype=dtype, seed=seed)[..., shape[3]:]


@hypothesis.settings(max_examples=80, deadline=None, derandomize=True)
@hypothesis.given(held_cases())
def test_held_table_path_equals_the_reference(case):
    layout, dtype, pairing, head_dim, rotary, b, hq, hk, t, pos_shape, view, inplace, n, seed = case
    if not cpu.available(dtype):
        return
    rope = Rope(head_dim=head_dim, rotary_dim=rotary, pairing=pairing)
    table = rope.table(50)
    shape = (lambda h: (b, h, t, head_dim)) if layout == "bhtd" else (lambda h: (b, t, h, head_dim))
    q, k = _make(shape(hq), view, layout, dtype, seed), _make(shape(hk), view, layout, dtype, seed + 1)
    gen = torch.Generator().manual_seed(seed)
    pos = {"t": lambda: torch.randint(0, 50, (t,), generator=gen), "1t": lambda: torch.randint(0, 50, (1, t), generator=gen),
           "bt": lambda: torch.randint(0, 50, (b, t), generator=gen)}[pos_shape]()
    expected = rope.apply(q, k, pos, layout=layout, impl="reference")
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        if inplace:
            got = rope.apply_(q, k, pos, layout=layout, table=table)
            assert got[0] is q and got[1] is k
        else:
            q0, k0 = q.clone(), k.clone()
            got = rope.apply(q, k, pos, layout=layout, table=table)
            assert torch.equal(q, q0) and torch.equal(k, k0)
    finally:
        torch.set_num_threads(before)
    assert got[0].dtype == dtype and got[0].shape == q.shape
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_hot_path_refusals_name_the_argument_and_write_nothing():
    rope = Rope(head_dim=64)
    table = rope.table(100)
    q, k = randn(3, 1, 4, 64), randn(3, 1, 2, 64, seed=1)  # bthd decode
    cases = [
        ((q, k, torch.tensor([[5], [100], [7]])), r"^position_ids: expected positions in \[0, 100\)"),
        ((q, k, torch.tensor([[5], [-1], [7]])), r"^position_ids: expected positions in \[0, 100\)"),
        ((q, q, torch.tensor([[5], [6], [7]])), "k: expected a tensor that shares no memory with q"),
        ((q, k, torch.tensor([5, 6])), "position_ids: expected last dim = 1 tokens"),
        ((q, k[:2], torch.tensor([5])), r"^k: expected size 3 in dim 0"),
        ((q, k.double(), torch.tensor([5])), None),  # k in another dtype: rotated, each by its own call
    ]
    for args, message in cases:
        qi, ki = args[0].clone(), args[1].clone() if args[1] is not args[0] else None
        ki = qi if ki is None else ki
        if message is None:
            got = rope.apply_(qi, ki, args[2], layout="bthd", table=table)
            exp = rope.apply(args[0], args[1], args[2], layout="bthd", impl="reference")
            assert torch.equal(got[0], exp[0]) and torch.equal(got[1], exp[1])
            continue
        q0, k0 = qi.clone(), ki.clone()
        with pytest.raises(PosencError, match=message):
            rope.apply_(qi, ki, args[2], layout="bthd", table=table)
        assert torch.equal(qi, q0) and torch.equal(ki, k0), message


@pytest.mark.parametrize("huge", ["0", "1"])
def test_held_table_allocating_large_outputs_bit_exact(huge, monkeypatch, threads):
    # >= 4 MiB fresh outputs: huge pages advised (unless POSENC_HUGE_PAGES=0) and streaming stores, on the hot path
    monkeypatch.setenv("POSENC_HUGE_PAGES", huge)
    rope = Rope(head_dim=128)
    table = rope.table(1100)
    q, k = randn(1, 1031, 8, 128), randn(1, 1031, 2, 128, seed=1)  # bthd, q 4.03 MiB
    pos = torch.arange(1031) + 60
    expected = rope.apply(q, k, pos, layout="bthd", impl="reference")
    for n in (1, 2):
        threads(n)
        got = rope.apply(q, k, pos, layout="bthd", table=table)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), n


def _refusal_cases():
    """`(name, call(rope, table, q, k, fn) -> None, message)`: every metadata refusal the hot path hands on."""
    pos = torch.tensor([5])
    return [
        # one head and one token: shapes that fit either 4-d layout, so that only the layout is wrong
        ("unknown layout", lambda r, tb, q, k, fn: fn(q[:, :1], k[:, :1], pos, layout="bhdt", table=tb),
         r"^layout: expected one of"),
        ("layout not a string", lambda r, tb, q, k, fn: fn(q[:, :1], k[:, :1], pos, layout=4, table=tb),
         r"^layout: expected one of"),
        ("integer q", lambda r, tb, q, k, fn: fn(q.to(torch.int32), k, pos, table=tb), r"^q: expected a floating-point"),
        ("3-d k", lambda r, tb, q, k, fn: fn(q, k[0], pos, table=tb), r"^k: expected a tensor of rank 4"),
        ("q of another head_dim", lambda r, tb, q, k, fn: fn(q[..., :32], k, pos, table=tb), r"^q: expected last dim = head_dim"),
        ("q and k wider than head_dim", lambda r, tb, q, k, fn: fn(torch.cat([q, q[..., :8]], -1), torch.cat([k, k[..., :8]], -1),
                                                                   pos, table=tb), r"^q: expected last dim = head_dim"),
        ("k of another batch", lambda r, tb, q, k, fn: fn(q, k[:2], pos, table=tb), r"^k: expected size 3 in dim 0"),
        ("k on another device", lambda r, tb, q, k, fn: fn(q, torch.empty(k.shape, device="meta"), pos, table=tb),
         r"^k: expected a tensor on the device of q"),
        ("float positions", lambda r, tb, q, k, fn: fn(q, k, pos.float(), table=tb), r"^position_ids: expected"),
        ("positions of another batch", lambda r, tb, q, k, fn: fn(q, k, torch.tensor([[5], [6]]), table=tb),
         r"^position_ids: expected batch size 1 or 3"),
        ("row past the table", lambda r, tb, q, k, fn: fn(q, k, torch.tensor([100]), table=tb),
         r"^position_ids: expected positions in \[0, 100\)"),
        ("negative row", lambda r, tb, q, k, fn: fn(q, k, torch.tensor([[1], [-3], [2]]), table=tb),
         r"^position_ids: expected positions in \[0, 100\)"),
        ("table of another Rope", lambda r, tb, q, k, fn: fn(q, k, pos, table=Rope(head_dim=64, base=500.0).table(100)),
         r"^table: expected a table made by this Rope"),
        ("other precision", lambda r, tb, q, k, fn: fn(q, k, pos, table=tb, precision="exact"), r"^precision: expected"),
        ("other seq_len", lambda r, tb, q, k, fn: fn(q, k, pos, table=tb, seq_len=50), r"^seq_len: expected"),
        ("impl that cannot", lambda r, tb, q, k, fn: fn(q, k, pos, table=tb, impl="triton"), r"^impl: expected"),
    ]


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("case", _refusal_cases(), ids=lambda c: c[0])
def test_held_table_refusals_name_the_argument_and_write_nothing(case, inplace, monkeypatch):
    # what the hot path does not take goes to the general path, which names the argument; inputs stay as they were
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # set by test_kernels_triton: triton would run on CPU
    _, call, message = case
    rope = Rope(head_dim=64)
    table = rope.table(100)
    q, k = randn(3, 4, 1, 64), randn(3, 2, 1, 64, seed=1)  # bhtd decode, GQA
    q0, k0 = q.clone(), k.clone()
    with pytest.raises(PosencError, match=message):
        call(rope, table, q, k, rope.apply_ if inplace else rope.apply)
    assert torch.equal(q, q0) and torch.equal(k, k0)


def test_held_table_in_place_refusals_name_the_argument():
    rope = Rope(head_dim=64)
    table = rope.table(100)
    pos = torch.tensor([5])
    x = randn(3, 6, 1, 64)
    leaf = randn(3, 4, 1, 64).requires_grad_()
    cases = [((leaf, randn(3, 2, 1, 64)), r"^q: expected a tensor autograd lets apply_ change"),
             ((x[:, :4], x[:, 2:]), r"^k: expected a tensor that shares no memory with q"),  # overlapping heads
             ((x[:, :1].expand(3, 4, 1, 64), x[:, 4:]), r"^q: expected a tensor whose elements are distinct memory")]  # broadcast
    before = x.clone()
    for (q, k), message in cases:
        with pytest.raises(PosencError, match=message):
            rope.apply_(q, k, pos, table=table)
    assert torch.equal(x, before)
    assert torch.equal(leaf, randn(3, 4, 1, 64))


@pytest.mark.parametrize("layout", ["bhtd", "bthd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hot_path_is_bit_identical_to_the_reference_on_odd_strided_shapes(layout, dtype, monkeypatch, threads):
    # odd sizes, GQA, q a channel slice and k a head slice of larger buffers, [b, t] positions; the hot path
    # (dispatch.rotate never runs) against impl="reference", allocating and in place, on 1 and 2 threads
    rope = Rope(head_dim=72, rotary_dim=40)
    table = rope.table(997)
    b, hq, hk, t = 3, 5, 3, 7
    big_q = (b, hq, t, 144) if layout == "bhtd" else (b, t, hq, 144)
    big_k = (b, hk + 2, t, 72) if layout == "bhtd" else (b, t, hk + 2, 72)
    q = randn(*big_q, dtype=dtype)[..., 72:]
    k = randn(*big_k, dtype=dtype, seed=1).narrow(1 if layout == "bhtd" else 2, 1, hk)
    pos = torch.randint(0, 997, (b, t), generator=torch.Generator().manual_seed(3))
    expected = rope.apply(q, k, pos, layout=layout, impl="reference")

    def general(*args, **kwargs):
        raise AssertionError("the general router ran")

    monkeypatch.setattr(dispatch, "rotate", general)
    for n in (1, 2):
        threads(n)
        got = rope.apply(q, k, pos, layout=layout, table=table)
        assert got[0].shape == q.shape and got[1].shape == k.shape
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        qi, ki = q.clone(), k.clone()
        rope.apply_(qi, ki, pos, layout=layout, table=table)
        assert torch.equal(qi, expected[0]) and torch.equal(ki, expected[1])


def test_apply_in_place_takes_the_keywords_of_apply():
    # apply_ names apply's options (keyword-only, same defaults) rather than taking **options
    allocating = list(inspect.signature(Rope.apply).parameters.values())
    in_place = list(inspect.signature(Rope.apply_).parameters.values())
    assert [(p.name, p.kind, p.default) for p in in_place] == [(p.name, p.kind, p.default) for p in allocating]
    rope = Rope(head_dim=8)
    with pytest.raises(TypeError):
        rope.apply_(randn(1, 1, 1, 8), randn(1, 1, 1, 8), torch.tensor([0]), "bhtd")  # options by keyword only
    with pytest.raises(TypeError):
        rope.apply_(randn(1, 1, 1, 8), randn(1, 1, 1, 8), torch.tensor([0]), layuot="bhtd")
