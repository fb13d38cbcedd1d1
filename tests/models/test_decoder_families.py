"""`Decoder.from_hf_config` builds the families whose layers differ from Llama only by config facts (issue 16).

Oracle: transformers' own model of each family (`AutoModelForCausalLM.from_config`, a tiny seeded config with the
family's features switched on and sized to matter), float64, posenc's decoder holding its state dict.
transformers rounds its RMS norms (and Gemma 2's eager softmax, Llama 4's rotation and L2 norm) through float32
even in a float64 model, and builds Llama 4's table with `torch.polar` (1 ulp from cos / sin); those few
functions are replaced by float64 / cos-sin copies of the same formulas so TOL[float64] (1e-10) applies.
Checked per family: the full forward, a left-padded batch against each row alone, and prefill + single-token
decode through `new_cache` against the full forward. Each family's
distinguishing fact, removed from the `Arch`, moves the logits far from transformers' (the fact matters).
"""

import dataclasses

import pytest
import torch
from tests.helpers.tolerances import assert_close
from tests.helpers.decoder_checks import check_decode_and_padding

transformers = pytest.importorskip("transformers")

import posenc  # noqa: E402
from posenc.models import Decoder  # noqa: E402
from posenc.models.arch import Arch, LayerSpec, MoESpec  # noqa: E402

SEQ = 12
SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=128, initializer_range=0.3,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
GEMMA3_ROPE = {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
# family -> (config class, extra config, module, the Arch facts that distinguish it -> a mutated value)
FAMILIES = {
    "qwen3": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=4, max_window_layers=2), "qwen3",
              {"qk_norm": None}),
    "gemma2": ("Gemma2Config", dict(sliding_window=4, query_pre_attn_scalar=24, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=3.0), "gemma2",
               {"attn_softcap": None, "logit_softcap": None, "layout": "pre", "norm": "rms", "embed_scale": 1.0,
                "attn_scale": None, "activation": "silu"}),
    "gemma3_text": ("Gemma3TextConfig", dict(sliding_window=4, query_pre_attn_scalar=24, rope_parameters=GEMMA3_ROPE,
                                             layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                          "sliding_attention"]), "gemma3", {"qk_norm": None}),
    "olmo2": ("Olmo2Config", {}, "olmo2", {"qk_norm": None, "layout": "sandwich"}),
    "olmo3": ("Olmo3Config", dict(sliding_window=4), "olmo3", {"qk_norm": None}),
    "granite": ("GraniteConfig", dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                      logits_scaling=4.0), "granite",
                {"embed_scale": 1.0, "residual_scale": 1.0, "attn_scale": None, "logit_scale": 1.0}),
    "smollm3": ("SmolLM3Config", dict(no_rope_layers=[1, 1, 0, 1], use_sliding_window=True, sliding_window=4),
                "smollm3", {}),
    "llama4_text": ("Llama4TextConfig", dict(moe_layers=[], intermediate_size_mlp=80, attention_chunk_size=3,
                                             floor_scale=2, attn_scale=0.5, rms_norm_eps=1e-5), "llama4",
                    {"qk_norm": None}),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=4,
                                     swiglu_limit=0.5, swiglu_alpha=1.3), "gpt_oss",
                {"sinks": False, "moe": MoESpec(4, 2, alpha=1.3, limit=100.0),
                 "moe ": MoESpec(4, 2, alpha=1.0, limit=0.5)}),
    "ministral3": ("Ministral3Config", dict(sliding_window=5, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "llama_4_scaling_beta": 0.4,
        "original_max_position_embeddings": 3}),
        "ministral3", {}),
}
EAGER = {"gemma2", "gpt_oss"}  # soft-capping and sinks: transformers and posenc both run eager attention


def _norm64(offset):
    def forward(self, x):  # the family's RMS / L2 norm, kept in float64
        eps = getattr(self, "variance_epsilon", None) or self.eps
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        weight = getattr(self, "weight", None)
        if weight is None:
            return normed
        return normed * (1.0 + weight) if offset else weight * normed
    return forward


def _eager64(module, query, key, value, attention_mask, dropout=0.0, scaling=None, softcap=None, **kwargs):
    """Gemma 2's eager attention with its softmax in the input dtype (transformers': float32)."""
    groups = module.num_key_value_groups
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = query @ key.transpose(2, 3) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    return (torch.softmax(scores, -1) @ value).transpose(1, 2).contiguous(), None


def _rotate64(xq, xk, freqs_cis):
    """Llama 4's complex rotation without its float32 round trip."""
    def rot(x):
        pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
        return torch.view_as_real(pairs * freqs_cis[:, :, None, :]).flatten(3).type_as(x)
    return rot(xq), rot(xk)


