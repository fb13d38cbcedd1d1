"""Reading a llama.cpp GGUF file: its metadata as a transformers-style config, its tensors dequantized.

The tensors come back under transformers' `LlamaForCausalLM` names (`model.layers.0.self_attn.q_proj.weight`,
`lm_head.weight`, ...), so `Decoder.load_state_dict` takes them like any transformers checkpoint.

llama.cpp's converter reorders the rows of `attn_q` and `attn_k` inside every head for the `llama`
architecture: half-split order `(a0..a_{d/2-1}, b0..b_{d/2-1})` becomes interleaved `(a0, b0, a1, b1, ...)`,
because llama.cpp's "normal" RoPE rotates adjacent pairs `(2i, 2i+1)` where transformers rotates
`(i, i + d/2)`. The file does not record this; it follows from the architecture (NeoX-mode archs such
as qwen2 are stored as they are). `undo_permutation=True` (the default) restores transformers' order, so
the weights pair with posenc's `split_half` RoPE; leaving the rows permuted and rotating split-half is
exactly the silent pairing bug (the text still looks like English).

    >>> w = torch.arange(8.0)[:, None]                 # one head, d = 8, rows in transformers' order
    >>> permute_rows(w, heads=1).flatten().tolist()    # llama.cpp's order
    [0.0, 4.0, 1.0, 5.0, 2.0, 6.0, 3.0, 7.0]
    >>> torch.equal(unpermute_rows(permute_rows(w, 1), 1), w)
    True
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from ..errors import Raw, fail, integer, real
from ..hf.override import with_rope_rule
from .files import check_layers

__all__ = ["read_gguf", "gguf_metadata", "gguf_config", "permute_rows", "unpermute_rows", "ARCHITECTURES"]

# GGUF `general.architecture` -> (transformers model_type, Q/K rows permuted by llama.cpp's converter)
ARCHITECTURES: dict[str, tuple[str, bool]] = {"llama": ("llama", True), "qwen2": ("qwen2", False)}

_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def permute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """transformers' row order -> llama.cpp's, per head: `[heads * d, ...]` rows `(h, half, i)` -> `(h, i, half)`."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's row order -> transformers', per head: rows `(h, i, half)` -> `(h, half, i)`."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _reader(path: str | Path) -> Any:
    try:
        import gguf
    except ImportError:
        fail("path", "a GGUF file with the `gguf` package installed (pip install 'posenc[gguf]')", str(path))
    from .gguf_layout import check_gguf_layout

    try:
        check_gguf_layout(path)  # counts the file cannot hold: the gguf reader would loop on them
    except OSError as err:
        fail("path", "a readable GGUF file", Raw(f"{str(path)!r} ({err})"))
    try:
        return gguf.GGUFReader(str(path))
    except Exception as err:  # the gguf package's parser leaks IndexError, KeyError, ... on a cut or forged file
        fail("path", "a readable GGUF file", Raw(f"{str(path)!r} ({type(err).__name__}: {err})"))


def _value(field: Any) -> Any:
    """One metadata value: a number, a bool, a string, or a list of them."""
    import gguf

    kinds = field.types
    def one(part: Any, kind: Any) -> Any:
        return bytes(part).decode("utf-8", errors="replace") if kind == gguf.GGUFValueType.STRING else part[0].item()
    if kinds[0] == gguf.GGUFValueType.ARRAY:
        return [one(field.parts[i], kinds[-1]) for i in field.data]
    return one(field.parts[field.data[0]], kinds[0])


def gguf_metadata(path: str | Path, reader: Any = None) -> dict[str, Any]:
    """Every metadata key of a GGUF file with its value (arrays as lists; tokenizer arrays included)."""
    reader = reader if reader is not None else _reader(path)
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = _value(field)
        except Exception as err:  # a value cut short or of a kind the reader half-parsed
            fail(key, "a readable GGUF metadata value", Raw(f"{type(err).__name__}: {err} (in {str(path)!r})"))
    return meta


