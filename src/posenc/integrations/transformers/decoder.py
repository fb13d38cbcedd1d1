"""The pieces of a patched transformers decoder: the positions its rotary module returns, posenc's rotation,
and the decoder forward that applies a cache policy for a length-dependent rule (see `policy.py`).
"""

from __future__ import annotations

import contextvars
import inspect
from dataclasses import dataclass
from typing import Any, Callable

import torch

from ...errors import Raw, fail
from ...rope.dispatch import rotate_held
from ...rope.spec import Rope
from ...rope.tables import RopeTable
from .policy import Record, decide, rerotate_cache, rope_positions, same_table

_KERNEL_DTYPES = (torch.float32, torch.float64)  # q's dtypes whose posenc default rounds as transformers
_compiling = torch.compiler.is_compiling

__all__ = ["Options", "Positions", "Tables", "positions_forward", "rotate", "rotate_one", "with_policy"]


@dataclass(frozen=True)
class Options:
    """What `patch` was asked for (a second `patch` compares them)."""

    policy: str = "recompute"
    impl: str | None = None
    precision: str = "float32"
    mrope_positions: str = "posenc"


class Positions:
    """A forward's position ids (`[b, t]`, `[1, t]` or `[3, b, t]`) and the length whose table rotates them
    (None: `max + 1`), travelling where transformers passes (cos, sin); `pairing`: a pairing that replaces the
    layer Rope's (channels reordered before the rotation), else None."""

    __slots__ = ("position_ids", "seq_len", "pairing", "bounds")

    def __init__(self, position_ids: torch.Tensor, seq_len: int | None, pairing: str | None = None,
                 bounds: tuple[int, int] | None = None) -> None:
        self.position_ids, self.seq_len, self.pairing = position_ids, seq_len, pairing
        self.bounds = bounds  # (min, max) of position_ids, read once per forward (one host sync)

    def span(self) -> tuple[int, int]:
        """`(min, max)` of the positions, read on first use and shared by every layer of the forward."""
        if self.bounds is None:
            lo, hi = torch.aminmax(self.position_ids)
            self.bounds = (int(lo), int(hi))
        return self.bounds


class Tables:
    """The `RopeTable` each layer Rope rotates with, held by one patched model (not per call): made again only
    when a forward needs more rows (doubling), another device or precision, or, under a length-dependent rule,
    a length whose table differs (LongRoPE past L0 and dynamic NTK up to L0 keep theirs). Layers that share a
    Rope share its table. `fast`: per Rope, the CPU kernel's view of its table (`RopeTable.held`) and the
    length it was last found right for (None: a fixed rule), which `rotate` hands to the kernel as is."""

    def __init__(self) -> None:
        self.held: dict[Rope, RopeTable] = {}
        self.fast: dict[Rope, tuple[tuple, int | None]] = {}

    def table(self, rope: Rope, rows: int, seq_len: int, precision: str, device: torch.device) -> RopeTable:
        held = self.held.get(rope)
        length = seq_len if rope.scaling.depends_on_length else None
        usable = held is not None and held.precision == precision and held.cos.device == device
        if usable and held.seq_len != length and same_table(rope, held.seq_len, length):
            length = held.seq_len  # another length, the same table
        if not usable or held.rows < rows or held.seq_len != length:
            size = max(rows, 2 * held.rows if held is not None and held.seq_len == length else rows)
            held = self.held[rope] = rope.table(size, seq_len=length, precision=precision, device=device)
        if held.held is not None:
            self.fast[rope] = (held.held, None if length is None else seq_len)
        else:
            self.fast.pop(rope, None)
        return held


def positions_forward(table: contextvars.ContextVar) -> Callable:
    """The rotary module's forward under a patch: `Positions` twice, where transformers returns (cos, sin)."""

    def forward(x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any) -> tuple:
        marker = Positions(position_ids, table.get())
        return marker, marker

    return forward


