"""Verify on MoE and hybrid families: eager matches, and faults planted inside the router/experts,
the shared expert and the linear-attention mixer are localized to that module and layer."""

from __future__ import annotations

import pytest
import torch

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


def test_unsupported_family_is_refused_by_name(tiny_dirs):
    """Granite 4.0-H's layers do not fit the sub-layer boundaries yet: a one-line error, not a crash."""
    from firstlight.targets.base import TargetError

    with pytest.raises(TargetError, match="verify does not support granitemoehybrid yet: .*Mamba-2"):
        run_verify(tiny_dirs["granitemoehybrid"], get_target("eager"), "eager", config=CFG)
