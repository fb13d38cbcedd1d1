"""The patch on the embedded SmolLM2-135M (transformers' LlamaForCausalLM on posenc's loaded weights).

Oracles: the unpatched model (length-independent rule: identical tokens and logits) and the unpatched model
run without a cache (dynamic NTK: what every cached step should equal). The issue's full measurement
(L0 = 256, a 240-token prompt, 40 steps: stock 10.3 logits off, recompute 4e-5) runs with POSENC_SLOW=1.
"""

import os

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

import posenc  # noqa: E402
from posenc.integrations.transformers import patch  # noqa: E402
from tests.helpers.transformers_tiny import cached_vs_full, fresh_full  # noqa: E402


@pytest.fixture(scope="module")
def reader():
    from posenc.verify.engines import CheckpointReader

    return CheckpointReader()  # the GGUF file is read and dequantized once for the module


def _model(reader, rope_scaling=None):
    from posenc.models import embedded_model_path, to_transformers
    from posenc.verify.engines import posenc_engine

    try:
        path = embedded_model_path()
    except posenc.PosencError:
        pytest.skip("the embedded model is not installed")
    return to_transformers(posenc_engine(str(path), rope_scaling, torch.float32, reader=reader))


@pytest.fixture(scope="module")
def text_ids():
    import pydoc_data.topics

    from posenc.models import embedded_model_path, load_tokenizer

    topics = pydoc_data.topics.topics
    text = "\n".join(topics[key] for key in sorted(topics))[:6000]
    return torch.tensor([load_tokenizer(embedded_model_path()).encode(text)[:240]])  # [1, 240]


def test_smollm2_patched_gives_the_same_tokens_and_logits(text_ids, reader):
    model = _model(reader)
    ids = text_ids[:, :64]
    with torch.no_grad():
        stock = model(ids).logits
        stock_gen = model.generate(ids, max_new_tokens=10, do_sample=False)
        patch(model)
        ours = model(ids).logits
        ours_gen = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert torch.equal(ours_gen, stock_gen)
    assert (ours - stock).abs().max().item() <= 1e-5


def _gap(reader, text_ids, l0, prompt, steps):
    model = _model(reader, {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": l0})
    full = fresh_full(model)
    stock, _ = cached_vs_full(model, full, text_ids[:, :prompt], steps)
    patch(model)
    ours, _ = cached_vs_full(model, full, text_ids[:, :prompt], steps)
    return stock, ours


def test_smollm2_dynamic_ntk_cached_steps_equal_a_fresh_full_forward(text_ids, reader):
    stock, ours = _gap(reader, text_ids, l0=64, prompt=56, steps=10)
    assert stock > 0.1, stock  # transformers' cache keeps the old table
    assert ours < 1e-4, ours


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("POSENC_SLOW"), reason="slow (3 min): set POSENC_SLOW=1 to run")
def test_smollm2_dynamic_ntk_at_the_issues_lengths(text_ids, reader):
    stock, ours = _gap(reader, text_ids, l0=256, prompt=240, steps=40)
    assert stock > 1.0, stock
    assert ours < 1e-4, ours
