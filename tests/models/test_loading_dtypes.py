"""`Decoder.from_pretrained` refuses dtypes the decoder cannot run."""

import pytest
import torch

from posenc import PosencError
from posenc.models import Decoder


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])


def test_from_pretrained_refuses_dtypes_the_decoder_cannot_run(tmp_path, dtype):
    with pytest.raises(PosencError, match=r"dtype: expected a floating-point torch.dtype the decoder computes in "
                                          r"\(float32, float64, bfloat16 or float16\)"):
        Decoder.from_pretrained(tmp_path, dtype=dtype)
