"""Running the rows: the registry, progress display, building the subject, and the self-test.

    >>> list(CHECKS)[:3]
    ['relativity', 'prefill-decode', 'batch-padding']
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Iterable

import torch

from ..errors import fail
from .checks.common import Budget, Row, Subject
from .checks.consistency import batch_padding, prefill_decode, relativity
from .checks.length import length_boundaries, short_context
from .checks.multimodal import multimodal
from .checks.pairing import pairing
from .checks.rules import rules_vs_reference
from .checks.scan import position_scan
from .checks.scoring import NEEDS, SCORING_CHECKS
from .faults import FAULTS, faulty_factory

__all__ = ["CHECKS", "run_checks", "self_test", "build_subject", "Progress", "parse_checks"]

CHECKS: dict[str, Callable[..., Row]] = {
    "relativity": relativity, "prefill-decode": prefill_decode, "batch-padding": batch_padding,
    "pairing": pairing, "length-boundaries": length_boundaries, "position-scan": position_scan,
    "short-context": short_context, "multimodal": multimodal, "rules-vs-reference": rules_vs_reference,
    "prefix-caching": lambda subject, budget, progress=None: Row(
        "prefix-caching", None, skipped="n/a: logits-protocol engines share no prefix cache between requests "
                                        "(cache reuse is prefill-decode's)"),
    "chunked-prefill": lambda subject, budget, progress=None: Row(
        "chunked-prefill", None, skipped="n/a: a logits-protocol engine is prefilled by verify itself (prefill in "
                                         "pieces through the cache is prefill-decode's and relativity's)")}


def steps_of(name: str, budget: Budget) -> int:
    """How many progress steps a row reports."""
    return {"relativity": len(budget.shifts), "prefill-decode": 6, "batch-padding": 6, "pairing": 1,
            "length-boundaries": 5, "short-context": 5, "multimodal": 1,
            "rules-vs-reference": 8, "prefix-caching": 1, "chunked-prefill": 1,
            "position-scan": len(budget.depths) * (len(budget.passkey_lengths) + len(budget.copy_lengths))}[name]


def parse_checks(text: str | None) -> list[str]:
    """`"a,b"` -> ["a", "b"] (all rows for None). Raises PosencError naming unknown rows."""
    if not text:
        return list(CHECKS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        fail("checks", f"comma-separated names from {list(CHECKS)}", text)
    return names


class Progress:
    """A progress bar per row: rich when installed and writing to a terminal, else one plain line per row."""

    def __init__(self, enabled: bool = True, stream: Any = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.rich = None
        if enabled and getattr(self.stream, "isatty", lambda: False)():
            try:
                from rich.progress import BarColumn, Progress as RichProgress, TextColumn, TimeElapsedColumn

                self.rich = RichProgress(TextColumn("{task.description:<28}"), BarColumn(), TextColumn(
                    "{task.completed}/{task.total}"), TimeElapsedColumn(), transient=False)
            except ImportError:
                self.rich = None

    def __enter__(self) -> "Progress":
        if self.rich is not None:
            self.rich.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.rich is not None:
            self.rich.__exit__(*exc)

    def task(self, label: str, total: int) -> Callable[[], None]:
        if not self.enabled:
            return lambda: None
        if self.rich is not None:
            task = self.rich.add_task(label, total=total)
            return lambda: self.rich.advance(task)
        state = {"done": 0, "start": time.perf_counter()}
        self.stream.write(f"{label:<28} ")
        self.stream.flush()

        def advance() -> None:
            state["done"] += 1
            self.stream.write("#" if state["done"] < total else f"# {time.perf_counter() - state['start']:.1f} s\n")
            self.stream.flush()
        return advance


def _row_for(subject: Subject, name: str) -> Callable[..., Row]:
    """The row's check for the subject's protocol (scoring engines: their own variant, or n/a)."""
    if subject.protocol != "scoring" or name == "rules-vs-reference":
        return CHECKS[name]
    if name in SCORING_CHECKS:
        return SCORING_CHECKS[name]
    return lambda subject, budget, progress=None: Row(name, None, skipped=f"n/a: needs {NEEDS[name]}")


def run_checks(subject: Subject, budget: Budget, names: Iterable[str], progress: Progress | None = None,
               label: str = "") -> list[Row]:
    """Run the named rows in order; an exception inside a row becomes a failed row with its message."""
    rows = []
    progress = progress or Progress(enabled=False)
    for name in names:
        advance = progress.task(f"{label}{name}", steps_of(name, budget))
        start = time.perf_counter()
        try:
            with torch.no_grad():
                row = _row_for(subject, name)(subject, budget, advance)
        except BaseException as exc:  # a crashing engine fails its row, with the reason, and the run goes on
            if isinstance(exc, (KeyboardInterrupt, GeneratorExit)):
                raise  # the user's, not the engine's (a Rust extension's panic is a BaseException too)
            # SystemExit inside a row can only come from the engine (an in-process one): a failure, never an exit
            error = f"SystemExit({exc.code!r}): the engine tried to end the process" if isinstance(exc, SystemExit) \
                else f"{type(exc).__name__}: {exc}"
            row = Row(name, False, {"error": error[:300]}, explanation="the engine raised while this row ran")
        row.seconds = time.perf_counter() - start
        rows.append(row)
    return rows


def self_test(make_subject: Callable[[Callable[..., Any]], Subject], budget: Budget, factory: Callable[..., Any],
              progress: Progress | None = None, faults: Iterable[str] | None = None
              ) -> tuple[list[Row], list[dict[str, Any]]]:
    """Clean engine through every row of the faults, then each fault through its row.

    Returns:
        `(clean rows, table)`; each table entry: fault, row, what, clean status, faulty status, the faulty
        row's measured numbers, and `caught` (clean passes and faulty fails).
    """
    chosen = [FAULTS[n] for n in (faults or FAULTS)]
    rows_needed = list(dict.fromkeys(f.row for f in chosen))
    clean = {r.name: r for r in run_checks(make_subject(factory), budget, rows_needed, progress, "clean ")}
    table = []
    for fault in chosen:
        row = run_checks(make_subject(faulty_factory(fault.name, factory)), budget, [fault.row], progress,
                         f"{fault.name} ")[0]
        table.append({"fault": fault.name, "row": fault.row, "what": fault.what, "clean": clean[fault.row].status,
                      "faulty": row.status, "measured": row.measured,
                      "caught": clean[fault.row].passed is True and row.passed is False})
    return list(clean.values()), table


def build_subject(model_path: str, factory: Callable[..., Any], *, engine_name: str, dtype: torch.dtype,
                  tokens: int, kv_dtype: str | None = None, reader: Any = None) -> tuple[Subject, dict[str, Any]]:
    """The subject for a checkpoint: config and tokenizer from posenc's loader, the reference text, and
    the pairing reference (transformers on the same weights; posenc's decoder when testing transformers).
    `kv_dtype` ("FORMAT:pre|post", posenc's engine only): every cache the engine makes is quantized.
    `reader`: the run's `CheckpointReader` (config and reference engines read through it; None: a new one)."""
    import functools
    import importlib.util

    from ..models import load_tokenizer
    from . import engines
    from .text import text_ids

    reader = reader or engines.CheckpointReader()
    config = reader.config(model_path)
    try:
        tokenizer = load_tokenizer(model_path)
    except Exception:  # a checkpoint without a tokenizer (tiny test models): random ids, no position-scan
        tokenizer = None
    ids, facts = text_ids(tokenizer, tokens, vocab_size=config["vocab_size"])
    if engine_name.startswith("transformers"):  # stock or patched: posenc's decoder is the other implementation
        reference = functools.partial(engines.posenc_engine, reader=reader)
    else:
        reference = (functools.partial(engines.transformers_engine, reader=reader)
                     if importlib.util.find_spec("transformers") else None)
    if kv_dtype is not None:
        factory = engines.with_kv_dtype(factory, kv_dtype)
    subject = Subject(factory, model_path, config, ids, tokenizer=tokenizer, reference=reference, dtype=dtype,
                      name=engine_name)
    subject.kv_dtype = kv_dtype
    return subject, facts
