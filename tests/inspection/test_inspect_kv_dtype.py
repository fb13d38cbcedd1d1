"""`posenc inspect MODEL --kv-dtype FORMAT[:pre|:post]`: the memory table of posenc's quantized cache.

Expected bytes are written out by hand from LLaMA-2-7B's shape (32 layers, 32 KV heads, d = 128): codes,
float16 statistics, per-channel key blocks of 64 tokens with a 4-byte block id per token and layer; and
checked against a real QuantizedKVCache's nbytes.
"""

import json

import pytest
import torch

from posenc import PosencError
from posenc import inspection as ins
from posenc.cache.quant import QuantizedKVCache
from tests.test_cli import run, table_rows

NUMBERS = 2 * 32 * 32 * 128  # K and V numbers per token of LLaMA-2-7B
BY_HAND = {  # bytes per token
    "int4": NUMBERS * 0.5 + 2 * 32 * 32 * 4,  # + scale and offset per token per head, for K and V
    "int8": NUMBERS * 1.0 + 2 * 32 * 32 * 4,
    "fp8": NUMBERS * 1.0 + 2 * 32 * 32 * 2,  # scale only
    "int4:pre": NUMBERS * 0.5 + 32 * 32 * 4 + 32 * 32 * 128 * 4 / 64 + 32 * 4,  # V per token; K per channel / 64; ids
    "bf16": NUMBERS * 2.0,
}


@pytest.mark.parametrize("kv_dtype", list(BY_HAND))
def test_plain_table_counts_codes_and_scales(capsys, kv_dtype):
    code, out, _ = run(capsys, "inspect", "llama-2-7b", "--lengths", "4k", "--kv-dtype", kv_dtype, "--format", "plain")
    assert code == 0
    label = ins.kv_label(kv_dtype)
    rows = table_rows(out, "KV cache")
    assert rows[0] == ["length", "tokens", label]
    assert rows[1] == ["4k", "4096", f"{BY_HAND[kv_dtype] * 4096 / 2**30:.3g} GB"]


@pytest.mark.parametrize("kv_dtype", ["int4", "int4:pre"])
def test_json_and_rich_carry_the_same_bytes(capsys, kv_dtype):
    code, out, _ = run(capsys, "inspect", "llama-2-7b", "--lengths", "4k", "--kv-dtype", kv_dtype, "--json")
    kv = json.loads(out)["kv_cache"]
    assert code == 0 and kv["bytes_per_token"] == {ins.kv_label(kv_dtype): BY_HAND[kv_dtype]}
    pytest.importorskip("rich")
    code, out, _ = run(capsys, "inspect", "llama-2-7b", "--lengths", "4k", "--kv-dtype", kv_dtype, "--format", "rich")
    assert code == 0 and ins.kv_label(kv_dtype) in out and f"{BY_HAND[kv_dtype] * 4096 / 2**30:.3g} GB" in out


@pytest.mark.parametrize("kv_dtype,store", [("int4", "rotated"), ("int8:pre", "unrotated"), ("fp8", "rotated")])
def test_the_table_matches_a_real_cache(kv_dtype, store):
    """A small config's per-token bytes equal a filled QuantizedKVCache's nbytes per token."""
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 3, "max_position_embeddings": 128, "vocab_size": 10}
    per_token = ins.inspect_model(cfg, lengths=[128], kv_dtype=kv_dtype)["kv_cache"]["bytes_per_token"]
    cache = QuantizedKVCache(3, 1, 2, 16, 128, kv_dtype=kv_dtype.split(":")[0], store=store)
    slots = cache.reserve(torch.arange(128)[None])
    for layer in range(3):
        cache.write(layer, torch.randn(1, 2, 128, 16), torch.randn(1, 2, 128, 16), slots)
    assert list(per_token.values()) == [cache.nbytes / 128]


@pytest.mark.parametrize("kv_dtype,message", [
    ("int3", "--kv-dtype: expected one of ('float32'"), ("int4:mid", "--kv-dtype: expected one of ('pre', 'post')")])
def test_bad_kv_dtype_is_refused_by_name(capsys, kv_dtype, message):
    code, _, err = run(capsys, "inspect", "llama-2-7b", "--kv-dtype", kv_dtype)
    assert code != 0 and message in err
    cfg = ins.load_config("gpt2")[0] | {"n_embd": 60, "n_head": 4}  # head_dim 15 (not RoPE, which needs pairs)
    with pytest.raises(PosencError, match="^--kv-dtype: expected an even head_dim"):
        ins.inspect_model(cfg, kv_dtype="int4")


def test_docs_cache_page_shows_real_output(capsys):
    """docs/cache.md: each `$ posenc inspect ...` block prints exactly what the page shows."""
    import re
    import shlex
    from pathlib import Path

    from posenc.cli import main

    page = (Path(__file__).resolve().parents[2] / "docs" / "cache.md").read_text()
    blocks = re.findall(r"```console\n\$ (posenc [^\n]*)\n(.*?)```", page, re.S)
    assert any("--kv-dtype" in command for command, _ in blocks)
    for command, shown in blocks:
        assert main(shlex.split(command)[1:]) == 0
        assert capsys.readouterr().out == shown
