"""tools/mutate.py: the mutants it makes (one edit each, messages untouched), and that a run never writes the checkout."""

import ast
import hashlib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("mutate", ROOT / "tools" / "mutate.py")
mutate = importlib.util.module_from_spec(spec)
sys.modules["mutate"] = mutate
spec.loader.exec_module(mutate)

SAMPLE = '''"""doc 1 + 2"""
from posenc.errors import fail


def f(x, n):
    if x < 0:
        fail("x", f"a value >= {n + 1}", x)
    if n == 3 and x:
        raise ValueError(n - 1)
    return x[1:n] * 2.5 + -n
'''


@pytest.fixture
def sample(tmp_path, monkeypatch):
    monkeypatch.setattr(mutate, "ROOT", tmp_path)
    path = tmp_path / "sample.py"
    path.write_text(SAMPLE)
    return path


def test_each_operator_once_and_messages_untouched(sample):
    found = {(m.line, m.what) for m in mutate.mutants(sample)}
    expected = {(6, "< -> <="), (6, "0 -> 1"), (6, "0 -> -1"), (7, "drop check fail(...)"), (8, "== -> !="),
                (8, "3 -> 4"), (8, "3 -> 2"), (8, "and -> or"), (9, "drop raise"), (9, "- -> +"), (9, "1 -> 2"),
                (9, "1 -> 0"), (10, "swap slice bounds"), (10, "* -> /"), (10, "2.5 -> 5.0"), (10, "+ -> -"),
                (10, "drop unary -"), (10, "1 -> 2"), (10, "1 -> 0")}
    assert found == expected  # nothing from the docstring, the f-string or fail's message
    for m in mutate.mutants(sample):
        ast.parse(m.source)
        changed = [i for i, (a, b) in enumerate(zip(SAMPLE.splitlines(), m.source.splitlines())) if a != b]
        assert changed == [m.line - 1], m  # one edit, on the line it names


def test_slice_swap_text(sample):
    (swap,) = [m for m in mutate.mutants(sample) if m.what == "swap slice bounds"]
    assert "x[n:1] * 2.5" in swap.source


def test_default_files_have_mutants_and_tests():
    files = sorted(p for pattern in mutate.DEFAULT_FILES for p in ROOT.glob(pattern))
    assert any(p.parent.name == "cache" for p in files) and any(p.parent.name == "hf" for p in files)
    for path in files:
        rel = str(path.relative_to(ROOT))
        tests = mutate.tests_for(rel)
        assert tests and all((ROOT / t).exists() for t in tests), rel


def test_list_writes_nothing(capsys):
    target = ROOT / "src" / "posenc" / "rope" / "rerotate.py"
    before = hashlib.sha256(target.read_bytes()).hexdigest()
    assert mutate.main(["--list", "--files", str(target.relative_to(ROOT)), "--max", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("running 5") and len(out) == 6
    assert all(line.startswith("src/posenc/rope/rerotate.py:") for line in out[1:])
    assert hashlib.sha256(target.read_bytes()).hexdigest() == before
