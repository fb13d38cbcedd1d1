"""`Rope.apply` / `apply_` / `cos_sin` without a table: the frequency ladder is kept with the value, the angles of
the asked positions are made in a few ops, and the results are bit-identical to the formula checkpoints use
(`float32(p) * inv_freq`, then float32 cos/sin, times the attention factor), to a held table and to transformers.

The op counts are the regression guard of the no-table path (issue 31): torch ops dispatched per call under
`TorchDispatchMode`, not a timing. A new op on this path fails here; raise a budget only for a reason.
"""

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from posenc import PosencError, Rope
from posenc.kernels import angles, cpu
from posenc.rope import tables
from posenc.rope.scaling import Linear, Llama3, YaRN

ROPES = {
    "default": Rope(head_dim=128),
    "yarn": Rope(head_dim=64, rotary_dim=48, scaling=YaRN(factor=4.0, original_max_positions=2048),
                 pairing="interleaved"),
    "llama3": Rope(head_dim=64, base=5e5, scaling=Llama3(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                        original_max_positions=8192)),
    "linear-backwards": Rope(head_dim=32, scaling=Linear(2.0), direction=-1, pairing="interleaved_to_split_half"),
}


class Ops(TorchDispatchMode):
    """Counts the torch ops dispatched inside it."""

    def __init__(self):
        super().__init__()
        self.count = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func)] += 1
        return func(*args, **(kwargs or {}))


def ops_of(fn):
    fn()  # the kernel library loads, lazy imports run
    with Ops() as mode:
        fn()
    return sum(mode.count.values()), dict(mode.count)


def checkpoint_cos_sin(rope, pos):
    """The formula as checkpoints (transformers' Llama rotary module) compute it, from Rope's public ladder."""
    inv, factor = rope.angle_freq()
    theta = pos.float()[..., None] * inv  # [..., r/2]
    return theta.cos() * factor, theta.sin() * factor


