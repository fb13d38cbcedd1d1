"""`posenc inspect` as text: the report of `posenc.inspection.inspect_model` as blocks, plain text or rich tables.

Plain text wraps its free lines at 80 columns and its default tables fit in 80 columns; rich tables that
would not fit the terminal are printed as the plain table instead of being cropped.

    >>> from posenc import inspection as ins
    >>> cfg, source = ins.load_config("llama-2-7b")
    >>> text = render_inspect(ins.inspect_model(cfg, source=source, lengths=[8192], dtypes=("fp16",)), bands=2)
    >>> print(text.splitlines()[-4])
    8k*     8192    4 GB
"""

from __future__ import annotations

import textwrap
from typing import Any

from .config import length_label
from .inspect import DTYPE_BYTES, GIB
from ..errors import fail

__all__ = ["inspect_blocks", "render_inspect", "print_rich", "WIDTH"]

WIDTH = 80  # columns the plain text is wrapped to


def _num(x: float) -> str:
    """Compact: 3 significant digits, whole numbers in full below 1e6 (6.28, 652, 54410, 1.9e6)."""
    if x >= 1e6:
        return f"{x:.3g}".replace("e+0", "e").replace("e+", "e")
    if x >= 100 or x == int(x):
        return f"{x:.0f}"
    return f"{x:.3g}"


def _gib(n_bytes: float) -> str:
    gib = n_bytes / GIB
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
        + (f", M-RoPE sections {rope['mrope_section']}" if rope["mrope_section"] else "")
        + (", direction -1 (turns by -theta: scores see n - m)" if rope.get("direction", 1) == -1 else ""),
        f"  base (rope_theta) {rope['base']:g}",
        f"  scaling {rope['scaling']}" + (f": {params}" if params else " (none)"),
        f"  attention factor {rope['attention_factor']:.6g} (multiplies cos and sin, so the rotary logits by its square)"
        + (f"; {rope['attention_factor_at_l1']:.6g} at L1" if rope["attention_factor_at_l1"] != rope["attention_factor"] else ""),
        f"  lengths: L0 = {l0} (original), L1 = {l1} (target)",
    ]
    if rope["softmax_scale_factor"] != 1.0:
        lines.append(f"  softmax scale multiplied by {rope['softmax_scale_factor']:.6g} (DeepSeek YaRN mscale_all_dim)")
    if bands > pairs:
        fail("--bands", f"at most the {pairs} rotation pairs of {rope['layers']}", bands)
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
    headers = ["pairs", "wavelength", "turns in L0", "scaled wl", "turns in L1", "stretch"]
    title = "Frequency bands (wavelength, wl: 2*pi/inv_freq tokens; turns = L / wavelength)"
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
    per_element = kv.get("bytes_per_element", {}).get(first, DTYPE_BYTES.get(first))
    notes = [f"per token: {size} in {first} = {how} x {per_element:.4g} bytes ({kv['kind'].upper()})"]
    notes += list(kv["notes"])
    if "int4" in dtypes:
        notes.append("int4 counts 0.5 byte per number, without quantisation scales")
    if any(":" in d for d in dtypes):  # a posenc quantized cache (--kv-dtype)
        cast = first.split(":")[0] in ("float32", "bfloat16", "float16")
        notes.append(f"{first}: posenc's quantized cache, " + ("a plain cast, no scales" if cast else
                     "codes plus float16 scales (keys " + ("per channel before RoPE in blocks of 64, with a block "
                     "id per token and layer)" if first.endswith(":pre") else "per token after RoPE); values per token")))
    rows, beyond = [], False
    for n in sorted({r["tokens"] for r in kv["rows"]}, key=[r["tokens"] for r in kv["rows"]].index):
        cells = {r["dtype"]: r for r in kv["rows"] if r["tokens"] == n}
        mark = "*" if cells[first]["beyond_max"] else ""
        beyond = beyond or bool(mark)
        rows.append([length_label(n) + mark, str(n)]
                    + [f"{_gib(cells[d]['bytes_per_request'])} GB" + ("" if batch == 1 else f" / {_gib(cells[d]['bytes_per_batch'])} GB")
                       for d in dtypes])
    for d, tokens in kv.get("max_tokens", {}).items():
        label = "" if tokens is None or length_label(tokens) == str(tokens) else f" ({length_label(tokens)})"
        mark = "*" if kv["max_tokens_beyond_max"][d] else ""
        beyond = beyond or bool(mark)
        fits = "any length (every layer is windowed)" if tokens is None else f"{tokens}{mark} tokens{label}"
        notes.append(f"{kv['memory_gib']:g} GB holds, in {d} at batch {batch}: {fits} per request")
    if beyond:
        notes.append(f"* beyond the model's declared maximum of {report['l1']} positions")
    # "GB" as the seed table writes it, meaning 2**30 bytes (GiB): said in the title so nobody guesses
    title = "KV cache (GB = 2**30 bytes, i.e. GiB): " + ("per request" if batch == 1 else f"per request / per batch of {batch}")
    return ("table", title, ["length", "tokens"] + dtypes, rows, notes)


