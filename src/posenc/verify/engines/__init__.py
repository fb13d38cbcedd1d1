"""Engines: what `posenc verify` runs, and the protocol any other implementation can follow.

An engine factory is `FACTORY(model_path: str, rope_scaling: dict | None, dtype: torch.dtype)`. It returns
an object with
- `forward(input_ids, *, attention_mask=None, cache=None, position_ids=None) -> logits [b, t, vocab]`:
  `input_ids [b, t]`; `attention_mask [b, t]` 0/1 for the NEW tokens (0 = padding); `cache` from
  `new_cache`, updated in place; `position_ids [b, t]` explicit logical positions, or None: then the
  engine derives them itself (continuing after the cache, counting only kept tokens).
- `new_cache(batch_size, capacity)`: an empty cache for `batch_size` rows of up to `capacity` tokens.

`rope_scaling` is a transformers `rope_parameters` dict (`rope_type`, `factor`, ...) that replaces the
checkpoint's rule, or None for the checkpoint's own. verify lowers the original length L0 to reach
boundaries cheaply: it puts `original_max_position_embeddings` in the dict and, for `dynamic` (which
reads L0 from the config's `max_position_embeddings`), also `max_position_embeddings`; an engine must
honour both keys.

    >>> sorted(ENGINES)
    ['llama-cpp', 'posenc', 'transformers', 'vllm']

Foreign engines (llama-cpp, vllm) run out of process in their own virtual environments
(`posenc setup-engine NAME`; `hosted.py`); serving engines follow the scoring protocol described there.
`MODULE:FACTORY` engines run out of process too, in a worker under verify's interpreter (`user.py`).
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

import torch

from ...errors import fail
from .checkpoint import CheckpointReader

__all__ = ["ENGINES", "load_factory", "posenc_engine", "transformers_engine", "transformers_patched_engine",
           "llamacpp_engine", "vllm_engine", "with_kv_dtype",
           "split_scaling", "model_config", "CheckpointReader"]


def split_scaling(rope_scaling: dict | None) -> tuple[dict | None, int | None]:
    """`(rope parameters without the L0 override, max_position_embeddings override or None)`."""
    if rope_scaling is None:
        return None, None
    params = {k: v for k, v in rope_scaling.items() if k != "max_position_embeddings"}
    return params, rope_scaling.get("max_position_embeddings")


def model_config(model_path: str, reader: CheckpointReader | None = None) -> dict[str, Any]:
    """The checkpoint's transformers `config.json` dict (read by posenc's loader; GGUF or directory)."""
    return (reader or CheckpointReader()).config(model_path)


def posenc_engine(model_path: str, rope_scaling: dict | None, dtype: torch.dtype, *,
                  reader: CheckpointReader | None = None) -> Any:
    """posenc's own `Decoder` (it follows the protocol as it is), sdpa attention; the tensors from `reader`
    (None: read from disk for this engine alone)."""
    from ...hf.override import with_rope_rule
    from ...models import Decoder

    cfg, state = (reader or CheckpointReader()).read(model_path, dtype)
    cfg = with_rope_rule(cfg, rope_scaling)
    with torch.device("meta"):  # every parameter comes from the checkpoint
        model = Decoder.from_hf_config(cfg)
    model.load_state_dict(state, assign=True)
    return model.to(dtype).eval()


def with_kv_dtype(factory: Callable[..., Any], kv_dtype: str) -> Callable[..., Any]:
    """`factory` whose engines (posenc Decoders) make `QuantizedKVCache`s: kv_dtype "FORMAT:pre" stores keys
    per channel before RoPE (unrotated), "FORMAT:post" per token after it (rotated)."""
    name, _, keys = kv_dtype.partition(":")
    store = "unrotated" if keys == "pre" else "rotated"

    def make(model_path: str, rope_scaling: dict | None, dtype: torch.dtype) -> Any:
        engine = factory(model_path, rope_scaling, dtype)
        plain = engine.new_cache
        engine.new_cache = lambda batch_size, capacity: plain(batch_size, capacity, store=store, kv_dtype=name)
        return engine
    return make


class _HFCache:
    """transformers' `DynamicCache` plus the attention-mask history transformers expects with it."""

    def __init__(self, config: Any, batch_size: int) -> None:
        from transformers import DynamicCache

        self.kv = DynamicCache(config=config)
        self.mask = torch.zeros(batch_size, 0, dtype=torch.long)  # [b, cached]


