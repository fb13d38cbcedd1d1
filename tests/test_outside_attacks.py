"""Inputs an outside fuzzer threw at the public API that crashed raw (TypeError, OverflowError,
NotImplementedError, AttributeError, torch's device/dtype RuntimeErrors) instead of a PosencError naming the
argument. Each case here crashed before the checks it names moved into `errors.py`."""

import numpy as np
import pytest
import torch

import posenc
from posenc import PosencError
from posenc.attention import attention
from posenc.errors import integer

HUGE = 2**70  # a Python int no int64 tensor or torch size can hold
IDS = dict(image_token_id=7, video_token_id=8, vision_start_token_id=9)
TOO_BIG = {  # name -> (call, the argument the message must name)
    "Rope": (lambda: posenc.Rope(head_dim=HUGE), "head_dim"),
    "alibi_slopes": (lambda: posenc.alibi_slopes(HUGE), "num_heads"),
    "LearnedPositions": (lambda: posenc.LearnedPositions(HUGE, 4), "num_positions"),
    "T5RelativeBias": (lambda: posenc.T5RelativeBias(HUGE), "num_heads"),
    "KVCache": (lambda: posenc.KVCache(1, 1, 1, 4, HUGE), "capacity"),
    "attention.window": (lambda: attention(*[torch.ones(1, 1, 2, 4)] * 3, q_positions=torch.arange(2),
                                           k_positions=torch.arange(2), window=HUGE), "window"),
    "mrope_position_ids": (lambda: posenc.mrope_position_ids(torch.ones(1, 3, dtype=torch.long),
                                                             **(IDS | {"image_token_id": HUGE})), "image_token_id"),
}


def _refused(table, name, expected):
    """Call `table[name]`'s function; it must raise a PosencError naming its argument, then `expected`."""
    call, arg = table[name]
    with pytest.raises(PosencError, match=rf"^{arg}: expected {expected}"):
        call()


@pytest.mark.parametrize("name", TOO_BIG)
def test_integers_beyond_int64_are_refused_by_name(name):
    _refused(TOO_BIG, name, ".*fits in int64")


def test_the_int64_bound_is_inclusive_and_numpy_integers_pass():
    assert integer("n", 2**63 - 1) == 2**63 - 1 and integer("n", -(2**63)) == -(2**63)
    assert integer("n", np.int64(5), min=1) == 5
    with pytest.raises(PosencError, match=r"^n: expected an integer that fits in int64"):
        integer("n", np.uint64(2**64 - 1))


META = torch.arange(4, device="meta")
NO_VALUES = {  # name -> (call, argument): positions and ids are read, a meta tensor has nothing to read
    "Rope.cos_sin": (lambda: posenc.Rope(head_dim=8).cos_sin(META), "position_ids"),
    "sinusoidal_table": (lambda: posenc.sinusoidal_table(META, 8), "positions"),
    "axial_cos_sin": (lambda: posenc.axial_cos_sin(META.view(2, 2), 8), "positions"),
    "alibi_bias.k": (lambda: posenc.alibi_bias(4, torch.arange(4), META), "k_positions"),
    "mrope_position_ids": (lambda: posenc.mrope_position_ids(META.view(1, 4), **IDS), "input_ids"),
    "vision_patch_positions": (lambda: posenc.vision_patch_positions(torch.ones(1, 3, dtype=torch.long,
                                                                                device="meta")), "grid_thw"),
}


@pytest.mark.parametrize("name", NO_VALUES)
def test_meta_tensors_where_values_are_needed_are_refused_by_name(name):
    _refused(NO_VALUES, name, r"a tensor with values \(not on the meta device\)")


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("bad", ["v_dtype", "k_dtype", "v_meta", "mask_meta"])
def test_attention_refuses_k_v_and_key_mask_unlike_q(impl, bad):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(2, 3, dtype=torch.bool)
    arg = {"v_dtype": "v", "k_dtype": "k", "v_meta": "v", "mask_meta": "key_mask"}[bad]
    if bad == "v_dtype":
        v = v.half()
    elif bad == "k_dtype":
        k = k.float()
    elif bad == "v_meta":
        v = v.to("meta")
    else:
        mask = mask.to("meta")
    with pytest.raises(PosencError, match=rf"^{arg}: expected .*(as q|on cpu)"):
        attention(q, k, v, q_positions=torch.arange(3), k_positions=torch.arange(3), key_mask=mask, impl=impl,
                  encoding=posenc.Rope(head_dim=4))


