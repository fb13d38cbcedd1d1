"""How a decoder family's layers differ from Llama's, as a small frozen value (`Arch`, one `LayerSpec` per layer).

`posenc.hf.arch.decoder_arch` reads one from a transformers config; `posenc.models.Decoder` runs the same blocks
for every family (Llama is the default `Arch`); what differs is data:

- `norm`: "rms" (`w * x / rms(x)`, Llama) or "offset" (`(1 + w) * x / rms(x)`, weights start at 0: Gemma).
- `layout`: where the norms sit, with transformers' parameter names. "pre" (Llama: `input_layernorm` before
  attention, `post_attention_layernorm` before the MLP); "sandwich" (Gemma 2/3: also a norm after each
  sublayer, `post_attention_layernorm` / `pre_feedforward_layernorm` / `post_feedforward_layernorm`);
  "post" (OLMo 2/3: only after each sublayer, `post_attention_layernorm` / `post_feedforward_layernorm`).
- `qk_norm`: None, "head" (Qwen 3, Gemma 3: an RMS norm of width head_dim on every head of q and k, before
  RoPE), "proj" (OLMo 2/3: one over the whole q / k projection, before the head split) or "l2" (Llama 4: no
  weight, after RoPE on the layers that rotate: those layers carry their own `LayerSpec.rope`).
- `activation`: the gated MLP's "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU); `mlp_name`: its module name.
- multipliers: `embed_scale` (Gemma sqrt(hidden), Granite embedding_multiplier), `residual_scale` (Granite),
  `attn_scale` (the softmax scale: Gemma query_pre_attn_scalar^-1/2, Granite attention_multiplier; None =
  head_dim^-1/2), `logit_scale` (Granite: logits / logits_scaling);
- caps: `attn_softcap` (scores), `logit_softcap` (final logits): `c * tanh(x / c)` (Gemma 2).
- `sinks`: a learned logit per query head joins every softmax and takes its share (gpt-oss);
  `moe`: a `MoESpec` replacing the MLP by a top-k mixture of clamped-SwiGLU experts (gpt-oss).
- per layer (`LayerSpec`): `rope` (a RoPE this layer applies itself; only when the decoder's layers differ
  in RoPE), `window` (sliding), `chunk` (Llama 4's chunked attention), `temperature` (Llama 4's NoPE layers).

    >>> arch = Arch(layers=(LayerSpec(), LayerSpec(window=4)), norm="offset", logit_softcap=30.0)
    >>> arch.windows, round(float(arch.final_logits(torch.tensor([100.0]))[0]), 3)
    ((None, 4), 29.924)
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch

from ..errors import choice, fail, integer, real
from ..rope.spec import Rope
from ..rope.temperature import QueryTemperature

__all__ = ["Arch", "LayerSpec", "MoESpec", "llama_arch", "NORMS", "NORM_LAYOUTS", "QK_NORMS", "ACTIVATIONS", "NORM_NAMES"]

NORMS = ("rms", "offset")
NORM_LAYOUTS = ("pre", "sandwich", "post")
QK_NORMS = (None, "head", "proj", "l2")
ACTIVATIONS = ("silu", "gelu_tanh")
# per layout: the norm at each place (before / after attention, before / after the MLP) -> its transformers name
NORM_NAMES = {
    "pre": {"pre_attn": "input_layernorm", "pre_mlp": "post_attention_layernorm"},
    "sandwich": {"pre_attn": "input_layernorm", "post_attn": "post_attention_layernorm",
                 "pre_mlp": "pre_feedforward_layernorm", "post_mlp": "post_feedforward_layernorm"},
    "post": {"post_attn": "post_attention_layernorm", "post_mlp": "post_feedforward_layernorm"},
}


@dataclass(frozen=True)
class LayerSpec:
    """What one layer's attention does beyond the shared blocks.

    Args:
        rope: a `Rope` the layer applies itself (decoders whose layers differ in RoPE), or None (the decoder's
            shared encoding, or no positions).
        window: sliding window (a query at p sees keys at p - window + 1 .. p) or None.
        chunk: chunked attention (keys in the query's chunk `floor(p / chunk)`) or None.
        temperature: a `QueryTemperature` multiplying q, or None.
    Raises:
        PosencError: a rope that is not a Rope, a window or chunk that is not an integer >= 1, a temperature
            that is not a QueryTemperature.
    """

    rope: Rope | None = None
    window: int | None = None
    chunk: int | None = None
    temperature: QueryTemperature | None = None

    def __post_init__(self) -> None:
        if self.rope is not None and not isinstance(self.rope, Rope):
            fail("rope", "None or a posenc.Rope", self.rope)
        for name in ("window", "chunk"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, integer(name, value, min=1, what="None or an integer >= 1"))
        if self.temperature is not None and not isinstance(self.temperature, QueryTemperature):
            fail("temperature", "None or a posenc.rope.temperature.QueryTemperature", self.temperature)


@dataclass(frozen=True)
class MoESpec:
    """gpt-oss's mixture of experts: a linear router (with bias) picks `top_k` of `num_experts` per token, their
    softmax weights the experts' outputs; each expert is `down((up + 1) * gate * sigmoid(alpha * gate))` with
    `gate <= limit` and `|up| <= limit` (clamped), gate and up interleaved in one `gate_up_proj`, all with biases.

    Raises:
        PosencError: counts that are not integers (top_k in 1..num_experts), alpha or limit not finite > 0.
    """

    num_experts: int
    top_k: int
    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_experts", integer("num_experts", self.num_experts, min=1))
        object.__setattr__(self, "top_k", integer("top_k", self.top_k, min=1, max=self.num_experts))
        object.__setattr__(self, "alpha", real("alpha", self.alpha, gt=0.0))
        object.__setattr__(self, "limit", real("limit", self.limit, gt=0.0))


def _optional_real(name: str, value: float | None) -> float | None:
    return None if value is None else real(name, value, gt=0.0, what="None or a finite number > 0")


@dataclass(frozen=True)
class Arch:
    """A decoder family's layer facts (see the module docstring); the defaults are Llama's.

    Raises:
        PosencError: an unknown norm, layout, qk_norm or activation, non-positive multipliers or caps,
            layers that are not LayerSpec values.
    """

    layers: tuple[LayerSpec, ...]
    norm: str = "rms"
    layout: str = "pre"
    qk_norm: str | None = None
    activation: str = "silu"
    mlp_name: str = "mlp"
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    attn_scale: float | None = None
    logit_scale: float = 1.0
    attn_softcap: float | None = None
    logit_softcap: float | None = None
    sinks: bool = False
    moe: MoESpec | None = None
    family: str = field(default="llama", compare=False)  # the model type it was read from, for messages

    def __post_init__(self) -> None:
        layers = tuple(self.layers)
        if not layers or not all(isinstance(s, LayerSpec) for s in layers):
            fail("layers", "a non-empty tuple of LayerSpec values", self.layers)
        object.__setattr__(self, "layers", layers)
        choice("norm", self.norm, NORMS)
        choice("layout", self.layout, NORM_LAYOUTS)
        choice("qk_norm", self.qk_norm, QK_NORMS)
        choice("activation", self.activation, ACTIVATIONS)
        if self.mlp_name not in ("mlp", "feed_forward"):
            fail("mlp_name", "'mlp' or 'feed_forward'", self.mlp_name)
        for name in ("embed_scale", "residual_scale", "logit_scale"):
            object.__setattr__(self, name, real(name, getattr(self, name), gt=0.0))
        for name in ("attn_scale", "attn_softcap", "logit_softcap"):
            object.__setattr__(self, name, _optional_real(name, getattr(self, name)))
        if not isinstance(self.sinks, bool):
            fail("sinks", "True or False", self.sinks)
        if self.moe is not None and not isinstance(self.moe, MoESpec):
            fail("moe", "None or a MoESpec", self.moe)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Per layer, the sliding window or None."""
        return tuple(s.window for s in self.layers)

    @property
    def own_ropes(self) -> bool:
        """Whether some layer applies its own RoPE (the decoder then has no shared one)."""
        return any(s.rope is not None for s in self.layers)

    def final_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """`[..., vocab]` logits after Granite's divisor and Gemma 2's final soft-cap (in that order)."""
        if self.logit_scale != 1.0:
            logits = logits / self.logit_scale
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap  # Gemma 2: divide, tanh, multiply
        return logits

    def layer_tables(self, positions: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, ...]:
        """Per layer, `(cos, sin)` `[b, t, r/2]` of the layer's own RoPE at `positions [b, t]`, or None;
        one table per distinct Rope (layers that share a Rope share the tensors)."""
        tables: dict[Rope, tuple[torch.Tensor, torch.Tensor]] = {}
        for spec in self.layers:
            if spec.rope is not None and spec.rope not in tables:
                tables[spec.rope] = spec.rope.cos_sin(positions)  # [b, t, r/2] each, float32
        return tuple(None if s.rope is None else tables[s.rope] for s in self.layers)


def llama_arch(windows: tuple[int | None, ...], family: str = "llama") -> Arch:
    """Llama's `Arch` (the defaults) with one sliding window or None per layer (Mistral, Qwen 2)."""
    return Arch(layers=tuple(LayerSpec(window=w) for w in windows), family=family)
