"""Results as tidy rows (CSV and JSON), a Markdown summary, and figures.

Every measured number becomes one row `{"section", "model", "multiple", "length", "metric", "band", "value"}`
(`band` is the L0-wide band index for per-band metrics, else None; `length` is in tokens). Sections:
"scheme" (each trained scheme), "extension" (each zero-shot rule), "finetune" (each method), "train",
"probe" (metric accuracy/exact, `band` = depth in percent), "longrope_factor" (band = frequency index).

    >>> rows = tidy_rows({"schemes": {"alibi": {"train": {"final_loss": 1.5, "seconds": 2.0, "steps": 3},
    ...     "eval": {}, "probe": []}}, "extension": {}, "finetune": {}, "longrope_search": {}})
    >>> [(r["metric"], r["value"]) for r in rows]
    [('final_loss', 1.5), ('seconds', 2.0), ('steps', 3)]
"""

from __future__ import annotations

import csv
import pathlib

__all__ = ["tidy_rows", "write_csv", "write_json", "markdown", "write_plots", "FIELDS"]

FIELDS = ("section", "model", "multiple", "length", "metric", "band", "value")
_SCALARS = ("ppl_all", "ppl_in", "ppl_out", "ref_all", "ref_out", "ratio_out", "ratio_all")
_LISTS = ("bands", "ref_bands", "band_ratios")


def _eval_rows(section: str, model: str, evals: dict) -> list[dict]:
    rows = []
    for m, row in sorted(evals.items()):
        base = dict(section=section, model=model, multiple=m, length=row["length"])
        rows += [dict(base, metric=k, band=None, value=row[k]) for k in _SCALARS if row[k] is not None]
        rows += [dict(base, metric=k[:-1], band=i, value=v) for k in _LISTS for i, v in enumerate(row[k])]
    return rows


def _train_rows(model: str, record: dict) -> list[dict]:
    return [dict(section="train", model=model, multiple=None, length=None, metric=k, band=None, value=record[k])
            for k in ("final_loss", "seconds", "steps") if k in record]


def _probe_rows(section: str, model: str, probe: list[dict]) -> list[dict]:
    return [dict(section="probe", model=f"{section}:{model}", multiple=p["multiple"], length=p["length"], metric=k,
                 band=round(100 * p["depth"]), value=p[k]) for p in probe for k in ("accuracy", "exact", "distance")]


def tidy_rows(results: dict) -> list[dict]:
    """Every measured number of `run_lab`'s results as a flat row (see the module docstring)."""
    rows: list[dict] = []
    for scheme, entry in results["schemes"].items():
        rows += _train_rows(scheme, entry["train"]) + _eval_rows("scheme", scheme, entry["eval"])
        rows += _probe_rows("scheme", scheme, entry["probe"])
    for label, entry in results["extension"].items():
        rows += _eval_rows("extension", label, entry["eval"]) + _probe_rows("extension", label, entry["probe"])
    for method, entry in results["finetune"].items():
        rows += _train_rows(f"finetune:{method}", entry["train"]) + _eval_rows("finetune", method, entry["eval"])
    for label, per_scale in results["longrope_search"].items():
        for m, found in sorted(per_scale.items()):
            base = dict(section="longrope_factor", model=label, multiple=m, length=None)
            rows += [dict(base, metric="factor", band=i, value=v) for i, v in enumerate(found["factors"])]
            rows.append(dict(base, metric="search_ppl", band=None, value=found["ppl"]))
    return rows


