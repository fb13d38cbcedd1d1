"""Edges of the tools and the newer modules attacked from outside: each bad argument is a PosencError naming it
(or a clean refusal before any work), never torch's raw error, a wrap-around or minutes of work then a traceback."""

import sys

import pytest
import torch

from posenc import PosencError
from posenc.attention import attention
from posenc.distributed.layouts import shard, unshard
from posenc.models import Decoder
from posenc.rope.packed import packed_positions


def tiny_decoder(**kw):
    return Decoder(vocab_size=8, hidden_size=8, num_layers=1, num_heads=2, intermediate_size=8, **kw)


# ------------------------------------------------------------------ lab without matplotlib
def test_lab_without_matplotlib_is_refused_before_training(monkeypatch, tmp_path, capsys):
    import posenc.lab.run as lab_run
    from posenc.cli import main

    def no_training(*args, **kwargs):
        raise AssertionError("the lab trained before checking its extras")
    monkeypatch.setattr(lab_run, "run_lab", no_training)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    assert main(["lab", "--quick", "--steps", "1", "--out", str(tmp_path / "lab")]) == 2
    err = capsys.readouterr().err
    assert "matplotlib" in err and "--no-plots" in err and "Traceback" not in err


# ------------------------------------------------------------------ flex attention backward on CPU
def test_flex_attention_with_grad_on_cpu_is_refused_by_name():
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    pos = torch.arange(4)
    with pytest.raises(PosencError, match=r"impl: expected 'eager' or 'sdpa' when q, k or v require grad on cpu"):
        attention(q, q, q, q_positions=pos, k_positions=pos, impl="flex")
    with torch.no_grad():  # torch refuses a leaf that requires grad even here: so does posenc, by name
        with pytest.raises(PosencError, match=r"impl: expected 'eager' or 'sdpa'"):
            attention(q, q, q, q_positions=pos, k_positions=pos, impl="flex")
    x = q.detach()  # forward-only flex still runs
    want = attention(x, x, x, q_positions=pos, k_positions=pos, impl="eager")
    torch.testing.assert_close(attention(x, x, x, q_positions=pos, k_positions=pos, impl="flex"), want)
    model = tiny_decoder(attn_impl="flex")
    with pytest.raises(PosencError, match=r"attn_impl: expected 'eager' or 'sdpa' when q, k or v require grad"):
        model(torch.tensor([[1, 2, 3]]))
    with torch.no_grad():
        assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 8)


# ------------------------------------------------------------------ packed positions with unsigned cu_seqlens
@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16, torch.uint32])
def test_packed_positions_with_unsigned_cu_seqlens(dtype):
    assert packed_positions(torch.tensor([0, 2, 5], dtype=dtype)).tolist() == [0, 1, 0, 1, 2]
    with pytest.raises(PosencError, match=r"cu_seqlens: expected non-decreasing cumulative lengths, got \[0, 5, 3\]"):
        packed_positions(torch.tensor([0, 5, 3], dtype=dtype))  # uint8 wrapped 3 - 5 to 254 and passed
    got = packed_positions(torch.tensor([0, 2, 5], dtype=dtype), offsets=torch.tensor([7, 1], dtype=dtype))
    assert got.tolist() == [7, 8, 1, 2, 3]


# ------------------------------------------------------------------ shard / unshard
@pytest.mark.parametrize("call, arg", [
    (lambda: shard(torch.zeros(4, 8), 5, 2, 0), "dim"),
    (lambda: shard(torch.zeros(4, 8), -3, 2, 0), "dim"),
    (lambda: shard(torch.zeros(4, 8), 1.0, 2, 0), "dim"),
    (lambda: shard(torch.tensor(1.0), 0, 2, 0), "x"),
    (lambda: unshard([torch.zeros(4, 4), torch.zeros(4, 4)], 5), "dim"),
    (lambda: unshard([torch.tensor(1.0), torch.tensor(2.0)], 0), "shards"),
    (lambda: unshard([[1, 2], [3, 4]], 0), "shards"),
    (lambda: unshard([torch.zeros(2, 4), torch.zeros(3, 4)], 1), "shards"),
    (lambda: unshard([torch.zeros(2, 4), torch.zeros(2, 4, dtype=torch.float64)], 1), "shards"),
    (lambda: unshard([torch.zeros(2, 4), torch.zeros(2, 4, 1)], 1), "shards"),
], ids=["dim-5", "dim-neg", "dim-float", "0-d", "un-dim-5", "un-0-d", "un-lists", "un-shapes", "un-dtypes", "un-ranks"])
def test_shard_and_unshard_refuse_bad_arguments_by_name(call, arg):
    with pytest.raises(PosencError) as err:
        call()
    assert err.value.arg == arg, str(err.value)