def rotate(rope: Rope, q: torch.Tensor, k: torch.Tensor, positions: Positions, options: Options, tables: Tables,
           float32: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k rotated at `position_ids` by posenc, rounding as transformers does.

    float32/float64 models: posenc's default (float32, float64 for float64 input) is what transformers computes.
    bf16/fp16: transformers rounds the tables and each product to the model's dtype, so this does too
    (`compute_dtype=q.dtype`) unless an `impl` is named. `float32`: the family casts q and k to float32 before
    multiplying by tables of the model's dtype (Cohere): a float64 model rotates float32-rounded q and k in
    float64, reproduced here; in bf16/fp16 its tables are rounded to bf16 while the products are float32,
    which posenc does not reproduce (its float32 tables are not rounded).
    """
    fast = tables.fast.get(rope)
    if fast is not None and (fast[1] is None or fast[1] == positions.seq_len) and q.dtype in _KERNEL_DTYPES \
            and not (float32 and q.dtype == torch.float64) and options.impl in (None, "cpu") and not _compiling():
        out = rotate_held(q, k, positions.position_ids, fast[0], "bhtd", rope.head_dim, False)  # one kernel call
        if out is not None:  # None: rows outside the table, other metadata (nothing written): the path below
            return _laid_out(rope, out)
    compute = q.dtype if q.dtype in (torch.bfloat16, torch.float16) and options.impl is None else None
    if float32:
        compute = None
        if q.dtype == torch.float64:
            q, k = q.float().double(), k.float().double()
    position_ids, seq_len = positions.position_ids, positions.seq_len
    if rope.mrope_section is None and compute is None and position_ids.ndim <= 2:  # q and k on the held table
        lo, hi = positions.span()
        if lo >= 0:
            table = tables.table(rope, hi + 1, hi + 1 if seq_len is None else seq_len, options.precision, q.device)
            return _laid_out(rope, rope.apply(q, k, position_ids, precision=options.precision, impl=options.impl,
                                              table=table))
    return _laid_out(rope, rope.apply(q, k, position_ids, seq_len=seq_len, precision=options.precision,
                                      impl=options.impl, compute_dtype=compute))


def _laid_out(rope: Rope, out: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k in the memory layout transformers' rotation gives them: with partial rotary its `torch.cat` of the
    rotated and passed channels is contiguous whatever q's strides (ZAYA's q has strided channels), and the
    attention's matmuls round by layout; a full rotation keeps q's strides, as posenc's outputs do."""
    if rope.rotary_dim < rope.head_dim and not (out[0].is_contiguous() and out[1].is_contiguous()):
        return out[0].contiguous(), out[1].contiguous()
    return out


def rotate_one(rope: Rope, x: torch.Tensor, position_ids: torch.Tensor, options: Options, seq_len: int | None,
               layout: str) -> torch.Tensor:
    """One tensor (Gemma 3n / Gemma 4 rotate q and k in separate calls) rotated at `position_ids` by posenc,
    rounding as `rotate` does."""
    compute = x.dtype if x.dtype in (torch.bfloat16, torch.float16) and options.impl is None else None
    return rope.rotate(x, position_ids, layout=layout, seq_len=seq_len, precision=options.precision,
                       impl=options.impl, compute_dtype=compute)


def with_policy(decoder: Any, dependent: dict[int, Rope], options: Options, table: contextvars.ContextVar) -> Callable:
    """The decoder's forward, applying `options.policy` to its cache (layers `dependent` use a length-dependent rule)."""
    original = type(decoder).forward
    signature = inspect.signature(original)
    cache_name = "cache" if "cache" in signature.parameters else "past_key_values"
    var_kw = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    rope = next(iter(dependent.values()))

    def forward(*args: Any, **kwargs: Any) -> Any:
        bound = signature.bind(decoder, *args, **kwargs)
        call = {k: v for k, v in bound.arguments.items() if k not in ("self", var_kw)}
        call.update(bound.arguments.get(var_kw, {}) if var_kw else {})
        if "past_key_values" in call and cache_name == "cache":  # the deprecated name
            call.setdefault("cache", call.pop("past_key_values"))
        cache = call.get(cache_name)
        use_cache = call.get("use_cache")
        if cache is None and (use_cache if use_cache is not None else getattr(decoder.config, "use_cache", False)):
            from transformers import DynamicCache

            cache = call[cache_name] = DynamicCache(config=decoder.config)  # what the decoder would make
        if cache is None:
            return original(decoder, **call)
        return _cached_forward(decoder, original, call, cache, cache_name, dependent, rope, options, table)

    return forward


def _cached_forward(decoder: Any, original: Callable, call: dict[str, Any], cache: Any, cache_name: str,
                    dependent: dict[int, Rope], rope: Rope, options: Options, table: contextvars.ContextVar) -> Any:
    record = Record.of(cache)
    cached = int(cache.get_seq_length())  # a static cache counts in a tensor
    if cached == 0:
        record.clear()
    elif record.length != cached:
        fail(cache_name, f"a cache this patched model wrote ({record.length} tokens recorded)",
             Raw(f"{type(cache).__name__} holding {cached} tokens"))
    embeds = call.get("inputs_embeds")
    if embeds is None:
        embeds = decoder.get_input_embeddings()(call["input_ids"])  # [b, t, hidden]; GPT-NeoX: embed_in
    b, t = embeds.shape[:2]
    positions = call.get("position_ids")
    if positions is None:  # as the decoder derives them
        positions = torch.arange(cached, cached + t, device=embeds.device)[None]
    positions = positions.expand(*positions.shape[:-2], b, t) if positions.shape[-2] == 1 else positions
    if record.positions is not None and record.positions.shape[:-1] != positions.shape[:-1]:
        fail("position_ids", f"positions shaped like the cached ones {tuple(record.positions.shape[:-1])} + (t,)",
             positions)
    call.update(input_ids=None, inputs_embeds=embeds, position_ids=positions)
    if record.length == 0:
        _check_static(cache, cache_name, rope, positions, options)
        if options.policy == "recompute":
            _check_rerunnable(call, b, t)
    length, rerun = decide(rope, record, positions, options.policy)
    if options.policy == "rerotate" and record.length and length != record.table_len:
        rerotate_cache(cache, dependent, record, record.table_len, length)
    keep = embeds if options.policy == "recompute" else None
    if rerun:  # the cached tokens run again under the new table: a fresh full forward over every token
        call["attention_mask"] = _padding(call.get("attention_mask"), record, b, cached + t)
        positions, keep = torch.cat((record.positions, positions), -1), torch.cat((record.embeds, embeds), 1)
        cache.reset()  # the record follows; a static cache's slots are written again from slot 0
        call.update(inputs_embeds=keep, position_ids=positions)
    token = table.set(length)
    try:
        out = original(decoder, **call)
    finally:
        table.reset(token)
    # `length` is max(position) + 1 over every token but under "freeze" (the prefill's table length)
    record.append(positions, keep, length, None if options.policy == "freeze" and record.length else length)
    if rerun:
        out.last_hidden_state = out.last_hidden_state[:, -t:]
        if getattr(out, "hidden_states", None) is not None:
            out.hidden_states = tuple(h[:, -t:] for h in out.hidden_states)
    return out


def _padding(mask: Any, record: Record, b: int, n: int) -> torch.Tensor | None:
    """The `[b, n]` 0/1 padding mask over the cached and new tokens for a re-run forward: the call's own, or,
    when `generate()` passed a prepared (4-d, or per-layer-type) mask, as a static cache makes it do, the 2-d
    mask `generate()` kept (`Record.padding`, taken by `generation.keep_padding`), or, from a wrapper's
    per-layer-type masks (Gemma 3's and 4's image-text models), the newest token's row of its full-attention
    mask (the padding; a re-run attends causally, image tokens' bidirectional attention included only as the
    text model applies it)."""
    if mask is None or isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape == (b, n):
        return mask
    kept = record.padding
    if kept is not None and kept.shape == (b, n):
        return kept
    if isinstance(mask, dict) and "full_attention" in mask:  # a wrapper's per-layer-type masks
        full = mask["full_attention"]
        if full is None:
            return None  # no padding: the wrapper left full attention to the kernel's causal flag
        if isinstance(full, torch.Tensor) and full.ndim == 4 and full.shape[0] == b and full.shape[-1] >= n:
            row = full[:, 0, -1, :n]  # the newest token's row of a causal full-attention mask: every unpadded token
            return (row if row.dtype == torch.bool else row == 0).long()
    fail("attention_mask", f"None or a [b, {n}] 0/1 mask over the cached and new tokens (policy='recompute' runs "
         "them again; a prepared 4-d mask is read only inside generate())", mask)


_OWN = ("input_ids", "inputs_embeds", "position_ids", "attention_mask", "cache_position")  # what a re-run rebuilds


def _check_rerunnable(call: dict[str, Any], b: int, t: int) -> None:
    """At a cache's first forward under "recompute": refuse inputs given per token beside the embeddings (Gemma 4's
    image-text model hands its text model `per_layer_inputs`), which a re-run over the cached tokens would not
    have; nothing has run yet."""
    extra = sorted(k for k, v in call.items() if k not in _OWN and isinstance(v, torch.Tensor)
                   and v.ndim >= 2 and tuple(v.shape[:2]) == (b, t))
    if extra:
        fail("policy", "'freeze' or 'refuse' for a decoder called with per-token inputs beside its embeddings "
             "(policy='recompute' runs the cached tokens again from their embeddings alone)",
             Raw(f"'recompute' with {', '.join(extra)}"))


def _check_static(cache: Any, cache_name: str, rope: Rope, positions: torch.Tensor, options: Options) -> None:
    """At a cache's first forward (when `generate()` starts): refuse a static cache under "rerotate" if the
    rule's table can change within its length (its preallocated slots are not `[b, h, n, d]` keys of the cached
    tokens); nothing has run yet. "recompute" runs the cached tokens again into the static cache's own slots
    (`cache.reset()`, then slots 0 .. n-1, a sliding window's as a long prefill writes them)."""
    if options.policy != "rerotate" or not getattr(cache, "is_compileable", False):
        return
    layers = list(getattr(cache, "layers", ()))
    lengths = [n for n in (getattr(layer, "max_cache_len", None) for layer in layers) if isinstance(n, int) and n > 0]
    if not lengths:
        return
    limit = max(lengths)
    if any("Sliding" in type(layer).__name__ for layer in layers):  # a window's slots bound no sequence length
        limit = 1 << 24
    first = int(rope_positions(positions).max()) + 1
    if not same_table(rope, first, max(first, limit)):
        fail(cache_name, f"a DynamicCache for policy='rerotate' with the {rope.scaling.name} rule (its table "
             f"changes between length {first} and the static cache's "
             f"{'unbounded sliding window' if limit == 1 << 24 else limit}; pass policy='recompute', 'freeze' or "
             "'refuse', or cache_implementation='dynamic')", Raw(f"{type(cache).__name__} of {max(lengths)} slots per layer"))
