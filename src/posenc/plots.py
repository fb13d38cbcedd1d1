"""Figures of positional encodings (matplotlib, imported lazily; renders headless through the Agg canvas).

Each `*_figure` function returns a `matplotlib.figure.Figure` (titled, axes labelled with units) built on
its own Agg canvas, so no global pyplot state or display is touched; `build(kind, models, ...)` makes the
figure of `posenc plot` and `render(kind, models, output, ...)` saves it to PNG or SVG. Curves of several
models carry a marker each (so identical curves stay visible) and legends sit beside the axes.

    >>> fig = alibi_figure(heads=4, length=16)
    >>> fig.axes[0].get_title()
    'ALiBi bias per head, query at position 15'
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import torch

from . import inspection as ins
from .errors import Raw, fail, integer

PLOT_KINDS = ("sinusoidal", "wavelengths", "decay", "alibi", "t5", "compare")

__all__ = ["sinusoidal_figure", "wavelength_figure", "decay_figure", "alibi_figure", "t5_figure", "compare_figure",
           "render", "build", "score_bound", "PLOT_KINDS"]


MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")  # one per model, so curves that coincide stay visible
LINESTYLES = ("-", "--", "-.", ":")
FONT = 11  # points, for axis labels and titles at the saved size


def _figure(rows: int, cols: int = 1, height: float = 3.4, width: float = 8.0) -> Any:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height * rows), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, [ax for row in axes for ax in row]


def _style(ax: Any, title: str, xlabel: str, ylabel: str, **props: Any) -> None:
    """Title and axis labels at a readable size, and the other axes properties."""
    ax.set(**props)
    ax.set_title(title, fontsize=FONT + 1)
    ax.set_xlabel(xlabel, fontsize=FONT)
    ax.set_ylabel(ylabel, fontsize=FONT)
    ax.tick_params(labelsize=FONT - 1)


def _legend_outside(ax: Any, ncols: int = 1) -> None:
    """The legend beside the axes (right), never over the curves."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize="small", ncols=ncols)


def _model_style(k: int) -> dict[str, Any]:
    """Color, marker (at an offset per model) and dash of the k-th model, so identical curves do not hide each other."""
    return {"color": f"C{k % 10}", "marker": MARKERS[k % len(MARKERS)], "markevery": (0.015 * (k % 8), 0.12),
            "markersize": 6, "markerfacecolor": "none", "ls": LINESTYLES[k % len(LINESTYLES)]}


def _reports(models: Sequence[str], *, rope_only: bool = True) -> list[tuple[str, dict[str, Any]]]:
    """`[(short name, inspect report)]`; refuses an empty list, and non-RoPE models (all of them if not `rope_only`)."""
    if not models:
        fail("MODEL", "at least one preset name or config path", Raw("none"))
    out = [(Path(model).stem if model.endswith(".json") else model, ins.inspect_source(model)) for model in models]
    others = [f"{name!r} ({report['scheme']})" for name, report in out if not report["rope"]]
    if others and (rope_only or len(others) == len(out)):
        fail("MODEL", "a RoPE model for this figure" if rope_only else "at least one RoPE model among the models",
             Raw(", ".join(others)))
    return out


def _scheme_facts(models: Sequence[str], scheme: str) -> dict[str, Any] | None:
    """The scheme facts of the one model given (None for no model); refuses more models or another scheme."""
    if not models:
        return None
    if len(models) > 1:
        fail("MODEL", f"at most one {scheme} model for this figure", Raw(" ".join(models)))
    report = ins.inspect_source(models[0])
    if report["scheme"] != scheme:
        fail("MODEL", f"a model whose position scheme is {scheme}", Raw(f"{models[0]!r} ({report['scheme']})"))
    return report["scheme_facts"]


def _label(name: str, rope: dict[str, Any], report: dict[str, Any]) -> str:
    return name if len(report["rope"]) == 1 else f"{name} ({rope['layers'].removesuffix(' layers')})"


