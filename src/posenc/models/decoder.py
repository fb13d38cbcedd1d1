"""The Llama-family `Decoder`: what it is built from and how it is made.

- `Decoder(...)`: checks the sizes, the encoding and the arch, and builds the embedding, the layers
  (`posenc.models.layers` for Llama, `posenc.models.blocks` for the families an `Arch` describes), the
  final norm and the head; `attn_impl` is a checked property.
- `Decoder.from_hf_config`: random weights shaped by a `config.json`; `Decoder.from_pretrained`: a
  checkpoint's weights (`posenc.models.loading`); `load_state_dict` also takes transformers' key names.

Running it lives in its base class `posenc.models.decoder_forward.DecoderForward`: `forward` with explicit
logical positions, `new_cache`, and what the cache's policy does when a length-dependent RoPE changes table.

    >>> import torch
    >>> cfg = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...        "num_key_value_heads": 2, "intermediate_size": 64}
    >>> model = Decoder.from_hf_config(cfg, seed=0).double()
    >>> cache = model.new_cache(batch_size=1, capacity=16)
    >>> model(torch.tensor([[1, 2, 3]]), cache=cache).shape, cache.next_positions().tolist()
    (torch.Size([1, 3, 50]), [3])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import ATTENTION_IMPLS, encoding_kind
from ..errors import Raw, fail, integer, rename
from ..rope.spec import Rope
from .arch import Arch, check_arch
from .blocks import Norm, build_layers
from .decoder_forward import DecoderForward
from .layers import DecoderLayer, RMSNorm

__all__ = ["Decoder"]


_CONFIG_KEYS = {"num_kv_heads": "config['num_key_value_heads']", "hidden_size": "config['hidden_size']"}


class Decoder(DecoderForward):
    """Llama-style decoder (RMSNorm, GQA attention with a pluggable positional scheme, SwiGLU MLP).

    Args:
        vocab_size, hidden_size, num_layers, num_heads, intermediate_size: the usual sizes.
        num_kv_heads: key/value heads (GQA; default num_heads).
        head_dim: channels per head (default hidden_size / num_heads).
        encoding: a `posenc.Rope`, a bias scheme (`ALiBi`, `T5RelativeBias`), an absolute scheme with
            `embedding(positions) -> [..., hidden_size]` (added to the token embeddings), or None (no positions).
        rms_norm_eps, tie_word_embeddings, attention_bias, mlp_bias: as in transformers' Llama.
        qkv_bias: biases on q, k and v only (Qwen2).
        attn_impl: "sdpa" (default: fused `scaled_dot_product_attention`, one mask per forward), "eager"
            (plain torch, the oracle) or "flex" (`flex_attention` with a score_mod from the positions);
            settable later (`model.attn_impl = "eager"`), never a silent fallback.
        layer_windows: per layer, a sliding window (a query at p sees keys at p - W + 1 .. p, as Mistral
            and Qwen2's sliding layers) or None (every earlier key); default None for every layer.
        qkv_bias: biases on the q/k/v projections (default: attention_bias; Qwen2 has them without an o bias).
        arch: a `posenc.models.arch.Arch` (one `LayerSpec` per layer): the family's norms, q/k norm,
            multipliers, soft-caps, windows, chunks, query temperatures and per-layer RoPE; None = Llama.
            Layers with their own RoPE need `encoding=None` (each layer rotates its q and k before the cache).
    Raises:
        PosencError: non-positive sizes, heads that do not divide, an encoding of the wrong kind or width,
            an unknown attn_impl, "sdpa" with an arch that soft-caps scores, other than "eager" with sinks,
            an arch that does not fit (`posenc.models.arch.check_arch`).
    """

    def __init__(self, *, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, intermediate_size: int,
                 num_kv_heads: int | None = None, head_dim: int | None = None, encoding: Any = None,
                 rms_norm_eps: float = 1e-6, tie_word_embeddings: bool = False, attention_bias: bool = False,
                 mlp_bias: bool = False, layer_windows: tuple[int | None, ...] | None = None,
                 qkv_bias: bool | None = None, attn_impl: str = "sdpa", arch: Arch | None = None) -> None:
        super().__init__()
        if arch is not None and not isinstance(arch, Arch):
            fail("arch", "None or a posenc.models.arch.Arch", arch)
        self.arch = arch
        self.attn_impl = attn_impl
        sizes = dict(vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                     intermediate_size=intermediate_size, num_kv_heads=num_kv_heads or num_heads)
        sizes = {key: integer(key, value, min=1) for key, value in sizes.items()}  # messages name the argument
        vocab_size, hidden_size, num_layers, num_heads, intermediate_size, num_kv_heads = sizes.values()
        if num_heads % num_kv_heads:
            fail("num_kv_heads", f"a divisor of num_heads={num_heads}", num_kv_heads)
        if head_dim is None:
            if hidden_size % num_heads:
                fail("hidden_size", f"a multiple of num_heads={num_heads} (or give head_dim)", hidden_size)
            head_dim = hidden_size // num_heads
        head_dim = integer("head_dim", head_dim, min=1)
        self.kind = encoding_kind(encoding)
        if self.kind == "rope" and encoding.head_dim != head_dim:
            fail("encoding", f"a Rope with head_dim={head_dim}", encoding)
        if self.kind == "bias" and getattr(encoding, "heads", num_heads) != num_heads:
            fail("encoding", f"a bias scheme for num_heads={num_heads}", encoding)
        if self.kind == "absolute" and encoding.embedding(torch.zeros(1, dtype=torch.long)).shape[-1] != hidden_size:
            fail("encoding", f"an absolute scheme whose embedding has width hidden_size={hidden_size}", encoding)
        if arch is not None:
            check_arch(arch, num_layers, head_dim, encoding, layer_windows)
            layer_windows = arch.windows if layer_windows is None else layer_windows
        layer_windows = (None,) * num_layers if layer_windows is None else tuple(layer_windows)
        what = f"{num_layers} entries, each None or an integer >= 1"
        if len(layer_windows) != num_layers:
            fail("layer_windows", what, layer_windows)
        layer_windows = tuple(None if w is None else integer("layer_windows", w, min=1, what=what) for w in layer_windows)
        self.layer_windows = layer_windows
        self.vocab_size, self.num_heads = vocab_size, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.encoding = encoding  # an nn.Module encoding (T5RelativeBias) registers as a submodule
        self.rope: Rope | None = encoding if self.kind == "rope" else None
        base_scale = head_dim**-0.5 if arch is None or arch.attn_scale is None else arch.attn_scale
        self.scale = base_scale * (self.rope.softmax_scale_factor if self.rope is not None else 1.0)
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        qkv_bias = attention_bias if qkv_bias is None else qkv_bias
        if arch is None:
            self.layers = nn.ModuleList(
                DecoderLayer(hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size, rms_norm_eps,
                             attention_bias, mlp_bias, qkv_bias)
                for _ in range(num_layers))
            self.norm = RMSNorm(hidden_size, rms_norm_eps)
        else:
            self.layers = build_layers(dict(hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                            head_dim=head_dim, intermediate_size=intermediate_size, eps=rms_norm_eps,
                                            attention_bias=attention_bias, mlp_bias=mlp_bias, qkv_bias=qkv_bias), arch)
            self.norm = Norm(hidden_size, rms_norm_eps, arch.norm)
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)
        if tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def attn_impl(self) -> str:
        """The attention implementation: "sdpa", "eager" or "flex"."""
        return self._attn_impl

    @attn_impl.setter
    def attn_impl(self, impl: str) -> None:
        if impl not in ATTENTION_IMPLS:
            fail("attn_impl", f"one of {ATTENTION_IMPLS}", impl)
        if impl != "eager" and self.arch is not None and self.arch.sinks:
            fail("attn_impl", f"'eager' (this {self.arch.family} model adds attention sinks to its softmax, which "
                 "posenc computes in eager attention only)", impl)
        if impl == "sdpa" and self.arch is not None and self.arch.attn_softcap is not None:
            fail("attn_impl", f"'eager' or 'flex' (this {self.arch.family} model soft-caps its attention scores, "
                 "which scaled_dot_product_attention cannot do)", impl)
        self._attn_impl = impl

    @classmethod
    def from_hf_config(cls, config: Any, *, encoding: Any = None, seed: int | None = None,
                       attn_impl: str = "sdpa") -> "Decoder":
        """A random-weight decoder shaped by a Llama-family `config.json` dict (or `PretrainedConfig`).

        It is built at the config's full size: llama-3.1-8b is 8 billion parameters (32 GiB in float32,
        60 GiB after `.double()`). For a small test model, shrink the sizes in the config first.

        Args:
            config: a Llama-family config, or one of the families `posenc.hf.arch` describes (qwen3, gemma2,
                gemma3_text, olmo2, olmo3, granite, smollm3, llama4_text with dense layers):
                vocab_size, hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
                intermediate_size, optional head_dim, rms_norm_eps, tie_word_embeddings, attention_bias,
                mlp_bias (q/k/v and o biases as the model_type's attention has them: Qwen2's q/k/v), and any RoPE settings `Rope.from_hf_config` accepts (model_type defaults to "llama").
            encoding: override the positional scheme (default: `Rope.from_hf_config(config)`).
            seed: seed for the random weights (default: torch's global generator).
            attn_impl: "sdpa", "eager" or "flex" (see the class).
        Returns:
            The decoder (float32; call `.double()` for float64).
        Raises:
            PosencError: missing or invalid sizes, unsupported activations, bad sliding windows or RoPE settings,
                a family the decoder does not build (`posenc.hf.arch.REFUSED`: MoE, attention sinks, ...),
                attn_impl "sdpa" for a family that soft-caps its attention scores (Gemma 2: pass "eager").
        """
        from ..hf import config_to_dict, decoder_arch, decoder_sizes

        cfg = config_to_dict(config)
        cfg.setdefault("model_type", "llama")
        sizes = decoder_sizes(cfg)
        arch, shared = decoder_arch(cfg)
        if arch is not None:
            sizes.pop("layer_windows")  # the arch's
        if encoding is None:
            encoding = Rope.from_hf_config(cfg) if arch is None else shared
        seed = None if seed is None else integer("seed", seed, what="None or an integer")
        with torch.random.fork_rng(devices=[]), rename(_CONFIG_KEYS):  # the constructor's checks, as config keys
            if seed is not None:
                torch.manual_seed(seed)
            model = cls(**sizes, encoding=encoding, attn_impl=attn_impl, arch=arch)
        model.config = cfg
        return model

    @classmethod
    def from_pretrained(cls, path: Any, *, rope_scaling: dict[str, Any] | None = None,
                        dtype: torch.dtype = torch.float32, attn_impl: str = "sdpa") -> "Decoder":
        """A decoder with a checkpoint's weights: a GGUF file or a transformers directory.

        Args:
            path: a `.gguf` file (Llama-family archs `llama` and `qwen2`; dequantized with the `gguf`
                package, Q/K rows put back in transformers' order) or a directory with `config.json`
                and `*.safetensors` (model_type llama, mistral or qwen2). `posenc.models.embedded_model_path()`
                is the embedded SmolLM2-135M-Instruct.
            rope_scaling: a transformers-style rule (`{"rope_type": "yarn", "factor": 2.0,
                "original_max_position_embeddings": 8192}`) replacing the checkpoint's; None keeps it.
                Every rule `posenc verify` passes is accepted, including dynamic NTK's
                `max_position_embeddings` (L0) inside the dict, so `Decoder.from_pretrained` is itself a
                verify engine factory: `lambda path, rule, dtype: Decoder.from_pretrained(path,
                rope_scaling=rule, dtype=dtype)`.
            dtype: parameter dtype (GGUF tensors are dequantized to float32, then cast).
            attn_impl: "sdpa", "eager" or "flex".
        Returns:
            The decoder in eval mode; `model.config` holds the config dict it was built from.
        Raises:
            PosencError: a missing or unsupported checkpoint, a bad rope_scaling, dtype or attn_impl,
                no `gguf` package for a GGUF file.
        """
        from .loading import load_pretrained

        return load_pretrained(cls, path, rope_scaling=rope_scaling, dtype=dtype, attn_impl=attn_impl)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """`nn.Module.load_state_dict` that also takes transformers' `LlamaForCausalLM` key names.

        `model.`-prefixed keys are renamed, a tied model may omit `lm_head.weight`, and (with `strict`)
        missing, unexpected or mis-shaped tensors raise PosencError naming them.
        """
        from .loading import posenc_state_dict

        tied = self.lm_head.weight is self.embed_tokens.weight
        state = posenc_state_dict(state_dict, tied=tied)
        own = self.state_dict(keep_vars=True)
        if strict:
            missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
            if missing or unexpected:
                fail("state_dict", "exactly this decoder's tensors", Raw(f"missing {missing[:4]} ({len(missing)}), "
                                                                       f"unexpected {unexpected[:4]} ({len(unexpected)})"))
        for key, value in state.items():
            if key in own and tuple(value.shape) != tuple(own[key].shape):
                fail(f"state_dict[{key!r}]", f"shape {tuple(own[key].shape)}", value)
        result = super().load_state_dict(state, strict=strict, assign=assign)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight  # assign=True replaces both; keep them one tensor
        return result
