"""gpt-oss's mixture-of-experts MLP (`posenc.models.arch.MoESpec`), with transformers' parameter names
(`mlp.router.weight` / `.bias`, `mlp.experts.gate_up_proj` `[E, hidden, 2 * inter]` with gate and up
interleaved, `gate_up_proj_bias`, `down_proj` `[E, inter, hidden]`, `down_proj_bias`).

    >>> moe = MoE(8, 6, MoESpec(num_experts=4, top_k=2))
    >>> moe(torch.zeros(2, 3, 8)).shape
    torch.Size([2, 3, 8])
"""

from __future__ import annotations

import torch
from torch import nn

from .arch import MoESpec

__all__ = ["MoE", "Router", "Experts"]


class Router(nn.Module):
    """`logits = x @ weight^T + bias`; the top_k logits' softmax weights their experts."""

    def __init__(self, hidden_size: int, spec: MoESpec) -> None:
        super().__init__()
        self.top_k = spec.top_k
        self.weight = nn.Parameter(torch.zeros(spec.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = nn.functional.linear(x, self.weight, self.bias)  # [n, E]
        top, experts = torch.topk(logits, self.top_k, dim=-1)  # [n, k] each
        return torch.softmax(top, dim=-1), experts  # weights [n, k], expert ids [n, k]


class Experts(nn.Module):
    """The experts' weights, stacked; `expert(e, x)` runs one on `x [m, hidden]`."""

    def __init__(self, hidden_size: int, intermediate_size: int, spec: MoESpec) -> None:
        super().__init__()
        e = spec.num_experts
        self.alpha, self.limit = spec.alpha, spec.limit
        self.gate_up_proj = nn.Parameter(torch.randn(e, hidden_size, 2 * intermediate_size) * hidden_size**-0.5)
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.randn(e, intermediate_size, hidden_size) * intermediate_size**-0.5)
        self.down_proj_bias = nn.Parameter(torch.zeros(e, hidden_size))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate_up = x @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # [m, 2 * inter]
        gate = gate_up[..., ::2].clamp(max=self.limit)  # [m, inter]: gate on even channels, clamped above
        up = gate_up[..., 1::2].clamp(min=-self.limit, max=self.limit)  # [m, inter]
        glu = gate * torch.sigmoid(gate * self.alpha)
        return ((up + 1) * glu) @ self.down_proj[e] + self.down_proj_bias[e]  # [m, hidden]


class MoE(nn.Module):
    """`sum over the token's top_k experts of weight * expert(x)`; each expert runs on its own tokens only."""

    def __init__(self, hidden_size: int, intermediate_size: int, spec: MoESpec) -> None:
        super().__init__()
        self.router = Router(hidden_size, spec)
        self.experts = Experts(hidden_size, intermediate_size, spec)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [n, hidden]
        weights, chosen = self.router(flat)  # [n, k] each
        out = torch.zeros_like(flat)  # [n, hidden]
        for e in chosen.unique().tolist():  # the experts some token chose, in ascending order
            tokens, slot = torch.where(chosen == e)  # [m] each: which tokens, at which of their k picks
            out.index_add_(0, tokens, self.experts.expert(e, flat[tokens]) * weights[tokens, slot, None])
        return out.reshape(x.shape)  # [b, t, hidden]
