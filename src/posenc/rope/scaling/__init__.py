"""RoPE scaling rules as small frozen values, one contract: `rule.inv_freq(base, dim, seq_len=None)`.

Each rule maps the head facts `(base, dim)` and an optional sequence length to `(inv_freq [dim/2] float32,
attention_factor)`, in transformers' operation order so the frequencies agree bit for bit. Rules whose
frequencies depend on the sequence length (`DynamicNTK`, `LongRoPE`) are pure functions of the `seq_len` they
are given; callers that omit it get transformers' convention, `max(position_ids) + 1` (see `Rope.cos_sin`).

- `uniform.py`: the unscaled ladder `default_inv_freq`, the rules that treat every frequency alike (`Default`,
  `Linear`, `NTKAware`, `DynamicNTK`) and the shared checks (`check_base`, `check_seq_len`).
- `wavelength.py`: the rules that treat each channel by its wavelength (`YaRN`, `LongRoPE`, `Llama3`) and
  `Scaling`, the union of all of them.

    >>> import torch
    >>> from posenc.rope.scaling import Linear, default_inv_freq
    >>> inv, af = Linear(factor=4.0).inv_freq(10000.0, 8)
    >>> bool(torch.equal(inv, default_inv_freq(10000.0, 8) / 4.0)), af
    (True, 1.0)
"""

from .uniform import Default, DynamicNTK, Linear, NTKAware, check_base, check_seq_len, default_inv_freq
from .wavelength import Llama3, LongRoPE, Scaling, YaRN, yarn_get_mscale

__all__ = ["Default", "Linear", "NTKAware", "DynamicNTK", "YaRN", "LongRoPE", "Llama3", "Scaling", "check_base",
           "check_seq_len", "default_inv_freq", "yarn_get_mscale"]
