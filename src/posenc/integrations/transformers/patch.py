"""posenc inside a transformers model: one call makes its positions exact under its cache, and fast.

    >>> import torch, transformers
    >>> cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...                                num_attention_heads=2)
    >>> model, ids = transformers.LlamaForCausalLM(cfg).eval(), torch.tensor([[1, 2, 3]])
    >>> stock = model(ids).logits
    >>> torch.equal(patch(model)(ids).logits, stock)          # posenc rotates; the result is transformers'
    True
    >>> unpatch(model) is model
    True

`patch` changes one model instance, never transformers' modules: each attention layer gets its own
`forward` (transformers' code, run with posenc's rotation in place of its module's `apply_rotary_pos_emb`),
the rotary module's `forward` returns the positions instead of (cos, sin) tables, and the few generation
hooks that fight a cache policy are replaced on the instance (Phi-3's cache drop at the LongRoPE switch,
the Qwen2-VL and Qwen3-VL families' `get_rope_index`; under "recompute" with a length-dependent rule,
`prepare_inputs_for_generation` also keeps `generate()`'s 2-d mask for a re-run). The RoPE of every layer comes from
`posenc.hf.layer_ropes(model.config)`; see `policy.py` for what each cache policy does with a length-dependent rule.

Everything `patch` needs is checked before it changes anything: a model it cannot patch raises
`PosencError` naming the model type and what is missing, and is left as it was.
"""

from __future__ import annotations

import contextvars
import dataclasses
import inspect
import types
from typing import Any, Callable

import torch

from ...errors import Raw, choice, fail
from ...kernels import IMPLS
from ...rope.spec import Rope
from .decoder import Options, Positions, Tables, positions_forward, rotate, rotate_one, with_policy
from .generation import generation_fixes, innermost
from .shapes import COMPLEX, COMPLEX_LAYOUTS, rotary_forward, rotations, shaped

__all__ = ["patch", "unpatch", "is_patched", "POLICIES", "OTHER_ROTATIONS"]

POLICIES = ("recompute", "rerotate", "freeze", "refuse")
ROTATION = "apply_rotary_pos_emb"  # the module-level function each patched attention forward calls
# DeepSeek-V3's MLA (rope_interleave): interleaved channels of q_pe / k_pe reordered to halves, then rotated
INTERLEAVE = "apply_rotary_pos_emb_interleave"
# module-level rotations of another shape, and what they are (named in the refusal); those of the families
# shapes.py knows (DeepSeek-V2, Llama 4: shapes.COMPLEX_LAYOUTS) are patched
OTHER_ROTATIONS = {
    "apply_rotary_emb": "a complex-number rotation apply_rotary_emb(q, k, freqs_cis) (freqs_cis from the rotary "
                        "module, its channels paired as complex numbers) in a layout posenc does not know for this "
                        "family (it knows DeepSeek-V2's and Llama 4's)",
}
PATCH_ATTR = "_posenc_patch"
_MISSING = object()
FLOAT32_ROTATION = ("cohere", "cohere2")  # their apply_rotary_pos_emb casts q and k to float32 for any dtype


@dataclasses.dataclass
class _Patched:
    """What `patch` changed on one model, so `unpatch` can put it back."""

    options: Options
    restore: list[tuple[Any, str, Any]]  # (object, attribute, its own value before the patch or _MISSING)


def is_patched(model: Any) -> bool:
    """Whether `patch` is in effect on `model`."""
    return isinstance(getattr(model, PATCH_ATTR, None), _Patched)


