"""The papers' predictions, checked on a lab run's results: hard ones gate, soft ones are reported.

Every check returns a row `{"name", "kind", "measured", "threshold", "passed", "detail", "paper"}`:
`kind` is "hard" (a miss means a bug or a failed reproduction), "soft" (orderings the papers themselves
disagree on, or effects that need seeds: `passed` is reported, never gated) or "report" (a number with no
threshold, `passed` None). `measured` is the number compared with `threshold`; `detail` gives the rest.
A check whose inputs were not run (a scheme or rule left out) is skipped.

Hard (paper-anchors.md section 3.3):
1. sinusoidal breaks beyond L0: `ppl_out / ref_out >= 1.5` at 2x (Press et al. T2: 43.54 / 20.05 = x2.17 at ~2x).
2. RoPE degrades (`ratio_out > 1.05` at 2x) and keeps degrading (ratio increasing at every longer length).
3. ALiBi stays within 3 % of its in-window control at every length (`|ratio_out - 1| <= 0.03`).
4. dynamic NTK equals plain RoPE within L0 (`ppl_in` relative difference <= 1e-4 at every length) and
   beats it beyond (`ppl_out` ratio < 1 at every length > L0).
5. zero-shot PI damages in-range perplexity: `ppl_in` with s = 2 at least 5 % above the un-scaled one.
6. every rule coincides at L = L0 (s = 1): `ppl_all` relative spread <= 1e-5.
"""

from __future__ import annotations

from .config import LabConfig

__all__ = ["check_predictions", "hard_failures"]

ANCHORS = {
    "sinusoidal": "Press et al. 2022 T2 (247M, L=512): 20.05 -> 43.54 at 1012 (x2.17), 209.37 at 4512",
    "rope": "Press et al. T2: rotary 20.07 -> 21.37 (~2x, x1.07) -> 39.15 (~9x, x1.95); Kazemnejad T3 (1.3B): breaks past L0",
    "alibi": "Press et al. T2/T5: ALiBi flat or improving to 16x (L=128: 23.98 -> 20.28 at 3072); T15 sliding: 17.98 -> 18.3",
    "dynamic": "Qwen-7B README: dynamic NTK 3.78 at L0 (= RoPE), 3.59 / 3.66 / 5.71 at 2x/4x/8x vs 39.35 / 469.81 / 2645.09",
    "pi": "Chen et al. 2023 T3 (LLaMA-7B): zero-shot PI 16.10 at 4x vs 7.20 at L0; 7.12 after 200 steps",
    "coincide": "identity at s = 1 (every rule's definition)",
    "t5": "Press et al. T2: T5 bias 19.65 -> 18.79 (~2x) -> 25.91 (~9x)",
    "order": "Press et al. T2 at >= 5x: ALiBi < T5 < rotary < sinusoidal",
    "p9": "LongRoPE T1 (zero-shot, LLaMA2-7B): PG19 16k PI 20.49 / dyn-NTK 23.29 / YaRN 87.89; Proof-pile 4.93 / 3.87 / 3.25",
    "longrope": "LongRoPE T1: searched factors 11.34 (PG19 16k) vs PI 20.49 / YaRN 87.89",
    "finetune": "PI T3: 16.10 zero-shot -> 7.12 after 200 steps; YaRN T1 (4k->8k): YaRN 3.35 ~ PI 3.34 < NTK 3.59 at 8k",
    "probe": "Press et al. T15 / Kazemnejad T3: ALiBi does not use far context (recency)",
    "kazemnejad": "Kazemnejad et al. 2023 Fig. 1 (synthetic tasks): NoPE > T5 > ALiBi > rotary > APE",
}


def _row(name, kind, measured, threshold, passed, detail, anchor) -> dict:
    return dict(name=name, kind=kind, measured=measured, threshold=threshold,
                passed=None if passed is None else bool(passed), detail=detail, paper=ANCHORS[anchor])


def _fmt(values) -> str:
    return ", ".join(f"{v:.3f}" for v in values)


