"""The one adapter that knows transformers' config keys and model-type conventions.

- `posenc.hf.rope`: `rope_from_hf_config(cfg, layer_type=None)` (behind `posenc.Rope.from_hf_config`), the
  model-type table `MODEL_TYPES`, the rope types `ROPE_TYPES`.
- `posenc.hf.facts`: the position scheme, declared lengths, KV-cache size per token, decoder sizes.
"""

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
from .rope import MODEL_TYPES, NON_ROPE_MODEL_TYPES, ROPE_TYPES, config_to_dict, rope_from_hf_config, text_config

__all__ = [
    "rope_from_hf_config",
    "config_to_dict",
    "text_config",
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
]