def gguf_config(meta: dict[str, Any], tensor_shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """A transformers-style `config.json` dict from GGUF metadata and the tensors' shapes (ggml order).

    Raises:
        PosencError: an architecture posenc's decoder does not implement, or missing sizes.
    """
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        fail("general.architecture", f"one of {sorted(ARCHITECTURES)} (Llama-family GGUF)", arch)

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            fail("path", f"a GGUF file with metadata {arch}.{key}", Raw("a file without it"))
        return meta[f"{arch}.{key}"]

    def size(key: str, default: Any = None) -> int:  # every size a positive integer, named by its key
        return integer(f"{arch}.{key}", need(key) if default is None else meta.get(f"{arch}.{key}", default), min=1)

    def number(key: str, default: float, **bounds: float) -> float:
        return real(f"{arch}.{key}", meta.get(f"{arch}.{key}", default), **bounds)

    hidden, heads = size("embedding_length"), size("attention.head_count")
    kv_heads = size("attention.head_count_kv", heads)
    if heads % kv_heads:
        fail(f"{arch}.attention.head_count_kv", f"a divisor of {arch}.attention.head_count={heads}", kv_heads)
    if f"{arch}.attention.key_length" not in meta and hidden % heads:
        fail(f"{arch}.attention.head_count", f"a divisor of {arch}.embedding_length={hidden} (or a key_length)",
             heads)
    head_dim = size("attention.key_length", hidden // heads)
    rotary = size("rope.dimension_count", head_dim)
    if rotary != head_dim:
        fail(f"{arch}.rope.dimension_count", f"head_dim={head_dim} (full rotary, as {arch})", rotary)
    if head_dim % 2:
        fail(f"{arch}.attention.key_length", "an even head_dim (RoPE rotates pairs)", head_dim)
    if "token_embd.weight" not in tensor_shapes or len(tensor_shapes["token_embd.weight"]) != 2:
        fail("token_embd.weight", "a 2-D tensor [hidden, vocab] in the file", tensor_shapes.get("token_embd.weight"))
    cfg: dict[str, Any] = {
        "model_type": ARCHITECTURES[arch][0],
        "vocab_size": integer("token_embd.weight", tensor_shapes["token_embd.weight"][-1], min=1,
                              what="a vocabulary of at least one row"),
        "hidden_size": hidden, "intermediate_size": size("feed_forward_length"),
        "num_hidden_layers": size("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "max_position_embeddings": size("context_length"),
        "rms_norm_eps": number("attention.layer_norm_rms_epsilon", 1e-6, ge=0.0, lt=1.0),
        "rope_theta": number("rope.freq_base", 10000.0, gt=0.0),
        "tie_word_embeddings": "output.weight" not in tensor_shapes,
        "attention_bias": False, "hidden_act": "silu",
    }
    for key, name in (("bos_token_id", "bos"), ("eos_token_id", "eos"), ("pad_token_id", "padding")):
        if f"tokenizer.ggml.{name}_token_id" in meta:
            cfg[key] = integer(f"tokenizer.ggml.{name}_token_id", meta[f"tokenizer.ggml.{name}_token_id"], min=0)
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    if kind in ("linear", "yarn"):
        rule = {"rope_type": kind, "factor": real(f"{arch}.rope.scaling.factor", need("rope.scaling.factor"), gt=0.0)}
        if kind == "yarn":
            rule["original_max_position_embeddings"] = size("rope.scaling.original_context_length")
            for key in ("beta_fast", "beta_slow"):
                if f"{arch}.rope.scaling.yarn_{key}" in meta:
                    rule[key] = number(f"rope.scaling.yarn_{key}", 0.0, gt=0.0)
        cfg["rope_scaling"] = rule
    elif kind != "none":
        fail(f"{arch}.rope.scaling.type", "'none', 'linear' or 'yarn'", kind)
    return cfg


def _hf_name(name: str) -> str:
    base, _, kind = name.rpartition(".")
    if base in _TOP:
        return f"{_TOP[base]}.{kind}"
    match = _BLOCK.fullmatch(name)
    if match is None or match.group(2) not in _LAYER:
        fail("path", "a GGUF file with Llama-family tensors only", Raw(f"a tensor named {name!r}"))
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER[part]}.{kind}"


def read_gguf(path: str | Path, *, dtype: torch.dtype = torch.float32, undo_permutation: bool = True,
              rope_scaling: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The config and the dequantized tensors (transformers' names) of a Llama-family GGUF file.

    Args:
        path: the `.gguf` file.
        dtype: dtype of the returned tensors (dequantized in float32 first).
        undo_permutation: restore transformers' Q/K row order for archs llama.cpp permutes (see the module).
        rope_scaling: a transformers-style rule replacing the file's (needed for files carrying
            llama.cpp's per-frequency `rope_freqs.weight`, which has no config form).
    Returns:
        `(config, state_dict)`: a `config.json`-style dict and `{name: tensor}`.
    Raises:
        PosencError: no `gguf` package, an unreadable file, an unsupported architecture or tensor.
    """
    from gguf.quants import dequantize  # _reader checks the package first

    reader = _reader(path)
    meta = gguf_metadata(path, reader)
    shapes = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    cfg = gguf_config(meta, shapes)
    if rope_scaling is not None:
        cfg = with_rope_rule(cfg, rope_scaling)
    elif "rope_freqs.weight" in shapes:
        fail("rope_scaling", "a rule for this file's per-frequency factors (rope_freqs.weight, Llama-3 style), "
             "e.g. {'rope_type': 'llama3', ...} from the original config.json", None)
    permuted = ARCHITECTURES[meta["general.architecture"]][1] and undo_permutation
    heads = {"attn_q": cfg["num_attention_heads"], "attn_k": cfg["num_key_value_heads"]}
    names = {t.name: _hf_name(t.name) for t in reader.tensors if t.name != "rope_freqs.weight"}  # unknown: refused
    check_layers(cfg["num_hidden_layers"], names, f"{meta['general.architecture']}.block_count")  # before any read
    for name, shape in shapes.items():  # the head split below needs rows = heads x head_dim, in whole pairs
        part, kind = name.split(".")[-2:] if name.count(".") == 3 else (None, None)
        rank = 2 if kind == "weight" else 1
        if part in heads and (len(shape) != rank or shape[-1] != heads[part] * cfg["head_dim"]):
            key = "attention.head_count" + ("_kv" if part == "attn_k" else "")
            fail(name, f"{heads[part] * cfg['head_dim']} rows (the last ggml dimension: {key}={heads[part]} x "
                 f"head_dim {cfg['head_dim']})", Raw(f"shape {list(shape)}"))
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue  # replaced by the explicit rope_scaling rule
        name = names[tensor.name]
        try:
            values = dequantize(tensor.data, tensor.tensor_type)  # numpy float32; F32 tensors: a read-only view
            values = torch.from_numpy(values if values.flags.writeable else values.copy())
            values = values.reshape(tuple(reversed(shapes[tensor.name])))  # ggml [in, out] -> torch [out, in]
        except Exception as err:  # data cut short, or a size the quantization's blocks do not divide
            fail(tensor.name, "tensor data matching its shape and type", Raw(f"{type(err).__name__}: {err}"))
        part = tensor.name.split(".")[-2]
        if permuted and part in heads:
            values = unpermute_rows(values, heads[part])
        state[name] = values.to(dtype)
    return cfg, state
