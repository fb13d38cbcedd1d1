"""Real text every Python has: the English documentation in CPython's `pydoc_data.topics`.

    >>> text, facts = reference_text()
    >>> facts["source"], facts["chars"] == len(text), len(facts["sha256"])
    ('pydoc_data.topics', True, 64)
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import torch

__all__ = ["reference_text", "text_ids"]


def reference_text() -> tuple[str, dict[str, Any]]:
    """The topics joined in sorted key order, and facts for the report (length, sha256, Python version)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    facts = {"source": "pydoc_data.topics", "python": sys.version.split()[0], "topics": len(topics),
             "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()}
    return text, facts


def text_ids(tokenizer: Any, tokens: int, *, vocab_size: int | None = None, seed: int = 0
             ) -> tuple[torch.Tensor, dict[str, Any]]:
    """`[n]` int64 ids of at least `tokens` tokens of the reference text (or seeded random ids without a tokenizer).

    Args:
        tokenizer: an object with `encode(str) -> list[int]`, or None (then `vocab_size` is required).
        tokens: how many tokens the checks need (the text is cut near 4.5 characters per token).
    Returns:
        `(ids, facts)`; facts record the text's sha256 and length, or that the ids are random.
    """
    if tokenizer is None:
        gen = torch.Generator().manual_seed(seed)
        return torch.randint(0, int(vocab_size), (max(tokens, 1),), generator=gen), \
            {"source": f"random ids (seed {seed}, no tokenizer)", "tokens": max(tokens, 1)}
    text, facts = reference_text()
    chars = min(len(text), int(tokens * 4.5) + 1000)
    ids = tokenizer.encode(text[:chars])
    while len(ids) < tokens and chars < len(text):
        chars = min(len(text), chars * 2)
        ids = tokenizer.encode(text[:chars])
    facts.update(chars_used=chars, tokens=len(ids))
    return torch.tensor(ids, dtype=torch.long), facts
