"""Test helper: transformers' own rotary embedding and apply function for a config dict (the parity oracle).

Everything here is transformers' code path for the model type: its config class (which standardises 4.x
keys), its `*RotaryEmbedding` module (built fresh per call, because dynamic and LongRoPE modules keep
state between calls) and the apply function its attention layer calls. Nothing comes from posenc.
"""

from __future__ import annotations

import copy
import importlib
import json
from pathlib import Path

import torch

FIXTURES = Path(__file__).parent / "fixtures" / "hf_configs"
# model types whose modeling code lives under another model's folder
_MODULE = {"gemma3_text": "gemma3", "qwen2_vl_text": "qwen2_vl", "qwen2_5_vl_text": "qwen2_5_vl"}


def load_fixture(name: str) -> dict:
    """A fixture config.json as a dict, without the `_source` note."""
    cfg = json.loads((FIXTURES / f"{name}.json").read_text())
    return {k: v for k, v in cfg.items() if not k.startswith("_")}


def fixture_names() -> list[str]:
    return sorted(p.stem for p in FIXTURES.glob("*.json"))


def hf_config(cfg: dict):
    """transformers' config object for a config.json dict (deep-copied: transformers mutates nested dicts)."""
    from transformers import AutoConfig
    from transformers.utils import logging

    logging.set_verbosity_error()
    kwargs = copy.deepcopy({k: v for k, v in cfg.items() if not k.startswith("_")})
    scaling = kwargs.get("rope_scaling") or {}
    if kwargs["model_type"] == "phi3" and scaling.get("type") == "su":
        # transformers 5.24 renames Phi-3's legacy "su" only after standardising, then misses
        # original_max_position_embeddings and refuses the config; "longrope" is the same rule under its new name.
        scaling["type"] = "longrope"
    return AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)


def _text(config):
    return getattr(config, "text_config", None) or config


def _modeling(model_type: str):
    name = _MODULE.get(model_type, model_type)
    return importlib.import_module(f"transformers.models.{name}.modeling_{name}")


def _rotary_class(module):
    found = [c for n, c in vars(module).items() if n.endswith("RotaryEmbedding") and "Vision" not in n]
    assert len(found) == 1, found
    return found[0]


def _rotate_partial(apply, q, k, cos, sin):
    """Rotate the leading cos.shape[-1] channels with `apply`, pass the rest through (as the attention does)."""
    r = cos.shape[-1]
    q_rot, k_rot = apply(q[..., :r], k[..., :r], cos, sin)
    return torch.cat((q_rot, q[..., r:]), -1), torch.cat((k_rot, k[..., r:]), -1)


def hf_apply(cfg, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, layer_type: str | None = None):
    """transformers' rotation of q `[b, hq, t, d]` and k `[b, hk, t, d]` at `position_ids` ([t], [b, t] or [3, b, t]).

    `cfg` is a config.json dict or a transformers config object.
    """
    config = hf_config(cfg) if isinstance(cfg, dict) else cfg
    text = _text(config)
    model_type = text.model_type
    module = _modeling(model_type)
    rotary = _rotary_class(module)(text)
    pos = position_ids if position_ids.ndim >= 2 else position_ids[None]  # [b, t] or [3, b, t]
    with torch.no_grad():
        if model_type == "gptj":
            sin, cos = rotary(q, pos)  # [b, t, r/2] each; GPT-J's apply takes [b, t, h, d]
            r = 2 * sin.shape[-1]

            def rot(x):
                xt = x.transpose(1, 2)
                out = module.apply_rotary_pos_emb(xt[..., :r], sin, cos)
                return torch.cat((out, xt[..., r:]), -1).transpose(1, 2)

            return rot(q), rot(k)
        if model_type == "deepseek_v2":
            return module.apply_rotary_emb(q, k, rotary(q, pos))
        if model_type in ("gemma3_text", "olmo3"):
            cos, sin = rotary(q, pos, layer_type or "full_attention")
        else:
            cos, sin = rotary(q, pos)
        if model_type == "deepseek_v3" and text.rope_interleave:
            return module.apply_rotary_pos_emb_interleave(q, k, cos, sin)
        if model_type == "gpt_oss":  # per-pair tables [b, t, d/2], applied to the whole head
            return module.apply_rotary_pos_emb(q, k, cos, sin)
        return _rotate_partial(module.apply_rotary_pos_emb, q, k, cos, sin)


def hf_softmax_scale_factor(cfg) -> float:
    """The factor DeepSeek's attention multiplies into `qk_head_dim ** -0.5` (1 for every other model)."""
    config = hf_config(cfg) if isinstance(cfg, dict) else cfg
    text = _text(config)
    module = _modeling(text.model_type)
    if not hasattr(module, "yarn_apply_mscale"):
        return 1.0
    return module.yarn_apply_mscale(text.rope_parameters, 1.0)
