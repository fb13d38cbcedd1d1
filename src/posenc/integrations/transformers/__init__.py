"""posenc inside a transformers model: `patch(model, policy=...)` and `unpatch(model)`.

- `patch.py`: the entry points and their up-front checks (a model that cannot be patched is left as it was).
- `decoder.py`: the patched rotary and attention forwards (positions in, posenc's rotation in place of the
  module's `apply_rotary_pos_emb`).
- `policy.py`: what each cache policy does when a length-dependent rule's table changes mid-generation.
- `generation.py`: the generation hooks replaced on the instance (Phi-3's LongRoPE cache drop, the official
  Qwen2-VL / Qwen3-VL positions).
"""

from .patch import POLICIES, is_patched, patch, unpatch

__all__ = ["patch", "unpatch", "is_patched", "POLICIES"]
