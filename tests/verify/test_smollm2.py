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
        f"  serving path: {serving(res)}",
        f"  tables: {sum(t['ok'] for t in res.tables)}/{len(res.tables)} match the reference's",
        f"  stage times (s): { {k: round(v, 1) for k, v in res.timings_s.items()} }",
    ])


def serving(res) -> str:
    rec = res.paths["serve"]
    steps = rec["steps"]
    kl = max(s["max_row_mean_kl"] for s in steps)
    own = max(s["vs_full_forward"]["rel_l2"] for s in steps)
    return (f"{len(steps)} steps ({sum(s['phase'] == 'decode' for s in steps)} decode), ok {rec['ok']}, worst row "
            f"mean KL {kl:.3g}, max rel L2 vs own full forward {own:.3g}, K/V max rel L2 "
            f"{rec['kv_cache']['max_rel_l2']:.3g}")


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
    assert res.paths["serve"]["ok"] and all(t["ok"] for t in res.tables)


def test_fault_in_layer_20_of_30_is_found(smol):
    path, ref, _ = smol
    fault = Fault("scale", op="aten.silu", layer=20, value=1.2)
    res = run_verify(path, FaultyTarget(faults=[fault]), "faulty", config=VerifyConfig(new_tokens=4, ppl_tokens=0),
                     reference=ref)
    assert res.verdict == "mismatch"
    assert res.first_failing["unit"] == "layers.20"
    assert res.culprit["op"] == "aten.silu.default" and res.culprit["module"] == "layers.20.mlp"


def test_decode_only_fault_is_localized_on_smollm2(smol):
    """Prefill exact, decode wrong (layer 20's SiLU in decode steps only): the step and op are named."""
    path, ref, _ = smol
    fault = Fault("scale", op="aten.silu", layer=20, value=1.2, phase="decode")
    res = run_verify(path, FaultyTarget(faults=[fault]), "faulty", config=VerifyConfig(new_tokens=8, ppl_tokens=0),
                     reference=ref)
    assert res.verdict == "mismatch"
    assert all(b["isolated"]["ok"] for b in res.boundaries) and res.parity["ok"]
    ff = res.first_failing
    assert ff["path"] == "serve" and ff["phase"] == "decode" and ff["unit"] == "layers.20"
    assert res.culprit["op"] == "aten.silu.default" and res.culprit["module"] == "layers.20.mlp"


def test_rope_table_fault_is_blamed_on_the_table_on_smollm2(smol):
    path, ref, _ = smol
    res = run_verify(path, FaultyTarget(faults=[Fault("table", table="rope", min_position=24)]), "faulty",
                     config=VerifyConfig(new_tokens=8, ppl_tokens=0), reference=ref)
    assert res.verdict == "mismatch"
    assert res.first_failing["unit"] == "tables" and res.first_failing["first_bad_position"] == 24
    assert res.culprit is None and all(b["isolated"]["ok"] for b in res.boundaries)
