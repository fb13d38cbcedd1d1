"""`Decoder`'s inputs and defaults: seeds, config keys, impossible caches refused by name; transformers' rms_norm_eps
default."""

import pytest

import posenc
from posenc import PosencError
from posenc.models import Decoder


def tiny_decoder(**kw):
    return Decoder(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=8, **kw)

HUGE = 2**70  # a Python int no int64 tensor or torch size can hold


def test_decoder_rms_norm_eps_defaults_to_transformers_llama():
    """hf/facts.py `cfg.get("rms_norm_eps", 1e-6)`, mutant 2e-06: a config without the key gets LlamaConfig's 1e-6."""
    from posenc.models import Decoder

    transformers = pytest.importorskip("transformers")
    cfg = {"model_type": "llama", "vocab_size": 11, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 64}
    model = Decoder.from_hf_config(cfg, seed=0)
    eps = {m.eps for m in model.modules() if hasattr(m, "eps")}
    assert eps == {transformers.LlamaConfig().rms_norm_eps} == {1e-6}


@pytest.mark.parametrize("seed", ["x", HUGE, True, 1.5])


def test_decoder_seed_that_is_not_an_integer_is_refused_by_name(seed):
    from tests.models.test_decoder import config
    with pytest.raises(PosencError, match=r"^seed: expected None or an integer"):
        posenc.models.Decoder.from_hf_config(config("default", num_hidden_layers=1), seed=seed)


def test_decoder_from_hf_config_names_the_config_key_of_a_bad_kv_head_count():
    from tests.models.test_decoder import config
    with pytest.raises(PosencError, match=r"^config\['num_key_value_heads'\]: expected a divisor of num_heads=4, got 3"):
        posenc.models.Decoder.from_hf_config(config("default", num_hidden_layers=1, num_key_value_heads=3))


@pytest.mark.parametrize("capacity", [2**62, 2**53 + 2])


def test_new_cache_of_an_impossible_capacity_is_refused_by_name(capacity):
    with pytest.raises(PosencError, match=r"capacity: expected"):
        tiny_decoder().new_cache(1, capacity)


def test_new_cache_that_cannot_be_allocated_is_refused_by_name():
    with pytest.raises(PosencError, match=r"capacity: expected a cache that fits in memory"):
        tiny_decoder().new_cache(1, 2**44)  # 1 layer x 2 x (1, 2, 2**44, 4) float32: 256 TiB
