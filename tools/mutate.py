#!/usr/bin/env python3
"""Mutation testing for posenc: change one thing in the source, run the tests that should notice, list survivors.

Each mutant is one small edit found through the AST (operators below), applied to a *copy* of the repository
(src/, tests/, docs/, README.md, pyproject.toml in a temporary directory); the relevant test files run there
with `pytest -x -q` under a timeout. A mutant that every test still passes "survives": either a test is
missing, or the mutant is equivalent (it cannot change any result). The checkout itself is never written.

Operators: `+` <-> `-`, `*` <-> `/`, `//` -> `/`, `**` -> `*`; comparisons `<` <-> `<=`, `>` <-> `>=`,
`==` <-> `!=`, `in` <-> `not in`, `is` <-> `is not`; `and` <-> `or`; `not x` -> `x`; `-x` -> `x`;
integer constants n -> n + 1 and n -> n - 1, float constants x -> 2x; `raise ...` and check calls used as
statements (`fail(...)`, `integer(...)`, ...) -> `pass`; slices `a[i:j]` -> `a[j:i]`, `a[:j]` -> `a[j:]`,
`a[i:]` -> `a[:i]`. Messages are left alone: nothing inside an f-string or the arguments of
`fail`/`PosencError` is mutated.

Examples:
    python tools/mutate.py --list --files src/posenc/cache/kvcache.py            # the mutants, nothing run
    nice -n 10 python tools/mutate.py --max 200 --seed 0 --report survivors.md
    python tools/mutate.py --files src/posenc/rope/rerotate.py --tests tests/rope/test_rerotate.py --max 20
"""

from __future__ import annotations

import argparse
import ast
import copy
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILES = ["src/posenc/rope/*.py", "src/posenc/cache/*.py", "src/posenc/hf/*.py"]
CHECKS = {"fail", "integer", "real", "boolean", "choice", "positions", "check_positive", "check_int_positions",
          "batch_positions", "check_float_tensor"}
MESSAGE_CALLS = {"fail", "PosencError", "Raw"}
SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
        ast.Pow: ast.Mult, ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
        ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is,
        ast.And: ast.Or, ast.Or: ast.And}
SYMBOL = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/", ast.FloorDiv: "//", ast.Pow: "**", ast.Lt: "<",
          ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=", ast.In: "in", ast.NotIn: "not in",
          ast.Is: "is", ast.IsNot: "is not", ast.And: "and", ast.Or: "or"}


@dataclass(frozen=True)
class Mutant:
    file: str  # relative to the repository root
    line: int
    col: int
    what: str  # e.g. "+ -> -"
    source: str  # the whole mutated file
    original: str  # the line as it was, for the report


def _span(lines: list[str], node: ast.AST) -> tuple[int, int]:
    """Character offsets of `node` in the file joined from `lines` (each keeping its newline)."""
    starts = [0]
    for line in lines:
        starts.append(starts[-1] + len(line))
    return starts[node.lineno - 1] + node.col_offset, starts[node.end_lineno - 1] + node.end_col_offset


