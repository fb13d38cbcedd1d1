"""Tests written for mutants that `tools/mutate.py` found surviving the rest of the suite (see docs/mutation.md).

Each test names the mutant it kills (file:line as found, the mutation); the behaviour it pins is documented.
"""

import pytest
import torch
from conftest import assert_close

from posenc import (PosencError, Rope, apply_rope, mrope_position_ids, mrope_segment_positions,
                    vision_patch_positions)
from posenc.cache import KVCache


def test_fresh_cache_marks_every_slot_empty_and_unknown():
    """cache `self.tokens = torch.full(..., -1)`, mutant -1 -> 0: a fresh slot's token id is unknown (-1)."""
    cache = KVCache(2, 3, 1, 4, capacity=5)
    assert torch.equal(cache.tokens, torch.full((3, 5), -1))
    assert torch.equal(cache.positions, torch.full((3, 5), -1))
    cache.reserve(torch.tensor([[7, 8]]).expand(3, 2))  # positions without token ids: the ids stay unknown
    assert torch.equal(cache.tokens, torch.full((3, 5), -1))
    assert torch.equal(cache.positions[:, :2], torch.tensor([[7, 8]] * 3))
    # `clear` (mutant: tokens[rows] = -1 -> 0): a cleared row is empty and its ids unknown again
    cache.reserve(torch.tensor([[9]]).expand(3, 1), tokens=torch.tensor([[4], [5], [6]]))
    cache.clear(torch.tensor([True, False, True]))
    assert torch.equal(cache.tokens[:, 2], torch.tensor([-1, 5, -1]))
    assert torch.equal(cache.positions[0], torch.full((5,), -1)) and cache.lengths.tolist() == [0, 3, 0]


@pytest.mark.parametrize("store", ["rotated", "unrotated"])
def test_move_to_position_zero(store):
    """cache `move`: `new_positions < 0` refused, mutant `< 1`: moving a kept key to position 0 is valid and exact."""
    rope = Rope(head_dim=8)
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, 2, 3, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(1, 2, 3, 8, generator=gen, dtype=torch.float64)
    moved, direct = (KVCache(1, 1, 2, 8, capacity=4, rope=rope, store=store, dtype=torch.float64) for _ in range(2))
    moved.write(0, k, v, moved.reserve(torch.tensor([[5, 6, 7]])))
    moved.move(torch.tensor([[0, 1, 2, -1]]))
    direct.write(0, k, v, direct.reserve(torch.tensor([[0, 1, 2]])))
    assert torch.equal(moved.positions, torch.tensor([[0, 1, 2, -1]]))
    assert_close(moved.read(0)[0], direct.read(0)[0], dtype=torch.float32)  # keys rotated by -5 in float32 tables


def test_dropped_slots_become_empty_and_unknown():
    """cache `keep`: dropped slots' token ids masked to -1, mutant -1 -> -2: a rolled-back slot is unknown again."""
    cache = KVCache(1, 2, 1, 4, capacity=4)
    cache.reserve(torch.tensor([[3, 4, 5], [0, 1, 2]]), tokens=torch.tensor([[10, 11, 12], [20, 21, 22]]))
    cache.rollback(torch.tensor([1, 2]))
    assert torch.equal(cache.tokens, torch.tensor([[10, 11, -1, -1], [20, -1, -1, -1]]))
    assert torch.equal(cache.positions, torch.tensor([[3, 4, -1, -1], [0, -1, -1, -1]]))
    assert torch.equal(cache.lengths, torch.tensor([2, 1]))


def test_apply_rope_refuses_an_integer_sin_table():
    """rope/apply.py `check_table`: mutant dropping `check_float_tensor("sin", sin)` rotated by an integer table."""
    x = torch.ones(1, 1, 2, 4)
    cos, sin = Rope(head_dim=4).cos_sin(torch.arange(2))
    with pytest.raises(PosencError, match=r"^sin: expected a floating-point dtype.*dtype torch\.int64$"):
        apply_rope(x, cos, sin.long())
    with pytest.raises(PosencError, match=r"^sin: expected a floating-point torch\.Tensor, got list$"):
        apply_rope(x, cos, sin.tolist())


