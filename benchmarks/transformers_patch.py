"""Stock transformers vs the same model patched by `posenc.integrations.transformers.patch`.

`--model smollm2` (default): two `LlamaForCausalLM` instances on the very same SmolLM2-135M tensors (posenc's
loader, `to_transformers`); `--model llama512`: a random Llama of hidden 512, 4 layers, 8 heads, and a copy of
it. One of the two is patched (default rule, policy recompute). Per repeat each runs a prefill of N real tokens and greedy decode
steps through a `DynamicCache`; the two are interleaved call by call (prefill, then each decode step of
one and the same step of the other, which goes first swapping every step and every repeat), so machine load
hits both alike. 1 thread by default. Writes tidy CSV rows (provider, phase, tokens, p20/p50/p80 ms) and
prints the medians and the paired ratios patched / stock (each prefill pair and each decode-step pair; < 1:
the patched model is faster), with their p20 and p80. Not a test: compare ratios.

    python benchmarks/transformers_patch.py --tokens 256 --decode 32 --repeats 7
    python benchmarks/transformers_patch.py --model llama512 --repeats 20
"""

from __future__ import annotations

import argparse
import copy
import csv
import statistics
import time
from pathlib import Path

import torch


def run(model, ids, steps):
    """`(prefill seconds, seconds per decode step, generated tokens)`."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    out = model(ids, cache=cache, use_cache=True)
    prefill = time.perf_counter() - start
    token, tokens = out.logits[:, -1:].argmax(-1), []
    start = time.perf_counter()
    for _ in range(steps):
        token = model(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
        tokens.append(int(token))
    return prefill, (time.perf_counter() - start) / steps, tokens


def paired_round(models, ids, steps, first):
    """One round, the models interleaved at every call (`first` goes first, then they swap each step):
    `({name: prefill seconds}, {name: [seconds of each decode step]}, {name: generated tokens})`."""
    from transformers import DynamicCache

    names = list(models) if first == 0 else list(models)[::-1]
    caches = {n: DynamicCache(config=models[n].config) for n in names}
    prefill, steps_s, tokens, last = {}, {n: [] for n in names}, {n: [] for n in names}, {}
    for n in names:
        start = time.perf_counter()
        out = models[n](ids, cache=caches[n], use_cache=True)
        prefill[n] = time.perf_counter() - start
        last[n] = out.logits[:, -1:].argmax(-1)
    for i in range(steps):
        for n in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            out = models[n](last[n], cache=caches[n], use_cache=True)
            steps_s[n].append(time.perf_counter() - start)
            last[n] = out.logits[:, -1:].argmax(-1)
            tokens[n].append(int(last[n]))
    return prefill, steps_s, tokens


def rotation_rounds(rounds: int) -> None:
    """The rotation alone, llama512 shapes (4 layers, 8 heads of 64): stock's rotary module plus four
    `apply_rotary_pos_emb` against the patch's four calls on its held tables; interleaved rounds, medians."""
    import transformers
    from transformers.models.llama import modeling_llama

    import posenc
    from posenc.integrations.transformers.decoder import Options, Positions, Tables, rotate

    config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=8, num_key_value_heads=8,
                                      num_hidden_layers=4)
    rotary, rope, tables, options = modeling_llama.LlamaRotaryEmbedding(config), posenc.Rope.from_hf_config(config), \
        Tables(), Options()

    def stock(q, k, pos):
        cos, sin = rotary(q, pos)
        for _ in range(4):
            modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)

    def patched(q, k, pos):
        marker = Positions(pos, None)  # one per forward, as the patched rotary module returns
        for _ in range(4):
            rotate(rope, q, k, marker, options, tables)

    for t, cached in ((256, 0), (1, 256)):
        q, k = torch.randn(1, 8, t, 64), torch.randn(1, 8, t, 64)
        pos = torch.arange(cached, cached + t)[None]
        times = {"stock": [], "patched": []}
        for r in range(rounds):
            for name, fn in (("stock", stock), ("patched", patched))[:: 1 if r % 2 else -1]:
                start = time.perf_counter()
                fn(q, k, pos)
                times[name].append(time.perf_counter() - start)
        a, b = statistics.median(times["stock"]), statistics.median(times["patched"])
        print(f"rotation, {t} token(s) after {cached}: stock {1e6 * a:7.0f} us   patched {1e6 * b:7.0f} us   "
              f"patched/stock {b / a:.2f}")


