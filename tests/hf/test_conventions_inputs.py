"""A config whose model_type is not a string is refused by name."""

import pytest

import posenc
from posenc import PosencError


@pytest.mark.parametrize("model_type", [["llama"], {"a": 1}, 3])


def test_a_model_type_that_is_not_a_string_is_refused_by_name(model_type):
    cfg = {"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128}
    with pytest.raises(PosencError, match=r"^config\['model_type'\]: expected a string"):
        posenc.Rope.from_hf_config(cfg)
