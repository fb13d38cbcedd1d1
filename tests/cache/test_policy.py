"""Policies for length-dependent scalings under a cache, and cache surgery (windows, sinks, shifts) in a model.

"recompute" is exact (tested in test_decoder.py across the switch); here: "rerotate" makes first-layer keys
exact and its whole-model gap is measured and recorded; "freeze" equals a model whose table never moves;
"refuse" raises and changes nothing. Float64, tolerance TOL[float64] = 1e-10.
"""

import pytest
import torch

import posenc
from posenc.models import Decoder
from tests.helpers.tolerances import assert_close
from tests.models.test_decoder import L0, config, model, reference_logits, rms, tokens

LENGTH_DEPENDENT = ("dynamic", "longrope")


def first_layer_keys(m, ids, positions, seq_len):
    """Independent: layer-0 keys of a full forward, `rotate(k_proj(norm(embed(ids))))` at the full length."""
    layer = m.layers[0]
    x = rms(m.embed_tokens.weight[ids], layer.input_layernorm.weight, layer.input_layernorm.eps)  # [t, hidden]
    k = (x @ layer.self_attn.k_proj.weight.T).view(len(ids), m.num_kv_heads, m.head_dim).transpose(0, 1)
    return m.rope.rotate(k[None], positions, seq_len=seq_len)[0]  # [hk, t, d]


def decode(m, ids, prefill, policy, store):
    """Prefill `prefill` tokens, then one token at a time; return the cache and every step's logits."""
    cache = m.new_cache(ids.shape[0], ids.shape[1], store=store, policy=policy)
    steps = [m(ids[:, :prefill], cache=cache)[:, -1:]]
    steps += [m(ids[:, j:j + 1], cache=cache) for j in range(prefill, ids.shape[1])]
    return cache, torch.cat(steps, 1)  # [b, 1 + n - prefill, vocab]


def full_steps(m, ids, prefill):
    """A full forward over each prefix, last row: what every decode step should give."""
    return torch.cat([m(ids[:, :j + 1])[:, -1:] for j in range(prefill - 1, ids.shape[1])], 1)


@pytest.mark.parametrize("name", LENGTH_DEPENDENT)
@pytest.mark.parametrize("store", ["rotated", "unrotated"])
@torch.no_grad()
def test_rerotate_first_layer_keys_are_exact_and_the_gap_is_recorded(name, store, record_property):
    m, ids, prefill = model(name), tokens((2, 2 * L0)), L0 - 2
    cache, steps = decode(m, ids, prefill, "rerotate", store)
    n = ids.shape[1]
    full_cache = m.new_cache(2, n)
    full = m(ids, cache=full_cache)
    keys, values = cache.read(0)
    assert_close(keys, full_cache.read(0)[0])
    assert_close(values, full_cache.read(0)[1])
    for row in range(2):
        assert_close(keys[row], first_layer_keys(m, ids[row], torch.arange(n), n))
    assert cache.table_len.tolist() == [n, n]
    # Deeper layers were computed under the old tables: rerotate is not a full forward. Measure, never hide.
    reference = full_steps(m, ids, prefill)
    gap = (steps - reference).abs().max().item()
    before = (steps[:, : L0 - prefill + 1] - reference[:, : L0 - prefill + 1]).abs().max().item()
    record_property(f"rerotate_gap_{name}_{store}", gap)
    print(f"\nrerotate {name}/{store}: max |logit - full forward| = {gap:.3e} (up to length L0: {before:.1e})")
    assert before < 1e-10 < gap  # exact until the first switch, then the documented gap
    assert_close(full[:, -1:], m(ids)[:, -1:])


@pytest.mark.parametrize("name", LENGTH_DEPENDENT)
@pytest.mark.parametrize("store", ["rotated", "unrotated"])
@torch.no_grad()
def test_rerotate_is_exact_for_one_layer(name, store):
    m, ids, prefill = model(name, layers=1), tokens((2, L0 + 6)), L0 - 3
    _, steps = decode(m, ids, prefill, "rerotate", store)
    assert_close(steps, full_steps(m, ids, prefill))  # one layer: keys depend on token and position only


@pytest.mark.parametrize("store", ["rotated", "unrotated"])
@torch.no_grad()
def test_freeze_keeps_the_table_chosen_at_prefill(store, record_property):
    ids, prefill = tokens((2, 2 * L0)), L0 // 2
    # dynamic NTK frozen below L0 is the unscaled table; LongRoPE frozen below L0 keeps its short factors
    short = dict(config("longrope")["rope_scaling"])
    short["long_factor"] = short["short_factor"]
    frozen_twins = {
        "dynamic": model("default"),
        "longrope": Decoder.from_hf_config(config("longrope") | {"rope_scaling": short}, seed=0).double(),
    }
    for name, twin in frozen_twins.items():
        m = model(name)
        assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), twin.state_dict().values()))
        cache, steps = decode(m, ids, prefill, "freeze", store)
        assert_close(steps, full_steps(twin, ids, prefill))
        assert cache.table_len.tolist() == [prefill, prefill]
        gap = (steps - full_steps(m, ids, prefill)).abs().max().item()
        record_property(f"freeze_gap_{name}_{store}", gap)
        print(f"\nfreeze {name}/{store}: max |logit - full forward| = {gap:.3e}")
        assert gap > 1e-10