def test_layout_td_is_one_sequence_of_one_head():
    """rope/apply.py LAYOUTS["td"] = (2, ...), mutant 2 -> 3: `[t, d]` input (one head, no batch) is accepted."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 8, generator=gen)
    cos, sin = Rope(head_dim=8).cos_sin(torch.arange(3, 8))  # [5, 4]
    got = apply_rope(x, cos, sin, layout="td")
    assert got.shape == (5, 8)
    assert torch.equal(got, apply_rope(x[None, None], cos, sin)[0, 0])  # the bhtd result of the same head
    with pytest.raises(PosencError, match=r"^x: expected a tensor of rank 2"):
        apply_rope(x[None], cos, sin, layout="td")


def test_empty_text_segment_adds_no_positions():
    """rope/mrope_positions.py: a text segment's count may be 0 (mutant: min 0 -> 1 refused it)."""
    pos, nxt = mrope_segment_positions([("text", 2), ("text", 0), ("text", 1)], start=4)
    assert pos.tolist() == [[4, 5, 6]] * 3 and nxt == 7
    with pytest.raises(PosencError, match=r"^segments\[0\]"):
        mrope_segment_positions([("text", -1)])


def test_decoder_rms_norm_eps_defaults_to_transformers_llama():
    """hf/facts.py `cfg.get("rms_norm_eps", 1e-6)`, mutant 2e-06: a config without the key gets LlamaConfig's 1e-6."""
    from posenc.models import Decoder

    transformers = pytest.importorskip("transformers")
    cfg = {"model_type": "llama", "vocab_size": 11, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
    model = Decoder.from_hf_config(cfg, seed=0)
    eps = {m.eps for m in model.modules() if hasattr(m, "eps")}
    assert eps == {transformers.LlamaConfig().rms_norm_eps} == {1e-6}


def test_falcon_is_labelled_multi_query():
    """hf/facts.py `"mqa" if kv_heads == 1`, mutant `== 0`: Falcon-7B's one KV head is MQA, not GQA."""
    from posenc import inspection as ins

    assert ins.kv_cache_facts(ins.load_preset("falcon-7b")).kind == "mqa"
    assert ins.kv_cache_facts(ins.load_preset("llama-3.1-8b")).kind == "gqa"
    assert ins.kv_cache_facts(ins.load_preset("llama-2-7b")).kind == "mha"


def test_t5_bucket_defaults_are_t5configs():
    """hf/facts.py T5 defaults when config.json omits them (mutant 32 -> 33): transformers' T5Config values."""
    from posenc import inspection as ins

    transformers = pytest.importorskip("transformers")
    cfg = {k: v for k, v in ins.load_preset("t5-base").items() if not k.startswith("relative_attention")}
    facts = ins.inspect_model(cfg)["scheme_facts"]
    ref = transformers.T5Config()
    assert (facts["num_buckets"], facts["max_distance"]) == (ref.relative_attention_num_buckets,
                                                             ref.relative_attention_max_distance) == (32, 128)


def test_vision_patch_positions_merge_default_is_two():
    """rope/axial.py `spatial_merge_size: int = 2` (mutant 3): Qwen2-VL's default merge of 2x2 patches."""
    grid = torch.tensor([[1, 4, 4]])
    assert torch.equal(vision_patch_positions(grid), vision_patch_positions(grid, spatial_merge_size=2))


def test_video_seconds_default_to_one_per_grid():
    """rope/mrope_positions.py `[1.0] * n_videos` (mutant 2.0): without second_per_grid_ts a grid step is 1 s."""
    ids = torch.tensor([[1, 151652] + [151656] * 3 + [2]])  # text, vision start, 3 video tokens (grid 3x2x2, merge 2)
    kw = dict(video_grid_thw=[[3, 2, 2]], image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
              tokens_per_second=2)
    default, _ = mrope_position_ids(ids, **kw)
    explicit, _ = mrope_position_ids(ids, second_per_grid_ts=[1.0], **kw)
    assert torch.equal(default, explicit)
    assert default[0, 0, 2:5].tolist() == [2, 4, 6]  # temporal index: frame t at 2 + t * 1 s * 2 tokens/s


def test_yarn_correction_range_is_clamped_to_the_last_pair():
    """rope/scaling.py `min(high, dim - 1)` (mutant dim - 2): when beta_slow's pair lies past the last one,
    the ramp ends at pair dim/2 - 1 as in transformers' YaRN (a huge original length makes that happen)."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from posenc import YaRN

    dim, base, l0 = 16, 500.0, 10**9
    params = {"rope_type": "yarn", "rope_theta": base, "factor": 4.0, "original_max_position_embeddings": l0}
    cfg = LlamaConfig(hidden_size=2 * dim, num_attention_heads=2, head_dim=dim, max_position_embeddings=4 * l0,
                      rope_parameters=params)
    ref, _ = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    low, high = YaRN(4.0, l0).correction_range(base, dim)
    assert high == dim - 1  # clamped
    assert torch.equal(YaRN(4.0, l0).inv_freq(base, dim)[0], ref)
