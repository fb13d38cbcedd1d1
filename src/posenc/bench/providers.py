"""The providers `posenc bench` times: posenc's implementations, the peers that import here, and the floors.

Each `Provider` makes, untimed, a zero-argument callable for given q, k `[b, h, t, d]` and positions that
returns the rotated pair in `[b, h, t, d]`; the peers' own layouts and tables are prepared in `make`.
Peers are imported lazily and skipped, with a note, when they do not import.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

__all__ = ["Provider", "providers", "hf_tables"]


@dataclass
class Provider:
    name: str
    inplace: bool
    make: Callable  # (q, k, pos, cos_hf, sin_hf) -> zero-argument callable returning (q_rot, k_rot) [b, h, t, d]
    # (in place: q and k themselves, or the provider's own rotated copies)
    pairing: str | None = None  # the pairing its rotation follows (checked once against the oracle); None: a floor


def hf_tables(rope, pos: torch.Tensor, dtype: torch.dtype):
    """transformers' Llama cos/sin `[b, t, d]` in the input dtype, as its rotary module returns them."""
    cos, sin = rope.cos_sin(pos if pos.ndim == 2 else pos[None])  # [b or 1, t, d/2] float32
    return torch.cat((cos, cos), -1).to(dtype), torch.cat((sin, sin), -1).to(dtype)


def providers(quick: bool) -> tuple[list[Provider], list[str]]:
    """The providers that import here, and notes on those that do not."""
    from ..rope.spec import Rope

    rope = Rope(head_dim=128)
    found = [
        Provider("copy_ (floor)", True, lambda q, k, *_: _copy_into(q, k)),
        Provider("clone (floor)", False, lambda q, k, *_: lambda: (q.clone(), k.clone())),
        Provider("clone into huge pages (floor)", False, _clone_huge),
        Provider("posenc apply_ (held table)", True, _posenc(rope, True), "split_half"),
        Provider("posenc apply (held table)", False, _posenc(rope, False), "split_half"),
        Provider("posenc apply_ (no table)", True, lambda q, k, pos, *_: lambda: rope.apply_(q, k, pos), "split_half"),
        Provider("posenc apply (no table)", False, lambda q, k, pos, *_: lambda: rope.apply(q, k, pos), "split_half"),
        Provider("posenc reference", False, lambda q, k, pos, *_: lambda: rope.apply(q, k, pos, impl="reference"),
                 "split_half"),
        Provider("complex multiply, in place", True, _complex_inplace, "interleaved"),
    ]
    notes = []
    try:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    except ImportError:
        notes.append("transformers: not installed")
    else:
        found.append(Provider("transformers eager", False, lambda q, k, pos, c, s: lambda: apply_rotary_pos_emb(q, k, c, s),
                              "split_half"))
        if not quick:
            fn = torch.compile(apply_rotary_pos_emb, fullgraph=True, dynamic=False)
            found.append(Provider("transformers torch.compile", False, lambda q, k, pos, c, s: lambda: fn(q, k, c, s),
                                  "split_half"))
    try:
        from rotary_embedding_torch import RotaryEmbedding
    except ImportError:
        notes.append("rotary-embedding-torch: not installed")
    else:
        found.append(Provider("rotary-embedding-torch", False, _lucidrains(RotaryEmbedding), "interleaved"))
    torchtune_rope, note = _torchtune_rope()
    if note:
        notes.append(note)
    if torchtune_rope is not None:
        found.append(Provider("torchtune", False, _torchtune(torchtune_rope), "interleaved"))
    try:
        import intel_extension_for_pytorch as ipex
    except ImportError:
        notes.append("intel-extension-for-pytorch: not installed (needs its own torch: docs/performance.md)")
    except Exception as exc:  # its torch-version check raises AttributeError (a typo'd os.exit) on a mismatch
        notes.append(f"intel-extension-for-pytorch: not importable with torch {torch.__version__} ({type(exc).__name__})")
    else:
        found += [Provider("ipex rotary op (out of place)", False, _ipex(rope, ipex, inplace=False), "split_half"),
                  Provider("ipex functional (in place = op + copy back)", True, _ipex(rope, ipex, inplace=True),
                           "split_half")]
    try:
        import vllm._custom_ops as vllm_ops  # registers torch.ops._C.rotary_embedding (vLLM's CPU build)
    except Exception as exc:  # not installed, or an install whose extension does not load with this torch
        notes.append(f"vllm rotary op: not importable ({type(exc).__name__}; it lives in its own environment: "
                     "docs/performance.md)")
    else:
        found.append(Provider("vllm rotary op (in place)", True, _vllm(rope, vllm_ops), "split_half"))
    if not quick:
        found.append(Provider("posenc compiled", False, lambda q, k, pos, *_: lambda: rope.apply(q, k, pos, impl="compiled"),
                              "split_half"))
    return found, notes