@pytest.mark.parametrize("name", LENGTH_DEPENDENT)
@torch.no_grad()
def test_refuse_raises_at_the_switch_and_changes_nothing(name):
    m, ids = model(name), tokens((2, L0 + 2))
    cache = m.new_cache(2, L0 + 2, policy="refuse")
    m(ids[:, : L0 - 1], cache=cache)
    m(ids[:, L0 - 1:L0], cache=cache)  # length L0: still the original table
    state = [cache.positions.clone(), cache.lengths.clone(), cache.table_len.clone()] + [k.clone() for k in cache.k]
    with pytest.raises(posenc.PosencError, match="policy: expected a table that stays the same.*length 17"):
        m(ids[:, L0:L0 + 1], cache=cache)
    after = [cache.positions, cache.lengths, cache.table_len] + cache.k
    assert all(torch.equal(a, b) for a, b in zip(state, after))


@torch.no_grad()
def test_a_request_does_not_depend_on_its_batch():
    m = model("longrope")  # vLLM #6283: long factors for the whole batch when one request is long
    short, long = tokens((1, 6), seed=2), tokens((1, L0 + 5), seed=3)
    ids = torch.cat((torch.zeros(1, L0 - 1, dtype=torch.long), short), 1)  # left-padded to the long row
    mask = torch.cat((torch.zeros(1, L0 - 1), torch.ones(1, 6)), 1).long()
    batched = m(torch.cat((ids, long)), attention_mask=torch.cat((mask, torch.ones_like(mask))))
    assert_close(batched[0, -6:], m(short)[0])
    assert_close(batched[1], m(long)[0])


@torch.no_grad()
def test_recompute_needs_the_cached_token_ids():
    m = model("dynamic")
    cache = m.new_cache(1, L0 + 2)
    m(tokens((1, L0)), cache=cache)
    cache.tokens.fill_(-1)  # as if the keys had been written through the KVCache API alone
    with pytest.raises(posenc.PosencError, match="token ids in every cached slot"):
        m(tokens((1, 1)), cache=cache)


# ------------------------------------------------------------------ windows, sinks and shifts inside a model
@pytest.mark.parametrize("sinks", [0, 2])
@torch.no_grad()
def test_sliding_window_with_sinks_equals_a_windowed_full_forward(sinks):
    m, window, n = model("default"), 6, 15
    ids = tokens((1, n))
    cache = m.new_cache(1, window + sinks + 1, store="rotated")
    m(ids[:, :window], cache=cache)  # a prompt no longer than the window: plain causal is windowed already
    for j in range(window, n):
        cache.keep_recent(window - 1, sinks=sinks)  # the next query sees window - 1 cached tokens and itself
        step = m(ids[:, j:j + 1], cache=cache)
        visible = lambda q, k: k <= q and (k < sinks or k > q - window)  # noqa: E731
        expected = reference_logits(m, ids[0, :j + 1], torch.arange(j + 1), visible)[-1]
        assert_close(step[0, 0], expected, msg=f"position {j}")
    assert cache.positions[0, : window + sinks].tolist() == list(range(sinks)) + list(range(n - window, n))


ONE_LAYER_ENCODINGS = {
    "default": None,
    "partial_yarn": posenc.Rope(head_dim=12, rotary_dim=8, scaling=posenc.YaRN(factor=4.0, original_max_positions=L0)),
    "interleaved": posenc.Rope(head_dim=12, pairing="interleaved"),
}


@pytest.mark.parametrize("encoding", list(ONE_LAYER_ENCODINGS))
@pytest.mark.parametrize("store", ["rotated", "unrotated"])
@torch.no_grad()
def test_shifted_cache_equals_reencoding_the_kept_tokens(encoding, store):
    m = Decoder.from_hf_config(config("default", num_hidden_layers=1), encoding=ONE_LAYER_ENCODINGS[encoding],
                               seed=0).double()
    ids, nxt = tokens((2, 12)), tokens((2, 1), seed=9)
    cache = m.new_cache(2, 13, store=store)
    m(ids, cache=cache)
    cache.keep_recent(5, sinks=2, shift=True)  # StreamingLLM: keep 0, 1 and the last 5, renumbered 0..6
    assert cache.positions[:, :8].tolist() == [list(range(7)) + [-1]] * 2
    kept = torch.cat((ids[:, :2], ids[:, -5:], nxt), 1)
    # one layer: cached keys and values depend only on token and position, so this is a full re-encoding
    assert_close(m(nxt, cache=cache), m(kept)[:, -1:])


@pytest.mark.parametrize("policy", ["recompute", "rerotate"])
@torch.no_grad()
def test_shift_gives_the_same_model_output_for_both_stores(policy):
    m, ids, nxt = model("longrope"), tokens((2, L0 + 4)), tokens((2, 2), seed=9)
    outs = []
    for store in ("rotated", "unrotated"):
        cache = m.new_cache(2, L0 + 6, store=store, policy=policy)
        m(ids, cache=cache)
        cache.keep_recent(6, sinks=4, shift=True)  # 10 kept tokens at 0..9, keys still on the long table
        # the next step (length 11 <= L0) returns to the short factors: re-run, or rotate shifted keys again
        outs.append(torch.cat([m(nxt[:, j:j + 1], cache=cache) for j in range(2)], 1))
        assert cache.positions[0, :12].tolist() == list(range(12))
    assert_close(outs[0], outs[1])
