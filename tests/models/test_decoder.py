"""The small decoder: full forward == transformers' Llama; cached decoding == one full forward.

Oracles: transformers' `LlamaForCausalLM` holding the same weights (full forward, every scaling it
knows), and `reference_logits`, a loop-based float64 forward written here (explicit masks, 2x2 rotations).
Float64 throughout, tolerance TOL[float64] = 1e-10.
"""

import functools
import importlib

import pytest
import torch

import posenc
from posenc.bias import ALiBi, T5RelativeBias
from posenc.models import Decoder
from tests.helpers.tolerances import assert_close
from tests.helpers.oracles import rotate_pairs

L0 = 16  # the original length of every length-dependent scaling below


BASE = {"model_type": "llama", "vocab_size": 50, "hidden_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 72, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4 * L0}
HALF = 6  # rotary pairs: head_dim 12
SCALINGS = {
    "default": {},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "ntk": {},  # static NTK-aware: no transformers config key, given as an encoding
    "dynamic": {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": L0},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": L0}},
    "longrope": {"rope_scaling": {"rope_type": "longrope", "original_max_position_embeddings": L0,
                                  "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                                  "long_factor": [1.5, 2.0, 3.0, 4.5, 6.0, 8.0]}},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": L0}},
}
LENGTH_DEPENDENT = ("dynamic", "longrope")


def config(name, **extra):
    cfg = dict(BASE) | SCALINGS[name] | extra
    if "rope_scaling" in cfg:
        cfg["rope_scaling"] = dict(cfg["rope_scaling"], rope_theta=10000.0)
    return cfg


@functools.lru_cache(maxsize=None)
def model(name, layers=2, seed=0):
    """A float64 random-weight decoder for one scaling (weights depend only on the seed and sizes)."""
    encoding = posenc.Rope(head_dim=12, scaling=posenc.NTKAware(factor=2.0)) if name == "ntk" else None
    return Decoder.from_hf_config(config(name, num_hidden_layers=layers), encoding=encoding, seed=seed).double().eval()


def tokens(shape, seed=1):
    return torch.randint(1, 50, shape, generator=torch.Generator().manual_seed(seed))


def rms(x, weight, eps):
    return weight * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))


def reference_logits(m, ids, positions, visible=None, seq_len=None):
    """One row, written independently: `ids, positions [t]`; `visible(q_pos, k_pos) -> bool` (default causal)."""
    t, hq, hk, d = len(ids), m.num_heads, m.num_kv_heads, m.head_dim
    seq_len = int(positions.max()) + 1 if seq_len is None else seq_len
    cos, sin = (x.double() for x in m.rope.cos_sin(positions, seq_len=seq_len))  # [t, r/2]
    allowed = torch.tensor([[bool(k <= q) if visible is None else bool(visible(int(q), int(k)))
                             for k in positions] for q in positions])  # [t, t]

    def rotate(x):  # [t, h, d], split-half pairs (i, i + r/2), the rest passed through
        return rotate_pairs(x, cos[:, None], sin[:, None])

    h = m.embed_tokens.weight[ids]  # [t, hidden]
    for layer in m.layers:
        at = layer.self_attn
        x = rms(h, layer.input_layernorm.weight, layer.input_layernorm.eps)
        q = rotate((x @ at.q_proj.weight.T).view(t, hq, d))
        k = rotate((x @ at.k_proj.weight.T).view(t, hk, d))
        v = (x @ at.v_proj.weight.T).view(t, hk, d)
        heads = []
        for head in range(hq):
            kv = head // (hq // hk)
            scores = (q[:, head] @ k[:, kv].T) / d**0.5  # [t, t]
            scores = scores.masked_fill(~allowed, float("-inf"))
            heads.append(torch.softmax(scores, -1) @ v[:, kv])  # [t, d]
        h = h + torch.cat(heads, -1) @ at.o_proj.weight.T
        mlp, y = layer.mlp, rms(h, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
        gated = torch.nn.functional.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)  # [t, inter]
        h = h + gated @ mlp.down_proj.weight.T
    return rms(h, m.norm.weight, m.norm.eps) @ m.lm_head.weight.T  # [t, vocab]


