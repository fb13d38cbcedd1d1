"""`Decoder.from_hf_config` applies what the config's attention applies beyond the rotation itself.

- DeepSeek YaRN's softmax mscale: the scores are multiplied by `softmax_scale_factor`; checked against
  the same decoder whose query projection is scaled by that factor (scores are linear in q), with the
  factor itself from a float64 closed form.
"""

import math

import pytest
import torch
from tests.helpers.tolerances import assert_close

import posenc
from posenc.models import Decoder

CFG = {"model_type": "llama", "vocab_size": 40, "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "intermediate_size": 64, "max_position_embeddings": 64}
YARN = posenc.YaRN(factor=40.0, original_max_positions=16, mscale=0.707, mscale_all_dim=0.707)


def test_softmax_scale_factor_closed_form():
    """DeepSeek-V2-Lite's numbers: (0.1 * 0.707 * ln 40 + 1)^2 = 1.58963."""
    want = (0.1 * 0.707 * math.log(40.0) + 1.0) ** 2
    assert YARN.softmax_scale_factor() == pytest.approx(want, rel=1e-15)
    assert want == pytest.approx(1.58963, abs=1e-5)


def test_decoder_multiplies_scores_by_softmax_scale_factor():
    s = YARN.softmax_scale_factor()
    scaled = posenc.Rope(head_dim=12, scaling=YARN, softmax_scale_factor=s)
    plain = posenc.Rope(head_dim=12, scaling=YARN)
    ours = Decoder.from_hf_config(CFG, encoding=scaled, seed=5).double().eval()
    twin = Decoder.from_hf_config(CFG, encoding=plain, seed=5).double().eval()
    twin.load_state_dict(ours.state_dict())
    with torch.no_grad():
        for layer in twin.layers:
            layer.self_attn.q_proj.weight.mul_(s)  # s * q . k == q . k with the softmax scale times s
    ids = torch.randint(0, 40, (2, 21), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = twin(ids)
        assert_close(ours(ids), want)
        cache = ours.new_cache(2, 32)
        steps = [ours(ids[:, :9], cache=cache)] + [ours(ids[:, i:i + 1], cache=cache) for i in range(9, 21)]
        assert_close(torch.cat(steps, 1), want)  # the cached path scales the same way
        unscaled = Decoder.from_hf_config(CFG, encoding=plain, seed=5).double().eval()
        assert not torch.allclose(unscaled(ids), want, atol=1e-3)  # the factor matters at these sizes


@pytest.mark.parametrize("bad, match", [
    ({"rms_norm_eps": "x"}, r"config\['rms_norm_eps'\]: expected a real number, got 'x'"),
    ({"rms_norm_eps": 1.0}, r"config\['rms_norm_eps'\]: expected a finite number in \[0, 1\), got 1.0"),
    ({"tie_word_embeddings": 1}, r"config\['tie_word_embeddings'\]: expected True or False, got 1"),
    ({"model_type": "qwen2_moe", "qkv_bias": "yes"}, r"config\['qkv_bias'\]: expected True or False, got 'yes'"),
    ({"sliding_window": 0}, r"config\['sliding_window'\]: expected None or a positive integer, got 0"),
])
def test_decoder_sizes_refuse_bad_values(bad, match):
    with pytest.raises(posenc.PosencError, match=match):
        posenc.hf.decoder_sizes({**CFG, **bad})


@pytest.mark.parametrize("model_type, qkv, o", [("llama", False, False), ("qwen2", True, False), ("mistral", False, False)])
def test_decoder_sizes_biases_per_family(model_type, qkv, o):
    """q/k/v and o biases as transformers' attention of each family has them (Mistral ignores attention_bias)."""
    sizes = posenc.hf.decoder_sizes({**CFG, "model_type": model_type, "attention_bias": False})
    assert (sizes["qkv_bias"], sizes["attention_bias"]) == (qkv, o)
    if model_type == "mistral":
        assert posenc.hf.decoder_sizes({**CFG, "model_type": model_type, "attention_bias": True})["qkv_bias"] is False
