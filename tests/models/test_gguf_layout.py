"""A GGUF file cut inside its tensor data, or whose tensor offsets overlap, is refused naming the tensor and
the bytes: what its shape and type need against what the file holds."""

import re
import struct

import pytest

from posenc import PosencError
from posenc.models.loading import read_checkpoint

gguf = pytest.importorskip("gguf", reason="the gguf package writes and reads GGUF files")

from tests.models.test_loading_hostile import write_gguf  # noqa: E402


def tensor_infos(path):
    """`{name: ReaderTensor}` of an intact file, read by the gguf package (independently of the check)."""
    reader = gguf.GGUFReader(path)
    return {t.name: t for t in reader.tensors}, reader


def test_a_file_cut_inside_a_tensor_names_it_and_the_bytes(tmp_path):
    path = write_gguf(tmp_path / "ok.gguf")
    data = path.read_bytes()
    tensors, _ = tensor_infos(path)
    last = max(tensors.values(), key=lambda t: t.data_offset)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:last.data_offset + last.n_bytes - 10])
    with pytest.raises(PosencError) as err:
        read_checkpoint(cut)
    message = str(err.value)
    assert message.startswith(f"{last.name}: expected {last.n_bytes} bytes of data (F32, shape "), message
    present = int(re.search(r"got (\d+) bytes present", message).group(1))
    assert present == last.n_bytes - 10 and f"the file ends at byte {cut.stat().st_size} (truncated)" in message


def test_overlapping_tensor_offsets_name_the_tensor_and_its_neighbour(tmp_path):
    path = write_gguf(tmp_path / "ok.gguf")
    data = bytearray(path.read_bytes())
    tensors, reader = tensor_infos(path)
    first, second = sorted(tensors.values(), key=lambda t: t.data_offset)[:2]
    field = second.field  # parts: name length, name, n_dims, dims, type, offset
    at = int(field.offset) + sum(int(p.nbytes) for p in field.parts[:-1])  # the offset field's byte index
    relative = struct.unpack_from("<Q", data, at)[0]
    struct.pack_into("<Q", data, at, relative - 8)  # starts 8 bytes early: inside the first tensor's data
    bad = tmp_path / "overlap.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(PosencError, match=rf"^{re.escape(first.name)}: expected {first.n_bytes} bytes of data .* before "
                                          rf"the next tensor, got {first.n_bytes - 8} bytes until {re.escape(second.name)}"):
        read_checkpoint(bad)
