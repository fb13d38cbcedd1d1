"""posenc verify's rows on a tiny random Llama: the clean engine passes, each injected fault fails its row,
and transformers' dynamic NTK fails prefill-decode (it keeps keys cached under the shorter table)."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from posenc import PosencError  # noqa: E402
from posenc.verify import CHECKS, FAULTS, faulty_factory, run_checks, self_test  # noqa: E402
from posenc.verify.engines import load_factory, posenc_engine, transformers_engine  # noqa: E402
from tests.helpers.verify_tiny import BUDGET, save_tiny, subject  # noqa: E402

SKIPPED = ("position-scan", "prefix-caching", "chunked-prefill")  # no tokenizer; serving-engine rows
ROWS = [n for n in CHECKS if n not in SKIPPED]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


def test_clean_posenc_passes_every_row(tiny):
    rows = run_checks(subject(tiny, posenc_engine), BUDGET, list(CHECKS))
    status = {r.name: r.status for r in rows}
    assert status == {**{n: "pass" for n in ROWS}, **{n: "skipped" for n in SKIPPED}}, [
        r.measured for r in rows]
    by = {r.name: r for r in rows}
    assert by["pairing"].measured["max_abs_logit_diff"] <= 1e-4
    assert by["prefill-decode"].measured["max_abs_logit_diff"] <= 1e-4
    assert by["short-context"].measured["dynamic_delta_nll"] == pytest.approx(0.0, abs=1e-6)
    assert "tokenizer" in by["position-scan"].skipped


def test_each_fault_is_caught_by_its_row(tiny):
    clean, table = self_test(lambda f: subject(tiny, f), BUDGET, posenc_engine)
    assert all(r.passed for r in clean)
    assert {e["fault"] for e in table} == set(FAULTS)
    assert [e["fault"] for e in table if not e["caught"]] == []
    assert all(e["faulty"] == "FAIL" for e in table)


def test_a_fault_leaves_other_rows_alone(tiny):
    # off-by-one decode only touches derived decode positions: relativity (explicit positions) still passes
    rows = run_checks(subject(tiny, faulty_factory("off-by-one-decode", posenc_engine)), BUDGET,
                      ["relativity", "prefill-decode"])
    assert [r.status for r in rows] == ["pass", "FAIL"]
    per_rule = rows[1].details["per_rule"]["default"]
    assert per_rule["explicit"]["max_abs_logit_diff"] <= 1e-4 < per_rule["derived"]["max_abs_logit_diff"]


def test_transformers_engine_fails_dynamic_decode_and_length_rules_in_a_batch(tiny):
    rows = run_checks(subject(tiny, transformers_engine, "transformers"), BUDGET,
                      ["prefill-decode", "batch-padding", "pairing", "relativity"])
    by = {r.name: r for r in rows}
    assert by["prefill-decode"].measured["failed_rules"] == ["dynamic"]
    assert by["prefill-decode"].measured["dynamic"] > 1e-2  # not noise: the cached keys use the shorter table
    # transformers reads a length-dependent rule's length as max(position_ids) + 1 over the whole batch: the rows
    # below L0 get the longest row's table; the row past L0, and padding under the plain rule, are exact
    padding = by["batch-padding"]
    assert padding.measured["failed_rules"] == ["dynamic", "longrope"]
    assert padding.measured["max_abs_logit_diff"] <= 1e-4
    per_row = padding.details["per_rule"]["dynamic"]["per_row"]
    assert per_row["56"] > 1.0 and per_row["88"] <= 1e-4, per_row
    assert all(by[n].passed for n in ("pairing", "relativity"))


def test_load_factory_names_and_errors(tmp_path, monkeypatch):
    assert load_factory("posenc") is posenc_engine
    with pytest.raises(PosencError, match="engine: expected one of"):
        load_factory("sglang")
    with pytest.raises(PosencError, match="importable MODULE"):
        load_factory("no_such_module_xyz:make")
    (tmp_path / "engine_mod.py").write_text("make = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PosencError, match="a callable make"):
        load_factory("engine_mod:make")


def test_module_factory_engine_is_run_and_judged(tiny, tmp_path, monkeypatch):
    # an engine written outside the repository: it forgets the cache's offset when deriving positions
    (tmp_path / "outside_engine.py").write_text(
        "import torch\n"
        "from posenc.verify.engines import posenc_engine\n"
        "class Restart:\n"
        "    def __init__(self, inner): self.inner = inner\n"
        "    def new_cache(self, b, n): return self.inner.new_cache(b, n)\n"
        "    def forward(self, ids, *, attention_mask=None, cache=None, position_ids=None):\n"
        "        if position_ids is None and cache is not None and int(cache.lengths.max()) > 0:\n"
        "            position_ids = cache.next_positions()[:, None] + 3 + torch.arange(ids.shape[1])\n"
        "        return self.inner.forward(ids, attention_mask=attention_mask, cache=cache, position_ids=position_ids)\n"
        "def broken(path, rope_scaling, dtype): return Restart(posenc_engine(path, rope_scaling, dtype))\n"
        "def clean(path, rope_scaling, dtype): return posenc_engine(path, rope_scaling, dtype)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    good = run_checks(subject(tiny, load_factory("outside_engine:clean")), BUDGET, ["prefill-decode"])[0]
    bad = run_checks(subject(tiny, load_factory("outside_engine:broken")), BUDGET, ["prefill-decode"])[0]
    assert (good.status, bad.status) == ("pass", "FAIL")


def test_a_crashing_engine_fails_its_row(tiny):
    def crash(path, rope_scaling, dtype):
        raise RuntimeError("boom")
    row = run_checks(subject(tiny, crash), BUDGET, ["relativity"])[0]
    assert row.passed is False and "boom" in row.measured["error"]


def test_each_rule_is_checked_for_being_applied(tiny):
    def ignores_yarn(path, rope_scaling, dtype):  # one rule silently dropped, the others applied
        drop = rope_scaling is not None and rope_scaling.get("rope_type") == "yarn"
        return posenc_engine(path, None if drop else rope_scaling, dtype)
    row = run_checks(subject(tiny, ignores_yarn), BUDGET, ["length-boundaries"])[0]
    assert row.measured["failed_rules"] == ["yarn"]
    assert row.details["per_rule"]["yarn"]["effect_max_abs_logit_diff"] <= 1e-4
    everything = run_checks(subject(tiny, faulty_factory("rule-ignored", posenc_engine)), BUDGET,
                            ["length-boundaries"])[0]
    assert everything.measured["failed_rules"] == ["linear", "ntk", "dynamic", "yarn", "llama3"]
