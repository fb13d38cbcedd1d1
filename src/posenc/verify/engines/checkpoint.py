"""`CheckpointReader`: posenc's loader for the checkpoint of one verify run, read once.

A run builds engines for a dozen rope rules on the same weights; reading and dequantizing a GGUF file takes
seconds each time. The run holds one reader and hands it to the factories it builds (`load_factory(spec,
reader)`, `build_subject(..., reader=...)`); nothing writes to the tensors it returns.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["CheckpointReader"]


class CheckpointReader:
    """`read_checkpoint(model_path, dtype)`, keeping the last checkpoint read (one model per run).

        >>> CheckpointReader().last is None
        True
    """

    def __init__(self) -> None:
        self.last: tuple[tuple[str, str], tuple[dict[str, Any], dict[str, torch.Tensor]]] | None = None

    def read(self, model_path: str, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """`(config, state_dict)` of the checkpoint in `dtype` (posenc's `read_checkpoint`); the same objects
        while the path and dtype stay the same."""
        from ...models.loading import read_checkpoint

        key = (str(model_path), str(dtype))
        if self.last is None or self.last[0] != key:
            self.last = (key, read_checkpoint(model_path, dtype=dtype))
        return self.last[1]

    def config(self, model_path: str) -> dict[str, Any]:
        """The checkpoint's transformers `config.json` dict (a copy)."""
        return dict(self.read(model_path, torch.float32)[0])
