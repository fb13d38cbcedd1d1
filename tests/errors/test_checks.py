"""The one validation layer: posenc.errors' checks, the error's fields, and the path prefix."""

import math

import numpy as np
import pytest
import torch

from posenc import PosencError
from posenc.errors import boolean, choice, fail, integer, positions, prefix, real


@pytest.mark.parametrize("value", [3, np.int64(3), np.int32(3), np.uint8(3), np.int8(3)])
def test_integer_accepts_every_integral(value):
    out = integer("n", value, min=1)
    assert out == 3 and type(out) is int


@pytest.mark.parametrize("value,shown", [(True, "True"), (3.0, "3.0"), ("3", "'3'"), (None, "None"),
                                         (torch.tensor(3), "tensor of shape () and dtype torch.int64"),
                                         (np.float64(3.0), "np.float64(3.0)")])
def test_integer_refuses_non_integers(value, shown):
    with pytest.raises(PosencError, match=r"^n: expected a positive integer, got ") as info:
        integer("n", value, min=1)
    assert str(info.value) == f"n: expected a positive integer, got {shown}"
    assert (info.value.arg, info.value.expected, info.value.got) == ("n", "a positive integer", shown)


@pytest.mark.parametrize("kwargs,value,expected", [
    ({"min": 0}, -1, "an integer >= 0"),
    ({"min": 2, "max": 8}, 9, "an integer in [2, 8]"),
    ({"max": 8}, 9, "an integer <= 8"),
    ({"min": 1, "what": "a head count"}, 0, "a head count"),
])
def test_integer_bounds(kwargs, value, expected):
    with pytest.raises(PosencError, match="^n: expected ") as info:
        integer("n", value, **kwargs)
    assert str(info.value) == f"n: expected {expected}, got {value}"
    integer("n", kwargs.get("min", kwargs.get("max", 0)), **kwargs)  # the bound itself is accepted


@pytest.mark.parametrize("value", [2, 2.5, np.float32(2.5), np.int64(2), np.float64(2.5)])
def test_real_accepts_numbers(value):
    out = real("factor", value, gt=0)
    assert out == float(value) and type(out) is float


@pytest.mark.parametrize("kwargs,value,message", [
    ({"gt": 0}, 0.0, "factor: expected a finite number > 0, got 0.0"),
    ({"ge": 0}, -1, "factor: expected a finite number >= 0, got -1"),
    ({"gt": 0, "le": 1}, 1.5, "factor: expected a finite number in (0, 1], got 1.5"),
    ({"ge": 0, "lt": 1}, 1, "factor: expected a finite number in [0, 1), got 1"),
    ({"gt": 0}, math.inf, "factor: expected a finite number > 0, got inf"),
    ({"gt": 0, "finite": False}, math.nan, "factor: expected a number > 0, got nan"),
    ({}, math.nan, "factor: expected a finite number, got nan"),
    ({"gt": 0.5}, 0.5, "factor: expected a finite number > 0.5, got 0.5"),
    ({}, True, "factor: expected a real number, got True"),
    ({}, "2", "factor: expected a real number, got '2'"),
])
def test_real_refuses(kwargs, value, message):
    with pytest.raises(PosencError, match="^factor: expected ") as info:
        real("factor", value, **kwargs)
    assert str(info.value) == message


def test_real_infinite_allowed_when_asked():
    assert real("factor", math.inf, gt=0, finite=False) == math.inf


def test_boolean_and_choice():
    assert boolean("flag", np.bool_(True)) is True and boolean("flag", False) is False
    for bad in (1, 0, "yes", None):
        with pytest.raises(PosencError, match=r"^flag: expected True or False, got "):
            boolean("flag", bad)
    assert choice("impl", "sdpa", ("eager", "sdpa")) == "sdpa"
    for bad in ("SDPA", 1, None, torch.tensor(1)):
        with pytest.raises(PosencError, match=r"^impl: expected one of \('eager', 'sdpa'\), got "):
            choice("impl", bad, ("eager", "sdpa"))
    with pytest.raises(PosencError, match=r"^n: expected one of \(1, 2\), got True$"):
        choice("n", True, (1, 2))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.int8, torch.int16,
                                   torch.int32, torch.int64])
def test_positions_every_integer_dtype(dtype):
    x = torch.tensor([0, 3, 7]).to(dtype)
    out = positions("position_ids", x)
    assert out.dtype.is_signed and torch.equal(out.long(), torch.tensor([0, 3, 7]))


