"""`posenc bench`: RoPE on q and k timed side by side with the peers and the memory floors, one run, one thread.

Every provider rotates the same tensors in the same process; rows of one (shape, dtype) are timed in
interleaved rounds so machine noise hits them alike, and each is reported against the floors measured
in that run: `copy` (`copy_` of q and k into existing buffers: the bound for an in-place rotation) and
`clone` (fresh outputs: the bound for an allocating one). Output: tidy CSV rows, a Markdown summary,
and a plot drawn from the CSV. Peers that are not installed are skipped (and listed in the summary).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from .providers import Provider, hf_tables, providers

__all__ = ["SHAPES", "run", "write_csv", "summary", "plot", "add_parser"]

# name -> (b, hq, hk, t, d, position of the first token)
SHAPES = {
    "prefill 1x32x4096x128": (1, 32, 32, 4096, 128, 0),
    "batch 8x32x512x128": (8, 32, 32, 512, 128, 0),
    "decode 32x32x1x128 @4095": (32, 32, 32, 1, 128, 4095),
    "gqa q32/k8 1x2048x128": (1, 32, 8, 2048, 128, 0),
}
FIELDS = ["provider", "shape", "dtype", "inplace", "p20_ms", "p50_ms", "p80_ms", "gb_per_s", "x_copy", "x_clone",
          "peak_extra_mib", "max_abs_err", "threads"]


def oracle(x: torch.Tensor, pos: torch.Tensor, pairing: str, base: float = 10000.0) -> torch.Tensor:
    """Float64 rotation of `x` `[b, h, t, d]` at the checkpoint's float32 angles (Llama's inv_freq times the
    position, in float32), by the 2x2 formula written out: the common yardstick of every provider."""
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))  # [d/2] float32
    angle = (pos.float()[..., None] * inv).double()  # [t, d/2] or [b, 1, d/2]
    c, s = angle.cos(), angle.sin()
    if pos.ndim == 2:
        c, s = c[:, None], s[:, None]  # [b, 1, t, d/2]
    x = x.double()
    if pairing == "split_half":
        a, b = x[..., : d // 2], x[..., d // 2:]
        return torch.cat((a * c - b * s, b * c + a * s), -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * c - b * s, b * c + a * s), -1).flatten(-2)


def _max_error(p: Provider, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, cos_hf, sin_hf) -> float:
    """One untimed call of `p` on copies of the first (at most) 4 batch rows and 64 tokens of q and k: the largest
    |result - oracle| over q and k (NaN for a floor). The slice keeps the check to a fraction of a second."""
    if p.pairing is None:
        return math.nan
    b, t = min(q.shape[0], 4), min(q.shape[2], 64)
    q, k = q[:b, :, :t].contiguous(), k[:b, :, :t].contiguous()  # [b', h, t', d]
    pos = pos[:b, :t] if pos.ndim == 2 else pos[:t]
    cos_hf, sin_hf = cos_hf[:b, :t], sin_hf[:b, :t]  # [b' or 1, t', d]
    out = p.make(q.clone(), k.clone(), pos, cos_hf, sin_hf)()  # (q_rot, k_rot) [b, h, t, d], in place or not
    return max(float((o.double() - oracle(x, pos, p.pairing)).abs().max()) for o, x in zip(out, (q, k)))


def _peak_extra_mib(fn: Callable) -> float:
    """Peak bytes the CPU allocator held during one call (outputs included), from the profiler's memory events."""
    with _quiet_stderr(), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                 profile_memory=True) as prof:
        fn()
    # self (not inclusive) usage: an op's allocation is otherwise counted again in every op that calls it
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    level = peak = 0
    for e in events:
        level += e.self_cpu_memory_usage
        peak = max(peak, level)
    return peak / 2**20


