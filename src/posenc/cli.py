"""The `posenc` command: `posenc inspect MODEL_OR_CONFIG` and `posenc plot KIND [MODEL...]`.

    >>> main(["inspect", "llama-2-7b", "--lengths", "4k", "--dtypes", "fp16", "--bands", "2"])  # doctest: +ELLIPSIS
    llama-2-7b: meta-llama/Llama-2-7b-hf (preset llama-2-7b)
    ...
    4k      4096    2 GB / 2 GB
      per token: 512 KiB in fp16 = 2 (K and V) x 32 layers x 32 KV heads x 128 dims x 2 bytes (MHA)
    0

`main(argv)` returns the exit code (0, or 2 for bad input with the message on stderr); plain aligned text
when stdout is not a terminal, rich tables when it is and `rich` is installed, JSON with `--json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from .errors import PosencError
from . import inspection as ins

__all__ = ["main", "build_parser", "render_inspect"]

PLOT_KINDS = ("sinusoidal", "wavelengths", "decay", "alibi", "t5", "compare")


def _num(x: float) -> str:
    """Compact: 3 significant digits, whole numbers in full (6.28, 652, 54410, 1.9e+06)."""
    if x >= 1e6:
        return f"{x:.3g}"
    if x >= 100 or x == int(x):
        return f"{x:.0f}"
    return f"{x:.3g}"


def _gib(n_bytes: float) -> str:
    gib = n_bytes / ins.GIB
    return f"{gib:.0f}" if gib == int(gib) or gib >= 100 else f"{gib:.3g}"


def _span(values: list[float]) -> str:
    first, last = _num(values[0]), _num(values[-1])
    return first if first == last else f"{first}..{last}"


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, start = [], None
    for k, i in enumerate(indices):
        start = i if start is None else start
        if k + 1 == len(indices) or indices[k + 1] != i + 1:
            out.append(str(start) if start == i else f"{start}-{i}")
            start = None
    return ", ".join(out) or "none"


def _rope_blocks(rope: dict[str, Any], bands: int) -> list[tuple]:
    pairs = rope["rotary_dim"] // 2
    l0, l1, scaled = rope["l0"], rope["l1"], rope["scaling"] != "default"
    params = ", ".join(f"{k}={v}" for k, v in rope["scaling_params"].items() if v is not None)
    lines = [
        f"RoPE ({rope['layers']})",
        f"  head_dim {rope['head_dim']}, rotary_dim {rope['rotary_dim']} ({pairs} rotation pairs), pairing {rope['pairing']}"
        + (f", M-RoPE sections {rope['mrope_section']}" if rope["mrope_section"] else ""),
        f"  base (rope_theta) {rope['base']:g}",
        f"  scaling {rope['scaling']}" + (f": {params}" if params else " (none)"),
        f"  attention factor {rope['attention_factor']:.6g} (multiplies cos and sin, so the rotary logits by its square)"
        + (f"; {rope['attention_factor_at_l1']:.6g} at L1" if rope["attention_factor_at_l1"] != rope["attention_factor"] else ""),
        f"  lengths: L0 = {l0} (original), L1 = {l1} (target)",
    ]
    if rope["softmax_scale_factor"] != 1.0:
        lines.append(f"  softmax scale multiplied by {rope['softmax_scale_factor']:.6g} (DeepSeek YaRN mscale_all_dim)")
    bands = max(1, min(bands, pairs))
    edges = [round(k * pairs / bands) for k in range(bands + 1)]
    rows = []
    for a, b in zip(edges, edges[1:]):
        rows.append([f"{a}-{b - 1}" if b - 1 > a else str(a), _span(rope["wavelength"][a:b]), _span(rope["turns_l0"][a:b]),
                     _span(rope["scaled_wavelength"][a:b]), _span(rope["turns_l1"][a:b]),
                     _span([round(s, 4) for s in rope["stretch"][a:b]])])
    long0 = [i for i, w in enumerate(rope["wavelength"]) if w > l0]
    notes = [f"{len(long0)} of {pairs} pairs ({_ranges(long0)}) have wavelengths beyond L0 = {l0}:"
             " less than one full turn in training"]
    if scaled:
        long1 = [i for i, w in enumerate(rope["scaled_wavelength"]) if w > l1]
        kept = [i for i, s in enumerate(rope["stretch"]) if abs(s - 1) < 1e-4]
        changed = [i for i, s in enumerate(rope["stretch"]) if abs(s - 1) >= 1e-4]
        notes.append(f"scaled: {len(long1)} of {pairs} pairs ({_ranges(long1)}) have wavelengths beyond L1 = {l1}")
        stretch = f"{min(rope['stretch']):.4g}" + ("" if max(rope["stretch"]) == min(rope["stretch"])
                                                    else f"..{max(rope['stretch']):.4g}")
        notes.append(("scaling stretches every pair" if not kept else f"scaling keeps pairs {_ranges(kept)}"
                      f" and stretches pairs {_ranges(changed)}") + f" (wavelength x {stretch})")
        if "yarn_correction_range" in rope:
            low, high = rope["yarn_correction_range"]
            notes.append(f"YaRN ramp from pair {low:g} (extrapolate) to {high:g} (interpolate by the factor)")
    headers = ["pairs", "wavelength", f"turns in L0={l0}", "scaled wavelength", f"turns in L1={l1}", "stretch"]
    title = "Frequency bands (wavelength = 2*pi/inv_freq in tokens; turns = length / wavelength)"
    return [("lines", lines), ("table", title, headers, rows, notes)]


def _kv_block(report: dict[str, Any]) -> tuple:
    kv = report["kv_cache"]
    if kv["kind"] == "none":
        return ("lines", ["KV cache: none"] + [f"  {n}" for n in kv["notes"]])
    dtypes, batch = kv["dtypes"], kv["batch"]
    first = dtypes[0]
    per_token = kv["bytes_per_token"][first]
    if kv["kind"] == "mla":
        how = f"{kv['layers']} layers x {kv['elements_per_token_per_layer']} (latent + rope key)"
    else:
        how = f"2 (K and V) x {kv['layers']} layers x {kv['kv_heads']} KV heads x {kv['head_dim']} dims"
    size = f"{per_token / 1024:.4g} KiB" if per_token >= 1024 else f"{per_token:g} bytes"
    notes = [f"per token: {size} in {first} = {how} x {ins.DTYPE_BYTES[first]:g} bytes ({kv['kind'].upper()})"]
    notes += list(kv["notes"])
    if "int4" in dtypes:
        notes.append("int4 counts 0.5 byte per number, without quantisation scales")
    rows, beyond = [], False
    for n in sorted({r["tokens"] for r in kv["rows"]}, key=[r["tokens"] for r in kv["rows"]].index):
        cells = {r["dtype"]: r for r in kv["rows"] if r["tokens"] == n}
        mark = "*" if report["l1"] and n > report["l1"] else ""
        beyond = beyond or bool(mark)
        rows.append([ins.length_label(n) + mark, str(n)]
                    + [f"{_gib(cells[d]['bytes_per_request'])} GB / {_gib(cells[d]['bytes_per_batch'])} GB" for d in dtypes])
    if beyond:
        notes.append(f"* beyond the model's declared maximum of {report['l1']} positions")
    for d, tokens in kv.get("max_tokens", {}).items():
        label = "" if tokens is None or ins.length_label(tokens) == str(tokens) else f" ({ins.length_label(tokens)})"
        fits = "any length (every layer is windowed)" if tokens is None else f"{tokens} tokens{label}"
        notes.append(f"{kv['memory_gib']:g} GB holds, in {d} at batch {batch}: {fits} per request")
    # "GB" as the seed table writes it, meaning 2**30 bytes (GiB): said in the title so nobody guesses
    title = f"KV cache (GB = 2**30 bytes, i.e. GiB): per request / per batch of {batch}"
    return ("table", title, ["length", "tokens"] + dtypes, rows, notes)


def inspect_blocks(report: dict[str, Any], bands: int = 8) -> list[tuple]:
    """The report as blocks: `("lines", [str])` or `("table", title, headers, rows, notes)`."""
    head = [f"{report['source'].removeprefix('preset ')}: {report['model']}" + (
        f" (preset {report['source'].removeprefix('preset ')})" if report["source"].startswith("preset ") else ""),
        f"model_type {report['model_type']}, position scheme {report['scheme']}"]
    blocks: list[tuple] = [("lines", head)]
    for rope in report["rope"]:
        blocks += _rope_blocks(rope, bands)
    if report["scheme_facts"]:
        facts = report["scheme_facts"]
        blocks.append(("lines", [facts["summary"]] + [f"  {k} {v}" for k, v in facts.items() if k != "summary"]))
    blocks.append(_kv_block(report))
    return blocks


def render_inspect(report: dict[str, Any], bands: int = 8) -> str:
    """Plain aligned text of `inspect_blocks` (what a non-terminal gets)."""
    out: list[str] = []
    for block in inspect_blocks(report, bands):
        if block[0] == "lines":
            out += block[1] + [""]
            continue
        _, title, headers, rows, notes = block
        widths = [max(len(str(r[c])) for r in [headers] + rows) for c in range(len(headers))]
        out.append(title)
        for r in [headers] + rows:
            out.append("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
        out += [f"  {n}" for n in notes] + [""]
    return "\n".join(out).rstrip() + "\n"


def _print_rich(report: dict[str, Any], bands: int) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    for block in inspect_blocks(report, bands):
        if block[0] == "lines":
            console.print(block[1][0], style="bold")
            for line in block[1][1:]:
                console.print(line, highlight=False)
            continue
        _, title, headers, rows, notes = block
        table = Table(title=title, title_justify="left")
        for h in headers:
            table.add_column(h, justify="left" if h in ("pairs", "length") else "right", no_wrap=True)
        for r in rows:
            table.add_row(*r)
        console.print(table)
        for n in notes:
            console.print(f"  {n}", highlight=False)


def _inspect(args: argparse.Namespace) -> int:
    cfg, source = ins.load_config(args.model)
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    lengths = ins.parse_lengths(args.lengths) if args.lengths else None
    try:
        report = ins.inspect_model(cfg, lengths=lengths, batch=args.batch, dtypes=dtypes, source=source,
                                   memory_gib=args.memory)
    except PosencError as e:
        raise PosencError(f"cannot inspect {source}: {e}") from None
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.format == "rich" or (args.format == "auto" and sys.stdout.isatty() and _has_rich()):
        _print_rich(report, args.bands)
    else:
        sys.stdout.write(render_inspect(report, args.bands))
    return 0


def _has_rich() -> bool:
    from importlib.util import find_spec

    return find_spec("rich") is not None


def _plot(args: argparse.Namespace) -> int:
    from . import plots

    path = plots.render(args.kind, args.models, args.output, length=args.length, dim=args.dim, heads=args.heads)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `posenc` (subcommands inspect and plot)."""
    parser = argparse.ArgumentParser(prog="posenc", description="Positional encodings of transformer checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="print a model's positional encoding and KV-cache memory",
                       description="Print the position scheme of a checkpoint config: head and rotary widths, pairing,"
                       " base, scaling rule and attention factor; per frequency band the wavelength and the full turns"
                       " within the original length L0 and the target length L1; the KV-cache memory per request and"
                       " per batch (GB = 2**30 bytes, i.e. GiB, as the seed table counts).",
                       epilog=f"bundled presets: {', '.join(ins.preset_names())}")
    p.add_argument("model", metavar="MODEL_OR_CONFIG", help="config.json, a directory holding one, or a preset name")
    p.add_argument("--lengths", help="KV-cache lengths, e.g. 4k,32k,128k (k = 1024; default: L0 and L1)")
    p.add_argument("--batch", type=int, default=1, help="requests per batch for the KV-cache table (default 1)")
    p.add_argument("--dtypes", default="fp16,bf16,fp8,int4", help=f"cache element types from {', '.join(ins.DTYPE_BYTES)}"
                   " (default fp16,bf16,fp8,int4)")
    p.add_argument("--memory", type=float, metavar="GIB", help="a KV-cache budget in GB (2**30 bytes): print the longest request that fits")
    p.add_argument("--bands", type=int, default=8, help="frequency bands to group the rotation pairs into (default 8)")
    p.add_argument("--json", action="store_true", help="print every fact as JSON (per-pair lists included)")
    p.add_argument("--format", choices=("auto", "plain", "rich"), default="auto",
                   help="auto: rich tables on a terminal when rich is installed, plain text otherwise")
    p.set_defaults(run=_inspect)
    q = sub.add_parser("plot", help="draw a figure (PNG or SVG) with matplotlib",
                       description="Figures: sinusoidal (table heatmap and channels), wavelengths (RoPE wavelengths"
                       " against L0 and L1 with the scaling's stretch and ramp), decay (RoPE score bound vs distance),"
                       " alibi (bias per head), t5 (buckets vs relative position), compare (several models side by side).",
                       epilog="example: posenc plot wavelengths llama-3.1-8b -o wavelengths.png")
    q.add_argument("kind", choices=PLOT_KINDS, help="which figure")
    q.add_argument("models", nargs="*", metavar="MODEL", help="presets or config paths (wavelengths, decay, compare)")
    q.add_argument("-o", "--output", required=True, help="output file, .png or .svg")
    q.add_argument("--length", type=int, help="positions or distances to draw (per figure default)")
    q.add_argument("--dim", type=int, default=128, help="model width for the sinusoidal table (default 128)")
    q.add_argument("--heads", type=int, default=8, help="heads for the alibi and t5 figures (default 8)")
    q.set_defaults(run=_plot)
    from .bench import add_parser as add_bench  # `posenc bench`: its own module

    add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 with a message on stderr for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except PosencError as e:
        print(f"posenc {args.command}: error: {e}", file=sys.stderr)
        return 2
