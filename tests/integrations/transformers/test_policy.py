"""Cache policies of a patched transformers model under a length-dependent rule, against fresh full forwards.

Oracle: the unpatched model run without a cache over the same tokens (its rotary module rebuilt before each
call), the forward a cache is meant to reproduce. Stock transformers keeps keys and hidden states of the old
table in its cache; the measured gap is asserted to be large, so a policy that behaves like it fails.
"""

import pytest
import torch

pytest.importorskip("transformers")

import posenc  # noqa: E402
from posenc.integrations.transformers import policy as hf_policy  # noqa: E402
from posenc.integrations.transformers import patch, unpatch  # noqa: E402
from tests.helpers.transformers_tiny import VOCAB, cached_vs_full, fresh_full, tiny_model  # noqa: E402

DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}  # L0 = max_position_embeddings = 256
CASES = {"llama": (DYNAMIC, 240, 24), "gemma3": ({"rope_type": "dynamic", "factor": 2.0}, 240, 24),
         "smollm3": (DYNAMIC, 240, 24), "phi3": (None, 56, 16)}  # phi3: LongRoPE, L0 = 64


def _ids(t, b=2):
    return torch.randint(0, VOCAB - 4, (b, t), generator=torch.Generator().manual_seed(2))


@pytest.mark.parametrize("family", sorted(CASES))
def test_recompute_equals_a_fresh_full_forward_where_transformers_does_not(family):
    rope, prompt, steps = CASES[family]
    model = tiny_model(family, rope, dtype=torch.float64)
    full = fresh_full(model)
    stock, stock_ids = cached_vs_full(model, full, _ids(prompt), steps)
    patch(model)
    ours, ids = cached_vs_full(model, full, _ids(prompt), steps)
    assert stock > 1e-3, stock  # transformers: the cache keeps the old table
    assert ours < 1e-9, ours


def test_a_recompute_that_keeps_the_cache_like_transformers_is_caught(monkeypatch):
    """Mutation: 'recompute' that never re-runs the cached tokens (transformers' behaviour) must fail."""
    decide = hf_policy.decide
    monkeypatch.setattr(hf_policy, "decide", lambda *a: (decide(*a)[0], False))
    import posenc.integrations.transformers.decoder as decoder

    monkeypatch.setattr(decoder, "decide", hf_policy.decide)
    model = patch(tiny_model("llama", DYNAMIC, dtype=torch.float64))
    worst, _ = cached_vs_full(model, fresh_full(model), _ids(240), 24)
    assert worst > 1e-3


def test_freeze_keeps_the_prefill_table():
    """Prefill below L0: the frozen table is the default one, so the oracle is the unscaled model."""
    model = tiny_model("llama", DYNAMIC, dtype=torch.float64)
    unscaled = tiny_model("llama", {"rope_type": "default", "rope_theta": 10000.0}, dtype=torch.float64)
    patch(model, policy="freeze")
    worst, _ = cached_vs_full(model, fresh_full(unscaled), _ids(240), 24)
    assert worst < 1e-9


def test_rerotate_turns_the_cached_keys_to_the_new_table():
    """One layer: its cached keys are all the cache carries of the old table, so re-rotating them is exact."""
    model = tiny_model("llama", DYNAMIC, dtype=torch.float64, num_hidden_layers=1)
    full = fresh_full(model)
    stock, _ = cached_vs_full(model, full, _ids(240), 24)
    patch(model, policy="rerotate")
    ours, _ = cached_vs_full(model, full, _ids(240), 24)
    assert stock > 1e-3 and ours < 1e-9, (stock, ours)


def test_refuse_raises_at_the_first_table_change():
    model = patch(tiny_model("llama", DYNAMIC), policy="refuse")
    with torch.no_grad():
        out = model(_ids(255), use_cache=True)  # length 255, then 256: still the default table
        out = model(_ids(1), cache=out.cache, use_cache=True)
        with pytest.raises(posenc.PosencError, match="policy='refuse'.*length 257"):
            model(_ids(1), cache=out.cache, use_cache=True)


def _decode_lengths(model):
    lengths = []
    forward = model.forward
    model.forward = lambda *a, **k: lengths.append(k["input_ids"].shape[1]) or forward(*a, **k)
    return lengths


def test_phi3_keeps_its_cache_across_the_longrope_switch_and_generate_matches_no_cache():
    model = tiny_model("phi3")
    ids = _ids(56, b=1)
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=16, do_sample=False, use_cache=False)
        stock_lengths = _decode_lengths(model)
        model.generate(ids, max_new_tokens=16, do_sample=False)
        del model.forward
        patch(model)
        lengths = _decode_lengths(model)
        ours = model.generate(ids, max_new_tokens=16, do_sample=False)
    assert max(stock_lengths[1:]) > 1  # transformers dropped its cache and re-fed the prompt
    assert lengths[1:] == [1] * 15  # patched: one token per step, the cache kept
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("mode", ["greedy", "beam", "assisted"])
def test_generate_under_dynamic_ntk_matches_generate_without_cache(mode):
    model, helper = tiny_model("llama", DYNAMIC), tiny_model("llama", DYNAMIC, seed=3)
    ids = _ids(248, b=1 if mode == "assisted" else 2)
    kwargs = {"greedy": {}, "beam": dict(num_beams=2), "assisted": dict(assistant_model=helper)}[mode]
    with torch.no_grad():
        reference = model.generate(ids, max_new_tokens=14, do_sample=False, use_cache=False,
                                   **{k: v for k, v in kwargs.items() if k != "assistant_model"})
        patch(model)
        ours = model.generate(ids, max_new_tokens=14, do_sample=False, **kwargs)
        unpatch(model)
        stock = model.generate(ids, max_new_tokens=14, do_sample=False, **kwargs)
    assert torch.equal(ours, reference)
    assert ours.shape == stock.shape
