"""Reference attention with any positional encoding as a value, and explicit logical positions.

- `attend.py`: `attention(q, k, v, q_positions=, k_positions=, encoding=, impl=)`, its argument checks and
  `ATTENTION_IMPLS` (the attention implementations; `posenc.kernels.IMPLS` names the rotation's).
- `encoding.py`: what an encoding does to q, k and the scores (RoPE, bias schemes, absolute embeddings).
- `masks.py`: logical masks (causal by position, key masks, windows, chunks) and the fused sdpa / flex paths.
"""

from .attend import ATTENTION_IMPLS, attention, check_inputs, check_score_options
from .encoding import apply_temperature, encode_qk, encoding_kind
from .masks import flex_score_mod, sdpa_attention, visibility

__all__ = ["attention", "ATTENTION_IMPLS", "encoding_kind", "check_inputs", "encode_qk", "flex_score_mod",
           "visibility", "sdpa_attention", "check_score_options", "apply_temperature"]
