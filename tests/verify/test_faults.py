"""Planted faults through the `faulty` target: each must be localized to the planted op and layer."""

from __future__ import annotations

import pytest
import torch

from firstlight.targets.faulty import Fault, FaultyTarget
from firstlight.verify.harness import VerifyConfig, run_verify

CFG = VerifyConfig(new_tokens=8, ppl_tokens=0)

# (family, fault, expected op prefix, expected module, expected layer)
PLANTED = [
    pytest.param("mistral", Fault("noise", op="aten.mm", module="layers.2.mlp.down_proj", value=0.2),
                 "aten.mm", "layers.2.mlp.down_proj", 2, id="matmul-down_proj-mistral"),
    pytest.param("qwen2", Fault("transpose", op="aten.mm", module="layers.1.self_attn.o_proj", arg=1),
                 "aten.mm", "layers.1.self_attn.o_proj", 1, id="transposed-o_proj-qwen2"),
    pytest.param("qwen3", Fault("scale", op="aten.rsqrt", module="layers.1.input_layernorm", value=1.2),
                 "aten.rsqrt", "layers.1.input_layernorm", 1, id="rsqrt-norm-qwen3"),
    pytest.param("llama", Fault("constant", op="aten.add.Tensor", module="layers.0.post_attention_layernorm", value=1.0),
                 "aten.add.Tensor", "layers.0.post_attention_layernorm", 0, id="norm-eps-constant-llama"),
    pytest.param("mistral", Fault("scale", op="aten.neg", module="layers.1.self_attn", value=-1.0),
                 "aten.neg", "layers.1.self_attn", 1, id="rotary-sign-mistral"),
    pytest.param("gemma3_text", Fault("noise", op="aten._softmax", layer=2, value=0.3),
                 "aten._softmax", "layers.2.self_attn", 2, id="softmax-gemma3"),
    pytest.param("llama", Fault("scale", op="aten.silu", layer=3, value=1.1),
                 "aten.silu", "layers.3.mlp", 3, id="silu-llama"),
    pytest.param("gemma3_text", Fault("dtype", op="aten.gelu", layer=0, to="bfloat16"),
                 "aten.gelu", "layers.0.mlp", 0, id="gelu-bf16-roundtrip-gemma3"),
    pytest.param("qwen2", Fault("offset", op="aten.add.Tensor", module="layers.1", nth=1, value=0.5),
                 "aten.add.Tensor", "layers.1", 1, id="residual-add-qwen2"),
    pytest.param("qwen3", Fault("constant", op="aten.masked_fill", layer=2, value=0.0),
                 "aten.masked_fill", "layers.2.self_attn", 2, id="causal-mask-qwen3"),
    pytest.param("qwen3", Fault("noise", op="aten.embedding", module="embed_tokens", value=0.1),
                 "aten.embedding", "embed_tokens", None, id="embedding-gather-qwen3"),
]


@pytest.mark.parametrize(("family", "fault", "op", "module", "layer"), PLANTED)
def test_planted_fault_is_localized(tiny_dirs, references, family, fault, op, module, layer):
    target = FaultyTarget(torch.float32, faults=[fault])
    res = run_verify(tiny_dirs[family], target, "faulty", config=CFG, reference=references(family))
    assert res.verdict == "mismatch"
    assert fault.hits > 0
    c = res.culprit
    assert c is not None, res.first_failing
    assert c["op"].startswith(op)
    assert c["module"] == module
    assert c["layer"] == layer
    # source line: the model's own file, the embedding included (its `embed` method, not torch's nn.Embedding)
    assert c["source"].startswith("firstlight/models/") and c["code"]
    if layer is None:
        assert "self.embed_tokens(input_ids)" in c["code"]
    assert not c["isolated"]["ok"]
    # error is introduced at the culprit: every op before it is within tolerance in isolation
    before = [o for o in res.ops if o["index"] < c["index"]]
    assert all(o["isolated"]["ok"] for o in before)
    # the failing unit is the planted layer (or the embedding)
    assert res.first_failing["unit"] == (f"layers.{layer}" if layer is not None else "embed")


def test_planted_fault_in_bf16_is_localized(tiny_dirs, references):
    fault = Fault("scale", op="aten.mm", module="layers.2.mlp.down_proj", value=1.25)
    target = FaultyTarget(torch.bfloat16, faults=[fault])
    res = run_verify(tiny_dirs["qwen3"], target, "faulty", config=CFG, reference=references("qwen3"))
    assert res.verdict == "mismatch"
    assert res.culprit["module"] == "layers.2.mlp.down_proj"
    assert res.culprit["op"].startswith("aten.mm")


def test_scale_fault_is_caught_although_pcc_is_one(tiny_dirs, references):
    """A pure scale error keeps PCC and cosine at 1: the verdict must still fail on it."""
    fault = Fault("scale", op="aten.mm", module="layers.1.mlp.down_proj", value=1.5)
    res = run_verify(tiny_dirs["qwen3"], FaultyTarget(torch.float32, faults=[fault]), "faulty",
                     config=CFG, reference=references("qwen3"))
    row = next(b for b in res.boundaries if b["name"] == "layers.1.mlp")
    assert row["isolated"]["pcc"] > 0.9999 and row["isolated"]["cosine"] > 0.9999
    assert not row["isolated"]["ok"]
    assert res.verdict == "mismatch"
