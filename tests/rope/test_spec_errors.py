"""Every bad input raises PosencError naming the argument, what was expected and what arrived."""

import math

import pytest
import torch

from posenc import PosencError, Rope, apply_rope
from posenc.rope.scaling import DynamicNTK, Linear, Llama3, LongRoPE, NTKAware, YaRN

Q = torch.zeros(2, 4, 5, 8)
K = torch.zeros(2, 2, 5, 8)
POS = torch.arange(5)
COS = torch.ones(5, 4)
ROPE = Rope(head_dim=8)

# (id, thunk, regex): the regex names the argument and shows what arrived
CASES = [
    # --- theta / base
    ("base-nan", lambda: Rope(head_dim=8, base=math.nan), r"^base: expected a finite number > 0.*got nan$"),
    ("base-inf", lambda: Rope(head_dim=8, base=math.inf), r"^base: expected a finite number > 0.*got inf$"),
    ("base-zero", lambda: Rope(head_dim=8, base=0.0), r"^base: expected a finite number > 0.*got 0\.0$"),
    ("base-negative", lambda: Rope(head_dim=8, base=-1e4), r"^base: expected .*> 0.*got -10000\.0$"),
    ("base-one", lambda: Rope(head_dim=8, base=1.0), r"^base: expected .*!= 1.*got 1\.0$"),
    ("base-str", lambda: Rope(head_dim=8, base="1e4"), r"^base: expected a finite number.*got '1e4'$"),
    ("base-bool", lambda: Rope(head_dim=8, base=True), r"^base: expected a finite number.*got True$"),
    # --- factors
    ("linear-nan", lambda: Linear(math.nan), r"^factor: expected a finite number > 0, got nan$"),
    ("linear-zero", lambda: Linear(0.0), r"^factor: expected a finite number > 0, got 0\.0$"),
    ("ntk-negative", lambda: NTKAware(-2.0), r"^factor: expected a finite number > 0, got -2\.0$"),
    ("dynamic-inf", lambda: DynamicNTK(math.inf, 2048), r"^factor: expected a finite number > 0, got inf$"),
    ("dynamic-length", lambda: DynamicNTK(2.0, 0), r"^max_position_embeddings: expected a positive integer.*got 0$"),
    ("yarn-factor", lambda: YaRN(-4.0, 4096), r"^factor: expected a finite number > 0, got -4\.0$"),
    ("yarn-length", lambda: YaRN(4.0, 4096.5), r"^original_max_position_embeddings: expected .*got 4096\.5$"),
    ("llama3-factor", lambda: Llama3(math.nan, 1.0, 4.0, 8192), r"^factor: expected a finite number > 0, got nan$"),
    ("factor-none", lambda: Linear(None), r"^factor: expected a real number, got None$"),
    ("factor-str", lambda: Linear("2"), r"^factor: expected a real number, got '2'$"),
    # --- YaRN parameters
    ("beta-order", lambda: YaRN(4.0, 4096, beta_fast=1.0, beta_slow=32.0),
     r"^beta_fast: expected a value greater than beta_slow=32\.0, got 1\.0$"),
    ("beta-equal", lambda: YaRN(4.0, 4096, beta_fast=2.0, beta_slow=2.0), r"^beta_fast: expected .*beta_slow=2\.0, got 2\.0$"),
    ("beta-zero", lambda: YaRN(4.0, 4096, beta_slow=0.0), r"^beta_slow: expected a finite number > 0, got 0\.0$"),
    ("mscale-negative", lambda: YaRN(4.0, 4096, mscale=-1.0), r"^mscale: expected a finite number >= 0, got -1\.0$"),
    ("attention-factor", lambda: YaRN(4.0, 4096, attention_factor=0.0), r"^attention_factor: expected .*> 0, got 0\.0$"),
    ("truncate", lambda: YaRN(4.0, 4096, truncate="no"), r"^truncate: expected True or False, got 'no'$"),
    # --- Llama-3 bands
    ("llama3-bands", lambda: Llama3(8.0, 5.0, 4.0, 8192),
     r"^low_freq_factor: expected a value not above high_freq_factor=4\.0, got 5\.0$"),
    ("llama3-bands-reversed", lambda: Llama3(8.0, 4.0, 1.0, 8192), r"^low_freq_factor: expected .*=1\.0, got 4\.0$"),
    # --- LongRoPE lists
    ("longrope-lengths", lambda: LongRoPE((1.0,) * 4, (1.0,) * 3, 4096),
     r"^long_factor: expected 4 values \(as many as short_factor\), got 3$"),
    ("longrope-width", lambda: Rope(head_dim=8, scaling=LongRoPE((1.0,) * 3, (1.0,) * 3, 4096)),
     r"^short_factor: expected 4 values \(rotary_dim / 2\), got 3$"),
    ("longrope-entry", lambda: LongRoPE((1.0, 0.0), (1.0, 1.0), 4096), r"^short_factor\[1\]: expected .*> 0, got 0\.0$"),
    ("longrope-not-list", lambda: LongRoPE(2.0, (1.0,), 4096), r"^short_factor: expected a list of positive numbers, got 2\.0$"),
    # --- widths
    ("head-dim-odd", lambda: Rope(head_dim=7), r"^head_dim: expected an even number .*got 7$"),
    ("rotary-odd", lambda: Rope(head_dim=8, rotary_dim=5), r"^rotary_dim: expected an even number .*got 5$"),
    ("rotary-wide", lambda: Rope(head_dim=8, rotary_dim=10), r"^rotary_dim: expected an integer in \[2, head_dim=8\], got 10$"),
    ("head-dim-zero", lambda: Rope(head_dim=0), r"^head_dim: expected a positive integer, got 0$"),
    ("head-dim-float", lambda: Rope(head_dim=8.0), r"^head_dim: expected a positive integer, got 8\.0$"),
    ("ntk-width", lambda: Rope(head_dim=2, scaling=NTKAware(2.0)), r"^rotary_dim: expected more than 2 .*got 2$"),
    ("pairing", lambda: Rope(head_dim=8, pairing="neox"), r"^pairing: expected one of .*got 'neox'$"),
    ("mrope-sum", lambda: Rope(head_dim=8, mrope_section=(1, 1, 1)),
     r"^mrope_section: expected sections summing to rotary_dim / 2 = 4, got \[1, 1, 1\]$"),
    ("softmax-scale", lambda: Rope(head_dim=8, softmax_scale_factor="x"), r"^softmax_scale_factor: expected a real number, got 'x'$"),
    ("scaling", lambda: Rope(head_dim=8, scaling="yarn"), r"^scaling: expected a scaling rule .*got 'yarn'$"),
    # --- q / k
    ("q-int", lambda: ROPE.apply(Q.long(), K, POS), r"^q: expected a floating-point dtype.*got tensor of shape \(2, 4, 5, 8\) and dtype torch\.int64$"),
    ("k-int", lambda: ROPE.apply(Q, K.int(), POS), r"^k: expected a floating-point dtype.*dtype torch\.int32$"),
    ("q-not-tensor", lambda: ROPE.apply([[0.0]], K, POS), r"^q: expected a floating-point torch\.Tensor, got list$"),
    ("q-rank", lambda: ROPE.apply(Q[0], K, POS), r"^q: expected a tensor of rank 4, got tensor of shape \(4, 5, 8\)"),
    ("q-head-dim", lambda: ROPE.apply(torch.zeros(2, 4, 5, 6), K, POS), r"^q: expected last dim = head_dim = 8, got tensor of shape \(2, 4, 5, 6\)"),
    ("k-tokens", lambda: ROPE.apply(Q, torch.zeros(2, 2, 4, 8), POS), r"^k: expected size 5 in dim 2 .*got tensor of shape \(2, 2, 4, 8\)"),
    ("k-batch", lambda: ROPE.apply(Q, torch.zeros(3, 2, 5, 8), POS), r"^k: expected size 2 in dim 0 .*got tensor of shape \(3, 2, 5, 8\)"),
    ("layout", lambda: ROPE.apply(Q, K, POS, layout="bsnd"), r"^layout: expected one of \('bhtd', 'bthd', 'thd'\), got 'bsnd'$"),
    # --- positions
    ("pos-float", lambda: ROPE.apply(Q, K, POS.float()), r"^position_ids: expected an integer dtype.*dtype torch\.float32$"),
    ("pos-bool", lambda: ROPE.apply(Q, K, POS > 2), r"^position_ids: expected an integer dtype.*dtype torch\.bool$"),
    ("pos-list", lambda: ROPE.apply(Q, K, [0, 1, 2, 3, 4]), r"^position_ids: expected an integer torch\.Tensor, got list$"),
    ("pos-length", lambda: ROPE.apply(Q, K, torch.arange(4)), r"^position_ids: expected last dim = 5 tokens \(as q\), got tensor of shape \(4,\)"),
    ("pos-batch", lambda: ROPE.apply(Q, K, torch.zeros(3, 5, dtype=torch.int64)),
     r"^position_ids: expected batch size 1 or 2 \(as q\), got tensor of shape \(3, 5\)"),
    ("pos-3d-no-mrope", lambda: ROPE.apply(Q, K, torch.zeros(3, 2, 5, dtype=torch.int64)),
     r"^position_ids: expected \[t\] or \[b, t\] \(this Rope has no mrope_section\), got tensor of shape \(3, 2, 5\)"),
    ("pos-scalar", lambda: ROPE.cos_sin(torch.tensor(3)), r"^position_ids: expected shape \[t\], \[b, t\] or \[3, b, t\], got tensor of shape \(\)"),
    ("pos-negative", lambda: ROPE.apply(Q, K, torch.tensor([0, 1, -1, 2, 3])), r"^position_ids: expected positions >= 0 .*got min -1$"),
    ("pos-thd-batched", lambda: ROPE.rotate(Q[0].transpose(0, 1), POS[None], layout="thd"),
     r"^position_ids: expected shape \[t\] for the packed 'thd' layout, got tensor of shape \(1, 5\)"),
    ("precision", lambda: ROPE.cos_sin(POS, precision="float64"), r"^precision: expected one of \('float32', 'exact'\), got 'float64'$"),
    ("exact-too-far", lambda: ROPE.cos_sin(torch.tensor([2**30]), precision="exact"), r"^position_ids: expected \|position\| < 2\*\*29.*got 1073741824$"),
    ("seq-len", lambda: ROPE.cos_sin(POS, seq_len=-1), r"^seq_len: expected a non-negative integer, got -1$"),
    # --- functional apply_rope
    ("x-int", lambda: apply_rope(Q.long(), COS, COS), r"^x: expected a floating-point dtype.*dtype torch\.int64$"),
    ("cos-int", lambda: apply_rope(Q, COS.long(), COS), r"^cos: expected a floating-point dtype.*dtype torch\.int64$"),
    ("sin-shape", lambda: apply_rope(Q, COS, torch.ones(5, 3)), r"^sin: expected the shape of cos \(5, 4\), got tensor of shape \(5, 3\)"),
    ("cos-wide", lambda: apply_rope(Q, torch.ones(5, 5), torch.ones(5, 5)), r"^cos: expected at most d/2 = 4 columns.*got tensor of shape \(5, 5\)"),
    ("cos-rows", lambda: apply_rope(Q, torch.ones(4, 4), torch.ones(4, 4)), r"^cos: expected 5 rows \(one per token of x\) or 1, got tensor of shape \(4, 4\)"),
    ("cos-batch", lambda: apply_rope(Q, torch.ones(3, 5, 4), torch.ones(3, 5, 4)), r"^cos: expected batch size 1 or 2 \(as x\), got tensor of shape \(3, 5, 4\)"),
    ("cos-rank", lambda: apply_rope(Q, torch.ones(4), torch.ones(4)), r"^cos: expected a per-pair table \[t, r/2\] or \[b, t, r/2\], got tensor of shape \(4,\)"),
    ("cos-batched-packed", lambda: apply_rope(Q[0].transpose(0, 1), torch.ones(1, 5, 4), torch.ones(1, 5, 4), layout="thd"),
     r"^cos: expected a per-pair table \[t, r/2\] \(layout 'thd'\), got tensor of shape \(1, 5, 4\)"),
    ("x-rank", lambda: apply_rope(Q[0], COS, COS), r"^x: expected a tensor of rank 4, got tensor of shape \(4, 5, 8\)"),
    ("interleaved", lambda: apply_rope(Q, COS, COS, interleaved=1), r"^interleaved: expected a bool, got 1$"),
    ("apply-pairing", lambda: apply_rope(Q, COS, COS, pairing="gptj"), r"^pairing: expected one of .*got 'gptj'$"),
    ("apply-layout", lambda: apply_rope(Q, COS, COS, layout="sbhd"), r"^layout: expected one of .*got 'sbhd'$"),
]


