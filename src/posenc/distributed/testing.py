"""Test helpers: spawn N gloo ranks safely, and compare sharded attention with the single-process result.

`spawn(fn, world_size, *args)` starts `world_size` processes (start method "spawn"), each with a
gloo process group on a free local port, one intra-op thread, a collective timeout and a
`faulthandler` watchdog, runs `fn(rank, world_size, *args)` and returns the results in rank order. It
never hangs: past `timeout_s` the processes are killed and `SpawnError` is raised with what each rank
said. A rank killed by a signal (rare gloo start-up aborts) is retried once. Where processes or gloo
are unavailable it raises `SpawnUnavailable`, which a test turns into a skip. `fn` must be importable
by the children (a module-level function).

`compare_attention(attn, ...)` runs inside a rank: it builds the global inputs from a seed (the same
on every rank), shards them, runs `attn` forward and backward on the shard, runs single-process
`posenc.attention` on the whole sequence, and returns the max |difference| of the output and of the
q/k/v (and bias-parameter) gradients over this rank's rows.
"""

from __future__ import annotations

import faulthandler
import queue
import socket
import sys
import traceback
from datetime import timedelta
from typing import Any, Callable

import torch

from ..attention import attention
from .collectives import all_reduce_grads
from .layouts import shard_positions, shard_varlen

__all__ = ["SpawnError", "SpawnUnavailable", "free_port", "spawn", "compare_attention", "max_diff"]


class SpawnError(RuntimeError):
    """A spawned rank failed or the group timed out; the message holds every rank's report."""


class SpawnUnavailable(RuntimeError):
    """Processes or the gloo backend cannot be started here (tests skip on it)."""


def free_port() -> int:
    """A TCP port the OS reports free on 127.0.0.1 (race-free enough for a test's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, timeout_s: float, fn: Callable, args: tuple, out: Any) -> None:
    import torch.distributed as dist

    # a hung rank prints where it hangs and exits, before the parent's deadline kills it silently
    faulthandler.dump_traceback_later(max(5.0, timeout_s - 10.0), exit=True)
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    except BaseException:  # no local TCP rendezvous here: the parent reports "unavailable", tests skip
        out.put((rank, "unavailable", traceback.format_exc()))
        faulthandler.cancel_dump_traceback_later()
        return
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
        out.put((rank, "ok", result))
    except BaseException:  # report everything to the parent, which raises
        out.put((rank, "error", traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()


def _available() -> str | None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        return "torch.distributed with gloo is not available"
    if sys.platform == "emscripten":
        return "no processes on this platform"
    return None


def spawn(fn: Callable, world_size: int, *args: Any, timeout_s: float = 120.0, retries: int = 1) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` fresh gloo ranks; return the results by rank.

    Raises:
        SpawnUnavailable: no gloo or no process start here.
        SpawnError: a rank raised, died, or the whole run exceeded `timeout_s` (processes are killed).
    """
    reason = _available()
    if reason:
        raise SpawnUnavailable(reason)
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    for attempt in range(retries + 1):
        out = ctx.Queue()
        try:
            port = free_port()
            procs = [ctx.Process(target=_entry, args=(r, world_size, port, timeout_s, fn, args, out), daemon=True)
                     for r in range(world_size)]
            for p in procs:
                p.start()
        except (OSError, PermissionError, NotImplementedError) as e:
            raise SpawnUnavailable(f"cannot start processes: {e}") from e
        reports, signalled = _collect(procs, out, world_size, timeout_s)
        complete = len(reports) == world_size  # ranks killed after reporting are not failures
        flaky = not complete and signalled and all(k == "ok" for k, _ in reports.values())
        refused = any(k == "unavailable" for k, _ in reports.values())  # maybe the port was taken meanwhile
        if attempt < retries and (flaky or refused):
            print(f"posenc.distributed.testing: {'signals ' + str(signalled) if flaky else 'rendezvous failed'}; "
                  "retrying once", file=sys.stderr)
            continue
        break
    unavailable = [v for kind, v in reports.values() if kind == "unavailable"]
    if unavailable:
        raise SpawnUnavailable(f"gloo cannot start a process group here:\n{unavailable[0]}")
    errors = {r: v for r, (kind, v) in reports.items() if kind == "error"}
    if errors or len(reports) < world_size:
        missing = sorted(set(range(world_size)) - set(reports))
        text = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        raise SpawnError(f"{len(errors)} rank(s) failed, no report from ranks {missing} "
                         f"(signals: {signalled}; timeout {timeout_s}s){text}")
    return [reports[r][1] for r in range(world_size)]