def patch(model: Any, *, policy: str = "recompute", impl: str | None = None, precision: str | None = None,
          mrope_positions: str = "posenc") -> Any:
    """Put posenc's rotation and cache policy into one transformers model instance; returns the model.

    Args:
        model: a transformers model (`*ForCausalLM`, `*Model`, the VL families' `*ForConditionalGeneration`)
            whose attention rotates q and k with its module's `apply_rotary_pos_emb(q, k, cos, sin)` (or
            `(x, cos, sin)`, one tensor per call) fed by the decoder's `rotary_emb`; also GPT-J's and CodeGen's
            `apply_rotary_pos_emb(tensor, sin, cos)` and the complex `apply_rotary_emb(q, k, freqs_cis)` of
            Llama 4 and DeepSeek-V2 (`shapes.py`).
        policy: what a cache does when a length-dependent rule (dynamic NTK, LongRoPE) changes the table:
            "recompute" (every cached step equals a fresh full forward), "rerotate", "freeze" or "refuse".
        impl: posenc's rotation implementation (None: the fastest available, bit-identical to transformers'
            rotation in float32 and float64; see `Rope.apply`).
        precision: "float32" (default, as transformers) or "exact" (float64 phases for long positions).
        mrope_positions: Qwen2-VL / Qwen3-VL families: "posenc" (positions of `posenc.mrope_position_ids`,
            the official rule; `timestamps=True` for Qwen3-VL, Qwen3.5 and their MoE) or "transformers"
            (keep the model's own `get_rope_index`).
    Returns:
        `model`, patched. A second `patch` with the same options does nothing; with other options it raises.
    Raises:
        PosencError: bad options; a model type or layout it cannot patch (nothing is changed then).
    """
    options = _options(policy, impl, precision, mrope_positions)
    current = getattr(model, PATCH_ATTR, None)
    if isinstance(current, _Patched):
        if current.options == options:
            return model
        fail("model", f"an unpatched model for these options (unpatch(model) first; it is patched with "
             f"{dataclasses.asdict(current.options)})", Raw(str(dataclasses.asdict(options))))
    changes = _survey(model, options)  # every check; nothing changed yet
    restore = []
    for obj, attr, value in changes:
        restore.append((obj, attr, obj.__dict__.get(attr, _MISSING)))
        setattr(obj, attr, value)
    setattr(model, PATCH_ATTR, _Patched(options, restore))
    return model


def unpatch(model: Any) -> Any:
    """Undo `patch` on `model`; returns it. Raises `PosencError` if it is not patched."""
    state = getattr(model, PATCH_ATTR, None)
    if not isinstance(state, _Patched):
        fail("model", "a model patched by posenc.integrations.transformers.patch", type(model))
    for obj, attr, old in reversed(state.restore):
        if old is _MISSING:
            obj.__dict__.pop(attr, None)
        else:
            setattr(obj, attr, old)
    delattr(model, PATCH_ATTR)
    return model


def _options(policy: Any, impl: Any, precision: Any, mrope_positions: Any) -> Options:
    choice("policy", policy, POLICIES)
    if impl is not None:
        choice("impl", impl, IMPLS)
    precision = "float32" if precision is None else choice("precision", precision, ("float32", "exact"))
    choice("mrope_positions", mrope_positions, ("posenc", "transformers"))
    return Options(policy, impl, precision, mrope_positions)


