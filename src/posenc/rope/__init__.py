"""Rotary position embeddings: scaling rules, tables, the reference rotation and the `Rope` description."""

from .apply import apply_rope
from .scaling import DynamicNTK, Default, Linear, Llama3, LongRoPE, NTKAware, YaRN
from .spec import Rope

__all__ = ["Rope", "apply_rope", "Default", "Linear", "NTKAware", "DynamicNTK", "YaRN", "LongRoPE", "Llama3"]
