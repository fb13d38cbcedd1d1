"""`--engine openai:URL`: any OpenAI-compatible completions server through the scoring protocol.

`POST URL/v1/completions` with the prompt as token ids, `echo: true` and `logprobs: k` returns the
prompt tokens' logprobs (the first is null) followed by the generated ones; `return_tokens_as_token_ids`
(vLLM; others ignore it) names tokens `token_id:N`, which is how top-1 ids and generated tokens are read.
The server's RoPE rule is its own: every other rule is `n/a` here. Standard library only; a refused
connection, a timeout, an HTTP error or an answer that is not the expected JSON is an EngineFailure.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request
from typing import Any, Callable

import numpy as np
import torch

from .hosted import check_engine_output, engine_timeout
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


class OpenAIEngine:
    protocol = "scoring"
    capabilities = {"prefix_caching"}

    def __init__(self, url: str, timeout: float | None = None) -> None:
        self.url, self.timeout = url.rstrip("/"), engine_timeout() if timeout is None else timeout
        self.model = self._request("GET", "/v1/models")["data"][0]["id"]

    def _request(self, method: str, path: str, body: dict | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            raise EngineFailure(f"{path}: HTTP {exc.code}: {exc.read()[:400].decode(errors='replace')}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            raise EngineFailure(f"{path}: no answer from {self.url} ({exc})") from None
        try:
            return json.loads(raw)
        except ValueError:
            raise EngineFailure(f"{path}: malformed answer (not JSON): {raw[:200]!r}") from None

    def _completions(self, prompt: Any, **params: Any) -> list[dict]:
        out = self._request("POST", "/v1/completions", {"model": self.model, "prompt": prompt, "temperature": 0,
                                                         "return_tokens_as_token_ids": True, **params})
        try:
            choices = sorted(out["choices"], key=lambda c: c.get("index", 0))
            return [dict(c["logprobs"], usage=out.get("usage") or {}) for c in choices]
        except (KeyError, TypeError) as exc:
            raise EngineFailure(f"/v1/completions: malformed answer (no {exc} in {str(out)[:200]})") from None

    def score(self, batch: list[list[int]], top_k: int = 1) -> list[dict[str, np.ndarray]]:
        results = []
        choices = self._completions([list(map(int, ids)) for ids in batch], echo=True, logprobs=max(1, top_k),
                                    max_tokens=1)
        if len(choices) != len(batch):
            raise EngineFailure(f"/v1/completions: malformed answer: {len(choices)} choices for {len(batch)} prompts")
        for ids, lp in zip(batch, choices):
            t = len(ids)
            values = [math.nan if v is None else float(v) for v in lp.get("token_logprobs", [])[:t]]
            tops = lp.get("top_logprobs") or [None] * t
            top1 = [-1 if not d else _token_id(max(d.items(), key=lambda kv: kv[1])[0]) for d in tops[:t]]
            results.append({"logprobs": check_engine_output("score", np.array(values, dtype=np.float64), (t,)),
                            "top1": check_engine_output("score", np.array(top1, dtype=np.int64), (t,))})
        return results

    def generate(self, ids: list[int], n: int) -> dict[str, Any]:
        lp = self._completions(list(map(int, ids)), logprobs=1, max_tokens=int(n), ignore_eos=True)[0]
        tokens = np.array([_token_id(tok) for tok in lp.get("tokens", [])], dtype=np.int64)
        if (tokens < 0).any():
            raise EngineFailure("generate: the server does not name tokens by id (return_tokens_as_token_ids)")
        details = lp["usage"].get("prompt_tokens_details") or {}
        return {"tokens": check_engine_output("generate", tokens, (n,)),
                "logprobs": check_engine_output("generate", np.array(lp.get("token_logprobs", []), dtype=np.float64),
                                                (n,)),
                "cached_tokens": int(details.get("cached_tokens") or 0)}

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