def _call_name(node: ast.AST) -> str:
    func = node.func if isinstance(node, ast.Call) else None
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _skipped(tree: ast.Module) -> set[int]:
    """ids of nodes never mutated: message text (f-strings, arguments of fail/PosencError), docstrings, __all__."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        roots = []
        if isinstance(node, ast.JoinedStr):
            roots = [node]
        elif isinstance(node, ast.Call) and _call_name(node) in MESSAGE_CALLS:
            roots = node.args[1:] if _call_name(node) == "fail" else node.args  # fail's first argument: the name
            roots = list(roots) + [k.value for k in node.keywords]
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            roots = [node]
        for root in roots:
            skip.update(id(n) for n in ast.walk(root))
    return skip


def _variants(node: ast.AST) -> list[tuple[str, ast.AST]]:
    """(description, replacement node) for each mutation of one node."""
    out: list[tuple[str, ast.AST]] = []
    if isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in SWAP:
        new = copy.deepcopy(node)
        new.op = SWAP[type(node.op)]()
        out.append((f"{SYMBOL[type(node.op)]} -> {SYMBOL[type(new.op)]}", new))
    elif isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in SWAP:
                new = copy.deepcopy(node)
                new.ops[i] = SWAP[type(op)]()
                out.append((f"{SYMBOL[type(op)]} -> {SYMBOL[type(new.ops[i])]}", new))
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
        out.append((f"drop unary {'not' if isinstance(node.op, ast.Not) else '-'}", node.operand))
    elif isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, int):
            out += [(f"{node.value} -> {node.value + d}", ast.Constant(node.value + d)) for d in (1, -1)]
        elif node.value not in (0.0,):
            out.append((f"{node.value!r} -> {node.value * 2!r}", ast.Constant(node.value * 2)))
    elif isinstance(node, ast.Slice) and (node.lower or node.upper):
        out.append(("swap slice bounds", ast.Slice(node.upper, node.lower, node.step)))
    elif isinstance(node, ast.Raise):
        out.append(("drop raise", ast.Pass()))
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) and _call_name(node.value) in CHECKS:
        out.append((f"drop check {_call_name(node.value)}(...)", ast.Pass()))
    return out


def mutants(path: Path) -> list[Mutant]:
    """Every mutant of one file that still parses."""
    text = path.read_text()
    lines = text.splitlines(keepends=True)
    tree = ast.parse(text)
    skip = _skipped(tree)
    docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef))
                  and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    rel = str(path.resolve().relative_to(ROOT))
    out = []
    for node in ast.walk(tree):
        if id(node) in skip or id(node) in docstrings or not hasattr(node, "lineno"):
            continue
        if isinstance(node, ast.Slice) and not hasattr(node, "end_lineno"):
            continue
        for what, new in _variants(node):
            start, end = _span(lines, node)
            mutated = text[:start] + ast.unparse(new) + text[end:]
            try:
                ast.parse(mutated)
            except SyntaxError:
                continue
            out.append(Mutant(rel, node.lineno, node.col_offset + 1, what, mutated, lines[node.lineno - 1].strip()))
    return sorted(out, key=lambda m: (m.line, m.col, m.what))


def tests_for(rel: str) -> list[str]:
    """Test files for a source file, found by the mirror rule: src/posenc/P/M.py -> tests/P/test_M*.py.

    A package's `__init__.py` maps to its whole test folder; a file with no mirror runs the whole suite.
    """
    path = Path(rel).relative_to("src/posenc")
    folder = ROOT / "tests" / path.parent
    if path.name == "__init__.py":
        return [str(folder.relative_to(ROOT))] if folder.is_dir() else ["tests"]
    found = sorted(str(p.relative_to(ROOT)) for p in folder.glob(f"test_{path.stem}*.py"))
    return found or ["tests"]


PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider"]


def run_forked(work: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    """Like `run_tests`, in a forked child of this process, which imported torch and pytest once (saves seconds)."""
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child: import posenc fresh from the copy, run pytest, exit with its code
        code = 3
        try:
            os.chdir(work)
            sys.path.insert(0, str(work / "src"))
            sys.dont_write_bytecode = True
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            import pytest

            code = int(pytest.main([*PYTEST_ARGS, *tests]))
        finally:
            os._exit(code)
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() - start > timeout:
                raise TimeoutError
            time.sleep(0.05)
    except (TimeoutError, KeyboardInterrupt) as e:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        if isinstance(e, KeyboardInterrupt):
            raise
        return "timeout", time.monotonic() - start
    return ("passed" if os.waitstatus_to_exitcode(status) == 0 else "failed"), time.monotonic() - start


def preload() -> None:
    """Import what every run needs, before forking (never posenc: each child imports the mutated copy)."""
    assert not any(m == "posenc" or m.startswith("posenc.") for m in sys.modules)
    os.environ["OMP_NUM_THREADS"] = "1"
    import pytest  # noqa: F401
    import torch

    torch.set_num_threads(1)
    for optional in ("numpy", "hypothesis", "transformers", "matplotlib"):
        try:
            __import__(optional)
        except ImportError:
            pass


def run_tests(work: Path, tests: list[str], timeout: float) -> tuple[str, float]:
    """("passed" | "failed" | "timeout", seconds) for `pytest -x -q tests` inside the copy, in a new interpreter."""
    env = {**os.environ, "PYTHONPATH": str(work / "src"), "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1"}
    start = time.monotonic()
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", *PYTEST_ARGS, *tests],
                              cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start
    return ("passed" if done.returncode == 0 else "failed"), time.monotonic() - start


def copy_repo() -> Path:
    """A throw-away copy of what the tests need; mutants are written only there."""
    work = Path(tempfile.mkdtemp(prefix="posenc-mutate-"))
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".pytest_cache", ".hypothesis")
    for name in ("src", "tests", "docs"):
        if (ROOT / name).exists():
            shutil.copytree(ROOT / name, work / name, ignore=ignore)
    for name in ("README.md", "pyproject.toml"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, work / name)
    return work


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("Examples:")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", nargs="+", default=DEFAULT_FILES, help="source files or globs (default: %(default)s)")
    parser.add_argument("--tests", nargs="+", help="test files to run for every mutant (default: per file, its mirror tests/P/test_M*.py)")
    parser.add_argument("--max", type=int, default=100, help="run at most N mutants, sampled at random (default 100; 0 = all)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--timeout", type=float, default=0, help="seconds per run (default: 3x the clean run + 20)")
    parser.add_argument("--line", type=int, action="append", help="only mutants on these lines (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit, running nothing")
    parser.add_argument("--report", help="also write the survivors table (markdown) to this file")
    parser.add_argument("--no-fork", action="store_true", help="a fresh interpreter per run (slower; default forks"
                        " a process that imported torch once, on POSIX)")
    args = parser.parse_args(argv)
    fork = hasattr(os, "fork") and not args.no_fork

    files = sorted({p for f in args.files for p in (ROOT.glob(f) if any(c in f for c in "*?[") else [ROOT / f])
                    if p.suffix == ".py" and p.is_file()})
    everything = [m for f in files for m in mutants(f) if not args.line or m.line in args.line]
    # a random order, so that a run stopped early (Ctrl-C: the report covers what ran) still samples every file
    chosen = random.Random(args.seed).sample(everything, len(everything) if args.max <= 0 else min(args.max, len(everything)))
    print(f"{len(everything)} mutants in {len(files)} files; running {len(chosen)}", flush=True)
    if args.list:
        for m in sorted(chosen, key=lambda m: (m.file, m.line, m.col, m.what)):
            print(f"{m.file}:{m.line}:{m.col}  {m.what}")
        return 0

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)  # `kill PID` stops it like Ctrl-C: restore, clean up, report
    work = copy_repo()
    if fork:
        preload()
    run = run_forked if fork else run_tests
    results: list[tuple[Mutant, str, float]] = []
    try:
        clean: dict[tuple[str, ...], float] = {}
        for k, m in enumerate(chosen, 1):
            tests = tuple(args.tests or tests_for(m.file))
            if tests not in clean:  # the unmutated copy must pass, and sets the timeout
                status, seconds = run(work, list(tests), 3600)
                if status != "passed":
                    raise SystemExit(f"the tests fail without any mutation: {' '.join(tests)}")
                clean[tests] = seconds
            target = work / m.file
            original = target.read_text()
            try:
                target.write_text(m.source)
                status, seconds = run(work, list(tests), args.timeout or 3 * clean[tests] + 20)
            except KeyboardInterrupt:
                print("stopped: reporting the mutants run so far", flush=True)
                break
            finally:
                target.write_text(original)  # never leave a mutant in place, even on Ctrl-C
            results.append((m, status, seconds))
            print(f"[{k}/{len(chosen)}] {'SURVIVED' if status == 'passed' else status:8} {m.file}:{m.line}:{m.col}"
                  f"  {m.what}  ({seconds:.0f} s)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    survivors = sorted(((m, s) for m, s, _ in results if s == "passed"), key=lambda r: (r[0].file, r[0].line, r[0].col))
    killed = sum(s != "passed" for _, s, _ in results)
    table = [f"{killed} of {len(results)} mutants killed, {len(survivors)} survived", "",
             "| file:line:col | mutation | source line |", "|---|---|---|"]
    table += [f"| {m.file}:{m.line}:{m.col} | {m.what} | `{m.original}` |" for m, _ in survivors]
    print("\n".join(table))
    if args.report:
        Path(args.report).write_text("\n".join(table) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