def inspect_blocks(report: dict[str, Any], bands: int = 8) -> list[tuple]:
    """The report as blocks: `("lines", [str])` or `("table", title, headers, rows, notes)`.

    Raises:
        PosencError: `bands` larger than a RoPE's rotation pairs.
    """
    head = [f"{report['source'].removeprefix('preset ')}: {report['model']}" + (
        f" (preset {report['source'].removeprefix('preset ')})" if report["source"].startswith("preset ") else ""),
        f"model_type {report['model_type']}, position scheme {report['scheme']}"]
    blocks: list[tuple] = [("lines", head)]
    for rope in report["rope"]:
        blocks += _rope_blocks(rope, bands)
    if report.get("branches"):
        blocks.append(("lines", ["Branches (tables inside one layer, posenc.hf.branch_ropes)"] + [
            f"  {b['branch']}: head_dim {b['head_dim']}, rotary_dim {b['rotary_dim']}, pairing {b['pairing']}, "
            f"base {b['base']:g}, scaling {b['scaling']}" + (", direction -1" if b["direction"] == -1 else "")
            for b in report["branches"]]))
    if report.get("kv_sharing"):
        pairs = ", ".join(f"{layer} <- {source}" for layer, source in report["kv_sharing"])
        blocks.append(("lines", [f"KV sharing: {len(report['kv_sharing'])} layers reuse an earlier layer's rotated "
                                 "keys and rotate only their queries (posenc.hf.kv_sources)",
                                 f"  layer <- source: {pairs}"]))
    if report["scheme_facts"]:
        facts = report["scheme_facts"]
        blocks.append(("lines", [facts["summary"]] + [f"  {k} {v}" for k, v in facts.items() if k != "summary"]))
    blocks.append(_kv_block(report))
    return blocks


def _wrap(line: str) -> list[str]:
    indent = " " * (len(line) - len(line.lstrip()))
    return textwrap.wrap(line, WIDTH, subsequent_indent=indent + "  ", break_on_hyphens=False) or [""]


def _table_lines(title: str, headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(r[c])) for r in [headers] + rows) for c in range(len(headers))]
    gap = "  " if sum(widths) + 2 * (len(widths) - 1) <= WIDTH else " "  # one space rather than a wrapped row
    return _wrap(title) + [gap.join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip() for r in [headers] + rows]


def render_inspect(report: dict[str, Any], bands: int = 8) -> str:
    """Plain aligned text of `inspect_blocks` (what a non-terminal gets), free text wrapped at `WIDTH` columns."""
    out: list[str] = []
    for block in inspect_blocks(report, bands):
        if block[0] == "lines":
            out += [w for line in block[1] for w in _wrap(line)] + [""]
            continue
        _, title, headers, rows, notes = block
        out += _table_lines(title, headers, rows)
        out += [w for n in notes for w in _wrap(f"  {n}")] + [""]
    return "\n".join(out).rstrip() + "\n"


def print_rich(report: dict[str, Any], bands: int = 8, console: Any = None) -> None:
    """Print the report with rich tables; a table wider than the terminal is printed as plain text instead."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
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
        natural = console.measure(table, options=console.options.update_width(10**6)).maximum
        if natural > console.width:  # rich would crop cells to "..."
            console.print("\n".join(_table_lines(title, headers, rows)), highlight=False, soft_wrap=True)
        else:
            console.print(table)
        for n in notes:
            console.print(f"  {n}", highlight=False)
