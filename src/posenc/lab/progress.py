"""Progress bars: rich's when it is installed and stderr is a terminal, plain lines otherwise, or none.

    >>> with bar("demo", 3, mode="off") as tick:
    ...     for _ in range(3):
    ...         tick()
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator

from ..errors import fail

__all__ = ["bar", "MODES", "log"]

MODES = ("auto", "rich", "plain", "off")
_state = {"mode": "auto"}


def set_mode(mode: str) -> None:
    """Choose the bars for this process: "auto", "rich", "plain" or "off"."""
    if mode not in MODES:
        fail("progress", f"one of {MODES}", mode)
    _state["mode"] = mode


def _resolve(mode: str | None) -> str:
    mode = mode or _state["mode"]
    if mode == "auto":
        from importlib.util import find_spec

        return "rich" if sys.stderr.isatty() and find_spec("rich") is not None else "plain"
    return mode


def log(message: str) -> None:
    """One status line on stderr (silent when progress is off)."""
    if _resolve(None) != "off":
        print(message, file=sys.stderr, flush=True)


@contextlib.contextmanager
def bar(label: str, total: int, *, mode: str | None = None) -> Iterator[Callable[..., None]]:
    """A progress bar over `total` steps; yields `tick(n=1, info="")`.

    Plain mode prints a line at every 10 % (and at the end) with the elapsed time and `info`.
    """
    mode = _resolve(mode)
    if mode == "off" or total <= 0:
        yield lambda n=1, info="": None
        return
    if mode == "rich":
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[info]}"))
        with Progress(*columns, transient=False, console=Console(stderr=True)) as progress:  # stdout: the results
            task = progress.add_task(label, total=total, info="")
            yield lambda n=1, info="": progress.update(task, advance=n, info=info)
        return
    start, done, shown = time.perf_counter(), [0], [-1]

    def tick(n: int = 1, info: str = "") -> None:
        done[0] += n
        decile = done[0] * 10 // total
        if decile != shown[0]:
            shown[0] = decile
            extra = f"  {info}" if info else ""
            print(f"{label}: {done[0]}/{total} ({100 * done[0] // total}%) {time.perf_counter() - start:.0f}s{extra}",
                  file=sys.stderr, flush=True)

    yield tick