def sinusoidal_figure(dim: int = 128, length: int = 256, channels: Sequence[int] = (0, 21, 40, 64, 97)) -> Any:
    """Heatmap of the sinusoidal table `[length, dim]` and a few of its channels against position."""
    from .absolute import sinusoidal_table

    table = sinusoidal_table(torch.arange(length), dim)  # [length, dim], sin on even, cos on odd channels
    fig, (heat, lines) = _figure(2)
    image = heat.imshow(table.T.numpy(), aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, origin="lower")
    fig.colorbar(image, ax=heat, label="value")
    _style(heat, f"Sinusoidal position table (dim {dim}, base 10000)", "position (tokens)",
           "channel (even: sin, odd: cos)")
    for c in [c for c in channels if c < dim]:
        lines.plot(table[:, c].numpy(), label=f"channel {c}")
    _style(lines, "Selected channels", "position (tokens)", "value")
    _legend_outside(lines)
    return fig


def wavelength_figure(models: Sequence[str]) -> Any:
    """RoPE wavelength per rotation pair, unscaled and scaled, against L0 and L1; below, the stretch per pair."""
    fig, (top, bottom) = _figure(2, width=10.0)
    k = 0
    for name, report in _reports(models):
        for rope in report["rope"]:
            style = _model_style(k)
            k += 1
            label = _label(name, rope, report)
            pairs = range(len(rope["wavelength"]))
            top.plot(pairs, rope["wavelength"], **{**style, "ls": "--", "lw": 1.0}, label=f"{label}: unscaled")
            top.plot(pairs, rope["scaled_wavelength"], **{**style, "ls": "-"}, label=f"{label}: {rope['scaling']} at L1")
            top.axhline(rope["l0"], color=style["color"], lw=0.8, ls=":")
            top.axhline(rope["l1"], color=style["color"], lw=0.8, ls="-.")
            bottom.plot(pairs, rope["stretch"], **{**style, "ls": "-"}, label=f"{label}: scaled / unscaled")
            if "yarn_ramp" in rope:
                factor = rope["scaling_params"]["factor"]
                ramp = [1 + (factor - 1) * r for r in rope["yarn_ramp"]]
                bottom.plot(pairs, ramp, ":", color=style["color"], label=f"{label}: YaRN ramp, 1 + (factor - 1) ramp")
    _style(top, "RoPE wavelengths (dotted: L0, dash-dot: L1)", "rotation pair i", "wavelength (tokens)", yscale="log")
    _style(bottom, "What the scaling does to each pair", "rotation pair i", "wavelength stretch (x)", yscale="log")
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator  # lazy, like every matplotlib import here

    top_stretch = max(max(line.get_ydata()) for line in bottom.get_lines())
    ticks = [v for v in (1, 1.5, 2, 3, 4, 6, 8, 16, 32, 64, 128) if v <= top_stretch * 1.05]
    bottom.yaxis.set_major_locator(FixedLocator(ticks))
    bottom.yaxis.set_minor_locator(NullLocator())
    bottom.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
    _legend_outside(top)
    _legend_outside(bottom)
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
    fig, (ax,) = _figure(1, height=4.0, width=10.0)
    k = 0
    for name, report in _reports(models):
        for rope in report["rope"]:
            inv = torch.tensor([2 * math.pi / w for w in rope["scaled_wavelength"]], dtype=torch.float64)
            far = max_distance or 2 * rope["l1"]
            distances = torch.unique(torch.logspace(0, math.log10(far), 600).round().long())  # [n]
            bound = score_bound(inv, distances) / ((len(inv) + 1) / 2)  # [n] relative to the bound at distance 0
            style = {**_model_style(k), "ls": "-", "markevery": (15 * k, 60)}  # noisy curve: markers by index
            ax.plot(distances.numpy(), bound.numpy(), label=_label(name, rope, report), lw=1, **style)
            k += 1
    _style(ax, "Long-range decay of the RoPE score bound (RoFormer 3.4.3)", "relative distance (tokens)",
           "relative upper bound (1 at distance 0)", xscale="log")
    _legend_outside(ax)
    return fig