def check_predictions(results: dict, cfg: LabConfig) -> list[dict]:
    """All prediction rows for a run (see the module docstring)."""
    rows: list[dict] = []
    schemes, ext, ft = results["schemes"], results["extension"], results["finetune"]
    far = [m for m in cfg.lengths if m > 1]
    if not far:
        return rows

    def ratios(scheme):
        return [schemes[scheme]["eval"][m]["ratio_out"] for m in far]

    if "sinusoidal" in schemes:
        r = ratios("sinusoidal")
        rows.append(_row("sinusoidal_breaks_beyond_L0", "hard", r[0], ">= 1.5", r[0] >= 1.5,
                         f"ppl_out / ref_out at {_fmt_lengths(far)}x: {_fmt(r)}", "sinusoidal"))
    if "learned" in schemes:
        r = ratios("learned")
        uses = ""
        if "nope" in schemes:
            gain = schemes["learned"]["eval"][1]["ppl_all"] / schemes["nope"]["eval"][1]["ppl_all"]
            uses = f"; ppl@L0 learned / NoPE = {gain:.3f} (< 0.97 would mean the table is used)"
        rows.append(_row("learned_table_beyond_L0", "soft", r[0], ">= 1.5", r[0] >= 1.5,
                         f"ratios {_fmt(r)}{uses}", "sinusoidal"))
    if "rope" in schemes:
        r = ratios("rope")
        rows.append(_row("rope_degrades_beyond_L0", "hard", r[0], "> 1.05", r[0] > 1.05, f"ratios {_fmt(r)}", "rope"))
        steps = [b - a for a, b in zip(r, r[1:])]
        if steps:
            rows.append(_row("rope_keeps_degrading", "hard", min(steps), "> 0 (each longer length worse)",
                             min(steps) > 0, f"ratios {_fmt(r)} at {_fmt_lengths(far)}x", "rope"))
    if "alibi" in schemes:
        for m, value in zip(far, ratios("alibi")):
            rows.append(_row(f"alibi_flat_{m}x", "hard", value, "|r - 1| <= 0.03", abs(value - 1) <= 0.03,
                             f"band ratios {_fmt(schemes['alibi']['eval'][m]['band_ratios'])}", "alibi"))
    if "t5" in schemes and "alibi" in schemes:
        t5, alibi = ratios("t5"), ratios("alibi")
        rows.append(_row("t5_close_to_alibi_at_2x", "soft", t5[0] - alibi[0], "<= 0.05", t5[0] - alibi[0] <= 0.05,
                         f"T5 ratios {_fmt(t5)}; ALiBi {_fmt(alibi)}", "t5"))
        if len(t5) > 1:
            rows.append(_row("t5_degrades_with_length", "soft", t5[-1] - t5[0], "> 0", t5[-1] > t5[0],
                             f"T5 ratios {_fmt(t5)}", "t5"))
    order = [s for s in ("alibi", "t5", "rope", "sinusoidal") if s in schemes]
    if len(order) >= 3:
        r = [schemes[s]["eval"][far[-1]]["ratio_out"] for s in order]
        rows.append(_row(f"extrapolation_order_{far[-1]}x", "soft", None, " < ".join(order), r == sorted(r),
                         ", ".join(f"{s} {v:.3f}" for s, v in zip(order, r)), "order"))
    if "nope" in schemes and "rope" in schemes:
        nope, rope = ratios("nope")[-1], ratios("rope")[-1]
        rows.append(_row(f"nope_beats_rope_{far[-1]}x", "soft", nope, f"< RoPE's {rope:.3f}", nope < rope,
                         f"NoPE ratios {_fmt(ratios('nope'))}", "kazemnejad"))
    in_range = {s: schemes[s]["eval"][1]["ppl_all"] for s in schemes}
    rows.append(_row("in_range_ppl_order", "report", None, None, None,
                     ", ".join(f"{s} {v:.3f}" for s, v in sorted(in_range.items(), key=lambda kv: kv[1])), "order"))
    rows += _extension_rows(ext, far)
    rows += _finetune_rows(ft, ext, far)
    rows += _probe_rows(schemes, far)
    return rows


def _fmt_lengths(far) -> str:
    return "/".join(str(m) for m in far)