def _freqs_cis(self, x, position_ids):
    """Llama 4's table through cos and sin: `torch.polar` rounds 1 ulp differently (tests/helpers/hf_enumeration.py)."""
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)  # float32
    return torch.complex(freqs.cos(), freqs.sin()) * self.attention_scaling


def hf_model(family, monkeypatch, **extra):
    """transformers' float64 model of `family` (seeded), its float32 detours replaced by float64 copies."""
    import importlib

    config_cls, facts, module_name, _ = FAMILIES[family]
    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    for name, cls in vars(module).items():
        if isinstance(cls, type) and (name.endswith("RMSNorm") or name.endswith("L2Norm")):
            monkeypatch.setattr(cls, "forward", _norm64(offset=name.startswith("Gemma")))
    if family == "gemma2":
        monkeypatch.setattr(module, "eager_attention_forward", _eager64)
    if family == "llama4_text":
        monkeypatch.setattr(module, "apply_rotary_emb", _rotate64)
        monkeypatch.setattr(module.Llama4TextRotaryEmbedding, "forward", _freqs_cis)
    impl = "eager" if family in EAGER else "sdpa"
    if family == "gpt_oss":  # the experts' loop (grouped_mm, transformers' default, refuses float64)
        extra = {"experts_implementation": "eager", **extra}
    config = getattr(transformers, config_cls)(**{**SMALL, **facts, **extra}, attn_implementation=impl)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).double().eval()
    with torch.no_grad():  # norms start at 1 (or 0 for Gemma): make every weight matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model


def ours(hf, **kw):
    """posenc's decoder from the same config, holding transformers' weights."""
    impl = "eager" if hf.config.model_type in EAGER else "sdpa"
    model = Decoder.from_hf_config(hf.config, attn_impl=impl, **kw).double().eval()
    model.load_state_dict(hf.state_dict())
    return model


