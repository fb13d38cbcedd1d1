"""The decoder's one set of blocks, for every family an `Arch` describes (Llama, Mistral, Qwen 2/3, Gemma 2/3,
OLMo 2/3, Granite, SmolLM 3, Llama 4, gpt-oss): RMS norms, GQA attention over a `KVCache`, a gated MLP, with
the family's facts read from the `Arch` value, never from a per-family class. Parameter names are
transformers' for each family (Llama: `input_layernorm`, `self_attn.q_proj`, ..., `mlp.gate_proj`, ...), so
checkpoints map one to one. `Step` is what every layer of one forward shares.

    >>> norm = Norm(4, eps=0.0, kind="offset")  # Gemma: weights start at 0 and multiply by (1 + w)
    >>> norm(torch.tensor([[3.0, 3.0, 3.0, 3.0]])).tolist()
    [[1.0, 1.0, 1.0, 1.0]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..attention import apply_temperature
from ..cache import KVCache
from ..rope import dispatch
from ..hf.family import NORM_NAMES, Arch, LayerSpec
from .moe import MoE

__all__ = ["Step", "Norm", "GatedMLP", "ArchAttention", "ArchLayer", "build_layers"]


@dataclass(frozen=True)
class Step:
    """What every layer of one forward shares (built once per forward by the decoder).

    Attributes:
        attend: `attend(q, k, v, window, chunk=None, sinks=None) -> [b, hq, t, dv]`, this forward's attention
            with its masks (built once from logical positions; see `posenc.models.attend`).
        pairing: the shared RoPE's pairing, or None without one.
        cos, sin: `[b, t, r/2]` shared RoPE tables of the new tokens (None without a shared RoPE).
        key_tables: `(cos, sin)` `[b, w, r/2]` of the cached keys for unrotated storage, else None.
        slots: `[b, t]` cache slot of each new token (-1 for padding), from `KVCache.reserve`; None
            in a full forward without a cache (as are index and width).
        index: `KVCache.write_index(slots)` (flat rows and slots), shared by every layer's write.
        width: cache slots a read covers (`KVCache.read_width`, a host-side bound: no host sync).
        positions: `[b, t]` logical positions of the new tokens (a query temperature reads them).
        layer_tables: per layer, `(cos, sin)` `[b, t, r/2]` of a RoPE the layer applies itself, or None
            (see `posenc.hf.family`); None when no layer has its own.
    """

    attend: Any
    pairing: str | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    key_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    slots: torch.Tensor | None = None
    index: Any = None
    width: int | None = None
    positions: torch.Tensor | None = None
    layer_tables: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...] | None = None


class Norm(nn.Module):
    """RMS norm: `w * x / rms(x)` ("rms"), `(1 + w) * x / rms(x)` ("offset", Gemma) or `x / rms(x)` (width None).

    In the input's dtype for float32 / float64 and in float32 for half inputs (transformers computes in float32
    even for float64 models; posenc keeps float64 so a float64 model is float64 throughout).
    """

    def __init__(self, width: int | None, eps: float, kind: str = "rms") -> None:
        super().__init__()
        self.eps, self.kind = eps, kind
        if width is not None:
            self.weight = nn.Parameter(torch.zeros(width) if kind == "offset" else torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        compute = x if x.dtype in (torch.float32, torch.float64) else x.float()
        normed = compute * torch.rsqrt(compute.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., width]
        if not hasattr(self, "weight"):
            return normed.to(x.dtype)
        if self.kind == "offset":  # Gemma multiplies in float32 and rounds once: (x * (1 + w)).to(dtype)
            return (normed * (1.0 + self.weight.to(compute.dtype))).to(x.dtype)
        return self.weight * normed.to(x.dtype)  # Llama rounds first, then multiplies in the weight's dtype


class GatedMLP(nn.Module):
    """`down(act(gate(x)) * up(x))` with act SiLU (SwiGLU) or tanh-approximated GELU (Gemma's GeGLU)."""

    def __init__(self, hidden_size: int, intermediate_size: int, activation: str, bias: bool = False) -> None:
        super().__init__()
        self.activation = activation
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)  # [b, t, inter]
        gate = nn.functional.silu(gate) if self.activation == "silu" else nn.functional.gelu(gate, approximate="tanh")
        return self.down_proj(gate * self.up_proj(x))  # [b, t, hidden]


