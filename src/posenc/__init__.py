"""posenc: transformer positional encodings, exact and fast.

`import posenc` imports torch and nothing else; optional pieces (transformers, matplotlib, rich,
triton, gguf) are imported where they are used.
"""

from .errors import PosencError
from .absolute import LearnedPositions, Sinusoidal, sinusoidal_table
from .bias import ALiBi, T5RelativeBias, alibi_bias, alibi_head_slice, alibi_slopes, t5_relative_position_bucket
from . import attention as attention  # module: posenc.attention.attention(...)
from .cache import KVCache
from . import models as models  # package: posenc.models.Decoder
from .rope import DynamicNTK, Default, Linear, Llama3, LongRoPE, NTKAware, Rope, YaRN, apply_rope
from .rope.axial import axial_cos_sin, vision_patch_positions
from .rope.mrope import mrope_cos_sin
from .rope.rerotate import rerotate
from .rope.mrope_positions import mrope_position_ids, mrope_segment_positions

__version__ = "0.1.0"

__all__ = [
    "PosencError",
    "Rope",
    "apply_rope",
    "Default",
    "Linear",
    "NTKAware",
    "DynamicNTK",
    "YaRN",
    "LongRoPE",
    "Llama3",
    "rerotate",
    "mrope_position_ids",
    "mrope_segment_positions",
    "mrope_cos_sin",
    "vision_patch_positions",
    "axial_cos_sin",
    "sinusoidal_table",
    "Sinusoidal",
    "LearnedPositions",
    "alibi_slopes",
    "alibi_bias",
    "alibi_head_slice",
    "ALiBi",
    "t5_relative_position_bucket",
    "T5RelativeBias",
    "attention",
    "KVCache",
    "models",
    "__version__",
]
