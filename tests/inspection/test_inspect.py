"""posenc.inspection: presets, KV-cache memory against closed forms, RoPE band facts against float64 formulas."""

import json
import math

import pytest
import torch

from tests.helpers.tolerances import assert_close
from posenc import PosencError
from posenc import inspection as ins
from posenc.hf.facts import kv_cache_facts

GIB = 2**30


def report(name, **kw):
    cfg, source = ins.load_config(name)
    return ins.inspect_model(cfg, source=source, **kw)


# ------------------------------------------------------------------ presets
FAMILIES = ["llama-2", "llama-3-", "llama-3.1", "llama-3.2", "mistral", "mixtral", "qwen2-", "qwen2.5", "qwen3",
            "qwen2-vl", "phi-2", "phi-3-", "phi-3.5", "gemma-2", "gemma-3", "gpt-neox", "gpt-j", "falcon",
            "deepseek-v2", "deepseek-v3", "gpt-oss", "bloom", "mpt", "t5", "gpt2", "bert"]


def test_presets_cover_the_issue_families():
    names = ins.preset_names()
    assert len(names) >= 20
    for family in FAMILIES:
        assert any(n.startswith(family) for n in names), family


@pytest.mark.parametrize("name", ins.preset_names())
def test_every_preset_inspects_and_is_json(name):
    r = report(name, lengths=[1000, 4096], batch=3)
    assert r["scheme"] in ("rope", "alibi", "t5", "learned_absolute")
    assert (r["scheme"] == "rope") == bool(r["rope"])
    assert json.loads(json.dumps(r)) == r
    for rope in r["rope"]:
        half = rope["rotary_dim"] // 2
        assert len(rope["wavelength"]) == len(rope["scaled_wavelength"]) == len(rope["turns_l1"]) == half
        assert rope["l0"] <= rope["l1"]
    for row in r["kv_cache"]["rows"]:
        assert row["bytes_per_batch"] == 3 * row["bytes_per_request"]


def test_load_config_from_file_and_directory(tmp_path):
    cfg = {"model_type": "llama", "hidden_size": 96, "num_attention_heads": 3, "num_hidden_layers": 5,
           "max_position_embeddings": 777}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert ins.load_config(str(tmp_path))[0] == cfg
    assert ins.load_config(str(tmp_path / "config.json"))[0] == cfg
    assert ins.load_config("LLAMA-2-7B")[1] == "preset llama-2-7b"


def test_unknown_model_names_the_presets():
    with pytest.raises(PosencError, match="MODEL_OR_CONFIG: expected .*llama-2-7b"):
        ins.load_config("not-a-model")


@pytest.mark.parametrize("text", ["/nonexistent/config.json", "missing.json", "no/such/dir"])
def test_missing_path_says_file_not_found(text):
    with pytest.raises(PosencError, match=r"MODEL_OR_CONFIG: expected an existing .*\(file not found\)"):
        ins.load_config(text)


def test_load_preset_is_a_fresh_config():
    cfg = ins.load_preset("LLaMA-3.1-8B")
    assert cfg == ins.load_config("llama-3.1-8b")[0] and cfg["rope_scaling"]["factor"] == 8.0
    cfg["rope_theta"] = 1.0
    assert ins.load_preset("llama-3.1-8b")["rope_theta"] == 500000.0
    with pytest.raises(PosencError, match="name: expected a bundled preset .*llama-2-7b"):
        ins.load_preset("llama-9")


@pytest.mark.parametrize("text, message", [
    ("", "--lengths: expected comma-separated"),
    ("4k,", "--lengths: expected comma-separated"),
    ("0", r"--lengths: expected whole numbers of tokens in \[1, 4294967296\]"),
    ("4097m", r"--lengths: expected whole numbers of tokens in \[1, 4294967296\] \(4096m\), got '4097m'"),
    ("1e9", "--lengths: expected comma-separated"),
])
def test_parse_lengths_refuses(text, message):
    with pytest.raises(PosencError, match=message):
        ins.parse_lengths(text)


def test_parse_lengths_bounds():
    assert ins.parse_lengths("4096m, 1.5k,1") == [2**32, 1536, 1]
    with pytest.raises(PosencError, match="--length: expected"):
        ins.parse_lengths("2k,x", "--length")


def test_rows_past_the_maximum_are_flagged():
    r = report("llama-2-7b", lengths=[4096, 4097], dtypes=("fp16",), memory_gib=80.0)
    assert [row["beyond_max"] for row in r["kv_cache"]["rows"]] == [False, True]
    assert r["kv_cache"]["max_tokens"]["fp16"] == 80 * 2**30 // (512 * 1024)  # 163840 > 4096
    assert r["kv_cache"]["max_tokens_beyond_max"] == {"fp16": True}
    with pytest.raises(PosencError, match=r"--dtypes: expected at least one name from \('fp32'"):
        report("llama-2-7b", dtypes=())


