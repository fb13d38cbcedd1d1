"""Test helper: every model type of the installed transformers whose modeling file defines a rotary class,
compared with posenc (used by tests/hf/test_enumeration.py; tests/helpers/hf_enumeration_summary.py writes the summary
in docs/hf.md).

For each model type: its config class is built with its own defaults; the text rotary class of its modeling
module (the `*RotaryEmbedding` whose `config` argument the config, or one of its sub-configs, is) is
instantiated as the model does and called once per layer type; its cos/sin rows at POSITIONS are compared
with `posenc.hf.rope_by_layer_type`, from the `PretrainedConfig` and from its `to_dict()` form. Outcomes:

- "exact": every layer type's per-pair cos and sin (attention factor applied) equal transformers' within
  TOL (bit-identical in practice; `bitwise` says so), and the inverse frequencies too where the class keeps them;
- "refused": posenc raised `PosencError`; the reason is its message;
- "differs": posenc built a Rope whose table is not transformers';
- "crash": anything else raised in posenc (a bug); "no reference": transformers itself cannot build the
  table from the defaults (the reason says why), or its only rotary class is one posenc has no reading for.

A model type without a text (or audio) table whose config holds a vision tower with rope type "axial" is
compared through `posenc.hf.vision_rope` instead (`check_axial`): the per-pair table at (row, column) patch
positions, the pairing its table layout implies, and the tower's `apply_rotary_pos_emb_vision` where it has one.

Nothing here comes from posenc except the call under test.
"""

from __future__ import annotations

import importlib
import inspect
import os
import re
from dataclasses import dataclass

import torch

POSITIONS = (0, 7, 4095, 9000)
TOL = 2e-6  # complex-polar tables (freqs_cis) round differently from cos/sin by ~1 ulp at 9000 rad
_CLASS = re.compile(r"^class (\w+RotaryEmbedding)\(", re.M)


@dataclass(frozen=True)
class Outcome:
    model_type: str
    outcome: str  # "exact", "refused", "differs", "crash", "no reference"
    detail: str = ""
    bitwise: bool = False
    layer_types: tuple[str, ...] = ()
    overrides: tuple[tuple[str, object], ...] = ()  # what the config was built with beyond its defaults
    sub_config: str = ""  # the sub-config whose table was compared, when not the model's (an audio encoder's)


