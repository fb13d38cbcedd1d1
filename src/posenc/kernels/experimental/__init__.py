"""Kernels that work and are tested but that no posenc call path reaches yet.

- `triton_append.py`: `rope_append_kv`, rotate new keys and write K and V into KV-cache slots in one Triton launch.
"""
