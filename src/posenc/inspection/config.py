"""Where `posenc inspect` gets its inputs: model configs (a path, a directory or a bundled preset) and lengths.

`load_config` reads a `config.json` path, a directory holding one, or a bundled preset (`preset_names()`,
`load_preset`); `parse_lengths` reads token counts such as "4k,32k,128k" and `length_label` writes them back.

Neighbours: `posenc.inspection` (the report and KV-cache memory; it re-exports these names) and
`posenc.inspection.rope` (the RoPE facts of one checkpoint).
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path
from typing import Any

from ..errors import Raw, fail

__all__ = ["preset_names", "load_config", "load_preset", "parse_lengths", "length_label"]

MAX_TOKENS = 2**32  # 4096m tokens: a length beyond it is a typo, not a model (the longest contexts are ~10m)


def preset_names() -> list[str]:
    """The names of the bundled model configs, sorted (e.g. "llama-2-7b")."""
    folder = resources.files("posenc") / "presets"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_config(model_or_config: str) -> tuple[dict[str, Any], str]:
    """Read a model config: a path to a config.json, a directory holding one, or a bundled preset name.

    Args:
        model_or_config: the path or preset name (case-insensitive).
    Returns:
        `(config dict, where it came from)`.
    Raises:
        PosencError: no such file, directory or preset; a file that is not a JSON object.
    """
    if not isinstance(model_or_config, str) or not model_or_config:
        fail("MODEL_OR_CONFIG", "a path or a preset name", model_or_config)
    path = Path(model_or_config).expanduser()
    if path.is_dir():
        path = path / "config.json"
        if not path.is_file():
            fail("MODEL_OR_CONFIG", "a directory holding config.json", f"{model_or_config!r} without one")
    if path.is_file():
        try:
            cfg = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            fail("MODEL_OR_CONFIG", "a readable JSON file", f"{str(path)!r} ({e})")
        if not isinstance(cfg, dict):
            fail("MODEL_OR_CONFIG", "a JSON object (a transformers config.json)", f"{type(cfg).__name__} in {str(path)!r}")
        return cfg, str(path)
    name = model_or_config.lower()
    if name in preset_names():
        return load_preset(name), f"preset {name}"
    if path.suffix == ".json" or "/" in model_or_config or "\\" in model_or_config:  # meant as a path
        fail("MODEL_OR_CONFIG", "an existing config.json or directory", Raw(f"{model_or_config!r} (file not found)"))
    fail("MODEL_OR_CONFIG", f"a config.json, a directory holding one, or a preset ({', '.join(preset_names())})",
         model_or_config)


def load_preset(name: str) -> dict[str, Any]:
    """The config.json dict of a bundled model (`preset_names()` lists them), ready for `from_hf_config`.

        >>> cfg = load_preset("llama-3.2-1b")
        >>> cfg["model_type"], cfg["rope_scaling"]["rope_type"]
        ('llama', 'llama3')

    Args:
        name: a preset name such as "llama-3.1-8b" (case-insensitive).
    Returns:
        A fresh dict (changing it does not change the preset).
    Raises:
        PosencError: no such preset.
    """
    names = preset_names()
    if not isinstance(name, str) or name.lower() not in names:
        fail("name", f"a bundled preset ({', '.join(names)})", name)
    return json.loads((resources.files("posenc") / "presets" / f"{name.lower()}.json").read_text())


def parse_lengths(text: str, arg: str = "--lengths") -> list[int]:
    """Token counts from "4k,32k,128k" (k = 1024, m = 1024**2) or plain integers.

    Args:
        text: the comma-separated counts.
        arg: the option's name for messages.
    Returns:
        The counts, in the order given.
    Raises:
        PosencError: empty text, a count that is not a whole number in [1, MAX_TOKENS].
    """
    lengths = []
    for item in str(text).split(","):
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", item)
        if not match:
            fail(arg, "comma-separated token counts such as 4k,32k,128k or 4096", text)
        value = float(match.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[match.group(2).lower()]
        if value != int(value) or not 0 < value <= MAX_TOKENS:
            fail(arg, f"whole numbers of tokens in [1, {MAX_TOKENS}] ({length_label(MAX_TOKENS)})", item.strip())
        lengths.append(int(value))
    return lengths


def length_label(tokens: int) -> str:
    """4096 -> "4k", 131072 -> "128k", 1048576 -> "1m", 4000 -> "4000"."""
    if tokens % 1024**2 == 0:
        return f"{tokens // 1024**2}m"
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)