def alibi_figure(heads: int = 8, length: int = 64, name: str = "") -> Any:
    """ALiBi: the bias each head adds against distance, and the bias map of the first and last head."""
    from matplotlib import colormaps
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    from .bias import alibi_bias

    positions = torch.arange(length)
    last = alibi_bias(heads, positions[-1:], positions)[:, 0]  # [h, t] the last query against every key
    fig, axes = _figure(1, 3, height=3.8, width=15)
    colors = colormaps["viridis"]
    for h in range(heads):
        axes[0].plot((length - 1 - positions).numpy(), last[h].numpy(), color=colors(h / max(heads - 1, 1)),
                     label=f"head {h}" if heads <= 8 else None)
    _style(axes[0], f"ALiBi bias per head{f' ({name})' if name else ''}, query at position {length - 1}",
           "distance q - k (tokens)", "bias added to the score")
    if heads <= 8:
        _legend_outside(axes[0])
    else:  # a legend of many heads would cover the lines: a colour bar names them instead
        fig.colorbar(ScalarMappable(Normalize(0, heads - 1), colors), ax=axes[0], label=f"head (of {heads})")
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    for ax, h in zip(axes[1:], (0, heads - 1)):
        bias = alibi_bias(heads, positions, positions, rank=h, world_size=heads)[0]  # [t, t] this head only
        image = ax.imshow(bias.masked_fill(~mask, float("nan")).numpy(), cmap="viridis")
        fig.colorbar(image, ax=ax, label="bias")
        _style(ax, f"head {h} bias (causal part)", "key position", "query position")
    return fig


def t5_figure(num_buckets: int = 32, max_distance: int = 128, length: int | None = None, name: str = "") -> Any:
    """T5 relative-position buckets against relative position, bidirectional (encoder) and causal (decoder)."""
    from .bias import t5_relative_position_bucket

    span = length or 2 * max_distance
    relative = torch.arange(-span, span + 1)  # [2 span + 1] key - query
    fig, (ax,) = _figure(1, height=4.0, width=10.0)
    for bidirectional, kind, ls in ((True, "bidirectional (encoder)", "-"), (False, "causal (decoder)", "--")):
        buckets = t5_relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
        ax.step(relative.numpy(), buckets.numpy(), where="mid", label=kind, ls=ls)
    for x in (-max_distance, max_distance):
        ax.axvline(x, color="grey", lw=0.8, ls=":")
    _style(ax, f"T5 relative position buckets{f' of {name}' if name else ''} ({num_buckets} buckets,"
           f" max_distance {max_distance} dotted)", "relative position k - q (tokens)", "bucket index")
    _legend_outside(ax)
    return fig


def compare_figure(models: Sequence[str]) -> Any:
    """Several models side by side: scaled wavelengths per relative channel, and fp16 KV cache per request."""
    fig, (waves, memory) = _figure(1, 2, height=4.6, width=15)
    k = 0
    for m, (name, report) in enumerate(_reports(models, rope_only=False)):
        for n, rope in enumerate(report["rope"]):  # a model's colour in both panels; its second RoPE filled, dashed
            style = {**_model_style(m), "markevery": (0.015 * (k % 8), 0.12)}
            if n:
                style.update(ls=LINESTYLES[(m + n) % len(LINESTYLES)], markerfacecolor=style["color"])
            half = len(rope["scaled_wavelength"])
            waves.plot([i / half for i in range(half)], rope["scaled_wavelength"], **style,
                       label=_label(name, rope, report))
            k += 1
        kv = ins.kv_cache_facts(ins.load_config(models[m])[0])
        if kv.layers:
            lengths = [2**p for p in range(10, 21)]  # 1k .. 1M tokens
            style = {**_model_style(m), "markevery": 1}
            memory.plot(lengths, [ins.kv_bytes(kv, n, "fp16") / ins.GIB for n in lengths], **style, label=name)
            if report["l1"]:
                memory.axvline(report["l1"], color=style["color"], lw=0.8, ls=":")
    _style(waves, "RoPE wavelengths at the target length", "rotation pair / (r/2)", "wavelength (tokens)",
           yscale="log")
    _style(memory, "KV cache per request, fp16 (dotted: max positions)", "sequence length (tokens)", "memory (GiB)",
           xscale="log", yscale="log")
    _legend_outside(waves)
    _legend_outside(memory)
    return fig