def _collect(procs: list, out: Any, world_size: int, timeout_s: float) -> tuple[dict, list]:
    """Gather each rank's report until all arrive, one fails, or the deadline; then end the processes."""
    import time

    reports: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    while len(reports) < world_size and time.monotonic() < deadline:
        try:
            rank, kind, value = out.get(timeout=0.2)
            reports[rank] = (kind, value)
            if kind != "ok":
                break
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(0.5)  # let the other ranks' reports arrive
                while not out.empty():
                    rank, kind, value = out.get()
                    reports[rank] = (kind, value)
                break
    grace = time.monotonic() + (3.0 if len(reports) == world_size else 1.0)  # reports are in: exits are cosmetic
    for p in procs:
        p.join(timeout=max(0.0, min(grace, deadline) - time.monotonic()))
    # deaths by a signal before the parent killed anyone (the rare gloo start-up abort), not timeouts
    signalled = [p.exitcode for p in procs if p.exitcode is not None and p.exitcode < 0]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    return reports, signalled if len(reports) < world_size else []


def max_diff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """max |a - b| in float64 (inf when exactly one is None, 0 when both are)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else float("inf")
    return float((a.detach().double() - b.detach().double()).abs().max()) if a.numel() else 0.0


def _single_process(q, k, v, grad, encoding, lengths, **kwargs):
    """posenc.attention on the whole sequence (each packed document on its own); returns (out, dq, dk, dv)."""
    full = [x.clone().requires_grad_() for x in (q, k, v)]
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()] if lengths else [0, q.shape[2]]
    outs = []
    for start, end in zip(bounds, bounds[1:]):  # positions restart in every document
        positions = torch.arange(end - start)
        parts = [x[:, :, start:end] for x in full]
        outs.append(attention(*parts, q_positions=positions, k_positions=positions, encoding=encoding, **kwargs))
    out = torch.cat(outs, dim=2)  # [b, hq, S, dv]
    out.backward(grad)
    return out, *(x.grad for x in full)


def compare_attention(attn: Callable, *, rank: int, size: int, seq_len: int, heads: tuple[int, int] = (4, 2),
                      head_dim: int = 8, batch: int = 1, layout: str = "zigzag", encoding: Any = None,
                      lengths: list[int] | None = None, group: Any = None, seed: int = 0,
                      dtype: torch.dtype = torch.float64, **kwargs: Any) -> dict[str, float]:
    """Sharded `attn` vs single-process `posenc.attention` on this rank's rows: max |diff| per quantity.

    Args:
        attn: `ring_attention`, `ulysses_attention` or anything with their signature.
        rank, size: this rank in the CP group and the group's size.
        seq_len, heads (hq, hk), head_dim, batch, dtype: the global problem, drawn from `seed`.
        layout: the sharding of the sequence.
        encoding: passed to both; parameters of a module encoding get their gradient summed over the group.
        lengths: packed documents (summing to seq_len): the oracle attends within each document, positions
            restarting at 0; the shard comes from `shard_varlen` and `attn` gets q/k_documents.
        kwargs: more arguments for both (causal, window, scale, a `[b, S]` key_mask sharded for `attn`, ...).
    Returns:
        `{"out": ..., "dq": ..., "dk": ..., "dv": ..., "dparam": ...}` max absolute differences.
    """
    g = torch.Generator().manual_seed(seed)
    hq, hk = heads
    q = torch.randn(batch, hq, seq_len, head_dim, generator=g, dtype=dtype)
    k = torch.randn(batch, hk, seq_len, head_dim, generator=g, dtype=dtype)
    v = torch.randn(batch, hk, seq_len, head_dim, generator=g, dtype=dtype)
    grad = torch.randn(batch, hq, seq_len, head_dim, generator=g, dtype=dtype)
    params = list(encoding.parameters()) if isinstance(encoding, torch.nn.Module) else []
    for p in params:
        p.grad = None
    expected = _single_process(q, k, v, grad, encoding, lengths, **kwargs)  # out, dq, dk, dv
    expected_params = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None

    if lengths:
        cu = torch.tensor([0, *lengths]).cumsum(0)
        index, positions, documents, _ = shard_varlen(cu, size, rank, layout)  # [n] each
        kwargs = {**kwargs, "q_documents": documents, "k_documents": documents}
    else:
        index = positions = shard_positions(seq_len, size, rank, layout)  # [S/W] global ids
    local = [x.index_select(2, index).requires_grad_() for x in (q, k, v)]  # [b, h, n, d]
    if kwargs.get("key_mask") is not None:
        kwargs = {**kwargs, "key_mask": kwargs["key_mask"].index_select(1, index)}  # [b, n]: this rank's keys
    out = attn(*local, q_positions=positions, k_positions=positions, encoding=encoding, group=group, **kwargs)
    out.backward(grad.index_select(2, index))
    all_reduce_grads(params, group)
    report = {name: max_diff(x, ref.index_select(2, index))
              for name, x, ref in zip(("out", "dq", "dk", "dv"), (out, *(x.grad for x in local)), expected)}
    report["dparam"] = max((max_diff(p.grad, e) for p, e in zip(params, expected_params)), default=0.0)
    return report
