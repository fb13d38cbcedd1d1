"""The one adapter that knows transformers' config keys and model-type conventions.

- `posenc.hf.conventions`: the per-model `Convention` table `MODEL_TYPES` and the shared config readers
  (`head_dim`, `layer_type_list`, ...).
- `posenc.hf.rope`: one rope-parameter dict -> `Rope`; the rope types `ROPE_TYPES`.
- `posenc.hf.layers`: `rope_from_hf_config(cfg, layer_type=None)` (behind `posenc.Rope.from_hf_config`),
  `layer_ropes` (one Rope or None per layer) and `rope_by_layer_type`.
- `posenc.hf.branches`: `branch_ropes` (DeepSeek-V4's main / compress tables, DSA indexers) and `kv_sources`
  (Gemma 3n / Gemma 4 layers that reuse rotated keys and rotate only q).
- `posenc.hf.vision`: `vision_rope` (a vision tower's axial 2-D table, `posenc.rope.axial.AxialRope`).
- `posenc.hf.temperature`: `layer_temperatures` (Llama 4's NoPE layers, Ministral 3's query temperature).
- `posenc.hf.classes`: a dict's defaults and aliases from its transformers config class (types outside the table).
- `posenc.hf.facts`: the position scheme, declared lengths, KV-cache size per token, decoder sizes.
- `posenc.hf.arch`: `decoder_arch` (the decoder family a config describes, or a refusal saying why).
"""

from .arch import decoder_arch
from .conventions import MODEL_TYPES, NON_ROPE_MODEL_TYPES, config_to_dict, head_dim, text_config
from .facts import (
    KVFacts,
    decoder_sizes,
    kv_cache_facts,
    layer_types,
    layer_windows,
    max_positions,
    original_max_positions,
    position_scheme,
    scheme_facts,
)
from .branches import branch_ropes, kv_sources
from .layers import layer_ropes, rope_by_layer_type, rope_from_hf_config
from .rope import ROPE_TYPES
from .temperature import layer_temperatures
from .vision import vision_rope

__all__ = [
    "rope_from_hf_config",
    "layer_ropes",
    "rope_by_layer_type",
    "branch_ropes",
    "kv_sources",
    "config_to_dict",
    "text_config",
    "head_dim",
    "MODEL_TYPES",
    "ROPE_TYPES",
    "NON_ROPE_MODEL_TYPES",
    "KVFacts",
    "kv_cache_facts",
    "max_positions",
    "original_max_positions",
    "position_scheme",
    "scheme_facts",
    "decoder_sizes",
    "layer_types",
    "layer_windows",
    "layer_temperatures",
    "vision_rope",
    "decoder_arch",
]
