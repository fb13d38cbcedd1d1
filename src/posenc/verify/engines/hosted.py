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

__all__ = ["RuleNotImplemented", "HostedLogitsEngine", "HostedScoringEngine", "SharedProcess", "llamacpp_params",
           "llamacpp_engine", "check_engine_output", "engine_timeout"]

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


class SharedProcess:
    """One engine host process whose adapter serves several configurations, one active at a time: before
    each call the engine's configuration is made active (`configure(config)`, a no-op when it already is)."""

    def __init__(self, proc: EngineProcess) -> None:
        self.proc, self.active = proc, None  # active: (process start number, configuration as JSON)

    def activate(self, config: dict[str, Any]) -> None:
        import json

        key = json.dumps(config, sort_keys=True)
        if self.proc.proc is not None and self.active == (self.proc.starts, key):
            return
        self.active = None
        answer = self.proc.call("configure", timeout=self.proc.load_timeout, config=config)
        if not isinstance(answer, dict):
            raise EngineFailure(f"configure: malformed answer: {type(answer).__name__}")
        if answer.get("refused"):
            raise EngineFailure(f"configure: the engine refused this configuration: {answer['refused']}", True)
        self.active = (self.proc.starts, key)

    def close(self) -> None:
        self.active = None
        self.proc.close()


class HostedScoringEngine:
    """The scoring protocol over an `EngineProcess` whose adapter has `score` and `generate`.

    With `shared` (a `SharedProcess`), every call first makes `config` active in that process; otherwise
    the process is this engine's own. `score` and `generate` take `positions=[offset, gap_at, gap]`
    (capability `positions`): the engine's own position p becomes `offset + p + gap * (p >= gap_at)`.
    """

    protocol = "scoring"

    def __init__(self, proc: EngineProcess | None, capabilities: set[str], *, shared: SharedProcess | None = None,
                 config: dict[str, Any] | None = None) -> None:
        self.shared, self.config = shared, config
        self.proc = shared.proc if shared is not None else proc
        self.capabilities = set(capabilities)

    def _call(self, method: str, **args: Any) -> Any:
        if self.shared is not None:
            self.shared.activate(self.config or {})
        return self.proc.call(method, **{k: v for k, v in args.items() if v is not None})

    def score(self, batch: list[list[int]], top_k: int = 1, positions: list | None = None
              ) -> list[dict[str, np.ndarray]]:
        out = self._call("score", batch=[[int(i) for i in ids] for ids in batch], top_k=int(top_k),
                         positions=self._positions(positions))
        if not isinstance(out, list) or len(out) != len(batch):
            raise EngineFailure(f"score: malformed answer: expected {len(batch)} results, got {type(out).__name__}")
        return [{"logprobs": check_engine_output("score", r.get("logprobs"), (len(ids),)),
                 "top1": check_engine_output("score", r.get("top1"), (len(ids),))} for r, ids in zip(out, batch)]

    def generate(self, ids: list[int], n: int, positions: list | None = None) -> dict[str, Any]:
        out = self._call("generate", ids=[int(i) for i in ids], n=int(n), positions=self._positions(positions))
        if not isinstance(out, dict):
            raise EngineFailure(f"generate: malformed answer: {type(out).__name__}")
        return {"tokens": check_engine_output("generate", out.get("tokens"), (n,)),
                "logprobs": check_engine_output("generate", out.get("logprobs"), (n,)),
                "cached_tokens": int(out.get("cached_tokens", 0))}

    def _positions(self, positions: list | None) -> list | None:
        if positions is None:
            return None
        if "positions" not in self.capabilities:
            raise EngineFailure("positions: this engine has no position map (capability `positions`)")
        offset, gap_at, gap = positions
        return [int(offset), None if gap_at is None else int(gap_at), int(gap)]

    def with_chunked_prefill(self, tokens: int | None) -> "HostedScoringEngine":
        """The same engine with its prefill split in chunks of `tokens` (None: chunked prefill off); a new
        configuration of the shared process, or a new process with `chunk` added to the load arguments."""
        if "chunked_prefill" not in self.capabilities:
            raise EngineFailure("chunked prefill: not a capability of this engine")
        chunk = None if tokens is None else int(tokens)
        if self.shared is not None:
            return HostedScoringEngine(None, self.capabilities, shared=self.shared,
                                       config={**(self.config or {}), "chunk": chunk})
        p = self.proc
        return HostedScoringEngine(EngineProcess(p.python, p.adapter, {**p.load_args, "chunk": chunk},
                                                 timeout=p.timeout, load_timeout=p.load_timeout, env=p.env),
                                   self.capabilities)

    def close(self) -> None:
        if self.shared is None:  # a shared process outlives its engines (the factory closes it)
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