# ---------------------------------------------------------------------------------------------- the survey
def _survey(model: Any, options: Options) -> list[tuple[Any, str, Any]]:
    """`[(object, attribute, new value)]` that patch `model`; raises before anything changes."""
    import torch.nn as nn

    from ...hf import layer_ropes

    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(text, "model_type", None) or getattr(config, "model_type", None)
    if not isinstance(model, nn.Module) or model_type is None:
        fail("model", "a transformers model (an nn.Module with a config)", type(model))
    what = f"model type {model_type!r}"
    decoders = [m for m in model.modules() if _rotary_of(m) is not None and _blocks(m) is not None]
    if len(decoders) != 1:
        for m in model.modules():  # a rotation of another signature says what it is
            if ROTATION in innermost(type(m).forward).__code__.co_names:
                _form(type(m).forward, what)
        fail("model", "one decoder module holding a rotary module (`rotary_emb`, or a child whose class is a "
             "*RotaryEmbedding: LFM2-MoE's `pos_emb`) and its layers (`layers`, Falcon's `h`)",
             Raw(f"{what} with {len(decoders)} such modules"))
    decoder = decoders[0]
    try:
        ropes = layer_ropes(config)
    except ValueError as e:
        fail("model", "a config posenc.hf reads (posenc.hf.layer_ropes)", Raw(f"{what}: {e}"))
    blocks = _blocks(decoder)
    if len(ropes) != len(blocks):
        fail("model", f"{len(ropes)} decoder layers (config num_hidden_layers)", Raw(f"{what} with {len(blocks)}"))
    if options.policy == "rerotate" and any(r is not None and r.mrope_section and r.scaling.depends_on_length
                                            for r in ropes):
        fail("policy", "'recompute', 'freeze' or 'refuse' for multi-axis RoPE with a length-dependent rule "
             "(posenc.rerotate takes [b, t] positions)", "rerotate")
    changes: list[tuple[Any, str, Any]] = []
    tables = Tables()  # this patch's RopeTables, one per layer Rope
    for index, layer in enumerate(blocks):
        attn = _attention_of(layer, what, index, ropes[index] is None, rotations(model_type))
        if attn is None:  # a layer without positions and without a rotating module (Qwen3.5's linear attention)
            continue
        if getattr(attn, "layer_idx", index) != index:
            fail("model", f"attention layer_idx {index} in decoder layer {index}", Raw(f"{what}: {attn.layer_idx}"))
        if "forward" in attn.__dict__:
            fail("model", "attention modules without an instance-level forward (accelerate hooks or another "
                 "patch put one there)", Raw(f"{what}, layer {index}"))
        others = rotations(model_type) & set(innermost(type(attn).forward).__code__.co_names)
        name = COMPLEX if COMPLEX in others else ROTATION
        form = "complex" if name == COMPLEX else _form(type(attn).forward, what)
        rotation = _rotation(ropes[index], options, what, index, model_type in FLOAT32_ROTATION, form, tables,
                             COMPLEX_LAYOUTS.get(model_type))
        forward = _with_rotation(type(attn).forward, rotation, what, name)
        changes.append((attn, "forward", types.MethodType(forward, attn)))
    if "forward" in _rotary_of(decoder).__dict__ or "forward" in decoder.__dict__:
        fail("model", "a decoder and rotary module without an instance-level forward", Raw(what))
    table = contextvars.ContextVar("posenc_table_len", default=None)  # this model's, set by its decoder forward
    rotaries = [m for name, m in decoder.named_modules() if type(m).__name__.endswith("RotaryEmbedding")
                and not name.startswith(("layers.", "h."))] or [_rotary_of(decoder)]
    if any("forward" in m.__dict__ for m in rotaries):
        fail("model", "rotary modules without an instance-level forward", Raw(what))
    changes += [(m, "forward", rotary_forward(model_type, m, table) or positions_forward(table))
                for m in rotaries]  # GraniteSWA: one per theta
    dependent = {i: r for i, r in enumerate(ropes) if r is not None and r.scaling.depends_on_length}
    if dependent:
        own = sorted(n for n in innermost(type(decoder).forward).__code__.co_names
                     if n.endswith("Cache") and n not in ("DynamicCache", "Cache", "StaticCache"))
        if own:  # MiniMax: a cache class of its own (linear-attention state) that the policies cannot re-run
            fail("model", "a decoder whose cache the policies can re-run (a DynamicCache or StaticCache) for a "
                 "length-dependent rule", Raw(f"{what}, whose decoder makes its own {', '.join(own)}"))
        scalings = {r.scaling for r in dependent.values()}
        if len(scalings) != 1:  # one table decision per forward
            fail("model", "one length-dependent rule shared by the layers that use one", Raw(f"{what}: {scalings}"))
        changes.append((decoder, "forward", with_policy(decoder, dependent, options, table)))
    changes += generation_fixes(model, options, what, padding=bool(dependent) and options.policy == "recompute")
    return changes


