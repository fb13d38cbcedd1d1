"""Every figure renders headless (Agg) to a non-blank PNG; the RoPE score bound against a loop oracle."""

import cmath
import math

import pytest
import torch

pytest.importorskip("matplotlib")

from conftest import assert_close  # noqa: E402
from posenc.cli import main  # noqa: E402
from posenc.plots import score_bound  # noqa: E402

CASES = [
    ("sinusoidal", []),
    ("wavelengths", ["llama-3.1-8b", "qwen2.5-7b-instruct-yarn", "phi-3.5-mini-instruct"]),
    ("decay", ["llama-2-7b", "gemma-3-4b"]),
    ("alibi", ["--heads", "12"]),
    ("t5", []),
    ("compare", ["llama-2-7b", "llama-3.1-8b", "deepseek-v3", "gpt2"]),
]


def check_png(path, min_h=250, min_w=500):
    from matplotlib.image import imread

    pixels = imread(path)  # [h, w, 4] float in [0, 1]
    assert pixels.shape[0] >= min_h and pixels.shape[1] >= min_w, pixels.shape
    rgb = pixels[..., :3]
    assert rgb.std() > 0.05  # not blank
    assert (rgb.mean(-1) < 0.5).mean() > 0.005  # some dark ink: text, axes, lines


@pytest.mark.parametrize("kind, extra", CASES)
def test_plot_renders_png(tmp_path, capsys, kind, extra):
    out = tmp_path / f"{kind}.png"
    assert main(["plot", kind, *extra, "-o", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    check_png(out)


def test_svg(tmp_path):
    out = tmp_path / "sub" / "t5.svg"
    assert main(["plot", "t5", "-o", str(out), "--length", "300"]) == 0
    text = out.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text


@pytest.mark.parametrize("argv, message", [
    (["plot", "wavelengths", "gpt2", "-o", "x.png"], "a RoPE model"),
    (["plot", "wavelengths", "-o", "x.png"], "at least one"),
    (["plot", "alibi", "-o", "x.pdf"], ".png or .svg"),
    (["plot", "alibi", "--heads", "0", "-o", "x.png"], "--heads"),
])
def test_plot_bad_input(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("pairs, base", [(64, 10000.0), (5, 500000.0)])
def test_score_bound_matches_loop(pairs, base):
    inv = torch.tensor([base ** (-2 * i / (2 * pairs)) for i in range(pairs)], dtype=torch.float64)
    distances = torch.tensor([0, 1, 7, 100, 4097])
    expected = []
    for m in distances.tolist():
        partial, total = 0j, 0.0
        for theta in inv.tolist():
            partial += cmath.exp(1j * m * theta)
            total += abs(partial)
        expected.append(total / pairs)
    assert_close(score_bound(inv, distances), torch.tensor(expected, dtype=torch.float64))
    assert score_bound(inv, torch.tensor([0]))[0] == pytest.approx((pairs + 1) / 2)
    assert math.isclose(expected[0], (pairs + 1) / 2)
