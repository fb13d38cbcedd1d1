"""`posenc.integrations.transformers.patch`: posenc's rotation inside transformers models, checked against
the unpatched model (transformers' own rotation is the oracle), on tiny random configs of each family.

Families: llama, qwen2, gemma3 (per-layer RoPE), phi3 (partial rotary, LongRoPE), smollm3 (a NoPE layer),
phi (the attention slices the rotary channels), glm and cohere (interleaved pairing) and qwen2_vl (M-RoPE).
"""

import pytest
import torch

pytest.importorskip("transformers")

import posenc  # noqa: E402
from posenc.integrations.transformers import is_patched, patch, unpatch  # noqa: E402
from tests.helpers.transformers_tiny import FAMILIES, VOCAB, tiny_model  # noqa: E402


def _ids(b=2, t=24, seed=1):
    return torch.randint(0, VOCAB - 4, (b, t), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("family", FAMILIES)
def test_patched_model_is_bit_identical_to_transformers(family, dtype):
    model = tiny_model(family, dtype=dtype)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding in row 1: positions come from the mask
    with torch.no_grad():
        stock = model(ids, attention_mask=mask).logits
        stock_gen = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert patch(model) is model and is_patched(model)
        ours = model(ids, attention_mask=mask).logits
        ours_gen = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, stock)
    assert torch.equal(ours_gen, stock_gen)


def test_the_rotation_is_posencs_and_transformers_module_is_untouched(monkeypatch):
    import importlib

    from transformers.models.smollm3 import modeling_smollm3 as module

    original = module.apply_rotary_pos_emb
    model = patch(tiny_model("smollm3"))
    assert module.apply_rotary_pos_emb is original  # the module keeps its function
    patch_module = importlib.import_module("posenc.integrations.transformers.patch")  # the module, not the function
    calls = []
    real_rotate = patch_module.rotate  # posenc's rotation of one layer (held table, or Rope.apply)
    monkeypatch.setattr(patch_module, "rotate", lambda rope, *a, **k: calls.append(rope) or real_rotate(rope, *a, **k))

    def broken(*args, **kwargs):
        raise AssertionError("transformers' rotation ran")

    monkeypatch.setattr(module, "apply_rotary_pos_emb", broken)
    with torch.no_grad():
        model(_ids())
        assert len(calls) == 2  # layers 0 and 1 rotate; layer 2 is a NoPE layer
        unpatch(model)
        with pytest.raises(AssertionError, match="transformers' rotation ran"):
            model(_ids())


def test_a_decode_step_rotates_each_layer_in_one_kernel_call_on_the_held_table(monkeypatch):
    """After the first forward made the table, a step calls the kernel entry once per layer (q and k together)
    with the held table's view, and never `Rope.apply` (whose per-call checks the patch has done)."""
    from posenc.integrations.transformers import decoder

    model = patch(tiny_model("llama"))
    real_held, real_apply = decoder.rotate_held, posenc.Rope.apply
    held, applied = [], []
    monkeypatch.setattr(decoder, "rotate_held", lambda q, k, *a: held.append(a[1]) or real_held(q, k, *a))
    monkeypatch.setattr(posenc.Rope, "apply", lambda self, *a, **k: applied.append(self) or real_apply(self, *a, **k))
    def steps():
        out = model(_ids(1, 8), use_cache=True)
        model(_ids(1, 1, seed=5), cache=out.cache, use_cache=True)  # position 8: the table grows (doubling)
        held.clear(), applied.clear()
        return model(_ids(1, 1, seed=6), cache=out.cache, use_cache=True).logits

    with torch.no_grad():
        step = steps()
    assert len(held) == 3 and not applied  # three layers
    assert len({id(t) for t in held}) == 1  # one Rope, one table, held across layers and calls
    unpatch(model)
    with torch.no_grad():  # the same step through transformers' own rotation
        assert torch.equal(steps(), step)


def test_unpatch_restores_the_instance_and_a_second_patch_never_rotates_twice():
    model = tiny_model("llama")
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        stock = model(_ids()).logits
        patch(model)
        assert "forward" in attn.__dict__ and "forward" in model.model.rotary_emb.__dict__
        assert patch(model) is model  # same options: nothing happens
        twice = model(_ids()).logits
        with pytest.raises(posenc.PosencError, match="unpatch"):
            patch(model, policy="freeze")
        unpatch(model)
        assert "forward" not in attn.__dict__ and "forward" not in model.model.rotary_emb.__dict__
        assert not is_patched(model)
        again = model(_ids()).logits
    assert torch.equal(twice, stock) and torch.equal(again, stock)
    with pytest.raises(posenc.PosencError, match="model: expected a model patched"):
        unpatch(model)


@pytest.mark.parametrize("options, arg", [(dict(policy="again"), "policy"), (dict(impl="gpu"), "impl"),
                                          (dict(precision="double"), "precision"),
                                          (dict(mrope_positions="mine"), "mrope_positions")])