# ------------------------------------------------------------------ full forward against independent oracles
@pytest.mark.parametrize("name", [n for n in SCALINGS if n != "ntk"])
def test_full_forward_equals_transformers_llama(name, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama import modeling_llama

    # transformers' RMSNorm rounds through float32 even for float64 models; keep float64 so 1e-10 applies
    def rms_float64(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_float64)
    cfg = config(name)
    params = cfg.pop("rope_scaling", {"rope_type": "default", "rope_theta": 10000.0})
    ours = model(name)
    hf = LlamaForCausalLM(LlamaConfig(**cfg, rope_parameters=params)).double().eval()
    hf.load_state_dict({(k if k == "lm_head.weight" else "model." + k): v for k, v in ours.state_dict().items()})
    ids = tokens((2, 2 * L0))
    with torch.no_grad():
        for length in (L0 - 1, L0, L0 + 1, 2 * L0):  # ascending: transformers' dynamic NTK only grows
            assert_close(ours(ids[:, :length]), hf(ids[:, :length]).logits, msg=f"{name} at length {length}")


@pytest.mark.parametrize("name", ["default", "ntk", "dynamic", "longrope"])
def test_full_forward_equals_loop_reference(name):
    m, ids = model(name), tokens((1, L0 + 3))
    positions = torch.arange(L0 + 3) + 2  # logical positions need not start at 0
    with torch.no_grad():
        assert_close(m(ids, position_ids=positions), reference_logits(m, ids[0], positions)[None])


# ------------------------------------------------------------------ prefill + decode == full forward
@pytest.mark.parametrize("store", ["rotated", "unrotated"])
@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("end", [L0 - 1, L0, L0 + 1, 2 * L0])
@torch.no_grad()
def test_prefill_then_decode_equals_full_forward(name, store, end):
    m, ids = model(name), tokens((3, end))
    prefill = L0 // 2 if end == 2 * L0 else end - 3  # 2*L0 crosses L0 while decoding, token by token
    cache = m.new_cache(3, end + 1, store=store)
    assert_close(m(ids[:, :prefill], cache=cache), m(ids[:, :prefill]))
    for j in range(prefill, end):
        step = m(ids[:, j:j + 1], cache=cache)  # [3, 1, vocab]
        assert_close(step, m(ids[:, :j + 1])[:, -1:], msg=f"{name}/{store}: step at position {j}")
    assert cache.next_positions().tolist() == [end] * 3
    if name not in LENGTH_DEPENDENT:
        assert_close(step, m(ids)[:, -1:])


@pytest.mark.parametrize("name", ["default", "dynamic", "longrope"])
@pytest.mark.parametrize("chunk", [1, 3, L0 + 4])
@torch.no_grad()
def test_chunked_prefill_equals_one_shot(name, chunk):
    m, ids, n = model(name), tokens((2, L0 + 4)), L0 + 4
    one_shot_cache = m.new_cache(2, n + 1)
    one_shot = m(ids, cache=one_shot_cache)
    cache = m.new_cache(2, n + 1, store="unrotated")
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        out = m(ids[:, start:end], cache=cache)
        assert_close(out, m(ids[:, :end])[:, start:])  # every chunk == a full forward over its prefix
    assert_close(out, one_shot[:, -out.shape[1]:])
    assert torch.equal(cache.positions, one_shot_cache.positions)
    nxt = tokens((2, 1), seed=7)
    assert_close(m(nxt, cache=cache), m(nxt, cache=one_shot_cache))


# ------------------------------------------------------------------ batches: padding, beams, rollback
@pytest.mark.parametrize("name", ["default", "dynamic", "longrope"])
@pytest.mark.parametrize("store", ["rotated", "unrotated"])
@torch.no_grad()
def test_left_padded_batch_equals_each_row_alone(name, store):
    m, lengths, width, steps = model(name), [5, 12, L0 + 3], L0 + 3, 5
    prompts = [tokens((1, n), seed=10 + i)[0] for i, n in enumerate(lengths)]
    new = tokens((3, steps), seed=20)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):], mask[row, width - len(p):] = p, 1
    cache = m.new_cache(3, width + steps, store=store)
    outs = [m(ids, attention_mask=mask, cache=cache)]
    for j in range(steps):
        mask = torch.cat((mask, torch.ones(3, 1, dtype=torch.long)), 1)  # transformers-style growing mask
        outs.append(m(new[:, j:j + 1], attention_mask=mask, cache=cache))
    for row, p in enumerate(prompts):
        alone = m.new_cache(1, width + steps, store=store)
        solo = [m(p[None], cache=alone)] + [m(new[row:row + 1, j:j + 1], cache=alone) for j in range(steps)]
        assert_close(outs[0][row, width - len(p):], solo[0][0], msg=f"prefill row {row}")
        assert_close(torch.cat(outs[1:], 1)[row], torch.cat(solo[1:], 1)[0], msg=f"decode row {row}")
        assert cache.positions[row, :len(p) + steps].tolist() == list(range(len(p) + steps))