@pytest.mark.parametrize("thunk,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises_posenc_error(thunk, pattern):
    with pytest.raises(PosencError, match=pattern):
        thunk()


def test_posenc_error_is_a_value_error():
    with pytest.raises(ValueError, match=r"^head_dim: expected .*, got 7$") as info:
        Rope(head_dim=7)
    assert isinstance(info.value, PosencError)


def test_negative_positions_allowed_on_request():
    q2, _ = ROPE.apply(Q + 1, K, torch.tensor([0, -1, -2, 3, 4]), allow_negative=True)
    assert torch.isfinite(q2).all()
    # rotating by -p is the inverse of rotating by p
    x = torch.randn(1, 1, 5, 8, generator=torch.Generator().manual_seed(0))
    back = ROPE.rotate(ROPE.rotate(x, POS), -POS, allow_negative=True)
    torch.testing.assert_close(back, x, atol=1e-6, rtol=0)  # two float32 rotations of |x| < 4: ~4 ulp


def test_validation_survives_python_O():
    # user-input checks are not asserts: they must hold under `python -O` too
    import subprocess
    import sys

    code = "import posenc\ntry:\n    posenc.Rope(head_dim=7)\nexcept posenc.PosencError:\n    print('ok')\n"
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize("bad", [torch.int32, "bfloat16", 16])
def test_compute_dtype_must_be_a_float_dtype(bad):
    rope = Rope(head_dim=8)
    q = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(PosencError, match=r"compute_dtype: expected None or a floating-point torch.dtype, got"):
        rope.apply(q, q, torch.arange(3), compute_dtype=bad)
