"""`patch` on the Qwen3-VL family (Qwen3-VL, Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE): tiny random
`*ForConditionalGeneration` models fed an image and a timestamped two-frame video the way transformers' model
takes them (`pixel_values`, `image_grid_thw`, `pixel_values_videos`, `video_grid_thw`, `mm_token_type_ids`).

Oracle: the unpatched model (transformers' rotation and its `get_rope_index`, which agrees with the official
rule on every token of a processor's prompt), and hand-derived positions where the two rules differ.
"""

import pytest
import torch

pytest.importorskip("transformers")

import posenc  # noqa: E402
from posenc.integrations.transformers import is_patched, patch, unpatch  # noqa: E402
from tests.helpers.transformers_tiny import sharpen  # noqa: E402

V = 128
IMG, VID, VS, VE, PAD = V - 3, V - 2, V - 1, V - 4, 0
CLASSES = {"qwen3_vl": ("Qwen3VLConfig", "Qwen3VLForConditionalGeneration", "qwen3_vl"),
           "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration", "qwen3_vl_moe"),
           "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", "qwen3_5"),
           "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe")}


def tiny_vl(family, dtype=torch.float32):
    """A seeded random model: 3 attention layers (Qwen3.5: linear, full, linear, full; partial rotary)."""
    import transformers
    from transformers.utils import logging

    logging.set_verbosity_error()
    hybrid = family.startswith("qwen3_5")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_interleaved": True,
            "mrope_section": [2, 1, 1] if hybrid else [2, 3, 3]}  # sums to rotary_dim / 2
    text = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16, max_position_embeddings=256, rope_parameters=rope, num_hidden_layers=3)
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=2, spatial_merge_size=2,
                  temporal_patch_size=1, in_channels=3, out_hidden_size=64, num_position_embeddings=16)
    if hybrid:  # Qwen3.5: rotary_dim 8 of head 16, gated delta-net layers between the attention layers
        rope["partial_rotary_factor"] = 0.5
        text.update(num_hidden_layers=4, layer_types=["linear_attention", "full_attention"] * 2,
                    linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    else:
        vision["deepstack_visual_indexes"] = [0]
    if family.endswith("moe"):
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        if hybrid:
            text["shared_expert_intermediate_size"] = 32
    config_cls, model_cls, _ = CLASSES[family]
    config = getattr(transformers, config_cls)(text_config=text, vision_config=vision, image_token_id=IMG,
                                               video_token_id=VID, vision_start_token_id=VS, vision_end_token_id=VE)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return sharpen(getattr(transformers, model_cls)(config)).to(dtype).eval()


def _block(kind, h, w, t=1):
    return [VS] + [kind] * (t * h // 2 * w // 2) + [VE]


def _inputs(dtype, image=(1, 4, 4)):
    """Two rows (row 1 left-padded by 4): text, an image, text, a 2-frame video (grid 2x4x6) written as the
    processor writes it (a timestamp token before each frame's block), text."""
    video = [30] + _block(VID, 4, 6) + [31] + _block(VID, 4, 6)
    rows = [[5, 6] + _block(IMG, *image[1:], t=image[0]) + [7, 8, 9] + video + [10, 11],
            [PAD] * 4 + [5] + _block(IMG, *image[1:], t=image[0]) + [8] + video + [12]]
    ids = torch.tensor(rows)  # [2, t]
    mask = (torch.arange(ids.shape[1]) >= torch.tensor([[0], [4]])).long()  # [2, t]
    types = (ids == IMG).long() + 2 * (ids == VID).long()  # [2, t]: text 0, image 1, video 2
    image_grid, video_grid = torch.tensor([image, image]), torch.tensor([[2, 4, 6], [2, 4, 6]])
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(int(image_grid.prod(-1).sum()), 12, generator=g).to(dtype)  # [patches, C*p*p]
    frames = torch.randn(int(video_grid.prod(-1).sum()), 12, generator=g).to(dtype)
    return ids, dict(attention_mask=mask, pixel_values=pixels, image_grid_thw=image_grid,
                     pixel_values_videos=frames, video_grid_thw=video_grid, mm_token_type_ids=types)


def _run(model, ids, kwargs, steps=4):
    """`(prefill logits [b, t, V], generated ids [b, t + steps], each decode step's logits [steps, b, V],
    the model's rope_deltas [b, 1] after generate, the logits [1, 1, V] of one manual cached step of row 0)`."""
    with torch.no_grad():
        logits = model(ids, **kwargs).logits
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, pad_token_id=PAD, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
        deltas = getattr(model.model, "rope_deltas", None)  # get_rope_index's, kept for decoding
        # a manual cached step of the unpadded row without position_ids: the model continues at cache length +
        # its delta (transformers 5.24 mis-shapes that path when given an attention mask, so row 0 alone)
        step = None  # text only: transformers keeps generate's stale [b, 1] deltas, which a 1-row step refuses
        if "image_grid_thw" in kwargs:
            first = model(ids[:1], use_cache=True, **_row0(kwargs))
            token = first.logits[:, -1:].argmax(-1)  # [1, 1]
            step = model(token, cache=first.cache, mm_token_type_ids=torch.zeros_like(token)).logits
    return logits, out.sequences, torch.stack(out.logits), deltas, step


def _row0(kwargs):
    """`kwargs` for row 0 alone (its image and video are the first grid rows and patches)."""
    image, video = kwargs["image_grid_thw"][:1], kwargs["video_grid_thw"][:1]
    return dict(attention_mask=kwargs["attention_mask"][:1], mm_token_type_ids=kwargs["mm_token_type_ids"][:1],
                image_grid_thw=image, video_grid_thw=video,
                pixel_values=kwargs["pixel_values"][: int(image.prod())],
                pixel_values_videos=kwargs["pixel_values_videos"][: int(video.prod())])


@pytest.mark.parametrize("family, dtype", [(f, torch.float32) for f in CLASSES] + [
    ("qwen3_vl", torch.float64), ("qwen3_5", torch.float64)])  # the MoE blocks' grouped_mm refuses float64
def test_patched_vl_model_with_image_and_video_is_bit_identical(family, dtype, monkeypatch):
    import importlib

    model = tiny_vl(family, dtype)
    ids, kwargs = _inputs(dtype)
    stock = _run(model, ids, kwargs)
    patch(model)
    module = importlib.import_module(type(model.model.language_model).__module__)

    def broken(*args, **kwargs):
        raise AssertionError("transformers' rotation ran")

    monkeypatch.setattr(module, "apply_rotary_pos_emb", broken)  # only posenc may rotate now
    ours = _run(model, ids, kwargs)
    assert all(torch.equal(a, b) for a, b in zip(ours, stock))  # logits, tokens, step logits, deltas, cached step
    assert ours[1].shape[1] == ids.shape[1] + 4 and ours[3].tolist() == [[-8], [-8]]  # largest + 1 - real tokens


def test_text_only_prompts_are_bit_identical():
    model = tiny_vl("qwen3_vl")
    ids = torch.randint(1, V - 4, (2, 12), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    stock = _run(model, ids, dict(attention_mask=mask))
    ours = _run(patch(model), ids, dict(attention_mask=mask))
    assert all(torch.equal(a, b) for a, b in zip(ours[:4], stock[:4])) and ours[4] is stock[4] is None


def test_qwen3_5_text_model_skips_its_linear_attention_layers():
    import transformers

    vl = tiny_vl("qwen3_5")
    model = transformers.Qwen3_5ForCausalLM(vl.config.text_config).eval()
    attns = [layer.self_attn for layer in model.model.layers if hasattr(layer, "self_attn")]
    ids = torch.randint(1, V - 4, (1, 10), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        stock = model(ids).logits
        ours = patch(model)(ids).logits
    assert torch.equal(ours, stock) and len(attns) == 2
    assert all("forward" in a.__dict__ for a in attns)  # the two full-attention layers, nothing else
    assert sum("forward" in m.__dict__ for m in model.modules()) == 3  # + the rotary module


def test_positions_follow_the_official_rule_and_the_switch_keeps_transformers():
    # An image grid with T = 3 > max(H, W) / merge = 1 (a processor never makes one for Qwen3-VL): the only
    # place the two rules differ. Official: the next token starts at the block's largest position + 1.
    model = tiny_vl("qwen3_vl")
    ids, kwargs = _inputs(torch.float32, image=(3, 2, 2))
    args = {k: kwargs[k] for k in ("image_grid_thw", "video_grid_thw", "attention_mask", "mm_token_type_ids")}
    stock, stock_delta = model.model.get_rope_index(ids, **args)
    stock_logits = _run(model, ids, kwargs, steps=2)
    patch(model)
    ours, delta = model.model.get_rope_index(ids, **args)
    # row 0 by hand: text 0 1, VS 2, image frames at t = 3, 4, 5 (row and column 3), VE at 6, text 7 8 9,
    # stamp 10, VS 11, frame 1 (2x3 tokens) at 12, VE 15, stamp 16, VS 17, frame 2 at 18, VE 21, text 22 23
    assert ours[0, 0, :12].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert ours[:, 0, 12:18].tolist() == [[12] * 6, [12, 12, 12, 13, 13, 13], [12, 13, 14, 12, 13, 14]]
    assert ours[0, 0, 18:].tolist() == [15, 16, 17, 18, 18, 18, 18, 18, 18, 21, 22, 23]
    assert ours[:, 0, 3].tolist() == [3, 3, 3] and ours[:, 0, 5].tolist() == [5, 3, 3]
    # row 1 (4 padding slots, then 26 tokens): 5 at 0, VS 1, image t = 2, 3, 4, VE 5, text 6, stamp 7, VS 8,
    # frame at 9, VE 12, stamp 13, VS 14, frame at 15, VE 18, text 19
    assert ours[0, 1].tolist() == [1] * 4 + list(range(9)) + [9] * 6 + [12, 13, 14] + [15] * 6 + [18, 19]
    # deltas count real tokens (transformers' convention): largest + 1 - real tokens
    assert delta.tolist() == [[24 - 30], [20 - 26]] and stock[0, 0, 6].item() == 4  # transformers: 3 + 1
    logits = _run(model, ids, kwargs, steps=2)
    assert not torch.allclose(logits[0], stock_logits[0])  # the positions reach the model
    unpatch(model)
    patch(model, mrope_positions="transformers")
    assert "get_rope_index" not in model.model.__dict__
    kept, kept_delta = model.model.get_rope_index(ids, **args)
    assert torch.equal(kept, stock) and torch.equal(kept_delta, stock_delta)
    kept_logits = _run(model, ids, kwargs, steps=2)
    assert all(torch.equal(a, b) for a, b in zip(kept_logits, stock_logits))
    assert is_patched(model)