def _posenc(rope, inplace: bool):
    """posenc's default path with a held table (`rope.table`, made once, outside the timed call), as a decode loop
    runs; the "(no table)" providers time the plain call `rope.apply(_)(q, k, pos)`, angles made per call."""
    def make(q, k, pos, *_):
        table = rope.table(int(pos.max()) + 1)
        fn = rope.apply_ if inplace else rope.apply
        return lambda: fn(q, k, pos, table=table)

    return make


def _vllm(rope, ops):
    """vLLM's CPU rotary op, in place on `[tokens, heads * d]` (its layout; made untimed from `[b, h, t, d]`), with its
    cos|sin cache `[max_pos, d]` in q's dtype (so bfloat16 results are rounded from bfloat16 tables)."""
    def make(q, k, pos, *_):
        b, hq, t, d = q.shape
        q_v = q.transpose(1, 2).reshape(b * t, hq * d).clone()  # [b*t, hq*d]
        k_v = k.transpose(1, 2).reshape(b * t, k.shape[1] * d).clone()  # [b*t, hk*d]
        table = rope.table(int(pos.max()) + 1)
        cache = torch.cat((table.cos, table.sin), -1).to(q.dtype)  # [max_pos, d]
        positions = (pos if pos.ndim == 2 else pos.expand(b, t)).reshape(-1).contiguous()  # [b*t]

        def run():
            ops.rotary_embedding(positions, q_v, k_v, d, cache, True)  # is_neox: split-half pairs
            return (q_v.view(b, t, hq, d).transpose(1, 2), k_v.view(b, t, -1, d).transpose(1, 2))

        return run

    return make


def _copy_into(q, k):
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    return lambda: (q_out.copy_(q), k_out.copy_(k))


def _clone_huge(q, k, *_):
    """Fresh outputs advised as the kernel advises its own (transparent huge pages), then `copy_`: the
    allocating floor for the same memory strategy as `posenc apply (held table)`."""
    from ..kernels.cpu import advise_huge_pages

    def run():
        q_out, k_out = advise_huge_pages(torch.empty_like(q)), advise_huge_pages(torch.empty_like(k))
        return q_out.copy_(q), k_out.copy_(k)
    return run


def _complex_inplace(q, k, pos, *_):
    """Meta's complex rotation written in place (interleaved pairs; torch has no complex bf16: it upcasts)."""
    from ..rope.spec import Rope

    cos, sin = Rope(head_dim=128).cos_sin(pos)  # [.., t, 64]
    freqs = torch.complex(cos, sin)[..., None, :, :] if cos.ndim == 3 else torch.complex(cos, sin)  # [b?, 1?, t, 64]
    if q.dtype == torch.float32:
        def native():
            torch.view_as_complex(q.unflatten(-1, (-1, 2))).mul_(freqs)
            torch.view_as_complex(k.unflatten(-1, (-1, 2))).mul_(freqs)
            return q, k
        return native

    def upcast():
        for x in (q, k):
            x.copy_(torch.view_as_real(torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * freqs).flatten(-2))
        return q, k
    return upcast