def rotary_model_types() -> list[tuple[str, str]]:
    """`(model_type, module name)` for every model type whose modeling file defines a `*RotaryEmbedding` class."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES, model_type_to_module_name

    root = os.path.join(os.path.dirname(transformers.__file__), "models")
    out = []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        module = model_type_to_module_name(model_type)
        path = os.path.join(root, module, f"modeling_{module}.py")
        if os.path.exists(path) and _CLASS.search(open(path, encoding="utf-8").read()):
            out.append((model_type, module))
    return out


def _sub_configs(config):
    """The config and every nested config object, depth first."""
    from transformers import PretrainedConfig

    yield config
    for name, value in sorted(vars(config).items()):
        if isinstance(value, PretrainedConfig) and value is not config:
            yield from _sub_configs(value)


def text_rotary(module, config):
    """`[(rotary class, the (sub-)config it takes)]` candidates for the language (or audio) model, best first.

    Vision towers' classes (config annotated as a vision config) are left out: they take 2-D positions.
    """
    found = []
    for name, cls in vars(module).items():
        if not (name.endswith("RotaryEmbedding") and inspect.isclass(cls) and cls.__module__ == module.__name__):
            continue
        params = inspect.signature(cls.__init__).parameters
        if "config" not in params or [p for p in params.values() if p.default is inspect.Parameter.empty][2:]:
            continue  # (self, config) only
        ann = params["config"].annotation
        if "Vision" in getattr(ann, "__name__", str(ann)) or "position_ids" not in inspect.signature(cls.forward).parameters:
            continue  # a vision tower's, or one that rotates q and k itself (ESM: forward(q, k))
        subs = [s for s in _sub_configs(config) if inspect.isclass(ann) and isinstance(s, ann)]
        subs = subs or list(_sub_configs(config))  # unannotated, or a sibling config class (encoder / decoder)
        for sub in subs:  # a composite config's rotary class is given its text_config (Qwen2-VL)
            text = vars(sub).get("text_config")
            found.extend((cls, c) for c in ([text] if text is not None else []) + [sub])
    text = vars(config).get("text_config")
    found.sort(key=lambda pair: 0 if pair[1] is text else 1 if pair[1] is config else 2)  # the language model first
    return found


def _pairs(table: torch.Tensor, rotary_dim: int) -> torch.Tensor | None:
    """A transformers cos (or sin) table `[b, t, r]` or `[b, t, r/2]` as per-pair `[t, r/2]`; None if neither."""
    table = table.reshape(-1, table.shape[-1]).double()
    half = rotary_dim // 2
    if table.shape[-1] == half:
        return table
    if table.shape[-1] != rotary_dim:
        return None
    if torch.equal(table[:, :half], table[:, half:]):
        return table[:, :half]  # cat((freqs, freqs))
    if torch.equal(table[:, 0::2], table[:, 1::2]):
        return table[:, 0::2]  # repeat_interleave(2)
    return None


def _hf_tables(rotary, positions, layer_type):
    x = torch.zeros(1, dtype=torch.float32)
    pos = torch.tensor([positions])
    fwd = inspect.signature(rotary.forward).parameters
    kwargs = {"layer_type": layer_type} if layer_type is not None and "layer_type" in fwd else {}
    with torch.no_grad():
        try:
            out = rotary(x, pos, **kwargs)
        except (RuntimeError, IndexError, ValueError, TypeError):
            out = rotary(x, pos[None].expand(3, 1, -1), **kwargs)  # multi-axis rotary: [3, b, t]
    if torch.is_tensor(out) and out.is_complex():
        return out.real, out.imag  # freqs_cis (DeepSeek-V2)
    first, second = out[0], out[1]
    if positions[0] == 0 and not first.reshape(-1, first.shape[-1])[0].any():
        return second, first  # (sin, cos) order (GPT-J): at position 0 sin is 0, cos is not
    return first, second


def _hf_rotate(module, rotary, positions, layer_type, q, k):
    """transformers' rotation of q, k `[1, h, t, d]` with the module's own apply function; None if it has none
    this helper can call (a different signature)."""
    fwd = inspect.signature(rotary.forward).parameters
    kwargs = {"layer_type": layer_type} if layer_type is not None and "layer_type" in fwd else {}
    pos = torch.tensor([positions])
    with torch.no_grad():
        try:
            out = rotary(q, pos, **kwargs)
        except (RuntimeError, IndexError, ValueError, TypeError):
            out = rotary(q, pos[None].expand(3, 1, -1), **kwargs)
        if torch.is_tensor(out) and out.is_complex():
            apply = getattr(module, "apply_rotary_emb", None)
            if apply is None:
                return None
            try:
                return apply(q, k, out)
            except RuntimeError:  # Llama 4 takes [b, t, h, d]
                return tuple(x.transpose(1, 2) for x in apply(q.transpose(1, 2), k.transpose(1, 2), out))
        apply = getattr(module, "apply_rotary_pos_emb", None)
        if _attention_interleaves(module, rotary):
            apply = module.apply_rotary_pos_emb_interleave
        if apply is None or len([p for p in inspect.signature(apply).parameters.values()
                                 if p.default is inspect.Parameter.empty]) != 4:
            return None
        cos, sin = out[0], out[1]
        if positions[0] == 0 and not cos.reshape(-1, cos.shape[-1])[0].any():
            return None  # GPT-J's (sin, cos) apply takes [b, t, h, d]: covered by tests/hf/test_rope_parity.py
        try:
            return apply(q, k, cos, sin)
        except RuntimeError:  # the attention layer slices the rotary part off (partial rotary)
            r = cos.shape[-1]
            q_rot, k_rot = apply(q[..., :r], k[..., :r], cos, sin)
            return torch.cat((q_rot, q[..., r:]), -1), torch.cat((k_rot, k[..., r:]), -1)


def _attention_interleaves(module, rotary) -> bool:
    """Whether the main attention rotates with `apply_rotary_pos_emb_interleave`: by the config's flag
    (DeepSeek-V3's `rope_interleave`), or always (DeepSeek-V3.2, GLM-MoE-DSA: their attention calls it with no
    flag, and `apply_rotary_pos_emb` is their indexer's)."""
    if not hasattr(module, "apply_rotary_pos_emb_interleave"):
        return False
    if getattr(getattr(rotary, "config", None), "rope_interleave", False):
        return True
    # the attention of the rotary class's own model (Dots3NoteText... vs Dots3NoteAudio...), else every attention
    prefix = type(rotary).__name__.removesuffix("RotaryEmbedding")
    classes = [cls for name, cls in vars(module).items() if name.endswith("Attention") and inspect.isclass(cls)
               and cls.__module__ == module.__name__ and "forward" in vars(cls)]
    own = [cls for cls in classes if cls.__name__ == prefix + "Attention"]
    for cls in own or classes:
        source = inspect.getsource(cls.forward)
        if "apply_rotary_pos_emb_interleave(" in source and "rope_interleave" not in source:
            return True
    return False


def _has_table(rotary, positions, layer_type) -> bool:
    try:
        _hf_tables(rotary, positions, layer_type)
        return True
    except KeyError:
        return False


def _hf_inv_freq(rotary, layer_type):
    for name in (f"{layer_type}_inv_freq", "inv_freq"):
        value = getattr(rotary, name, None)
        if torch.is_tensor(value):
            return value
    return None


AXES = ((0, 7, 8, 8, 9, 4095, 9000), (0, 7, 8, 9, 9, 4095, 9000), (0, 7, 8, 8, 10, 4100, 9001))


def _compare_axes(rope, rotary, layer_type) -> str:
    """'' when the [3, 1, t] tables agree (every axis differs somewhere in AXES), else what differs."""
    pos = torch.tensor(AXES)[:, None]  # [3, 1, t]
    fwd = inspect.signature(rotary.forward).parameters
    kwargs = {"layer_type": layer_type} if layer_type is not None and "layer_type" in fwd else {}
    with torch.no_grad():
        cos_hf, sin_hf = rotary(torch.zeros(1), pos, **kwargs)[:2]
    if cos_hf.ndim == 4:
        return f"{layer_type}: transformers' rotary returns one table per axis {tuple(cos_hf.shape)} (sections applied later)"
    cos, sin = rope.cos_sin(pos)
    c, s = _pairs(cos_hf, rope.rotary_dim), _pairs(sin_hf, rope.rotary_dim)
    if c is None or s is None:
        return f"{layer_type}: transformers' 3-axis table has {cos_hf.shape[-1]} channels, posenc {rope.rotary_dim}"
    err = max((c - cos.reshape(c.shape).double()).abs().max().item(), (s - sin.reshape(s.shape).double()).abs().max().item())
    return f"{layer_type}: 3-axis (M-RoPE) cos/sin differ by {err:.3g}" if err > TOL else ""


def _compare(rope, module, rotary, positions, layer_type) -> tuple[str, bool]:
    """'' when posenc's rope matches transformers' table for this layer type, else what differs; and bitwise."""
    cos_hf, sin_hf = _hf_tables(rotary, positions, layer_type)
    pos = torch.tensor(positions)
    if rope.mrope_section is not None:
        pos = pos[None, None].expand(3, 1, -1)
    cos, sin = rope.cos_sin(pos)
    cos, sin = cos.reshape(-1, cos.shape[-1]).double(), sin.reshape(-1, sin.shape[-1]).double()
    c, s = _pairs(cos_hf, rope.rotary_dim), _pairs(sin_hf, rope.rotary_dim)
    if c is None or s is None:
        return f"{layer_type}: transformers' table has {cos_hf.shape[-1]} channels, posenc rotary_dim {rope.rotary_dim}", False
    s = s * rope.direction  # nanochat's table is +theta and its apply turns by -theta: the rotation below decides
    err = max((c - cos).abs().max().item(), (s - sin).abs().max().item())
    if err > TOL:
        return f"{layer_type}: cos/sin differ by {err:.3g}", False
    bitwise = torch.equal(c, cos) and torch.equal(s, sin)
    if rope.mrope_section is not None:  # three axes that differ (text, then an image's rows and columns)
        why = _compare_axes(rope, rotary, layer_type)
        if why:
            return why, False
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, len(positions), rope.head_dim, generator=gen)
    k = torch.randn(1, 1, len(positions), rope.head_dim, generator=gen)
    try:
        theirs = _hf_rotate(module, rotary, positions, layer_type, q, k)
    except RuntimeError as e:
        return f"{layer_type}: transformers' apply function fails on head_dim {rope.head_dim}: {e}", False
    if theirs is not None:
        ours = rope.apply(q, k, pos)  # [t], or [3, 1, t] for multi-axis RoPE
        err = max((a - b).abs().max().item() for a, b in zip(theirs, ours))
        if err > 1e-4:
            return f"{layer_type}: the rotation differs by {err:.3g} (pairing)", False
    inv = _hf_inv_freq(rotary, layer_type)
    if inv is not None and inv.numel() == rope.rotary_dim // 2:
        ours = rope.inv_freq(max(positions) + 1)[0]
        if not torch.allclose(inv.float(), ours, rtol=1e-6, atol=0) and not torch.equal(inv.float().sort().values, ours.sort().values):
            # (a permutation of the ladder passes: Ernie 4.5 VL keeps its buffer pre-permuted; the per-pair
            # tables compared above are what its attention uses)
            return f"{layer_type}: inverse frequencies differ by {(inv.float() - ours).abs().max().item():.3g}", False
    return "", bitwise


