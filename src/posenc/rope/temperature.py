"""Position-dependent query temperature: q multiplied by `1 + beta * ln(1 + floor((p + offset) / floor_scale))`.

Two families scale the queries by a slowly growing function of the position, besides (or instead of) RoPE:

- Llama 4, on its NoPE layers (`attn_temperature_tuning`): `beta = attn_scale` (0.1), `floor_scale` (8192),
  `offset = 1`;
- Ministral 3 / Mistral 4, on every layer after RoPE (`llama_4_scaling_beta` in the rope dict): `beta`,
  `floor_scale = original_max_position_embeddings`, `offset = 0`, and `log(1 + x)` written out (`log="log"`):
  in float32 `torch.log1p(x)` and `torch.log(1 + x)` differ in the last bit at some integers (x = 178, 401,
  ...), so each family's own spelling is kept to stay bit-identical to it.

The factor is 1 below the first step, so short contexts are unchanged. It is a value the attention applies
(`scale(positions)` gives the per-token multiplier); posenc's `Rope` tables do not contain it.

    >>> QueryTemperature(beta=0.1, floor_scale=8192, offset=1).scale(torch.tensor([0, 8191, 20000])).tolist()
    [1.0, 1.06931471824646, 1.1098612546920776]
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import choice, integer, positions, real

__all__ = ["QueryTemperature"]


@dataclass(frozen=True)
class QueryTemperature:
    """`scale(p) = 1 + beta * ln(1 + floor((p + offset) / floor_scale))`, multiplying the queries of a layer.

    Args:
        beta: the slope (Llama 4's `attn_scale`, Ministral 3's `llama_4_scaling_beta`).
        floor_scale: tokens per step (Llama 4's `floor_scale`, Ministral 3's original length).
        offset: added to the position first (Llama 4: 1, Ministral 3: 0).
        log: how the logarithm is computed in float32: "log1p" (`torch.log1p(steps)`, Llama 4) or "log"
            (`torch.log(1 + steps)`, Ministral 3).
    Raises:
        PosencError: a beta that is not a finite number >= 0, a floor_scale or offset that is not an integer
            (floor_scale >= 1, offset >= 0), a `log` other than "log1p" or "log".
    """

    beta: float
    floor_scale: int
    offset: int = 0
    log: str = "log1p"

    def __post_init__(self) -> None:
        object.__setattr__(self, "beta", real("beta", self.beta, ge=0.0))
        object.__setattr__(self, "floor_scale", integer("floor_scale", self.floor_scale, min=1))
        object.__setattr__(self, "offset", integer("offset", self.offset, min=0))
        choice("log", self.log, ("log1p", "log"))

    def scale(self, position_ids: torch.Tensor) -> torch.Tensor:
        """float32 multipliers, the shape of `position_ids` (integer logical positions >= 0)."""
        position_ids = positions("position_ids", position_ids, shapes=[("t",), ("b", "t")])
        steps = torch.floor((position_ids.float() + self.offset) / self.floor_scale)  # float32, as both models
        if self.log == "log":
            return 1 + self.beta * torch.log(1 + steps)  # Ministral 3's get_llama_4_attn_scale, term for term
        return torch.log1p(steps) * self.beta + 1.0  # Llama 4's attention
