"""`posenc lab` refuses what it cannot finish before it trains: no matplotlib, a folder as the JSON path; strict JSON
on divergence."""

import sys


def test_lab_without_matplotlib_is_refused_before_training(monkeypatch, tmp_path, capsys):
    import posenc.lab.run as lab_run
    from posenc.cli import main

    def no_training(*args, **kwargs):
        raise AssertionError("the lab trained before checking its extras")
    monkeypatch.setattr(lab_run, "run_lab", no_training)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert main(["lab", "--quick", "--steps", "1", "--out", str(tmp_path / "lab")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "--no-plots" in err and "Traceback" not in err


def test_lab_refuses_a_json_path_that_is_a_folder_before_training(monkeypatch, tmp_path, capsys):
    import posenc.lab.run as lab_run
    from posenc.cli import main

    def no_training(*args, **kwargs):
        raise AssertionError("the lab trained before checking --json")
    monkeypatch.setattr(lab_run, "run_lab", no_training)
    (tmp_path / "folder").mkdir()
    assert main(["lab", "--quick", "--no-plots", "--out", str(tmp_path / "o"), "--json", str(tmp_path / "folder")]) == 2
    assert "--json: expected a file path to write (not a folder)" in capsys.readouterr().err


def test_lab_json_is_strict_json_when_a_run_diverges(monkeypatch, tmp_path):
    import json

    import posenc.lab.report as report

    rows = [{"section": "eval", "model": "rope", "value": float("inf")}, {"value": float("nan")}]
    monkeypatch.setattr(report, "tidy_rows", lambda results: rows)
    report.write_json({"meta": {"schemes": ("rope",)}}, [{"name": "p", "measured": float("-inf")}], tmp_path / "r.json")

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    data = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert [r["value"] for r in data["measurements"]] == ["inf", "nan"] and data["predictions"][0]["measured"] == "-inf"
    assert data["meta"]["schemes"] == ["rope"]
