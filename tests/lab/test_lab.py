"""posenc lab: a tiny end-to-end run produces well-formed outputs; its pieces checked against independent oracles.

The paper predictions themselves need the full configuration (docs/lab.md); here the run is far too small
for them, so only the shape and sanity of the outputs are checked, plus the prediction logic on made-up
results whose verdicts are known.
"""

import csv
import json
import math

import pytest
import torch

from posenc import PosencError
from posenc.cli import main
from posenc.lab import train as lab_train
from posenc.lab.config import LabConfig, train_key
from posenc.lab.data import eval_windows, load_corpus, train_batch
from posenc.lab.evaluate import control_nll, summarize, token_nll
from posenc.lab.extension import parse_rule
from posenc.lab.longrope import project, seed_factors
from posenc.lab.predictions import check_predictions, hard_failures
from posenc.lab.probe import probe_batch
from posenc.lab.schemes import build_model, with_rope
from posenc.rope.scaling import DynamicNTK
from posenc.rope.spec import Rope

from tests.helpers.tolerances import assert_close

TINY = ["lab", "--quick", "--corpus", "pydoc", "--steps", "4", "--l0", "32", "--d", "32", "--heads", "2", "--ffn", "48",
        "--batch", "4", "--lengths", "1,2,4", "--windows", "2", "--finetune-steps", "2", "--probe-trials", "2",
        "--search-population", "2", "--search-generations", "1", "--threads", "1", "--progress", "off"]
HARD = {"sinusoidal_breaks_beyond_L0", "rope_degrades_beyond_L0", "rope_keeps_degrading", "alibi_flat_2x",
        "alibi_flat_4x", "dynamic_ntk_exact_within_L0", "dynamic_ntk_better_beyond_L0_2x",
        "dynamic_ntk_better_beyond_L0_4x", "pi_zero_shot_damages_in_range", "rules_coincide_at_L0"}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lab")
    code = main(TINY + ["--out", str(out / "res"), "--json", str(out / "all.json")])
    assert code == 0
    return out


