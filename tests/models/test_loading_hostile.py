"""Checkpoints built to break the loader: GGUF files cut short or whose metadata contradicts the tensors, files
declaring far more layers than they hold, transformers directories with a bad config.json or a corrupt
safetensors. Each must be a PosencError naming the key, tensor or file, raised before anything is built."""

import json
import time

import numpy as np
import pytest
import torch

from posenc import PosencError
from posenc.models import Decoder
from posenc.models.loading import read_checkpoint

gguf = pytest.importorskip("gguf", reason="the gguf package writes and reads GGUF files")

HIDDEN, VOCAB, FFN = 16, 32, 24


def write_gguf(path, *, layers=1, heads=4, kv=2, meta=None, drop=(), rope_freqs=False):
    """A small llama GGUF (F32 tensors for `layers` layers); `meta` overrides or adds metadata (None drops)."""
    w = gguf.GGUFWriter(str(path), "llama")
    values = {"llama.block_count": layers, "llama.context_length": 64, "llama.embedding_length": HIDDEN,
              "llama.feed_forward_length": FFN, "llama.attention.head_count": heads,
              "llama.attention.head_count_kv": kv, **(meta or {})}
    for key, value in values.items():
        if key in drop:
            continue
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        else:
            w.add_uint32(key, value)
    rng = np.random.default_rng(0)

    def add(name, *shape):  # torch order [out, in]
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    d = HIDDEN // heads if heads and HIDDEN % heads == 0 else 4
    add("token_embd.weight", VOCAB, HIDDEN)
    add("output_norm.weight", HIDDEN)
    for i in range(layers):
        for part, shape in (("attn_norm", (HIDDEN,)), ("ffn_norm", (HIDDEN,)), ("attn_q", (4 * d, HIDDEN)),
                            ("attn_k", (2 * d, HIDDEN)), ("attn_v", (2 * d, HIDDEN)), ("attn_output", (HIDDEN, 4 * d)),
                            ("ffn_gate", (FFN, HIDDEN)), ("ffn_up", (FFN, HIDDEN)), ("ffn_down", (HIDDEN, FFN))):
            add(f"blk.{i}.{part}.weight", *shape)
    if rope_freqs:  # last: the other tensors draw the same numbers with or without it
        add("rope_freqs.weight", d // 2)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_small_written_gguf_loads(tmp_path):  # the baseline the hostile variants below break
    model = Decoder.from_pretrained(write_gguf(tmp_path / "ok.gguf", layers=2))
    assert model.config["num_hidden_layers"] == 2 and len(model.layers) == 2


def test_a_gguf_cut_anywhere_is_a_posenc_error(tmp_path):
    data = write_gguf(tmp_path / "ok.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    leaks = {}
    for n in list(range(0, 2048, 3)) + list(range(2048, len(data), 97)):  # every 3rd byte of the header
        cut.write_bytes(data[:n])
        try:
            read_checkpoint(cut)
        except PosencError:
            continue
        except Exception as e:  # noqa: BLE001 - what leaked, collected to show them all
            leaks.setdefault(type(e).__name__, []).append(n)
            continue
        leaks.setdefault("loaded", []).append(n)
    assert leaks == {}, {k: v[:5] for k, v in leaks.items()}


@pytest.mark.parametrize("kwargs, names", [
    (dict(heads=3), "llama.attention.head_count"),  # 16 rows do not split into 3 heads
    (dict(heads=0), "llama.attention.head_count"),
    (dict(kv=0), "llama.attention.head_count_kv"),
    (dict(kv=3), "llama.attention.head_count_kv"),  # 3 kv heads for 4 query heads
    (dict(meta={"llama.embedding_length": "sixteen"}), "llama.embedding_length"),
    (dict(meta={"llama.block_count": "1"}), "llama.block_count"),
    (dict(meta={"llama.rope.dimension_count": [4, 4]}), "llama.rope.dimension_count"),
    (dict(meta={"llama.attention.key_length": 6}), "blk.0.attn_q.weight"),  # 16 rows are not 4 heads x 6
    (dict(meta={"llama.attention.key_length": 3}), "llama.attention.key_length"),  # odd: no rotation pairs
    (dict(meta={"llama.rope.freq_base": "1e4"}), "llama.rope.freq_base"),
    (dict(meta={"llama.attention.layer_norm_rms_epsilon": -1.0}), "llama.attention.layer_norm_rms_epsilon"),
    (dict(meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": "2"}), "llama.rope.scaling.factor"),
    (dict(meta={"tokenizer.ggml.bos_token_id": "one"}), "tokenizer.ggml.bos_token_id"),
    (dict(drop=("llama.feed_forward_length",)), "llama.feed_forward_length"),
], ids=["heads-3", "heads-0", "kv-0", "kv-3", "hidden-str", "blocks-str", "rope-dim-array", "key-length",
        "key-length-odd", "theta-str", "eps-negative", "factor-str", "bos-str", "no-ffn"])
def test_gguf_metadata_contradicting_the_tensors_is_refused_by_key(tmp_path, kwargs, names):
    path = write_gguf(tmp_path / "bad.gguf", **kwargs)
    with pytest.raises(PosencError) as err:
        Decoder.from_pretrained(path)
    assert names in str(err.value), str(err.value)


def test_a_gguf_declaring_20000_layers_is_refused_before_building(tmp_path):
    path = write_gguf(tmp_path / "many.gguf", meta={"llama.block_count": 20000})
    start = time.perf_counter()
    with pytest.raises(PosencError, match=r"llama.block_count: expected the number of layers the file holds tensors "
                                          r"for \(1: layers 0..0\), got 20000"):
        Decoder.from_pretrained(path)
    assert time.perf_counter() - start < 2.0  # was: 20,000 layers built (14 s, 840 MB) before the refusal
    with pytest.raises(PosencError, match=r"llama.block_count: .*\(2: layers 0..1\), got 1"):
        Decoder.from_pretrained(write_gguf(tmp_path / "few.gguf", layers=2, meta={"llama.block_count": 1}))


def test_read_checkpoint_passes_rope_scaling_to_a_llama3_style_gguf(tmp_path):
    rule = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16}
    with_freqs = write_gguf(tmp_path / "l3.gguf", rope_freqs=True)
    with pytest.raises(PosencError, match="rope_scaling: expected a rule for this file's per-frequency factors"):
        Decoder.from_pretrained(with_freqs)
    model = Decoder.from_pretrained(with_freqs, rope_scaling=rule)
    assert type(model.rope.scaling).__name__ == "Llama3" and model.config["rope_parameters"]["factor"] == 8.0
    twin = Decoder.from_pretrained(write_gguf(tmp_path / "plain.gguf"), rope_scaling=rule)  # same weights and rule
    ids = torch.arange(20)[None] % VOCAB
    with torch.no_grad():
        assert torch.equal(model(ids), twin(ids))
    with pytest.raises(PosencError, match="rope_scaling: expected None or a transformers-style dict"):
        read_checkpoint(with_freqs, rope_scaling="llama3")


# ------------------------------------------------------------------ transformers directories
def _directory(tmp_path, layers=2):
    pytest.importorskip("safetensors")
    from safetensors.torch import save_file

    model = Decoder.from_hf_config({"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": layers,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": FFN},
                                   seed=0)
    cfg = {"model_type": "llama", **{k: v for k, v in model.config.items() if k != "model_type"}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()},
              str(tmp_path / "model.safetensors"))
    return tmp_path, cfg


@pytest.mark.parametrize("content, what", [
    (b"{not json", "invalid JSON"),
    (b"", "an empty file"),
    (b"  \n", "an empty file"),
    (b"\xef\xbb\xbf{}", "byte-order mark"),
    (b"[1, 2]", "a JSON list"),
    (b'"llama"', "a JSON str"),
    (b'{"model_type": "llama", "name": "caf\xe9"}', "not UTF-8"),
], ids=["invalid", "empty", "blank", "bom", "list", "string", "latin-1"])
def test_a_bad_config_json_names_the_file_and_what_is_wrong(tmp_path, content, what):
    folder, _ = _directory(tmp_path)
    (folder / "config.json").write_bytes(content)
    with pytest.raises(PosencError, match="path: expected .*config.json holding a JSON object") as err:
        Decoder.from_pretrained(folder)
    assert what in str(err.value)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "huge-header"])
def test_a_corrupt_safetensors_names_the_file(tmp_path, damage):
    folder, _ = _directory(tmp_path)
    file = folder / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes({"garbage": b"\x00" * 64, "truncated": data[: len(data) // 2],
                      "huge-header": (2**62).to_bytes(8, "little") + data[8:]}[damage])
    with pytest.raises(PosencError, match=r"path: expected .*model.safetensors as a readable .safetensors file"):
        Decoder.from_pretrained(folder)


def test_a_directory_declaring_more_layers_than_its_tensors_is_refused_before_building(tmp_path):
    folder, cfg = _directory(tmp_path)
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 20000}))
    start = time.perf_counter()
    with pytest.raises(PosencError, match=r"config\['num_hidden_layers'\]: expected the number of layers the file "
                                          r"holds tensors for \(2: layers 0..1\), got 20000"):
        Decoder.from_pretrained(folder)
    assert time.perf_counter() - start < 2.0
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": "2"}))
    with pytest.raises(PosencError, match=r"config\['num_hidden_layers'\]: expected a positive integer, got '2'"):
        Decoder.from_pretrained(folder)


