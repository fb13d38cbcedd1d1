"""The layout's rules (docs/architecture.md), read from the source itself: every import, lazy ones too.

- Packages import downward only: each top-level package of `src/posenc` (a top-level module counts as its own
  package) imports only packages of a lower layer, or of its own. The layers are the table of
  docs/architecture.md, so the page and the code cannot drift apart.
- No cycle between packages (implied by the layers, checked on its own so a failure names the cycle).
- No top-level family of modules sharing a prefix (`kv_quant.py` beside `kv_store.py`, `attention_masks.py`
  beside `attention/`): a concept with more than one file is a package.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "posenc"
DOC = ROOT / "docs" / "architecture.md"

# The one upward import the rule allows, lazily inside the method it serves (the test below checks both).
ALLOWED_UPWARD = {
    ("posenc.rope.spec", "hf"): "Rope.from_hf_config: the front door on the value; the config reading lives in hf",
}


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(absolute posenc module, line, lazy) for every import in one file; lazy: inside a function body."""
    name = module_name(path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    lazy_lines = {n.lineno for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            targets = [target] + [f"{target}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            if target == "posenc" or target.startswith("posenc."):
                found.append((target, node.lineno, node.lineno in lazy_lines))
    return found


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None  # `posenc` itself: the front, above every layer


def existing(module: str) -> bool:
    rel = Path(*module.split("."))
    return (SRC.parent / rel).with_suffix(".py").exists() or (SRC.parent / rel / "__init__.py").exists()


def package_edges() -> dict[tuple[str, str], list[str]]:
    """(importer package, imported package) -> ['file:line', ...], over every import of src/posenc."""
    edges = defaultdict(list)
    for path in sorted(SRC.rglob("*.py")):
        here = module_name(path)
        for target, line, lazy in imports(path):
            if not existing(target):
                continue  # `from posenc.x import name`: the name is not a module; the module itself is counted
            a, b = package_of(here), package_of(target)
            if a is None or b is None or a == b:
                continue
            if (here, b) in ALLOWED_UPWARD and lazy:
                continue
            edges[(a, b)].append(f"{path.relative_to(ROOT)}:{line}")
    return edges


def doc_layers() -> list[list[str]]:
    """The layer table of docs/architecture.md, bottom first: one row per layer, its packages in backticks."""
    text = DOC.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    return [re.findall(r"`([\w.]+)`", row.split("|")[2]) for row in rows]


def test_the_doc_names_every_package_once():
    layers = doc_layers()
    named = [p for layer in layers for p in layer]
    present = sorted({p.stem if p.is_file() else p.name for p in SRC.iterdir()
                      if (p.suffix == ".py" and p.stem not in ("__init__",)) or (p / "__init__.py").exists()})
    assert sorted(named) == present, "docs/architecture.md's layers must list every top-level package once"


def test_packages_import_downward_only():
    rank = {p: i for i, layer in enumerate(doc_layers()) for p in layer}
    upward = {f"{a} (layer {rank[a]}) imports {b} (layer {rank[b]})": where
              for (a, b), where in package_edges().items() if rank[b] >= rank[a]}
    assert not upward, "\n".join(f"{what}: {', '.join(where)}" for what, where in sorted(upward.items()))


def test_no_cycle_between_packages():
    graph = defaultdict(set)
    for a, b in package_edges():
        graph[a].add(b)
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles between packages: " + "; ".join(" -> ".join(c) for c in cycles)


def test_the_allowed_upward_import_is_lazy_and_still_needed():
    for (module, package), why in ALLOWED_UPWARD.items():
        path = SRC.parent / Path(*module.split(".")).with_suffix(".py")
        found = [(t, lazy) for t, _, lazy in imports(path) if package_of(t) == package]
        assert found, f"{module} no longer imports {package}: drop it from ALLOWED_UPWARD ({why})"
        assert all(lazy for _, lazy in found), f"{module} must import {package} inside the method only ({why})"


def test_no_top_level_module_family_sharing_a_prefix():
    """No two top-level modules `a_x.py`, `a_y.py`, and no `a_x.py` beside a package or module `a`."""
    names = sorted(p.stem for p in SRC.glob("*.py") if not p.stem.startswith("__"))
    packages = {p.name for p in SRC.iterdir() if (p / "__init__.py").exists()}
    by_prefix = defaultdict(list)
    for n in names:
        if "_" in n:
            by_prefix[n.split("_")[0]].append(n)
    families = {p: ns for p, ns in by_prefix.items() if len(ns) > 1 or p in packages or p in names}
    assert not families, f"top-level modules sharing a prefix (make each family a package): {families}"
