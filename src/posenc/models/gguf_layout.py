"""A bounds check of a GGUF file's header and metadata section, before the `gguf` package parses it.

The `gguf` reader trusts the counts a file declares. Past the end of the file its reads return empty
arrays instead of failing, so a 40-byte file declaring one metadata array of 2**40 numbers makes it
loop 2**40 times, growing a list of empty arrays until memory runs out. This walk reads only the
sizes (GGUF v2/v3: `magic, version u32, tensors u64, keys u64`, then per key `string, type u32,
value`) and refuses any count the rest of the file cannot hold, naming the key; then the tensor infos
(`name, dims, shape, type, offset`): a tensor whose data the file does not hold (cut short) or that runs
into the next one is refused by name, with the bytes expected and the bytes present.

    >>> import struct, tempfile, pathlib
    >>> header = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1)          # version 3, 0 tensors, 1 key
    >>> forged = header + struct.pack("<Q", 3) + b"arr" + struct.pack("<IIQ", 9, 0, 2**40)  # uint8[2**40]
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "forged.gguf"
    >>> _ = path.write_bytes(forged)
    >>> try:
    ...     check_gguf_layout(path)
    ... except PosencError as e:
    ...     print(e)
    arr: expected an array the file can hold (at most 0 bytes left), got 1099511627776 elements of 1 byte(s)
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

from ..errors import PosencError, Raw, fail  # noqa: F401 (PosencError: the doctest)

__all__ = ["check_gguf_layout"]

# GGUF value types: fixed sizes in bytes; 8 = string (u64 length + bytes), 9 = array (u32 type, u64 count, items)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MIN_SIZE = {**_SCALAR, _STRING: 8, _ARRAY: 12}  # the fewest bytes one value of a type takes


class _Walk:
    """A cursor over the file's bytes that refuses any read past the end."""

    def __init__(self, data: bytes | mmap.mmap, order: str, where: str) -> None:
        self.data, self.order, self.where, self.at = data, order, where, 0

    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, fmt: str, arg: str) -> int:
        size = struct.calcsize(fmt)
        if size > self.left():
            fail(arg, f"{size} more bytes in {self.where}",
                 Raw(f"{self.left()} (the file ends at byte {len(self.data)})"))
        (value,) = struct.unpack_from(self.order + fmt, self.data, self.at)
        self.at += size
        return value

    def string(self, arg: str) -> str:
        n = self.take("Q", arg)
        if n > self.left():
            fail(arg, f"a string the file can hold (at most {self.left()} bytes left)", Raw(f"a length of {n}"))
        text = bytes(self.data[self.at:self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return text

    def value(self, kind: int, arg: str, depth: int = 0) -> None:
        if kind in _SCALAR:
            self.take({1: "B", 2: "H", 4: "I", 8: "Q"}[_SCALAR[kind]], arg)
        elif kind == _STRING:
            self.string(arg)
        elif kind == _ARRAY and depth < 4:
            item, count = self.take("I", arg), self.take("Q", arg)
            if item not in _MIN_SIZE:
                fail(arg, f"an array of a GGUF value type in {sorted(_MIN_SIZE)}", Raw(f"item type {item}"))
            if count * _MIN_SIZE[item] > self.left():
                fail(arg, f"an array the file can hold (at most {self.left()} bytes left)",
                     Raw(f"{count} elements of {_MIN_SIZE[item]} byte(s)"))
            if item in _SCALAR:
                self.at += count * _SCALAR[item]
            else:
                for _ in range(count):
                    self.value(item, arg, depth + 1)
        else:
            fail(arg, f"a GGUF value type in {sorted(_MIN_SIZE)} (arrays nested at most 4 deep)", Raw(f"type {kind}"))


def check_gguf_layout(path: str | Path) -> None:
    """Refuse a GGUF file whose header, metadata or tensor data declares more than the file holds.

    Raises:
        PosencError: `path` for a bad magic, version or key count; the key's name for a value that runs
            past the end of the file or an unknown value type; the tensor's name, with the bytes its shape
            and type need and the bytes present, for data cut short or overlapping the next tensor.
    """
    path = Path(path)
    with open(path, "rb") as handle:
        size = path.stat().st_size
        if size < 24:
            fail("path", "a readable GGUF file (magic 'GGUF', version, counts: 24 bytes at least)",
                 Raw(f"{size} bytes in {str(path)!r}"))
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            _walk(data, str(path))
        finally:
            data.close()


def _walk(data: mmap.mmap, where: str) -> None:
    if data[:4] != b"GGUF":
        fail("path", "a readable GGUF file (it starts with b'GGUF')", Raw(f"{bytes(data[:4])!r} at the start of {where!r}"))
    order = "<" if struct.unpack_from("<I", data, 4)[0] in (2, 3) else ">"  # gguf writes big-endian files too
    walk = _Walk(data, order, where)
    walk.at = 4
    version = walk.take("I", "path")
    if version not in (2, 3):
        fail("path", "a readable GGUF file of version 2 or 3", Raw(f"version {version} in {where!r}"))
    tensors, keys = walk.take("Q", "path"), walk.take("Q", "path")
    if keys * 13 > walk.left() or tensors * 24 > walk.left():  # the smallest key-value and tensor entries
        fail("path", f"a readable GGUF file: counts it can hold ({walk.left()} bytes after the header)",
             Raw(f"{keys} metadata keys and {tensors} tensors declared in {where!r}"))
    alignment = 32  # GGUF's default; `general.alignment` (uint32) overrides it
    for i in range(keys):
        key = walk.string(f"metadata key {i}")
        kind = walk.take("I", key)
        if key == "general.alignment" and kind == 4:
            alignment = walk.take("I", key) or 32
        else:
            walk.value(kind, key)
    _check_tensors(walk, tensors, alignment)


def _check_tensors(walk: _Walk, count: int, alignment: int) -> None:
    """Each tensor's data lies inside the file and does not run into the next tensor's: the tensor named,
    the bytes its shape and type need against the bytes there."""
    infos = []
    for i in range(count):
        name = walk.string(f"tensor {i}")
        dims = walk.take("I", name)
        if dims > 8:
            fail(name, "at most 8 dimensions", Raw(f"{dims}"))
        shape = [walk.take("Q", name) for _ in range(dims)]
        kind, offset = walk.take("I", name), walk.take("Q", name)
        infos.append((offset, name, shape, kind))
    start = -(-walk.at // alignment) * alignment  # the data section begins at the next multiple of the alignment
    size = len(walk.data)
    infos.sort()
    for j, (offset, name, shape, kind) in enumerate(infos):
        need = _tensor_bytes(name, shape, kind)
        if need is None:
            continue  # a type this check does not know: the reader refuses it by name
        at = start + offset
        present = max(0, min(need, size - at))
        if present < need:
            fail(name, f"{need} bytes of data ({_type_name(kind)}, shape {shape}) from byte {at}",
                 Raw(f"{present} bytes present: the file ends at byte {size} (truncated)"))
        if j + 1 < len(infos) and offset + need > infos[j + 1][0]:
            room = infos[j + 1][0] - offset
            fail(name, f"{need} bytes of data ({_type_name(kind)}, shape {shape}) before the next tensor",
                 Raw(f"{room} bytes until {infos[j + 1][1]} starts (inconsistent offsets)"))


def _tensor_bytes(name: str, shape: list[int], kind: int) -> int | None:
    """Bytes of a tensor's data from ggml's block sizes (the `gguf` package's table), None for an unknown type."""
    try:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    except (ImportError, ValueError, KeyError):
        return None
    elements = 1
    for n in shape:
        elements *= int(n)
    if elements % block:
        fail(name, f"a multiple of {block} elements ({_type_name(kind)} blocks)", Raw(f"shape {shape}: {elements}"))
    return elements // block * type_size


def _type_name(kind: int) -> str:
    try:
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(kind).name
    except (ImportError, ValueError):
        return f"type {kind}"
