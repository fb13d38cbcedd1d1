"""posenc's `Decoder`: one class that is built (sizes, encoding, an `Arch`: Llama's by default) and run
(`forward` over an explicit KV cache, `new_cache`).

- `Decoder(...)`: checks the sizes, the encoding and the arch, and builds the embedding, the layers
  (`posenc.models.blocks`, one set for every family), the final norm and the head; `attn_impl` is a checked
  property.
- `Decoder.from_hf_config`: random weights shaped by a `config.json` (read by `posenc.hf.arch.decoder_config`);
  `Decoder.from_pretrained`: a checkpoint's weights (`posenc.models.loading`); `load_state_dict` also takes
  transformers' key names.

`forward(input_ids, position_ids=None, attention_mask=None, cache=None) -> logits`: positions are
logical and explicit; when omitted they count only the tokens the mask keeps, continuing after the
cache's last position, so left padding never shifts them. The cache is an object passed in and updated.

Length-dependent scalings (dynamic NTK, LongRoPE) use, for each row, `seq_len = last position + 1` of
that row alone; transformers' batch maximum is not used because it makes a request depend on its
batch-mates. When a row grows into a different table, the cache's policy decides (cost per switch):
- "recompute" (default): re-run the row's cached tokens under the new table in the same forward, so
  every step equals a full forward over the whole sequence. Cost: a forward over all cached tokens per
  switch (LongRoPE: once, at L0 + 1; dynamic NTK: every step past L0).
- "rerotate": rotate every layer's cached keys to the new table (rotated storage: one 2x2 map per cached
  key and layer; unrotated storage: free, keys are rotated on read). First-layer keys are exact; deeper
  layers keep values and keys computed from hidden states of the old table, so logits differ from a full forward.
- "freeze": keep the table chosen when the row was first filled. Cost: none. Differs from a full forward.
- "refuse": raise PosencError, changing nothing.

    >>> import torch
    >>> cfg = {"vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    ...        "num_key_value_heads": 2, "intermediate_size": 64}
    >>> model = Decoder.from_hf_config(cfg, seed=0).double()
    >>> cache = model.new_cache(batch_size=2, capacity=16)
    >>> mask = torch.tensor([[0, 1, 1], [1, 1, 1]])  # row 0 is left-padded: its positions start at 0 all the same
    >>> model(torch.tensor([[0, 5, 6], [4, 5, 6]]), attention_mask=mask, cache=cache).shape
    torch.Size([2, 3, 50])
    >>> cache.next_positions().tolist()
    [2, 3]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention import ATTENTION_IMPLS, encoding_kind
from ..cache import KVCache, check_model_cache, check_new_positions
from ..errors import Raw, batch_positions, fail, integer, rename
from ..hf.arch import decoder_config
from ..rope.rerotate import row_tables
from ..rope.spec import Rope
from .arch import Arch, check_arch, llama_arch
from .attend import forward_attention
from .blocks import Norm, Step, build_layers
from .inputs import checked_inputs, prepend_cached

__all__ = ["Decoder"]


_CONFIG_KEYS = {"num_kv_heads": "config['num_key_value_heads']", "hidden_size": "config['hidden_size']"}


class Decoder(nn.Module):
    """Llama-style decoder (RMS norms, GQA attention with a pluggable positional scheme, gated MLP), the family's
    differences from Llama given as an `Arch`.

    Args:
        vocab_size, hidden_size, num_layers, num_heads, intermediate_size: the usual sizes.
        num_kv_heads: key/value heads (GQA; default num_heads).
        head_dim: channels per head (default hidden_size / num_heads).
        encoding: a `posenc.Rope`, a bias scheme (`ALiBi`, `T5RelativeBias`), an absolute scheme with
            `embedding(positions) -> [..., hidden_size]` (added to the token embeddings), or None (no positions).
        rms_norm_eps, tie_word_embeddings, attention_bias, mlp_bias: as in transformers' Llama.
        layer_windows: per layer, a sliding window (a query at p sees keys at p - W + 1 .. p, as Mistral
            and Qwen2's sliding layers) or None (every earlier key); default None for every layer.
        qkv_bias: biases on the q/k/v projections (default: attention_bias; Qwen2 has them without an o bias).
        attn_impl: "sdpa" (default: fused `scaled_dot_product_attention`, one mask per forward), "eager"
            (plain torch, the oracle) or "flex" (`flex_attention` with a score_mod from the positions);
            settable later (`model.attn_impl = "eager"`), never a silent fallback.
        arch: a `posenc.models.arch.Arch` (one `LayerSpec` per layer): the family's norms, q/k norm,
            multipliers, soft-caps, windows, chunks, query temperatures and per-layer RoPE; None = Llama's with
            `layer_windows`. Layers with their own RoPE need `encoding=None` (each layer rotates its q and k
            before the cache).
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
        if attn_impl not in ATTENTION_IMPLS:
            fail("attn_impl", f"one of {ATTENTION_IMPLS}", attn_impl)
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
            layer_windows = arch.windows
        layer_windows = (None,) * num_layers if layer_windows is None else tuple(layer_windows)
        what = f"{num_layers} entries, each None or an integer >= 1"
        if len(layer_windows) != num_layers:
            fail("layer_windows", what, layer_windows)
        layer_windows = tuple(None if w is None else integer("layer_windows", w, min=1, what=what) for w in layer_windows)
        self.arch = llama_arch(layer_windows) if arch is None else arch
        self.attn_impl = attn_impl  # after the arch: sinks and soft-caps limit the choice
        self.layer_windows = layer_windows
        self.vocab_size, self.num_heads = vocab_size, num_heads
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.encoding = encoding  # an nn.Module encoding (T5RelativeBias) registers as a submodule
        self.rope: Rope | None = encoding if self.kind == "rope" else None
        base_scale = head_dim**-0.5 if self.arch.attn_scale is None else self.arch.attn_scale
        self.scale = base_scale * (self.rope.softmax_scale_factor if self.rope is not None else 1.0)
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        qkv_bias = attention_bias if qkv_bias is None else qkv_bias
        self.layers = build_layers(dict(hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                        head_dim=head_dim, intermediate_size=intermediate_size, eps=rms_norm_eps,
                                        attention_bias=attention_bias, mlp_bias=mlp_bias, qkv_bias=qkv_bias),
                                   self.arch)
        self.norm = Norm(hidden_size, rms_norm_eps, self.arch.norm)
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
        if impl != "eager" and self.arch.sinks:
            fail("attn_impl", f"'eager' (this {self.arch.family} model adds attention sinks to its softmax, which "
                 "posenc computes in eager attention only)", impl)
        if impl == "sdpa" and self.arch.attn_softcap is not None:
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
        cfg, kwargs = decoder_config(config, encoding=encoding)
        seed = None if seed is None else integer("seed", seed, what="None or an integer")
        with torch.random.fork_rng(devices=[]), rename(_CONFIG_KEYS):  # the constructor's checks, as config keys
            if seed is not None:
                torch.manual_seed(seed)
            model = cls(**kwargs, attn_impl=attn_impl)
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

    def new_cache(self, batch_size: int, capacity: int | None = None, store: str = "rotated",
                  policy: str = "recompute", *, block_size: int | None = None,
                  kv_dtype: str | None = None) -> KVCache:
        """An empty `KVCache` for this model (its dtype, device, heads and RoPE).

        Args:
            batch_size: rows.
            capacity: slots per row (prompt + generated tokens; a full cache raises PosencError saying
                how to size it), or None to grow on demand (doubling; amortised O(1) per token).
            store: "rotated" or "unrotated" keys. policy: "recompute", "rerotate", "freeze" or "refuse".
            block_size: None (contiguous rows) or slots per block of paged storage (forks share blocks).
            kv_dtype: None (the model's dtype) or a `posenc.cache.quant.formats` format ("int8", "int4", "fp8",
                "bfloat16", ...): a `QuantizedKVCache` (store "unrotated": keys per channel before RoPE).
                Not with a block_size (quantized storage is contiguous).
        """
        if store != "rotated" and self.arch.own_ropes:
            fail("store", f"'rotated' (the layers of this {self.arch.family} model rotate their own keys before the "
                 "cache: there are no unrotated keys to store)", store)
        weight = self.embed_tokens.weight
        if kv_dtype is not None:
            from ..cache.quant import QuantizedKVCache

            if block_size is not None:
                fail("block_size", "None with a kv_dtype (quantized storage is contiguous)", block_size)
            return QuantizedKVCache(len(self.layers), batch_size, self.num_kv_heads, self.head_dim, capacity,
                                    kv_dtype=kv_dtype, rope=self.rope, store=store, policy=policy,
                                    dtype=weight.dtype, device=weight.device, absolute=self.kind == "absolute")
        return KVCache(len(self.layers), batch_size, self.num_kv_heads, self.head_dim, capacity, rope=self.rope,
                       store=store, policy=policy, dtype=weight.dtype, device=weight.device,
                       absolute=self.kind == "absolute", block_size=block_size)

    def forward(self, input_ids: torch.Tensor, *, position_ids: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, cache: KVCache | None = None) -> torch.Tensor:
        """Logits for new tokens, appending them to `cache` (a temporary cache when None: a full forward).

        Args:
            input_ids: `[b, t]` token ids.
            position_ids: `[t]` or `[b, t]` logical positions (default: count the kept tokens after the cache).
            attention_mask: `[b, t]`, or `[b, cached + t]` as transformers passes it (only the last t columns
                are used; the earlier ones must count each row's cached tokens); 0/False = padding.
            cache: a `KVCache` from `new_cache`, updated in place.
        Returns:
            `[b, t, vocab]` logits; rows at padding are finite but meaningless.
        Raises:
            PosencError: bad ids, masks or positions (not increasing, not past the cache), a full cache,
                a cache of another shape, policy "refuse" when a row's frequencies change.
        """
        ids, mask = checked_inputs(input_ids, attention_mask, cache, vocab_size=self.vocab_size)
        b, t = ids.shape
        if cache is not None and (not isinstance(cache, KVCache) or cache.batch_size != b
                                  or cache.num_layers != len(self.layers) or cache.rope != self.rope
                                  or (cache.num_kv_heads, cache.head_dim) != (self.num_kv_heads, self.head_dim)):
            fail("cache", f"a KVCache from this model's new_cache with batch_size={b}", cache)
        if cache is not None:
            weight = self.embed_tokens.weight
            check_model_cache(cache, weight.dtype, weight.device, len(self.layers), self.num_kv_heads, self.head_dim)
        start = torch.zeros(b, dtype=torch.long, device=ids.device) if cache is None else cache.next_positions()
        if position_ids is None:
            positions = start[:, None] + mask.long().cumsum(dim=1) - 1  # [b, t]
        else:
            positions = batch_positions("position_ids", position_ids, b, t,  # [b, t]; negatives fail below
                                        device=start.device)
        positions = positions.masked_fill(~mask, 0)  # padding: a placeholder, never cached or counted
        names = ("input_ids" if position_ids is None else "position_ids", "attention_mask")
        if cache is None:  # a full forward: the positions are checked as for an empty cache, no cache built
            check_new_positions(positions, mask, start - 1, names=names)
        else:
            check_new_positions(positions, mask, start - 1, None if cache.growable else cache.capacity - cache.lengths,
                                names=names, capacity=cache.capacity, lengths=cache.lengths)
        seq_lens = torch.maximum(start, (positions + 1).masked_fill(~mask, 0).max(dim=1).values)  # [b], per row
        if cache is None:
            return self._run(ids, positions, mask, None, seq_lens)
        return self._cached_forward(ids, positions, mask, cache, seq_lens)

    def _cached_forward(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: KVCache,
                        seq_lens: torch.Tensor) -> torch.Tensor:
        """Every change a cached forward makes to `cache`: the rows' table lengths (`retable`), the re-run of
        the rows whose table changed (policy "recompute"), the new tokens' keys and values; `[b, t, vocab]`."""
        t = ids.shape[1]
        with cache.transaction():  # a refused call (a layer's write, an error in a layer) leaves the cache as it was
            if self.rope is not None and self.rope.scaling.depends_on_length:
                redo = cache.retable(seq_lens)
                if bool(redo.any()):
                    ids, positions, mask = prepend_cached(cache, redo, ids, positions, mask)
                    cache.retable(seq_lens)  # the cleared rows adopt the new table
            else:
                cache.retable(seq_lens)  # records the lengths; no host sync
            return self._run(ids, positions, mask, cache)[:, -t:]

    def _run(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: KVCache | None,
             seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """Embed, run the layers, project. `cache=None`: a full forward whose keys are its own tokens
        (padding hidden), with RoPE tables at `seq_lens [b]`; otherwise append to `cache` and read it."""
        h = self.embed_tokens(ids)  # [b, t, hidden]
        if self.arch.embed_scale != 1.0:
            h = h * self.arch.embed_scale  # Gemma's sqrt(hidden), Granite's embedding_multiplier
        if self.kind == "absolute":
            h = h + self.encoding.embedding(positions).to(h.dtype)  # [b, t, hidden]
        cos = sin = key_tables = slots = index = width = None
        if cache is None:
            key_positions, key_mask = positions, mask  # [b, t]
            if self.rope is not None:
                cos, sin = row_tables(self.rope, positions, seq_lens)  # [b, t, r/2]
        else:
            slots = cache.reserve(positions, mask, ids)  # [b, t]
            width = cache.read_width  # a host-side bound of the longest row: no sync
            key_positions = cache.positions[:, :width]  # [b, w]
            key_mask = key_positions >= 0
            index = cache.write_index(slots)
            if self.rope is not None:
                cos, sin = cache.tables(positions)  # [b, t, r/2], each row at its table_len
                if cache.store == "unrotated":
                    key_tables = cache.tables(key_positions)  # [b, w, r/2], shared by every layer
        scheme = self.encoding if self.kind == "bias" else None
        attend = forward_attention(self.attn_impl, self.scale, self.arch.attn_softcap, scheme, positions,
                                   key_positions, key_mask)
        step = Step(attend=attend, pairing=self.rope.pairing if self.rope is not None else None, cos=cos, sin=sin,
                    key_tables=key_tables, slots=slots, index=index, width=width, positions=positions,
                    layer_tables=self.arch.layer_tables(positions) if self.arch.own_ropes else None)
        for i, layer in enumerate(self.layers):
            h = layer(h, i, step, cache)  # [b, t, hidden]
        return self.arch.final_logits(self.lm_head(self.norm(h)))  # [b, t, vocab]
