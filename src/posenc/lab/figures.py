"""The lab's figures (matplotlib, imported by `draw_all` only; the Agg backend, no display needed).

- `ppl_vs_length.png`: per scheme, ppl on positions >= L0 over its in-window control, and ppl over all
  positions, against the evaluation length; a third panel shows the per-band ratios at the longest length.
- `extension_rules.png`: the zero-shot rules (and fine-tuned models) side by side: ratio beyond L0 and
  in-range ppl against length.
- `retrieval_depth.png`: probe accuracy against the depth of the earlier copy, one panel per length.
"""

from __future__ import annotations

import pathlib

__all__ = ["draw_all"]


def _lines(ax, entries: dict, key: str, multiples, style="-o") -> None:
    for name, entry in entries.items():
        xs = [m for m in multiples if m in entry["eval"] and entry["eval"][m][key] is not None]
        if xs:
            ax.plot(xs, [entry["eval"][m][key] for m in xs], style, label=name, markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(multiples), [f"{m}x" for m in multiples])
    ax.set_xlabel("evaluation length / L0")
    ax.grid(alpha=0.3)


def _label(ax, ylabel: str, title: str, unit_line: bool = False) -> None:
    if unit_line:  # ratio panels: 1 = no damage
        ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel(ylabel)
    ax.set_title(title)


def _save(plt, fig, path: pathlib.Path, paths: list) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)


def draw_all(results: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Write the three figures into `out_dir`; returns their paths (only those with data)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    multiples = results["meta"]["config"]["lengths"]
    far = [m for m in multiples if m > 1]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    _lines(axes[0], results["schemes"], "ratio_out", far)
    _label(axes[0], "ppl(pos >= L0) / in-window control", "extrapolation damage", unit_line=True)
    _lines(axes[1], results["schemes"], "ppl_all", multiples)
    _label(axes[1], "ppl over all positions", "non-overlapping perplexity")
    if far:
        for name, entry in results["schemes"].items():
            ratios = entry["eval"][far[-1]]["band_ratios"]
            axes[2].plot(range(len(ratios)), ratios, "-o", label=name, markersize=3)
        _label(axes[2], "band ppl / control", "per-band ratio", unit_line=True)
        axes[2].set_xlabel(f"band of L0 positions (at {far[-1]}x)")
        axes[2].grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    _save(plt, fig, out_dir / "ppl_vs_length.png", paths)

    if results["extension"]:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        for ax in axes:  # up to ~12 rules and fine-tuned models: 20 distinct colours
            ax.set_prop_cycle(color=matplotlib.colormaps["tab20"].colors)
        _lines(axes[0], results["extension"], "ratio_out", far)
        if results["finetune"]:
            _lines(axes[0], {f"FT {k}": v for k, v in results["finetune"].items()}, "ratio_out", far, style="--s")
        _label(axes[0], "ppl(pos >= L0) / un-scaled in-window control", "zero-shot rules (dashed: fine-tuned at 2 L0)",
               unit_line=True)
        _lines(axes[1], results["extension"], "ppl_in", multiples)
        _label(axes[1], "ppl on positions < L0", "in-range damage (rule configured for the length)")
        axes[0].legend(fontsize=7)
        _save(plt, fig, out_dir / "extension_rules.png", paths)

    probes = {k: e["probe"] for k, e in results["schemes"].items() if e["probe"]}
    if probes:
        fig, axes = plt.subplots(1, len(multiples), figsize=(3.6 * len(multiples), 3.6), sharey=True, squeeze=False)
        for ax, m in zip(axes[0], multiples):
            for name, rows in probes.items():
                at = sorted((p["depth"], p["accuracy"]) for p in rows if p["multiple"] == m)
                ax.plot([d for d, _ in at], [a for _, a in at], "-o", label=name, markersize=4)
            ax.axhline(1 / 26, color="grey", ls=":", lw=0.8)  # chance: a random lowercase letter
            ax.set_title(f"length {m}x L0")
            ax.set_xlabel("depth of the earlier copy (0 = start)")
            ax.set_ylim(-0.02, 1.02)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("copy accuracy")
        axes[0][0].legend(fontsize=7)
        _save(plt, fig, out_dir / "retrieval_depth.png", paths)
    return paths
