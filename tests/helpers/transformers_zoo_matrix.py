"""Writes the patch matrix of docs/transformers.md from `tests.helpers.transformers_zoo.conformance` (the function
tests/integrations/transformers/test_patch_conformance.py asserts on), one row per causal-LM model type.

    PYTHONPATH=src python3 -m tests.helpers.transformers_zoo_matrix [--types a,b,c] [model_type ...]

The table goes between the markers `<!-- patch-matrix:start -->` and `<!-- patch-matrix:end -->`. With no types,
every causal-LM type is run and the block rewritten; `--types a,b,c` re-runs only those and replaces their rows
(and the header's counts) in the block on the page, keeping the others; model types named without `--types` are
run and printed only (`--update` writes them as `--types` does).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tests.helpers.transformers_zoo import CHECKS, causal_lm_types, conformance

DOC = Path(__file__).resolve().parents[2] / "docs" / "transformers.md"
RULE_CHECKS = ("linear", "yarn", "llama3", "longrope", "dynamic recompute", "static + recompute")
START, END = "<!-- patch-matrix:start -->", "<!-- patch-matrix:end -->"


def row(model_type: str, result: dict[str, str]) -> str:
    if "not built" in result:
        return f"| `{model_type}` | not built | transformers at the tiny sizes: {_cell(result['not built'])} |"
    if "refused" in result:
        return f"| `{model_type}` | refused | {_cell(result['refused'])} |"
    notes = [f"{k}: {v}" for k, v in result.items() if v not in ("ok", "refused at start")]
    skipped = [k for k, v in result.items() if v.startswith("n/a")]
    # a rule patch() refuses for this family before anything runs (its structural reason in the note)
    refused = [k for k, v in result.items() if v.startswith("refused: ") and k in RULE_CHECKS]
    verdict = ("differs" if len(skipped) + len(refused) < len(notes) else "identical, a rule refused" if refused
               else "identical (some n/a)" if skipped else "identical")
    return f"| `{model_type}` | {verdict} | {_cell('; '.join(notes)) or 'every check'} |"


def _cell(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")[:300]


def table(rows: list[str]) -> str:
    counts: dict[str, int] = {}
    for line in rows:
        kind = line.split("|")[2].strip()
        counts[kind] = counts.get(kind, 0) + 1
    head = (f"{len(rows)} causal-LM model types; " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))
            + f". Checks: {', '.join(CHECKS)} (\"longrope\": where the family's config class has it; \"static + "
            "recompute\": every static-cache step within 1e-4 of a fresh full forward). \"identical (some n/a)\": every check that runs is identical; "
            "\"identical, a rule refused\": likewise, and patch() refuses a rule for the family before anything runs "
            "(the structural reason in the notes); "
            "the notes say why the others do not apply to the family (its config class refuses the rule, or "
            "transformers itself fails on it).\n\n"
            "| model type | patched | notes |\n|---|---|---|")
    return "\n".join([head, *rows])


def page_rows(page: str) -> dict[str, str]:
    """`{model type: row}` of the matrix on the page."""
    section = page.split(START, 1)[1].split(END, 1)[0]
    return {line.split("`")[1]: line for line in section.splitlines() if line.startswith("| `")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("named", nargs="*", metavar="model_type", help="model types to run and print only")
    parser.add_argument("--types", help="comma-separated model types: re-run them and replace their rows on the page")
    parser.add_argument("--update", action="store_true", help="with model types named: replace their rows on the page")
    args = parser.parse_args(argv)
    named = [*args.named, *(t for t in (args.types or "").split(",") if t.strip())]
    named = [t.strip() for t in named]
    update = bool(args.types) or args.update
    known = set(causal_lm_types())
    unknown = [t for t in named if t not in known]
    if unknown:
        parser.error(f"not causal-LM model types of this transformers: {', '.join(unknown)}")
    types = named or sorted(known)
    results = {}
    for i, model_type in enumerate(types, 1):
        results[model_type] = conformance(model_type)
        print(f"[{i}/{len(types)}] {row(model_type, results[model_type])[:160]}", file=sys.stderr, flush=True)
    rows = {t: row(t, r) for t, r in results.items()}
    if named and not update:
        print(table(list(rows.values())))
        return 0
    page = DOC.read_text()
    if named:
        rows = {**page_rows(page), **rows}
    before, rest = page.split(START, 1)
    _, after = rest.split(END, 1)
    DOC.write_text(f"{before}{START}\n{table([rows[t] for t in sorted(rows)])}\n{END}{after}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
