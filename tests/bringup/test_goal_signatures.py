"""Goals parse and judge; signatures are computed from verify evidence (pure data, no model)."""

from __future__ import annotations

import pytest

from firstlight.bringup.goal import GoalError, parse_goal
from firstlight.bringup.signatures import (
    Accumulation,
    Context,
    DecodeOnly,
    NonFinite,
    OpClassError,
    OpNotLowered,
    PositionDivergence,
    QualityOnly,
    TableMismatch,
    UnitComposition,
    classify,
    module_kind,
    op_class,
)
from firstlight.targets.base import OpNotLoweredError


def _result(**kw):
    base = {"verdict": "mismatch", "reasons": ["x"], "boundaries": [], "first_failing": None, "culprit": None,
            "ops": [], "parity": {"top1_agreement": 0.9, "mean_kl": 0.05, "topk_overlap": 0.9},
            "perplexity": {"ratio": 1.02}}
    base.update(kw)
    return base


def test_goal_parsing_and_two_sided_perplexity():
    g = parse_goal("ppl<=1.01,top1>=0.99,kl<=1e-3")
    assert [c.metric for c in g.conditions] == ["ppl", "top1", "kl"]
    ok = _result(parity={"top1_agreement": 1.0, "mean_kl": 1e-4, "topk_overlap": 1.0}, perplexity={"ratio": 1.005})
    assert g.unmet(ok) == []
    low = _result(parity={"top1_agreement": 1.0, "mean_kl": 1e-4, "topk_overlap": 1.0}, perplexity={"ratio": 0.98})
    assert any(u.startswith("ppl") for u in g.unmet(low))  # lower than the reference is a mismatch too
    assert parse_goal(None).unmet({"verdict": "match"}) == []
    assert parse_goal("verdict").unmet(_result()) == ["x"]


@pytest.mark.parametrize("text", ["ppl<1.01,", "ppl=1", "speed>=3", "kl<=abc", "top1 >= "])
def test_bad_goal_is_named(text):
    with pytest.raises(GoalError, match="goal"):
        parse_goal(text)


def test_op_class_and_module_kind():
    assert op_class("aten.addmm.default") == "matmul"
    assert op_class("aten._softmax.default") == "softmax"
    assert op_class("aten.mul.Tensor", "layers.3.input_layernorm") == "norm"
    assert op_class("aten.exp.default") == "transcendental"
    assert op_class("aten.embedding.default") == "embedding"
    assert module_kind("layers.12.mlp.down_proj") == "layers.*.mlp.down_proj"
    assert module_kind("lm_head") == "lm_head"


def test_op_not_lowered_from_the_compile_error():
    sig = classify(None, OpNotLoweredError("no", op="aten.cos", module="", line="firstlight/models/layers.py:80"))
    assert sig == OpNotLowered(op="aten.cos", module="", line="firstlight/models/layers.py:80")
    assert sig.key() == "op_not_lowered:aten.cos"


def _culprit(op, module, rel=0.1):
    return {"op": op, "module": module, "isolated": {"rel_l2": rel}}


def test_accumulation_needs_a_narrow_accumulator_and_growth_with_k():
    ks = {"layers.0.self_attn.qkv_proj": 576, "layers.0.self_attn.o_proj": 576, "layers.0.mlp.gate_up_proj": 576,
          "layers.0.mlp.down_proj": 1536}
    ops = [{"op": "aten.mm.default", "module": m, "isolated": {"rel_l2": 0.01 * k / 576}} for m, k in ks.items()]
    res = _result(first_failing={"unit": "layers.0"}, culprit=_culprit("aten.mm.default", "layers.0.mlp.down_proj"),
                  ops=ops)
    narrow = Context(accumulator=lambda m, op: "bf16", reduction_len=ks.get)
    sig = classify(res, None, narrow)
    assert isinstance(sig, Accumulation) and sig.reduction_len == 1536 and sig.accumulator == "bf16"
    assert sig.key() == "accumulation:bf16"
    wide = Context(accumulator=lambda m, op: "fp32", reduction_len=ks.get)
    sig = classify(res, None, wide)
    assert isinstance(sig, OpClassError) and sig.op_class == "matmul"


