"""Foreign engines through both protocols, out of process: a posenc-backed fake behind the engine host
passes every row it can run; the same fake with a segfault, a hang, an exception or garbage fails only the
row that met it, with the reason, and the run goes on; rules an engine lacks are n/a, not failures."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from posenc.verify import run_checks  # noqa: E402
from posenc.verify.engines.hosted import (HostedLogitsEngine, HostedScoringEngine, RuleNotImplemented,  # noqa: E402
                                          SharedProcess, llamacpp_params)
from posenc.verify.engines.vllm_client import vllm_overrides  # noqa: E402
from posenc.verify.engines.process import EngineProcess  # noqa: E402
from tests.helpers.verify_tiny import BUDGET, save_tiny, subject  # noqa: E402

FAKE = str(Path(__file__).parents[2] / "helpers" / "engine_fakes" / "posenc_side.py")
SHARED = str(Path(__file__).parents[2] / "helpers" / "engine_fakes" / "shared_side.py")
SERVING = {"prefix_caching", "positions", "chunked_prefill"}
LOGITS_ROWS = ["relativity", "prefill-decode", "batch-padding", "pairing", "rules-vs-reference"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


def hosted(protocol, fault=None, timeout=60.0, rule_support=None, capabilities=("prefix_caching",)):
    def factory(model_path, rule, dtype):
        proc = EngineProcess(sys.executable, FAKE, {"model_path": model_path, "rule": rule, "fault": fault},
                             timeout=timeout, load_timeout=120)
        return HostedLogitsEngine(proc) if protocol == "logits" else HostedScoringEngine(proc, set(capabilities))
    factory.protocol = protocol
    if rule_support is not None:
        factory.rule_support = rule_support
    return factory


def test_hosted_logits_engine_passes_its_rows(tiny):
    rows = run_checks(subject(tiny, hosted("logits")), BUDGET, LOGITS_ROWS)
    assert {r.name: r.status for r in rows} == {n: "pass" for n in LOGITS_ROWS}, [r.measured for r in rows]
    rules = rows[-1]
    assert set(rules.details["per_rule"]) == {"default", "linear", "ntk", "dynamic", "yarn", "yarn-untruncated",
                                              "llama3", "longrope"}


@pytest.mark.parametrize("fault, failing, reason", [
    ("segfault-on-batch", {"batch-padding"}, "killed by signal SIGSEGV"),
    ("hang-on-batch", {"batch-padding"}, "no answer within 5 s"),
    ("raise-on-decode", {"prefill-decode", "batch-padding"}, "decode kernel exploded"),  # both decode a token
])
def test_a_crash_fails_its_row_and_the_run_goes_on(tiny, fault, failing, reason):
    rows = run_checks(subject(tiny, hosted("logits", fault, timeout=5.0)), BUDGET,
                      ["batch-padding", "pairing", "prefill-decode"])
    status = {r.name: r.status for r in rows}
    assert status == {n: ("FAIL" if n in failing else "pass") for n in status}, [r.measured for r in rows]
    for r in rows:
        if r.name in failing:
            assert reason in r.measured["error"] and "EngineFailure" in r.measured["error"]


def test_garbage_answers_are_failures_with_the_reason(tiny):
    rows = run_checks(subject(tiny, hosted("logits", "garbage-shape")), BUDGET, ["pairing"])
    assert rows[0].status == "FAIL" and "malformed answer" in rows[0].measured["error"]
    rows = run_checks(subject(tiny, hosted("scoring", "nan")), BUDGET, ["pairing"])
    assert rows[0].status == "FAIL" and rows[0].measured["max_abs_logprob_diff"] == float("inf")


def test_scoring_engine_rows_and_na_reasons(tiny):
    names = ["pairing", "prefill-decode", "batch-padding", "prefix-caching", "rules-vs-reference", "relativity",
             "length-boundaries", "multimodal"]
    rows = {r.name: r for r in run_checks(subject(tiny, hosted("scoring")), BUDGET, names)}
    assert [n for n in names[:5] if rows[n].status != "pass"] == [], {n: rows[n].measured for n in names[:5]}
    assert rows["relativity"].skipped.startswith("n/a: needs explicit position ids")
    assert "full logits" in rows["length-boundaries"].skipped
    rows = run_checks(subject(tiny, hosted("scoring", "segfault-on-batch")), BUDGET, ["batch-padding", "pairing"])
    assert [r.status for r in rows] == ["FAIL", "pass"] and "SIGSEGV" in rows[0].measured["error"]


def test_rules_an_engine_lacks_are_na_not_failures(tiny):
    def support(rule):
        return None if rule is None or rule.get("rope_type") in ("linear", "yarn") else "no such option"
    rows = run_checks(subject(tiny, hosted("logits", rule_support=support)), BUDGET,
                      ["rules-vs-reference", "prefill-decode"])
    assert [r.status for r in rows] == ["pass", "pass"]
    assert set(rows[0].details["per_rule"]) == {"default", "linear", "yarn", "yarn-untruncated"}
    assert rows[0].measured["not_implemented"] == ["dynamic", "llama3", "longrope", "ntk"]
    assert rows[1].measured["not_implemented"] == ["dynamic", "llama3", "ntk"]


def test_a_configuration_refused_at_load_is_na_with_the_message(tiny):
    rows = run_checks(subject(tiny, hosted("scoring", "refuse-linear")), BUDGET, ["rules-vs-reference"])
    assert rows[0].status == "pass", rows[0].measured
    assert rows[0].measured["not_implemented"] == ["linear"]
    why = rows[0].details["not_implemented"]["linear"]
    assert why.startswith("n/a: the engine refused") and "ValueError: User-specified max_model_len" in why


def test_llamacpp_rule_mapping_and_gaps():
    assert llamacpp_params(None) == {}
    assert llamacpp_params({"rope_type": "default", "rope_theta": 5e5}) == {"rope_freq_base": 5e5}
    assert llamacpp_params({"rope_type": "linear", "factor": 4.0}) == {"rope_scaling_type": 1, "rope_freq_scale": 0.25}
    y = llamacpp_params({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256})
    assert y == {"rope_scaling_type": 2, "rope_freq_scale": 0.5, "yarn_orig_ctx": 256, "yarn_ext_factor": 1.0,
                 "yarn_attn_factor": 1.0}
    for rule, why in [({"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 64}, "dynamic"),
                      ({"rope_type": "llama3", "factor": 2.0}, "llama3"),
                      ({"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 8,
                        "truncate": False}, "truncates"),
                      ({"rope_type": "linear", "factor": 2.0, "mystery": 1}, "mystery")]:
        with pytest.raises(RuleNotImplemented, match=why):
            llamacpp_params(rule)
    assert vllm_overrides({"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 64}) == {
        "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 64}


def test_prefix_caching_needs_cached_tokens_and_counts_them(tiny):
    rows = run_checks(subject(tiny, hosted("scoring")), BUDGET, ["prefix-caching"])
    assert rows[0].status == "pass" and rows[0].measured["cached_tokens_repeat"] == 160 - 32 \
        and rows[0].measured["cached_tokens_shared"] == 128, rows[0].measured  # whole blocks of 32
    rows = run_checks(subject(tiny, hosted("scoring", "no-prefix-cache")), BUDGET, ["prefix-caching"])
    assert rows[0].status == "skipped" and "no cached tokens" in rows[0].skipped, rows[0].measured


def test_an_engine_that_refuses_gaps_gets_relativity_na_not_a_pass(tiny):
    # llama.cpp keeps a sequence's positions consecutive; without the gap, shifted copies cannot fail an engine
    # that ignores positions, so the row is n/a with the reason (and what it measured), never a pass.
    from posenc.verify.engines import llamacpp_engine

    factory = hosted("logits", "positions-ignored")
    factory.position_gaps = "refuses gaps"
    row = run_checks(subject(tiny, factory), BUDGET, ["relativity"])[0]
    assert row.status == "skipped" and row.skipped.startswith("n/a: needs positions with a gap (refuses gaps)")
    assert row.measured["shifts"] and "gap_effect" not in row.measured
    assert "not continuous" in llamacpp_engine.position_gaps


def test_from_pretrained_takes_every_verify_rule(tiny):
    from posenc.models import Decoder
    from posenc.verify.checks.rules import all_rules, token_logprobs
    from posenc.verify.engines import transformers_engine

    ids = torch.randint(0, 256, (1, 160), generator=torch.Generator().manual_seed(0))
    for name, rule in all_rules(64, 10000.0, 16).items():
        ours = Decoder.from_pretrained(tiny, rope_scaling=rule)
        lp, _ = token_logprobs(ours, ids)
        ref, _ = token_logprobs(transformers_engine(tiny, rule, torch.float32), ids)
        assert float((lp - ref).abs().max()) <= 2e-4, name
    dyn = Decoder.from_pretrained(tiny, rope_scaling=all_rules(64, 10000.0, 16)["dynamic"])
    assert dyn.config["max_position_embeddings"] == 64


@pytest.fixture
def server(tiny, request):
    from tests.helpers.engine_fakes.openai_server import serve

    srv, url = serve(tiny, getattr(request, "param", None))
    yield url
    srv.shutdown()


def test_openai_engine_against_a_local_server(tiny, server):
    from posenc.verify.engines import load_factory

    names = ["pairing", "prefill-decode", "batch-padding", "rules-vs-reference", "prefix-caching", "relativity"]
    rows = {r.name: r for r in run_checks(subject(tiny, load_factory(f"openai:{server}")), BUDGET, names)}
    assert [n for n in names[:4] if rows[n].status != "pass"] == [], {n: rows[n].measured for n in names}
    # the stdlib server reports no cached tokens (usage has no prompt_tokens_details): equal logprobs prove nothing
    assert rows["prefix-caching"].skipped.startswith("n/a: the engine reported no cached tokens")
    assert rows["prefix-caching"].measured["repeat_max_abs_logprob_diff"] <= 2e-4
    assert rows["pairing"].measured["max_abs_logprob_diff"] <= 2e-4
    assert list(rows["rules-vs-reference"].details["per_rule"]) == ["default"]  # the server's rule is fixed
    assert "linear" in rows["rules-vs-reference"].measured["not_implemented"]
    assert rows["relativity"].status == "skipped"


@pytest.mark.parametrize("server, reason", [("http-500", "HTTP 500"), ("not-json", "not JSON")], indirect=["server"])
def test_a_broken_server_fails_rows_with_the_reason(tiny, server, reason):
    from posenc.verify.engines import load_factory

    rows = run_checks(subject(tiny, load_factory(f"openai:{server}")), BUDGET, ["pairing", "batch-padding"])
    assert [r.status for r in rows] == ["FAIL", "FAIL"]
    assert all(reason in r.measured["error"] for r in rows)


def test_an_unreachable_server_is_a_failure_not_a_hang(tiny):
    from posenc.verify.engines import load_factory

    rows = run_checks(subject(tiny, load_factory("openai:http://127.0.0.1:9")), BUDGET, ["pairing"])
    assert rows[0].status == "FAIL" and "no answer from" in rows[0].measured["error"]


def test_scoring_relativity_and_chunked_prefill_pass_a_clean_engine(tiny):
    rows = {r.name: r for r in run_checks(subject(tiny, hosted("scoring", capabilities=SERVING)), BUDGET,
                                          ["relativity", "chunked-prefill"])}
    assert [r.status for r in rows.values()] == ["pass", "pass"], {k: r.measured for k, r in rows.items()}
    rel = rows["relativity"].measured
    assert rel["shifts"] == list(BUDGET.shifts) and rel["gap_effect"] >= 1e-2  # the map moved the later half
    assert all(e["reference"] <= e["tolerance"] for e in rows["relativity"].details["per_shift"].values())
    assert rows["chunked-prefill"].measured["score_reference_diff"] <= 2e-4


@pytest.mark.parametrize("fault, row", [("positions-ignored", "relativity"), ("chunk-restart", "chunked-prefill"),
                                        ("chunk-skip", "chunked-prefill")])
def test_position_faults_of_a_serving_engine_fail_their_row(tiny, fault, row):
    rows = {r.name: r for r in run_checks(subject(tiny, hosted("scoring", fault, capabilities=SERVING)), BUDGET,
                                          ["pairing", row])}
    assert rows["pairing"].status == "pass" and rows[row].status == "FAIL", rows[row].measured
    if fault == "positions-ignored":  # the shifted copies equal the base: only the gap and the reference see it
        assert rows[row].measured["gap_effect"] == 0.0 and rows[row].measured["worst_diff_over_tolerance"] > 1
    else:
        assert rows[row].measured["score_diff"] > 1e-2


def test_engines_without_the_capabilities_say_na(tiny):
    rows = run_checks(subject(tiny, hosted("scoring")), BUDGET, ["relativity", "chunked-prefill"])
    assert [r.status for r in rows] == ["skipped", "skipped"]
    assert "position map" in rows[0].skipped and "chunked prefill" in rows[1].skipped
    rows = run_checks(subject(tiny, hosted("logits")), BUDGET, ["chunked-prefill"])
    assert rows[0].skipped.startswith("n/a: a logits-protocol engine")


def test_one_shared_process_serves_every_rule_and_survives_a_refusal(tiny):
    shared = SharedProcess(EngineProcess(sys.executable, SHARED, {}, timeout=60, load_timeout=120))

    def factory(model_path, rule, dtype):
        return HostedScoringEngine(None, SERVING, shared=shared, config={"model_path": model_path, "rule": rule})
    factory.protocol = "scoring"
    names = ["pairing", "rules-vs-reference", "relativity", "chunked-prefill", "prefix-caching"]
    try:
        rows = {r.name: r for r in run_checks(subject(tiny, factory), BUDGET, names)}
        assert [rows[n].status for n in names] == ["pass"] * 5, {n: rows[n].measured for n in names}
        assert rows["rules-vs-reference"].measured["not_implemented"] == ["linear"]
        assert "refused" in rows["rules-vs-reference"].details["not_implemented"]["linear"]
        assert shared.proc.starts == 1  # a refusal is an answer: the process lives on
        # default, 6 rules (linear refused), default, chunked, default: a rebuild per change, never per call
        assert shared.proc.call("configures") == 10
    finally:
        shared.close()
