"""Figures of positional encodings (matplotlib, imported lazily; renders headless through the Agg canvas).

Each `*_figure` function returns a `matplotlib.figure.Figure` (titled, axes labelled with units) built on
its own Agg canvas, so no global pyplot state or display is touched; `render(kind, ...)` saves one to
PNG or SVG (what `posenc plot` calls).

    >>> fig = alibi_figure(heads=4, length=16)
    >>> fig.axes[0].get_title()
    'ALiBi bias per head (query at position 15)'
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch

from . import inspection as ins
from .errors import fail

__all__ = ["sinusoidal_figure", "wavelength_figure", "decay_figure", "alibi_figure", "t5_figure", "compare_figure",
           "render", "score_bound"]


def _figure(rows: int, cols: int = 1, height: float = 3.4, width: float = 8.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _reports(models: Sequence[str]) -> list[tuple[str, dict[str, Any]]]:
    if not models:
        fail("MODEL", "at least one preset name or config path", "none")
    out = []
    for model in models:
        cfg, source = ins.load_config(model)
        report = ins.inspect_model(cfg, source=source)
        if not report["rope"]:
            fail("MODEL", "a RoPE model for this figure", f"{model!r} ({report['scheme']})")
        out.append((Path(model).stem if model.endswith(".json") else model, report))
    return out


def _label(name: str, rope: dict[str, Any], report: dict[str, Any]) -> str:
    return name if len(report["rope"]) == 1 else f"{name} ({rope['layers'].removesuffix(' layers')})"


def sinusoidal_figure(dim: int = 128, length: int = 256, channels: Sequence[int] = (0, 21, 40, 64, 97)) -> Any:
    """Heatmap of the sinusoidal table `[length, dim]` and a few of its channels against position."""
    from .absolute import sinusoidal_table

    table = sinusoidal_table(torch.arange(length), dim)  # [length, dim], sin on even, cos on odd channels
    fig, (heat, lines) = _figure(2)
    image = heat.imshow(table.T.numpy(), aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, origin="lower")
    fig.colorbar(image, ax=heat, label="value")
    heat.set(title=f"Sinusoidal position table (dim {dim}, base 10000)", xlabel="position (tokens)",
             ylabel="channel (even: sin, odd: cos)")
    for c in [c for c in channels if c < dim]:
        lines.plot(table[:, c].numpy(), label=f"channel {c}")
    lines.set(title="Selected channels", xlabel="position (tokens)", ylabel="value")
    lines.legend(loc="upper right", fontsize="small", ncols=2)
    return fig


def wavelength_figure(models: Sequence[str]) -> Any:
    """RoPE wavelength per rotation pair, unscaled and scaled, against L0 and L1; below, the stretch per pair."""
    fig, (top, bottom) = _figure(2)
    for k, (name, report) in enumerate(_reports(models)):
        for rope in report["rope"]:
            color = f"C{k}" if len(report["rope"]) == 1 else None
            label = _label(name, rope, report)
            pairs = range(len(rope["wavelength"]))
            top.plot(pairs, rope["wavelength"], "--", color=color, label=f"{label}: unscaled")
            line, = top.plot(pairs, rope["scaled_wavelength"], color=color, label=f"{label}: {rope['scaling']} at L1")
            top.axhline(rope["l0"], color=line.get_color(), lw=0.8, ls=":")
            top.axhline(rope["l1"], color=line.get_color(), lw=0.8, ls="-.")
            bottom.plot(pairs, rope["stretch"], color=line.get_color(), label=f"{label}: scaled / unscaled")
            if "yarn_ramp" in rope:
                factor = rope["scaling_params"]["factor"]
                ramp = [1 + (factor - 1) * r for r in rope["yarn_ramp"]]
                bottom.plot(pairs, ramp, ":", color=line.get_color(), label=f"{label}: YaRN ramp as 1 + (factor - 1) ramp")
    top.set(yscale="log", title="RoPE wavelengths (dotted: L0, dash-dot: L1)", xlabel="rotation pair i",
            ylabel="wavelength (tokens)")
    bottom.set(yscale="log", title="What the scaling does to each pair", xlabel="rotation pair i",
               ylabel="wavelength stretch (x)")
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # lazy, like every matplotlib import here

    top_stretch = max(max(line.get_ydata()) for line in bottom.get_lines())
    ticks = [v for v in (1, 1.5, 2, 3, 4, 6, 8, 16, 32, 64, 128) if v <= top_stretch * 1.05]
    bottom.yaxis.set_major_locator(FixedLocator(ticks))
    bottom.yaxis.set_minor_locator(NullLocator())
    bottom.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    top.legend(fontsize="small")
    bottom.legend(fontsize="small")
    return fig


def score_bound(inv_freq: torch.Tensor, distances: torch.Tensor) -> torch.Tensor:
    """RoFormer's relative upper bound of the RoPE score at each distance: `mean_j |sum_{i<=j} e^{i m theta_i}|`.

    At distance 0 every partial sum has modulus j, so the bound is `(r/2 + 1) / 2`; it decays with m.

    Args:
        inv_freq: `[r/2]` inverse frequencies.
        distances: `[n]` relative distances m.
    Returns:
        `[n]` float64 bounds.
    """
    phase = distances.double()[:, None] * inv_freq.double()[None, :]  # [n, r/2]
    partial = torch.polar(torch.ones_like(phase), phase).cumsum(-1)  # [n, r/2] complex128
    return partial.abs().mean(-1)  # [n]


def decay_figure(models: Sequence[str], max_distance: int | None = None) -> Any:
    """The long-range decay of the RoPE score bound with distance, per model (scaled frequencies at L1)."""
    fig, (ax,) = _figure(1, height=4.0)
    for name, report in _reports(models):
        for rope in report["rope"]:
            inv = torch.tensor([2 * math.pi / w for w in rope["scaled_wavelength"]], dtype=torch.float64)
            far = max_distance or 2 * rope["l1"]
            distances = torch.unique(torch.logspace(0, math.log10(far), 600).round().long())  # [n]
            bound = score_bound(inv, distances) / ((len(inv) + 1) / 2)  # [n] relative to the bound at distance 0
            ax.plot(distances.numpy(), bound.numpy(), label=_label(name, rope, report), lw=1)
    ax.set(xscale="log", title="Long-range decay of the RoPE score bound (RoFormer 3.4.3)",
           xlabel="relative distance (tokens)", ylabel="relative upper bound (1 at distance 0)")
    ax.legend(fontsize="small")
    return fig


def alibi_figure(heads: int = 8, length: int = 64) -> Any:
    """ALiBi: the bias each head adds against distance, and the bias map of the first and last head."""
    from .bias import alibi_bias

    positions = torch.arange(length)
    bias = alibi_bias(heads, positions, positions)  # [h, t, t]; causal rows, 0 on the diagonal
    fig, axes = _figure(1, 3, height=3.6, width=13)
    last = bias[:, -1, :]  # [h, t] the last query against every key
    for h in range(heads):
        axes[0].plot((length - 1 - positions).numpy(), last[h].numpy(), label=f"head {h}")
    axes[0].set(title=f"ALiBi bias per head (query at position {length - 1})", xlabel="distance q - k (tokens)",
                ylabel="bias added to the score")
    axes[0].legend(fontsize="x-small", ncols=2)
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    for ax, h in zip(axes[1:], (0, heads - 1)):
        image = ax.imshow(bias[h].masked_fill(~mask, float("nan")).numpy(), cmap="viridis")
        fig.colorbar(image, ax=ax, label="bias")
        ax.set(title=f"head {h} bias (causal part)", xlabel="key position", ylabel="query position")
    return fig


def t5_figure(num_buckets: int = 32, max_distance: int = 128, length: int | None = None) -> Any:
    """T5 relative-position buckets against relative position, bidirectional (encoder) and causal (decoder)."""
    from .bias import t5_relative_position_bucket

    span = length or 2 * max_distance
    relative = torch.arange(-span, span + 1)  # [2 span + 1] key - query
    fig, (ax,) = _figure(1, height=4.0)
    for bidirectional, name in ((True, "bidirectional (encoder)"), (False, "causal (decoder)")):
        buckets = t5_relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
        ax.step(relative.numpy(), buckets.numpy(), where="mid", label=name)
    for x in (-max_distance, max_distance):
        ax.axvline(x, color="grey", lw=0.8, ls=":")
    ax.set(title=f"T5 relative position buckets ({num_buckets} buckets, max_distance {max_distance} dotted)",
           xlabel="relative position k - q (tokens)", ylabel="bucket index")
    ax.legend()
    return fig


def compare_figure(models: Sequence[str]) -> Any:
    """Several models side by side: scaled wavelengths per relative channel, and fp16 KV cache per request."""
    fig, (waves, memory) = _figure(1, 2, height=4.2, width=13)
    for k, model in enumerate(models or fail("MODEL", "at least one preset name or config path", "none")):
        cfg, source = ins.load_config(model)
        report = ins.inspect_model(cfg, source=source)
        for rope in report["rope"]:
            half = len(rope["scaled_wavelength"])
            style = "-" if rope is report["rope"][0] else "--"
            waves.plot([i / half for i in range(half)], rope["scaled_wavelength"], style, color=f"C{k}",
                       label=_label(model, rope, report))
        kv = ins.kv_cache_facts(cfg)
        if kv.layers:
            lengths = [2**p for p in range(10, 21)]  # 1k .. 1M tokens
            memory.plot(lengths, [ins.kv_bytes(kv, n, "fp16") / ins.GIB for n in lengths], marker=".", color=f"C{k}",
                        label=model)
            if report["l1"]:
                memory.axvline(report["l1"], color=f"C{k}", lw=0.8, ls=":")
    waves.set(yscale="log", title="RoPE wavelengths at the target length", xlabel="rotation pair / (r/2)",
              ylabel="wavelength (tokens)")
    memory.set(xscale="log", yscale="log", title="KV cache per request, fp16 (dotted: max positions)",
               xlabel="sequence length (tokens)", ylabel="memory (GiB)")
    waves.legend(fontsize="small")
    memory.legend(fontsize="small")
    return fig


def render(kind: str, models: Sequence[str], output: str | Path, *, length: int | None = None, dim: int = 128,
           heads: int = 8) -> Path:
    """Draw one figure and save it (format from the suffix: .png or .svg).

    Args:
        kind: "sinusoidal", "wavelengths", "decay", "alibi", "t5" or "compare".
        models: presets or config paths (wavelengths, decay, compare).
        output: the file to write.
        length: positions (sinusoidal, alibi), distance span (t5) or largest distance (decay).
        dim: sinusoidal table width. heads: ALiBi heads.
    Returns:
        The path written.
    Raises:
        PosencError: unknown kind or suffix, missing or non-RoPE models, bad sizes.
    """
    path = Path(output)
    if path.suffix.lower() not in (".png", ".svg"):
        fail("--output", "a file name ending in .png or .svg", str(output))
    for arg, value in (("--length", length), ("--dim", dim), ("--heads", heads)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            fail(arg, "a positive integer", value)
    builders = {
        "sinusoidal": lambda: sinusoidal_figure(dim, length or 256),
        "wavelengths": lambda: wavelength_figure(models),
        "decay": lambda: decay_figure(models, length),
        "alibi": lambda: alibi_figure(heads, length or 64),
        "t5": lambda: t5_figure(length=length),
        "compare": lambda: compare_figure(models),
    }
    if kind not in builders:
        fail("KIND", f"one of {tuple(builders)}", kind)
    fig = builders[kind]()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