def rope_keys(module, rotary, sub) -> dict[str, str]:
    """`{layer type: the key of transformers' table}` where the rotary class keys its tables by branch, not by
    layer type (DeepSeek-V4's "main" / "compress"): read from the attention class's own `rope_layer_type`, built
    on the meta device for one layer of each type; {} when the rotary class knows the layer types."""
    types = list(dict.fromkeys(getattr(sub, "layer_types", None) or []))
    known = getattr(rotary, "layer_types", None)
    attention = getattr(module, type(rotary).__name__.removesuffix("RotaryEmbedding") + "Attention", None)
    if not types or not known or set(types) <= set(known) or attention is None:
        return {}
    out = {}
    for layer_type in types:
        with torch.device("meta"):
            layer = attention(sub, sub.layer_types.index(layer_type))
        if getattr(layer, "rope_layer_type", None) is not None:
            out[layer_type] = layer.rope_layer_type
    return out


def _positions(rotary, sub, keys) -> tuple[int, ...]:
    """POSITIONS, or those inside the table of a class with a fixed-length table (GPT-J); checks the call runs
    (for the first layer type transformers has a table for: LFM3's "conv" layers have none)."""
    error: Exception = RuntimeError("no layer type")
    for layer_type in list(dict.fromkeys(getattr(sub, "layer_types", None) or [])) or [None]:
        layer_type = keys.get(layer_type, layer_type)
        try:
            _hf_tables(rotary, POSITIONS, layer_type)
            return POSITIONS
        except IndexError:
            inside = tuple(p for p in POSITIONS if p < sub.max_position_embeddings)
            _hf_tables(rotary, inside, layer_type)
            return inside
        except KeyError as e:
            error = e
    raise error


