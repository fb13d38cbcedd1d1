"""`posenc verify --kv-dtype`: posenc's engine with a quantized cache; consistency thresholds grow by the
format's noise (the constants fixed in verify/checks/consistency.py, recomputed here by hand)."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from posenc.cli import main  # noqa: E402
from posenc.cache.quant import QuantizedKVCache  # noqa: E402
from posenc.verify import run_checks  # noqa: E402
from posenc.verify import runner  # noqa: E402
from posenc.verify.checks.consistency import kv_tol, logit_tol  # noqa: E402
from posenc.verify.engines import posenc_engine  # noqa: E402
from tests.helpers.verify_tiny import BUDGET, save_tiny  # noqa: E402

ROWS = ["relativity", "prefill-decode", "batch-padding"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


def test_allowance_is_float_noise_plus_twice_the_measured_effect(tiny):
    plain = runner.build_subject(tiny, posenc_engine, engine_name="posenc", dtype=torch.float32, tokens=4096)[0]
    quant = runner.build_subject(tiny, posenc_engine, engine_name="posenc", dtype=torch.float32, tokens=4096,
                                 kv_dtype="int8:pre")[0]
    assert kv_tol(plain, 0.7) == logit_tol(torch.float32) == 1e-4  # no cache format: float noise only
    assert kv_tol(quant, 0.7) == pytest.approx(1e-4 + 1.4, rel=1e-12)


@pytest.mark.parametrize("kv_dtype", ["int8:pre", "int8:post", "int4:pre"])
def test_consistency_rows_run_on_the_quantized_cache(tiny, kv_dtype):
    subject = runner.build_subject(tiny, posenc_engine, engine_name="posenc", dtype=torch.float32, tokens=4096,
                                   kv_dtype=kv_dtype)[0]
    engine = subject.engine(None)
    cache = engine.new_cache(1, 8)
    assert isinstance(cache, QuantizedKVCache) and cache.format.name == kv_dtype.split(":")[0]
    assert cache.key_axis == ("channel" if kv_dtype.endswith("pre") else "token")
    rows = {r.name: r for r in run_checks(subject, BUDGET, ROWS)}
    for name in ROWS:
        assert rows[name].status == "pass", (name, rows[name].measured)
    decode = rows["prefill-decode"].measured["max_abs_logit_diff"]
    effect = rows["prefill-decode"].measured["kv_effect"]  # the references through the cache vs none
    assert effect > 100 * logit_tol(torch.float32)  # the cache really is quantized
    for entries in rows["prefill-decode"].details["per_rule"].values():  # each rule's allowance from its own effect
        for e in entries.values():
            assert e["tolerance"] == pytest.approx(1e-4 + 2 * e["kv_effect"], rel=1e-12)
            assert e["max_abs_logit_diff"] <= e["tolerance"]
    # the references run through a cache of the same format, so most of its error cancels: per token (post) all
    # of it but float noise on this 2-layer model; per channel (pre) a prefill that fills a block at once
    # quantizes keys its tokens saw in full precision when decoded one by one, so part of it stays
    assert decode < effect / (100 if kv_dtype.endswith("post") else 1), (decode, effect)
    padded = rows["batch-padding"].measured  # solo runs prefill and decode like the batch
    assert padded["max_abs_logit_diff"] < padded["kv_effect"] / 100, padded
    assert "2 x the rule's kv_effect" in rows["prefill-decode"].thresholds["max_abs_logit_diff"]
    assert kv_dtype in rows["relativity"].thresholds["worst_diff_over_tolerance"]
    assert rows["relativity"].measured["kv_effect"] > 100 * logit_tol(torch.float32)


@pytest.mark.parametrize("argv,message", [
    (["--kv-dtype", "int3"], "--kv-dtype: expected one of ('float32'"),
    (["--kv-dtype", "int4:mid"], "--kv-dtype: expected one of ('pre', 'post')"),
    (["--kv-dtype", "int8", "--engine", "transformers"], "--kv-dtype: expected --engine posenc"),
    (["--kv-dtype", "int8", "--self-test"], "--kv-dtype: expected --engine posenc (without --self-test)")])
def test_bad_kv_dtype_is_refused_before_anything_runs(tmp_path, capsys, monkeypatch, argv, message):
    def no_run(*args, **kwargs):
        raise AssertionError("checks ran before the arguments were refused")
    monkeypatch.setattr(runner, "run_checks", no_run)
    monkeypatch.setattr(runner, "build_subject", no_run)
    assert main(["verify", "--checks", "prefill-decode", "--out", str(tmp_path / "r"), *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("fault,row", [("off-by-one-decode", "prefill-decode"), ("padding-drift", "batch-padding"),
                                       ("reused-rotated-keys", "relativity")])
def test_position_faults_still_fail_under_a_quantized_cache(tiny, fault, row):
    from posenc.verify.faults import faulty_factory
    subject = runner.build_subject(tiny, faulty_factory(fault, posenc_engine), engine_name="posenc",
                                   dtype=torch.float32, tokens=4096, kv_dtype="int4:pre")[0]
    got = run_checks(subject, BUDGET, [row])[0]
    assert got.status == "FAIL", (fault, got.measured)