def test_positions_wrapped_uint64_is_negative():
    x = torch.tensor([0, -5]).to(torch.uint64)  # 2**64 - 5 does not fit in int64: it wraps to -5
    with pytest.raises(PosencError, match=r"^position_ids: expected positions >= 0, got min -5$"):
        positions("position_ids", x)


@pytest.mark.parametrize("x,message", [
    ([0, 1], "position_ids: expected an integer torch.Tensor, got list"),
    (torch.tensor([0.0]), "position_ids: expected an integer dtype (int32 or int64) of logical positions, "
                          "got tensor of shape (1,) and dtype torch.float32"),
    (torch.tensor([True]), "position_ids: expected an integer dtype (int32 or int64) of logical positions, "
                           "got tensor of shape (1,) and dtype torch.bool"),
    (torch.tensor([[0, 1, 2]]), "position_ids: expected shape [4] or [b, 4], got tensor of shape (1, 3) and dtype torch.int64"),
    (torch.tensor([0, -2, 1, 1]), "position_ids: expected positions >= 0, got min -2"),
])
def test_positions_refuses(x, message):
    with pytest.raises(PosencError, match="^position_ids: expected ") as info:
        positions("position_ids", x, shapes=[(4,), ("b", 4)])
    assert str(info.value) == message


def test_positions_skips_value_check_when_asked():
    x = torch.tensor([0, -2])
    assert positions("p", x, check_values=False) is x
    assert positions("p", x, allow_negative=True) is x


def test_positions_device():
    x = torch.tensor([0, 1])
    assert positions("p", x, device=torch.device("cpu")) is x
    with pytest.raises(PosencError, match=r"^p: expected a tensor on meta .*got one on cpu$"):
        positions("p", x, device=torch.device("meta"))


def test_prefix_places_the_argument_under_the_path():
    with pytest.raises(PosencError, match=r"^config\['rope_scaling'\]\['beta_fast'\]: expected a finite") as info:
        with prefix("config['rope_scaling']"):
            real("beta_fast", -1.0, gt=0)
    e = info.value
    assert e.arg == "config['rope_scaling']['beta_fast']" and e.expected == "a finite number > 0" and e.got == "-1.0"
    assert e.__cause__ is None and isinstance(e, ValueError)


def test_prefix_indexed_renamed_nested_and_free():
    with pytest.raises(PosencError, match=r"^config\['rope_scaling'\]\['short_factor'\]\[1\]: expected x, got 0$"):
        with prefix("config['rope_scaling']"):
            fail("short_factor[1]", "x", 0)
    with pytest.raises(PosencError, match=r"^cfg\['original_max_position_embeddings'\]: expected x, got 0$"):
        with prefix("cfg", rename={"max_position_embeddings": "original_max_position_embeddings"}):
            fail("max_position_embeddings", "x", 0)
    with pytest.raises(PosencError, match=r"^config\['rope_theta'\]: expected x, got 0$"):  # already placed: kept
        with prefix("config"):
            with prefix("config"):
                fail("config['rope_theta']", "x", 0)
    with pytest.raises(PosencError, match=r"^config: something odd$") as info:
        with prefix("config"):
            raise PosencError("something odd")
    assert info.value.arg == "config"


def test_prefix_lets_other_errors_and_success_through():
    with prefix("config"):
        assert integer("n", 2) == 2
    with pytest.raises(KeyError, match="k"):
        with prefix("config"):
            raise KeyError("k")


def test_rename_reports_the_callers_argument():
    from posenc.errors import rename

    with pytest.raises(PosencError, match=r"^position_ids: expected x, got 1$") as info:
        with rename({"positions": "position_ids"}):
            fail("positions", "x", 1)
    assert info.value.arg == "position_ids"
    with pytest.raises(PosencError, match=r"^mask: expected x, got 1$"):
        with rename({"positions": "position_ids"}):
            fail("mask", "x", 1)


def test_integer_tensor():
    from posenc.errors import integer_tensor

    assert integer_tensor("n", torch.tensor([1, 2]).to(torch.uint32)).dtype == torch.int64
    for bad in (torch.tensor([1.0]), torch.tensor([True]), [1], None):
        with pytest.raises(PosencError, match=r"^n: expected an integer torch\.Tensor, got "):
            integer_tensor("n", bad)
    with pytest.raises(PosencError, match=r"^n: expected an integer torch\.Tensor of rank 0 or 1, got tensor of shape \(1, 1\)"):
        integer_tensor("n", torch.tensor([[1]]), ndim=(0, 1))
