"""`posenc bench`: tidy CSV rows with the floors of the same run, a summary and a plot read from the CSV."""

import csv
import math
import sys

import pytest
import torch

from posenc.bench import harness as bench
from posenc.cli import main


def test_bench_rows_summary_and_plot(tmp_path, monkeypatch):
    monkeypatch.setitem(bench.SHAPES, "tiny 2x3x5x128 @40", (2, 3, 3, 5, 128, 40))
    rows, notes = bench.run(["tiny 2x3x5x128 @40", "decode 32x32x1x128 @4095"], [torch.float32], rounds=1,
                            quick=True, progress=lambda _: None)
    names = {r["provider"] for r in rows}
    assert {"copy_ (floor)", "clone (floor)", "posenc apply_ (held table)", "posenc apply (held table)",
            "posenc apply_ (no table)", "posenc apply (no table)", "posenc reference"} <= names
    for r in rows:
        assert set(r) == set(bench.FIELDS)
        assert r["p20_ms"] <= r["p50_ms"] <= r["p80_ms"]
        if r["provider"] == "copy_ (floor)":
            assert r["x_copy"] == 1.0
    assert {r["peak_extra_mib"] for r in rows if r["provider"] == "posenc apply_ (held table)"} == {0.0}  # in place: no temporary
    for r in rows:  # every rotation checked once against the float64 oracle; floors are not rotations
        if "floor" in r["provider"]:
            assert math.isnan(r["max_abs_err"])
        elif r["provider"].startswith(("posenc", "transformers", "complex")):
            assert r["max_abs_err"] < 2e-6, r  # float32 tables and arithmetic at values ~N(0, 1)
    path = tmp_path / "rows.csv"
    bench.write_csv(rows, path)
    with open(path) as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    text = bench.summary(rows, notes)
    assert "## decode 32x32x1x128 @4095, float32" in text and "| posenc apply_ (held table) | yes |" in text
    pytest.importorskip("matplotlib")
    assert bench.plot(path, tmp_path / "rows.png").stat().st_size > 0


def test_peak_memory_counts_each_allocation_once():
    q, k = torch.randn(1, 4, 512, 128), torch.randn(1, 2, 512, 128)  # 1 MiB and 0.5 MiB
    assert bench._peak_extra_mib(lambda: (q.clone(), k.clone())) == 1.5


@pytest.mark.parametrize("pairing", ["split_half", "interleaved"])
def test_bench_oracle_is_the_2x2_rotation(pairing):
    # the yardstick of the error column, against explicit 2x2 rotation matrices pair by pair
    g = torch.Generator().manual_seed(3)
    x, pos = torch.randn(2, 3, 5, 8, generator=g), torch.tensor([[0], [7]]).expand(2, 5) + torch.arange(5)
    got = bench.oracle(x, pos, pairing)  # [b, h, t, d]
    inv = 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8))
    for b in range(2):
        for t in range(5):
            for i in range(4):
                theta = float(torch.tensor(float(pos[b, t])) * inv[i])  # the float32 angle
                rot = torch.tensor([[math.cos(theta), -math.sin(theta)], [math.sin(theta), math.cos(theta)]],
                                   dtype=torch.float64)
                j = (i, i + 4) if pairing == "split_half" else (2 * i, 2 * i + 1)
                pair = x[b, :, t, list(j)].double()  # [h, 2]
                assert torch.allclose(got[b, :, t, list(j)], pair @ rot.T, rtol=0, atol=1e-12)


@pytest.mark.parametrize("shapes", ["huge", "", "decode,,prefill", " "])
def test_bench_cli_rejects_unknown_shapes(capsys, shapes):
    assert main(["bench", "--shapes", shapes]) == 2
    assert "--shapes: expected names from" in capsys.readouterr().err


@pytest.mark.parametrize("rounds", ["0", "-1"])
def test_bench_cli_rejects_rounds_below_one(capsys, tmp_path, rounds):
    assert main(["bench", "--quick", "--shapes", "decode", "--rounds", rounds, "--out", str(tmp_path)]) == 2
    assert f"--rounds: expected a positive integer, got {rounds}" in capsys.readouterr().err
    assert not (tmp_path / "rope_bench.csv").exists()


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


def test_bench_header_says_which_cpu_kernel_runs(tmp_path, monkeypatch):
    from posenc.kernels import build

    monkeypatch.setitem(bench.SHAPES, "tiny 2x3x5x128 @40", (2, 3, 3, 5, 128, 40))
    argv = ["bench", "--quick", "--shapes", "tiny", "--rounds", "1", "--dtypes", "float32", "--no-plot"]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    assert f"- {build.describe()}" in (tmp_path / "rope_bench.md").read_text().splitlines()