LIMITS = {"sinusoidal": 65536, "alibi": 4096, "t5": 2**20, "decay": ins.MAX_TOKENS}  # --length: what a figure can hold


def render(kind: str, models: Sequence[str], output: str | Path, *, length: int | None = None, dim: int | None = None,
           heads: int | None = None) -> Path:
    """Draw one figure (see `build`) and save it, the format from the suffix: .png or .svg.

    Returns:
        The path written.
    Raises:
        PosencError: a suffix other than .png or .svg, and whatever `build` refuses (before any file is written).
    """
    path = Path(output)
    if path.suffix.lower() not in (".png", ".svg"):
        fail("--output", "a file name ending in .png or .svg", str(output))
    fig = build(kind, models, length=length, dim=dim, heads=heads)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def build(kind: str, models: Sequence[str], *, length: int | None = None, dim: int | None = None,
          heads: int | None = None) -> Any:
    """One figure of `posenc plot`, as a matplotlib `Figure`.

    Args:
        kind: "sinusoidal", "wavelengths", "decay", "alibi", "t5" or "compare".
        models: presets or config paths: one or more (wavelengths, decay, compare: at least one RoPE model),
            at most one ALiBi model (alibi: its head count) or T5 model (t5: its buckets and max distance).
        length: positions (sinusoidal, alibi), distance span (t5) or largest distance (decay); at most `LIMITS[kind]`.
        dim: sinusoidal table width (default 128). heads: ALiBi heads without a model (default 8).
    Returns:
        The figure.
    Raises:
        PosencError: unknown kind, missing, extra or unsuitable models, bad or unused sizes.
    """
    if kind not in PLOT_KINDS:
        fail("KIND", f"one of {PLOT_KINDS}", kind)
    limits = {"--length": LIMITS.get(kind), "--dim": 8192, "--heads": 1024}
    for arg, value, used in (("--length", length, kind in LIMITS), ("--dim", dim, kind == "sinusoidal"),
                             ("--heads", heads, kind == "alibi")):
        if value is None:
            continue
        if not used:
            fail(arg, f"nothing for the {kind} figure (it does not use {arg})", value)
        integer(arg, value, min=1, max=limits[arg], what=f"a positive integer <= {limits[arg]} for the {kind} figure")
    if kind == "sinusoidal":
        if models:
            fail("MODEL", "no model for the sinusoidal figure (it draws the table of --dim)", Raw(" ".join(models)))
        fig = sinusoidal_figure(dim or 128, length or 256)
    elif kind == "alibi":
        facts = _scheme_facts(models, "alibi")
        if facts and heads is not None and heads != facts["heads"]:
            fail("--heads", f"{facts['heads']} (the heads of {models[0]}) or nothing", heads)
        fig = alibi_figure(facts["heads"] if facts else heads or 8, length or 64, models[0] if facts else "")
    elif kind == "t5":
        facts = _scheme_facts(models, "t5") or {"num_buckets": 32, "max_distance": 128}
        fig = t5_figure(facts["num_buckets"], facts["max_distance"], length, models[0] if models else "")
    elif kind == "wavelengths":
        fig = wavelength_figure(models)
    elif kind == "decay":
        fig = decay_figure(models, length)
    else:
        fig = compare_figure(models)
    return fig
