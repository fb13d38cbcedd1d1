"""The blocks of the Llama-family decoder: RMSNorm, GQA attention over a `KVCache`, SwiGLU MLP.

Parameter names follow transformers' Llama (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`,
`up_proj`, `down_proj`, `input_layernorm`, `post_attention_layernorm`) so checkpoints map one to one.

    >>> import torch
    >>> norm = RMSNorm(4, eps=0.0)
    >>> norm(torch.tensor([[3.0, 3.0, 3.0, 3.0]])).tolist()
    [[1.0, 1.0, 1.0, 1.0]]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import attention
from ..cache import KVCache
from ..kernels.dispatch import apply_tables

__all__ = ["RMSNorm", "SwiGLU", "Attention", "DecoderLayer"]


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
        compute = x if x.dtype in (torch.float32, torch.float64) else x.float()
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

    RoPE rotates q here and k inside the cache (at write or at read, by the cache's `store`); a bias
    scheme (ALiBi, T5) is handed to `posenc.attention` with the query and slot positions.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, layer: int, step: dict[str, Any], cache: KVCache) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [b, hq, t, d]
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [b, hk, t, d]
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [b, hk, t, d]
        if cache.rope is not None:
            q = apply_tables(q, step["cos"], step["sin"], pairing=cache.rope.pairing)  # C kernel on CPU: same bits
        cache.write(layer, k, v, step["slots"], step["cos"], step["sin"])
        keys, values = cache.read(layer, step["key_tables"])  # [b, hk, w, d]
        out = attention(q, keys, values, q_positions=step["positions"], k_positions=step["key_positions"],
                        encoding=step["bias"], causal=True, key_mask=step["key_mask"], scale=step["scale"],
                        window=step["windows"][layer])
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))  # [b, t, hidden]


class DecoderLayer(nn.Module):
    """Pre-norm block: `h + attn(norm(h))`, then `h + mlp(norm(h))`."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 eps: float, attention_bias: bool = False, mlp_bias: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = Attention(hidden_size, num_heads, num_kv_heads, head_dim, attention_bias)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = SwiGLU(hidden_size, intermediate_size, mlp_bias)

    def forward(self, h: torch.Tensor, layer: int, step: dict[str, Any], cache: KVCache) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), layer, step, cache)  # [b, t, hidden]
        return h + self.mlp(self.post_attention_layernorm(h))