def write_csv(rows: list[dict], path: pathlib.Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def write_json(results: dict, predictions: list[dict], path: pathlib.Path) -> None:
    """`{"meta", "measurements": tidy rows, "predictions": rows}` (no losses curve, no tensors)."""
    payload = dict(meta=results["meta"], measurements=tidy_rows(results), predictions=predictions)
    from ..verify.report import dumps  # strict JSON: a diverged run's inf perplexity is "inf", not Infinity

    pathlib.Path(path).write_text(dumps(payload))


def _cell(row: dict) -> str:
    if row["ratio_out"] is None:
        return f"{row['ppl_all']:.3f}"
    return f"{row['ppl_out']:.3f} (x{row['ratio_out']:.2f}) [{row['ppl_all']:.3f}]"


def _table(title: str, entries: dict, multiples) -> list[str]:
    head = ["| model | " + " | ".join(f"{m}x" for m in multiples) + " |", "|---" * (len(multiples) + 1) + "|"]
    body = [f"| {name} | " + " | ".join(_cell(e["eval"][m]) if m in e["eval"] else "-" for m in multiples) + " |"
            for name, e in entries.items()]
    return [f"### {title}", "", *head, *body, ""]


def markdown(results: dict, predictions: list[dict]) -> str:
    """A Markdown summary: tables of perplexities, in-range damage, probe accuracy, and predictions."""
    meta, cfg = results["meta"], results["meta"]["config"]
    multiples = cfg["lengths"]
    lines = ["# posenc lab results", "",
             f"Corpus {meta['corpus']['name']} ({meta['corpus']['source']}, sha256 {meta['corpus']['sha256'][:16]}..., "
             f"Python {meta['python']}); L0 = {cfg['l0']}, d = {cfg['hidden_size']}, {cfg['num_layers']} layers, "
             f"{cfg['steps']} steps x {cfg['batch_size']} windows; torch {meta['torch']}, {meta['threads']} threads; "
             f"total {meta['timings'].get('total', 0):.0f} s.", "",
             "Cells: ppl on positions >= L0 (ratio to the same tokens with <= L0 context) [ppl over all positions]; "
             "1x: ppl over the window.", ""]
    lines += _table("Schemes", results["schemes"], multiples)
    if results["extension"]:
        lines += _table("Zero-shot RoPE extension", results["extension"], multiples)
        lines += ["ppl on positions < L0 (in-range damage) per rule: ", ""]
        lines += [f"- {label}: " + ", ".join(f"{m}x {e['eval'][m]['ppl_in']:.3f}" for m in multiples if m in e["eval"])
                  for label, e in results["extension"].items()] + [""]
    if results["finetune"]:
        lines += _table("Fine-tuned at 2 L0 (static s = 2 during tuning and evaluation)", results["finetune"], multiples)
    probes = {f"{k}": e["probe"] for k, e in results["schemes"].items() if e["probe"]}
    if probes:
        depths = sorted({p["depth"] for rows in probes.values() for p in rows})
        lines += ["### Retrieval probe (accuracy on the copied letters, by depth of the earlier copy)", "",
                  "| model | length | " + " | ".join(f"depth {d:g}" for d in depths) + " |",
                  "|---|---" + "|---" * len(depths) + "|"]
        for name, rows in probes.items():
            for m in multiples:
                at = {p["depth"]: p["accuracy"] for p in rows if p["multiple"] == m}
                lines.append(f"| {name} | {m}x | " + " | ".join(f"{at[d]:.2f}" if d in at else "-" for d in depths) + " |")
        lines.append("")
    lines += ["### Predictions", "", "| prediction | kind | measured | threshold | result | detail |", "|---|---|---|---|---|---|"]
    for p in predictions:
        measured = "-" if p["measured"] is None else f"{p['measured']:.4g}"
        result = {True: "pass", False: "FAIL" if p["kind"] == "hard" else "miss", None: "-"}[p["passed"]]
        lines.append(f"| {p['name']} | {p['kind']} | {measured} | {p['threshold'] or '-'} | {result} | {p['detail']} |")
    return "\n".join(lines) + "\n"


def write_plots(results: dict, out_dir: pathlib.Path) -> list[pathlib.Path]:
    """ppl_vs_length.png, extension_rules.png and retrieval_depth.png (matplotlib, imported here)."""
    from .figures import draw_all

    return draw_all(results, pathlib.Path(out_dir))
