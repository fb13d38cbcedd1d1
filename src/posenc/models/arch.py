"""A decoder family's layer facts (`Arch`, `LayerSpec`, `MoESpec`, described in `posenc.hf.family`, re-exported
here where the docs name them) and `check_arch`, which refuses an `Arch` that does not fit a decoder.

    >>> from posenc.models.arch import Arch, LayerSpec
    >>> Arch(layers=(LayerSpec(), LayerSpec(window=4))).windows
    (None, 4)
"""

from __future__ import annotations

from typing import Any

from ..errors import Raw, fail
from ..hf.family import Arch, LayerSpec, MoESpec, llama_arch

__all__ = ["Arch", "LayerSpec", "MoESpec", "llama_arch", "check_arch"]


def check_arch(arch: Arch, num_layers: int, head_dim: int, encoding: Any, layer_windows: Any) -> None:
    """Refuse an `Arch` that does not fit a decoder's sizes and encoding.

    Raises:
        PosencError: another layer count, windows that differ from `layer_windows`, layer RoPEs (or qk_norm
            "l2") beside an encoding, layer RoPEs of another head_dim, with a length-dependent scaling or a
            softmax scale factor.
    """
    if len(arch.layers) != num_layers:
        fail("arch", f"{num_layers} layer specs (num_layers)", Raw(f"{len(arch.layers)}"))
    listed = isinstance(layer_windows, (tuple, list))
    if layer_windows is not None and (not listed or tuple(layer_windows) != arch.windows):
        fail("layer_windows", f"None or the arch's windows {arch.windows}", layer_windows)
    ropes = {s.rope for s in arch.layers if s.rope is not None}
    if arch.qk_norm == "l2" and encoding is not None:
        fail("encoding", "None (qk_norm 'l2' normalises rotated q and k: give each rotating layer its LayerSpec.rope)",
             encoding)
    if ropes and encoding is not None:
        fail("encoding", "None (the arch gives some layers their own RoPE)", encoding)
    for rope in ropes:
        if rope.head_dim != head_dim:
            fail("arch", f"layer RoPEs of head_dim={head_dim}", rope)
        if rope.scaling.depends_on_length or rope.softmax_scale_factor != 1.0:
            fail("arch", "layer RoPEs with a length-independent scaling and no softmax scale factor (a decoder "
                 "whose layers differ in RoPE rotates keys before its cache, so it cannot re-table them)", rope)