class ArchAttention(nn.Module):
    """GQA attention over a `KVCache` with a family's q/k norm, its own or the shared RoPE, query temperature,
    window, chunk, soft-cap and sinks (`Arch` / `LayerSpec`); names as transformers' (`q_proj`, ..., `q_norm`,
    `k_norm`, `sinks`)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, eps: float, arch: Arch,
                 spec: LayerSpec, bias: bool = False, qkv_bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.arch, self.spec = arch, spec
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        if arch.qk_norm == "head":  # one weight of width head_dim shared by the heads (Qwen 3, Gemma 3)
            self.q_norm, self.k_norm = Norm(head_dim, eps, arch.norm), Norm(head_dim, eps, arch.norm)
        elif arch.qk_norm == "proj":  # over the whole projection (OLMo 2)
            self.q_norm = Norm(num_heads * head_dim, eps, arch.norm)
            self.k_norm = Norm(num_kv_heads * head_dim, eps, arch.norm)
        elif arch.qk_norm == "l2":  # no weight (Llama 4's L2Norm, eps = rms_norm_eps)
            self.l2_norm = Norm(None, eps)
        if arch.sinks:  # gpt-oss: one learned logit per query head in every softmax
            self.sinks = nn.Parameter(torch.zeros(num_heads))

    def forward(self, x: torch.Tensor, layer: int, step: Step, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [b, t, h * d]
        if self.arch.qk_norm == "proj":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [b, hq, t, d]
        k = k.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [b, hk, t, d]
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [b, hk, t, d]
        if self.arch.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        own = step.layer_tables[layer] if step.layer_tables is not None else None
        rotate_k = False
        if own is not None:  # this layer's own RoPE: q and k rotated here, the cache stores them as given
            q, k = dispatch.rotate(q, k, own[0], own[1], None, self.spec.rope.pairing)  # type: ignore[union-attr]
            if self.arch.qk_norm == "l2":  # Llama 4: after RoPE, on the layers that rotate (float32 tables
                q, k = self.l2_norm(q), self.l2_norm(k)  # move the RMS by ~1e-8, so the order matters)
        elif step.pairing is not None:  # the decoder's shared RoPE: q here, k here or inside the cache
            rotate_k = cache is None or cache.rotates_at_write
            q, k_rot = dispatch.rotate(q, k if rotate_k else None, step.cos, step.sin, None, step.pairing)
            k = k_rot if rotate_k else k  # [b, hk, t, d]
        if self.spec.temperature is not None:
            q = apply_temperature(self.spec.temperature, q, step.positions)  # [b, hq, t, d]
        if cache is None:
            keys, values = k, v
        else:
            cache.write(layer, k, v, step.slots, step.cos, step.sin, index=step.index, rotated=rotate_k)
            keys, values = cache.read(layer, step.key_tables, step.width)  # [b, hk, w, d]
        out = step.attend(q, keys, values, self.spec.window, chunk=self.spec.chunk,
                          sinks=self.sinks if self.arch.sinks else None)  # [b, hq, t, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # [b, t, hidden]


class ArchLayer(nn.Module):
    """One block: norms placed by `arch.layout`, attention, gated MLP (or gpt-oss's MoE), residuals times
    `arch.residual_scale`."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 eps: float, arch: Arch, spec: LayerSpec, attention_bias: bool = False, mlp_bias: bool = False,
                 qkv_bias: bool = False) -> None:
        super().__init__()
        self.arch = arch
        self.names = NORM_NAMES[arch.layout]  # place -> transformers' module name
        for name in self.names.values():
            self.add_module(name, Norm(hidden_size, eps, arch.norm))
        self.self_attn = ArchAttention(hidden_size, num_heads, num_kv_heads, head_dim, eps, arch, spec,
                                       attention_bias, qkv_bias)
        mlp = GatedMLP(hidden_size, intermediate_size, arch.activation, mlp_bias) if arch.moe is None \
            else MoE(hidden_size, intermediate_size, arch.moe)
        self.add_module(arch.mlp_name, mlp)

    def _norm(self, place: str, x: torch.Tensor) -> torch.Tensor:
        name = self.names.get(place)
        return x if name is None else getattr(self, name)(x)

    def forward(self, h: torch.Tensor, layer: int, step: Step, cache: KVCache | None) -> torch.Tensor:
        scale = self.arch.residual_scale
        a = self._norm("post_attn", self.self_attn(self._norm("pre_attn", h), layer, step, cache))  # [b, t, hidden]
        h = h + (a if scale == 1.0 else a * scale)
        m = self._norm("post_mlp", getattr(self, self.arch.mlp_name)(self._norm("pre_mlp", h)))  # [b, t, hidden]
        return h + (m if scale == 1.0 else m * scale)


def build_layers(sizes: dict[str, Any], arch: Arch) -> nn.ModuleList:
    """One `ArchLayer` per `arch.layers` entry, from the decoder's sizes (`hidden_size`, `num_heads`, ...)."""
    return nn.ModuleList(ArchLayer(arch=arch, spec=spec, **sizes) for spec in arch.layers)
