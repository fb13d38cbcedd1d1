"""`CheckpointReader`: one read of the checkpoint for every engine a run builds, held by the run."""

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from posenc.models import loading  # noqa: E402
from posenc.verify.engines import CheckpointReader, load_factory, posenc_engine  # noqa: E402
from tests.helpers.verify_tiny import save_tiny  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("tiny"))


def counted(monkeypatch):
    reads = []
    real = loading.read_checkpoint

    def read(path, **kwargs):
        reads.append((str(path), kwargs.get("dtype")))
        return real(path, **kwargs)
    monkeypatch.setattr(loading, "read_checkpoint", read)
    return reads


def test_engines_of_one_reader_share_one_read(tiny, monkeypatch):
    reads = counted(monkeypatch)
    reader = CheckpointReader()
    factory = load_factory("posenc", reader)
    a = factory(tiny, None, torch.float32)
    b = factory(tiny, {"rope_type": "linear", "factor": 2.0}, torch.float32)
    assert reader.config(tiny)["vocab_size"] == 256
    assert len(reads) == 1
    assert a.embed_tokens.weight.data_ptr() == b.embed_tokens.weight.data_ptr()  # the same tensors, no copy
    reader.read(tiny, torch.float64)  # another dtype is another read, and replaces the last
    assert len(reads) == 2


def test_without_a_reader_each_engine_reads_for_itself(tiny, monkeypatch):
    reads = counted(monkeypatch)
    posenc_engine(tiny, None, torch.float32)
    posenc_engine(tiny, None, torch.float32)
    assert len(reads) == 2  # no state kept between calls