def test_unit_failure_without_culprit_is_composition_aimed_at_the_worst_op():
    res = _result(first_failing={"unit": "layers.4", "first_propagated_op": {"module": "layers.4.mlp"}})
    assert classify(res) == UnitComposition(unit="layers.4", module="layers.4.mlp")
    ops = [{"op": "aten.mm.default", "module": "layers.4.mlp.down_proj", "isolated": {"rel_l2": 0.03}},
           {"op": "aten.mul.Tensor", "module": "layers.4.mlp", "isolated": {"rel_l2": 0.004}}]
    sig = classify(_result(first_failing={"unit": "layers.4"}, ops=ops))
    assert sig == UnitComposition(unit="layers.4", module="layers.4.mlp.down_proj", op="aten.mm.default")


def test_concentrated_error_names_the_class():
    res = _result(first_failing={"unit": "layers.1"}, culprit=_culprit("aten._softmax.default", "layers.1.self_attn"))
    sig = classify(res)
    assert isinstance(sig, OpClassError) and sig.key() == "op_class:softmax"


def test_non_finite_table_decode_position_and_quality():
    nan = {"rel_l2": float("nan"), "max_abs": float("inf")}
    assert classify(_result(ops=[{"op": "aten.exp.default", "module": "layers.2.self_attn", "isolated": nan}])) \
        == NonFinite(op="aten.exp.default", module="layers.2.self_attn")
    assert classify(_result(tables=[{"name": "rope:sliding_attention", "ok": False, "op": "aten.cos"}])) \
        == TableMismatch(table="rope:sliding_attention", op="aten.cos")
    step = {"phase": "decode", "vs_full_forward": {"ok": False}}
    dec = classify(_result(paths={"serve": {"ok": False, "first_failing_step": 2, "steps": [{}, {}, step]}},
                           first_failing={"unit": "layers.0", "path": "serve", "step": 2},
                           culprit={"op": "aten.bmm.default", "module": "layers.0.self_attn"}))
    assert isinstance(dec, DecodeOnly) and dec.step == 2 and dec.key() == "decode_only:matmul"
    assert classify(_result(long_range={"first_position": 96, "first_unit": "layers.5"})) \
        == PositionDivergence(position=96, unit="layers.5")
    q = classify(_result(reasons=["perplexity ratio 1.04 > 1.03"]))
    assert isinstance(q, QualityOnly) and q.metric == "ppl"


def test_a_weight_culprit_is_a_weight_mismatch_with_no_remedy():
    from firstlight.bringup import remedies as R
    from firstlight.bringup.signatures import WeightMismatch

    res = _result(first_failing={"unit": "layers.1"},
                  culprit={"op": "weight", "param": "layers.1.mlp.experts.down_proj", "module": "layers.1.mlp.experts.3"})
    sig = classify(res)
    assert sig == WeightMismatch(param="layers.1.mlp.experts.down_proj", module="layers.1.mlp.experts.3")
    assert R.candidates(sig, None) == []  # no numerics override fixes a wrongly loaded weight


def test_fields_verify_leaves_unnamed_do_not_break_a_signature():
    """A failing unit or a worst op whose names verify gives as None (an op outside every module)."""
    res = _result(first_failing={"unit": None},
                  ops=[{"op": "aten.mm.default", "module": None, "isolated": {"rel_l2": 0.1}}])
    sig = classify(res)
    assert sig.kind == "unit_composition" and sig.key() == "unit_composition:" and sig.to_dict()["unit"] == ""


def _ev(kl, ppl, top1=0.9, units=3):
    from firstlight.bringup.loop import Evaluation

    bounds = [{"name": f"b{i}", "isolated": {"ok": i >= units}} for i in range(10)]
    res = _result(parity={"top1_agreement": top1, "mean_kl": kl, "topk_overlap": 0.9}, perplexity={"ratio": ppl},
                  boundaries=bounds)
    return Evaluation(res, None, None, ["x"], None, None)


def test_judge_weighs_kl_over_a_short_perplexity():
    from firstlight.bringup.loop import judge

    assert judge(_ev(0.099, 1.003), _ev(0.077, 1.047)) == "improved"  # KL clearly down: not worse on ppl alone
    assert judge(_ev(0.099, 1.003), _ev(0.098, 1.047)) == "worse"  # KL flat, perplexity off: worse
    assert judge(_ev(0.099, 1.003), _ev(None, None)) == "worse"  # non-finite logits: the worst, not a crash
    assert judge(_ev(0.05, 1.02), _ev(0.051, 1.019)) == "no_effect"
