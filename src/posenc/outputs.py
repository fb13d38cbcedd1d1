"""Output paths checked before the work that fills them (minutes of checks or training, then a traceback).

    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> writable_folder("--out", folder / "report")
    >>> try:
    ...     writable_file("--json", folder)
    ... except PosencError as e:
    ...     print(e.arg, "|", e.expected)
    --json | a file path to write (not a folder)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .errors import PosencError, Raw, fail  # noqa: F401 (PosencError: the doctest)

__all__ = ["writable_folder", "writable_file"]


def _blocked(path: Path) -> Path | None:
    """The nearest existing ancestor of `path` when it is not a folder (nothing can be made under it), or None."""
    for parent in path.parents:
        if parent.exists():
            return None if parent.is_dir() else parent
    return None


def writable_folder(arg: str, path: Any) -> None:
    """Refuse a folder path that is a file or lies under one. Raises PosencError naming `arg`."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        fail(arg, "a folder to write into (not a file)", Raw(f"{path}, a file"))
    if (above := _blocked(path)) is not None:
        fail(arg, "a folder to write into (not a file)", Raw(f"{path}, under the file {above}"))


def writable_file(arg: str, path: Any) -> None:
    """Refuse a file path that is a folder or lies under a file. Raises PosencError naming `arg`."""
    path = Path(path)
    if path.is_dir():
        fail(arg, "a file path to write (not a folder)", Raw(f"{path}, a folder"))
    if (above := _blocked(path)) is not None:
        fail(arg, "a file path to write (not a folder)", Raw(f"{path}, under the file {above}"))
