"""Scaling rules at their edges: YaRN betas whose turns overflow, and its correction range clamped like
transformers'."""

import pytest
import torch

import posenc
from posenc import PosencError


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


@pytest.mark.parametrize("arg, value", [("beta_fast", 1e308), ("beta_slow", 1e-320)])


def test_yarn_betas_whose_turns_overflow_are_refused_by_name(arg, value):
    with pytest.raises(PosencError, match=rf"^{arg}: expected a number of turns"):
        posenc.Rope(head_dim=16, scaling=posenc.YaRN(4.0, 32, **{arg: value}))
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, arg: value}}
    with pytest.raises(PosencError, match=rf"^config\['rope_scaling'\]\['{arg}'\]: expected a number of turns"):
        posenc.Rope.from_hf_config(cfg)
