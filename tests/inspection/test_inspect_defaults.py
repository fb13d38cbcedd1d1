"""`posenc inspect`'s facts where a config omits keys: MQA/GQA/MHA labels, T5's bucket defaults."""

import pytest


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
