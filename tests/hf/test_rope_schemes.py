"""Rotary schemes of newer families against transformers' own rotary classes and apply functions, on random
tensors and multi-axis positions: Ernie 4.5 VL's h/w-alternating M-RoPE.
"""

import pytest
import torch
from tests.helpers.oracles import rotate_angles

import posenc
import posenc.hf
from posenc import PosencError

transformers = pytest.importorskip("transformers")

ERNIE = {"model_type": "ernie4_5_vl_moe_text", "hidden_size": 80, "num_attention_heads": 2, "head_dim": 40,
         "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 32, "max_position_embeddings": 4096,
         "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [6, 6, 8]}}


def _hf(cfg):
    return transformers.AutoConfig.for_model(cfg["model_type"], **{k: v for k, v in cfg.items() if k != "model_type"})


def _axes(gen, t):
    """[3, 1, t] positions whose three rows differ (text, then an image's rows and columns)."""
    return torch.stack([torch.randint(0, 3000, (t,), generator=gen) for _ in range(3)])[:, None]


@pytest.mark.parametrize("section", [[6, 6, 8], [2, 2, 16], [4, 4, 12]])
def test_ernie_vl_mrope_matches_transformers(section):
    from transformers.models.ernie4_5_vl_moe import modeling_ernie4_5_vl_moe as m

    cfg = {**ERNIE, "rope_parameters": {**ERNIE["rope_parameters"], "mrope_section": section}}
    config = _hf(cfg)
    rope = posenc.Rope.from_hf_config(cfg)
    assert rope == posenc.Rope.from_hf_config(config) and rope.pairing == "interleaved"
    gen = torch.Generator().manual_seed(sum(section))
    q, k = torch.randn(2, 2, 13, 40, generator=gen), torch.randn(2, 1, 13, 40, generator=gen)
    pos = _axes(gen, 13).expand(3, 2, 13)
    rotary = m.Ernie4_5_VLMoeTextRotaryEmbedding(config)
    cos, sin = rotary(q, pos)
    want = m.apply_rotary_pos_emb(q, k, cos, sin)
    got = rope.apply(q, k, pos)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    # the 2x2 oracle from the stated rule: pair j < 2 s_h follows axis 1 (j even) or 2 (j odd), the rest axis 0,
    # each at its own ladder frequency base**(-2j / d)
    s_h = section[0]
    axis = torch.tensor([1 + j % 2 if j < 2 * s_h else 0 for j in range(20)])
    inv = (1.0 / 500000.0 ** (torch.arange(0, 40, 2, dtype=torch.int64).float() / 40)).double()  # [20]
    angles = pos.double()[axis, :, :].permute(1, 2, 0) * inv  # [b, t, 20]
    oracle = rotate_angles(q, angles[:, None], "interleaved")
    assert torch.allclose(rope.apply(q, k, pos, precision="exact")[0].double(), oracle, atol=1e-5)


@pytest.mark.parametrize("section, match", [([6, 7, 7], "s_h == s_w"), ([6, 6], "3 integers"), ([10, 10, 0], "s_t >= 1"),
                                            ([6, 6, 9], "sections summing to rotary_dim / 2 = 20")])
def test_ernie_vl_bad_sections_name_the_key(section, match):
    cfg = {**ERNIE, "rope_parameters": {**ERNIE["rope_parameters"], "mrope_section": section}}
    with pytest.raises(PosencError, match=r"config\['rope_parameters'\]\['mrope_section'\]: expected .*" + match):
        posenc.hf.rope_by_layer_type(cfg)


# ------------------------------------------------------------------------------ Qwen3.5: partial interleaved M-RoPE
@pytest.mark.parametrize("section", [[3, 3, 2], [2, 3, 3], [4, 2, 2]])
def test_qwen3_5_partial_interleaved_mrope_matches_transformers(section):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    cfg = {"model_type": "qwen3_5_text", "hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 36, "num_hidden_layers": 2, "vocab_size": 32, "layer_types": ["full_attention"] * 2,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.5,
                               "mrope_section": section, "mrope_interleaved": True}}  # 18 rotary channels: 9 pairs
    config = _hf(cfg)
    rope = posenc.hf.rope_by_layer_type(cfg)["full_attention"]
    assert (rope.rotary_dim, rope.mrope_interleaved) == (18, True)
    gen = torch.Generator().manual_seed(sum(section))
    q, k = torch.randn(2, 2, 7, 36, generator=gen), torch.randn(2, 1, 7, 36, generator=gen)
    pos = _axes(gen, 7).expand(3, 2, 7)
    cos, sin = m.Qwen3_5TextRotaryEmbedding(config)(q, pos)
    want = m.apply_rotary_pos_emb(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(rope.apply(q, k, pos), want))
    # the 2x2 oracle from the stated rule: pair j follows H if j % 3 == 1 and j < 3 s_h, W if j % 3 == 2 and
    # j < 3 s_w, else T; the pass-through channels 18.. are untouched
    axis = torch.tensor([1 if j % 3 == 1 and j < 3 * section[1] else 2 if j % 3 == 2 and j < 3 * section[2] else 0
                         for j in range(9)])
    inv = (1.0 / 1e7 ** (torch.arange(0, 18, 2, dtype=torch.int64).float() / 18)).double()  # [9]
    angles = pos.double()[axis].permute(1, 2, 0) * inv  # [b, t, 9]
    got = rope.apply(q, k, pos, precision="exact")[0]
    assert torch.allclose(got.double(), rotate_angles(q, angles[:, None], "split_half"), atol=1e-5)
    assert torch.equal(got[..., 18:], q[..., 18:])


