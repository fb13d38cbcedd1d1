"""A static cache (`generate(cache_implementation="static")`) under policy "recompute" with a length-dependent
rule: when the table changes, the cached tokens run again into the static cache's own slots.

Oracle: the model's fresh full forward over the whole sequence so far, without a cache (same positions and
padding as `generate()` gives the cached run); for one unpadded row also the unpatched transformers model
run without a cache (`fresh_full`). Every step's logits (`output_logits`) must be within 1e-4 of it, and the
tokens those of the same run with a dynamic cache. The decoding crosses the rule's switch (dynamic NTK past
L0 = 16; Phi-3's LongRoPE across original_max_position_embeddings = 64), and a run that keeps the cache as
stock transformers does is shown to miss the oracle by far more. Also: a length-dependent rule whose table
stays the same across lengths keeps its held table (no table made again at each step).
"""

import pytest
import torch

pytest.importorskip("transformers")

import posenc  # noqa: E402
from posenc.integrations.transformers import patch, unpatch  # noqa: E402
from posenc.integrations.transformers import policy as hf_policy  # noqa: E402
from tests.helpers.transformers_tiny import VOCAB, fresh_full, sharpen, tiny_model  # noqa: E402

DYNAMIC = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
GEN = dict(do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)


def _ids(b, t, seed=3):
    return torch.randint(3, VOCAB - 4, (b, t), generator=torch.Generator().manual_seed(seed))


def _mistral(window):
    """A tiny Mistral whose every layer slides (a static cache of `StaticSlidingWindowLayer`s)."""
    import transformers

    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                        sliding_window=window, rope_parameters=DYNAMIC, attn_implementation="sdpa")
    torch.manual_seed(0)
    return sharpen(transformers.MistralForCausalLM(config)).eval()


def _full_logits(model, seq, mask, n):
    """Last-token logits of a fresh full forward over the first `n` tokens, positions as generate() makes them."""
    m = mask[:, :n]
    positions = (m.long().cumsum(-1) - 1).masked_fill(m == 0, 1)
    return model(seq[:, :n], attention_mask=m, position_ids=positions, use_cache=False).logits[:, -1]


@torch.no_grad()
def _static_vs_full(model, ids, mask, new):
    """`(worst |static step - fresh full|, static run, dynamic run)`."""
    static = model.generate(ids, attention_mask=mask, cache_implementation="static", max_new_tokens=new, **GEN)
    dynamic = model.generate(ids, attention_mask=mask, max_new_tokens=new, **GEN)
    seq, t = static.sequences, ids.shape[1]
    full_mask = torch.cat((mask, mask.new_ones(mask.shape[0], seq.shape[1] - t)), 1)
    worst = max((_full_logits(model, seq, full_mask, t + i) - logits).abs().max().item()
                for i, logits in enumerate(static.logits))
    return worst, static, dynamic


CASES = {  # name: (model, prompt length, new tokens, left padding of row 1 or None for one row)
    "llama": (lambda: tiny_model("llama", DYNAMIC, max_position_embeddings=16), 12, 8, None),
    "llama, left-padded batch": (lambda: tiny_model("llama", DYNAMIC, max_position_embeddings=16), 12, 8, 3),
    "phi3 longrope": (lambda: tiny_model("phi3"), 60, 8, None),
    "mistral sliding window 8": (lambda: _mistral(8), 12, 8, 2),
    "gemma3 sliding and full layers": (lambda: tiny_model("gemma3", {"rope_type": "dynamic", "factor": 2.0},
                                                          max_position_embeddings=16), 12, 8, 3),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_static_cache_recompute_equals_a_fresh_full_forward(case):
    build, t, new, pad = CASES[case]
    model = build()
    ids = _ids(1 if pad is None else 2, t)
    mask = torch.ones_like(ids)
    if pad is not None:
        mask[1, :pad] = 0
    oracle = fresh_full(model) if pad is None else None  # unpatched transformers, no cache
    patch(model)
    worst, static, dynamic = _static_vs_full(model, ids, mask, new)
    assert worst < 1e-4, worst
    assert torch.equal(static.sequences, dynamic.sequences)
    if oracle is not None:  # the patched full forward is transformers' own
        seq = static.sequences
        gap = max((oracle(seq[:, :t + i]) - logits).abs().max().item() for i, logits in enumerate(static.logits))
        assert gap < 1e-4, gap
    assert "prepare_inputs_for_generation" in model.__dict__  # the hook that keeps generate()'s 2-d mask
    unpatch(model)
    assert "prepare_inputs_for_generation" not in model.__dict__  # unpatch puts the class's method back


def test_a_static_recompute_that_keeps_the_cache_is_caught(monkeypatch):
    """Mutation: no re-run (the static cache keeps keys of the old table, as stock) misses the oracle."""
    import posenc.integrations.transformers.decoder as decoder

    decide = hf_policy.decide
    monkeypatch.setattr(decoder, "decide", lambda *a: (decide(*a)[0], False))
    model = patch(tiny_model("llama", DYNAMIC, max_position_embeddings=16))
    worst, _, _ = _static_vs_full(model, _ids(1, 12), torch.ones(1, 12, dtype=torch.long), 8)
    assert worst > 1e-3, worst


def test_a_prepared_mask_outside_generate_is_refused_by_name():
    """A manual cached forward that must re-run, given a 4-d mask and no 2-d one to read, raises PosencError."""
    from transformers import StaticCache

    model = patch(tiny_model("llama", DYNAMIC, max_position_embeddings=16))
    cache = StaticCache(config=model.config, max_cache_len=24)
    ids = _ids(1, 16)
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        mask = torch.ones(1, 1, 1, 24, dtype=torch.bool)
        with pytest.raises(posenc.PosencError, match="attention_mask: expected None or a \\[b, 17\\]"):
            model(ids[:, :1], cache=cache, attention_mask=mask, position_ids=torch.tensor([[16]]), use_cache=True)


def test_rerotate_with_a_static_cache_is_refused_when_generate_starts():
    model = patch(tiny_model("llama", DYNAMIC, max_position_embeddings=16), policy="rerotate")
    with torch.no_grad(), pytest.raises(posenc.PosencError, match="DynamicCache for policy='rerotate'"):
        model.generate(_ids(1, 12), cache_implementation="static", max_new_tokens=8, do_sample=False, pad_token_id=0)
    unpatch(model)


@pytest.mark.parametrize("family, prompt", [("phi3", 66), ("llama", 8)])
def test_a_length_dependent_rule_keeps_its_table_while_the_table_stays_the_same(family, prompt, monkeypatch):
    """Phi-3's LongRoPE past L0 = 64, dynamic NTK below L0 = 16: each step has another length, not another
    table, so no table is made again (the steps still equal a fresh full forward, above and in test_policy)."""
    model = patch(tiny_model(family, None if family == "phi3" else DYNAMIC, max_position_embeddings=16 if
                             family == "llama" else 256))
    made, real_table = [], posenc.Rope.table
    monkeypatch.setattr(posenc.Rope, "table", lambda self, *a, **k: made.append(a) or real_table(self, *a, **k))
    with torch.no_grad():
        out = model(_ids(1, prompt), use_cache=True)
        model(_ids(1, 1, seed=5), cache=out.cache, use_cache=True)  # the table's rows double at most once here
        made.clear()
        for seed in (6, 7):
            model(_ids(1, 1, seed=seed), cache=out.cache, use_cache=True)
    assert made == []