@pytest.mark.parametrize("name", ["default", "dynamic", "longrope"])
@pytest.mark.parametrize("store", ["rotated", "unrotated"])
@torch.no_grad()
def test_rollback_then_redecode_equals_never_decoding(name, store):
    m, prompt = model(name), tokens((2, L0 - 2))
    draft, accepted = tokens((2, 5), seed=3), tokens((2, 3), seed=4)
    cache = m.new_cache(2, L0 + 8, store=store)
    m(prompt, cache=cache)
    verify = m(draft, cache=cache)  # 5 speculative tokens at positions L0-2 .. L0+2, in one call
    assert_close(verify, m(torch.cat((prompt, draft), 1))[:, -5:])
    cache.rollback(4)  # keep the first draft token
    fresh = m.new_cache(2, L0 + 8, store=store)
    m(torch.cat((prompt, draft[:, :1]), 1), cache=fresh)
    for j in range(3):
        assert_close(m(accepted[:, j:j + 1], cache=cache), m(accepted[:, j:j + 1], cache=fresh))
    assert torch.equal(cache.positions, fresh.positions)


@torch.no_grad()
def test_beam_reorder_keeps_each_rows_positions():
    m = model("longrope")
    prompts, offsets = tokens((3, 6)), torch.tensor([[0], [3], [L0]])  # the last row starts past L0: long factors
    positions = torch.arange(6) + offsets
    cache = m.new_cache(3, 10)
    m(prompts, position_ids=positions, cache=cache)
    cache.reorder(torch.tensor([2, 0, 0]))
    nxt = tokens((3, 2), seed=5)
    out = torch.cat([m(nxt[:, j:j + 1], cache=cache) for j in range(2)], 1)  # positions continue per row
    for row, source in enumerate([2, 0, 0]):
        solo = m.new_cache(1, 10)
        m(prompts[source:source + 1], position_ids=positions[source], cache=solo)
        expected = torch.cat([m(nxt[row:row + 1, j:j + 1], cache=solo) for j in range(2)], 1)
        assert_close(out[row], expected[0])
        assert cache.positions[row, :8].tolist() == (torch.arange(8) + offsets[source]).tolist()


# ------------------------------------------------------------------ bias and absolute schemes under the cache
SCHEMES = {
    "alibi": lambda: ALiBi(4),
    "t5": lambda: T5RelativeBias(4, bidirectional=False),
    "sinusoidal": lambda: posenc.Sinusoidal(48),  # absolute schemes are added to the token embeddings
    "learned": lambda: posenc.LearnedPositions(64, 48),
}


@pytest.mark.parametrize("scheme", list(SCHEMES))
@torch.no_grad()
def test_other_schemes_under_the_cache_equal_full_rows(scheme):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = Decoder.from_hf_config(BASE, encoding=SCHEMES[scheme](), seed=0).double()
    ids, mask = tokens((2, 14)), torch.ones(2, 14, dtype=torch.long)
    mask[1, :4] = 0  # a left-padded row
    full = m(ids, attention_mask=mask)
    for store in ("rotated", "unrotated"):
        cache = m.new_cache(2, 14, store=store)
        outs = [m(ids[:, :7], attention_mask=mask[:, :7], cache=cache)]
        outs += [m(ids[:, j:j + 1], attention_mask=mask[:, :j + 1], cache=cache) for j in range(7, 14)]
        assert_close(torch.cat(outs, 1)[0], full[0])
        assert_close(torch.cat(outs, 1)[1, 4:], full[1, 4:])
    # the positions matter: the same tokens with doubled distances give other logits
    moved = m(ids[:1], position_ids=torch.arange(14) * 2)
    assert (moved - full[:1]).abs().max() > 1e-3


