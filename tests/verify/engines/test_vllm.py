"""The vLLM adapter's own logic, without vLLM: the position map hook (`vllm_worker/posenc_vllm_positions.py`)
on a fake rotary module with vLLM's signature, checked against the 2x2 rotation oracle at positions computed
here by hand; and `vllm_side.py`'s configuration and map bookkeeping against a fake `vllm` module."""

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
from tests.helpers.oracles import rotate_angles

ENGINES = Path(__file__).resolve().parents[3] / "src" / "posenc" / "verify" / "engines"


def load_file(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hook = load_file("posenc_vllm_positions", ENGINES / "vllm_worker" / "posenc_vllm_positions.py")
side = load_file("posenc_vllm_side", ENGINES / "vllm_side.py")
HEADS, DIM = 3, 10  # odd head count, a head size that is not a power of two


class FakeRotary(torch.nn.Module):
    """vLLM's rotary interface: `forward(positions [t], query [t, h*d], key [t, h*d]) -> (query, key)`,
    a `cos_sin_cache` buffer; rotates by the oracle at the positions it is given."""

    def __init__(self):
        super().__init__()
        self.inv = 1.0 / 10000.0 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)  # [d/2]
        self.register_buffer("cos_sin_cache", torch.zeros(8, DIM))
        self.seen = []

    def forward(self, positions, query, key):
        self.seen.append(positions.clone())
        angles = positions.double()[:, None, None] * self.inv  # [t, 1, d/2]
        rot = [rotate_angles(x.view(-1, HEADS, DIM), angles).reshape(x.shape) for x in (query, key)]
        return rot[0], rot[1]


class FakeModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rotary = FakeRotary()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
        for layer in self.layers:
            layer.rotary_emb = self.rotary  # vLLM shares one instance between layers

    def attend(self, positions, q, k):
        return self.layers[0].rotary_emb(positions, q, k)


def expected(positions, q, k):
    inv = 1.0 / 10000.0 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)
    out = []
    for x in (q, k):
        rows = [rotate_angles(x[i].view(HEADS, DIM), (positions[i] * inv)[None]).reshape(-1) for i in range(len(x))]
        out.append(torch.stack(rows))
    return out


@pytest.mark.parametrize("offset, gap_at, gap", [(0, None, 0), (1000, None, 0), (0, 5, 37), (61, 3, 4)])
def test_position_map_rotates_at_the_remapped_positions(offset, gap_at, gap):
    model = FakeModel()
    t = 11
    q, k = torch.randn(t, HEADS * DIM, dtype=torch.float64), torch.randn(t, HEADS * DIM, dtype=torch.float64)
    derived = torch.arange(t)
    assert hook.set_position_map(model, offset, gap_at, gap) == 1  # one shared module, counted once
    assert hook.set_position_map(model, offset, gap_at, gap) == 1  # installing twice does not stack maps
    got = model.attend(derived, q, k)
    want_pos = [offset + p + (gap if gap_at is not None and p >= gap_at else 0) for p in range(t)]
    assert model.rotary.seen[-1].tolist() == want_pos
    for a, b in zip(got, expected(torch.tensor(want_pos, dtype=torch.float64), q, k)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # same float64 arithmetic: bit-exact


def test_identity_map_restores_vllm_and_a_model_without_rotary_is_reported():
    model = FakeModel()
    hook.set_position_map(model, 3000, 2, 9)
    hook.set_position_map(model)
    model.attend(torch.arange(7), torch.zeros(7, HEADS * DIM), torch.zeros(7, HEADS * DIM))
    assert model.rotary.seen[-1].tolist() == list(range(7))
    assert hook.set_position_map(torch.nn.Linear(2, 2), 5) == 0
    fn = hook.position_map_setter(4, None, 0)  # what apply_model receives: picklable by reference
    assert fn(model) == 1 and model.rotary.seen[-1].tolist() == list(range(7))  # no call yet under the new map
    model.attend(torch.arange(2), torch.zeros(2, HEADS * DIM), torch.zeros(2, HEADS * DIM))
    assert model.rotary.seen[-1].tolist() == [4, 5]


class FakeLLM:
    """What vllm_side uses of `vllm.LLM`: generate, apply_model (on a FakeModel), reset_prefix_cache."""

    made = []

    def __init__(self, **kwargs):
        if kwargs.get("hf_overrides", {}) and kwargs["hf_overrides"].get("refuse"):
            raise ValueError("User-specified max_model_len (4096) is greater than the derived max_model_len (512)")
        self.kwargs, self.model, self.resets = kwargs, FakeModel(), 0
        self.llm_engine = types.SimpleNamespace(engine_core=types.SimpleNamespace(shutdown=lambda: None))
        FakeLLM.made.append(self)

    def apply_model(self, fn):
        return [fn(self.model)]

    def reset_prefix_cache(self):
        self.resets += 1
        return True

    def generate(self, prompts, params, use_tqdm=False):
        return [types.SimpleNamespace(prompt=p) for p in prompts]


@pytest.fixture
def fake_vllm(monkeypatch):
    module = types.ModuleType("vllm")
    module.LLM, module.__version__ = FakeLLM, "fake"
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda prompt_token_ids: prompt_token_ids
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setitem(sys.modules, "posenc_vllm_positions", hook)
    FakeLLM.made = []
    return module


def test_configure_builds_one_engine_per_configuration_and_reports_refusals(fake_vllm):
    adapter = side.load()
    config = {"model_dir": "/m", "hf_overrides": {}, "max_model_len": 4096, "dtype": "float32", "chunk": None}
    assert adapter.configure(config) == {"refused": None}
    assert adapter.configure(dict(config)) == {"refused": None} and len(FakeLLM.made) == 1  # already active
    kw = FakeLLM.made[0].kwargs
    assert kw["enable_chunked_prefill"] is False and kw["max_num_batched_tokens"] == 4096
    assert adapter.configure({**config, "chunk": 64}) == {"refused": None}
    kw = FakeLLM.made[1].kwargs
    assert kw["enable_chunked_prefill"] is True and kw["max_num_batched_tokens"] == 64
    answer = adapter.configure({**config, "hf_overrides": {"refuse": True}})
    assert "derived max_model_len" in answer["refused"] and adapter.llm is None
    with pytest.raises(RuntimeError, match="no engine configured"):
        adapter._run([[1, 2]], None, None)


def test_the_position_map_is_set_only_when_it_changes_and_resets_the_prefix_cache(fake_vllm):
    adapter = side.load()
    adapter.configure({"model_dir": "/m", "hf_overrides": {}, "max_model_len": 64, "chunk": None})
    llm = adapter.llm
    adapter._run([[1, 2, 3]], None, None)
    assert llm.resets == 0  # identity: vLLM untouched
    adapter._run([[1, 2, 3]], None, [1000, None, 0])
    adapter._run([[1, 2, 3]], None, [1000, None, 0])
    assert llm.resets == 1 and adapter.map == (1000, None, 0)  # keys cached under 0.. are never read at 1000..
    llm.model.attend(torch.arange(3), torch.zeros(3, HEADS * DIM), torch.zeros(3, HEADS * DIM))
    assert llm.model.rotary.seen[-1].tolist() == [1000, 1001, 1002]
    adapter._run([[1, 2, 3]], None, None)
    assert llm.resets == 2 and adapter.map == side.IDENTITY
    adapter.llm.model = torch.nn.Linear(2, 2)  # a model whose rotary module is not found
    with pytest.raises(RuntimeError, match="no rotary-embedding module"):
        adapter._run([[1]], None, [3, None, 0])