@pytest.mark.parametrize("rope", [None, 8, "rope", posenc.ALiBi(2)])
def test_rerotate_refuses_a_rope_that_is_not_a_rope(rope):
    k = torch.randn(1, 2, 3, 8, generator=torch.Generator().manual_seed(0))
    with pytest.raises(PosencError, match=r"^rope: expected a posenc.Rope"):
        posenc.rerotate(rope, k, torch.arange(3), torch.arange(3) + 2)


@pytest.mark.parametrize("inv_freq", [[1.0, 0.5, 0.25, 0.125], np.ones(4), torch.ones(()), torch.ones(4, dtype=torch.long),
                                      torch.ones(1, 4)])
def test_mrope_cos_sin_refuses_inverse_frequencies_that_are_not_a_1d_float_tensor(inv_freq):
    with pytest.raises(PosencError, match=r"^inv_freq: expected a (floating-point|tensor of rank 1)"):
        posenc.mrope_cos_sin(torch.zeros(3, 1, 5, dtype=torch.long), inv_freq, (2, 1, 1))


@pytest.mark.parametrize("arg, value", [("beta_fast", 1e308), ("beta_slow", 1e-320)])
def test_yarn_betas_whose_turns_overflow_are_refused_by_name(arg, value):
    with pytest.raises(PosencError, match=rf"^{arg}: expected a number of turns"):
        posenc.Rope(head_dim=16, scaling=posenc.YaRN(4.0, 32, **{arg: value}))
    cfg = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128,
           "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, arg: value}}
    with pytest.raises(PosencError, match=rf"^config\['rope_scaling'\]\['{arg}'\]: expected a number of turns"):
        posenc.Rope.from_hf_config(cfg)


@pytest.mark.parametrize("model_type", [["llama"], {"a": 1}, 3])
def test_a_model_type_that_is_not_a_string_is_refused_by_name(model_type):
    cfg = {"model_type": model_type, "hidden_size": 64, "num_attention_heads": 4, "max_position_embeddings": 128}
    with pytest.raises(PosencError, match=r"^config\['model_type'\]: expected a string"):
        posenc.Rope.from_hf_config(cfg)


def _reserved_cache():
    cache = posenc.KVCache(1, 2, 2, 12, 8, rope=posenc.Rope(head_dim=12), dtype=torch.float64)
    return cache, cache.reserve(torch.tensor([[0, 1], [3, 4]]))


@pytest.mark.parametrize("bad, arg", [
    ({"k": torch.zeros(1, 2, 2, 12)}, "k"),  # another batch
    ({"v": torch.zeros(2, 2, 3, 12)}, "v"),  # more tokens than slots
    ({"k": torch.zeros(2, 2, 2, 10)}, "k"),  # another head width
    ({"v": [0.0]}, "v"),
    ({"slots": torch.tensor([[0, 5], [0, 1]])}, "slots"),  # slot 5 was never reserved
    ({"slots": torch.tensor([[0, 1]])}, "slots"),
    ({"slots": torch.tensor([[0.0, 1.0], [0.0, 1.0]])}, "slots"),
])
def test_kvcache_write_refuses_keys_values_and_slots_unlike_the_cache(bad, arg):
    cache, slots = _reserved_cache()
    g = torch.Generator().manual_seed(0)
    args = {"k": torch.randn(2, 2, 2, 12, generator=g), "v": torch.randn(2, 2, 2, 12, generator=g), "slots": slots}
    before = [x.clone() for x in (cache.k[0], cache.v[0])]
    with pytest.raises(PosencError, match=rf"^{arg}: expected"):
        cache.write(0, **(args | bad))
    assert torch.equal(cache.k[0], before[0]) and torch.equal(cache.v[0], before[1])  # nothing written


def test_kvcache_write_still_stores_the_rotated_keys_at_their_slots():
    cache, slots = _reserved_cache()
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(2, 2, 2, 12, generator=g, dtype=torch.float64), torch.randn(2, 2, 2, 12, generator=g, dtype=torch.float64)
    cache.write(0, k, v, slots)
    rotated, _ = posenc.Rope(head_dim=12).apply(k, k, torch.tensor([[0, 1], [3, 4]]))
    assert torch.equal(cache.v[0][:, :, :2], v)
    assert torch.allclose(cache.k[0][:, :, :2], rotated, atol=1e-6, rtol=0)  # float32 rotation of float64 keys