def _lucidrains(cls):
    def make(q, k, pos, *_):
        rot = cls(dim=128)
        rot.rotate_queries_or_keys(torch.zeros(1, 1, 8, 128))  # fill its cache in float32 (bf16 first fills it wrong)
        offset = int(pos.flatten()[0])
        return lambda: (rot.rotate_queries_or_keys(q, offset=offset), rot.rotate_queries_or_keys(k, offset=offset))
    return make


def _torchtune_rope():
    """(torchtune's RotaryPositionalEmbeddings or None, a note or None).

    torchtune's package `__init__` refuses to import without a torchao built for the same torch; its RoPE
    module itself needs only torch, so when the package import fails the module is loaded from its file.
    """
    try:
        from torchtune.modules import RotaryPositionalEmbeddings
        return RotaryPositionalEmbeddings, None
    except Exception:  # noqa: BLE001 (ImportError, or torchao failing inside torchtune's __init__)
        pass
    import importlib.util

    spec = importlib.util.find_spec("torchtune")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        return None, "torchtune: not installed"
    path = Path(spec.submodule_search_locations[0]) / "modules" / "position_embeddings.py"
    module_spec = importlib.util.spec_from_file_location("_posenc_bench_torchtune_rope", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.RotaryPositionalEmbeddings, ("torchtune: its RotaryPositionalEmbeddings loaded from its own file "
                                               "(the package __init__ needs a torchao built for this torch)")


def _torchtune(cls):
    """torchtune's RoPE (interleaved pairs, out of place, float32 math) on [b, t, h, d] copies made once, untimed."""
    def make(q, k, pos, *_):
        rot = cls(q.shape[-1], max_seq_len=int(pos.max()) + 1)
        qt, kt = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()  # [b, t, h, d]
        from_zero = pos.ndim == 1 and bool((pos == torch.arange(pos.numel())).all())
        input_pos = None if from_zero else pos if pos.ndim == 2 else pos[None]  # [b, t]
        return lambda: (rot(qt, input_pos=input_pos).transpose(1, 2), rot(kt, input_pos=input_pos).transpose(1, 2))
    return make


def _ipex(rope, ipex, inplace: bool):
    """Intel Extension for PyTorch's fused CPU RoPE (split-half pairs) on q and k in its own layout `[b, t, h, d]`.

    Untimed set-up: q and k copied once to `[b, t, h, d]`, and its float32 `sin | cos` table holding the rows of
    the distinct positions, indexed by `position_ids [b, t]`. `inplace=False` times the op
    `torch_ipex.rotary_position_embedding` (out of place, one call per tensor); `inplace=True` times
    `ipex.llm.functional.rotary_embedding`, which runs that op and copies the results back into q and k.
    """
    def make(q, k, pos, *_):
        b, hq, t, d = q.shape
        hk = k.shape[1]
        rows, index = torch.unique(pos, return_inverse=True)  # [p] distinct positions; index: pos's shape
        cos, sin = rope.cos_sin(rows)  # [p, d/2] float32
        pid = index.expand(b, t).contiguous()  # [b, t] rows of the table ([t] or [b, 1] broadcast)
        qs, ks = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()  # [b, t, h, d]
        if inplace:
            cos_full, sin_full = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # [p, d], as its API takes them
            def run():
                ipex.llm.functional.rotary_embedding(qs, ks, sin_full, cos_full, d, True, pid)
                return qs.transpose(1, 2), ks.transpose(1, 2)  # [b, h, t, d] views
            return run
        table = torch.cat((sin, cos), -1).contiguous()  # [p, d] = sin | cos, float32
        op = torch.ops.torch_ipex.rotary_position_embedding
        return lambda: (op(qs, table, pid, hq, d, d // 2, d)[0].transpose(1, 2),
                        op(ks, table, pid, hk, d, d // 2, d)[0].transpose(1, 2))  # [b, h, t, d] views
    return make
