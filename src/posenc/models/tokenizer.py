"""The tokenizer stored in a GGUF file, as a `tokenizers.Tokenizer` (byte-level BPE: GPT-2, SmolLM, Qwen2, Llama-3).

The GGUF metadata holds the vocabulary (`tokenizer.ggml.tokens`, already spelled in GPT-2's byte alphabet),
the merges, the token types (3 = control: `<|im_start|>` and friends stay whole) and the name of the
pre-tokenizer (`tokenizer.ggml.pre`), which decides how text is split before the merges apply.

    >>> tok = load_tokenizer(embedded_model_path())          # doctest: +SKIP
    >>> tok.decode(tok.encode("The pass key is 71432.")) # doctest: +SKIP
    'The pass key is 71432.'
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import Raw, fail

__all__ = ["GGUFTokenizer", "load_tokenizer", "PRE_TOKENIZERS"]

_LETTERS_THEN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_REST = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# tokenizer.ggml.pre -> (split regex before byte-level encoding or None for GPT-2's, digits one by one)
PRE_TOKENIZERS: dict[str, tuple[str | None, bool]] = {
    "default": (None, False), "gpt-2": (None, False),
    "smollm": (None, True),  # SmolLM: every digit its own pre-token, then GPT-2's split
    "qwen2": (_LETTERS_THEN + r"\p{N}" + _REST, False),
    "llama-bpe": (_LETTERS_THEN + r"\p{N}{1,3}" + _REST, False),
}


class GGUFTokenizer:
    """`encode(text) -> list[int]` and `decode(ids) -> str` over a `tokenizers.Tokenizer` (`.backend`).

    Attributes:
        backend: the `tokenizers.Tokenizer`. vocab_size: tokens in the vocabulary.
        bos_token_id, eos_token_id, pad_token_id: from the file (None when absent).
        chat_template: the Jinja chat template stored in the file, or None.
    """

    def __init__(self, backend: Any, meta: dict[str, Any]) -> None:
        self.backend = backend
        self.vocab_size = len(meta["tokenizer.ggml.tokens"])
        self.bos_token_id = meta.get("tokenizer.ggml.bos_token_id")
        self.eos_token_id = meta.get("tokenizer.ggml.eos_token_id")
        self.pad_token_id = meta.get("tokenizer.ggml.padding_token_id")
        self.chat_template = meta.get("tokenizer.chat_template")

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (no BOS/EOS added; control tokens written in the text stay whole)."""
        if not isinstance(text, str):
            fail("text", "a str", type(text))
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as err:  # the backend would raise a bare TypeError
            fail("text", "a str of Unicode scalar values (encodable as UTF-8)",
                 Raw(f"a lone surrogate {text[err.start]!r} at index {err.start}"))
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Any) -> str:
        """The text of `ids` (a list of ints or a 1-D integer tensor), control tokens included."""
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        if any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size for i in ids):
            fail("ids", f"integers in [0, {self.vocab_size})", Raw(f"{ids[:8]}{'...' if len(ids) > 8 else ''}"))
        return self.backend.decode(ids, skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"GGUFTokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_id})"


def _vocabulary(meta: dict[str, Any]) -> tuple[list[str], list[tuple[str, str]], list[int]]:
    """The tokens, merges and token types of the file, checked: the BPE backend panics or mis-builds on less."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        fail("tokenizer.ggml.tokens", "a non-empty array of strings", Raw(repr(tokens)[:80]))
    if len(set(tokens)) != len(tokens):
        fail("tokenizer.ggml.tokens", "distinct tokens (one id each)",
             Raw(f"{len(tokens) - len(set(tokens))} repeated"))
    raw = meta["tokenizer.ggml.merges"]
    if not isinstance(raw, list) or not all(isinstance(m, str) and m.count(" ") >= 1 for m in raw):
        fail("tokenizer.ggml.merges", "an array of strings 'left right'", Raw(repr(raw)[:80]))
    merges = [tuple(m.split(" ", 1)) for m in raw]
    known = set(tokens)
    for i, (left, right) in enumerate(merges):
        if left not in known or right not in known or left + right not in known:
            fail("tokenizer.ggml.merges", "merges of tokens in the vocabulary into a token of it",
                 Raw(f"merge {i} {left + ' ' + right!r}"))
    types = meta.get("tokenizer.ggml.token_type") or []
    if not isinstance(types, list) or (types and len(types) != len(tokens)) \
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in types):
        fail("tokenizer.ggml.token_type", f"an array of {len(tokens)} integers (one per token)", Raw(repr(types)[:80]))
    return tokens, merges, types


def load_tokenizer(path: str | Path) -> GGUFTokenizer:
    """The byte-level BPE tokenizer stored in a GGUF file.

    Args:
        path: a `.gguf` file whose `tokenizer.ggml.model` is "gpt2" (byte-level BPE).
    Returns:
        A `GGUFTokenizer`.
    Raises:
        PosencError: no `gguf` or `tokenizers` package, a file without a byte-level BPE vocabulary, or a
            pre-tokenizer posenc does not know (the split would silently differ from the model's).
    """
    from .gguf_checkpoint import gguf_metadata

    meta = gguf_metadata(path)
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2" or "tokenizer.ggml.merges" not in meta:
        fail("path", "a GGUF file with a byte-level BPE tokenizer (tokenizer.ggml.model 'gpt2' with merges)", model)
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        fail("tokenizer.ggml.pre", f"one of {sorted(PRE_TOKENIZERS)}", pre)
    try:
        from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    except ImportError:
        fail("path", "a GGUF tokenizer with the `tokenizers` package installed (it ships with transformers)",
             str(path))
    tokens, merges, types = _vocabulary(meta)
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    split, digits = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(split), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t, kind in zip(tokens, types) if kind == 3])  # 3: control
    return GGUFTokenizer(backend, meta)
