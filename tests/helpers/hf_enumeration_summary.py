"""The enumeration's summary in docs/hf.md: written from `hf_enumeration.enumerate_all()`, read back by the test.

Regenerate after a change (and review the diff): `PYTHONPATH=src python3 -m tests.helpers.hf_enumeration_summary`.
"""

from __future__ import annotations

import re

from tests.helpers.hf_enumeration import POSITIONS, Outcome, enumerate_all

BEGIN, END = "<!-- enumeration:begin -->", "<!-- enumeration:end -->"


def summary(outcomes: list[Outcome]) -> str:
    """The markdown block docs/hf.md carries between BEGIN and END (regenerate: PYTHONPATH=src python3 -m tests.helpers.hf_enumeration_summary)."""
    import transformers

    ref = [o for o in outcomes if o.outcome != "no reference"]
    counts = {k: sum(o.outcome == k for o in ref) for k in ("exact", "no rope", "refused", "differs", "crash")}
    lines = [BEGIN, "",
             f"transformers {transformers.__version__}: {len(outcomes)} model types whose modeling file defines a "
             f"`*RotaryEmbedding` class; {len(ref)} of them build a text (or audio) rotary table, or a vision "
             f"tower's axial one, from their config class's defaults. Of those: **{counts['exact']} exact** ({100 * counts['exact'] / max(len(ref), 1):.1f} %), "
             f"{counts['no rope']} with no RoPE layer by posenc's reading, {counts['refused']} refused, {counts['differs']} differ, {counts['crash']} crash "
             f"({sum(o.bitwise for o in ref)} bit-identical). Positions {list(POSITIONS)}, every layer type, "
             "from the `PretrainedConfig` and from its `to_dict()`.", "",
             "| model type | outcome | layer types | detail |", "|---|---|---|---|"]
    for o in outcomes:
        detail = o.detail.replace("|", "\\|").replace("\n", " ")
        if len(detail) > 160:
            detail = detail[:157] + "..."
        types = ", ".join(t for t in o.layer_types if t is not None)
        if o.sub_config:
            detail = f"the table of its {o.sub_config}" + (f"; {detail}" if detail else "")
        mark = o.outcome + (" (bitwise)" if o.bitwise else "")
        lines.append(f"| `{o.model_type}` | {mark} | {types} | {detail} |")
    lines += ["", END]
    return "\n".join(lines)


def parse_summary(text: str) -> dict[str, str]:
    """`{model_type: outcome}` from a summary block (the outcome word, without "(bitwise)")."""
    block = text[text.index(BEGIN):text.index(END)]
    out = {}
    for line in block.splitlines():
        m = re.match(r"\| `([^`]+)` \| ([a-z ]+?)(?: \(bitwise\))? \|", line)
        if m:
            out[m.group(1)] = m.group(2)
    return out


if __name__ == "__main__":
    import sys
    from pathlib import Path

    doc = Path(__file__).resolve().parents[2] / "docs" / "hf.md"
    text = doc.read_text()
    block = summary(enumerate_all())
    if BEGIN in text:
        text = text[:text.index(BEGIN)] + block + text[text.index(END) + len(END):]
    else:
        text = text.rstrip() + "\n\n## Every rotary model type of the pinned transformers\n\n" + block + "\n"
    doc.write_text(text)
    print(block.splitlines()[2], file=sys.stderr)
