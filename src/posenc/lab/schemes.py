"""The lab's models: posenc's own `Decoder` with each of posenc's positional schemes.

| scheme | encoding given to `posenc.models.Decoder` |
|---|---|
| nope | None |
| sinusoidal | `Sinusoidal(hidden_size)` added to the token embeddings |
| learned | `LearnedPositions(lengths[-1] * L0, hidden_size)`, N(0, 1/2) (the sinusoid's rms); rows >= L0 never
  see a gradient, so at evaluation they are still at their initialisation (what "extrapolating" a learned
  table means here; other harnesses clamp or refuse) |
| rope | `Rope(head_dim, base=10000)`, split-half pairing |
| alibi | `ALiBi(num_heads)` (Press et al. slopes, causal form) |
| t5 | `T5RelativeBias(num_heads, 32 buckets, max_distance=L0, causal)`, shared by the layers as in T5 |

    >>> from posenc.lab.config import LabConfig
    >>> cfg = LabConfig.preset("quick")
    >>> model = build_model(cfg, "alibi")
    >>> type(model.encoding).__name__, model.kind
    ('ALiBi', 'bias')
"""

from __future__ import annotations

import torch

from ..absolute import LearnedPositions, Sinusoidal
from ..bias import ALiBi, T5RelativeBias
from ..errors import fail
from ..models import Decoder
from ..rope.spec import Rope
from .config import SCHEMES, LabConfig
from .data import VOCAB

__all__ = ["build_model", "make_encoding", "with_rope", "ROPE_BASE"]

ROPE_BASE = 10000.0


def make_encoding(cfg: LabConfig, scheme: str):
    """The positional encoding value (or module) for `scheme` at this config's sizes."""
    if scheme == "nope":
        return None
    if scheme == "sinusoidal":
        return Sinusoidal(cfg.hidden_size)
    if scheme == "learned":
        table = LearnedPositions(cfg.max_length, cfg.hidden_size)
        with torch.no_grad():
            table.weight.normal_(0.0, 0.5**0.5)  # [max_length, hidden]: the sinusoid table's rms
        return table
    if scheme == "rope":
        return Rope(head_dim=cfg.head_dim, base=ROPE_BASE)
    if scheme == "alibi":
        return ALiBi(cfg.num_heads)
    if scheme == "t5":
        return T5RelativeBias(cfg.num_heads, num_buckets=32, max_distance=cfg.l0, bidirectional=False)
    fail("scheme", f"one of {SCHEMES}", scheme)


def build_model(cfg: LabConfig, scheme: str, *, seed: int | None = None) -> Decoder:
    """A freshly initialised float32 decoder for `scheme` (seeded by `cfg.seed` unless `seed` is given)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed if seed is None else seed)
        encoding = make_encoding(cfg, scheme)
        return Decoder(vocab_size=VOCAB, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                       num_heads=cfg.num_heads, intermediate_size=cfg.intermediate_size, encoding=encoding)


def with_rope(model: Decoder, rope: Rope) -> Decoder:
    """The same weights under another `Rope` (a scaling rule): a new decoder holding a copy of `model`'s weights.

    Raises:
        PosencError: `model` is not a RoPE decoder, or `rope` has another head_dim.
    """
    if model.rope is None:
        fail("model", "a decoder with a RoPE encoding", type(model.encoding))
    other = Decoder(vocab_size=model.vocab_size, hidden_size=model.embed_tokens.embedding_dim,
                    num_layers=len(model.layers), num_heads=model.num_heads,
                    intermediate_size=model.layers[0].mlp.gate_proj.out_features,
                    num_kv_heads=model.num_kv_heads, head_dim=model.head_dim, encoding=rope)
    other.load_state_dict(model.state_dict())
    return other.to(model.embed_tokens.weight.device).train(model.training)
