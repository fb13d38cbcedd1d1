"""posenc verify against the real engines, out of process (opt-in: `POSENC_REAL_ENGINES=1 pytest -m engines
tests/test_engines_real.py`, after `posenc setup-engine vllm` and `posenc setup-engine llama-cpp`; about 6 min
on 2 cores). CI skips them with the reason: no engine virtual environments, and they take minutes."""

import os
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.engines
if os.environ.get("POSENC_REAL_ENGINES") != "1":
    pytest.skip("real engines are opt-in: POSENC_REAL_ENGINES=1 pytest -m engines tests/test_engines_real.py",
                allow_module_level=True)

from posenc.verify import run_checks  # noqa: E402
from posenc.verify.checks.common import BUDGETS  # noqa: E402
from posenc.verify.engines import llamacpp_engine, vllm_engine  # noqa: E402
from posenc.verify.engines.process import EngineFailure, EngineProcess  # noqa: E402
from posenc.verify.engines.setup import engine_dir  # noqa: E402


def need(name):
    if not (engine_dir(name) / "venv" / "bin" / "python").exists():
        pytest.skip(f"{name} is not set up: posenc setup-engine {name}")


@pytest.fixture(scope="module")
def model():
    from posenc.models import embedded_model_path

    return str(embedded_model_path())


def subject_for(model, factory, name):
    from posenc.verify.runner import build_subject

    return build_subject(model, factory, engine_name=name, dtype=torch.float32, tokens=24000)[0]


def test_llamacpp_q4_1_segfault_is_contained(model):
    need("llama-cpp")
    from posenc.verify.engines.hosted import HERE
    from posenc.verify.engines.setup import engine_python

    proc = EngineProcess(engine_python("llama-cpp"), str(HERE / "llamacpp_side.py"),
                         {"model_path": model, "ctx_params": {}}, timeout=120, load_timeout=300)
    try:
        with pytest.raises(EngineFailure, match="SIGSEGV"):
            proc.call("forward", ids=torch.arange(100, 132, dtype=torch.int32)[None].numpy())
    finally:
        proc.close()


def test_llamacpp_every_rule_it_implements_matches_the_reference(model):
    need("llama-cpp")
    rows = {r.name: r for r in run_checks(subject_for(model, llamacpp_engine, "llama-cpp"), BUDGETS["quick"],
                                          ["rules-vs-reference", "relativity", "batch-padding"])}
    assert all(r.passed for r in rows.values()), {k: r.measured for k, r in rows.items()}
    rules = rows["rules-vs-reference"]
    assert sorted(rules.details["per_rule"]) == ["default", "linear", "ntk", "yarn"]
    assert rules.measured["not_implemented"] == ["dynamic", "llama3", "longrope", "yarn-untruncated"]


def test_vllm_scoring_rows_and_its_yarn_table_overrun(model):
    need("vllm")
    rows = {r.name: r for r in run_checks(subject_for(model, vllm_engine, "vllm"), BUDGETS["quick"],
                                          ["pairing", "prefill-decode", "batch-padding", "prefix-caching"])}
    assert all(r.passed for r in rows.values()), {k: r.measured for k, r in rows.items()}
    assert rows["pairing"].measured["max_abs_logprob_diff"] <= 2e-4
    assert rows["prefix-caching"].measured["cached_tokens_repeat"] > 0  # the cache was really read


def test_vllm_yarn_is_right_inside_its_table_and_wrong_past_it(model):
    # vLLM 0.32 (CPU) sizes YaRN's cos/sin cache at original * factor = 512 rows while max_model_len is 4096
    need("vllm")
    from posenc.verify.checks.common import boundary_rules
    from posenc.verify.checks.rules import token_logprobs
    from posenc.verify.engines import transformers_engine

    s = subject_for(model, vllm_engine, "vllm")
    rule = boundary_rules(256, s.theta, s.head_dim)["yarn"]
    ids = s.text(640, offset=30000)
    ours, _ = token_logprobs(vllm_engine(model, rule, torch.float32), ids)
    ref, _ = token_logprobs(transformers_engine(model, rule, torch.float32), ids)
    diff = (ours - ref).abs().nan_to_num(float("inf"))  # entry j predicts token j + 1 at position j
    assert float(diff[:511].max()) <= 2e-4
    assert float(diff[511:].max()) > 1.0