@contextlib.contextmanager
def _quiet_stderr():
    """Silence the profiler's C++ start/stop log lines (written to file descriptor 2)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _quantile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p * (len(ordered) - 1))))]


def run(shapes: list[str], dtypes: list[torch.dtype], rounds: int, quick: bool, progress: Callable = print,
        clock: str = "wall") -> tuple[list[dict], list[str]]:
    """Time every provider on every (shape, dtype); returns (CSV rows, notes).

    clock: "wall" (`time.perf_counter`) or "thread" (`time.thread_time`: CPU time of this thread, user and
    system, so time spent descheduled on an oversubscribed machine does not count).
    """
    torch.set_num_threads(1)
    now = time.thread_time if clock == "thread" else time.perf_counter
    found, notes = providers(quick)
    rows = []
    for shape in shapes:
        b, hq, hk, t, d, start = SHAPES[shape]
        for dtype in dtypes:
            if not quick:  # torch.compile providers: fresh caches, so that no group meets dynamo's recompile limit
                torch._dynamo.reset()  # (past it dynamo runs eager without a word and the timings lie)
            gen = torch.Generator().manual_seed(0)
            q = torch.randn(b, hq, t, d, generator=gen).to(dtype)
            k = torch.randn(b, hk, t, d, generator=gen).to(dtype)
            pos = torch.full((b, 1), start) if t == 1 else torch.arange(t) + start  # [b, 1] or [t]
            from ..rope.spec import Rope

            cos_hf, sin_hf = hf_tables(Rope(head_dim=128), pos, dtype)
            q0, k0 = q.clone(), k.clone()  # the in-place providers rotate q and k on every call
            calls = {}
            for p in found:
                try:
                    fn = p.make(q, k, pos, cos_hf, sin_hf)
                    start_t = time.perf_counter()
                    fn()  # warm-up (and compile)
                    calls[p.name] = (p, fn, time.perf_counter() - start_t)
                except Exception as exc:  # a peer that fails on this input is reported, not fatal
                    notes.append(f"{p.name} on {shape} {dtype}: {type(exc).__name__}: {str(exc)[:120]}")
            # inner repetitions so that one sample lasts >= 2 ms (decode calls take microseconds)
            inner = {n: max(1, math.ceil(2e-3 / max(first, 1e-6))) for n, (_, _, first) in calls.items()}
            for n, (_, fn, first) in calls.items():  # recalibrate on a warm call (not worth it past 20 ms: 1 call)
                if first >= 20e-3:
                    continue
                start_t = time.perf_counter()
                for _ in range(inner[n]):
                    fn()
                inner[n] = max(1, math.ceil(2e-3 * inner[n] / max(time.perf_counter() - start_t, 1e-9)))
            samples: dict[str, list[float]] = {n: [] for n in calls}
            for _ in range(rounds * (4 if t == 1 else 1)):  # interleaved: noise hits every provider alike; decode is cheap
                for n, (_, fn, _) in calls.items():
                    start_t = now()
                    for _ in range(inner[n]):
                        fn()
                    samples[n].append((now() - start_t) / inner[n])
            moved = 2 * (q.numel() + k.numel()) * q.element_size()  # read and write q and k
            floor_copy = _quantile(samples.get("copy_ (floor)", [math.nan]), 0.5)
            floor_clone = _quantile(samples.get("clone (floor)", [math.nan]), 0.5)
            for n, (p, fn, _) in calls.items():
                p50 = _quantile(samples[n], 0.5)
                rows.append({
                    "provider": n, "shape": shape, "dtype": str(dtype).replace("torch.", ""), "inplace": p.inplace,
                    "p20_ms": _quantile(samples[n], 0.2) * 1e3, "p50_ms": p50 * 1e3,
                    "p80_ms": _quantile(samples[n], 0.8) * 1e3, "gb_per_s": moved / p50 / 1e9,
                    "x_copy": p50 / floor_copy, "x_clone": p50 / floor_clone,
                    "peak_extra_mib": _peak_extra_mib(fn), "threads": torch.get_num_threads(),
                    "max_abs_err": _max_error(p, q0, k0, pos, cos_hf, sin_hf),
                })
            progress(f"{shape} {dtype}: " + ", ".join(f"{r['provider']} {r['x_copy']:.2f}x" for r in rows[-len(calls):]))
            del q, k, calls
    return rows, notes


def recompiles(lengths: int = 16) -> int:
    """Graphs compiled by `torch.compile(Rope.apply, fullgraph=True)` over `lengths` growing sequence lengths."""
    from torch._dynamo.utils import counters

    from ..rope.spec import Rope

    rope = Rope(head_dim=64)
    torch._dynamo.reset()
    counters.clear()
    fn = torch.compile(lambda q, k, pos: rope.apply(q, k, pos), fullgraph=True)
    for t in range(8, 8 + lengths):
        fn(torch.randn(1, 4, t, 64), torch.randn(1, 2, t, 64), torch.arange(t))
    return int(counters["stats"]["unique_graphs"])


def write_csv(rows: list[dict], path: Path) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in r.items()})


def summary(rows: list[dict], notes: list[str], extra: list[str] = ()) -> str:
    """A Markdown table per (shape, dtype): p50, GB/s and the ratios to both floors."""
    out = ["# RoPE benchmark (CPU, one thread, one run; ratios to floors measured in the same run)", ""]
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["shape"], r["dtype"]), []).append(r)
    for (shape, dtype), group in groups.items():
        out += [f"## {shape}, {dtype}", "", "| provider | in place | p50 ms (p20-p80) | GB/s | x copy | x clone | peak MiB "
                "| max abs err |", "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(group, key=lambda r: float(r["p50_ms"])):
            out.append(f"| {r['provider']} | {'yes' if r['inplace'] else 'no'} | {float(r['p50_ms']):.4g} "
                       f"({float(r['p20_ms']):.3g}-{float(r['p80_ms']):.3g}) | {float(r['gb_per_s']):.3g} | "
                       f"{float(r['x_copy']):.2f} | {float(r['x_clone']):.2f} | {float(r['peak_extra_mib']):.0f} | "
                       f"{_err(r['max_abs_err'])} |")
        out.append("")
    out += [f"- {n}" for n in [*extra, *notes]]
    return "\n".join(out) + "\n"


def _err(value) -> str:
    value = float(value)
    return "-" if math.isnan(value) else f"{value:.1e}"


def plot(csv_path: Path, out_path: Path) -> Path:
    """Bar chart of the ratio to the copy floor per provider, one panel per (shape, dtype), read from the CSV."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    panels = sorted({(r["shape"], r["dtype"]) for r in rows})
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels)), squeeze=False)
    for ax, (shape, dtype) in zip(axes[:, 0], panels):
        group = sorted((r for r in rows if (r["shape"], r["dtype"]) == (shape, dtype)), key=lambda r: float(r["x_copy"]))
        ax.barh([r["provider"] for r in group], [float(r["x_copy"]) for r in group], color="tab:blue")
        ax.set_xscale("log")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_title(f"{shape}, {dtype}: time / copy floor (log)", fontsize=9)
        ax.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    return out_path


