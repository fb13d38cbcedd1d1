"""posenc's decoder vs transformers' LlamaForCausalLM (sdpa) on SmolLM2-135M, same weights, side by side.

Prefill of N real tokens (CPython's pydoc_data.topics text) and greedy decode with a KV cache, fp32,
1 thread by default. The two models alternate within each repeat so that machine load hits both alike;
the table reports the best (minimum) wall and CPU seconds per phase and the ratio posenc / transformers
(< 1 means posenc is faster). Not a test: timings on a shared machine are noisy, compare ratios.

    python benchmarks/decoder_vs_transformers.py --tokens 512 --decode 32 --repeats 3
"""

from __future__ import annotations

import argparse
import time

import torch


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - wall, time.process_time() - cpu


def hf_twin(model):
    """transformers' LlamaForCausalLM (sdpa) holding the decoder's very tensors."""
    import transformers

    config = transformers.LlamaConfig(**{k: v for k, v in model.config.items() if k != "model_type"})
    config._attn_implementation = "sdpa"
    with torch.device("meta"):
        hf = transformers.LlamaForCausalLM(config)
    state = {(k if k == "lm_head.weight" else "model." + k): v for k, v in model.state_dict().items()}
    hf.load_state_dict(state, assign=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)
    return hf.eval()


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

    from posenc.models import Decoder, embedded_model_path, load_tokenizer

    path = args.model or embedded_model_path()
    print(f"loading {path} ...", flush=True)
    model = Decoder.from_pretrained(path)  # fp32, sdpa
    hf = hf_twin(model)
    tokenizer = load_tokenizer(path)
    text = "\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = torch.tensor([tokenizer.encode(text[: 8 * args.tokens])[: args.tokens]])
    best: dict[str, list[float]] = {}
    with torch.inference_mode():
        for repeat in range(args.repeats):
            for name, fn, engine in (("posenc", run_posenc, model), ("transformers", run_hf, hf)):
                *times, tokens = fn(engine, ids, args.decode)
                best[name] = [min(a, b) for a, b in zip(best.get(name, times), times)]
                best[name + " tokens"] = tokens
                print(f"  repeat {repeat + 1}/{args.repeats} {name}: prefill {times[0]:.3f} s, "
                      f"decode {1000 * times[2]:.1f} ms/token", flush=True)
    same = best["posenc tokens"] == best["transformers tokens"]
    print(f"\nSmolLM2-135M fp32, {args.threads} thread(s), prefill {args.tokens} tokens, decode {args.decode} "
          f"tokens; best of {args.repeats}; greedy tokens identical: {same}")
    print(f"{'phase':<18}{'posenc':>12}{'transformers':>14}{'ratio':>8}")
    labels = ("prefill wall s", "prefill cpu s", "decode wall ms", "decode cpu ms")
    for i, label in enumerate(labels):
        scale = 1000.0 if "ms" in label else 1.0
        ours, theirs = best["posenc"][i] * scale, best["transformers"][i] * scale
        print(f"{label:<18}{ours:>12.3f}{theirs:>14.3f}{ours / theirs:>8.3f}")


if __name__ == "__main__":
    main()
