"""A checkpoint's files read as untrusted input: `config.json`, safetensors, and the sizes they declare.

Every way such a file can be wrong (not UTF-8, a BOM, invalid JSON, not an object, a corrupt or truncated
safetensors header, more layers declared than the tensors hold) is a `PosencError` naming the file, before
any tensor is read or a decoder is built (a config declaring 20,000 layers over tensors for two would
otherwise build 20,000 layers first).

    >>> check_layers(2, ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"], "n")
    >>> try:
    ...     check_layers(20000, ["blk.0.attn_q.weight"], "llama.block_count")
    ... except PosencError as e:
    ...     print(e)
    llama.block_count: expected the number of layers the file holds tensors for (1: layers 0..0), got 20000
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from ..errors import PosencError, Raw, fail, integer  # noqa: F401 (PosencError: the doctest)

__all__ = ["read_config_json", "read_safetensors", "check_layers"]

_LAYER = re.compile(r"(?:model\.)?(?:layers|blk)\.(\d+)\.")


def read_config_json(file: Path) -> dict[str, Any]:
    """The object in a `config.json`, read as strict UTF-8 JSON.

    Raises:
        PosencError: `path`: the file named, with what is wrong (not UTF-8, a byte-order mark, empty,
            invalid JSON with its line and column, or a value that is not a JSON object).
    """
    raw = file.read_bytes()
    what = f"{file} holding a JSON object in UTF-8 (a transformers config.json)"
    if raw.startswith(b"\xef\xbb\xbf"):  # json.loads refuses it too; say what it is
        fail("path", what, Raw("a file that starts with a UTF-8 byte-order mark (save it without one)"))
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        fail("path", what, Raw(f"bytes that are not UTF-8 (at byte {err.start})"))
    if not text.strip():
        fail("path", what, Raw("an empty file"))
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as err:
        fail("path", what, Raw(f"invalid JSON ({err.msg} at line {err.lineno}, column {err.colno})"))
    if not isinstance(cfg, dict):
        fail("path", what, Raw(f"a JSON {type(cfg).__name__}"))
    return cfg


def _open(file: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(file), framework="pt")
    except Exception as err:  # SafetensorError, OSError: a header that does not parse or does not fit the file
        fail("path", f"{file} as a readable .safetensors file", Raw(f"a corrupt file ({type(err).__name__}: {err})"))


def read_safetensors(files: list[Path], dtype: torch.dtype, check: Any = None) -> dict[str, torch.Tensor]:
    """Every tensor of `files` (cast to `dtype`), after `check(names)` has seen the names of all of them.

    Raises:
        PosencError: a corrupt file, a tensor name found in two files, or what `check` raises.
    """
    where: dict[str, Path] = {}
    for file in files:  # headers first: nothing is read before the names are known and checked
        with _open(file) as handle:
            for name in handle.keys():
                if name in where:
                    fail("path", "each tensor in one .safetensors file", Raw(f"{name!r} in {where[name]} and {file}"))
                where[name] = file
    if check is not None:
        check(list(where))
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with _open(file) as handle:
            for name in handle.keys():
                try:
                    state[name] = handle.get_tensor(name).to(dtype)
                except Exception as err:  # data that does not match the header
                    fail("path", f"{file} as a readable .safetensors file", Raw(f"tensor {name!r}: {err}"))
    return state


def _ranges(held: list[int]) -> str:
    return "none" if not held else f"{held[0]}..{held[-1]}" + ("" if held == list(range(held[0], held[-1] + 1))
                                                               else " with gaps")


def check_layers(declared: Any, names: Iterable[str], arg: str) -> None:
    """Refuse a declared layer count the tensors do not match: layers `0 .. declared - 1`, each present.

    Args:
        declared: the layer count the config or metadata declares. names: the checkpoint's tensor names
            (transformers' `model.layers.N.` or GGUF's `blk.N.`). arg: the key that declared it.
    Raises:
        PosencError: `arg` not a positive integer, or not the layers the tensors hold.
    """
    n = integer(arg, declared, min=1)
    held = sorted({int(m.group(1)) for name in names if (m := _LAYER.match(name))})
    if held != list(range(n)):
        fail(arg, f"the number of layers the file holds tensors for ({len(held)}: layers {_ranges(held)})", n)
