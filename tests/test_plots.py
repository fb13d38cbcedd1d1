"""Every figure renders headless (Agg) to a non-blank PNG; the RoPE score bound against a loop oracle."""

import cmath
import json
import math

import pytest
import torch

pytest.importorskip("matplotlib")

from tests.helpers.tolerances import assert_close  # noqa: E402
from posenc.cli import main  # noqa: E402
from posenc import PosencError  # noqa: E402
from posenc import inspection as ins  # noqa: E402
from posenc.plots import build, score_bound  # noqa: E402

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
    (["plot", "wavelengths", "gpt2", "-o", "x.png"], "MODEL: expected a RoPE model for this figure, got 'gpt2'"),
    (["plot", "wavelengths", "-o", "x.png"], "MODEL: expected at least one preset name or config path, got none"),
    (["plot", "alibi", "-o", "x.pdf"], "--output: expected a file name ending in .png or .svg"),
    (["plot", "alibi", "--heads", "0", "-o", "x.png"], "--heads: expected a positive integer, got 0"),
    (["plot", "compare", "gpt2", "bloom-7b1", "-o", "x.png"],
     "MODEL: expected at least one RoPE model among the models, got 'gpt2' (learned_absolute), 'bloom-7b1' (alibi)"),
    (["plot", "alibi", "t5-base", "-o", "x.png"], "MODEL: expected a model whose position scheme is alibi, got 't5-base' (t5)"),
    (["plot", "t5", "bloom-7b1", "-o", "x.png"], "MODEL: expected a model whose position scheme is t5"),
    (["plot", "alibi", "bloom-7b1", "mpt-7b", "-o", "x.png"], "MODEL: expected at most one alibi model"),
    (["plot", "alibi", "bloom-7b1", "--heads", "8", "-o", "x.png"], "--heads: expected 32 (the heads of bloom-7b1) or nothing"),
    (["plot", "sinusoidal", "gpt2", "-o", "x.png"], "MODEL: expected no model for the sinusoidal figure"),
    (["plot", "sinusoidal", "--length", "1000000", "-o", "x.png"], "--length: expected a positive integer <= 65536"),
    (["plot", "alibi", "--length", "1m", "-o", "x.png"], "--length: expected a positive integer <= 4096 for the alibi"),
    (["plot", "alibi", "--length", "", "-o", "x.png"], "--length: expected comma-separated token counts"),
    (["plot", "alibi", "--length", "1k,2k", "-o", "x.png"], "--length: expected one token count"),
    (["plot", "t5", "--dim", "64", "-o", "x.png"], "--dim: expected nothing for the t5 figure"),
    (["plot", "decay", "llama-2-7b", "--heads", "4", "-o", "x.png"], "--heads: expected nothing for the decay figure"),
    (["plot", "sinusoidal", "--dim", "100000", "-o", "x.png"], "--dim: expected a positive integer <= 8192"),
    (["plot", "wavelengths", "no/such/config.json", "-o", "x.png"], "(file not found)"),
])
def test_plot_bad_input(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("posenc plot: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "x.png").exists()


def test_alibi_figure_uses_the_models_heads():
    fig = build("alibi", ["bloom-7b1"])
    assert ins.load_preset("bloom-7b1")["n_head"] == 32
    lines = fig.axes[0].get_lines()
    assert len(lines) == 32  # one line per head of BLOOM, not the 8-head default
    slopes = sorted(-float(line.get_ydata()[0]) / float(line.get_xdata()[0]) for line in lines)  # at distance 63
    assert slopes[0] == pytest.approx(2 ** (-8 * 32 / 32)) and slopes[-1] == pytest.approx(2 ** (-8 / 32))
    assert "bloom-7b1" in fig.axes[0].get_title()
    assert len(build("alibi", [], heads=12).axes[0].get_lines()) == 12


def test_t5_figure_uses_the_models_buckets(tmp_path):
    cfg = {**ins.load_preset("t5-base"), "relative_attention_num_buckets": 16, "relative_attention_max_distance": 64}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (ax,) = build("t5", [str(tmp_path)]).axes
    steps = ax.get_lines()[:2]
    assert max(max(line.get_ydata()) for line in steps) == 15  # 16 buckets: 0..15, not the default 32
    assert sorted(line.get_xdata()[0] for line in ax.get_lines()[2:]) == [-64, 64]  # the max_distance markers
    assert "16 buckets, max_distance 64" in ax.get_title()


def test_length_accepts_k(tmp_path, capsys):
    assert main(["plot", "sinusoidal", "--length", "2k", "--dim", "16", "-o", str(tmp_path / "s.png")]) == 0
    heat = build("sinusoidal", [], length=2048, dim=16).axes[0]
    assert heat.get_images()[0].get_array().shape == (16, 2048)


def overlaps(a, b):
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("kind, models", [
    ("compare", ["llama-2-7b", "mistral-7b-v0.1", "gemma-3-4b", "llama-3.1-8b", "gpt2"]),
    ("wavelengths", ["llama-3.1-8b", "qwen2.5-7b-instruct-yarn"]),
    ("decay", ["llama-2-7b", "mistral-7b-v0.1"]),
    ("t5", []),
    ("sinusoidal", []),
    ("alibi", []),
])
def test_legends_beside_the_curves_and_labels_readable(kind, models):
    fig = build(kind, models)
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None]
    assert legends or kind == "alibi"
    for legend in legends:
        box = legend.get_window_extent(renderer)
        for ax in fig.axes:
            assert not overlaps(box, ax.get_window_extent(renderer)), (kind, ax.get_title())
    for ax in fig.axes:
        for label in (ax.xaxis.label, ax.yaxis.label):
            assert not label.get_text() or label.get_fontsize() >= 10


def test_compare_no_curve_hides_another():
    """llama-2-7b, Mistral and Gemma-3's local layers share base 10000: each curve needs its own marker."""
    fig = build("compare", ["llama-2-7b", "mistral-7b-v0.1", "gemma-3-4b", "llama-3.1-8b"])
    for ax in fig.axes[:2]:
        lines = [line for line in ax.get_lines() if len(line.get_xdata()) > 2]  # curves, not the dotted markers
        looks = {(line.get_color(), line.get_marker(), line.get_linestyle()) for line in lines}
        assert len(looks) == len(lines) >= 4
        assert all(line.get_marker() not in (None, "None", "") for line in lines)
    waves = fig.axes[0].get_lines()
    same = [line for line in waves if line.get_ydata()[0] == pytest.approx(2 * math.pi)]
    assert len(same) >= 3  # the coinciding curves are really there, told apart by markers at offsets
    assert len({str(line.get_markevery()) for line in same}) == len(same)


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


def test_compare_keeps_a_models_colour_in_both_panels():
    waves, memory = build("compare", ["llama-2-7b", "gemma-3-4b", "deepseek-v3"]).axes[:2]
    colours = {line.get_label(): line.get_color() for line in memory.get_lines() if not line.get_label().startswith("_")}
    assert set(colours) == {"llama-2-7b", "gemma-3-4b", "deepseek-v3"}
    for line in waves.get_lines():
        assert line.get_color() == colours[line.get_label().split(" (")[0]], line.get_label()
