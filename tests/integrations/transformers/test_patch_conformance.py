"""`patch()` on every causal-LM model type of the pinned transformers that posenc's enumeration reads, against
the unpatched model (tests/helpers/transformers_zoo.py `conformance`: tiny random models from the config classes).

Always: a few representative types (Llama; Mistral, whose static cache slides; GPT-NeoX, whose embeddings are
`embed_in`; DeepSeek-V3's MLA with interleaved rope dims; Gemma 3n, which rotates q and k in separate calls;
GraniteSWA, one rotary module per theta; Phi-MoE, whose LongRoPE keeps its short factors times its mscale and whose
config class refuses the other rules: "n/a"; LFM2-MoE, whose rotary module is `pos_emb`; Gemma 3's image-text
model, which hands its text model per-layer-type masks; ZAYA, whose q has strided channels: its partial rotation's
`torch.cat` lays q out anew, and the attention's matmuls round by layout). Every type: `POSENC_ZOO=all pytest tests/integrations/transformers/test_patch_conformance.py`; the
matrix in docs/transformers.md is written from the same function by `python3 -m tests.helpers.transformers_zoo_matrix`.
"""

import os

import pytest

pytest.importorskip("transformers")

from tests.helpers.transformers_zoo import causal_lm_types, conformance  # noqa: E402

REPRESENTATIVE = ("llama", "mistral", "gpt_neox", "deepseek_v3", "gemma3n_text", "granite_swa", "phimoe", "lfm2_moe", "gemma3", "zaya")
# refused types and the structural reason their message must give
# Falcon's layers are `h`, not `layers` (accepted; in the full run)
REFUSED = {"glm_moe_dsa": "one attention module calling", "deepseek_v32": "one attention module calling"}
ALL = os.environ.get("POSENC_ZOO") == "all"
TYPES = causal_lm_types() if ALL else REPRESENTATIVE


@pytest.mark.parametrize("model_type", TYPES)
def test_patched_model_matches_the_unpatched_one(model_type):
    result = conformance(model_type)
    if "not built" in result:
        pytest.skip(f"transformers cannot build {model_type} at the tiny sizes: {result['not built']}")
    if "refused" in result:
        assert model_type not in REPRESENTATIVE, result
        assert "model type" in result["refused"] and "expected" in result["refused"], result
        return
    bad = {k: v for k, v in result.items() if v not in ("ok", "refused at start") and not v.startswith("n/a")}
    assert not bad, bad


@pytest.mark.parametrize("model_type", sorted(REFUSED) if ALL else ["glm_moe_dsa"])
def test_a_type_it_cannot_patch_is_refused_with_the_structural_reason(model_type):
    result = conformance(model_type)
    assert REFUSED[model_type] in result.get("refused", ""), result


@pytest.mark.parametrize("model_type, refusal", [
    # MiniMax makes a MiniMaxCache (linear-attention state) and refuses any other: the policies cannot re-run it,
    # so patch() refuses a length-dependent rule before anything changes
    ("minimax", "refused: model: expected a decoder whose cache the policies can re-run"),
    # Gemma 4's image-text model hands its text model per_layer_inputs for the new tokens only: a re-run over the
    # cached tokens would lack theirs, so "recompute" is refused at the cache's first forward, before anything runs
    ("gemma4", "refused: policy: expected 'freeze' or 'refuse' for a decoder called with per-token inputs"),
])
def test_a_family_the_policies_cannot_rerun_is_refused_a_length_rule_up_front(model_type, refusal):
    result = conformance(model_type)
    if "not built" in result:
        pytest.skip(result["not built"])
    assert result["dynamic recompute"].startswith(refusal), result
    assert all(v == "ok" for k, v in result.items() if k != "dynamic recompute"), result  # fixed rules identical
