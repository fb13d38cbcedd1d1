"""`--engine MODULE:FACTORY` out of process: every way an engine can end or stall its process is a failed row
naming what happened, the run goes on, and `posenc verify` never exits 0 without its report."""

import json
import textwrap

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from posenc.errors import PosencError  # noqa: E402
from posenc.verify import run_checks  # noqa: E402
from posenc.verify.engines import load_factory  # noqa: E402
from tests.helpers.verify_tiny import BUDGET, save_tiny, subject  # noqa: E402

ENGINE = textwrap.dedent('''
    import ctypes, os, signal, time
    import torch
    from posenc.verify.engines import posenc_engine

    class Exits:
        def __init__(self, inner, how): self.inner, self.how = inner, how
        def new_cache(self, b, n): return self.inner.new_cache(b, n)
        def forward(self, ids, **kw):
            if self.how == "exit0": os._exit(0)
            if self.how == "exit1": os._exit(1)
            if self.how == "systemexit": raise SystemExit(0)
            if self.how == "sigterm": os.kill(os.getpid(), signal.SIGTERM)
            if self.how == "segfault": ctypes.string_at(0)
            if self.how == "hang": time.sleep(3600)
            return self.inner.forward(ids, **kw)

    def clean(path, rule, dtype): return posenc_engine(path, rule, dtype)
    def exit_in_factory(path, rule, dtype): os._exit(0)
    def no_linear(path, rule, dtype): return posenc_engine(path, rule, dtype)
    no_linear.rule_support = lambda rule: "no linear here" if rule and rule.get("rope_type") == "linear" else None
    no_linear.position_gaps = "this engine refuses gaps"
    for how in ("exit0", "exit1", "systemexit", "sigterm", "segfault", "hang"):
        globals()[how] = (lambda how: lambda path, rule, dtype: Exits(posenc_engine(path, rule, dtype), how))(how)
    ''')


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def engines(tmp_path, monkeypatch):
    (tmp_path / "ways_out.py").write_text(ENGINE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("POSENC_ENGINE_TIMEOUT", "4")
    return tmp_path


@pytest.mark.parametrize("how, reason", [
    ("exit0", "exited with status 0"), ("exit1", "exited with status 1"),
    ("systemexit", "SystemExit: 0"), ("sigterm", "killed by signal SIGTERM"),
    ("segfault", "killed by signal SIGSEGV"), ("hang", "no answer within 4 s"),
    ("exit_in_factory", "building the engine: the engine process exited with status 0")])
def test_each_way_out_is_a_failed_row_and_the_run_goes_on(tiny, engines, how, reason):
    factory = load_factory(f"ways_out:{how}")
    try:
        rows = run_checks(subject(tiny, factory), BUDGET, ["pairing", "multimodal"])
    finally:
        factory.close()
    assert rows[0].passed is False and reason in rows[0].measured["error"], rows[0].measured
    # the next row runs on a fresh worker (multimodal builds an engine and uses posenc's own builder)
    assert rows[1].passed is (how != "exit_in_factory"), rows[1].measured


def test_the_factory_is_judged_in_the_worker_and_its_declarations_reach_the_rows(tiny, engines):
    factory = load_factory("ways_out:no_linear")
    try:
        assert factory.position_gaps == "this engine refuses gaps"
        linear = {"rope_type": "linear", "factor": 2.0}
        kept, na = subject(tiny, factory).split_rules({"default": None, "linear": linear})
        assert kept == {"default": None} and na == {"linear": "n/a: not implemented (no linear here)"}
    finally:
        factory.close()
    with pytest.raises(PosencError, match="importable MODULE"):
        load_factory("ways_out_missing:clean")
    with pytest.raises(PosencError, match="a callable nothing in module ways_out"):
        load_factory("ways_out:nothing")


@pytest.mark.parametrize("how", ["exit0", "systemexit"])
def test_verify_never_exits_0_without_its_report(tiny, engines, tmp_path, how):
    from posenc.cli import main

    out = tmp_path / "report"
    code = main(["verify", "--engine", f"ways_out:{how}", "--model", tiny, "--checks", "pairing,multimodal",
                 "--quick", "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert code == 1 and [r["status"] for r in report["rows"]] == ["FAIL", "pass"]


def test_in_process_is_opt_in_and_a_systemexit_there_is_a_failed_row(tiny, engines):
    factory = load_factory("ways_out:systemexit", in_process=True)
    assert not hasattr(factory, "proc")  # the module's own function
    row = run_checks(subject(tiny, factory), BUDGET, ["pairing"])[0]
    assert row.passed is False and "SystemExit(0)" in row.measured["error"]


def test_a_scoring_engine_runs_out_of_process_too(tiny, tmp_path, monkeypatch):
    (tmp_path / "scoring_out.py").write_text(
        "from tests.helpers.engine_fakes.posenc_side import Fake\n"
        "def make(path, rule, dtype):\n"
        "    engine = Fake(path, rule, None)\n"
        "    engine.capabilities = {'positions'}\n"
        "    return engine\n"
        "make.protocol = 'scoring'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    factory = load_factory("scoring_out:make")
    try:
        assert factory.protocol == "scoring"
        rows = run_checks(subject(tiny, factory), BUDGET, ["pairing", "batch-padding"])
    finally:
        factory.close()
    assert [r.status for r in rows] == ["pass", "pass"], [r.measured for r in rows]
