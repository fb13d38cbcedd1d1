"""Scaling rules: float64 closed forms written here, transformers' ROPE_INIT_FUNCTIONS element-wise, worked numbers."""

import math
import warnings

import pytest
import torch
from tests.helpers.tolerances import assert_close

from posenc import PosencError, Rope
from posenc.rope.scaling import Default, DynamicNTK, Linear, Llama3, LongRoPE, NTKAware, YaRN, default_inv_freq

# Relative tolerance for float32 frequencies against float64 closed forms. The brief asks 1e-6: the float32
# exponent 2i/d and one pow rounding keep the measured error below 4.3e-7 for every (d, theta) below.
# Absolute tolerance 0: slow channels are ~1e-6 in size, so any atol from TOL would hide errors there.
REL = 1e-6
DIMS = [32, 64, 72, 128]
THETAS = [1e4, 1.5e5, 5e5, 1e6]


def closed_default(theta: float, d: int) -> torch.Tensor:
    return torch.tensor([theta ** (-2.0 * i / d) for i in range(d // 2)], dtype=torch.float64)


def assert_rel(actual: torch.Tensor, expected: torch.Tensor, rel: float = REL) -> None:
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    err = ((actual.double() - expected) / expected).abs().max().item()
    assert err < rel, f"max relative error {err:.3e} >= {rel:.1e}"


# ----------------------------------------------------------------------------------- closed forms
@pytest.mark.parametrize("d", DIMS)
@pytest.mark.parametrize("theta", THETAS)
def test_default_closed_form(d, theta):
    inv, af = Default().inv_freq(theta, d)
    assert_rel(inv, closed_default(theta, d))
    assert af == 1.0


@pytest.mark.parametrize("factor", [0.5, 2.0, 2.5, 8.0])
@pytest.mark.parametrize("d", [64, 72])
def test_linear_closed_form(factor, d):
    inv, af = Linear(factor).inv_freq(1e4, d)
    assert_rel(inv, closed_default(1e4, d) / factor)
    assert af == 1.0


@pytest.mark.parametrize("factor", [1.0, 2.0, 4.0, 16.0])
@pytest.mark.parametrize("d", [64, 72, 128])
def test_ntk_aware_closed_form(factor, d):
    inv, af = NTKAware(factor).inv_freq(1e4, d)
    base = 1e4 * factor ** (d / (d - 2))
    assert_rel(inv, closed_default(base, d))
    # The fastest channel never moves; the slowest is divided by exactly `factor` (the NTK-aware design goal).
    assert inv[0].item() == 1.0
    assert math.isclose(inv[-1].item() * factor, closed_default(1e4, d)[-1].item(), rel_tol=REL)
    assert af == 1.0


@pytest.mark.parametrize("seq_len", [None, 0, 100, 4096, 4097, 10000, 50000])
@pytest.mark.parametrize("factor", [2.0, 3.5])
def test_dynamic_closed_form(seq_len, factor):
    d, l0 = 128, 4096
    length = l0 if seq_len is None else max(seq_len, l0)
    base = 1e4 * (factor * length / l0 - (factor - 1)) ** (d / (d - 2))
    inv, af = DynamicNTK(factor, l0).inv_freq(1e4, d, seq_len)
    assert_rel(inv, closed_default(base, d))
    assert af == 1.0


def yarn_closed(theta, d, factor, l0, beta_fast=32.0, beta_slow=1.0, truncate=True):
    def dim_of(turns):  # the channel index that turns `turns` times within l0 positions
        return d * math.log(l0 / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    out = []
    for i, inv in enumerate(closed_default(theta, d).tolist()):
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep, 1: interpolate
        out.append(inv / factor * ramp + inv * (1 - ramp))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize(
    "theta,d,factor,l0,betas,truncate",
    [
        (1e4, 128, 4.0, 4096, (32.0, 1.0), True),
        (1e4, 64, 8.0, 2048, (32.0, 1.0), True),
        (1.5e5, 64, 32.0, 4096, (32.0, 1.0), False),  # gpt-oss
        (1e4, 72, 16.0, 4096, (16.0, 2.0), True),
        (1e6, 128, 2.0, 32768, (32.0, 1.0), True),
    ],
)
def test_yarn_closed_form(theta, d, factor, l0, betas, truncate):
    rule = YaRN(factor, l0, beta_fast=betas[0], beta_slow=betas[1], truncate=truncate)
    inv, af = rule.inv_freq(theta, d)
    assert_rel(inv, yarn_closed(theta, d, factor, l0, *betas, truncate=truncate))
    assert math.isclose(af, 0.1 * math.log(factor) + 1, rel_tol=1e-12)


def test_yarn_worked_numbers():
    low, high = YaRN(4.0, 4096).correction_range(1e4, 128)
    assert (low, high) == (20, 46)
    low, high = YaRN(32.0, 4096, truncate=False).correction_range(150000.0, 64)  # gpt-oss
    assert abs(low - 8.093) < 5e-4 and abs(high - 17.398) < 5e-4
    for factor, af in [(4.0, 1.13863), (32.0, 1.34657), (40.0, 1.36889)]:
        assert abs(YaRN(factor, 4096).effective_attention_factor() - af) < 5e-6
    # DeepSeek-V3: mscale = mscale_all_dim = 1 -> rope factor 1, softmax scale x1.87385; V2-Lite 0.707 -> x1.58963.
    v3 = YaRN(40.0, 4096, mscale=1.0, mscale_all_dim=1.0)
    assert v3.effective_attention_factor() == 1.0 and abs(v3.softmax_scale_factor() - 1.87385) < 5e-6
    lite = YaRN(40.0, 4096, mscale=0.707, mscale_all_dim=0.707)
    assert abs(lite.softmax_scale_factor() - 1.58963) < 5e-6
    # An explicit attention_factor wins over the mscale rule.
    assert YaRN(40.0, 4096, mscale=1.0, mscale_all_dim=0.5, attention_factor=0.9).inv_freq(1e4, 64)[1] == 0.9
    # beta None means transformers' defaults 32 / 1.
    assert YaRN(4.0, 4096, beta_fast=None, beta_slow=None) == YaRN(4.0, 4096)


def test_yarn_factor_one_is_default():
    for d in (64, 72, 128):
        inv, af = YaRN(1.0, 4096).inv_freq(1e4, d)
        assert_rel(inv, closed_default(1e4, d))
        assert af == 1.0
    pos = torch.arange(0, 3000, 17)  # and so are the tables a Rope builds from it
    for got, want in zip(Rope(head_dim=64, scaling=YaRN(1.0, 4096)).cos_sin(pos), Rope(head_dim=64).cos_sin(pos)):
        assert_close(got, want)


@pytest.mark.parametrize("seq_len,long", [(None, False), (0, False), (4095, False), (4096, False), (4097, True)])
def test_longrope_closed_form_and_switch(seq_len, long):
    d, l0 = 16, 4096
    short = tuple(1.0 + 0.1 * i for i in range(d // 2))
    longf = tuple(2.0 + 0.5 * i for i in range(d // 2))
    rule = LongRoPE(short, longf, l0, attention_factor=1.19)
    inv, af = rule.inv_freq(1e4, d, seq_len)
    ext = torch.tensor(longf if long else short, dtype=torch.float64)
    assert_rel(inv, closed_default(1e4, d) / ext)
    assert af == 1.19 and rule.uses_long(seq_len) is long


def test_longrope_default_attention_factor():
    assert abs(LongRoPE.default_attention_factor(32.0, 4096) - 1.19024) < 5e-6  # Phi-3-mini-128k
    assert LongRoPE.default_attention_factor(1.0, 4096) == 1.0


def llama3_closed(theta, d, factor, low, high, l0):
    out = []
    for inv in closed_default(theta, d).tolist():
        wavelen = 2 * math.pi / inv
        if wavelen < l0 / high:
            out.append(inv)
        elif wavelen > l0 / low:
            out.append(inv / factor)
        else:
            s = (l0 / wavelen - low) / (high - low)
            out.append((1 - s) * inv / factor + s * inv)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_llama3_closed_form_and_bands(factor):
    inv, af = Llama3(factor, 1.0, 4.0, 8192).inv_freq(5e5, 128)
    assert_rel(inv, llama3_closed(5e5, 128, factor, 1.0, 4.0, 8192))
    assert af == 1.0
    base = default_inv_freq(5e5, 128)
    # Llama-3.1 worked numbers: channels 0..28 untouched (bit-identical), 29..34 blended, 35..63 divided by factor.
    assert torch.equal(inv[:29], base[:29])
    assert torch.equal(inv[35:], base[35:] / factor)
    assert bool(((inv[29:35] < base[29:35]) & (inv[29:35] > base[29:35] / factor)).all())


# ----------------------------------------------------------------------------------- statelessness
@pytest.mark.parametrize(
    "rule",
    [DynamicNTK(2.0, 64), LongRoPE(tuple([1.0] * 4), tuple([4.0] * 4), 64, attention_factor=1.1)],
    ids=["dynamic", "longrope"],
)
def test_length_dependent_rules_are_stateless(rule):
    rope = Rope(head_dim=8, scaling=rule)
    short = torch.arange(10)
    fresh = rope.cos_sin(short)
    rope.cos_sin(torch.arange(1000))  # a long call in between must not leave anything behind
    again = rope.cos_sin(short)
    assert torch.equal(fresh[0], again[0]) and torch.equal(fresh[1], again[1])
    # The length is max(position_ids) + 1, not the number of tokens: one far position switches the table.
    far = rope.cos_sin(torch.tensor([0, 1, 200]))[0]
    assert not torch.equal(far[:2], fresh[0][:2])
    assert torch.equal(far, rope.cos_sin(torch.tensor([0, 1, 200]), seq_len=201)[0])


# ----------------------------------------------------------------------------------- transformers parity
transformers = pytest.importorskip("transformers")


def hf_inv(rope_type, head_dim, params, max_pos, seq_len=None):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = LlamaConfig(
            hidden_size=head_dim * 2,
            num_attention_heads=2,
            head_dim=head_dim,
            max_position_embeddings=max_pos,
            rope_parameters={"rope_type": rope_type, **params},
        )
        return ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", seq_len=seq_len)


def test_default_matches_transformers_llama():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    for d, theta in [(64, 1e4), (128, 5e5), (72, 1e6)]:
        cfg = LlamaConfig(hidden_size=2 * d, num_attention_heads=2, head_dim=d, rope_parameters={"rope_theta": theta})
        ref, af = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
        assert torch.equal(Default().inv_freq(theta, d)[0], ref) and af == 1.0


HF_GRID = [
    ("linear", 64, {"rope_theta": 1e4, "factor": 4.0}, 2048, None, Linear(4.0)),
    ("linear", 72, {"rope_theta": 1e6, "factor": 2.5}, 2048, None, Linear(2.5)),
    ("dynamic", 64, {"rope_theta": 1e4, "factor": 2.0}, 2048, None, DynamicNTK(2.0, 2048)),
    ("dynamic", 64, {"rope_theta": 1e4, "factor": 2.0}, 2048, 1000, DynamicNTK(2.0, 2048)),
    ("dynamic", 64, {"rope_theta": 1e4, "factor": 2.0}, 2048, 2049, DynamicNTK(2.0, 2048)),
    ("dynamic", 128, {"rope_theta": 5e5, "factor": 4.0}, 4096, 30000, DynamicNTK(4.0, 4096)),
    ("yarn", 128, {"rope_theta": 1e4, "factor": 4.0, "original_max_position_embeddings": 4096}, 16384, None,
     YaRN(4.0, 4096)),
    ("yarn", 64, {"rope_theta": 1.5e5, "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 32.0,
                  "beta_slow": 1.0, "truncate": False}, 131072, None, YaRN(32.0, 4096, truncate=False)),
    ("yarn", 64, {"rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0,
                  "mscale_all_dim": 1.0}, 163840, None, YaRN(40.0, 4096, mscale=1.0, mscale_all_dim=1.0)),
    ("yarn", 64, {"rope_theta": 1e4, "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
                  "mscale_all_dim": 0.707}, 163840, None, YaRN(40.0, 4096, mscale=0.707, mscale_all_dim=0.707)),
    ("yarn", 72, {"rope_theta": 1e6, "factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16.0,
                  "beta_slow": 2.0, "attention_factor": 1.5}, 16384, None,
     YaRN(8.0, 2048, beta_fast=16.0, beta_slow=2.0, attention_factor=1.5)),
    ("yarn", 64, {"rope_theta": 1e4, "factor": 2.0, "original_max_position_embeddings": 4096, "mscale": 0.0,
                  "mscale_all_dim": 1.0}, 8192, None, YaRN(2.0, 4096, mscale=0.0, mscale_all_dim=1.0)),
    ("llama3", 128, {"rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192}, 131072, None, Llama3(8.0, 1.0, 4.0, 8192)),
    ("llama3", 64, {"rope_theta": 5e5, "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 8192}, 131072, None, Llama3(32.0, 1.0, 4.0, 8192)),
]


@pytest.mark.parametrize("rope_type,d,params,max_pos,seq_len,rule", HF_GRID)
def test_matches_transformers_elementwise(rope_type, d, params, max_pos, seq_len, rule):
    # a length goes in as transformers' forward passes it, a tensor max(position_ids) + 1 (see the test below)
    ref, ref_af = hf_inv(rope_type, d, params, max_pos, None if seq_len is None else torch.tensor(seq_len))
    inv, af = rule.inv_freq(params["rope_theta"], d, seq_len)
    assert torch.equal(inv, ref), f"max abs diff {(inv - ref).abs().max().item():.3e}"
    assert af == pytest.approx(ref_af, rel=1e-15)


@pytest.mark.parametrize("seq_len", [None, 4095, 4096, 4097, 131072])
def test_longrope_matches_transformers(seq_len):
    d = 32
    short = [1.0 + 0.05 * i for i in range(d // 2)]
    longf = [1.5 + 0.75 * i for i in range(d // 2)]
    params = {"rope_theta": 1e4, "short_factor": short, "long_factor": longf, "original_max_position_embeddings": 4096}
    ref, ref_af = hf_inv("longrope", d, params, 131072, seq_len)
    rule = LongRoPE(tuple(short), tuple(longf), 4096, LongRoPE.default_attention_factor(131072 / 4096, 4096))
    inv, af = rule.inv_freq(1e4, d, seq_len)
    assert torch.equal(inv, ref)
    assert af == pytest.approx(ref_af, rel=1e-15)
    assert ref_af == pytest.approx(1.19024, abs=5e-6)


@pytest.mark.parametrize("factor", [2.0, 2.5, 3.0])
def test_dynamic_matches_transformers_forward_and_is_close_to_int_path(factor):
    # transformers' forward passes max(position_ids) + 1 as a 0-dim tensor, so its grown base is float32
    # arithmetic; posenc matches that bit for bit. Called with a Python int, ROPE_INIT_FUNCTIONS grows it in
    # float64 instead: a few-ulp difference (measured <= 2.5e-7 relative), held here within REL.
    params = {"rope_theta": 1e4, "factor": factor}
    for length in (1, 2047, 2048, 2049, 5000, 65536, 100000):
        for d in (64, 72, 128):
            inv = DynamicNTK(factor, 2048).inv_freq(1e4, d, length)[0]
            assert torch.equal(inv, hf_inv("dynamic", d, params, 2048, torch.tensor(length))[0]), (length, d)
            assert torch.equal(inv, DynamicNTK(factor, 2048).inv_freq(1e4, d, torch.tensor(length))[0])
            assert_rel(inv, hf_inv("dynamic", d, params, 2048, length)[0].double())


def test_scaling_rules_reject_bad_head_facts():
    with pytest.raises(PosencError, match=r"rotary_dim: expected a positive even .*got 7"):
        Default().inv_freq(1e4, 7)
    with pytest.raises(PosencError, match=r"base: expected a finite number > 0.*got -1\.0"):
        Linear(2.0).inv_freq(-1.0, 8)
    with pytest.raises(PosencError, match=r"seq_len: expected a non-negative integer.*got 2\.5"):
        DynamicNTK(2.0, 16).inv_freq(1e4, 8, 2.5)
