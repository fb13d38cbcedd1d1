"""`posenc lab`: the command-line front of the lab (registered by `posenc.cli`).

    >>> import argparse
    >>> parser = argparse.ArgumentParser(prog="posenc")
    >>> add_parser(parser.add_subparsers(dest="command"))
    >>> args = parser.parse_args(["lab", "--quick", "--steps", "7", "--schemes", "rope", "alibi"])
    >>> cfg = config_from_args(args)
    >>> cfg.steps, cfg.schemes, cfg.l0
    (7, ('rope', 'alibi'), 64)
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from ..errors import Raw, fail
from ..outputs import writable_file, writable_folder
from .config import DEFAULT_RULES, SCHEMES, LabConfig

__all__ = ["add_parser", "config_from_args", "run"]

# numeric options: (flag, LabConfig field, type, help); None on the command line keeps the preset's value
_NUMBERS = (
    ("--l0", "l0", int, "training length L0 (tokens = bytes)"),
    ("--d", "hidden_size", int, "hidden size"),
    ("--layers", "num_layers", int, "decoder layers"),
    ("--heads", "num_heads", int, "attention heads"),
    ("--ffn", "intermediate_size", int, "SwiGLU intermediate size"),
    ("--steps", "steps", int, "training steps per scheme"),
    ("--batch", "batch_size", int, "training windows per step"),
    ("--lr", "lr", float, "peak AdamW learning rate"),
    ("--seed", "seed", int, "seed of initialisation, batches, search and probe"),
    ("--windows", "eval_windows", int, "validation windows scored at every length"),
    ("--eval-batch", "eval_batch", int, "windows per evaluation forward"),
    ("--finetune-steps", "finetune_steps", int, "fine-tuning steps at 2 L0, 0 to skip"),
    ("--probe-trials", "probe_trials", int, "retrieval trials per depth and length, 0 to skip"),
    ("--search-population", "search_population", int, "LongRoPE search: candidates per generation"),
    ("--search-generations", "search_generations", int, "LongRoPE search: generations, 0 for the seeds only"),
)
_FIELDS = {**{flag[2:].replace("-", "_"): field for flag, field, _, _ in _NUMBERS},
           "corpus": "corpus", "schemes": "schemes", "rules": "rules", "finetune_methods": "finetune_methods"}


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def _floats(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers separated by commas, got {text!r}") from None


def add_parser(sub) -> None:
    """Add the `lab` subcommand to an argparse subparsers object."""
    p = sub.add_parser(
        "lab", help="train tiny models per positional scheme and check the papers' length predictions",
        description="Train tiny decoders (posenc.models.Decoder) with each positional scheme at L0 on bytes of text"
        " every CPython ships, evaluate at 1/2/4/8x L0 against an in-window control, extend the RoPE model zero-shot"
        " with every scaling rule (and by short fine-tuning at 2 L0), probe copy-retrieval by depth, and check the"
        " papers' predictions. Trained models are cached under OUT/checkpoints by a hash of their settings, so a"
        " rerun (or an interrupted run) resumes.",
        epilog="example: posenc lab --quick --out results/lab-quick --json results/lab-quick.json")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="the small configuration (minutes on 2 cores; noisy numbers)")
    size.add_argument("--full", action="store_true", help="the configuration the predictions are checked on (default)")
    p.add_argument("--out", help="results folder (default results/lab-quick or results/lab-full)")
    p.add_argument("--json", metavar="FILE", help="also write every measured number and each prediction as JSON")
    p.add_argument("--corpus", choices=("stdlib", "pydoc"), help="stdlib sources (default) or pydoc_data topics")
    p.add_argument("--schemes", nargs="+", choices=SCHEMES, help=f"schemes to train (default all: {' '.join(SCHEMES)})")
    p.add_argument("--rules", nargs="+", metavar="RULE",
                   help="zero-shot RoPE rules, 'name' or 'name:key=value,...' (names none pi ntk dynamic_ntk yarn llama3"
                   f" longrope; default {' '.join(DEFAULT_RULES)})")
    p.add_argument("--longrope-factors", type=_floats, metavar="F,F,...",
                   help="given LongRoPE long factors (head_dim / 2 numbers) instead of searching them")
    p.add_argument("--lengths", type=_ints, metavar="1,2,4,8", help="evaluation lengths as multiples of L0")
    for flag, field, kind, text in _NUMBERS:
        p.add_argument(flag, type=kind, help=f"{text} (LabConfig.{field})")
    p.add_argument("--finetune-methods", nargs="+", choices=("none", "pi", "yarn", "ntk"), help="default none pi yarn")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's choice)")
    p.add_argument("--progress", choices=("auto", "rich", "plain", "off"), default="auto",
                   help="progress bars on stderr (auto: rich on a terminal when installed, else plain lines)")
    p.add_argument("--no-plots", action="store_true", help="skip the figures (matplotlib not needed)")
    p.add_argument("--check", action="store_true", help="exit with status 1 when a hard prediction fails")
    p.set_defaults(run=run)


def config_from_args(args: argparse.Namespace) -> LabConfig:
    """The `LabConfig` for parsed arguments: the preset, with every given option applied."""
    overrides = {field: getattr(args, option) for option, field in _FIELDS.items() if getattr(args, option) is not None}
    for key in ("schemes", "rules", "finetune_methods"):
        if key in overrides:
            overrides[key] = tuple(overrides[key])
    if args.lengths is not None:
        overrides["lengths"] = args.lengths
    if args.longrope_factors is not None:
        overrides["longrope_factors"] = args.longrope_factors
    return LabConfig.preset("quick" if args.quick else "full", **overrides)


def run(args: argparse.Namespace) -> int:
    """Run the lab and write results.csv, results.json, summary.md and the figures into the results folder."""
    import torch

    from . import progress
    from .predictions import check_predictions, hard_failures
    from .report import markdown, tidy_rows, write_csv, write_json, write_plots
    from .run import run_lab

    progress.set_mode(args.progress)
    if not args.no_plots:  # before minutes of training, not after them
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("--no-plots", "matplotlib for the figures: pip install 'posenc[plots]' (or pass --no-plots to "
                 "write the CSV, JSON and summary without them)", Raw("matplotlib not installed"))
    if args.threads is not None:
        if args.threads < 1:
            fail("--threads", "an integer >= 1", args.threads)
        torch.set_num_threads(args.threads)
    cfg = config_from_args(args)
    out = pathlib.Path(args.out or f"results/lab-{'quick' if args.quick else 'full'}")
    writable_folder("--out", out)
    if args.json:
        writable_file("--json", args.json)
    out.mkdir(parents=True, exist_ok=True)
    results = run_lab(cfg, out)
    torch.save(results, out / "raw_results.pt")  # the nested results, should a report step need redoing
    predictions = check_predictions(results, cfg)
    write_csv(tidy_rows(results), out / "results.csv")
    write_json(results, predictions, out / "results.json")
    if args.json:
        write_json(results, predictions, pathlib.Path(args.json))
    summary = markdown(results, predictions)
    (out / "summary.md").write_text(summary)
    written = [out / "results.csv", out / "results.json", out / "summary.md"]
    if not args.no_plots:
        written += write_plots(results, out)
    sys.stdout.write(summary[summary.index("### Predictions"):])
    for path in written + ([pathlib.Path(args.json)] if args.json else []):
        print(f"wrote {path}")
    failed = hard_failures(predictions)
    if failed:
        print(f"{len(failed)} hard prediction(s) failed: {', '.join(row['name'] for row in failed)}")
    return 1 if failed and args.check else 0
