"""`patch()` on the families whose attention rotates in another shape (integrations/transformers/shapes.py):
GPT-J and CodeGen (`apply_rotary_pos_emb(tensor, sin, cos)`, one tensor per call, interleaved pairs, partial
rotary_dim), Llama 4 text (the complex `apply_rotary_emb(q, k, freqs_cis)`, NoPE layers, chunked attention) and
DeepSeek-V2 (the same complex rotation on MLA's `q_pe`, `k_pe`). The oracle is the same tiny random model unpatched
(tests/helpers/transformers_zoo.py: hidden 64, 2 layers, rotary_dim 8 of 16 for GPT-J / CodeGen).
"""

import pytest
import torch

pytest.importorskip("transformers")

from posenc.hf import layer_ropes  # noqa: E402
from posenc.integrations.transformers import is_patched, patch, unpatch  # noqa: E402
from tests.helpers.transformers_zoo import RULES, zoo_model  # noqa: E402

TYPES = ("gptj", "codegen", "llama4_text", "deepseek_v2")
COMPLEX = ("llama4_text", "deepseek_v2")


def _ids(b=2, t=12, seed=0):  # 12 tokens: past Llama 4's attention chunk of 8
    return torch.randint(3, 128, (b, t), generator=torch.Generator().manual_seed(seed))


def _untouched(model):
    return not any("forward" in m.__dict__ for m in model.modules()) and not is_patched(model)


def _greedy(model, ids, **kw):
    return model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, **kw)


@pytest.mark.parametrize("model_type", TYPES)
def test_patched_equals_stock_logits_greedy_left_padded_and_unpatch(model_type):
    model, ids = zoo_model(model_type), _ids()
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # row 0 left-padded by 3
    padded = ids.masked_fill(mask == 0, 0)
    with torch.no_grad():
        stock, greedy, left = model(ids).logits, _greedy(model, ids), _greedy(model, padded, attention_mask=mask)
        patch(model)
        assert torch.equal(model(ids).logits, stock)
        assert torch.equal(_greedy(model, ids), greedy)
        assert torch.equal(_greedy(model, padded, attention_mask=mask), left)
        unpatch(model)
        assert _untouched(model) and torch.equal(model(ids).logits, stock)


@pytest.mark.parametrize("model_type", TYPES)
def test_posenc_tables_rotate_the_patched_model(model_type):
    """Exact phases change the last bits: the rotation is posenc's, not transformers' left in place."""
    model, ids = zoo_model(model_type), _ids()
    with torch.no_grad():
        stock = model(ids).logits
        exact = patch(model, precision="exact")(ids).logits
    assert not torch.equal(exact, stock) and (exact - stock).abs().max() < 1e-4


@pytest.mark.parametrize("model_type", COMPLEX)
def test_a_linear_rule_on_a_complex_family(model_type):
    model, ids = zoo_model(model_type, rope=RULES["linear"]), _ids()
    assert layer_ropes(model.config)[0].scaling.name == "linear"
    with torch.no_grad():
        stock, greedy = model(ids).logits, _greedy(model, ids)
        patch(model)
        assert torch.equal(model(ids).logits, stock) and torch.equal(_greedy(model, ids), greedy)


def test_llama4_nope_layer_is_not_rotated():
    model = zoo_model("llama4_text")  # no_rope_layers [1, 0]: layer 1 applies no RoPE
    assert [r is None for r in layer_ropes(model.config)] == [False, True]
    assert [a.self_attn.use_rope for a in model.model.layers] == [1, 0]


@pytest.mark.parametrize("model_type", COMPLEX)
def test_a_named_impl_rotates_within_an_ulp(model_type):
    """posenc's kernels on the same cos/sin: torch's scalar complex loop may fuse a multiply-add (shapes.py)."""
    model, ids = zoo_model(model_type), _ids()
    with torch.no_grad():
        stock = model(ids).logits
        ours = patch(model, impl="reference")(ids).logits
    assert (ours - stock).abs().max() < 1e-5


@pytest.mark.parametrize("model_type,dtype", [("gptj", torch.bfloat16), ("codegen", torch.bfloat16),
                                              ("gptj", torch.float64), ("llama4_text", torch.bfloat16)])
def test_other_dtypes_round_as_the_family_does(model_type, dtype):
    model, ids = zoo_model(model_type, dtype=dtype), _ids()
    decoder = model.model if model_type in COMPLEX else model.transformer
    rotary = decoder.rotary_emb  # model.to(dtype) rounded its buffers: rebuilt in float32, as a checkpoint loads
    decoder.rotary_emb = type(rotary)(config=model.config)
    if model_type == "codegen":  # its float32 buffer rotates bf16 q and k in float32
        assert decoder.rotary_emb.embed_positions.dtype == torch.float32
    with torch.no_grad():
        stock = model(ids).logits
        assert torch.equal(patch(model)(ids).logits, stock)