M64 = 2**63 - 1
OVERFLOWING = {  # name -> (call, argument); each wrapped p + 1 or p - q in int64 and returned a wrong result
    "Decoder.position_ids": (lambda: _longrope_decoder()(torch.tensor([[1, 2]]), position_ids=torch.tensor([M64 - 1, M64])),
                             "position_ids"),  # seq_len wrapped negative: short factors at position 2**63 - 1
    "alibi_bias": (lambda: posenc.alibi_bias(4, torch.tensor([M64]), torch.tensor([-M64 - 1])), "q_positions"),
    "t5_bucket": (lambda: posenc.t5_relative_position_bucket(torch.tensor([-M64 - 1, M64])), "relative_position"),
    "rerotate": (lambda: posenc.rerotate(posenc.Rope(head_dim=8, scaling=posenc.DynamicNTK(2.0, 8)),
                                         torch.ones(1, 1, 1, 8), torch.tensor([M64]), torch.tensor([0])), "old_positions"),
    "Rope.cos_sin": (lambda: posenc.Rope(head_dim=8).cos_sin(torch.tensor([2**53 + 1])), "position_ids"),
}


def _longrope_decoder():
    from test_decoder import config
    return posenc.models.Decoder.from_hf_config(config("longrope", num_hidden_layers=1), seed=0).double()


@pytest.mark.parametrize("name", OVERFLOWING)
def test_positions_beyond_2_pow_53_are_refused_by_name(name):
    _refused(OVERFLOWING, name, r"positions with \|p\| <= 2\*\*53")


def test_positions_up_to_2_pow_53_are_still_accepted():
    p = torch.tensor([[2**53 - 1, 2**53]])
    cos, sin = posenc.Rope(head_dim=4).cos_sin(p)  # float32 angles, as checkpoints compute them
    assert bool(((cos.double() ** 2 + sin.double() ** 2 - 1).abs() < 1e-6).all())  # a rotation, whatever the angle
    logits = _longrope_decoder()(torch.tensor([[1, 2]]), position_ids=p)
    assert logits.shape == (1, 2, 50) and bool(torch.isfinite(logits).all())


@pytest.mark.parametrize("args, arg", [((HUGE, 2, 0), "seq_len"), ((8, HUGE, 0), "cp_size"), ((8, 2, HUGE), "cp_rank")])
def test_shard_positions_refuses_integers_beyond_int64_by_name(args, arg):
    from posenc.distributed import shard_positions
    with pytest.raises(PosencError, match=rf"^{arg}: expected"):
        shard_positions(*args)


@pytest.mark.parametrize("seed", ["x", HUGE, True, 1.5])
def test_decoder_seed_that_is_not_an_integer_is_refused_by_name(seed):
    from test_decoder import config
    with pytest.raises(PosencError, match=r"^seed: expected None or an integer"):
        posenc.models.Decoder.from_hf_config(config("default", num_hidden_layers=1), seed=seed)


def test_decoder_from_hf_config_names_the_config_key_of_a_bad_kv_head_count():
    from test_decoder import config
    with pytest.raises(PosencError, match=r"^config\['num_key_value_heads'\]: expected a divisor of num_heads=4, got 3"):
        posenc.models.Decoder.from_hf_config(config("default", num_hidden_layers=1, num_key_value_heads=3))


def test_mrope_cos_sin_refuses_positions_on_another_device_than_the_frequencies():
    with pytest.raises(PosencError, match=r"^position_ids: expected a tensor on meta"):
        posenc.mrope_cos_sin(torch.zeros(3, 1, 5, dtype=torch.long), torch.ones(4, device="meta"), (2, 1, 1))


def test_sparse_q_or_k_is_refused_by_name():
    # a sparse tensor has no memory for the kernel to read (it raised torch's "Cannot access data pointer")
    rope = posenc.Rope(head_dim=64)
    q, k, pos = torch.randn(2, 4, 3, 64), torch.randn(2, 2, 3, 64), torch.tensor([[0, 1, 2], [5, 6, 7]])
    for table in (rope.table(100), None):
        for arg, (a, b) in (("q", (q.to_sparse(), k)), ("k", (q, k.to_sparse()))):
            with pytest.raises(PosencError, match=rf"^{arg}: expected a dense tensor \(layout torch.strided\), got a "
                               r"tensor of layout torch.sparse_coo"):
                rope.apply(a, b, pos, table=table)
    with pytest.raises(PosencError, match=r"^q: expected a dense tensor"):
        attention(q.to_sparse(), k, k, q_positions=torch.arange(3), k_positions=torch.arange(3))
