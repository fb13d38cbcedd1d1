"""posenc's in-place RoPE against vLLM's CPU rotary op on the same bytes, as ratios to the copy floor of the same run.

Run it in vLLM's own environment (`posenc setup-engine vllm` makes one; vLLM pins its own transformers), with
posenc on the path:

    PYTHONPATH=src ~/.cache/posenc/engines/vllm/venv/bin/python benchmarks/vllm_rotary.py --threads 1,2

Layout: 32 q and 32 k heads of 128 channels, split-half (neox) pairing, tokens outer (`[tokens, heads * d]`,
vLLM's layout; posenc's `layout="bthd"` on the same memory). Each case times, in alternating rounds at one
thread count: the copy of q and k (`copy_` from a second buffer: read and write every byte once, the floor an
in-place rotation can reach), vLLM's op, and `rope.apply_(..., table=table)`; each round repeats a call for
about 200 MB of traffic (a decode round lasts milliseconds, not a fraction of one, so that one preemption
does not decide it). It prints, for vLLM and posenc, the median over rounds of (the round's time / the copy's
time in the same round) and the 25th-75th percentile of those ratios, then the same for posenc's time over
vLLM's (below 1: posenc ahead; this one needs no copy floor, which under load stalls at two threads), the
load average it started under and the one after each case. vLLM rounds its cos/sin cache to bfloat16 for bfloat16 inputs, so its results differ
from transformers' (float32 tables) by up to ~3e-2; posenc's are bit-identical to transformers'. The script
prints both errors against a float64 rotation.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from pathlib import Path

import torch

CASES = {  # name -> (sequences, tokens each, first position)
    "prefill 4096 tokens": (1, 4096, 0),
    "decode 32 tokens at 4095": (32, 1, 4095),
}
HEADS, DIM = 32, 128


def round_ms(fn, inner: int) -> float:
    """Milliseconds per call over `inner` back-to-back calls."""
    start = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - start) / inner * 1e3


def case(name: str, dtype: torch.dtype, threads: int, rounds: int, ops) -> dict:
    import posenc

    torch.set_num_threads(threads)
    seqs, t, start = CASES[name]
    rope = posenc.Rope(head_dim=DIM)
    table = rope.table(start + t)
    g = torch.Generator().manual_seed(0)
    src_q = torch.randn(seqs, t, HEADS, DIM, generator=g).to(dtype)  # [b, t, h, d]: bthd memory
    src_k = torch.randn(seqs, t, HEADS, DIM, generator=g).to(dtype)
    q, k = src_q.clone(), src_k.clone()
    vq, vk = src_q.clone().view(seqs * t, HEADS * DIM), src_k.clone().view(seqs * t, HEADS * DIM)  # [tokens, h*d]
    pos = (torch.arange(t) + start).expand(seqs, t).contiguous()  # [b, t]
    flat_pos = pos.reshape(-1)
    cache = torch.cat((table.cos, table.sin), -1).to(dtype)  # [max_pos, d], vLLM's cos|sin cache
    floor = lambda: (q.copy_(src_q), k.copy_(src_k))  # noqa: E731
    posenc_fn = lambda: rope.apply_(q, k, pos, layout="bthd", table=table)  # noqa: E731
    vllm_fn = lambda: ops.rotary_embedding(flat_pos, vq, vk, DIM, cache, True)  # noqa: E731
    # errors against a float64 rotation of the same inputs (one call each)
    exact = rope.apply(src_q.double(), src_k.double(), pos, layout="bthd", impl="reference")
    q.copy_(src_q), k.copy_(src_k)
    posenc_fn()
    vq.copy_(src_q.view_as(vq)), vk.copy_(src_k.view_as(vk))
    vllm_fn()
    err = {"posenc": float((q.double() - exact[0]).abs().max()),
           "vllm": float((vq.view_as(src_q).double() - exact[0]).abs().max())}
    inner = max(1, int(2e8 // (src_q.numel() * 2 * src_q.element_size() + 1)))
    times = {"copy": [], "vllm": [], "posenc": []}
    for _ in range(rounds):  # alternating: the three see the same machine state
        for key, fn in (("copy", floor), ("vllm", vllm_fn), ("posenc", posenc_fn)):
            times[key].append(round_ms(fn, inner))
    out = {"case": name, "dtype": str(dtype).replace("torch.", ""), "threads": threads,
           "copy_ms": statistics.median(times["copy"])}
    for key, over in (("vllm", "copy"), ("posenc", "copy"), ("posenc", "vllm")):  # per round: key's time / over's
        ratios = sorted(a / c for a, c in zip(times[key], times[over]))
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        name = f"{key}_x_{over}"
        out[name], out[f"{name}_p25"], out[f"{name}_p75"] = statistics.median(ratios), q1, q3
    return {**out, "vllm_max_err": err["vllm"], "posenc_max_err": err["posenc"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", default="benchmarks/results/vllm-rotary.csv")
    args = p.parse_args()
    import vllm._custom_ops as ops  # noqa: F401  (registers torch.ops._C.rotary_embedding)

    rows = []
    print(f"load average at start: {os.getloadavg()[0]:.1f} (1 min) on {os.cpu_count()} cores", flush=True)
    print("| case | threads | vLLM x copy (p25-p75) | posenc x copy | posenc x vLLM | vLLM max err | posenc max err | load |")
    print("|---|---|---|---|---|---|---|---|")
    for threads in [int(x) for x in args.threads.split(",")]:
        for name in CASES:
            for dtype in (torch.float32, torch.bfloat16):
                rows.append(case(name, dtype, threads, args.rounds, ops))
                r = rows[-1]
                cells = [f"{r[n]:.2f}x ({r[n + '_p25']:.2f}-{r[n + '_p75']:.2f})"
                         for n in ("vllm_x_copy", "posenc_x_copy", "posenc_x_vllm")]
                print(f"| {r['case']}, {r['dtype']} | {threads} | {' | '.join(cells)} | "
                      f"{r['vllm_max_err']:.1e} | {r['posenc_max_err']:.1e} | {os.getloadavg()[0]:.1f} |", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