# ------------------------------------------------------------------ shapes, construction, bad input
@pytest.mark.parametrize("store", ["rotated", "unrotated"])
@torch.no_grad()
def test_odd_shapes_mqa_decode_equals_full_forward(store):
    cfg = config("longrope", vocab_size=37, hidden_size=30, num_attention_heads=3, num_key_value_heads=1,
                 head_dim=14, intermediate_size=41, tie_word_embeddings=True)
    cfg["rope_scaling"] = dict(cfg["rope_scaling"], short_factor=[1.0] * 7, long_factor=[1.0 + i for i in range(7)])
    m = Decoder.from_hf_config(cfg, seed=3).double()
    assert m.layers[0].self_attn.q_proj.weight.shape == (42, 30) and m.lm_head.weight is m.embed_tokens.weight
    ids = torch.randint(0, 37, (1, L0 + 3), generator=torch.Generator().manual_seed(0))
    cache = m.new_cache(1, L0 + 3, store=store)
    out = [m(ids[:, :5], cache=cache)] + [m(ids[:, j:j + 1], cache=cache) for j in range(5, L0 + 3)]
    assert_close(out[-1], m(ids)[:, -1:])
    assert_close(torch.cat(out, 1)[:, :L0], m(ids[:, :L0]))


def test_from_hf_config_seeds_dtypes_and_errors():
    a, b, c = (Decoder.from_hf_config(BASE, seed=s) for s in (0, 0, 1))
    assert torch.equal(a.layers[1].mlp.up_proj.weight, b.layers[1].mlp.up_proj.weight)
    assert not torch.equal(a.layers[1].mlp.up_proj.weight, c.layers[1].mlp.up_proj.weight)
    assert a.new_cache(2, 5).k[0].dtype == torch.float32 and a.double().new_cache(2, 5).k[0].dtype == torch.float64
    assert a.rope == posenc.Rope.from_hf_config(BASE) and a.new_cache(1, 3, store="unrotated").store == "unrotated"
    for bad, match in [
        ({k: v for k, v in BASE.items() if k != "vocab_size"}, r"config\['vocab_size'\]"),
        (BASE | {"hidden_act": "gelu"}, "hidden_act"),
        (BASE | {"sliding_window": 0}, "sliding_window"),
        (BASE | {"num_key_value_heads": 3}, r"^config\['num_key_value_heads'\]: expected a divisor"),
        (BASE | {"rope_scaling": {"rope_type": "linear"}}, "factor"),
        (BASE | {"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
    ]:
        with pytest.raises(posenc.PosencError, match=match):
            Decoder.from_hf_config(bad)
    with pytest.raises(posenc.PosencError, match="encoding"):
        Decoder.from_hf_config(BASE, encoding=posenc.Rope(head_dim=8))
    with pytest.raises(posenc.PosencError, match="store"):
        a.new_cache(1, 4, store="compressed")


@torch.no_grad()
def test_decoder_refuses_bad_inputs_and_leaves_the_cache_alone():
    m = model("default")
    cache = m.new_cache(2, 8)
    m(tokens((2, 5)), cache=cache)
    state = (cache.positions.clone(), cache.lengths.clone(), cache.k[1].clone())
    bad_calls = [
        (dict(input_ids=tokens((2, 1)), position_ids=torch.tensor([4])), "past its last cached position 4"),
        (dict(input_ids=tokens((2, 4))), "at most 3 new tokens"),
        (dict(input_ids=torch.full((2, 1), 50)), "vocab_size=50"),
        (dict(input_ids=tokens((2, 1)).float()), "input_ids"),
        (dict(input_ids=tokens((1, 1))), "cache: expected a KVCache"),
        (dict(input_ids=tokens((2, 1)), attention_mask=torch.full((2, 1), 2)), "attention_mask"),
        (dict(input_ids=tokens((2, 1)), attention_mask=torch.ones(2, 5, dtype=torch.long)), "counting each row"),
        (dict(input_ids=tokens((2, 1)), position_ids=torch.tensor([[5, 6]])), "position_ids"),
    ]
    for kwargs, match in bad_calls:
        with pytest.raises(posenc.PosencError, match=match):
            m(kwargs.pop("input_ids"), cache=cache, **kwargs)
    assert all(torch.equal(x, y) for x, y in zip(state, (cache.positions, cache.lengths, cache.k[1])))
    with pytest.raises(posenc.PosencError, match="cache"):
        model("longrope")(tokens((2, 1)), cache=cache)  # a cache built for another RoPE
    out = m(tokens((2, 1)), attention_mask=torch.ones(2, 6, dtype=torch.long), cache=cache)  # the right one works
    assert out.shape == (2, 1, 50) and cache.next_positions().tolist() == [6, 6]


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.bool, torch.float32])
def test_attention_mask_of_any_real_dtype(dtype):
    """A 0/1 mask may come as int, bool or float (torch.ones default); all give the same logits."""
    m = model("default")
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    want = m(ids, attention_mask=mask)
    got = m(ids, attention_mask=mask.to(dtype))
    assert torch.equal(got, want)