VISION_POSITIONS = ((0, 0), (0, 1), (1, 0), (3, 2), (7, 13), (40, 5), (1, 63))  # (row, column) patches


def check_axial(model_type, module, config) -> Outcome | None:
    """A vision tower's axial table (`rope_type: axial`) against `posenc.hf.vision_rope`; None if the module has
    no vision rotary class that transformers can build and call on `[n, 2]` patch positions."""
    import posenc.hf
    from posenc import PosencError

    pos = torch.tensor(VISION_POSITIONS)  # [n, 2]
    for sub in _sub_configs(config):
        if (getattr(sub, "rope_parameters", None) or {}).get("rope_type") != "axial":
            continue
        for name, cls in vars(module).items():
            if not (name.endswith("RotaryEmbedding") and inspect.isclass(cls) and cls.__module__ == module.__name__):
                continue
            try:
                with torch.no_grad():
                    cos_hf, sin_hf = cls(sub)(torch.zeros(1), pos)[:2]
            except Exception:  # noqa: BLE001 - not this class, or transformers cannot build it
                continue
            where = type(sub).__name__
            for form in (sub, sub.to_dict()):
                try:
                    rope = posenc.hf.vision_rope(form)
                except PosencError as e:
                    return Outcome(model_type, "refused", str(e), sub_config=where)
                except Exception as e:  # noqa: BLE001
                    return Outcome(model_type, "crash", f"{type(e).__name__}: {e}", sub_config=where)
                why = _compare_axial(rope, module, cos_hf, sin_hf, pos)
                if why:
                    return Outcome(model_type, "differs", why, sub_config=where)
            cos, sin = rope.cos_sin(pos)
            bitwise = torch.equal(_pairs(cos_hf, rope.head_dim), cos.double())
            return Outcome(model_type, "exact", bitwise=bitwise and torch.equal(_pairs(sin_hf, rope.head_dim),
                                                                                sin.double()), sub_config=where)
    return None