def quantiles(values):
    q = statistics.quantiles(values, n=10, method="inclusive") if len(values) > 1 else values * 9
    return q[1], statistics.median(values), q[7]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "llama512"), default="smollm2")
    parser.add_argument("--tokens", type=int, default=256, help="prefill length (real text)")
    parser.add_argument("--decode", type=int, default=32, help="greedy decode steps per repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rotation", action="store_true", help="time the rotation alone (llama512 shapes)")
    parser.add_argument("--control", action="store_true", help="A/A: the second model is an unpatched copy too "
                        "(the ratios then show the noise floor of the machine)")
    parser.add_argument("--out", default=None, help="CSV rows (default results/transformers_patch[_MODEL].csv)")
    args = parser.parse_args()
    suffix = "" if args.model == "smollm2" else f"_{args.model}"
    args.out = args.out or str(Path(__file__).parent / "results" / f"transformers_patch{suffix}.csv")
    torch.set_num_threads(args.threads)
    if args.rotation:
        rotation_rounds(max(args.repeats, 50))
        return

    import pydoc_data.topics

    from posenc.integrations.transformers import patch
    from posenc.models import Decoder, embedded_model_path, load_tokenizer, to_transformers

    if args.model == "llama512":
        import transformers

        config = transformers.LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376,
                                          num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8)
        torch.manual_seed(0)
        stock = transformers.LlamaForCausalLM(config).eval()
        patched = copy.deepcopy(stock) if args.control else patch(copy.deepcopy(stock))
        ids = torch.randint(0, 32000, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    else:
        path = embedded_model_path()
        decoder = Decoder.from_pretrained(path)
        stock, patched = to_transformers(decoder), to_transformers(decoder)
        patched = patched if args.control else patch(patched)
        topics = pydoc_data.topics.topics
        text = "\n".join(topics[k] for k in sorted(topics))
        ids = torch.tensor([load_tokenizer(path).encode(text[: args.tokens * 8])[: args.tokens]])
    models = {"transformers": stock, "transformers+posenc": patched}
    times = {(name, phase): [] for name in models for phase in ("prefill", "decode")}
    outputs = {}
    with torch.no_grad():
        for name, model in models.items():  # warm-up (and the kernel build) outside the timings
            run(model, ids[:, :16], 2)
        ratios = {"prefill": [], "decode": []}
        for r in range(args.repeats):
            prefill, steps, tokens = paired_round(models, ids, args.decode, r % 2)
            for name in models:
                times[name, "prefill"].append(prefill[name])
                times[name, "decode"].extend(steps[name])
                outputs[name] = tokens[name]
            a, b = models
            ratios["prefill"].append(prefill[b] / prefill[a])
            ratios["decode"] += [y / x for x, y in zip(steps[a], steps[b])]
            print(f"repeat {r + 1}/{args.repeats}", flush=True)
    if outputs["transformers"] != outputs["transformers+posenc"]:
        raise SystemExit("the patched model generated other tokens than stock transformers")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["model", "provider", "phase", "tokens", "threads", "p20_ms", "p50_ms", "p80_ms"])
        for (name, phase), values in times.items():
            writer.writerow([args.model, name, phase, args.tokens, args.threads,
                             *(f"{1e3 * v:.3f}" for v in quantiles(values))])
    print(f"\n{args.model} fp32, {args.threads} thread(s), prefill {args.tokens} tokens, decode {args.decode} steps "
          f"after it, {args.repeats} alternating repeats (median ms)")
    for phase in ("prefill", "decode"):
        a, b = (statistics.median(times[n, phase]) for n in models)
        lo, mid, hi = quantiles(ratios[phase])
        print(f"{phase:8s} transformers {1e3 * a:8.2f}   patched {1e3 * b:8.2f}   patched/stock {b / a:.3f}   "
              f"paired ratios: median {mid:.3f} (p20 {lo:.3f}, p80 {hi:.3f}, n {len(ratios[phase])})")
    print(f"rows: {args.out}")


if __name__ == "__main__":
    main()
