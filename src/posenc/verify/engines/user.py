"""`--engine MODULE:FACTORY` out of process: the user's factory runs in a worker process (`user_side.py`
behind the engine host), so nothing it does can end or hang verify.

`UserFactory(spec)` starts the worker, which imports MODULE and checks FACTORY; each call of the factory
builds an engine there and returns a client speaking the same protocol (`forward` / `new_cache`, or
`score` / `generate` for `protocol = "scoring"`). Every call has the `--engine-timeout` deadline (start-up
and building an engine 3x, at least `START_FLOOR`). An exit (any status, `os._exit(0)` included), a signal, a segfault or a hang
is an `EngineFailure` naming it, the row fails with that reason, and the next call starts a fresh worker
(engines are rebuilt in it; caches made before are lost, which fails the row that held them). A
`SystemExit` raised by the engine comes back as an exception like any other.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np
import torch

from ...errors import fail
from .hosted import HERE, HostedLogitsEngine, HostedScoringEngine, RuleNotImplemented, engine_timeout
from .process import EngineFailure, EngineProcess, exception_line

__all__ = ["UserFactory", "START_FLOOR"]

START_FLOOR = 60.0  # seconds start-up and building an engine get at least (importing torch on a loaded machine)


def _first_line(exc: EngineFailure) -> str:
    return exc.reason.splitlines()[0]


class UserFactory:
    """The factory `MODULE:FACTORY` in one worker process shared by its engines.

    Raises:
        PosencError: MODULE does not import or FACTORY is not a callable (checked in the worker), or the
            worker dies or hangs before it can say (the reason named).
    """

    def __init__(self, spec: str, timeout: float | None = None) -> None:
        self.spec = spec
        timeout = engine_timeout() if timeout is None else float(timeout)
        path = os.pathsep.join(p for p in sys.path if p)  # the user's MODULE is found where verify finds modules
        self.proc = EngineProcess(sys.executable, str(HERE / "user_side.py"), {"spec": spec}, timeout=timeout,
                                  load_timeout=max(3 * timeout, START_FLOOR), env={"PYTHONPATH": path})
        try:
            info = self.proc.call("describe", timeout=self.proc.load_timeout)
        except EngineFailure as exc:
            self.proc.close()
            fail("engine", "MODULE:FACTORY whose module imports in a worker process", f"{spec} ({_first_line(exc)})")
        error = info.get("error") if isinstance(info, dict) else ["answer", repr(info)[:200]]
        if error:
            self.proc.close()
            if error[0] == "import":
                fail("engine", "MODULE:FACTORY with an importable MODULE (on sys.path or PYTHONPATH)",
                     f"{spec} ({error[1]})")
            fail("engine", f"a callable {spec.partition(':')[2]} in module {spec.partition(':')[0]}",
                 f"{spec} ({error[1]})")
        self.protocol = info["protocol"]
        if info.get("position_gaps"):
            self.position_gaps = info["position_gaps"]
        if info.get("rule_support"):
            self.rule_support = self._rule_support

    def _rule_support(self, rule: dict | None) -> str | None:
        try:
            return self.proc.call("rule_support", rule=rule)
        except EngineFailure as exc:
            return f"rule_support failed in the worker: {_first_line(exc)}"

    def __call__(self, model_path: str, rope_scaling: dict | None, dtype: torch.dtype) -> Any:
        bound = Bound(self, {"model_path": str(model_path), "rope_scaling": rope_scaling,
                             "dtype": str(dtype).split(".")[-1]})
        built = bound.build()
        if self.protocol == "scoring":
            caps = set(built["capabilities"]) - {"chunked_prefill"}  # a derived engine is not rebuilt by handle
            return HostedScoringEngine(bound, caps)  # type: ignore[arg-type]
        engine = UserLogitsEngine(bound)
        if built["mrope"]:
            engine.mrope_position_ids = engine.mrope  # type: ignore[attr-defined]
        return engine

    def close(self) -> None:
        self.proc.close()


class Bound:
    """The worker seen by one engine: every call names the engine's handle; after a restart of the worker
    the engine is built again (a call holding a cache from before fails: the cache is gone)."""

    def __init__(self, factory: UserFactory, build_args: dict[str, Any]) -> None:
        self.factory, self.build_args = factory, build_args
        self.handle: int | None = None
        self.built_at = -1

    @property
    def starts(self) -> int:
        return self.factory.proc.starts

    @property
    def load_timeout(self) -> float:
        return self.factory.proc.load_timeout

    def _alive(self) -> bool:
        proc = self.factory.proc
        return proc.proc is not None and proc.proc.poll() is None and self.built_at == proc.starts

    def build(self) -> dict[str, Any]:
        try:
            built = self.factory.proc.call("build", timeout=self.factory.proc.load_timeout, **self.build_args)
        except EngineFailure as exc:
            if "RuleNotImplemented" in exception_line(exc.reason):
                raise RuleNotImplemented(exception_line(exc.reason).split(": ", 1)[-1]) from None
            raise EngineFailure(exc.reason.replace("build:", "building the engine:", 1)) from None
        if not isinstance(built, dict) or not isinstance(built.get("handle"), int):
            raise EngineFailure(f"build: malformed answer from the worker: {str(built)[:200]}")
        self.handle, self.built_at = built["handle"], self.factory.proc.starts
        return built

    def call(self, method: str, timeout: float | None = None, **args: Any) -> Any:
        if not self._alive():
            self.build()
            if args.get("cache") is not None:
                raise EngineFailure(f"{method}: the engine process was restarted and lost this cache")
        return self.factory.proc.call(method, timeout, engine=self.handle, **args)

    def close(self) -> None:
        if self._alive():
            try:
                self.factory.proc.call("drop", engine=self.handle)
            except EngineFailure:
                pass
        self.handle = None


class UserLogitsEngine(HostedLogitsEngine):
    """The logits protocol to a user engine in the worker (`new_cache` passes the capacity too)."""

    def new_cache(self, batch_size: int, capacity: int) -> dict:
        handle = self.proc.call("new_cache", batch_size=int(batch_size), capacity=int(capacity))
        return {"handle": handle, "batch": int(batch_size), "starts": self.proc.starts}

    def mrope(self, input_ids: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's own `mrope_position_ids`, called in the worker."""
        pos, delta = self.proc.call("mrope", ids=input_ids.to(torch.int64).numpy(), kwargs=kwargs)
        return torch.from_numpy(np.array(pos)), torch.from_numpy(np.array(delta))
