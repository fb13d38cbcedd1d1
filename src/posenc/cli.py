"""The `posenc` command: `posenc inspect MODEL_OR_CONFIG`, `posenc plot KIND [MODEL...]` and `posenc lab`.

    >>> main(["inspect", "llama-2-7b", "--lengths", "4k", "--dtypes", "fp16", "--bands", "2"])  # doctest: +ELLIPSIS
    llama-2-7b: meta-llama/Llama-2-7b-hf (preset llama-2-7b)
    ...
    4k      4096    2 GB
      per token: 512 KiB in fp16 = 2 (K and V) x 32 layers x 32 KV heads x 128 dims x 2 bytes (MHA)
    0

`main(argv)` returns the exit code (0, or 2 for bad input with the message on stderr, a missing optional
package included); plain aligned text when stdout is not a terminal, rich tables when it is and `rich` is
installed, JSON with `--json`. The text itself is `posenc.inspection.text`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Sequence

from . import __version__
from . import inspection as ins
from .errors import PosencError, fail, integer
from .inspection.text import print_rich, render_inspect
from .plots import PLOT_KINDS

__all__ = ["main", "build_parser", "render_inspect", "require"]


def require(module: str, extra: str) -> None:
    """Import an optional package or raise `PosencError` with the one line that installs it.

    Raises:
        PosencError: `"<module> is not installed: pip install 'posenc[<extra>]'"`.
    """
    try:
        importlib.import_module(module)
    except ImportError:
        raise PosencError(f"{module} is not installed: pip install 'posenc[{extra}]'") from None


def _inspect(args: argparse.Namespace) -> int:
    integer("--bands", args.bands, min=1)
    if args.format == "rich" and not args.json:
        require("rich", "rich")
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    lengths = ins.parse_lengths(args.lengths) if args.lengths is not None else None
    report = ins.inspect_source(args.model, lengths=lengths, batch=args.batch, dtypes=dtypes, memory_gib=args.memory,
                                kv_dtype=args.kv_dtype)
    if args.json:
        print(json.dumps(report, indent=2))
    elif args.format == "rich" or (args.format == "auto" and sys.stdout.isatty() and _has_rich()):
        print_rich(report, args.bands)
    else:
        sys.stdout.write(render_inspect(report, args.bands))
    return 0


def _has_rich() -> bool:
    from importlib.util import find_spec

    return find_spec("rich") is not None


def _plot(args: argparse.Namespace) -> int:
    require("matplotlib", "plot")
    from . import plots

    length = None
    if args.length is not None:
        lengths = ins.parse_lengths(args.length, "--length")
        if len(lengths) != 1:
            fail("--length", "one token count such as 4k or 4096", args.length)
        length = lengths[0]
    for arg, value in (("--dim", args.dim), ("--heads", args.heads)):
        if value is not None:
            integer(arg, value, min=1)
    path = plots.render(args.kind, args.models, args.output, length=length, dim=args.dim, heads=args.heads)
    print(f"wrote {path}")
    return 0


class _Version(argparse.Action):
    """`--version`: the version and `kernels.build.describe()`, looked up only when asked (it may build)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        from .kernels import build

        print(f"posenc {__version__}\n{build.describe()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `posenc` (subcommands inspect, plot, verify and lab)."""
    parser = argparse.ArgumentParser(prog="posenc", description="Positional encodings of transformer checkpoints.")
    parser.add_argument("--version", action=_Version, help="print the version and which CPU kernel runs, then exit")
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
    p.add_argument("--kv-dtype", metavar="FORMAT[:pre|:post]",
                   help="the memory table of posenc's quantized cache in FORMAT (int8, int4, fp8, bf16, fp16, fp32): "
                   "codes plus scales per token; :pre = keys per channel before RoPE (default :post, per token); "
                   "replaces --dtypes")
    p.add_argument("--memory", type=float, metavar="GIB", help="a KV-cache budget in GB (2**30 bytes): print the longest request that fits")
    p.add_argument("--bands", type=int, default=8, help="frequency bands to group the rotation pairs into (default 8)")
    p.add_argument("--json", action="store_true", help="print every fact as JSON (per-pair lists included)")
    p.add_argument("--format", choices=("auto", "plain", "rich"), default="auto",
                   help="auto: rich tables on a terminal when rich is installed, plain text otherwise")
    p.set_defaults(run=_inspect)
    q = sub.add_parser("plot", help="draw a figure (PNG or SVG) with matplotlib",
                       description="Figures: sinusoidal (table heatmap and channels), wavelengths (RoPE wavelengths"
                       " against L0 and L1 with the scaling's stretch and ramp), decay (RoPE score bound vs distance),"
                       " alibi (bias per head: the model's heads, or --heads), t5 (buckets vs relative position: the"
                       " model's buckets and max distance, or T5's 32 and 128), compare (several models side by side, at"
                       " least one with RoPE). Needs matplotlib: pip install 'posenc[plot]'.",
                       epilog="example: posenc plot wavelengths llama-3.1-8b -o wavelengths.png")
    q.add_argument("kind", choices=PLOT_KINDS, help="which figure")
    q.add_argument("models", nargs="*", metavar="MODEL",
                   help="presets or config paths: one or more (wavelengths, decay, compare), at most one (alibi, t5)")
    q.add_argument("-o", "--output", required=True, help="output file, .png or .svg")
    q.add_argument("--length", help="positions or distances to draw, e.g. 512 or 4k (per figure default)")
    q.add_argument("--dim", type=int, help="model width for the sinusoidal table (default 128)")
    q.add_argument("--heads", type=int, help="heads for the alibi figure without a model (default 8)")
    q.set_defaults(run=_plot)
    from .verify.cli import add_parser as add_verify_parser  # `posenc verify`: its code lives in posenc/verify/
    from .lab.cli import add_parser as add_lab_parser  # `posenc lab`: its code lives in posenc/lab/
    from .bench import add_parser as add_bench_parser  # `posenc bench`: its own module

    add_verify_parser(sub)
    from .verify.cli import add_setup_parser

    add_setup_parser(sub)
    add_bench_parser(sub)
    add_lab_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (2 with a message on stderr for bad input)."""
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except PosencError as e:
        print(f"posenc {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a path that cannot be read or written (an --out that is a file, a full disk)
        print(f"posenc {args.command}: error: {e}", file=sys.stderr)
        return 2
