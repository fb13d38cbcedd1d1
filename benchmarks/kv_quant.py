"""Quantized KV cache on the embedded SmolLM2-135M: next-token NLL over real text, and bytes per token.

The text is CPython's `pydoc_data.topics` (the English language-reference topics every CPython ships),
topics sorted by name and joined by blank lines, tokenized with the model's own tokenizer; the first
N + 1 tokens are scored. Scoring writes the text through the cache in chunks (chunked prefill), so every
chunk attends to the keys and values the cache decoded: the quantized ones. The chunk size is a
multiple of the per-channel block (64), so no key is read from the full-precision residual.

Configurations: kv dtype x key storage: "pre" = unrotated store, keys quantized per channel before
RoPE (KVQuant); "post" = rotated store, keys quantized per token after RoPE. Values per token in both.
float32 is the reference (the model's own cache). One CSV row per (tokens, config), written as it finishes:

    python benchmarks/kv_quant.py --tokens 2048 8192 --out benchmarks/results/kv_quant.csv
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import time
from pathlib import Path

import torch

CONFIGS = ("float32", "int4:pre", "int4:post", "int8:pre", "int8:post", "bfloat16:post", "bfloat16:pre",
           "fp8:pre", "fp8:post")
FIELDS = ("tokens", "kv_dtype", "keys", "nll", "ppl", "delta_nll", "bytes_per_token", "measured_bytes_per_token",
          "wall_s", "chunk", "threads", "text")


def real_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[name] for name in sorted(topics.topics))


def score(model, ids: torch.Tensor, chunk: int, config: str) -> tuple[float, float]:
    """Mean next-token NLL of `ids [1, n + 1]` through a cache of `config`, and the cache's bytes per token."""
    n = ids.shape[1] - 1
    kv_dtype, _, keys = config.partition(":")
    store = "unrotated" if keys == "pre" else "rotated"
    cache = model.new_cache(1, n, store=store, kv_dtype=None if kv_dtype == "float32" else kv_dtype)
    total = 0.0
    with torch.no_grad():
        for start in range(0, n, chunk):
            logits = model(ids[:, start:min(start + chunk, n)], cache=cache)[0]  # [t, vocab]
            target = ids[0, start + 1:start + 1 + logits.shape[0]]
            total += float(torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum"))
            print(f"\r  {config:14s} {min(start + chunk, n):6d}/{n} tokens", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    held = getattr(cache, "nbytes", None)
    if held is None:  # the model's own float cache
        held = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
    return total / n, held / n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[2048], help="tokens scored (default 2048)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), help=f"kv_dtype[:pre|:post] (default {CONFIGS})")
    parser.add_argument("--chunk", type=int, default=256, help="prefill chunk (a multiple of 64; default 256)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--out", type=Path, help="CSV file to append rows to (default: stdout only)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from posenc.cache.quant import cache_bytes_per_token
    from posenc.models import Decoder, embedded_model_path, load_tokenizer

    path = embedded_model_path()
    model, tokenizer = Decoder.from_pretrained(path), load_tokenizer(path)
    ids = torch.tensor([tokenizer.encode(real_text())])  # [1, all tokens]
    dims = dict(num_layers=len(model.layers), num_kv_heads=model.num_kv_heads, head_dim=model.head_dim)
    writer = csv.DictWriter(sys.stdout, FIELDS)
    writer.writeheader()
    if args.out and not args.out.exists():
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(",".join(FIELDS) + "\n")
    for n in args.tokens:
        base = None
        for config in args.configs:
            began = time.perf_counter()
            nll, measured = score(model, ids[:, :n + 1], args.chunk, config)
            kv_dtype, _, keys = config.partition(":")
            store = "unrotated" if keys == "pre" else "rotated"
            base = nll if config == "float32" else base
            row = dict(tokens=n, kv_dtype=kv_dtype, keys=keys or "-", nll=f"{nll:.5f}", ppl=f"{math.exp(nll):.4f}",
                       delta_nll="" if base is None else f"{nll - base:+.5f}",
                       bytes_per_token=f"{cache_bytes_per_token(kv_dtype, store=store, **dims):.1f}",
                       measured_bytes_per_token=f"{measured:.1f}", wall_s=f"{time.perf_counter() - began:.0f}",
                       chunk=args.chunk, threads=args.threads, text="pydoc_data.topics")
            writer.writerow(row)
            sys.stdout.flush()
            if args.out:
                with args.out.open("a", newline="") as f:
                    csv.DictWriter(f, FIELDS).writerow(row)


if __name__ == "__main__":
    main()
