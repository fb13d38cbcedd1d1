"""posenc verify against engines that try to pass without computing: NaN logits, logits of the wrong width or
dtype, and reports that strict JSON parsers refuse. Each engine wraps posenc's own (a tiny random Llama) and
breaks one thing; every row it reaches must fail, saying what arrived."""

import json
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from posenc import PosencError  # noqa: E402
from posenc.cli import main  # noqa: E402
from posenc.verify import FAULTS, run_checks, self_test  # noqa: E402
from posenc.verify.checks.common import Row, max_diff  # noqa: E402
from posenc.verify.engines import posenc_engine  # noqa: E402
from posenc.verify.report import html_page, write_report  # noqa: E402
from tests.helpers.verify_tiny import BUDGET, save_tiny, subject  # noqa: E402

ROWS = ["relativity", "prefill-decode", "batch-padding", "length-boundaries", "short-context", "pairing"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


def breaking(change):
    """A factory whose engine runs posenc's decoder and then applies `change(logits, input_ids)`."""
    class Engine:
        def __init__(self, inner):
            self.inner = inner

        def new_cache(self, b, n):
            return self.inner.new_cache(b, n)

        def forward(self, ids, **kwargs):
            return change(self.inner.forward(ids, **kwargs), ids)

    def make(path, rope_scaling, dtype):
        return Engine(posenc_engine(path, rope_scaling, dtype))
    return make


def all_nan(out, ids):
    return torch.full_like(out, float("nan"))


def nan_in_second_row(out, ids):
    if out.shape[0] > 1:
        out = out.clone()
        out[1] = float("nan")
    return out


def nan_after_first_call(calls=[]):  # noqa: B006 - one list per factory, on purpose
    def change(out, ids):
        calls.append(1)
        return out if len(calls) == 1 else out + float("nan")
    return change


@pytest.mark.parametrize("change, arrived", [
    (all_nan, "non-finite"),
    (lambda out, ids: out[..., :10], "(1, 24, 10)"),  # 10 of the vocabulary's 256 columns
    (lambda out, ids: out.round().long(), "torch.int64"),
    (lambda out, ids: out[:, :-1], "shape"),  # one position short
    (lambda out, ids: out.to(torch.complex64), "complex64"),
    (lambda out, ids: out.tolist(), "list"),
], ids=["all-nan", "narrow-vocab", "int64", "short", "complex", "list"])
def test_engines_with_bad_logits_fail_every_row_naming_what_arrived(tiny, change, arrived):
    rows = run_checks(subject(tiny, breaking(change)), BUDGET, ROWS)
    assert [r.status for r in rows] == ["FAIL"] * len(ROWS), [(r.name, r.measured) for r in rows]
    for r in rows:
        assert "logits" in r.measured["error"], r.measured
    assert arrived in rows[0].measured["error"] or arrived in rows[1].measured["error"]


def test_nan_in_one_batch_row_fails_batch_padding(tiny):
    row = run_checks(subject(tiny, breaking(nan_in_second_row)), BUDGET, ["batch-padding"])[0]
    assert row.status == "FAIL" and "non-finite" in row.measured["error"]


def test_nan_that_is_not_the_first_value_still_fails(tiny):
    rows = run_checks(subject(tiny, breaking(nan_after_first_call())), BUDGET, ["relativity"])
    assert rows[0].status == "FAIL" and "non-finite" in rows[0].measured["error"]


def test_the_fold_keeps_nan_and_max_diff_reports_it():
    from posenc.verify.checks.common import worst

    nan = float("nan")
    assert math.isnan(worst([0.0, nan, 1.0])) and math.isnan(worst([nan])) and worst([0.0, 2.0, 1.0]) == 2.0
    assert worst([]) == 0.0
    a = torch.zeros(3)
    assert math.isnan(max_diff(a, torch.tensor([0.0, nan, 0.0])))
    assert max_diff(a, torch.tensor([0.0, float("inf"), 0.0])) == float("inf")
    assert max(0.0, nan) == 0.0  # why the fold exists: Python's max drops a NaN that is not first


def test_check_logits_names_shape_dtype_and_values():
    from posenc.verify.checks.output import check_logits

    ids = torch.zeros(2, 3, dtype=torch.long)
    good = torch.zeros(2, 3, 5)
    assert check_logits(good, ids, 5) is good
    with pytest.raises(PosencError, match=r"logits: expected a floating-point tensor of shape \[2, 3, 5\]"):
        check_logits(torch.zeros(2, 3, 4), ids, 5)
    with pytest.raises(PosencError, match=r"logits: expected .*got tensor of shape \(2, 3, 5\) and dtype torch.int"):
        check_logits(torch.zeros(2, 3, 5, dtype=torch.int32), ids, 5)
    bad = good.clone()
    bad[1, 2, 0] = float("inf")
    with pytest.raises(PosencError, match=r"logits: expected finite values .*1 non-finite"):
        check_logits(bad, ids, 5)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the bad value sits at a padded column: not held against it
    assert check_logits(bad, ids, 5, mask) is bad
    assert check_logits(torch.zeros(2, 3, 7), ids, None).shape == (2, 3, 7)  # vocabulary unknown: any width
    with pytest.raises(PosencError, match=r"logits: expected .* with values, got a meta tensor"):
        check_logits(torch.zeros(2, 3, 5, device="meta"), ids, 5)


def test_selftest_catches_nan_and_narrow_vocabulary_engines(tiny):
    assert {"nan-logits", "narrow-vocab"} <= set(FAULTS)
    clean, table = self_test(lambda f: subject(tiny, f), BUDGET, posenc_engine, faults=["nan-logits", "narrow-vocab"])
    assert [(e["fault"], e["clean"], e["faulty"], e["caught"]) for e in table] == [
        ("nan-logits", "pass", "FAIL", True), ("narrow-vocab", "pass", "FAIL", True)]
    assert all("logits" in e["measured"]["error"] for e in table)


def _strict(text):
    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    return json.loads(text, parse_constant=refuse)


def test_report_json_is_strict_json_with_non_finite_numbers_as_strings(tmp_path):
    nan, inf = float("nan"), float("inf")
    rows = [Row("relativity", False, {"max_abs_logit_diff": nan, "ratio": inf, "low": -inf, "ok": 1.5},
                {"max_abs_logit_diff": "<= 1e-4"}, "why", details={"per_step": [0.0, nan, {"x": inf}]})]
    folder = write_report(tmp_path / "r", rows, {"engine": "e", "model": "m", "budget": "quick", "text": {},
                                                 "wall_seconds": nan}, json_file=tmp_path / "v.json")
    data = _strict((folder / "report.json").read_text())
    measured = data["rows"][0]["measured"]
    assert measured == {"max_abs_logit_diff": "nan", "ratio": "inf", "low": "-inf", "ok": 1.5}
    assert data["rows"][0]["details"]["per_step"] == [0.0, "nan", {"x": "inf"}]
    assert _strict((tmp_path / "v.json").read_text()) == data
    page = html_page(rows, {"engine": "e", "model": "m", "budget": "quick", "text": {}})
    assert "NaN" not in page and "Infinity" not in page


def test_verify_cli_refuses_bad_threads_and_outputs_before_running(tiny, tmp_path, capsys, monkeypatch):
    import posenc.verify.runner as runner

    def no_run(*args, **kwargs):
        raise AssertionError("checks ran before the arguments were refused")
    monkeypatch.setattr(runner, "run_checks", no_run)
    monkeypatch.setattr(runner, "build_subject", no_run)
    base = ["verify", "--model", tiny, "--checks", "multimodal"]
    for threads in ("-3", "0"):
        assert main([*base, "--threads", threads, "--out", str(tmp_path / "o")]) == 2
        assert f"--threads: expected an integer >= 1, got {threads}" in capsys.readouterr().err
    (tmp_path / "dir").mkdir()
    assert main([*base, "--json", str(tmp_path / "dir"), "--out", str(tmp_path / "o")]) == 2
    assert "--json: expected a file path to write (not a folder)" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main([*base, "--out", str(tmp_path / "file" / "sub")]) == 2
    assert "--out: expected a folder to write into (not a file)" in capsys.readouterr().err
    assert main([*base, "--json", str(tmp_path / "file" / "v.json"), "--out", str(tmp_path / "o")]) == 2
    assert "--json: expected a file path" in capsys.readouterr().err


@pytest.mark.parametrize("change", [lambda out, ids: torch.zeros_like(out),
                                    lambda out, ids: out[:, :1].mean(0, keepdim=True).expand_as(out) * 0 + 1.5],
                         ids=["zeros", "constant"])
def test_logits_that_ignore_the_input_fail_the_consistency_rows(tiny, change):
    # the same logits for every token agree with themselves everywhere: the rows hold the spread too
    rows = run_checks(subject(tiny, breaking(change)), BUDGET, ["relativity", "prefill-decode", "batch-padding"])
    assert [r.status for r in rows] == ["FAIL"] * 3, [(r.name, r.measured) for r in rows]
    assert all(r.measured["logit_spread"] == 0.0 and r.measured["max_abs_logit_diff"] == 0.0 for r in rows)
    clean = run_checks(subject(tiny, posenc_engine), BUDGET, ["relativity", "prefill-decode", "batch-padding"])
    assert all(r.passed and r.measured["logit_spread"] > 1.0 for r in clean), [r.measured for r in clean]


def test_an_engine_that_ignores_explicit_positions_fails_relativity(tiny):
    class Ignores:  # always derives its own positions: shifted copies run at 0.. and match trivially
        def __init__(self, inner):
            self.inner = inner

        def new_cache(self, b, n):
            return self.inner.new_cache(b, n)

        def forward(self, ids, *, attention_mask=None, cache=None, position_ids=None):
            return self.inner.forward(ids, attention_mask=attention_mask, cache=cache)
    row = run_checks(subject(tiny, lambda p, r, d: Ignores(posenc_engine(p, r, d))), BUDGET, ["relativity"])[0]
    assert row.status == "FAIL" and row.measured["gap_effect"] == 0.0 and row.measured["max_abs_logit_diff"] == 0.0
    clean = run_checks(subject(tiny, posenc_engine), BUDGET, ["relativity"])[0]
    assert clean.passed and clean.measured["gap_effect"] > 1e-2, clean.measured
    assert "positions-ignored" in FAULTS and FAULTS["positions-ignored"].row == "relativity"


def test_an_engine_that_panics_with_a_base_exception_fails_its_row(tiny):
    class Panic(BaseException):  # what a Rust extension's panic (pyo3's PanicException) derives from
        pass

    def panics(path, rope_scaling, dtype):
        raise Panic("index out of range")
    rows = run_checks(subject(tiny, panics), BUDGET, ["relativity", "batch-padding"])
    assert [r.status for r in rows] == ["FAIL", "FAIL"] and "Panic: index out of range" in rows[0].measured["error"]

    def interrupted(path, rope_scaling, dtype):
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):  # the user's interrupt still stops the run
        run_checks(subject(tiny, interrupted), BUDGET, ["relativity"])