def tokens(shape, seed=1):
    return torch.randint(0, 96, shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@torch.no_grad()
def test_family_equals_transformers(family, monkeypatch):
    hf = hf_model(family, monkeypatch)
    model = ours(hf)
    ids = tokens((2, SEQ))
    want = hf(ids).logits
    assert_close(model(ids), want, msg=f"{family} full forward")
    # prefill + decode, and a left-padded batch whose every row equals transformers on that row alone
    check_decode_and_padding(model, ids, want, prefill=5, pad=4, alone=lambda x: hf(x).logits, capacity=16,
                             label=family)


@pytest.mark.parametrize("family", sorted(f for f in FAMILIES if FAMILIES[f][3]))
@torch.no_grad()
def test_each_distinguishing_fact_matters(family, monkeypatch):
    """Without any one of the family's facts the logits leave transformers' by far more than the tolerance."""
    hf = hf_model(family, monkeypatch)
    model = ours(hf)
    ids = tokens((1, SEQ))
    want = hf(ids).logits
    for fact, value in FAMILIES[family][3].items():
        fact = fact.strip()  # a trailing space: a second mutation of the same fact
        mutant = Decoder(**_sizes(model), encoding=model.encoding,
                         arch=dataclasses.replace(model.arch, **{fact: value}),
                         attn_impl="sdpa" if fact == "attn_softcap" else model.attn_impl).double().eval()
        mutant.load_state_dict(_mutant_state(hf.state_dict(), model, mutant), strict=False)
        assert (mutant(ids) - want).abs().max() > 1e-4, f"{family} with {fact}={value}"


def _sizes(model):
    layer = model.layers[0]
    attn = layer.self_attn
    mlp = getattr(layer, model.arch.mlp_name)
    inter = mlp.experts.down_proj.shape[1] if model.arch.moe is not None else mlp.gate_proj.weight.shape[0]
    return dict(vocab_size=model.vocab_size, hidden_size=model.embed_tokens.weight.shape[1],
                num_layers=len(model.layers), num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                head_dim=model.head_dim, intermediate_size=inter, rms_norm_eps=model.norm.eps,
                tie_word_embeddings=model.lm_head.weight is model.embed_tokens.weight,
                attention_bias=attn.o_proj.bias is not None, qkv_bias=attn.q_proj.bias is not None)


def _mutant_state(state, model, mutant):
    """transformers' tensors the mutant has (a mutant with fewer norms drops some; one with more keeps its init)."""
    from posenc.models.loading import posenc_state_dict

    mine = mutant.state_dict()
    return {k: v for k, v in posenc_state_dict(state, tied=False).items() if k in mine and v.shape == mine[k].shape}


def test_families_without_rope_layers_share_no_rope():
    """SmolLM 3 / Llama 4 / Gemma 3 layers differ in RoPE: each layer carries its own, the cache none."""
    cfg = transformers.SmolLM3Config(**SMALL, no_rope_layers=[1, 1, 0, 1])
    model = Decoder.from_hf_config(cfg, seed=0)
    assert model.rope is None and [s.rope is None for s in model.arch.layers] == [False, False, True, False]
    with pytest.raises(posenc.PosencError, match=r"^store: expected 'rotated'"):
        model.new_cache(1, 4, store="unrotated")


@pytest.mark.parametrize("config, match", [
    (lambda: transformers.Qwen3MoeConfig(**SMALL), r"config\['model_type'\].*'qwen3_moe', whose layers need a mix"),
    (lambda: transformers.Llama4TextConfig(**SMALL),
     r"config\['moe_layers'\]: expected no MoE layers.*got MoE layers \[0, 1, 2, 3\]"),
    (lambda: transformers.MixtralConfig(**SMALL), r"'mixtral', whose layers need a mixture"),
    (lambda: {**SMALL, "model_type": "mistral", "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
              "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 8}},
     r"^config\['model_type'\]: expected a family posenc's decoder builds with its query temperature"),
])
def test_refused_families_say_why(config, match):
    with pytest.raises(posenc.PosencError, match=match):
        Decoder.from_hf_config(config())


def test_softcap_needs_eager_or_flex():
    cfg = transformers.Gemma2Config(**SMALL)
    with pytest.raises(posenc.PosencError, match=r"^attn_impl: expected 'eager' or 'flex' \(this gemma2 model soft"):
        Decoder.from_hf_config(cfg)
    model = Decoder.from_hf_config(cfg, attn_impl="flex")
    with pytest.raises(posenc.PosencError, match=r"^attn_impl"):
        model.attn_impl = "sdpa"
    assert model.attn_impl == "flex"  # unchanged
    with pytest.raises(posenc.PosencError, match=r"^attn_impl: expected 'eager' \(this gpt_oss model adds attention"):
        Decoder.from_hf_config(transformers.GptOssConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2))


ROPE = posenc.Rope(head_dim=16)
DYNAMIC = posenc.Rope(head_dim=16, scaling=posenc.DynamicNTK(factor=2.0, max_positions=8))


@pytest.mark.parametrize("make, match", [
    (lambda: LayerSpec(window=0), r"^window: expected None or an integer >= 1, got 0"),
    (lambda: LayerSpec(chunk=1.5), r"^chunk: expected None or an integer >= 1"),
    (lambda: LayerSpec(rope="rope"), r"^rope: expected None or a posenc.Rope"),
    (lambda: LayerSpec(temperature=0.1), r"^temperature: expected None or a posenc.rope"),
    (lambda: Arch(layers=()), r"^layers: expected a non-empty tuple of LayerSpec"),
    (lambda: Arch(layers=(LayerSpec(),), norm="layer"), r"^norm: expected one of"),
    (lambda: Arch(layers=(LayerSpec(),), attn_softcap=0.0), r"^attn_softcap: expected"),
    (lambda: Arch(layers=(LayerSpec(),), sinks=1), r"^sinks: expected True or False"),
    (lambda: Arch(layers=(LayerSpec(),), moe=(4, 2)), r"^moe: expected None or a MoESpec"),
    (lambda: MoESpec(num_experts=2, top_k=3), r"^top_k: expected an integer .*2"),
    (lambda: _decoder(layers=(LayerSpec(),)), r"^arch: expected 2 layer specs"),
    (lambda: _decoder(encoding=ROPE, layers=(LayerSpec(rope=ROPE),) * 2), r"^encoding: expected None"),
    (lambda: _decoder(layers=(LayerSpec(rope=posenc.Rope(head_dim=8)),) * 2),
     r"^arch: expected layer RoPEs of head_dim=16"),
    (lambda: _decoder(layers=(LayerSpec(rope=DYNAMIC),) * 2), r"^arch: expected layer RoPEs with a length-independent"),
    (lambda: _decoder(layers=(LayerSpec(window=4),) * 2, layer_windows=(None, None)),
     r"^layer_windows: expected None or the arch's windows \(4, 4\)"),
    (lambda: _decoder(encoding=ROPE, qk_norm="l2"), r"^encoding: expected None \(qk_norm 'l2'"),
    (lambda: _decoder(arch="gemma"), r"^arch: expected None or a posenc.models.arch.Arch"),
])
def test_arch_values_refuse_bad_input(make, match):
    with pytest.raises(posenc.PosencError, match=match):
        make()


def _decoder(layers=(LayerSpec(),) * 2, encoding=None, layer_windows=None, arch=None, **facts):
    arch = arch or Arch(layers=layers, **facts)
    return Decoder(vocab_size=10, hidden_size=32, num_layers=2, num_heads=2, intermediate_size=8, encoding=encoding,
                   layer_windows=layer_windows, arch=arch)
