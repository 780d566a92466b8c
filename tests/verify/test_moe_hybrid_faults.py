"""Verify on MoE and hybrid families: eager matches, and faults planted inside the router/experts,
the shared expert and the linear-attention mixer are localized to that module and layer."""

from __future__ import annotations

import pytest
import torch

from firstlight.targets.base import TargetError
from firstlight.targets.faulty import Fault, FaultyTarget
from firstlight.targets.registry import get_target
from firstlight.verify.harness import VerifyConfig, run_verify

CFG = VerifyConfig(new_tokens=8, ppl_tokens=0)


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_next"])
def test_eager_matches_reference(tiny_dirs, references, family):
    res = run_verify(tiny_dirs[family], get_target("eager"), "eager", config=CFG, reference=references(family))
    assert res.verdict == "match"


PLANTED = [
    pytest.param("mixtral", Fault("noise", op="aten._grouped_mm", layer=1, value=0.2),
                 "aten._grouped_mm", "layers.1.mlp.experts", 1, id="experts-grouped-gemm-mixtral"),
    pytest.param("qwen2_moe", Fault("noise", op="aten.mm", module="layers.1.mlp.shared_expert.down_proj", value=0.2),
                 "aten.mm", "layers.1.mlp.shared_expert.down_proj", 1, id="shared-expert-qwen2_moe"),
    pytest.param("qwen3_next", Fault("scale", op="aten.softplus", layer=2, value=1.5),
                 "aten.softplus", "layers.2.linear_attn", 2, id="deltanet-decay-qwen3_next"),
    pytest.param("qwen3_next", Fault("noise", op="aten._grouped_mm", layer=0, nth=1, value=0.2),
                 "aten._grouped_mm", "layers.0.mlp.experts", 0, id="experts-down-qwen3_next"),
]


@pytest.mark.parametrize(("family", "fault", "op", "module", "layer"), PLANTED)
def test_planted_fault_is_localized(tiny_dirs, references, family, fault, op, module, layer):
    target = FaultyTarget(torch.float32, faults=[fault])
    res = run_verify(tiny_dirs[family], target, "faulty", config=CFG, reference=references(family))
    assert res.verdict == "mismatch" and fault.hits > 0
    c = res.culprit
    assert c is not None, res.first_failing
    assert c["op"].startswith(op) and c["module"] == module and c["layer"] == layer
    assert c["source"].startswith("firstlight/models/")
    assert res.first_failing["unit"] == f"layers.{layer}"


# ---- blaming one expert among the stacked ones ---------------------------------------------------

@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_weight_fault_in_one_expert_is_blamed_on_that_expert(tiny_dirs, references, family):
    """Expert 3's down_proj weight in layer 1 scaled by 1.5: no op fails on the reference's weights,
    and the weight check names the parameter and the expert."""
    fault = Fault("weight", param="layers.1.mlp.experts.down_proj", expert=3, value=1.5)
    res = run_verify(tiny_dirs[family], FaultyTarget(torch.float32, faults=[fault]), "faulty", config=CFG,
                     reference=references(family))
    assert res.verdict == "mismatch" and fault.hits == 1
    assert res.first_failing["unit"] == "layers.1"
    c = res.culprit
    assert c is not None, res.first_failing
    assert (c["op"], c["module"], c["expert"], c["layer"]) == ("weight", "layers.1.mlp.experts.3", 3, 1)
    assert c["param"] == "layers.1.mlp.experts.down_proj"
    assert c["source"].startswith("firstlight/models/moe.py") and "down_proj" in c["code"]
    assert [w["module"] for w in res.first_failing["weights"]] == ["layers.1.mlp.experts.3"]  # only that expert
    assert "expert 3" in res.first_failing["note"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_op_fault_in_one_expert_is_blamed_on_that_expert(tiny_dirs, references, family):
    """Only expert 3's rows of layer 1's down-projection grouped GEMM are scaled: the culprit op is the
    grouped GEMM, and its per-expert comparison names expert 3 (the other experts' rows are exact)."""
    fault = Fault("scale", op="aten._grouped_mm", layer=1, nth=1, expert=3, value=1.5)
    res = run_verify(tiny_dirs[family], FaultyTarget(torch.float32, faults=[fault]), "faulty", config=CFG,
                     reference=references(family))
    assert res.verdict == "mismatch" and fault.hits > 0
    c = res.culprit
    assert c is not None, res.first_failing
    assert c["op"].startswith("aten._grouped_mm") and c["module"] == "layers.1.mlp.experts.3" and c["expert"] == 3
    per_expert = {r["expert"]: r["isolated"]["ok"] for r in c["experts"]}
    assert per_expert.pop(3) is False and per_expert and all(per_expert.values())
    assert c["source"].startswith("firstlight/models/moe.py")


def test_weight_fault_outside_experts_names_the_module(tiny_dirs, references):
    fault = Fault("weight", param="layers.2.self_attn.o_proj.weight", value=1.05)
    res = run_verify(tiny_dirs["qwen3_moe"], FaultyTarget(torch.float32, faults=[fault]), "faulty", config=CFG,
                     reference=references("qwen3_moe"))
    c = res.culprit
    assert res.verdict == "mismatch" and c is not None
    assert (c["op"], c["module"], c["expert"], c["layer"]) == ("weight", "layers.2.self_attn.o_proj", None, 2)


def test_weight_fault_options():
    f = FaultyTarget(torch.float32, kind="weight", param="layers.1.mlp.experts.down_proj", expert="3", value="1.5")
    assert (f.faults[0].param, f.faults[0].expert, f.faults[0].value) == ("layers.1.mlp.experts.down_proj", 3, 1.5)
    with pytest.raises(TargetError, match="needs param="):
        Fault("weight")
    with pytest.raises(TargetError, match="no parameter matches param=nope"):
        Fault("weight", param="nope").plant_weight(torch.nn.Linear(2, 2))


def test_unsupported_family_is_refused_by_name(tiny_dirs):
    """Granite 4.0-H's layers do not fit the sub-layer boundaries yet: a one-line error, not a crash."""
    from firstlight.targets.base import TargetError

    with pytest.raises(TargetError, match="verify does not support granitemoehybrid yet: .*Mamba-2"):
        run_verify(tiny_dirs["granitemoehybrid"], get_target("eager"), "eager", config=CFG)