class TransformersEngine:
    """transformers' `LlamaForCausalLM` behind the protocol; positions derived as `generate()` does."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def new_cache(self, batch_size: int, capacity: int) -> _HFCache:
        return _HFCache(self.model.config, batch_size)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
                cache: _HFCache | None = None, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, t = input_ids.shape
        new_mask = torch.ones(b, t, dtype=torch.long) if attention_mask is None else attention_mask.long()
        past = cache.mask if cache is not None else torch.zeros(b, 0, dtype=torch.long)
        full = torch.cat((past, new_mask), dim=1)  # [b, cached + t]
        if position_ids is None:  # generate(): cumsum of the mask, padding at 1, the new columns
            position_ids = (full.cumsum(-1) - 1).masked_fill(full == 0, 1)[:, -t:]
        out = self.model(input_ids=input_ids, attention_mask=full, position_ids=position_ids.expand(b, t),
                         cache=cache.kv if cache is not None else None, use_cache=cache is not None)
        if cache is not None:
            cache.mask = full
        return out.logits  # [b, t, vocab]

    __call__ = forward


def transformers_engine(model_path: str, rope_scaling: dict | None, dtype: torch.dtype, *,
                        reader: CheckpointReader | None = None) -> TransformersEngine:
    """transformers' `LlamaForCausalLM` (its own forward, rotary module and cache) from the config, on the
    tensors posenc's loader reads (`posenc.models.to_transformers`; no accelerate; `reader` as for
    `posenc_engine`)."""
    from transformers.utils import logging

    from ...models import to_transformers

    logging.set_verbosity_error()
    return TransformersEngine(to_transformers(posenc_engine(model_path, rope_scaling, dtype, reader=reader)))


def transformers_patched_engine(model_path: str, rope_scaling: dict | None, dtype: torch.dtype,
                                policy: str = "recompute", *, reader: CheckpointReader | None = None
                                ) -> TransformersEngine:
    """`transformers_engine` with `posenc.integrations.transformers.patch(model, policy=policy)` applied
    (`posenc verify --engine transformers --patch`)."""
    from ...integrations.transformers import patch

    engine = transformers_engine(model_path, rope_scaling, dtype, reader=reader)
    patch(engine.model, policy=policy)
    return engine


def llamacpp_engine(model_path: str, rope_scaling: dict | None, dtype: torch.dtype) -> Any:
    """llama.cpp in its own process (see `posenc.verify.engines.hosted.llamacpp_engine`)."""
    from .hosted import llamacpp_engine as hosted

    return hosted(model_path, rope_scaling, dtype)


def _llamacpp_support(rule: dict | None) -> str | None:
    from .hosted import RuleNotImplemented, llamacpp_params

    try:
        llamacpp_params(rule)
    except RuleNotImplemented as exc:
        return str(exc).split(": ", 1)[-1]
    return None


def vllm_engine(model_path: str, rope_scaling: dict | None, dtype: torch.dtype) -> Any:
    """vLLM's offline API in its own virtual environment (see `posenc.verify.engines.vllm_client.vllm_engine`)."""
    from .vllm_client import vllm_engine as hosted

    return hosted(model_path, rope_scaling, dtype)


llamacpp_engine.rule_support = _llamacpp_support  # type: ignore[attr-defined]
# llama.cpp's batch validation (0.3.36) requires a sequence's positions to stay consecutive (Y = X + 1), within a
# batch and after its cache: "sequence positions are not continuous". The relativity row's gap is n/a there.
llamacpp_engine.position_gaps = ("llama.cpp refuses non-consecutive positions within a sequence: "  # type: ignore[attr-defined]
                                 "'sequence positions are not continuous'")
vllm_engine.protocol = "scoring"  # type: ignore[attr-defined]


ENGINES: dict[str, Callable[..., Any]] = {
    "posenc": posenc_engine, "transformers": transformers_engine, "llama-cpp": llamacpp_engine,
    "vllm": vllm_engine}


def load_factory(spec: str, reader: CheckpointReader | None = None, *, in_process: bool = False
                 ) -> Callable[..., Any]:
    """`posenc | transformers | llama-cpp | vllm | openai:URL | MODULE:FACTORY` -> the factory callable.

    `reader`: the run's `CheckpointReader`; the factories that read the checkpoint in this process
    (posenc, transformers, vllm's config) share it. None: `ENGINES[spec]` itself, reading per engine.
    `MODULE:FACTORY` runs in a worker process (`user.UserFactory`: an exit, signal, crash or hang of the
    engine fails a row, never verify); `in_process=True` imports and calls it here instead (debugging:
    then an engine that ends the process ends verify).

    Raises:
        PosencError: an unknown name, a module that does not import, or a missing or non-callable factory.
    """
    if spec == "vllm":  # one host process for every rule of the run (ENGINES["vllm"] starts one per engine)
        from .vllm_client import VLLMFactory

        return VLLMFactory(reader=reader)
    if spec in ("posenc", "transformers") and reader is not None:
        return functools.partial(ENGINES[spec], reader=reader)
    if spec in ENGINES:
        return ENGINES[spec]
    if isinstance(spec, str) and spec.startswith("openai:"):
        from .openai import openai_factory

        return openai_factory(spec[len("openai:"):])
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        fail("engine", f"one of {sorted(ENGINES)} or MODULE:FACTORY", spec)
    if not in_process:
        from .user import UserFactory

        return UserFactory(spec)
    module_name, attr = spec.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        fail("engine", "MODULE:FACTORY with an importable MODULE (on sys.path or PYTHONPATH)", f"{spec} ({exc})")
    factory = getattr(module, attr, None)
    if not callable(factory):
        fail("engine", f"a callable {attr} in module {module_name}", spec)
    return factory
