"""SmolLM2-135M (30 layers): honest targets pass, a fault planted in layer 20 is found. Slow."""

from __future__ import annotations

import pytest
import torch

from firstlight.targets.faulty import Fault, FaultyTarget
from firstlight.targets.registry import get_target
from firstlight.verify.harness import VerifyConfig, run_verify

pytestmark = pytest.mark.slow
CFG = VerifyConfig(new_tokens=16, ppl_tokens=256)


def summary(res) -> str:
    """The figures docs/VERIFY.md records for a run."""
    def worst(kind: str, sub: bool) -> str:
        rows = [b for b in res.boundaries if kind in b and (b["name"].count(".") == 2) == sub]
        if not rows:
            return "-"
        b = max(rows, key=lambda b: b[kind]["rel_l2"])
        return f"{b[kind]['rel_l2']:.3g} ({b['name']}, frac beyond {b[kind]['frac_beyond']:.3g})"

    p, q = res.parity, res.perplexity
    div = p["first_divergence"]
    return "\n".join([
        f"  max isolated rel L2: units {worst('isolated', False)}; attention/MLP {worst('isolated', True)}",
        f"  max propagated rel L2: {worst('propagated', False)}",
        f"  teacher-forced ({p['num_positions']} positions): top-1 {p['top1_agreement']:.4f}, top-5 overlap "
        f"{p['topk_overlap']:.4f}, mean KL {p['mean_kl']:.3g}, max KL {p['max_kl']:.3g}, "
        f"max |logprob err| {p['max_logprob_error']:.3g}",
        f"  greedy: {'no divergence' if div is None else div}",
        f"  perplexity ({q['num_tokens']} tokens): reference {q['reference']:.4f}, target {q['target']:.4f}, "
        f"ratio {q['ratio']:.6f}",
        f"  stage times (s): { {k: round(v, 1) for k, v in res.timings_s.items()} }",
    ])


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
    print(f"\n{spec} {dtype}: {res.verdict.upper()}\n{summary(res)}")
    assert res.verdict == "match", res.reasons
    names = {b["name"] for b in res.boundaries}
    assert {"layers.29.self_attn", "layers.29.mlp"} <= names  # inside-layer too, compiled targets included


def test_fault_in_layer_20_of_30_is_found(smol):
    path, ref, _ = smol
    fault = Fault("scale", op="aten.silu", layer=20, value=1.2)
    res = run_verify(path, FaultyTarget(faults=[fault]), "faulty", config=VerifyConfig(new_tokens=4, ppl_tokens=0),
                     reference=ref)
    assert res.verdict == "mismatch"
    assert res.first_failing["unit"] == "layers.20"
    assert res.culprit["op"] == "aten.silu.default" and res.culprit["module"] == "layers.20.mlp"
