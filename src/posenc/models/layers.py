"""The blocks of the Llama-family decoder: RMSNorm, GQA attention over a `KVCache`, SwiGLU MLP.

Parameter names follow transformers' Llama (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`,
`up_proj`, `down_proj`, `input_layernorm`, `post_attention_layernorm`) so checkpoints map one to one.

    >>> import torch
    >>> norm = RMSNorm(4, eps=0.0)
    >>> norm(torch.tensor([[3.0, 3.0, 3.0, 3.0]])).tolist()
    [[1.0, 1.0, 1.0, 1.0]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..cache import KVCache
from ..rope import dispatch

__all__ = ["Step", "RMSNorm", "SwiGLU", "Attention", "DecoderLayer"]


@dataclass(frozen=True)
class Step:
    """What every layer of one forward shares (built once per forward by the decoder).

    Attributes:
        attend: `attend(q, k, v, window, chunk=None, sinks=None) -> [b, hq, t, dv]`, this forward's attention with its masks
            (built once from logical positions; see `Decoder._attend`).
        windows: per layer, a sliding window or None.
        pairing: the RoPE pairing, or None without RoPE.
        cos, sin: `[b, t, r/2]` RoPE tables of the new tokens (None without RoPE).
        key_tables: `(cos, sin)` `[b, w, r/2]` of the cached keys for unrotated storage, else None.
        slots: `[b, t]` cache slot of each new token (-1 for padding), from `KVCache.reserve`; None
            in a full forward without a cache (as are index and width).
        index: `KVCache.write_index(slots)` (flat rows and slots), shared by every layer's write.
        width: cache slots a read covers (`KVCache.read_width`, a host-side bound: no host sync).
        positions: `[b, t]` logical positions of the new tokens (a query temperature reads them).
        layer_tables: per layer, `(cos, sin)` `[b, t, r/2]` of a RoPE the layer applies itself, or None
            (see `posenc.models.arch`); None when no layer has its own.
    """

    attend: Any
    windows: tuple[int | None, ...]
    pairing: str | None = None
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    key_tables: tuple[torch.Tensor, torch.Tensor] | None = None
    slots: torch.Tensor | None = None
    index: Any = None
    width: int | None = None
    positions: torch.Tensor | None = None
    layer_tables: tuple[tuple[torch.Tensor, torch.Tensor] | None, ...] | None = None


class RMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`, in float32 for half inputs and in the input's dtype otherwise.

    transformers computes it in float32 even for float64 inputs; posenc keeps float64 so a float64
    model is float64 throughout (the two agree to float32 rounding).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.float32, torch.float64):  # no casts: this runs twice per layer and token
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))  # [..., hidden]
        compute = x.float()
        normed = compute * torch.rsqrt(compute.pow(2).mean(-1, keepdim=True) + self.eps)  # [..., hidden]
        return self.weight * normed.to(x.dtype)


class SwiGLU(nn.Module):
    """`down(silu(gate(x)) * up(x))`."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))  # [b, t, hidden]


class Attention(nn.Module):
    """GQA self-attention whose keys and values live in a `KVCache` at logical positions.

    RoPE rotates q here and k inside the cache (at write or at read, by the cache's `store`); the
    attention itself is `step["attend"](q, k, v, window)`, which the decoder builds once per forward
    (masks from logical positions shared by every layer; eager, sdpa or flex).
    `bias` puts biases on all four projections (Llama's attention_bias); `qkv_bias` on q, k, v only (Qwen2).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False,
                 qkv_bias: bool | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        qkv_bias = bias if qkv_bias is None else qkv_bias  # Qwen2: q/k/v biases without an o bias
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, layer: int, step: Step, cache: KVCache | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [b, hq, t, d]
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [b, hk, t, d]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [b, hk, t, d]
        # q and k of a layer in one call of the router, with this forward's tables (the C kernel on CPU: same bits)
        rotate_k = step.pairing is not None and (cache is None or cache.rotates_at_write)
        if step.pairing is not None:
            q, k_rot = dispatch.rotate(q, k if rotate_k else None, step.cos, step.sin, None, step.pairing)
            k = k_rot if rotate_k else k  # [b, hk, t, d]
        if cache is None:  # a full forward: the keys are this forward's own tokens
            keys, values = k, v
        else:
            cache.write(layer, k, v, step.slots, step.cos, step.sin, index=step.index, rotated=rotate_k)
            keys, values = cache.read(layer, step.key_tables, step.width)  # [b, hk, w, d]
        out = step.attend(q, keys, values, step.windows[layer])  # [b, hq, t, d]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # [b, t, hidden]


class DecoderLayer(nn.Module):
    """Pre-norm block: `h + attn(norm(h))`, then `h + mlp(norm(h))`."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 eps: float, attention_bias: bool = False, mlp_bias: bool = False, qkv_bias: bool | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, attention_bias, qkv_bias)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = SwiGLU(hidden_size, intermediate_size, mlp_bias)

    def forward(self, h: torch.Tensor, layer: int, step: Step, cache: KVCache | None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), layer, step, cache)  # [b, t, hidden]
        return h + self.mlp(self.post_attention_layernorm(h))
