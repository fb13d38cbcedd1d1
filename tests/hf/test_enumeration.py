"""Every model type of the pinned transformers with a rotary class, against posenc (tests/helpers/hf_enumeration.py).

The committed summary in docs/hf.md is the record: a transformers upgrade (or a change in posenc) that moves any
model type to another outcome fails here, naming the model types that moved; regenerate the summary with
`PYTHONPATH=src python3 -m tests.helpers.hf_enumeration_summary` and review the diff. Independently of the record, no model type
may differ or crash, at least 95 % of those transformers can build must be exact, and every refusal must name
what posenc does not model (never "unknown model type").
"""

from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
from tests.helpers.hf_enumeration import enumerate_all  # noqa: E402
from tests.helpers.hf_enumeration_summary import parse_summary  # noqa: E402

DOC = Path(__file__).resolve().parents[2] / "docs" / "hf.md"
PINNED = "5.24.0"


@pytest.fixture(scope="module")
def outcomes():
    return enumerate_all()


def test_no_model_type_differs_or_crashes(outcomes):
    bad = [(o.model_type, o.outcome, o.detail) for o in outcomes if o.outcome in ("differs", "crash")]
    assert not bad, bad


def test_at_least_95_percent_exact(outcomes):
    ref = [o for o in outcomes if o.outcome != "no reference"]
    exact = [o for o in ref if o.outcome == "exact"]
    assert len(ref) > 200  # the enumeration found the rotary classes (a broken search would pass vacuously)
    assert len(exact) >= 0.95 * len(ref), sorted(o.model_type for o in ref if o.outcome != "exact")


def test_refusals_name_what_posenc_does_not_model(outcomes):
    vague = [(o.model_type, o.detail) for o in outcomes if o.outcome == "refused"
             and ("known RoPE model types" in o.detail or "key missing" in o.detail)]
    assert not vague, vague


# exact types whose model-level facts `posenc inspect` cannot state: the sizes it needs are not in the config
NOT_INSPECTABLE = {"recurrent_gemma": "no max_position_embeddings (its attention is windowed, its length unbounded)"}


def test_inspect_works_for_every_exact_model_type(outcomes):
    from transformers import AutoConfig

    from posenc.inspection import inspect_model

    failed = []
    for o in outcomes:
        if o.outcome != "exact" or o.sub_config or o.model_type in NOT_INSPECTABLE:
            continue
        config = AutoConfig.for_model(o.model_type, **dict(o.overrides))
        report = inspect_model(config, lengths=[4096], dtypes=("fp16",))
        heads = [r["head_dim"] for r in report["rope"]]
        if not report["rope"] or report["kv_cache"]["layers"] < 1 or not heads:
            failed.append(o.model_type)
    assert not failed, failed


@pytest.mark.skipif(transformers.__version__ != PINNED, reason="the committed record is for the pinned transformers")
def test_outcomes_match_the_committed_record(outcomes):
    record = parse_summary(DOC.read_text())
    now = {o.model_type: o.outcome for o in outcomes}
    moved = {t: (record.get(t), now.get(t)) for t in sorted(set(record) | set(now)) if record.get(t) != now.get(t)}
    assert not moved, f"model types whose outcome changed (record -> now): {moved}"
