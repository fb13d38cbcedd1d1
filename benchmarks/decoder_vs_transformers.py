"""posenc's decoder vs transformers' LlamaForCausalLM (sdpa) on SmolLM2-135M, same weights, side by side.

Prefill of N real tokens (CPython's pydoc_data.topics text) and greedy decode with a KV cache, fp32,
1 thread by default. The two models alternate within each repeat so that machine load hits both alike;
the table reports the best and median wall and CPU seconds per phase and the ratio posenc / transformers
(< 1 means posenc is faster). Not a test: timings on a shared machine are noisy, compare ratios.

    python benchmarks/decoder_vs_transformers.py --tokens 512 --decode 32 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def run_posenc(model, ids, steps):
    cache = model.new_cache(1, ids.shape[1] + steps)
    (logits, prefill, prefill_cpu) = timed(lambda: model(ids, cache=cache))
    token = logits[:, -1:].argmax(-1)

    def decode():
        nonlocal token
        out = []
        for _ in range(steps):
            token = model(token, cache=cache)[:, -1:].argmax(-1)
            out.append(int(token))
        return out
    tokens, wall, cpu = timed(decode)
    return prefill, prefill_cpu, wall / steps, cpu / steps, tokens


def run_hf(hf, ids, steps):
    from transformers import DynamicCache

    cache = DynamicCache()
    out, prefill, prefill_cpu = timed(lambda: hf(ids, past_key_values=cache, use_cache=True))
    token = out.logits[:, -1:].argmax(-1)

    def decode():
        nonlocal token
        tokens = []
        for _ in range(steps):
            token = hf(token, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            tokens.append(int(token))
        return tokens
    tokens, wall, cpu = timed(decode)
    return prefill, prefill_cpu, wall / steps, cpu / steps, tokens


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=512, help="prefill length (default 512)")
    parser.add_argument("--decode", type=int, default=32, help="greedy decode steps after the prefill (default 32)")
    parser.add_argument("--repeats", type=int, default=3, help="alternating repeats; the best is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--model", default=None, help="GGUF or transformers directory (default: embedded SmolLM2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    import pydoc_data.topics

    from posenc.models import Decoder, embedded_model_path, load_tokenizer, to_transformers

    path = args.model or embedded_model_path()
    print(f"loading {path} ...", flush=True)
    model = Decoder.from_pretrained(path)  # fp32, sdpa
    hf = to_transformers(model)  # LlamaForCausalLM, sdpa, the very same tensors
    tokenizer = load_tokenizer(path)
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = torch.tensor([tokenizer.encode(text[: 8 * args.tokens])[: args.tokens]])
    runs: dict[str, list[list[float]]] = {"posenc": [], "transformers": []}
    tokens: dict[str, list[int]] = {}
    with torch.inference_mode():
        for repeat in range(args.repeats):
            for name, fn, engine in (("posenc", run_posenc, model), ("transformers", run_hf, hf)):
                *times, tokens[name] = fn(engine, ids, args.decode)
                runs[name].append(times)
                print(f"  repeat {repeat + 1}/{args.repeats} {name}: prefill {times[0]:.3f} s "
                      f"(cpu {times[1]:.3f}), decode {1000 * times[2]:.1f} ms/token (cpu {1000 * times[3]:.1f})",
                      flush=True)
    same = tokens["posenc"] == tokens["transformers"]
    print(f"\n{Path(str(path)).name}, fp32, {args.threads} thread(s), prefill {args.tokens} tokens, decode "
          f"{args.decode} tokens, {args.repeats} alternating repeats; greedy tokens identical: {same}")
    print(f"{'phase':<16}{'stat':<8}{'posenc':>10}{'transformers':>14}{'ratio':>8}")
    labels = ("prefill wall s", "prefill cpu s", "decode wall ms", "decode cpu ms")
    for i, label in enumerate(labels):
        scale = 1000.0 if "ms" in label else 1.0
        for stat, reduce in (("best", min), ("median", statistics.median)):
            ours, theirs = (reduce(r[i] for r in runs[name]) * scale for name in ("posenc", "transformers"))
            print(f"{label:<16}{stat:<8}{ours:>10.3f}{theirs:>14.3f}{ours / theirs:>8.3f}")


if __name__ == "__main__":
    main()