def test_bad_options_are_refused_by_name(options, arg):
    model = tiny_model("llama")
    with pytest.raises(posenc.PosencError) as info:
        patch(model, **options)
    assert info.value.arg == arg and not is_patched(model)


def _untouched(model):
    return not any("forward" in m.__dict__ for m in model.modules()) and not is_patched(model)


def test_a_family_it_cannot_patch_is_named_and_left_unchanged():
    from tests.helpers.transformers_zoo import zoo_model

    model = zoo_model("glm_moe_dsa")  # an indexer beside the attention: two modules rotate in each layer
    with pytest.raises(posenc.PosencError, match="model type 'glm_moe_dsa'"):
        patch(model)
    assert _untouched(model)


def test_a_layout_it_cannot_patch_is_refused_before_any_change():
    model = tiny_model("llama")
    last = model.model.layers[2].self_attn
    last.forward = last.forward  # an instance-level forward, as accelerate's hooks leave one
    with pytest.raises(posenc.PosencError, match="instance-level forward"):
        patch(model)
    assert all("forward" not in model.model.layers[i].self_attn.__dict__ for i in (0, 1))
    assert "forward" not in model.model.rotary_emb.__dict__ and not is_patched(model)


def test_a_config_posenc_cannot_read_is_refused_before_any_change():
    model = tiny_model("llama")
    model.config.rope_parameters = {"rope_type": "no-such-rule", "rope_theta": 10000.0}
    with pytest.raises(posenc.PosencError, match="model type 'llama'.*no-such-rule"):
        patch(model)
    assert _untouched(model)


@pytest.mark.parametrize("mode", ["sample", "beam", "assisted"])
def test_generate_modes_are_unchanged(mode):
    model, helper = tiny_model("qwen2"), tiny_model("qwen2", seed=3)
    ids = _ids(b=1 if mode == "assisted" else 2)
    kwargs = {"sample": dict(do_sample=True, top_k=20), "beam": dict(num_beams=3, num_return_sequences=2),
              "assisted": dict(assistant_model=helper)}[mode]

    def run():
        torch.manual_seed(5)
        with torch.no_grad():
            return model.generate(ids, max_new_tokens=10, pad_token_id=0, **kwargs)

    stock = run()
    patch(model)
    assert torch.equal(run(), stock)


def test_qwen2_vl_positions_follow_the_official_rule():
    model = tiny_model("qwen2_vl")
    image, video, start = VOCAB - 3, VOCAB - 2, VOCAB - 1
    # text, a video block of 3 frames x 1x1 merged patches (grid 3x2x2, merge 2), text
    ids = torch.tensor([[5, start, video, video, video, 6, 7]])
    types = torch.tensor([[0, 0, 2, 2, 2, 0, 0]])
    grid = torch.tensor([[3, 2, 2]])
    stock, stock_delta = model.model.get_rope_index(ids, types, video_grid_thw=grid)
    patch(model)
    ours, delta = model.model.get_rope_index(ids, types, video_grid_thw=grid)
    # by hand (Qwen2-VL): frames at t = start + f, one row and column at start; the next text token starts at
    # the block's largest position + 1 = 2 + 2 + 1 = 5
    official = [[0, 1, 2, 3, 4, 5, 6], [0, 1, 2, 2, 2, 5, 6], [0, 1, 2, 2, 2, 5, 6]]
    assert ours[:, 0].tolist() == official and delta.tolist() == [[7 - 7]]
    assert stock[:, 0, 5].tolist() == [3, 3, 3]  # transformers 5.24: start + max(H, W) / merge
    unpatch(model)
    patch(model, mrope_positions="transformers")
    kept, _ = model.model.get_rope_index(ids, types, video_grid_thw=grid)
    assert torch.equal(kept, stock)


def test_importing_the_integration_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, posenc.integrations.transformers\nprint('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bfloat16_rounds_as_transformers_does(family):
    model = tiny_model(family, dtype=torch.bfloat16)
    rotary = model.model.rotary_emb  # model.to(bfloat16) rounded its inv_freq buffers: rebuild them in float32
    model.model.rotary_emb = type(rotary)(config=rotary.config)
    with torch.no_grad():
        stock = model(_ids()).logits
        ours = patch(model)(_ids()).logits
    assert torch.equal(ours, stock)


def test_precision_and_impl_reach_the_rotation(monkeypatch):
    seen = []
    real_apply = posenc.Rope.apply
    monkeypatch.setattr(posenc.Rope, "apply", lambda self, *a, **k: seen.append(k) or real_apply(self, *a, **k))
    model = patch(tiny_model("llama"), precision="exact", impl="reference")
    with torch.no_grad():
        stock_free = model(_ids()).logits
    assert seen and all(k["precision"] == "exact" and k["impl"] == "reference" for k in seen)
    unpatch(model)
    with torch.no_grad():
        stock = model(_ids()).logits
    assert (stock_free - stock).abs().max() < 1e-3  # exact phases: the same angles to float32 rounding here