def test_a_forged_metadata_count_is_refused_before_the_gguf_reader_loops_on_it(tmp_path):
    import struct

    key = b"x.arr"  # one array of 2**40 uint8 in a 45-byte file: the gguf reader loops 2**40 times on it
    head = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    forged = head + struct.pack("<IIQ", 9, 0, 2**40)
    (tmp_path / "forged.gguf").write_bytes(forged)
    start = time.perf_counter()
    with pytest.raises(PosencError, match=r"x.arr: expected an array the file can hold .* got 1099511627776 elements"):
        read_checkpoint(tmp_path / "forged.gguf")
    strings = head + struct.pack("<IIQ", 9, 8, 2**62)
    (tmp_path / "strings.gguf").write_bytes(strings)
    with pytest.raises(PosencError, match=r"x.arr: expected an array the file can hold"):
        read_checkpoint(tmp_path / "strings.gguf")
    (tmp_path / "keys.gguf").write_bytes(struct.pack("<4sIQQ", b"GGUF", 3, 2**50, 2**60))
    with pytest.raises(PosencError, match=r"path: expected a readable GGUF file: counts it can hold"):
        read_checkpoint(tmp_path / "keys.gguf")
    assert time.perf_counter() - start < 2.0


def _tokenizer_gguf(path, tokens=("a", "b", "ab"), merges=("a b",), types=None, skip=()):
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("tokenizer.ggml.model", "gpt2")
    if "tokens" not in skip:
        w.add_array("tokenizer.ggml.tokens", list(tokens))
    w.add_array("tokenizer.ggml.merges", list(merges))
    if types is not None:
        w.add_array("tokenizer.ggml.token_type", list(types))
    w.add_tensor("token_embd.weight", np.zeros((3, 2), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("kwargs, key", [
    (dict(skip=("tokens",)), "tokenizer.ggml.tokens"),
    (dict(tokens=("a", "b", "a")), "tokenizer.ggml.tokens"),
    (dict(merges=("a c",)), "tokenizer.ggml.merges"),
    (dict(merges=("ab",)), "tokenizer.ggml.merges"),
    (dict(types=(1, 1)), "tokenizer.ggml.token_type"),
], ids=["no-tokens", "repeated", "unknown-merge", "merge-without-space", "types-short"])
def test_a_gguf_tokenizer_with_contradicting_metadata_is_refused_by_key(tmp_path, kwargs, key):
    pytest.importorskip("tokenizers")
    from posenc.models import load_tokenizer

    assert load_tokenizer(_tokenizer_gguf(tmp_path / "ok.gguf")).encode("ab") == [2]  # the baseline loads
    with pytest.raises(PosencError, match=rf"^{key}: expected"):
        load_tokenizer(_tokenizer_gguf(tmp_path / "bad.gguf", **kwargs))
