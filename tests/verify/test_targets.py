"""No false alarms on honest targets; registry and user-target loading; metrics and tolerance."""

from __future__ import annotations

import math

import pytest
import torch

from firstlight.targets.base import Target, TargetError
from firstlight.targets.registry import get_target
from firstlight.verify.harness import VerifyConfig, run_verify
from firstlight.verify.metrics import compare, ulp_distance
from firstlight.verify.tolerance import TolerancePolicy

CFG = VerifyConfig(new_tokens=8, ppl_tokens=0)


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "gemma3_text"])
def test_eager_fp32_matches(tiny_dirs, references, family):
    res = run_verify(tiny_dirs[family], get_target("eager"), "eager", config=CFG, reference=references(family))
    assert res.verdict == "match", res.reasons
    assert res.culprit is None and res.parity["top1_agreement"] == 1.0
    assert res.parity["first_divergence"] is None


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_eager_bf16_matches_with_bf16_policy(tiny_dirs, references, family):
    res = run_verify(tiny_dirs[family], get_target("eager", torch.bfloat16), "eager", config=CFG,
                     reference=references(family))
    assert res.verdict == "match", res.reasons
    # bf16 is not bit-identical: errors exist, they are just within the bf16 policy
    assert max(b["isolated"]["rel_l2"] for b in res.boundaries) > 1e-4


def test_eager_bf16_fails_the_fp32_policy(tiny_dirs, references):
    res = run_verify(tiny_dirs["llama"], get_target("eager", torch.bfloat16), "eager", config=CFG,
                     reference=references("llama"), policy=TolerancePolicy.for_dtype(torch.float32))
    assert res.verdict == "mismatch"


def test_inductor_fp32_matches(tiny_dirs, references):
    res = run_verify(tiny_dirs["qwen3"], get_target("inductor"), "inductor", config=CFG, reference=references("qwen3"))
    assert res.verdict == "match", res.reasons
    assert res.target_report["ops_lowered"]
    # compiled units: layer outputs both ways; attention and MLP in isolation, as units of their own
    layer_rows = [b for b in res.boundaries if b["name"].count(".") != 2]
    sub_rows = [b for b in res.boundaries if b["name"].count(".") == 2]
    assert all("isolated" in b and "propagated" in b for b in layer_rows)
    assert {b["name"].split(".")[2] for b in sub_rows} == {"self_attn", "mlp"} and len(sub_rows) == 2 * 4
    assert all(b["isolated"]["ok"] and b["isolated"]["rel_l2"] < 1e-5 for b in sub_rows)
    # every unit went through Inductor (none fell back to eager at Dynamo's recompile limit)
    note = next(n for n in res.target_report["notes"] if "compiled by Inductor" in n)
    num_graphs, num_units = int(note.split()[0]), int(note.split(" for ")[1].split()[0])
    # full sequence: logits, embed, layer, head, attention, MLP, tables; serving paths: the target's
    # logits over the batch's second prompt, prefill and decode steps, the one-shot prefill the cached
    # K/V are checked against, tables at both shapes
    assert num_units == 13 and num_graphs >= num_units  # prefill is [3, 20], decode [3, 1]
    assert res.paths["serve"]["ok"] and all(t["ok"] for t in res.tables)


class _AttentionMiscompiled(Target):
    """A compiling target (no hooks) whose attention units come out 10% too large."""

    name = "attention-miscompiled"
    supports_hooks = False

    def compile(self, unit, example_inputs, key):
        if not key.startswith("attn:"):
            return unit
        return lambda *xs: unit(*xs) * 1.1


def test_compiled_target_attention_error_is_seen_inside_the_layer(tiny_dirs, references):
    res = run_verify(tiny_dirs["llama"], _AttentionMiscompiled(), "attention-miscompiled", config=CFG,
                     reference=references("llama"))
    assert res.verdict == "mismatch"
    rows = {b["name"]: b for b in res.boundaries}
    assert not rows["layers.0.self_attn"]["isolated"]["ok"]
    assert rows["layers.0.self_attn"]["isolated"]["rel_l2"] == pytest.approx(0.1, rel=1e-3)
    assert rows["layers.0.mlp"]["isolated"]["ok"] and rows["layers.0"]["isolated"]["ok"]
    assert res.first_failing["unit"] == "layers.0"
    # every op of the layer is right when replayed one by one: the error is the compiled unit's
    assert res.culprit is None and "how the target compiled the unit" in res.first_failing["note"]


