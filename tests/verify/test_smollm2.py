"""SmolLM2-135M (30 layers): honest targets pass, a fault planted in layer 20 is found. Slow."""

from __future__ import annotations

import pytest
import torch

from firstlight.targets.faulty import Fault, FaultyTarget
from firstlight.targets.registry import get_target
from firstlight.verify.harness import VerifyConfig, run_verify

pytestmark = pytest.mark.slow
CFG = VerifyConfig(new_tokens=16, ppl_tokens=256)


@pytest.fixture(scope="module")
def smol():
    from firstlight.data import load_text
    from firstlight.models.hub import resolve
    from firstlight.models.loader import load_tokenizer
    from firstlight.verify.harness import load_reference

    path = resolve("smollm2-135m")
    ids = load_tokenizer(path)(load_text("hamlet-sample"))["input_ids"]
    return path, load_reference(path), ids


@pytest.mark.parametrize(("spec", "dtype"), [("eager", torch.float32), ("eager", torch.bfloat16),
                                             ("inductor", torch.float32), ("onnxruntime", torch.float32)])
def test_honest_target_matches(smol, spec, dtype):
    path, ref, ids = smol
    res = run_verify(path, get_target(spec, dtype), spec, config=CFG, reference=ref, ppl_ids=ids)
    print(spec, dtype, res.parity["mean_kl"], res.parity["top1_agreement"], res.perplexity)
    assert res.verdict == "match", res.reasons


def test_fault_in_layer_20_of_30_is_found(smol):
    path, ref, _ = smol
    fault = Fault("scale", op="aten.silu", layer=20, value=1.2)
    res = run_verify(path, FaultyTarget(faults=[fault]), "faulty", config=VerifyConfig(new_tokens=4, ppl_tokens=0),
                     reference=ref)
    assert res.verdict == "mismatch"
    assert res.first_failing["unit"] == "layers.20"
    assert res.culprit["op"] == "aten.silu.default" and res.culprit["module"] == "layers.20.mlp"
