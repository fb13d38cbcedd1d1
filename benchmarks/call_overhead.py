"""Per-call cost of decode-sized rotations with a held table: `python benchmarks/call_overhead.py [--profile]`.

Prints microseconds per call (median of `--repeats` runs of `--calls` calls each, after a warm-up) for
`rope.apply(q, k, pos, table=table)` against `(q.clone(), k.clone())`, and `rope.apply_` against
`q_out.copy_(q), k_out.copy_(k)`, at q and k `[1, 1, 1, 128]` and `[32, 32, 1, 128]` ("bhtd"), position
4095 of `rope.table(4096)`, float32 and bfloat16, on 1 and 2 threads. `--profile` adds a cProfile of the
in-place call at the small shape (where the Python cost is all there is). Not a test: the numbers are noisy
on a shared machine; compare runs made back to back.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import posenc


def per_call_us(fn, calls: int, repeats: int, clock=time.perf_counter) -> float:
    """Median over `repeats` of the mean microseconds per call of `calls` calls to `fn`, timed by `clock`."""
    for _ in range(max(calls // 10, 10)):  # warm-up: the library loads, the pool starts, caches fill
        fn()
    runs = []
    for _ in range(repeats):
        start = clock()
        for _ in range(calls):
            fn()
        runs.append((clock() - start) / calls * 1e6)
    return statistics.median(runs)


def cases(rope: posenc.Rope, table, shape, dtype):
    """The four calls at one shape and dtype, as `(name, fn)`."""
    q, k = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    pos = torch.tensor([4095])
    return [
        ("apply", lambda: rope.apply(q, k, pos, table=table)),
        ("clone", lambda: (q.clone(), k.clone())),
        ("apply_", lambda: rope.apply_(q_out, k_out, pos, table=table)),
        ("copy_", lambda: (q_out.copy_(q), k_out.copy_(k))),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(prog="call_overhead")
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--clock", choices=["wall", "thread"], default="wall",
                        help="wall time, or the calling thread's CPU time (steadier on a loaded machine; 1 thread only: "
                        "with more, work on other threads is not counted)")
    parser.add_argument("--profile", action="store_true", help="cProfile apply_ at [1, 1, 1, 128] float32")
    args = parser.parse_args()
    rope = posenc.Rope(head_dim=128)
    table = rope.table(4096)
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    print(f"posenc {posenc.__file__}; torch {torch.__version__}; us per call ({args.clock} clock), median of "
          f"{args.repeats} x {args.calls}")
    print(f"{'threads':>7} {'shape':>16} {'dtype':>9} {'apply':>8} {'clone':>8} {'ratio':>6} {'apply_':>8} {'copy_':>8} {'ratio':>6}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        for shape in ((1, 1, 1, 128), (32, 32, 1, 128)):
            for dtype in (torch.float32, torch.bfloat16):
                us = {name: per_call_us(fn, args.calls, args.repeats, clock) for name, fn in cases(rope, table, shape, dtype)}
                print(f"{threads:>7} {str(list(shape)):>16} {str(dtype)[6:]:>9} {us['apply']:8.2f} {us['clone']:8.2f} "
                      f"{us['apply'] / us['clone']:6.2f} {us['apply_']:8.2f} {us['copy_']:8.2f} "
                      f"{us['apply_'] / us['copy_']:6.2f}")
    if args.profile:
        torch.set_num_threads(1)
        fn = cases(rope, table, (1, 1, 1, 128), torch.float32)[2][1]
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(20000):
            fn()
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()