@pytest.mark.slow
def test_onnxruntime_fp32_matches(tiny_dirs, references):
    pytest.importorskip("onnxruntime")
    res = run_verify(tiny_dirs["llama"], get_target("onnxruntime"), "onnxruntime", config=CFG,
                     reference=references("llama"))
    assert res.verdict == "match", res.reasons
    assert "MatMul" in res.target_report["ops_lowered"]


def test_perplexity_ratio_is_one_for_eager(tiny_dirs, references):
    from firstlight.data import load_text
    from firstlight.models.loader import load_tokenizer

    ids = load_tokenizer(tiny_dirs["qwen2"])(load_text("hamlet-sample"))["input_ids"]
    cfg = VerifyConfig(new_tokens=4, ppl_tokens=96, ppl_window=64, ppl_stride=32)
    res = run_verify(tiny_dirs["qwen2"], get_target("eager"), "eager", config=cfg, reference=references("qwen2"),
                     ppl_ids=ids)
    assert res.perplexity["num_tokens"] == 95
    assert res.perplexity["ratio"] == pytest.approx(1.0, abs=1e-4)


def test_unknown_target_names_the_choices():
    with pytest.raises(TargetError, match="unknown target 'tpu'.*eager"):
        get_target("tpu")


def test_faulty_options_from_spec():
    t = get_target("faulty:op=aten.rsqrt,layer=2,kind=scale,value=1.5")
    assert t.faults[0].op == "aten.rsqrt" and t.faults[0].layer == 2 and t.faults[0].value == 1.5
    with pytest.raises(TargetError, match="kind"):
        get_target("faulty:op=aten.rsqrt,kind=wobble")


def test_user_target_file(tmp_path):
    f = tmp_path / "mine.py"
    f.write_text("from firstlight.targets import Target\nclass Mine(Target):\n    name = 'mine'\n")
    assert type(get_target(f"{f}:Mine")).__name__ == "Mine"
    with pytest.raises(TargetError, match="has no class 'Other'.*Mine"):
        get_target(f"{f}:Other")
    with pytest.raises(TargetError, match="not found"):
        get_target(f"{tmp_path / 'nope.py'}:Mine")


def test_metrics_scale_error_has_pcc_one_but_fails():
    r = torch.randn(1000)
    m = compare(r * 1.1, r, torch.float32, TolerancePolicy.for_dtype(torch.float32).tensor)
    assert m.pcc == pytest.approx(1.0) and m.cosine == pytest.approx(1.0)
    assert not m.ok and m.rel_l2 == pytest.approx(0.1, rel=1e-6)


def test_ulp_distance_counts_representable_steps():
    one = torch.tensor([1.0])
    nxt = torch.nextafter(one, torch.tensor([2.0]))
    assert ulp_distance(nxt, one, torch.float32).item() == 1
    assert ulp_distance(torch.tensor([-0.0]), torch.tensor([0.0]), torch.float32).item() == 0
    # across zero: -tiny to +tiny is 2 steps
    tiny = torch.tensor([torch.finfo(torch.float32).smallest_normal / 2**23])
    assert ulp_distance(-tiny, tiny, torch.float32).item() == 2
    # bf16: 1 and 1 + 2^-7 are adjacent
    assert ulp_distance(torch.tensor([1.0 + 2**-7]), one, torch.bfloat16).item() == 1


def test_metrics_exact_and_nonfinite():
    r = torch.tensor([1.0, float("-inf"), 3.0])
    assert compare(r.clone(), r, torch.float32, TolerancePolicy.for_dtype(torch.float32).tensor).ok
    bad = torch.tensor([1.0, 0.0, 3.0])
    m = compare(bad, r, torch.float32, TolerancePolicy.for_dtype(torch.float32).tensor)
    assert not m.ok and math.isinf(m.max_abs)


def test_tolerance_overrides_by_glob(tmp_path):
    f = tmp_path / "tol.json"
    f.write_text('{"overrides": {"layers.*.mlp": {"max_rel_l2": 0.5}}, "logits": {"max_mean_kl": 0.1}}')
    pol = TolerancePolicy.for_dtype(torch.float32).with_file(f)
    assert pol.for_tensor("layers.3.mlp").max_rel_l2 == 0.5
    assert pol.for_tensor("layers.3.self_attn").max_rel_l2 == 1e-3
    assert pol.logits.max_mean_kl == 0.1
    f.write_text('{"tensor": {"wobble": 1}}')
    with pytest.raises(Exception, match="wobble"):
        TolerancePolicy.for_dtype(torch.float32).with_file(f)
