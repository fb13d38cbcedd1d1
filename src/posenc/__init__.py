"""posenc: transformer positional encodings, exact and fast.

`import posenc` imports torch and nothing else; optional pieces (transformers, matplotlib, rich,
triton, gguf) are imported where they are used.
"""

from .errors import PosencError
from .rope import DynamicNTK, Default, Linear, Llama3, LongRoPE, NTKAware, Rope, YaRN, apply_rope

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
    "__version__",
]