def _rotary_of(module: Any) -> Any:
    """A decoder's rotary module: its `rotary_emb`, else its one direct child whose class is a `*RotaryEmbedding`
    (LFM2-MoE names it `pos_emb`), else None."""
    import torch.nn as nn

    found = getattr(module, "rotary_emb", None)
    if isinstance(found, nn.Module):
        return found
    named = [m for m in module.children() if type(m).__name__.endswith("RotaryEmbedding")]
    return named[0] if len(named) == 1 else None


def _blocks(module: Any) -> Any:
    """A decoder's layers: the `nn.ModuleList` named `layers` (Falcon: `h`), or None."""
    import torch.nn as nn

    for name in ("layers", "h"):
        found = getattr(module, name, None)
        if isinstance(found, nn.ModuleList):
            return found
    return None


def _attention_of(layer: Any, what: str, index: int, positionless: bool, others: set[str]) -> Any:
    """The one submodule of a decoder layer whose forward calls `apply_rotary_pos_emb` (or one of `others`, the
    family's rotations of another shape, `shapes.rotations`; None: none there in a layer `posenc.hf.layer_ropes`
    gives no RoPE, such as a linear-attention layer); a rotation of another shape is refused with what it is."""
    names = {ROTATION, INTERLEAVE} | others
    found = [m for m in layer.modules() if names & set(innermost(type(m).forward).__code__.co_names)]
    if not found:
        other = [name for m in layer.modules() for name in innermost(type(m).forward).__code__.co_names
                 if name in OTHER_ROTATIONS]
        if other:
            fail("model", "attention that rotates q and k with a module-level apply_rotary_pos_emb",
                 Raw(f"{what}, whose attention applies {OTHER_ROTATIONS[other[0]]}"))
        if positionless:
            return None
    if len(found) != 1:
        fail("model", f"one attention module calling {ROTATION} in each decoder layer",
             Raw(f"{what}, layer {index}: {len(found)} ({', '.join(type(m).__name__ for m in found)})"))
    return found[0]


def _form(fn: Callable, what: str) -> str:
    """"pair" (`apply_rotary_pos_emb(q, k, cos, sin, ...)`), "single" (`(x, cos, sin, unsqueeze_dim)`: Gemma 3n,
    Gemma 4, one tensor per call) or "sincos" (`(tensor, sin, cos)`: GPT-J, CodeGen, see `shapes.py`) for the
    module-level function an attention forward calls."""
    rotation = innermost(fn).__globals__.get(ROTATION)
    try:
        names = list(inspect.signature(rotation).parameters)[:4]
    except (TypeError, ValueError):
        names = []
    if len(names) >= 4 and names[2:4] == ["cos", "sin"]:
        return "pair"
    if len(names) >= 3 and names[1:3] == ["cos", "sin"]:
        return "single"
    if len(names) >= 3 and names[1:3] == ["sin", "cos"]:
        return "sincos"
    fail("model", "attention whose apply_rotary_pos_emb takes (q, k, cos, sin) or (x, cos, sin)",
         Raw(f"{what}, whose apply_rotary_pos_emb takes {names}"))


