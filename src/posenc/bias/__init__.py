"""Additive attention biases from explicit positions: ALiBi and T5 relative buckets.

A bias scheme is a value with `bias(q_positions, k_positions) -> [h, tq, tk]` (or `[b, h, tq, tk]`) float32
and `score_mod(q_positions, k_positions)` for FlexAttention; `posenc.attention` takes either.
"""

from .alibi import ALiBi, alibi_bias, alibi_head_slice, alibi_slopes
from .relative import T5RelativeBias, t5_relative_position_bucket

__all__ = ["ALiBi", "alibi_bias", "alibi_head_slice", "alibi_slopes", "T5RelativeBias", "t5_relative_position_bucket"]