def add_parser(sub) -> None:
    """Register `posenc bench` on the CLI's subparsers."""
    p = sub.add_parser("bench", help="time RoPE on q and k against the peers and the copy/clone floors",
                       description="Times posenc's RoPE (in place and allocating), transformers, the complex-multiply"
                       " idiom and other installed peers side by side on the same tensors, one thread, with the copy_"
                       " and clone floors measured in the same run. Writes rope_bench.csv, rope_bench.md and"
                       " rope_bench.png (matplotlib) into --out.")
    p.add_argument("--quick", action="store_true", help="fewer rounds, no torch.compile providers (< 1 min on 2 cores)")
    p.add_argument("--shapes", default="all", help=f"comma-separated subset of: {'; '.join(SHAPES)} (match by first word)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated dtypes (default float32,bfloat16)")
    p.add_argument("--rounds", type=int, help="timed rounds per provider (default 5 quick, 15 full)")
    p.add_argument("--clock", choices=("wall", "thread"), default="wall",
                   help="wall time, or this thread's CPU time (robust when other jobs share the cores)")
    p.add_argument("--out", default=".", help="output directory (default: current)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.set_defaults(run=main)


def main(args: argparse.Namespace) -> int:
    from ..errors import fail

    names = list(SHAPES) if args.shapes == "all" else []
    for word in ([] if args.shapes == "all" else args.shapes.split(",")):
        match = [s for s in SHAPES if word.split() and s.split()[0] == word.split()[0]]
        if not match:
            fail("--shapes", f"names from {[s.split()[0] for s in SHAPES]}", word)
        names += match
    dtypes = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name.strip(), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            fail("--dtypes", "floating dtypes such as float32,bfloat16", name)
        dtypes.append(dtype)
    rounds = 5 if args.quick else 15
    if args.rounds is not None:
        from ..errors import integer

        rounds = integer("--rounds", args.rounds, min=1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, notes = run(names, dtypes, rounds, args.quick, clock=args.clock)
    from ..kernels import build

    extra = [f"torch {torch.__version__}, {torch.get_num_threads()} thread, quick={args.quick}, clock={args.clock}",
             build.describe()]
    if not args.quick:
        extra.append(f"torch.compile(Rope.apply, fullgraph=True) over 16 growing lengths: {recompiles()} graphs compiled")
    write_csv(rows, out / "rope_bench.csv")
    written = ["rope_bench.csv", "rope_bench.md"]
    if not args.no_plot:
        try:
            plot(out / "rope_bench.csv", out / "rope_bench.png")
            written.append("rope_bench.png")
        except ImportError:
            notes.append("plot skipped: matplotlib not installed")
    (out / "rope_bench.md").write_text(summary(rows, notes, extra))
    print(f"wrote {', '.join(str(out / w) for w in written)}")
    return 0
