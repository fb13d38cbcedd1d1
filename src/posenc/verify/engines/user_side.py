"""Host-side adapter for `--engine MODULE:FACTORY`: the user's factory and its engines in a worker process.

Run by the engine host (`host.py`) under verify's own interpreter, with verify's `sys.path` as
`PYTHONPATH`. `load(spec)` imports MODULE and finds FACTORY (an import error or a missing factory is an
answer, not a crash); `build(...)` calls the factory and keeps the engine under a handle; `forward`,
`new_cache`, `score`, `generate` and `mrope` call the engine of a handle with numpy arrays in and out.
Whatever the engine does to this process (exit, signal, segfault, hang) is seen by the client as a dead
or silent process; exceptions (SystemExit included) go back as text.
"""

from __future__ import annotations

import importlib
from collections import OrderedDict
from typing import Any

import numpy as np
import torch

CACHES_KEPT = 16  # caches kept per engine (a row holds one or two at a time); older handles are dropped


def _tensor(array: Any) -> torch.Tensor:
    return torch.from_numpy(np.array(array).astype(np.int64))


def _array(out: Any, what: str) -> np.ndarray:
    """An engine's tensor answer as a float32 (or integer, for positions) ndarray; TypeError for anything else."""
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{what} returned {type(out).__name__}, expected a torch.Tensor")
    out = out.detach().cpu()
    return (out.float() if out.is_floating_point() else out).numpy()


class Worker:
    def __init__(self, spec: str) -> None:
        self.spec, self.error, self.factory = spec, None, None
        self.engines: dict[int, Any] = {}
        self.caches: dict[int, OrderedDict] = {}
        self.next_handle = 0
        module_name, _, attr = spec.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            self.error = ["import", f"{type(exc).__name__}: {exc}"]
            return
        self.factory = getattr(module, attr, None)
        if not callable(self.factory):
            self.error = ["callable", f"{attr} is {type(self.factory).__name__}"]

    def describe(self) -> dict[str, Any]:
        """What the factory declares: protocol, whether it has `rule_support`, its `position_gaps` reason."""
        if self.error is not None:
            return {"error": self.error}
        gaps = getattr(self.factory, "position_gaps", None)
        return {"protocol": str(getattr(self.factory, "protocol", "logits")),
                "rule_support": callable(getattr(self.factory, "rule_support", None)),
                "position_gaps": None if gaps is None else str(gaps)}

    def rule_support(self, rule: Any = None) -> Any:
        reason = self.factory.rule_support(rule)
        return None if reason is None else str(reason)

    def build(self, model_path: str, rope_scaling: Any = None, dtype: str = "float32") -> dict[str, Any]:
        engine = self.factory(model_path, rope_scaling, getattr(torch, dtype))
        self.next_handle += 1
        self.engines[self.next_handle] = engine
        self.caches[self.next_handle] = OrderedDict()
        caps = getattr(engine, "capabilities", ())
        return {"handle": self.next_handle, "capabilities": sorted(str(c) for c in caps),
                "mrope": callable(getattr(engine, "mrope_position_ids", None))}

    def drop(self, engine: int) -> None:
        self.engines.pop(engine, None)
        self.caches.pop(engine, None)

    def new_cache(self, engine: int, batch_size: int, capacity: int) -> int:
        self.next_handle += 1
        caches = self.caches[engine]
        caches[self.next_handle] = self.engines[engine].new_cache(int(batch_size), int(capacity))
        while len(caches) > CACHES_KEPT:
            caches.popitem(last=False)
        return self.next_handle

    def forward(self, engine: int, ids: Any, mask: Any = None, positions: Any = None, cache: Any = None) -> np.ndarray:
        kwargs: dict[str, Any] = {}
        if cache is not None:
            if cache not in self.caches[engine]:
                raise KeyError(f"cache {cache} was dropped (verify keeps the last {CACHES_KEPT} per engine)")
            kwargs["cache"] = self.caches[engine][cache]
        if mask is not None:
            kwargs["attention_mask"] = _tensor(mask)
        if positions is not None:
            kwargs["position_ids"] = _tensor(positions)
        return _array(self.engines[engine].forward(_tensor(ids), **kwargs), "forward")

    def score(self, engine: int, batch: list, top_k: int = 1, positions: Any = None) -> Any:
        extra = {} if positions is None else {"positions": positions}
        return [{k: np.asarray(v) for k, v in r.items()} if isinstance(r, dict) else r
                for r in self.engines[engine].score(batch, top_k, **extra)]

    def generate(self, engine: int, ids: list, n: int, positions: Any = None) -> Any:
        extra = {} if positions is None else {"positions": positions}
        out = self.engines[engine].generate(ids, n, **extra)
        return {k: np.asarray(v) if isinstance(v, (list, np.ndarray, torch.Tensor)) else v for k, v in out.items()} \
            if isinstance(out, dict) else out

    def mrope(self, engine: int, ids: Any, kwargs: dict[str, Any]) -> list:
        pos, delta = self.engines[engine].mrope_position_ids(_tensor(ids), **kwargs)
        return [_array(pos, "mrope_position_ids"), _array(delta, "mrope_position_ids")]


def load(spec: str) -> Worker:
    """The worker process's adapter (called once, by the host, in the process it owns: no autograd there; an
    import alone changes nothing, as the doctests' import of every module shows)."""
    torch.set_grad_enabled(False)
    return Worker(spec)