def test_shard_and_unshard_still_round_trip_with_negative_dims():
    x = torch.arange(24.0).reshape(2, 12)
    parts = [shard(x, -1, 3, r) for r in range(3)]
    assert torch.equal(unshard(parts, -1), x)


# ------------------------------------------------------------------ tokenizer, cache, dtype
def test_gguf_tokenizer_refuses_a_lone_surrogate_by_name():
    from posenc.models.tokenizer import GGUFTokenizer

    class Backend:  # the check is posenc's: it must fire before the backend sees the text
        def encode(self, text, add_special_tokens=False):
            raise AssertionError("the backend was given the text")
    tok = GGUFTokenizer(Backend(), {"tokenizer.ggml.tokens": ["a"]})
    for text in ("\ud800", "ok \udfff then"):
        with pytest.raises(PosencError, match=r"text: expected a str of Unicode scalar values .* lone surrogate"):
            tok.encode(text)


@pytest.mark.parametrize("capacity", [2**62, 2**53 + 2])
def test_new_cache_of_an_impossible_capacity_is_refused_by_name(capacity):
    with pytest.raises(PosencError, match=r"capacity: expected"):
        tiny_decoder().new_cache(1, capacity)


def test_new_cache_that_cannot_be_allocated_is_refused_by_name():
    with pytest.raises(PosencError, match=r"capacity: expected a cache that fits in memory"):
        tiny_decoder().new_cache(1, 2**44)  # 1 layer x 2 x (1, 2, 2**44, 4) float32: 256 TiB


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8])
def test_from_pretrained_refuses_dtypes_the_decoder_cannot_run(tmp_path, dtype):
    with pytest.raises(PosencError, match=r"dtype: expected a floating-point torch.dtype the decoder computes in "
                                          r"\(float32, float64, bfloat16 or float16\)"):
        Decoder.from_pretrained(tmp_path, dtype=dtype)


def test_lab_refuses_a_json_path_that_is_a_folder_before_training(monkeypatch, tmp_path, capsys):
    import posenc.lab.run as lab_run
    from posenc.cli import main

    def no_training(*args, **kwargs):
        raise AssertionError("the lab trained before checking --json")
    monkeypatch.setattr(lab_run, "run_lab", no_training)
    (tmp_path / "folder").mkdir()
    assert main(["lab", "--quick", "--no-plots", "--out", str(tmp_path / "o"), "--json", str(tmp_path / "folder")]) == 2
    assert "--json: expected a file path to write (not a folder)" in capsys.readouterr().err


def test_lab_json_is_strict_json_when_a_run_diverges(monkeypatch, tmp_path):
    import json

    import posenc.lab.report as report

    rows = [{"section": "eval", "model": "rope", "value": float("inf")}, {"value": float("nan")}]
    monkeypatch.setattr(report, "tidy_rows", lambda results: rows)
    report.write_json({"meta": {"schemes": ("rope",)}}, [{"name": "p", "measured": float("-inf")}], tmp_path / "r.json")

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")
    data = json.loads((tmp_path / "r.json").read_text(), parse_constant=refuse)
    assert [r["value"] for r in data["measurements"]] == ["inf", "nan"] and data["predictions"][0]["measured"] == "-inf"
    assert data["meta"]["schemes"] == ["rope"]


def test_growing_or_batching_a_cache_beyond_memory_is_refused_by_name():
    model = tiny_decoder()
    cache = model.new_cache(1, 4)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
    with pytest.raises(PosencError, match=r"capacity: expected a cache that fits in memory"):
        cache.grow(2**45)
    assert cache.capacity == 4 and cache.lengths.tolist() == [3]  # unchanged by the refusal
    kept = cache.k[0][:, :, :3].clone()
    cache.grow(9)  # a real growth keeps the filled slots
    assert cache.capacity == 9 and torch.equal(cache.k[0][:, :, :3], kept) and not cache.k[0][:, :, 3:].any()
    with pytest.raises(PosencError, match=r"batch_size: expected a cache that fits in memory"):
        model.new_cache(2**45, 1)
    with pytest.raises(PosencError, match=r"path: expected a .gguf file or transformers directory \(a str or"):
        Decoder.from_pretrained(123)