def randn(*shape, dtype=torch.float32, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("name", list(ROPES))
def test_cos_sin_is_the_checkpoint_formula_bit_for_bit_up_to_2_pow_53(name):
    rope = ROPES[name]
    g = torch.Generator().manual_seed(1)
    pos = torch.cat((torch.arange(0, 70), torch.randint(0, 2**53, (200,), generator=g), torch.tensor([2**53]),
                     torch.randint(2**20, 2**25, (199,), generator=g)))  # 470 positions
    for p in (pos, pos[5:6], pos.view(2, -1)):  # many positions, one (the decode form), a batch
        got, expected = rope.cos_sin(p), checkpoint_cos_sin(rope, p)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert got[0].dtype == torch.float32 and got[0].shape == (*p.shape, rope.rotary_dim // 2)
        same = tables.cos_sin(p, *rope.angle_freq())  # the module's own float32 formula
        assert torch.equal(got[0], same[0]) and torch.equal(got[1], same[1])


@pytest.mark.parametrize("name", list(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 7])
def test_apply_without_a_table_equals_a_held_table_and_the_reference(name, dtype, t):
    rope = ROPES[name]
    q, k = randn(3, 4, t, rope.head_dim, dtype=dtype), randn(3, 2, t, rope.head_dim, dtype=dtype, seed=1)
    one = torch.arange(4090, 4090 + t)
    for pos in (one, one[None], torch.stack((one, one - 7, one * 3))):  # [t], [1, t], [b, t]
        reference = rope.apply(q, k, pos, impl="reference")
        held = rope.apply(q, k, pos, table=rope.table(13000))
        fresh = rope.apply(q, k, pos)
        q_in, k_in = q.clone(), k.clone()
        rope.apply_(q_in, k_in, pos)
        for got in (held, fresh, (q_in, k_in)):
            assert torch.equal(got[0], reference[0]) and torch.equal(got[1], reference[1])


def test_transformers_rotation_is_reproduced_without_a_table():
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    rope = ROPES["default"]
    q, k = randn(2, 8, 1, 128), randn(2, 2, 1, 128, seed=1)
    pos = torch.tensor([[4095], [17]])
    cos, sin = checkpoint_cos_sin(rope, pos)  # [b, 1, 64]
    expected = llama.apply_rotary_pos_emb(q, k, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    for row in range(2):
        got = rope.apply(q[row:row + 1], k[row:row + 1], pos[row])
        assert torch.equal(got[0], expected[0][row:row + 1]) and torch.equal(got[1], expected[1][row:row + 1])


@pytest.mark.skipif(not cpu.available(), reason="no C compiler for the cpu kernel")
@pytest.mark.parametrize("c_angles", [True, False], ids=["c-angles", "torch-ops"])
def test_torch_ops_per_call_stay_within_budget(monkeypatch, c_angles):
    if c_angles and angles.entry() is None:
        pytest.skip("no C angles here (kernels.angles.entry() is None)")
    if not c_angles:  # the path where the C angles do not run (a torch without MKL): torch's three ops
        monkeypatch.setattr(angles, "entry", lambda: None)
    rope = Rope(head_dim=128)
    table = rope.table(4096)
    q, k, pos = randn(32, 32, 1, 128), randn(32, 8, 1, 128), torch.tensor([4095])
    q7, k7 = randn(1, 2, 7, 128), randn(1, 2, 7, 128)
    c = c_angles
    budgets = {  # (call, ops): the decode shapes of issue 31
        # C angles: the range check, angles and rotation in one foreign call, no op; else product, cos, sin
        "apply_ no table": (lambda p=torch.tensor([4095]): rope.apply_(q, k, p), 0 if c else 3),
        "apply_ no table, [b, 1] positions": (lambda p=torch.full((32, 1), 4095): rope.apply_(q, k, p), 0 if c else 3),
        "apply no table": (lambda p=torch.tensor([4095]): rope.apply(q, k, p), 2 if c else 5),  # and the 2 outputs
        "apply_ held table": (lambda: rope.apply_(q, k, pos, table=table), 0),
        "apply held table": (lambda: rope.apply(q, k, pos, table=table), 2),
        "cos_sin of 32 positions": (lambda p=torch.arange(4064, 4096): rope.cos_sin(p), 3 if c else 4),  # (C: 2 views)
        "cos_sin of 100 positions": (lambda p=torch.arange(100): rope.cos_sin(p), 3 if c else 8),  # torch: check 4
        "apply_ no table, 7 tokens": (lambda p=torch.arange(7): rope.apply_(q7, k7, p), 0 if c else 4),
    }
    over = {}
    for name, (fn, budget) in budgets.items():
        n, ops = ops_of(fn)
        if n > budget:
            over[name] = (n, budget, ops)
    assert not over, f"torch ops per call over budget: {over}"


def test_position_values_are_refused_by_name_with_nothing_written():
    rope = ROPES["default"]
    q, k = randn(1, 2, 1, 128), randn(1, 2, 1, 128, seed=1)
    for pos, text in ((torch.tensor([-1]), r"positions >= 0 \(pass allow_negative=True"),
                      (torch.tensor([2**53 + 1]), r"positions with \|p\| <= 2\*\*53"),
                      (torch.tensor([3, -4]), r"positions >= 0 \(pass allow_negative=True"),
                      (torch.tensor([3, -(2**53) - 1]), r"positions >= 0")):
        t = pos.shape[0]
        qt, kt = q.expand(1, 2, t, 128).clone(), k.expand(1, 2, t, 128).clone()
        before = qt.clone(), kt.clone()
        for call in (rope.apply, rope.apply_):
            with pytest.raises(PosencError, match=r"^position_ids: expected " + text):
                call(qt, kt, pos)
            assert torch.equal(qt, before[0]) and torch.equal(kt, before[1])
        with pytest.raises(PosencError, match=r"^position_ids: expected " + text):
            rope.cos_sin(pos)
    backwards = rope.apply(q, k, torch.tensor([-5]), allow_negative=True)
    expected = rope.apply(q, k, torch.tensor([-5]), allow_negative=True, impl="reference")
    assert torch.equal(backwards[0], expected[0]) and torch.equal(backwards[1], expected[1])
    with pytest.raises(PosencError, match=r"^position_ids: expected positions with \|p\| <= 2\*\*53"):
        rope.apply(q, k, torch.tensor([-(2**53) - 1]), allow_negative=True)


def test_the_ladder_is_made_on_the_cpu_under_a_meta_default_device():
    with torch.device("meta"):
        rope = Rope(head_dim=16, scaling=YaRN(factor=2.0, original_max_positions=64))
    plain = Rope(head_dim=16, scaling=YaRN(factor=2.0, original_max_positions=64))
    pos = torch.arange(5)
    got, expected = rope.cos_sin(pos), plain.cos_sin(pos)
    assert got[0].device.type == "cpu" and torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert rope == plain and hash(rope) == hash(plain) and repr(rope) == repr(plain)


def test_a_subclass_that_changes_cos_sin_is_honoured_without_a_table():
    class Shifted(Rope):  # as verify's fault injection does: its own tables
        def cos_sin(self, position_ids, **kwargs):
            return super().cos_sin(position_ids + 1, **kwargs)

    rope, shifted = Rope(head_dim=32), Shifted(head_dim=32)
    q, k = randn(1, 2, 1, 32), randn(1, 2, 1, 32, seed=1)
    got = shifted.apply(q, k, torch.tensor([4]))
    expected = rope.apply(q, k, torch.tensor([5]))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
