"""`--engine openai:URL`: any OpenAI-compatible completions server through the scoring protocol.

`POST URL/v1/completions` with the prompt as token ids, `echo: true` and `logprobs: k` returns the
prompt tokens' logprobs (the first is null) followed by the generated ones; `return_tokens_as_token_ids`
(vLLM; others ignore it) names tokens `token_id:N`, which is how top-1 ids and generated tokens are read.
The server's RoPE rule is its own: every other rule is `n/a` here. Standard library only (`httpclient`:
one deadline per request, no redirects, a size cap); a refused connection, a timeout, an HTTP error or
an answer that is not the expected JSON is an EngineFailure that says what was expected and what came.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import numpy as np
import torch

from .hosted import check_engine_output, engine_timeout
from .httpclient import request_json
from .process import EngineFailure

__all__ = ["OpenAIEngine", "openai_factory"]


def _token_id(token: Any) -> int:
    """`"token_id:42"` -> 42; anything else -> -1 (a server that names tokens by their text)."""
    if isinstance(token, str) and token.startswith("token_id:"):
        try:
            return int(token[len("token_id:"):])
        except ValueError:
            return -1
    return -1


def _number(value: Any, where: str) -> float:
    """A logprob entry: a number, or null (NaN); EngineFailure naming the entry otherwise."""
    if value is None:
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise EngineFailure(f"{where} is {value!r}, expected a number or null")
    return float(value)


class OpenAIEngine:
    protocol = "scoring"
    capabilities = {"prefix_caching"}

    def __init__(self, url: str, timeout: float | None = None, max_bytes: int | None = None) -> None:
        self.url, self.timeout = url.rstrip("/"), engine_timeout() if timeout is None else timeout
        self.max_bytes = max_bytes
        models = self._request("GET", "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not isinstance(data, list) or not data or not isinstance(data[0], dict) or "id" not in data[0]:
            raise EngineFailure(f"/v1/models: expected {{\"data\": [{{\"id\": MODEL}}, ...]}} naming the served model, "
                                f"got {str(models)[:200]}")
        self.model = data[0]["id"]

    def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        return request_json(self.url + path, method, body, timeout=self.timeout, max_bytes=self.max_bytes)

    def _completions(self, prompt: Any, count: int, **params: Any) -> list[dict]:
        """The `logprobs` object of each of `count` choices (sorted by index), with the answer's `usage`."""
        out = self._request("POST", "/v1/completions", {"model": self.model, "prompt": prompt, "temperature": 0,
                                                         "return_tokens_as_token_ids": True, **params})
        choices = out.get("choices") if isinstance(out, dict) else None
        if not isinstance(choices, list):
            raise EngineFailure(f"/v1/completions: the answer has no `choices` list: {str(out)[:200]}")
        if len(choices) != count:
            raise EngineFailure(f"/v1/completions: {len(choices)} choices for {count} prompts (one choice per prompt "
                                "expected)")
        result = []
        for i, c in enumerate(sorted(choices, key=lambda c: c.get("index", 0) if isinstance(c, dict) else 0)):
            lp = c.get("logprobs") if isinstance(c, dict) else None
            if not isinstance(lp, dict):
                raise EngineFailure(f"/v1/completions: choice {i} has `logprobs: {json.dumps(lp)[:60]}`; expected an "
                                    "object with `token_logprobs` (the server must honour `logprobs` with `echo`)")
            usage = out.get("usage")
            result.append(dict(lp, usage=usage if isinstance(usage, dict) else {}))
        return result

    @staticmethod
    def _entries(lp: dict, key: str, n: int, i: int, what: str) -> list:
        """The first `n` entries of `lp[key]`; EngineFailure when it is not a list or is shorter."""
        values = lp.get(key)
        if not isinstance(values, list):
            raise EngineFailure(f"/v1/completions: choice {i} has `{key}: {json.dumps(values)[:60]}`; expected a list "
                                f"of {n} entries ({what})")
        if len(values) < n:
            raise EngineFailure(f"/v1/completions: choice {i}: `{key}` has {len(values)} entries for {what} of {n} "
                                "tokens (one per token expected)")
        return values[:n]

    def score(self, batch: list[list[int]], top_k: int = 1) -> list[dict[str, np.ndarray]]:
        results = []
        choices = self._completions([list(map(int, ids)) for ids in batch], len(batch), echo=True,
                                    logprobs=max(1, top_k), max_tokens=1)
        for i, (ids, lp) in enumerate(zip(batch, choices)):
            t = len(ids)
            raw = self._entries(lp, "token_logprobs", t, i, "a prompt (echo)")
            values = [_number(v, f"/v1/completions: choice {i}: token_logprobs[{j}]") for j, v in enumerate(raw)]
            tops = lp.get("top_logprobs")
            tops = self._entries(lp, "top_logprobs", t, i, "a prompt (echo)") if tops is not None else [None] * t
            top1 = [-1 if not isinstance(d, dict) or not d else
                    _token_id(max(d.items(), key=lambda kv: _number(kv[1], "top_logprobs"))[0]) for d in tops]
            results.append({"logprobs": check_engine_output("score", np.array(values, dtype=np.float64), (t,)),
                            "top1": check_engine_output("score", np.array(top1, dtype=np.int64), (t,))})
        return results

    def generate(self, ids: list[int], n: int) -> dict[str, Any]:
        lp = self._completions(list(map(int, ids)), 1, logprobs=1, max_tokens=int(n), ignore_eos=True)[0]
        tokens = np.array([_token_id(tok) for tok in self._entries(lp, "tokens", n, 0, "generated tokens")],
                          dtype=np.int64)
        if (tokens < 0).any():
            raise EngineFailure("generate: the server does not name tokens by id (return_tokens_as_token_ids)")
        values = [_number(v, f"/v1/completions: choice 0: token_logprobs[{j}]")
                  for j, v in enumerate(self._entries(lp, "token_logprobs", n, 0, "generated tokens"))]
        details = lp["usage"].get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else 0
        return {"tokens": check_engine_output("generate", tokens, (n,)),
                "logprobs": check_engine_output("generate", np.array(values, dtype=np.float64), (n,)),
                "cached_tokens": int(cached) if isinstance(cached, int) else 0}

    def close(self) -> None:
        pass


def openai_factory(url: str) -> Callable[..., Any]:
    """The engine factory for a server at `url` (rules other than the server's own are n/a)."""
    def factory(model_path: str, rope_scaling: dict | None, dtype: torch.dtype) -> OpenAIEngine:
        return OpenAIEngine(url)

    factory.protocol = "scoring"  # type: ignore[attr-defined]
    factory.rule_support = (  # type: ignore[attr-defined]
        lambda rule: None if rule is None else "the server's RoPE rule is fixed when it starts")
    return factory
