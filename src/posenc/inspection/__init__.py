"""Facts about one checkpoint's positional encoding and KV cache, as plain data: what `posenc inspect` prints.

- `config.py`: reading a `config.json` path, a directory holding one, or a bundled preset; target lengths.
- `rope.py`: the RoPE facts (widths, pairing, base, rule, per-pair wavelengths before and after scaling).
- `inspect.py`: the report (`inspect_model`, `inspect_source`) and the KV-cache memory arithmetic.
- `text.py`: the report as plain text or a rich table.

    >>> from posenc.inspection import inspect_source
    >>> inspect_source("llama-2-7b")["scheme"]
    'rope'
"""

from ..hf import KVFacts, kv_cache_facts
from .config import MAX_TOKENS, length_label, load_config, load_preset, parse_lengths, preset_names
from .inspect import DTYPE_BYTES, GIB, element_bytes, inspect_model, inspect_source, kv_bytes, kv_label, max_tokens
from .rope import rope_facts, target_lengths

__all__ = ["load_config", "load_preset", "inspect_source", "preset_names", "parse_lengths", "kv_cache_facts",
           "kv_bytes", "element_bytes", "kv_label", "rope_facts", "inspect_model", "max_tokens", "target_lengths",
           "length_label", "DTYPE_BYTES", "GIB", "MAX_TOKENS", "KVFacts"]
