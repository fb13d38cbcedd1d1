"""The report: a printed table, Markdown, a self-contained HTML page (inline SVG plots), and JSON.

    >>> from posenc.verify.checks.common import Row
    >>> print(render_table([Row("multimodal", True, {"violations": 0}, {"violations": "== 0"}, "ok")]))
    row         status  measured       threshold
    multimodal  pass    violations=0   violations == 0
"""

from __future__ import annotations

import html
import io
import json
import math
import numbers
from pathlib import Path
from typing import Any

from .checks.common import Row, fmt

__all__ = ["render_table", "render_selftest", "side_by_side", "to_json", "markdown", "html_page", "write_report"]


def _value(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return fmt(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    return str(v)


def headline(row: Row, limit: int = 4) -> str:
    """The row's first few scalar measurements, `name=value`."""
    items = [(k, v) for k, v in row.measured.items() if not isinstance(v, dict)][:limit]
    return ", ".join(f"{k}={_value(v)}" for k, v in items) if items else (row.skipped or "")


def _align(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def render_table(rows: list[Row]) -> str:
    """Aligned plain text: row, status, headline numbers, thresholds."""
    lines = [["row", "status", "measured", "threshold"]]
    for r in rows:
        thresholds = "; ".join(f"{k} {v}" for k, v in r.thresholds.items()) or (r.skipped or "")
        lines.append([r.name, r.status, headline(r) + " ", thresholds])
    return _align(lines)


def side_by_side(left: list[Row], right: list[Row], names: tuple[str, str] = ("transformers", "transformers+patch")) -> str:
    """Aligned plain text: each row's status and headline for two engines (`verify --patch`)."""
    lines = [["row", names[0], "", names[1], ""]]
    for a, b in zip(left, right):
        lines.append([a.name, a.status, headline(a, 2) + " ", b.status, headline(b, 2)])
    return _align(lines)


_CONTEXT = {"nll", "tokens", "L0", "L1", "nll_default", "invariants_checked", "shifts", "llama_cpp", "reference_nll"}


def evidence(measured: dict[str, Any], limit: int = 2) -> str:
    """The faulty row's telling numbers (context such as token counts left out)."""
    items = [(k, v) for k, v in measured.items() if k not in _CONTEXT and not isinstance(v, dict)][:limit]
    return ", ".join(f"{k}={_value(v)}" for k, v in items)


def render_selftest(table: list[dict[str, Any]]) -> str:
    lines = [["fault injected", "row", "clean", "faulty", "caught", "evidence"]]
    for e in table:
        lines.append([e["fault"], e["row"], e["clean"], e["faulty"], "yes" if e["caught"] else "NO",
                      evidence(e["measured"])])
    return _align(lines)


def to_json(rows: list[Row], meta: dict[str, Any], selftest: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The report as plain JSON values: non-finite numbers become the strings "nan", "inf", "-inf"
    (`float()` reads them back), anything else that is not JSON its `str`."""
    return strict({"schema": "posenc.verify/1", "meta": meta, "passed": all(r.passed is not False for r in rows),
                   "rows": [r.to_json() for r in rows], "self_test": selftest})


def strict(value: Any) -> Any:
    """`value` with every float that strict JSON refuses (NaN, +-Infinity) as a string, tuples as lists."""
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)  # "nan", "inf", "-inf"
    if isinstance(value, dict):
        return {str(k): strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return [strict(v) for v in sorted(value, key=str)]
    if isinstance(value, numbers.Real):  # NumPy and torch scalars
        return strict(float(value))
    return str(value)


def dumps(data: Any) -> str:
    """Strict JSON text (`allow_nan=False`: a non-finite number that slipped through raises, never writes NaN)."""
    return json.dumps(strict(data), indent=1, allow_nan=False)


def markdown(rows: list[Row], meta: dict[str, Any], selftest: list[dict[str, Any]] | None = None) -> str:
    out = [f"# posenc verify: {meta.get('engine')} on {meta.get('model')}", "",
           f"Budget `{meta.get('budget')}`, dtype {meta.get('dtype')}, {meta.get('wall_seconds', 0):.0f} s wall. "
           f"Text: {meta.get('text', {}).get('source')} ({meta.get('text', {}).get('chars', '-')} chars, sha256 "
           f"`{meta.get('text', {}).get('sha256', '-')}`).", "",
           "| row | status | measured | threshold | why |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        th = "; ".join(f"{k} {v}" for k, v in r.thresholds.items()) or (r.skipped or "")
        out.append(f"| {r.name} | **{r.status}** | {headline(r, 6)} | {th} | {r.explanation} |")
    if selftest:
        out += ["", "## Self-test: each fault injected into posenc's engine", "",
                "| fault | row | clean | faulty | caught | evidence |", "| --- | --- | --- | --- | --- | --- |"]
        out += [f"| {e['fault']} ({e['what']}) | {e['row']} | {e['clean']} | {e['faulty']} | "
                f"{'yes' if e['caught'] else '**NO**'} | {evidence(e['measured'], 3)} |" for e in selftest]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- plots (matplotlib, inline SVG)
def _svg(fig: Any) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight", metadata={"Date": None})
    import matplotlib.pyplot as plt

    plt.close(fig)
    text = buf.getvalue()
    return text[text.find("<svg"):]


def _smooth(values: list[float], k: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= k:
            acc -= values[i - k]
        out.append(acc / min(i + 1, k))
    return out


def plots(rows: list[Row]) -> dict[str, str]:
    """Title -> inline SVG; empty when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    by = {r.name: r for r in rows}
    figs: dict[str, str] = {}
    lb = by.get("length-boundaries")
    if lb is not None and lb.details.get("nll_curves"):
        fig, ax = plt.subplots(figsize=(7, 3.2))
        curves = lb.details["nll_curves"]
        k = max(4, len(curves["default"]) // 32)
        for name, values in curves.items():
            ax.plot(range(1, len(values) + 1), _smooth(values, k), label=name, lw=1.2)
        ax.axvline(lb.measured["L0"], color="k", ls="--", lw=0.8)
        ax.set_xlabel("position"), ax.set_ylabel(f"next-token NLL (mean of {k})"), ax.legend(fontsize=7, ncol=3)
        figs["Loss vs position per rule (dashed: L0)"] = _svg(fig)
    ps = by.get("position-scan")
    if ps is not None and ps.details.get("copy"):
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for kind, marker in (("passkey", "o"), ("copy", "s")):
            for length, cells in ps.details[kind].items():
                ax.plot([float(d.strip("%")) for d in cells], list(cells.values()), marker=marker,
                        label=f"{kind} {length}")
        ax.set_xlabel("depth (%)"), ax.set_ylabel("accuracy"), ax.set_ylim(-0.05, 1.05), ax.legend(fontsize=7)
        figs["Retrieval vs depth"] = _svg(fig)
    pd = by.get("prefill-decode")
    if pd is not None and pd.details.get("per_rule"):
        fig, ax = plt.subplots(figsize=(7, 3.2))
        for name, entry in pd.details["per_rule"].items():
            steps = entry["derived"]["per_step"]
            ax.semilogy(range(len(steps)), [max(s, 1e-9) for s in steps], marker=".", label=name)
        ax.axhline(float(pd.thresholds["max_abs_logit_diff"].split()[1]), color="r", ls="--", lw=0.8)
        ax.set_xlabel("decode step"), ax.set_ylabel("max |logit diff| vs full forward"), ax.legend(fontsize=7)
        figs["Logit differences: cached decode vs full forward (red: threshold)"] = _svg(fig)
    return figs


_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#222}
table{border-collapse:collapse;width:100%;font-size:14px}td,th{border-bottom:1px solid #ddd;padding:6px;
text-align:left;vertical-align:top}.pass{color:#fff;background:#2a8a3a}.FAIL{color:#fff;background:#c0302a}
.skipped{background:#ccc}.badge{padding:2px 8px;border-radius:4px;font-weight:bold}figure{margin:1.5em 0}
small{color:#666}code{font-size:12px}"""


def html_page(rows: list[Row], meta: dict[str, Any], selftest: list[dict[str, Any]] | None = None) -> str:
    """One self-contained page: summary, the table, plots (inline SVG), self-test, the raw JSON."""
    e = html.escape
    passed = sum(r.passed is True for r in rows)
    failed = sum(r.passed is False for r in rows)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>posenc verify</title><style>{_CSS}</style>"
             f"</head><body><h1>posenc verify: {e(str(meta.get('engine')))}</h1>",
             f"<p>{e(str(meta.get('model')))} &middot; budget {e(str(meta.get('budget')))} &middot; "
             f"{meta.get('wall_seconds', 0):.0f} s &middot; <b>{passed} pass, {failed} fail</b></p>",
             "<table id='rows'><tr><th>row</th><th>status</th><th>measured</th><th>threshold</th><th>why</th></tr>"]
    for r in rows:
        th = "; ".join(f"{k} {v}" for k, v in r.thresholds.items()) or (r.skipped or "")
        parts.append(f"<tr><td><b>{e(r.name)}</b></td><td><span class='badge {r.status}'>{r.status}</span></td>"
                     f"<td><code>{e(headline(r, 8))}</code></td><td>{e(th)}</td><td>{e(r.explanation)}</td></tr>")
    parts.append("</table>")
    for title, svg in plots(rows).items():
        parts.append(f"<figure><figcaption><b>{e(title)}</b></figcaption>{svg}</figure>")
    if selftest:
        parts.append("<h2>Self-test: faults injected into posenc's engine</h2><table id='selftest'><tr><th>fault"
                     "</th><th>row</th><th>clean</th><th>faulty</th><th>caught</th><th>evidence</th></tr>")
        for t in selftest:
            parts.append(f"<tr><td>{e(t['fault'])}<br><small>{e(t['what'])}</small></td><td>{e(t['row'])}</td>"
                         f"<td><span class='badge {t['clean']}'>{t['clean']}</span></td><td><span class='badge "
                         f"{t['faulty']}'>{t['faulty']}</span></td><td>{'yes' if t['caught'] else 'NO'}</td>"
                         f"<td><code>{e(evidence(t['measured'], 3))}</code></td></tr>")
        parts.append("</table>")
    text = meta.get("text", {})
    parts.append(f"<p><small>Text: {e(str(text.get('source')))}, {e(str(text.get('chars', '-')))} chars, sha256 "
                 f"{e(str(text.get('sha256', '-')))}.</small></p>")
    parts.append("<details><summary>raw JSON</summary><pre>" + e(dumps(to_json(rows, meta, selftest)))
                 + "</pre></details>")
    return "\n".join(parts) + "</body></html>\n"


def write_report(folder: str | Path, rows: list[Row], meta: dict[str, Any],
                 selftest: list[dict[str, Any]] | None = None, json_file: str | Path | None = None) -> Path:
    """Write report.md, report.html and report.json into `folder` (and the JSON to `json_file` too)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = dumps(to_json(rows, meta, selftest))
    (folder / "report.json").write_text(data)
    (folder / "report.md").write_text(markdown(rows, meta, selftest))
    (folder / "report.html").write_text(html_page(rows, meta, selftest))
    if json_file:
        Path(json_file).write_text(data)
    return folder
