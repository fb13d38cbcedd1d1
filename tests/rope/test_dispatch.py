"""`posenc.rope.dispatch`: the implementation is chosen once, with one question to the C kernel (`cpu.entry`),
and then one kernel call runs; a named implementation that cannot run is refused by name."""

import pytest
import torch

from posenc import PosencError, Rope
from posenc.kernels import angles, cpu
from posenc.rope import dispatch

pytestmark = pytest.mark.skipif(not cpu.available(), reason="no C compiler for the cpu kernel")


@pytest.fixture
def calls(monkeypatch):
    """Every function of `posenc.kernels.cpu` and `posenc.kernels.angles` wrapped to count its calls (by name;
    angles' as `angles.NAME`)."""
    counted = {}
    for module, prefix in ((cpu, ""), (angles, "angles.")):
        for name in module.__all__:
            fn = getattr(module, name)
            if callable(fn) and not isinstance(fn, type):
                def counting(*args, _fn=fn, _name=prefix + name, **kwargs):
                    counted[_name] = counted.get(_name, 0) + 1
                    return _fn(*args, **kwargs)

                monkeypatch.setattr(module, name, counting)
    return counted


@pytest.mark.parametrize("case", ["table", "no-table", "no-table-batch", "no-table-int32"])
@pytest.mark.parametrize("inplace", [True, False], ids=["apply_", "apply"])
def test_one_question_and_one_kernel_call_per_rotation(calls, case, inplace):
    rope = Rope(head_dim=64)
    q, k, pos = torch.randn(2, 4, 3, 64), torch.randn(2, 2, 3, 64), torch.tensor([7, 8, 9])
    if case == "no-table-batch":  # [b, t] positions
        pos = torch.stack((pos, pos + 5))
    if case == "no-table-int32":  # int32 positions: the general path (dispatch.rotate, then cpu.rope)
        pos = pos.int()
    table = rope.table(16) if case == "table" else None
    expected = rope.apply(q, k, pos, impl="reference")
    c_angles = angles.entry() is not None
    calls.clear()
    got = (rope.apply_ if inplace else rope.apply)(q, k, pos, table=table)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    # a held table: rotate_held packs the struct itself (pack_args is the packer, not a question); no table:
    # one question (whether the C angles run here), one pack of the kernel's and the angles' arguments
    if case == "no-table-int32":
        assert calls == {"entry": 1, "rope": 1}
    elif case == "table":
        assert calls == {"entry": 1, "pack_args": 1}
    elif not c_angles:  # torch's ops make the rows, then the kernel
        assert calls == {"angles.entry": 1, "entry": 1, "pack_args": 1}
    else:
        assert calls == {"angles.entry": 1, "angles.pack_fresh": 1}


def test_choose_decides_once_and_names_what_cannot_run():
    x = torch.randn(1, 1, 2, 64)
    name, run = dispatch.choose(None, x, None, 64)
    assert name == "cpu" and run is cpu.entry(torch.float32)
    assert dispatch.choose("reference", x, None, 64) == ("reference", None)
    assert dispatch.choose(None, x, torch.bfloat16, 64) == ("reference", None)  # another compute dtype
    wide = torch.randn(1, 1, 2, 4100)
    assert dispatch.choose(None, wide, None, 64) == ("reference", None)  # rows the kernel's buffers do not hold
    with pytest.raises(PosencError, match=r"impl: expected 'cpu' with rotary_dim <= 2048 and head_dim <= 4096"):
        dispatch.choose("cpu", wide, None, 64)
    with pytest.raises(PosencError, match=r"impl: expected None or one of"):
        dispatch.choose("fast", x, None, 64)
    with pytest.raises(PosencError, match=r"impl: expected 'reference' or 'compiled' for compute_dtype"):
        dispatch.choose("cpu", x, torch.bfloat16, 64)


def test_mixed_dtypes_choose_per_tensor():
    rope = Rope(head_dim=32)
    q, k, pos = torch.randn(1, 2, 3, 32), torch.randn(1, 2, 3, 32).to(torch.bfloat16), torch.tensor([1, 2, 3])
    got = rope.apply(q, k, pos)
    ref = rope.apply(q, k, pos, impl="reference")
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.bfloat16
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
