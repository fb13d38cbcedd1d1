"""Real text that every CPython has, as bytes (vocabulary 256), split into train and validation by document.

Corpora:
- "stdlib": the standard library's own `*.py` sources (`sysconfig.get_paths()["stdlib"]`, without
  `test/`, `tests/`, `idlelib/`, `lib2to3/`, `site-packages/`): about 11 MB on CPython 3.11.
- "pydoc": the English reference topics shipped in `pydoc_data.topics` (about 0.47 MB).

A document goes to validation when the CRC-32 of its name is 0 mod 20 (about 5 %), so no document is
in both splits. The corpus differs slightly between Python versions: `Corpus.sha256` (of the train and
validation bytes) is recorded with every result; compare runs only on equal checksums.

    >>> import torch
    >>> stream = torch.arange(100, dtype=torch.uint8)
    >>> eval_windows(stream, count=3, length=10).shape
    torch.Size([3, 11])
"""

from __future__ import annotations

import hashlib
import pathlib
import platform
import sysconfig
import zlib
from dataclasses import dataclass

import torch

from ..errors import fail

__all__ = ["Corpus", "load_corpus", "train_batch", "eval_windows"]

VOCAB = 256
_SKIP = ("test", "tests", "idlelib", "lib2to3", "site-packages")


@dataclass(frozen=True)
class Corpus:
    """Bytes of a corpus, split by document.

    Attributes:
        name: "stdlib" or "pydoc". source: where the bytes came from (a path or module).
        train, val: uint8 streams `[n]`. documents: (train, val) document counts.
        sha256: hex digest of `train + val`. python: the interpreter version that shipped the text.
    """

    name: str
    source: str
    train: torch.Tensor
    val: torch.Tensor
    documents: tuple[int, int]
    sha256: str
    python: str

    def describe(self) -> dict:
        """JSON-ready facts (no tensors)."""
        return dict(name=self.name, source=self.source, train_bytes=int(self.train.numel()),
                    val_bytes=int(self.val.numel()), train_documents=self.documents[0],
                    val_documents=self.documents[1], sha256=self.sha256, python=self.python, vocab=VOCAB)


def _stdlib_documents() -> tuple[str, list[tuple[str, bytes]]]:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in _SKIP for part in rel.parts):
            continue
        docs.append((rel.as_posix(), path.read_bytes()))
    return str(root), docs


def _pydoc_documents() -> tuple[str, list[tuple[str, bytes]]]:
    from pydoc_data import topics

    return "pydoc_data.topics", [(key, topics.topics[key].encode("utf-8")) for key in sorted(topics.topics)]


def load_corpus(name: str = "stdlib") -> Corpus:
    """Read a corpus and split it (deterministic for a given Python installation).

    Args:
        name: "stdlib" or "pydoc".
    Returns:
        The `Corpus`.
    Raises:
        PosencError: an unknown name, or a corpus too small to hold a validation split.
    """
    if name == "stdlib":
        source, docs = _stdlib_documents()
    elif name == "pydoc":
        source, docs = _pydoc_documents()
    else:
        fail("corpus", "'stdlib' or 'pydoc'", name)
    train, val = bytearray(), bytearray()
    counts = [0, 0]
    for doc_name, text in docs:
        is_val = zlib.crc32(doc_name.encode()) % 20 == 0
        (val if is_val else train).extend(text + b"\n")
        counts[is_val] += 1
    if not train or not val:
        fail("corpus", "documents in both the train and validation splits", f"{counts[0]} and {counts[1]}")
    digest = hashlib.sha256(bytes(train) + bytes(val)).hexdigest()
    to_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)  # noqa: E731 - [n] uint8
    return Corpus(name, source, to_tensor(train), to_tensor(val), (counts[0], counts[1]), digest,
                  platform.python_version())


def train_batch(stream: torch.Tensor, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """`[batch_size, length + 1]` int64 token windows at random offsets (inputs `[:, :-1]`, targets `[:, 1:]`)."""
    if stream.numel() <= length + 1:
        fail("stream", f"more than {length + 1} bytes", stream)
    starts = torch.randint(0, stream.numel() - length - 1, (batch_size,), generator=generator)  # [b]
    index = starts[:, None] + torch.arange(length + 1)  # [b, length + 1]
    return stream[index].long()


def eval_windows(stream: torch.Tensor, count: int, length: int, *, offset: int = 0) -> torch.Tensor:
    """`[count, length + 1]` int64 windows at evenly spaced, fixed offsets (overlapping if the stream is short).

    Every evaluation length uses prefixes of these same windows, so positions `[0, L0)` are the same
    text at every length and for every method.

    Args:
        stream: uint8 `[n]`. count: windows. length: tokens scored per window. offset: first start.
    Raises:
        PosencError: a stream shorter than one window.
    """
    span = stream.numel() - offset - length - 1
    if span < 0:
        fail("stream", f"at least {offset + length + 1} bytes for windows of {length} tokens", stream)
    starts = torch.linspace(offset, offset + span, count).long()  # [count]
    return stream[starts[:, None] + torch.arange(length + 1)].long()  # [count, length + 1]
