"""Random `Arch` values (norms, layouts, q/k norms, multipliers, caps, sinks, MoE, per-layer RoPE / NoPE, windows,
chunks, temperatures) through the decoder: invariants that need no other model.

Oracles: the same decoder's full forward (prefill + single-token decode must equal it, in both key stores where
the layers share one RoPE), and each row run alone (a left-padded batch must equal it). Float64, TOL[float64].
"""

import pytest
import torch
from tests.helpers.tolerances import assert_close
from tests.helpers.decoder_checks import check_decode_and_padding
from hypothesis import given, settings
from hypothesis import strategies as st

import posenc
from posenc.models import Decoder
from posenc.models.arch import Arch, LayerSpec, MoESpec
from posenc.rope.temperature import QueryTemperature

LAYERS, SEQ = 3, 9
ROPES = [posenc.Rope(head_dim=8), posenc.Rope(head_dim=8, base=500.0, pairing="interleaved"),
         posenc.Rope(head_dim=8, scaling=posenc.Linear(factor=2.0))]

spec = st.builds(LayerSpec, window=st.one_of(st.none(), st.integers(1, 6)), chunk=st.one_of(st.none(), st.integers(1, 5)),
                 temperature=st.one_of(st.none(), st.builds(QueryTemperature, beta=st.floats(0.0, 1.0),
                                                           floor_scale=st.integers(1, 4), offset=st.integers(0, 1))))


@st.composite
def arches(draw):
    specs = [draw(spec) for _ in range(LAYERS)]
    own = draw(st.booleans())  # per-layer RoPE (some NoPE) or one shared encoding
    if own:
        specs = [LayerSpec(rope=draw(st.sampled_from([None, *ROPES])), window=s.window, chunk=s.chunk,
                           temperature=s.temperature) for s in specs]
    arch = Arch(layers=tuple(specs), norm=draw(st.sampled_from(["rms", "offset"])),
                layout=draw(st.sampled_from(["pre", "sandwich", "post"])),
                qk_norm=draw(st.sampled_from([None, "head", "proj"] + (["l2"] if own else []))),
                activation=draw(st.sampled_from(["silu", "gelu_tanh"])),
                embed_scale=draw(st.floats(0.5, 3.0)), residual_scale=draw(st.floats(0.5, 1.5)),
                attn_scale=draw(st.one_of(st.none(), st.floats(0.1, 1.0))), logit_scale=draw(st.floats(0.5, 4.0)),
                attn_softcap=draw(st.one_of(st.none(), st.floats(0.5, 5.0))),
                logit_softcap=draw(st.one_of(st.none(), st.floats(0.5, 5.0))), sinks=draw(st.booleans()),
                moe=draw(st.one_of(st.none(), st.just(MoESpec(num_experts=3, top_k=2, limit=1.0)))))
    return arch, None if own else draw(st.sampled_from(ROPES))


@settings(max_examples=15, deadline=None)
@given(arch_rope=arches(), seed=st.integers(0, 2**16))
@torch.no_grad()
def test_random_arch_decode_and_padding_invariants(arch_rope, seed):
    arch, rope = arch_rope
    impl = "eager" if arch.sinks or arch.attn_softcap is not None else "sdpa"
    torch.manual_seed(seed)
    model = Decoder(vocab_size=30, hidden_size=24, num_layers=LAYERS, num_heads=3, num_kv_heads=1, head_dim=8,
                    intermediate_size=20, encoding=rope, arch=arch, attn_impl=impl).double().eval()
    for p in model.parameters():  # norms start at 1 / 0, sinks and router at 0: make every weight matter
        p.add_(0.3 * torch.randn_like(p))
    ids = torch.randint(0, 30, (2, SEQ), generator=torch.Generator().manual_seed(seed))
    want = model(ids)
    assert torch.isfinite(want).all()
    check_decode_and_padding(model, ids, want, prefill=4, pad=3, alone=model, capacity=12,
                             stores=("rotated",) if arch.own_ropes else ("rotated", "unrotated"))


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")
@torch.no_grad()
def test_flex_equals_eager_with_chunks_caps_and_temperatures():
    """The decoder hands chunk and softcap to flex's score_mod as to eager (one model, two impls)."""
    temp = QueryTemperature(beta=0.5, floor_scale=2, offset=1)
    arch = Arch(layers=(LayerSpec(rope=ROPES[0], chunk=3), LayerSpec(window=4, temperature=temp),
                        LayerSpec(rope=ROPES[1], chunk=2, window=3)), norm="offset", layout="sandwich",
                attn_softcap=1.5, logit_softcap=4.0)
    torch.manual_seed(0)
    model = Decoder(vocab_size=30, hidden_size=24, num_layers=LAYERS, num_heads=3, num_kv_heads=1, head_dim=8,
                    intermediate_size=20, arch=arch, attn_impl="eager").double().eval()
    for p in model.parameters():
        p.add_(0.3 * torch.randn_like(p))
    ids = torch.randint(0, 30, (2, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :2] = 0
    want = model(ids, attention_mask=mask)
    model.attn_impl = "flex"
    assert_close(model(ids, attention_mask=mask), want)