def test_attention_mask_values_must_be_zero_or_one():
    m = model("default")
    with pytest.raises(posenc.PosencError, match="attention_mask: expected a 0/1 tensor"):
        m(torch.zeros(1, 3, dtype=torch.long), attention_mask=torch.tensor([[0.0, 0.5, 1.0]]))



# ------------------------------------------------------------------ sliding windows (Mistral, Qwen2)
WINDOWED = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"model_type": "mistral", "sliding_window": 5}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"model_type": "qwen2", "use_sliding_window": True,
                                                   "sliding_window": 4, "max_window_layers": 1}),
}


@pytest.mark.parametrize("name", sorted(WINDOWED))
def test_sliding_window_equals_transformers(name, monkeypatch):
    """Mistral slides every layer; Qwen2 slides layers >= max_window_layers: logits equal transformers'."""
    import transformers

    config_cls, model_cls, extra = WINDOWED[name]
    family = importlib.import_module(f"transformers.models.{name}.modeling_{name}")

    def rms_float64(self, h):  # transformers' RMSNorm rounds through float32; keep float64 so 1e-10 applies
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(getattr(family, f"{name.capitalize()}RMSNorm"), "forward", rms_float64)
    cfg = {k: v for k, v in BASE.items() if k != "model_type"} | {k: v for k, v in extra.items() if k != "model_type"}
    ours = Decoder.from_hf_config(BASE | extra, seed=3).double().eval()
    expected_windows = (5, 5) if name == "mistral" else (None, 4)
    assert ours.layer_windows == expected_windows
    hf = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg)).double().eval()
    hf.load_state_dict({(k if k == "lm_head.weight" else "model." + k): v for k, v in ours.state_dict().items()})
    attn = ours.layers[0].self_attn
    if name == "qwen2":  # Qwen2: random nonzero q/k/v biases (transformers hard-wires them), no o bias
        assert all(p.bias is not None and bool(p.bias.abs().min() > 0) for p in (attn.q_proj, attn.k_proj, attn.v_proj))
        assert attn.o_proj.bias is None
    ids = tokens((2, 12))
    with torch.no_grad():
        want = hf(ids).logits
        assert_close(ours(ids), want)
        cache = ours.new_cache(2, 16)
        steps = [ours(ids[:, :6], cache=cache)] + [ours(ids[:, i:i + 1], cache=cache) for i in range(6, 12)]
        assert_close(torch.cat(steps, 1), want)  # decode under the window equals the full forward
        unwindowed = Decoder.from_hf_config(BASE | {"model_type": extra["model_type"]}, seed=3).double().eval()
        assert not torch.allclose(unwindowed(ids), want)  # the window matters at this length