def test_tiny_run_writes_well_formed_outputs(tiny_run):
    res = tiny_run / "res"
    payload = json.loads((tiny_run / "all.json").read_text())
    assert payload == json.loads((res / "results.json").read_text())
    assert set(payload) == {"meta", "measurements", "predictions"}
    assert len(payload["meta"]["corpus"]["sha256"]) == 64 and payload["meta"]["corpus"]["name"] == "pydoc"
    rows = payload["measurements"]
    sections = {r["section"] for r in rows}
    assert sections == {"scheme", "extension", "finetune", "train", "probe", "longrope_factor"}
    ppl_rows = [r for r in rows if r["metric"] in ("ppl_all", "ppl_in", "ppl_out", "ref_all", "ref_out", "band", "ref_band")]
    assert ppl_rows and all(math.isfinite(r["value"]) and 1.0 < r["value"] < 1e4 for r in ppl_rows)
    ratios = [r for r in rows if "ratio" in r["metric"]]
    assert ratios and all(math.isfinite(r["value"]) and r["value"] > 0 for r in ratios)
    models = {r["model"] for r in rows if r["section"] == "scheme"}
    assert models == {"nope", "sinusoidal", "learned", "rope", "alibi", "t5"}
    for scheme in models:  # 3 lengths, ppl_all at each; ppl_out only beyond L0
        got = {(r["multiple"], r["metric"]) for r in rows if r["model"] == scheme and r["section"] == "scheme"}
        assert {(m, "ppl_all") for m in (1, 2, 4)} <= got and (1, "ppl_out") not in got and (4, "ratio_out") in got
        bands = [r for r in rows if r["model"] == scheme and r["metric"] == "band" and r["multiple"] == 4]
        assert sorted(r["band"] for r in bands) == [0, 1, 2, 3]
    probe = [r for r in rows if r["section"] == "probe" and r["metric"] == "accuracy"]
    assert probe and all(0.0 <= r["value"] <= 1.0 for r in probe)
    preds = payload["predictions"]
    assert HARD <= {p["name"] for p in preds}
    for p in preds:
        assert set(p) >= {"name", "measured", "threshold", "passed", "kind"}
        assert p["kind"] in ("hard", "soft", "report")
        assert (p["passed"] is None) == (p["kind"] == "report")
    with open(res / "results.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    summary = (res / "summary.md").read_text()
    assert "### Predictions" in summary and "rules_coincide_at_L0" in summary
    for name in ("ppl_vs_length.png", "extension_rules.png", "retrieval_depth.png"):
        assert (res / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    by_name = {p["name"]: p for p in preds}  # exact by construction, even for a 4-step model
    assert by_name["rules_coincide_at_L0"]["passed"] and by_name["dynamic_ntk_exact_within_L0"]["passed"]


def test_rerun_loads_checkpoints_and_reproduces(tiny_run, capsys):
    first = json.loads((tiny_run / "all.json").read_text())
    assert main(TINY + ["--out", str(tiny_run / "res"), "--json", str(tiny_run / "again.json")]) == 0
    second = json.loads((tiny_run / "again.json").read_text())
    values = lambda p: [(r["section"], r["model"], r["metric"], r["band"], r["value"]) for r in p["measurements"]
                        if r["metric"] != "seconds"]
    assert values(first) == values(second)
    raw = torch.load(tiny_run / "res" / "raw_results.pt", weights_only=False)
    assert all(entry["train"]["loaded"] for entry in raw["schemes"].values())
    assert all(entry["train"]["loaded"] for entry in raw["finetune"].values())


def test_interrupted_training_resumes_to_the_same_weights(tmp_path, monkeypatch):
    cfg = LabConfig.preset("quick", l0=16, hidden_size=16, num_heads=2, intermediate_size=16, batch_size=2,
                           lengths=(1, 2), probe_run=6, probe_cue=2)
    stream = torch.arange(4000, dtype=torch.int64).remainder(251).to(torch.uint8)
    schedule = lab_train.Schedule(steps=6, batch_size=2, length=16, lr=1e-2, warmup=2, min_ratio=0.1, grad_clip=1.0,
                                  seed=3)
    whole = build_model(cfg, "rope")
    lab_train.fit(whole, stream, schedule, tmp_path / "a" / "m.pt", label="a", save_every=2)
    real_loss, calls = lab_train.lm_loss, []

    def failing(model, tokens):
        calls.append(1)
        if len(calls) == 4:
            raise KeyboardInterrupt
        return real_loss(model, tokens)

    monkeypatch.setattr(lab_train, "lm_loss", failing)
    broken = build_model(cfg, "rope")
    with pytest.raises(KeyboardInterrupt):
        lab_train.fit(broken, stream, schedule, tmp_path / "b" / "m.pt", label="b", save_every=2)
    assert (tmp_path / "b" / "m.partial.pt").exists() and not (tmp_path / "b" / "m.pt").exists()
    monkeypatch.setattr(lab_train, "lm_loss", real_loss)
    resumed = build_model(cfg, "rope")
    record = lab_train.fit(resumed, stream, schedule, tmp_path / "b" / "m.pt", label="b", save_every=2)
    assert record["resumed_from"] == 2 and not (tmp_path / "b" / "m.partial.pt").exists()
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), name


def _tiny_model(scheme="rope", **changes):
    cfg = LabConfig.preset("quick", l0=8, hidden_size=16, num_heads=2, intermediate_size=24, lengths=(1, 2, 4),
                           probe_run=4, probe_cue=2, **changes)
    return cfg, build_model(cfg, scheme, seed=1)


@pytest.mark.parametrize("length", [32, 30])  # 30: the last control window is placed at the tail
def test_control_nll_equals_per_token_windows(length):
    cfg, model = _tiny_model()
    windows = torch.randint(0, 256, (2, length + 1), generator=torch.Generator().manual_seed(0))
    got = control_nll(model, windows, 8)
    stride = 4
    for p in [0, 5, 7, 8, 11, 12, 19, length - 2, length - 1]:
        start = 0 if p < 8 else min((p // stride - 1) * stride, length - 8)
        logits = model(windows[:, start:p + 1])[:, -1]  # positions 0 .. p - start: at most L0 of context
        want = torch.nn.functional.cross_entropy(logits, windows[:, p + 1], reduction="none").double()
        assert 0 < p - start + 1 <= 8
        assert_close(got[:, p].float(), want.float())


def test_summarize_against_hand_computation():
    nll = torch.tensor([[0.0, 1.0, 2.0, 3.0], [1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    ref = torch.full((2, 4), 0.5, dtype=torch.float64)
    rows = summarize(nll, ref, 2, (1, 2))
    assert rows[1]["ratio_out"] is None and rows[1]["ppl_all"] == pytest.approx(math.exp(0.75))
    assert rows[2]["ppl_in"] == pytest.approx(math.exp(0.75)) and rows[2]["ppl_out"] == pytest.approx(math.exp(1.75))
    assert rows[2]["ratio_out"] == pytest.approx(math.exp(1.25))
    assert rows[2]["bands"] == pytest.approx([math.exp(0.75), math.exp(1.75)])
    with pytest.raises(PosencError, match="nll: expected at least 8 positions"):
        summarize(nll, ref, 2, (4,))


def test_dynamic_ntk_blocks_equal_full_forwards_at_each_length():
    cfg, model = _tiny_model()
    dyn = with_rope(model, Rope(head_dim=8, scaling=DynamicNTK(1.0, 8)))
    windows = torch.randint(0, 256, (3, 25), generator=torch.Generator().manual_seed(1))
    blocks = token_nll(dyn, windows, block=8)  # [3, 24]
    plain = token_nll(model, windows)
    assert torch.equal(blocks[:, :8], token_nll(model, windows[:, :9]))  # the unscaled table within L0
    full_16 = token_nll(dyn, windows[:, :17])  # the table of length 16 for every position
    assert_close(blocks[:, 8:16].float(), full_16[:, 8:16].float())
    assert not torch.allclose(blocks[:, 8:], plain[:, 8:])
    assert torch.equal(token_nll(model, windows, block=8), token_nll(model, windows, block=8))
    assert_close(token_nll(model, windows, block=8).float(), plain.float())  # no length dependence: same


def test_rules_parse_and_map_to_scalings():
    rule = parse_rule("yarn:beta_fast=8,temperature=off")
    assert rule.label == "yarn:beta_fast=8,temperature=off" and rule.knobs["beta_slow"] == 1.0
    on = parse_rule("yarn").scaling(4, 128)
    assert on.effective_attention_factor() == pytest.approx(0.1 * math.log(4) + 1)
    assert parse_rule("pi").scaling(8, 128).factor == 8.0
    assert parse_rule("llama3:high_freq_factor=8").scaling(2, 64).high_freq_factor == 8.0
    assert parse_rule("dynamic_ntk:block=16").block(128) == 16 and parse_rule("dynamic_ntk").block(128) == 128
    given = parse_rule("longrope:factors=1/2/4,attention=none").scaling(4, 64)
    assert given.long_factor == (1.0, 2.0, 4.0) and given.attention_factor == 1.0
    assert parse_rule("longrope").attention(8, 128) == pytest.approx(math.sqrt(1 + math.log(8) / math.log(128)))
    for spec, match in [("rope2", "rule: expected a rule name"), ("yarn:beta=3", "key=value knobs"),
                        ("yarn:beta_fast=x", "yarn:beta_fast: expected a number"),
                        ("yarn:beta_fast=0.5", "beta_fast > beta_slow"), ("pi:factor=2", r"knobs from \(none\)"),
                        ("longrope:factors=1/-2", "longrope:factors: expected positive numbers")]:
        with pytest.raises(PosencError, match=match):
            parse_rule(spec)


def test_longrope_seeds_and_projection():
    rope = Rope(head_dim=16)
    pi, ntk = seed_factors(rope, 4.0, 64)[:2]
    assert torch.equal(pi, torch.full((8,), 4.0, dtype=torch.float64))
    d = 16  # NTK-aware: lambda_i = (s^(d/(d-2)))^(2i/d), float64 closed form
    want = torch.tensor([(4.0 ** (d / (d - 2))) ** (2 * i / d) for i in range(8)], dtype=torch.float64).clamp(max=5.0)
    torch.testing.assert_close(ntk, torch.cummax(want.clamp(min=1.0), 0).values, rtol=1e-6, atol=1e-6)
    lam = project(torch.tensor([0.5, 3.0, 2.0, 9.0]), 4.0)
    assert lam.tolist() == [1.0, 3.0, 3.0, 5.0]


def test_probe_places_the_run_at_depth_and_at_the_end():
    stream = torch.full((500,), ord(" "), dtype=torch.uint8)
    for depth, needle in [(0.0, 0), (0.5, 12), (1.0, 25)]:  # round(depth * (41 - 2 * 8)); 25 ends at the query
        inputs, targets, scored, distance = probe_batch(stream, 40, depth, run=8, cue=3, trials=3,
                                                        generator=torch.Generator().manual_seed(0))
        seq = torch.cat([inputs, targets[:, -1:]], dim=1)  # [3, 41]
        assert torch.equal(seq[:, needle:needle + 8], seq[:, 33:]) and distance == 33 - needle
        assert bool(((seq[:, 33:] >= ord("a")) & (seq[:, 33:] <= ord("z"))).all())
        assert scored.sum(1).tolist() == [5, 5, 5] and bool(scored[:, 35:].all())
        assert torch.equal(targets[scored].view(3, 5), seq[:, 36:])
    with pytest.raises(PosencError, match="depth: expected a fraction"):
        probe_batch(stream, 40, 1.5, run=8, cue=3, trials=1, generator=torch.Generator())


def _made_up(sinusoidal=1.8, rope=(1.1, 1.2, 1.5), alibi=(1.0, 0.99, 1.01), dyn_in=6.0, dyn_out=0.9, pi_in=7.0):
    def row(m, ppl_all=6.0, ppl_in=6.0, ratio=None, out=None):
        return dict(length=8 * m, ppl_all=ppl_all, ppl_in=ppl_in, ppl_out=out, ratio_out=ratio, band_ratios=[1.0] * m)

    def scheme(ratios):
        return dict(eval={1: row(1), **{m: row(m, ratio=r, out=6 * r) for m, r in zip((2, 4, 8), ratios)}}, probe=[])

    plain = {1: row(1), **{m: row(m, out=8.0) for m in (2, 4, 8)}}
    ext = {"none": dict(eval=plain),
           "dynamic_ntk": dict(eval={1: row(1), **{m: row(m, ppl_in=dyn_in, out=8.0 * dyn_out) for m in (2, 4, 8)}}),
           "pi": dict(eval={1: row(1), **{m: row(m, ppl_in=pi_in, out=9.0) for m in (2, 4, 8)}})}
    return dict(schemes={"sinusoidal": scheme([sinusoidal] * 3), "rope": scheme(rope), "alibi": scheme(alibi)},
                extension=ext, finetune={})


@pytest.mark.parametrize("change, failing", [
    ({}, set()),
    (dict(sinusoidal=1.4), {"sinusoidal_breaks_beyond_L0"}),
    (dict(rope=(1.1, 1.3, 1.2)), {"rope_keeps_degrading"}),
    (dict(rope=(1.02, 1.1, 1.2)), {"rope_degrades_beyond_L0"}),
    (dict(alibi=(1.0, 1.05, 1.0)), {"alibi_flat_4x"}),
    (dict(dyn_in=6.01), {"dynamic_ntk_exact_within_L0"}),
    (dict(dyn_out=1.01), {"dynamic_ntk_better_beyond_L0_2x", "dynamic_ntk_better_beyond_L0_4x",
                          "dynamic_ntk_better_beyond_L0_8x"}),
    (dict(pi_in=6.2), {"pi_zero_shot_damages_in_range"}),
])
def test_hard_predictions_flip_on_made_up_results(change, failing):
    rows = check_predictions(_made_up(**change), LabConfig())
    assert {r["name"] for r in hard_failures(rows)} == failing


def test_config_and_data_checks():
    with pytest.raises(PosencError, match="schemes: expected one or more of"):
        LabConfig(schemes=("rope", "xpos"))
    with pytest.raises(PosencError, match="lengths: expected increasing integer multiples"):
        LabConfig(lengths=(2, 4))
    with pytest.raises(PosencError, match="preset: expected one of"):
        LabConfig.preset("huge")
    cfg = LabConfig()
    assert train_key(cfg, "rope", "a") != train_key(cfg, "alibi", "a") != train_key(cfg, "rope", "b")
    assert train_key(cfg, "rope", "a") == train_key(LabConfig(eval_windows=3, rules=("pi",)), "rope", "a")
    corpus = load_corpus("pydoc")
    assert corpus.documents[0] > 10 * corpus.documents[1] > 0 and len(corpus.sha256) == 64
    batch = train_batch(corpus.train, 3, 10, torch.Generator().manual_seed(0))
    assert batch.shape == (3, 11) and batch.dtype == torch.int64
    windows = eval_windows(corpus.val, 4, 64)
    assert torch.equal(windows[0], corpus.val[:65].long())
    with pytest.raises(PosencError, match="corpus: expected 'stdlib' or 'pydoc'"):
        load_corpus("wiki")


def test_lab_cli_rejects_bad_input_before_training(capsys, tmp_path):
    assert main(["lab", "--quick", "--schemes", "rope", "--rules", "warp", "--out", str(tmp_path / "x")]) == 2
    assert "rule: expected a rule name" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert main(["lab", "--quick", "--longrope-factors", "1,2", "--out", str(tmp_path / "x")]) == 2
    assert "longrope_factors: expected head_dim / 2 = 8 numbers" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["plain", "rich", "off"])
def test_progress_bars_write_to_stderr_only(capsys, mode):
    from posenc.lab.progress import bar, set_mode

    with bar("steps", 20, mode=mode) as tick:
        for i in range(20):
            tick(info=f"loss {i}")
    out, err = capsys.readouterr()
    assert out == ""
    if mode == "plain":
        lines = err.splitlines()
        assert len(lines) == 11 and lines[0].startswith("steps: 1/20 (5%)") and lines[-1].startswith("steps: 20/20 (100%)") and lines[-1].endswith("loss 19")
    elif mode == "rich":
        assert "20/20" in err and "loss 19" in err
    else:
        assert err == ""
    with pytest.raises(PosencError, match="progress: expected one of"):
        set_mode("loud")
