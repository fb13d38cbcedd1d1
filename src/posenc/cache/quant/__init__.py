"""Quantized KV caches: formats, per-layer code stores, and `QuantizedKVCache`.

- `formats.py`: pure encode / decode of a block per token or per channel (int8, int4, fp8, plain casts).
- `codes.py`: `CodeStore`, the base of both parts, and the code-buffer helpers they share.
- `tokens.py`: `TokenStore`, codes with one set of statistics per slot (values, post-RoPE keys).
- `channels.py`: `ChannelStore`, pre-RoPE keys per channel in blocks of `group` tokens (KIVI / KVQuant).
- `store.py`: `QuantStore`, a `posenc.cache.KVStore` over a key part and a value part.
- `kvcache.py`: `QuantizedKVCache`, a `KVCache` over `QuantStore`, and the bytes-per-token arithmetic.
"""

from .kvcache import QuantizedKVCache, bytes_per_number, cache_bytes_per_token, kv_label

__all__ = ["QuantizedKVCache", "cache_bytes_per_token", "bytes_per_number", "kv_label"]