def test_bad_files(tmp_path):
    with pytest.raises(PosencError, match="directory holding config.json"):
        ins.load_config(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(PosencError, match="readable JSON"):
        ins.load_config(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(PosencError, match="JSON object"):
        ins.load_config(str(tmp_path))


def test_unsupported_config_fails_clearly():
    with pytest.raises(PosencError, match="model_type"):
        ins.inspect_model({"model_type": "mamba", "hidden_size": 64, "num_attention_heads": 4})
    with pytest.raises(PosencError, match="num_hidden_layers"):
        ins.kv_cache_facts({"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4})
    with pytest.raises(PosencError, match="--batch"):
        report("llama-2-7b", batch=0)
    with pytest.raises(PosencError, match="--dtypes"):
        report("llama-2-7b", dtypes=("fp12",))


def test_parse_lengths():
    assert ins.parse_lengths("4k,32k, 128k,1m,1000,1.5k") == [4096, 32768, 131072, 2**20, 1000, 1536]
    for bad in ("4q", "0", "", "1.3", "-4k"):
        with pytest.raises(PosencError, match="--lengths"):
            ins.parse_lengths(bad)


# ------------------------------------------------------------------ KV cache against closed forms
def kv_closed_form(layers, kv_heads, head_dim, tokens, bytes_per):
    return 2 * layers * kv_heads * head_dim * tokens * bytes_per


def test_seed_table_llama2_7b():
    r = report("llama-2-7b", lengths=ins.parse_lengths("4k,32k,128k"), batch=16, dtypes=("fp16",))
    got = [(row["bytes_per_request"] / GIB, row["bytes_per_batch"] / GIB) for row in r["kv_cache"]["rows"]]
    assert got == [(2, 32), (16, 256), (64, 1024)]  # the seed's table, GB meaning GiB
    assert r["kv_cache"]["bytes_per_token"]["fp16"] == 512 * 1024


@pytest.mark.parametrize("name, layers, kv_heads, head_dim", [
    ("llama-3.1-8b", 32, 8, 128), ("falcon-7b", 32, 1, 64), ("gpt2", 12, 12, 64), ("phi-2", 32, 32, 80),
    ("gpt-j-6b", 28, 16, 256), ("t5-base", 12, 12, 64), ("mpt-7b", 32, 32, 128), ("qwen2-7b-instruct", 28, 4, 128)])
@pytest.mark.parametrize("dtype, nbytes", [("fp16", 2), ("bf16", 2), ("fp8", 1), ("int4", 0.5), ("fp32", 4)])
def test_kv_bytes_dense(name, layers, kv_heads, head_dim, dtype, nbytes):
    facts = ins.kv_cache_facts(ins.load_config(name)[0])
    for tokens in (1, 37, 4096):
        assert ins.kv_bytes(facts, tokens, dtype) == kv_closed_form(layers, kv_heads, head_dim, tokens, nbytes)


def test_kv_bytes_mla_caches_the_latent():
    facts = ins.kv_cache_facts(ins.load_config("deepseek-v3")[0])
    assert facts.kind == "mla"
    assert ins.kv_bytes(facts, 1000, "bf16") == 61 * (512 + 64) * 1000 * 2
    lite = ins.kv_cache_facts(ins.load_config("deepseek-v2-lite")[0])
    assert ins.kv_bytes(lite, 3, "fp8") == 27 * 576 * 3
    assert any("MLA" in n for n in facts.notes)


def test_kv_bytes_sliding_windows_cap_their_layers():
    gemma2 = ins.kv_cache_facts(ins.load_config("gemma-2-9b")[0])  # 42 layers alternate window 4096 / full
    per = 2 * 8 * 256 * 2
    assert ins.kv_bytes(gemma2, 8192, "fp16") == (21 * 4096 + 21 * 8192) * per
    assert ins.kv_bytes(gemma2, 1000, "fp16") == 42 * 1000 * per
    mistral = ins.kv_cache_facts(ins.load_config("mistral-7b-v0.1")[0])  # every layer windowed at 4096
    assert ins.kv_bytes(mistral, 32768, "fp16") == ins.kv_bytes(mistral, 4096, "fp16") == 32 * 4096 * 2 * 8 * 128 * 2
    assert ins.max_tokens(mistral, 80 * GIB, "fp16") is None
    gemma3 = ins.kv_cache_facts(ins.load_config("gemma-3-4b")[0])  # 34 layers, every 6th global, window 1024
    assert ins.kv_bytes(gemma3, 10000, "bf16") == (29 * 1024 + 5 * 10000) * 2 * 4 * 256 * 2
    # Qwen2 ships sliding_window but use_sliding_window=false: nothing is capped.
    qwen = ins.kv_cache_facts(ins.load_config("qwen2.5-7b-instruct")[0])
    assert all(w is None for w in qwen.windows)


def test_kv_encoder_only_and_max_tokens():
    assert ins.kv_cache_facts(ins.load_config("bert-base-uncased")[0]).kind == "none"
    llama = ins.kv_cache_facts(ins.load_config("llama-2-7b")[0])
    assert ins.max_tokens(llama, 80 * GIB, "fp16") == 80 * GIB // (512 * 1024)
    assert ins.max_tokens(llama, 80 * GIB, "fp16", batch=3) == 80 * GIB // (3 * 512 * 1024)
    r = report("llama-2-7b", memory_gib=1.0, dtypes=("int4",))
    assert r["kv_cache"]["max_tokens"] == {"int4": 8192}


# ------------------------------------------------------------------ RoPE facts against float64 formulas
def test_default_wavelengths_and_turns():
    rope = report("llama-2-7b")["rope"][0]
    i = torch.arange(64, dtype=torch.float64)
    expected = 2 * math.pi * 10000.0 ** (2 * i / 128)
    assert_close(torch.tensor(rope["wavelength"]), expected, dtype=torch.float32)
    assert_close(torch.tensor(rope["turns_l0"]), 4096 / expected, dtype=torch.float32)
    assert rope["stretch"] == [1.0] * 64
    assert [k for k, w in enumerate(rope["wavelength"]) if w > 4096] == list(range(46, 64))


def test_llama3_scaled_wavelengths_closed_form():
    rope = report("llama-3.1-8b")["rope"][0]
    assert (rope["l0"], rope["l1"]) == (8192, 131072)
    wave = 2 * math.pi * 500000.0 ** (2 * torch.arange(64, dtype=torch.float64) / 128)
    expected = []
    for w in wave.tolist():  # Meta's recipe, written out per pair
        if w < 8192 / 4:
            expected.append(w)
        elif w > 8192 / 1:
            expected.append(w * 8)
        else:
            s = (8192 / w - 1) / (4 - 1)
            expected.append(1 / ((1 - s) / (8 * w) + s / w))
    assert_close(torch.tensor(rope["scaled_wavelength"]), torch.tensor(expected), dtype=torch.float32)
    assert_close(torch.tensor(rope["turns_l1"]), 131072 / torch.tensor(expected), dtype=torch.float32)


def test_yarn_ramp_and_attention_factor():
    rope = report("qwen2.5-7b-instruct-yarn")["rope"][0]
    assert (rope["l0"], rope["l1"]) == (32768, 131072)
    d, base, l0 = 128, 1e6, 32768
    corr = [d * math.log(l0 / (b * 2 * math.pi)) / (2 * math.log(base)) for b in (32, 1)]
    assert rope["yarn_correction_range"] == [math.floor(corr[0]), math.ceil(corr[1])]
    assert rope["attention_factor"] == pytest.approx(0.1 * math.log(4) + 1, rel=1e-12)
    low, high = rope["yarn_correction_range"]
    assert all(abs(s - 1) < 1e-6 for s in rope["stretch"][:low])
    assert all(abs(s - 4) < 1e-5 for s in rope["stretch"][high:])


def test_longrope_uses_long_factors_at_l1_and_factors_known():
    cfg = ins.load_config("phi-3.5-mini-instruct")[0]
    rope = report("phi-3.5-mini-instruct")["rope"][0]
    assert (rope["l0"], rope["l1"]) == (4096, 131072)
    long_factor = cfg["rope_scaling"]["long_factor"]
    assert_close(torch.tensor(rope["stretch"]), torch.tensor(long_factor, dtype=torch.float64), dtype=torch.float32)
    assert rope["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)), rel=1e-12)
    assert report("gpt-oss-20b")["rope"][0]["attention_factor"] == pytest.approx(0.1 * math.log(32) + 1, rel=1e-12)
    v3 = report("deepseek-v3")["rope"][0]
    assert v3["softmax_scale_factor"] == pytest.approx((0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    assert v3["pairing"] == "interleaved_to_split_half"


def test_gemma3_shows_both_layer_types_and_partial_rotary():
    ropes = report("gemma-3-4b")["rope"]
    assert [(r["layers"], r["base"], r["scaling"]) for r in ropes] == [
        ("sliding_attention layers", 10000.0, "default"), ("full_attention layers", 1e6, "linear")]
    assert (ropes[1]["l0"], ropes[1]["l1"]) == (16384, 131072)  # linear x8 without a stated original length
    gemma2 = report("gemma-2-9b")["rope"]  # both layer types share one RoPE: shown once
    assert [r["layers"] for r in gemma2] == ["all layers"]
    neox = report("gpt-neox-20b")["rope"][0]
    assert (neox["head_dim"], neox["rotary_dim"], len(neox["wavelength"])) == (96, 24, 12)
    assert report("gpt-j-6b")["rope"][0]["pairing"] == "interleaved"


def test_non_rope_schemes_summarised():
    assert report("bloom-7b1")["scheme"] == "alibi"
    assert report("mpt-7b")["scheme"] == "alibi"
    t5 = report("t5-base")
    assert t5["scheme"] == "t5" and t5["scheme_facts"]["num_buckets"] == 32
    gpt2 = report("gpt2")
    assert gpt2["scheme"] == "learned_absolute" and gpt2["scheme_facts"]["table_rows"] == 1024
    falcon_alibi = {**ins.load_config("falcon-7b")[0], "alibi": True}
    assert ins.inspect_model(falcon_alibi)["scheme"] == "alibi"


# ------------------------------------------------------------------ direction, branch tables, kv sharing
NANOCHAT = {"model_type": "nanochat", "hidden_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
            "num_hidden_layers": 2, "vocab_size": 32, "max_position_embeddings": 4096,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def _text(r, bands=2):
    """The plain-text report with its wrapped lines joined again."""
    from posenc.inspection.text import render_inspect

    return render_inspect(r, bands=bands).replace("\n    ", " ")


def test_direction_minus_one_is_shown_and_leaves_wavelengths_alone():
    r = ins.inspect_model(NANOCHAT)
    rope = r["rope"][0]
    assert rope["direction"] == -1 and rope["head_dim"] == 24
    expected = 2 * math.pi * 10000.0 ** (2 * torch.arange(12, dtype=torch.float64) / 24)  # |angle| per token
    assert_close(torch.tensor(rope["wavelength"]), expected, dtype=torch.float32)
    assert_close(torch.tensor(rope["scaled_wavelength"]), expected, dtype=torch.float32)
    assert "direction -1 (turns by -theta" in _text(r, bands=4)
    llama = report("llama-2-7b")
    assert llama["rope"][0]["direction"] == 1 and "direction" not in _text(llama)
    assert llama["branches"] == [] and llama["kv_sharing"] == []


DSA = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2,
       "vocab_size": 32, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
       "v_head_dim": 16, "index_head_dim": 40, "index_n_heads": 3, "index_topk": 4,
       "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.mark.parametrize("model_type, indexer_pairing", [("deepseek_v32", "split_half"),
                                                          ("glm_moe_dsa", "interleaved_to_split_half")])
def test_dsa_branch_tables_are_listed(model_type, indexer_pairing):
    r = ins.inspect_model({"model_type": model_type, **DSA})
    # the MLA slice (qk_rope_head_dim 16) and the indexer heads (index_head_dim 40, leading 16 channels rotate)
    assert [(b["branch"], b["head_dim"], b["rotary_dim"], b["pairing"], b["base"]) for b in r["branches"]] == [
        ("attention", 16, 16, "interleaved_to_split_half", 10000.0), ("indexer", 40, 16, indexer_pairing, 10000.0)]
    text = _text(r)
    assert "Branches (tables inside one layer" in text
    assert f"indexer: head_dim 40, rotary_dim 16, pairing {indexer_pairing}" in text
    assert json.loads(json.dumps(r)) == r


GEMMA3N = {"model_type": "gemma3n_text", "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 16, "num_hidden_layers": 8, "num_kv_shared_layers": 3,
           "layer_types": (["sliding_attention"] * 3 + ["full_attention"]) * 2}


def test_kv_sharing_is_listed_and_bad_counts_refused():
    r = ins.inspect_model(GEMMA3N)
    # the last 3 layers read the keys of the last earlier layer of their own type: 5, 6 (sliding) <- 4; 7 <- 3
    assert r["kv_sharing"] == [[5, 4], [6, 4], [7, 3]] and r["branches"] == []
    assert "layer <- source: 5 <- 4, 6 <- 4, 7 <- 3" in _text(r)
    with pytest.raises(PosencError, match="num_kv_shared_layers"):
        ins.inspect_model({**GEMMA3N, "num_kv_shared_layers": 8})


def test_kv_shared_layers_add_nothing_to_the_cache():
    # 8 layers, 3 of them reading an earlier layer's cache: 5 store keys and values. Every layer here is within
    # its window at 16 tokens (no sliding_window key: none is set), so bytes = 5 layers x 2 (K, V) x 1 head x 16
    # channels x 16 tokens x 2 bytes (fp16).
    facts = kv_cache_facts(GEMMA3N)
    assert ins.kv_bytes(facts, 16, "fp16") == 5 * 2 * 1 * 16 * 16 * 2
    assert ins.kv_bytes(kv_cache_facts({**GEMMA3N, "num_kv_shared_layers": 0}), 16, "fp16") == 8 * 2 * 16 * 16 * 2
    assert any("3 of 8 layers reuse" in n for n in facts.notes)