def _compare_axial(rope, module, cos_hf, sin_hf, pos) -> str:
    cos, sin = rope.cos_sin(pos)  # [n, head_dim/2]
    c, s = _pairs(cos_hf, rope.head_dim), _pairs(sin_hf, rope.head_dim)
    if c is None or s is None:
        return f"transformers' vision table has {cos_hf.shape[-1]} channels, posenc head_dim {rope.head_dim}"
    err = max((c - cos.double()).abs().max().item(), (s - sin.double()).abs().max().item())
    if err > TOL:
        return f"vision cos/sin differ by {err:.3g}"
    full = cos_hf.reshape(-1, cos_hf.shape[-1])
    layout = "split_half" if torch.equal(full[:, : rope.head_dim // 2], full[:, rope.head_dim // 2:]) else "interleaved"
    if layout != rope.pairing:  # the table's duplication says how the tower pairs channels
        return f"transformers' vision table pairs {layout}, posenc {rope.pairing}"
    apply = getattr(module, "apply_rotary_pos_emb_vision", None)
    if apply is not None and len([p for p in inspect.signature(apply).parameters.values()
                                  if p.default is inspect.Parameter.empty]) == 4:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(len(pos), 3, rope.head_dim, generator=gen)  # [patches, h, d]
        try:
            theirs = apply(q, q.flip(0), cos_hf, sin_hf)[0]
        except RuntimeError:
            return ""  # another signature ([b, h, t, d]): the table and its layout are compared above
        err = (theirs - rope.rotate(q, pos)).abs().max().item()
        if err > 1e-4:
            return f"the vision rotation differs by {err:.3g}"
    return ""


# The config classes whose defaults apply no RoPE anywhere, and the switch that turns it on (checked as well)
ROPE_ON = {
    "zamba2": {"use_mem_rope": True},
    "granitemoehybrid": {"position_embedding_type": "rope", "layer_types": ["mamba", "attention"] * 2,
                         "num_hidden_layers": 4},
    "bamba": {"attn_layer_indices": [1], "num_hidden_layers": 4},
}


# Config classes whose defaults no model can be built from (hidden_size not a multiple of the heads, and no
# head_dim: the attention layer itself fails), checked again with the head_dim of the published checkpoints
SIZED = {"glm4_moe": {"head_dim": 128}, "qwen3_omni_moe_text": {"head_dim": 128},
         "qwen3_omni_moe_thinker": {"text_config": {"head_dim": 128}},
         "qwen3_omni_moe": {"thinker_config": {"text_config": {"head_dim": 128}}}}


def check(model_type: str, module_name: str, overrides: dict | None = None) -> Outcome:
    """The outcome of one model type (see the module docstring), its config built with `overrides`."""
    from transformers import AutoConfig

    import posenc.hf
    from posenc import PosencError

    try:
        module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
        config = AutoConfig.for_model(model_type, **(overrides or {}))
    except Exception as e:  # noqa: BLE001 - transformers' own failure is a result, not ours
        return Outcome(model_type, "no reference", f"transformers: {type(e).__name__}: {str(e)[:120]}")
    rotary, why = None, "only vision rotary classes for this config (2-D positions)"
    for cls, sub in text_rotary(module, config):
        if (getattr(sub, "rope_parameters", None) or {}).get("rope_type") == "axial":
            why = "a vision tower's 2-D (axial) table"
            continue
        try:
            rotary = cls(sub)
            keys = rope_keys(module, rotary, sub)
            positions = _positions(rotary, sub, keys)
            break
        except Exception as e:  # noqa: BLE001 - transformers' own failure is a result, not ours
            rotary = None
            why = f"transformers: {cls.__name__}: {type(e).__name__}: {str(e)[:120]}"
    if rotary is None:
        return check_axial(model_type, module, config) or Outcome(model_type, "no reference", why)
    types = tuple(dict.fromkeys(getattr(sub, "layer_types", None) or ())) or (None,)
    bitwise, compared = True, 0
    # posenc reads the model's config (it finds the language model's text_config itself); a table that belongs to
    # another sub-config (an audio encoder's) is compared with posenc reading that sub-config
    top = config if sub is config or sub is vars(config).get("text_config") else sub
    where = "" if top is config else type(sub).__name__
    for form in (top, top.to_dict()):
        try:
            ropes = posenc.hf.rope_by_layer_type(form)
        except PosencError as e:
            return Outcome(model_type, "refused", str(e), layer_types=types)
        except Exception as e:  # noqa: BLE001 - posenc must never crash on a config transformers builds
            return Outcome(model_type, "crash", f"{type(e).__name__}: {e}", layer_types=types)
        for layer_type in types:
            if layer_type in ropes or None in ropes:
                mine = [ropes.get(layer_type, ropes.get(None))]
            else:  # transformers' one table; posenc names the layer types (Qwen3-MoE's full_attention)
                mine = list(ropes.values())
            for rope in mine:
                if rope is None:
                    continue  # posenc says this layer type applies no RoPE (checked by the NoPE tests)
                hf_type = keys.get(layer_type, layer_type)  # transformers' table of this layer type
                if layer_type is not None and not _has_table(rotary, positions, hf_type):
                    return Outcome(model_type, "differs", f"{layer_type}: posenc builds a Rope where transformers "
                                   "has no table", layer_types=types)
                try:
                    why, same = _compare(rope, module, rotary, positions, hf_type)
                except Exception as e:  # noqa: BLE001
                    return Outcome(model_type, "crash", f"comparing {layer_type}: {type(e).__name__}: {e}", layer_types=types)
                if why:
                    return Outcome(model_type, "differs", why, layer_types=types)
                bitwise &= same
                compared += 1
    if not compared:  # posenc says no layer rotates, where transformers builds a table: nothing was compared
        return Outcome(model_type, "no rope", "posenc: no layer of this config applies RoPE (see the NoPE rules)",
                       layer_types=types)
    return Outcome(model_type, "exact", bitwise=bitwise, layer_types=types, sub_config=where,
                   overrides=tuple(sorted((overrides or {}).items())))


def enumerate_all() -> list[Outcome]:
    from transformers.utils import logging

    logging.set_verbosity_error()
    out = []
    for model_type, module in rotary_model_types():
        outcome = check(model_type, module)
        if outcome.outcome == "no rope" and model_type in ROPE_ON:  # and the same config with RoPE switched on
            on = check(model_type, module, ROPE_ON[model_type])
            outcome = Outcome(model_type, on.outcome, f"defaults: no RoPE layer (as posenc reads them); with "
                              f"{sorted(ROPE_ON[model_type])} set: {on.outcome} {on.detail}".rstrip(), on.bitwise,
                              on.layer_types, on.overrides, on.sub_config)
        elif outcome.outcome == "refused" and model_type in SIZED:
            on = check(model_type, module, SIZED[model_type])
            outcome = Outcome(model_type, on.outcome, f"defaults refused ({outcome.detail}); with "
                              f"{SIZED[model_type]}: {on.outcome} {on.detail}".rstrip(), on.bitwise, on.layer_types,
                              on.overrides, on.sub_config)
        out.append(outcome)
    return out