def _with_rotation(fn: Callable, rotation: Callable, what: str, name: str = ROTATION) -> Callable:
    """`fn` (and each decorator around it) rebuilt so that its `apply_rotary_pos_emb` (its `name`) is `rotation`."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        if name not in fn.__globals__:
            fail("model", f"an attention module whose module defines {name}", Raw(what))
        scope = dict(fn.__globals__)  # a copy: transformers' module keeps its own function
        scope[name] = rotation
        if INTERLEAVE in scope and name == ROTATION:
            scope[INTERLEAVE] = _halves_first(rotation)
        new = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    else:
        new_inner = _with_rotation(inner, rotation, what, name)
        cells = fn.__closure__ or ()
        held = [i for i, c in enumerate(cells) if _content(c) is inner]
        if len(held) != 1:
            fail("model", "attention forwards whose decorators keep the function they wrap in a closure",
                 Raw(f"{what}: {getattr(fn, '__qualname__', fn)}"))
        cells = tuple(types.CellType(new_inner) if i == held[0] else c for i, c in enumerate(cells))
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, cells)
        new.__wrapped__ = new_inner
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__qualname__, new.__doc__ = fn.__qualname__, fn.__doc__
    return new


def _content(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _rotation(rope: Rope | None, options: Options, what: str, index: int, float32: bool, form: str,
              tables: Tables, layout: str | None = None) -> Callable:
    """posenc's `apply_rotary_pos_emb` for one layer, `(q, k, cos, sin)` or `(x, cos, sin)` (`form`); `cos`
    carries the positions. The forms of another shape ("sincos", "complex" in `layout`) are `shapes.shaped`."""
    narrow = None if rope is None or rope.rotary_dim == rope.head_dim else dataclasses.replace(rope, head_dim=rope.rotary_dim)

    def pick(x: torch.Tensor, cos: Any) -> Rope:
        if rope is None:
            fail("model", f"no rotation in layer {index} (posenc.hf.layer_ropes: this layer applies no RoPE)",
                 Raw(f"{what}, whose attention rotates there"))
        width = x.shape[-1]
        if width != rope.head_dim and (narrow is None or width != narrow.head_dim):
            fail("q", f"last dim {rope.head_dim} or rotary_dim {rope.rotary_dim} (layer {index})", x)
        if not isinstance(cos, Positions):
            fail("position_embeddings", "the positions posenc's patched rotary module returns", type(cos))
        use = rope if width == rope.head_dim else narrow
        if cos.pairing is not None and cos.pairing != use.pairing:  # DeepSeek-V3's reordered channels
            use = dataclasses.replace(use, pairing=cos.pairing)
        return use

    def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, cos: Any, sin: Any = None, *args: Any, **kwargs: Any):
        if kwargs.get("unsqueeze_dim", args[0] if args else 1) != 1:
            fail("model", f"attention rotating [b, h, t, d] q and k (layer {index})",
                 Raw(f"{what}, whose rotation is called with unsqueeze_dim={kwargs.get('unsqueeze_dim', args[0])}"))
        use = pick(q, cos)
        if use.mrope_section is not None and cos.position_ids.ndim == 2:
            cos = Positions(_axes(use, cos.position_ids), cos.seq_len, cos.pairing)
        return rotate(use, q, k, cos, options, tables, float32)

    def apply_rotary_pos_emb_single(x: torch.Tensor, cos: Any, sin: Any = None, unsqueeze_dim: int = 1, **kwargs: Any):
        use = pick(x, cos)
        return rotate_one(use, x, _axes(rope, cos.position_ids), options, cos.seq_len,
                          "bhtd" if unsqueeze_dim == 1 else "bthd")

    if form in ("sincos", "complex"):
        return shaped(form, pick, options, layout, tables)
    return apply_rotary_pos_emb if form == "pair" else apply_rotary_pos_emb_single


def _halves_first(rotation: Callable) -> Callable:
    """DeepSeek-V3's `apply_rotary_pos_emb_interleave`: q and k channels `(x0, y0, x1, y1, ...)` reordered to
    `(x0, x1, ..., y0, y1, ...)` as transformers does, then rotated by `rotation` in split-half pairing."""

    def apply_rotary_pos_emb_interleave(q: torch.Tensor, k: torch.Tensor, cos: Any, sin: Any = None, *args: Any,
                                        **kwargs: Any):
        def halves(x: torch.Tensor) -> torch.Tensor:
            return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # [b, h, t, d]: evens, then odds
        if isinstance(cos, Positions):
            cos = Positions(cos.position_ids, cos.seq_len, "split_half", cos.bounds)
        return rotation(halves(q), halves(k), cos)

    return apply_rotary_pos_emb_interleave


def _axes(rope: Rope, position_ids: torch.Tensor) -> torch.Tensor:
    """M-RoPE takes `[3, b, t]`: text-only `[b, t]` positions are the same on every axis (as transformers)."""
    if rope.mrope_section is not None and position_ids.ndim == 2:
        return position_ids.unsqueeze(0).expand(3, -1, -1)
    return position_ids