def _extension_rows(ext: dict, far: list[int]) -> list[dict]:
    rows: list[dict] = []
    if "none" not in ext:
        return rows
    plain = ext["none"]["eval"]
    if "dynamic_ntk" in ext:
        dyn = ext["dynamic_ntk"]["eval"]
        drift = max(abs(dyn[m]["ppl_in"] / plain[m]["ppl_in"] - 1) for m in [1] + far)
        rows.append(_row("dynamic_ntk_exact_within_L0", "hard", drift, "<= 1e-4", drift <= 1e-4,
                         "max relative ppl_in difference to plain RoPE over lengths", "dynamic"))
        for m in far:
            value = dyn[m]["ppl_out"] / plain[m]["ppl_out"]
            rows.append(_row(f"dynamic_ntk_better_beyond_L0_{m}x", "hard", value, "< 1", value < 1,
                             f"ppl_out {dyn[m]['ppl_out']:.3f} vs plain {plain[m]['ppl_out']:.3f}", "dynamic"))
    if "pi" in ext:
        value = ext["pi"]["eval"][far[0]]["ppl_in"] / plain[far[0]]["ppl_in"]
        rows.append(_row("pi_zero_shot_damages_in_range", "hard", value, ">= 1.05", value >= 1.05,
                         f"ppl_in at s = {far[0]}: " + ", ".join(
                             f"{m}x {ext['pi']['eval'][m]['ppl_in']:.3f}" for m in far)
                         + f" vs {plain[1]['ppl_all']:.3f} unscaled", "pi"))
    at_l0 = {label: entry["eval"][1]["ppl_all"] for label, entry in ext.items() if 1 in entry["eval"]}
    spread = max(at_l0.values()) / min(at_l0.values()) - 1
    rows.append(_row("rules_coincide_at_L0", "hard", spread, "<= 1e-5", spread <= 1e-5,
                     f"{len(at_l0)} rules, ppl@L0 {min(at_l0.values()):.5f} .. {max(at_l0.values()):.5f}", "coincide"))
    if "ntk" in ext:
        worst = max(ext["ntk"]["eval"][m]["ppl_out"] / plain[m]["ppl_out"] for m in far)
        rows.append(_row("ntk_better_beyond_L0", "soft", worst, "< 1 at every length", worst < 1,
                         "max over lengths of ppl_out(NTK) / ppl_out(plain)", "dynamic"))
    for m in far:
        present = [(label, ext[label]["eval"][m]["ppl_out"]) for label in ("pi", "ntk", "dynamic_ntk", "yarn", "llama3",
                                                                          "longrope") if label in ext]
        if len(present) >= 2:
            ranked = sorted(present, key=lambda kv: kv[1])
            rows.append(_row(f"zero_shot_order_{m}x", "report", None, None, None,
                             " < ".join(f"{k} {v:.3f}" for k, v in ranked), "p9"))
    if "yarn" in ext and "yarn:beta_fast=8" in ext:
        a, b = ext["yarn:beta_fast=8"]["eval"][far[-1]]["ppl_out"], ext["yarn"]["eval"][far[-1]]["ppl_out"]
        rows.append(_row("yarn_small_beta_fast_helps_at_small_L0", "soft", a / b, "< 1", a < b,
                         f"ppl_out at {far[-1]}x: beta_fast=8 {a:.3f} vs 32 {b:.3f}", "p9"))
    if "longrope" in ext and "pi" in ext:
        a, b = ext["longrope"]["eval"][far[-1]]["ppl_out"], ext["pi"]["eval"][far[-1]]["ppl_out"]
        rows.append(_row("longrope_beats_pi_zero_shot", "soft", a / b, "< 1", a < b,
                         f"ppl_out at {far[-1]}x: LongRoPE {a:.3f} vs PI {b:.3f}", "longrope"))
    return rows


def _finetune_rows(ft: dict, ext: dict, far: list[int]) -> list[dict]:
    rows: list[dict] = []
    m = 2 if 2 in far else far[0]
    if "pi" in ft and "pi" in ext:
        tuned, zero = ft["pi"]["eval"][m]["ppl_all"], ext["pi"]["eval"][m]["ppl_all"]
        rows.append(_row("pi_finetuning_recovers", "soft", tuned / zero, "< 1", tuned < zero,
                         f"ppl@{m}x after fine-tuning {tuned:.3f} vs zero-shot {zero:.3f}", "finetune"))
    if "pi" in ft and "yarn" in ft:
        a, b = ft["yarn"]["eval"][m]["ppl_all"], ft["pi"]["eval"][m]["ppl_all"]
        rows.append(_row("finetuned_yarn_not_worse_than_pi", "soft", a / b, "<= 1.01", a / b <= 1.01,
                         f"ppl@{m}x: YaRN {a:.3f}, PI {b:.3f}"
                         + (f", none {ft['none']['eval'][m]['ppl_all']:.3f}" if "none" in ft else ""), "finetune"))
    return rows


def _probe_rows(schemes: dict, far: list[int]) -> list[dict]:
    rows: list[dict] = []
    if "alibi" not in schemes or not schemes["alibi"]["probe"]:
        return rows
    at = [p for p in schemes["alibi"]["probe"] if p["multiple"] == far[-1]]
    if len(at) >= 2:
        first, last = min(at, key=lambda p: p["depth"]), max(at, key=lambda p: p["depth"])
        rows.append(_row("alibi_retrieval_decays_with_distance", "soft", first["accuracy"] - last["accuracy"], "< 0",
                         first["accuracy"] < last["accuracy"],
                         f"accuracy at distance {first['distance']}: {first['accuracy']:.2f}, at {last['distance']}: "
                         f"{last['accuracy']:.2f} ({far[-1]}x)", "probe"))
    return rows


def hard_failures(rows: list[dict]) -> list[dict]:
    """The hard rows that did not pass."""
    return [row for row in rows if row["kind"] == "hard" and not row["passed"]]