# ------------------------------------------------------------------------------ DSA indexers
DSA = {"hidden_size": 64, "num_attention_heads": 2, "num_key_value_heads": 2, "num_hidden_layers": 2,
       "vocab_size": 32, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 16, "qk_nope_head_dim": 16,
       "v_head_dim": 16, "index_head_dim": 40, "index_n_heads": 3, "index_topk": 4,
       "max_position_embeddings": 4096, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


@pytest.mark.parametrize("model_type, module, indexer, pairing", [
    ("deepseek_v32", "deepseek_v32", "DeepseekV32Indexer", "split_half"),
    ("glm_moe_dsa", "glm_moe_dsa", "GlmMoeDsaIndexer", "interleaved_to_split_half"),
])
def test_dsa_indexer_branch_matches_the_indexer_forward(monkeypatch, model_type, module, indexer, pairing):
    """The indexer's own forward, its rotation recorded: posenc's "indexer" Rope on the whole index head rotates
    the leading qk_rope_head_dim channels exactly as it does, and passes the rest through."""
    import importlib

    m = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    config = _hf({"model_type": model_type, **DSA})
    ropes = posenc.hf.branch_ropes(config)
    assert ropes == posenc.hf.branch_ropes({"model_type": model_type, **DSA})
    assert (ropes["indexer"].head_dim, ropes["indexer"].rotary_dim, ropes["indexer"].pairing) == (40, 16, pairing)
    assert ropes["attention"].pairing == "interleaved_to_split_half"  # the MLA attention, whatever rope_interleave
    seen = []
    for name in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_interleave"):
        original = getattr(m, name, None)
        if original is None:
            continue

        def record(q, k, cos, sin, *args, _original=original, **kwargs):
            out = _original(q, k, cos, sin, *args, **kwargs)
            seen.append((q, k, out))
            return out
        monkeypatch.setattr(m, name, record)
    torch.manual_seed(0)
    layer = getattr(m, indexer)(config, 0).eval()
    gen = torch.Generator().manual_seed(3)
    hidden, q_resid = torch.randn(1, 11, 64, generator=gen), torch.randn(1, 11, 16, generator=gen)
    pos = torch.tensor([[0, 1, 2, 3, 50, 51, 52, 900, 901, 4000, 4095]])
    rotary = getattr(m, type(layer).__name__.replace("Indexer", "RotaryEmbedding"))(config)
    layer(hidden, q_resid, rotary(hidden, pos), torch.zeros(1, 1, 11, 11), pos)
    (q_rot, k_rot, (q_out, k_out)), = seen
    q = layer.wq_b(q_resid).view(1, 11, 3, 40)  # [b, t, h, index_head_dim] before rotation
    k = layer.k_norm(layer.wk(hidden)).unsqueeze(2)  # [b, t, 1, index_head_dim]
    assert torch.equal(q_rot, q[..., :16]) and torch.equal(k_rot, k[..., :16])  # the leading channels rotate
    q2, k2 = ropes["indexer"].apply(q, k, pos[0], layout="bthd")
    assert torch.equal(q2[..., :16], q_out) and torch.equal(k2[..., :16], k_out)
    assert torch.equal(q2[..., 16:], q[..., 16:]) and torch.equal(k2[..., 16:], k[..., 16:])


def test_dsa_index_head_narrower_than_the_rope_slice_is_refused():
    with pytest.raises(PosencError, match=r"config\['index_head_dim'\]: expected at least qk_rope_head_dim = 16"):
        posenc.hf.branch_ropes({"model_type": "deepseek_v32", **DSA, "index_head_dim": 8})


# ------------------------------------------------------------------------------ DeepSeek-V4 branches
V4 = {"model_type": "deepseek_v4", "num_hidden_layers": 3,
      "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]}


def test_deepseek_v4_branch_tables_and_rotation_match_transformers():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    config = _hf(V4)
    ropes = posenc.hf.branch_ropes(config)
    assert ropes == posenc.hf.branch_ropes(V4) and sorted(ropes) == ["compress", "main"]
    assert ropes["main"].base == config.rope_parameters["main"]["rope_theta"] != ropes["compress"].base
    rotary = m.DeepseekV4RotaryEmbedding(config)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 3, 9, config.head_dim, generator=gen)  # [b, h, t, 512]: [nope | rope] per head
    pos = torch.tensor([[0, 1, 2, 127, 128, 4096, 4097, 65536, 900000]]).expand(2, -1)
    for key, rope in ropes.items():
        cos, sin = rotary(x, pos, layer_type=key)
        want = m.apply_rotary_pos_emb(x, cos, sin)
        r = rope.head_dim  # the trailing rope slice
        got = rope.rotate(x[..., -r:].contiguous(), pos)
        assert torch.equal(want[..., :-r], x[..., :-r]) and torch.equal(want[..., -r:], got), key
    # each layer type reads the table its attention names (built on the meta device: no weights)
    by_type = posenc.hf.rope_by_layer_type(config)
    for i, layer_type in enumerate(config.layer_types):
        with torch.device("meta"):
            attention = m.DeepseekV4Attention(config, i)
        assert by_type[layer_type] == ropes[attention.rope_layer_type], layer_type


def test_deepseek_v4_missing_branch_names_the_key():
    cfg = {**V4, "rope_parameters": {"main": "yarn", "compress": {"rope_type": "default", "rope_theta": 160000.0,
                                                                  "partial_rotary_factor": 0.125}}}
    with pytest.raises(PosencError, match=r"config\['rope_parameters'\]\['main'\]: expected a dict"):
        posenc.hf.branch_ropes(cfg)
    with pytest.raises(PosencError, match=r"config\['rope_parameters'\]\['main'\]: expected a dict"):
        posenc.hf.rope_by_layer_type(cfg)


# ------------------------------------------------------------------------------ Gemma 3n: q-only layers
@pytest.mark.parametrize("layers, shared, pattern", [(8, 3, 4), (7, 2, 2), (12, 5, 5), (6, 0, 3), (30, 10, 5)])
def test_gemma3n_kv_sources_match_transformers(layers, shared, pattern):
    from transformers.models.gemma3n import modeling_gemma3n as m

    types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    cfg = {"model_type": "gemma3n_text", "hidden_size": 32, "num_attention_heads": 2, "num_key_value_heads": 1,
           "head_dim": 16, "num_hidden_layers": layers, "num_kv_shared_layers": shared, "layer_types": types,
           "vocab_size": 32, "vocab_size_per_layer_input": 32, "hidden_size_per_layer_input": 8,
           "intermediate_size": 32, "laurel_rank": 4, "altup_num_inputs": 2}
    config = _hf(cfg)
    sources = posenc.hf.kv_sources(config)
    assert sources == posenc.hf.kv_sources(cfg) and len(sources) == layers
    modes = config.kv_sharing_modes
    ropes = posenc.hf.layer_ropes(config)
    for i, source in enumerate(sources):
        with torch.device("meta"):
            attention = m.Gemma3nTextAttention(config, i)
        assert attention.is_kv_shared_layer == (source is not None)  # it rotates only q
        if source is not None:  # it reads shared_kv_states[its type], which the "store" layer of that type writes
            assert modes[source] == "store" and types[source] == types[i] and source < layers - shared
            assert ropes[source] == ropes[i]  # its q and the reused keys share one table


def test_kv_sharing_bad_counts():
    cfg = {"model_type": "gemma3n_text", "hidden_size": 32, "num_attention_heads": 2, "head_dim": 16,
           "num_hidden_layers": 4, "layer_types": ["sliding_attention"] * 3 + ["full_attention"]}
    with pytest.raises(PosencError, match=r"num_kv_shared_layers'\]: expected an integer in \[0, num_hidden_layers"):
        posenc.hf.kv_sources({**cfg, "num_kv_shared_layers": 4})
    with pytest.raises(PosencError, match=r"num_kv_shared_layers'\]: expected a value leaving a full_attention layer"):
        posenc.hf.kv_sources({**cfg, "num_kv_shared_layers": 1})


# ------------------------------------------------------------------------------ keys transformers accepts
HUNYUAN = {"model_type": "hunyuan_v1_dense", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
           "num_hidden_layers": 2, "vocab_size": 32, "max_position_embeddings": 32768,
           "rope_parameters": {"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0, "beta_fast": 32, "beta_slow": 1,
                               "mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0}}  # as its checkpoints


@pytest.mark.parametrize("model_type", ["hunyuan_v1_dense", "hunyuan_v1_moe"])
def test_hunyuan_ntk_alpha_matches_transformers(model_type):
    import importlib

    m = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    cfg = {**HUNYUAN, "model_type": model_type}
    config = _hf(cfg)
    rope = posenc.Rope.from_hf_config(cfg)
    assert rope == posenc.Rope.from_hf_config(config) and rope.scaling == posenc.rope.scaling.NTKAware(1000.0)
    rotary = next(c for n, c in vars(m).items() if n.endswith("RotaryEmbedding"))(config)
    assert rotary.rope_type == "ntk_alpha" and torch.equal(rotary.inv_freq, rope.inv_freq()[0])
    pos = torch.tensor([[0, 1, 4095, 32767, 100000]])  # past max_position_embeddings: still static
    cos, sin = rotary(torch.zeros(1), pos)
    ours = rope.cos_sin(pos[0])
    assert torch.equal(cos[0, :, :8], ours[0]) and torch.equal(sin[0, :, :8], ours[1])


@pytest.mark.parametrize("change, match", [({"alpha": -2.0}, r"\['alpha'\]: expected"),
                                           ({"short_factor": [1.0]}, r"\['short_factor'\]: expected no such key")])
def test_hunyuan_bad_alpha_dicts_name_the_key(change, match):
    cfg = {**HUNYUAN, "rope_parameters": {**HUNYUAN["rope_parameters"], **change}}
    with pytest.raises(PosencError, match=r"config\['rope_parameters'\]" + match):
        posenc.Rope.from_hf_config(cfg)


@pytest.mark.parametrize("model_type", ["deepseek_v32", "glm_moe_dsa", "deepseek_v3"])
@pytest.mark.parametrize("flag", [True, False])
def test_mla_pairing_follows_the_attention_not_the_flag(model_type, flag):
    """DSA attention de-interleaves whatever rope_interleave says; DeepSeek-V3 follows the flag."""
    from tests.helpers.hf_enumeration import check

    outcome = check(model_type, model_type, {"rope_interleave": flag})
    assert outcome.outcome == "exact", outcome
    pairing = posenc.Rope.from_hf_config({"model_type": model_type, **DSA, "rope_interleave": flag}).pairing
    assert pairing == ("split_half" if model_type == "deepseek_v3" and not flag else "interleaved_to_split_half")


def test_qwen3_omni_interleaved_key_is_accepted_and_unread():
    cfg = {"model_type": "qwen3_omni_moe_text", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 3, 3]}}
    flagged = {**cfg, "rope_parameters": {**cfg["rope_parameters"], "interleaved": True}}
    _hf(flagged)  # transformers' config class takes it without a word (ignore_keys_at_rope_validation)
    assert posenc.Rope.from_hf_config(flagged) == posenc.Rope.from_hf_config(cfg)


def test_mistral_large4_nope_layers_and_kv_sources_match_transformers():
    from transformers.models.mistral_large4 import modeling_mistral_large4 as m

    config = _hf({"model_type": "mistral_large4_text", "num_hidden_layers": 9,
                  "kv_source_layers": [0, 1, 1, 3, 4, 4, 6, 3, 6]})  # layers 3 and 7 have no RoPE
    ropes, sources = posenc.hf.layer_ropes(config), posenc.hf.kv_sources(config)
    assert sources == (None, None, 1, None, None, 4, None, 3, 6)
    modes = config.kv_sharing_modes
    for i in range(9):
        with torch.device("meta"):
            attention = m.MistralLarge4TextAttention(config, i)
        assert (ropes[i] is not None) == bool(attention.use_rope)  # every 4th layer: no RoPE
        assert (sources[i] is not None) == modes[i].startswith("reuse") if modes[i] else sources[i] is None
    # transformers would read layer 1's keys for layer 4 (the last RoPE layer that stores), not layer 3's (NoPE)
    with pytest.raises(PosencError, match=r"kv_source_layers'\]\[4\]: expected 1, the last earlier layer that stores"):
        posenc.hf.kv_sources(_hf({"model_type": "mistral_large4_text", "num_hidden_layers": 6,
                                  "kv_source_layers": [0, 1, 1, 3, 3, 5]}))
    with pytest.raises(PosencError, match=r"kv_source_layers'\]\[2\]: expected a layer that computes its own keys"):
        posenc.hf.kv_sources({"model_type": "mistral_large4_text", "num_hidden_layers": 3, "hidden_size": 64,
                              "num_attention_heads": 2, "kv_source_layers": [0, 0, 1]})
