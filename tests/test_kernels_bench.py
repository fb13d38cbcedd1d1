"""`posenc bench`: tidy CSV rows with the floors of the same run, a summary and a plot read from the CSV."""

import csv
import sys

import pytest
import torch

from posenc import bench
from posenc.cli import main


def test_bench_rows_summary_and_plot(tmp_path, monkeypatch):
    monkeypatch.setitem(bench.SHAPES, "tiny 2x3x5x128 @40", (2, 3, 3, 5, 128, 40))
    rows, notes = bench.run(["tiny 2x3x5x128 @40", "decode 32x32x1x128 @4095"], [torch.float32], rounds=1,
                            quick=True, progress=lambda _: None)
    names = {r["provider"] for r in rows}
    assert {"copy_ (floor)", "clone (floor)", "posenc apply_", "posenc apply", "posenc reference"} <= names
    for r in rows:
        assert set(r) == set(bench.FIELDS)
        assert r["p20_ms"] <= r["p50_ms"] <= r["p80_ms"]
        if r["provider"] == "copy_ (floor)":
            assert r["x_copy"] == 1.0
    assert {r["peak_extra_mib"] for r in rows if r["provider"] == "posenc apply_"} == {0.0}  # in place: no temporary
    path = tmp_path / "rows.csv"
    bench.write_csv(rows, path)
    with open(path) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    text = bench.summary(rows, notes)
    assert "## decode 32x32x1x128 @4095, float32" in text and "| posenc apply_ | yes |" in text
    pytest.importorskip("matplotlib")
    assert bench.plot(path, tmp_path / "rows.png").stat().st_size > 0


def test_bench_cli_rejects_unknown_shapes(capsys):
    assert main(["bench", "--shapes", "huge"]) == 2
    assert "--shapes: expected names from" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["absent", "torch mismatch"])
def test_bench_skips_ipex_cleanly_when_it_does_not_import(case, tmp_path, monkeypatch):
    if case == "absent":
        monkeypatch.setitem(sys.modules, "intel_extension_for_pytorch", None)  # import raises ImportError
        expected = "intel-extension-for-pytorch: not installed"
    else:  # IPEX 2.8's own reaction to a torch it was not built for: it calls os.exit (AttributeError)
        (tmp_path / "intel_extension_for_pytorch").mkdir()
        (tmp_path / "intel_extension_for_pytorch" / "__init__.py").write_text("import os\nos.exit(127)\n")
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, "intel_extension_for_pytorch", raising=False)
        expected = f"intel-extension-for-pytorch: not importable with torch {torch.__version__} (AttributeError)"
    found, notes = bench.providers(quick=True)
    assert not [p for p in found if p.name.startswith("ipex")]
    assert any(n.startswith(expected) for n in notes)
