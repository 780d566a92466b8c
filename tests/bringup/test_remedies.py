"""Every builtin remedy on the signatures it answers: valid override rules that change what the chip
computes at the failing site, the planner's order (direct remedies first), and cheaper variants."""

from __future__ import annotations

import pytest

from firstlight.bringup import remedies as R
from firstlight.bringup.planner import PlaybookPlanner, RunInfo, widens
from firstlight.bringup.playbook import Playbook
from firstlight.bringup.signatures import (
    Accumulation,
    OpClassError,
    OpNotLowered,
    TableMismatch,
    UnitComposition,
)
from firstlight.targets.emulated import EmulatedTarget
from firstlight.targets.overrides import Overrides

MODULE = "layers.2.mlp.down_proj"
ACC = Accumulation(op="aten.mm.default", module=MODULE, reduction_len=1536, accumulator="bf16", growth=0.6)


@pytest.fixture
def ctx(failing_chip):
    t = EmulatedTarget(chip=str(failing_chip))
    return R.RemedyContext(numerics=t.numerics, site=t.site_numerics, modules=[MODULE])


def _site_after(chip, cand: R.Candidate, module: str = MODULE, op: str = "aten.mm"):
    return EmulatedTarget(chip=str(chip), overrides=Overrides(rules=list(cand.rules))).site_numerics(module, op)


def test_every_builtin_remedy_is_registered_with_its_cost():
    reg = R.load_builtin()
    assert {"host_fallback", "decompose", "raise_fidelity", "widen_accumulator", "promote_more_often", "split_k",
            "stochastic_rounding", "widen_weights", "widen_activations", "exact_transcendental", "high_precision",
            "upcast_module", "recompute_table"} <= set(reg)
    assert all(r.cost and r.kinds and set(r.primary) <= set(r.kinds) for r in reg.values())


def test_accumulation_candidates_change_the_site_and_the_direct_one_goes_first(ctx, failing_chip, tmp_path):
    cands = R.candidates(ACC, ctx)
    by = {c.remedy: c for c in cands}
    assert _site_after(failing_chip, by["widen_accumulator"]).matmul.accumulator == "fp32"
    assert _site_after(failing_chip, by["raise_fidelity"]).matmul.fidelity == "hifi4"
    assert _site_after(failing_chip, by["promote_more_often"]).matmul.promotion_interval
    # split K: each split a whole number of the chip's MMA depth (Wormhole: 16), K / 4 rounded up
    interval = _site_after(failing_chip, by["split_k"]).matmul.promotion_interval
    assert interval == 384 and interval % 16 == 0
    ranked = PlaybookPlanner(Playbook(tmp_path / "pb.json")).rank(ACC, cands, RunInfo("c", "v", "llama", "m"))
    assert ranked[0].remedy == "widen_accumulator" and ranked[0].primary
    assert ranked.index(by["raise_fidelity"]) > max(ranked.index(c) for c in cands if c.primary)
    # scoped first for a local failure: the failing module kind in every layer
    assert ranked[0].rules[0].module == "layers.*.mlp.down_proj"


def test_a_remedy_kept_in_one_module_escalates_to_the_whole_model(ctx, tmp_path):
    """Kept for down_proj, proposed again for o_proj: the model-wide variant goes before o_proj's."""
    other = Accumulation(op="aten.mm.default", module="layers.2.self_attn.o_proj", reduction_len=576,
                         accumulator="bf16", growth=0.6)
    ctx.modules.append(other.module)
    planner, info = PlaybookPlanner(Playbook(tmp_path / "pb.json")), RunInfo("c", "v", "llama", "m")
    first = planner.rank(ACC, R.candidates(ACC, ctx), info)[0]
    assert first.remedy == "widen_accumulator" and first.rules[0].module == "layers.*.mlp.down_proj"
    cands = R.candidates(other, ctx)
    assert planner.rank(other, cands, info)[0].rules[0].module == "layers.*.self_attn.o_proj"  # nothing kept
    escalated = planner.rank(other, cands, info, kept=[first])[0]
    assert escalated.remedy == "widen_accumulator" and all(r.module is None for r in escalated.rules)
    # only the same change widens: an fp32 accumulator kept somewhere does not escalate another setting
    assert not widens(R.Candidate("widen_accumulator", (R.rule(op="aten.mm", matmul={"accumulator": "bf16"}),), "x"),
                      first)
    silu = R.Candidate("exact_transcendental", (R.rule(module="layers.*.mlp", op="aten.silu",
                                                       transcendental="exact"),), "exact silu in the MLP")
    exp = R.Candidate("exact_transcendental", (R.rule(op="aten.exp", transcendental="exact"),), "exact exp")
    assert not widens(exp, silu)
    assert widens(R.Candidate("exact_transcendental", (R.rule(op="aten.silu", transcendental="exact"),), "y"), silu)


def test_split_k_rounds_to_a_hopper_mma(failing_chip):
    t = EmulatedTarget(chip="h100-sxm")
    ctx = R.RemedyContext(numerics=t.numerics, site=t.site_numerics)
    sig = Accumulation(op="aten.mm.default", module=MODULE, reduction_len=576, accumulator="fp22", growth=0.5)
    (c,) = [c for c in R.candidates(sig, ctx) if c.remedy == "split_k"]
    assert c.rules[0].matmul.promotion_interval == 160  # 576 / 4 = 144 -> 5 x 32


def test_op_not_lowered_gets_decompose_or_host(ctx):
    sig = OpNotLowered(op="aten.cos.default", module="rotary", line="layers.py:1")
    cands = R.candidates(sig, ctx)
    assert {c.remedy for c in cands} >= {"host_fallback"} and all(c.primary for c in cands
                                                                  if c.remedy in ("host_fallback", "decompose"))
    host = next(c for c in cands if c.remedy == "host_fallback")
    assert host.rules[0].fallback == "host"


def test_matmul_op_class_widens_weights_and_their_cheaper_variants(ctx, failing_chip):
    sig = OpClassError(op_class="matmul", op="aten.mm.default", module=MODULE, rel_l2=0.05)
    cands = R.candidates(sig, ctx)
    ww = next(c for c in cands if c.remedy == "widen_weights")
    assert _site_after(failing_chip, ww).matmul.b_format == "bfp8_b"  # the chip's bfp4_b, one step wider
    cheaper = R.load_builtin()["raise_fidelity"].cheaper(next(c for c in cands if c.remedy == "raise_fidelity"), ctx)
    assert [c.rules[0].matmul.fidelity for c in cheaper] == ["hifi3", "hifi2", "lofi"]  # closest first


def test_unit_composition_can_upcast_and_tables_are_recomputed(ctx, failing_chip):
    sig = UnitComposition(unit="layers.2", module=MODULE, op="aten.mm.default")
    up = [c for c in R.candidates(sig, ctx) if c.remedy == "upcast_module"]
    assert [c.description for c in up] == ["upcast layers.*.mlp.down_proj", "upcast the whole model"]
    site = _site_after(failing_chip, up[0])
    assert site.activation == "fp32" and site.matmul.b_format == "bf16" and site.matmul.accumulator == "fp32"
    assert _site_after(failing_chip, up[0], module="layers.2.self_attn.o_proj").matmul.b_format == "bfp4_b"
    tables = R.candidates(TableMismatch(table="rotary:cos", op="aten.cos.default"), ctx)
    assert tables and all(c.remedy == "recompute_table" for c in tables if c.primary)


def test_per_tensor_fp8_gets_block_scales_first():
    """Hopper's per-tensor fp8: a matmul error is answered first by per-128 block scales (not by giving
    up fp8), and the performance phase may try coarser blocks."""
    t = EmulatedTarget(chip="h100-sxm")
    ctx = R.RemedyContext(numerics=t.numerics, site=t.site_numerics)
    sig = OpClassError(op_class="matmul", op="aten.mm.default", module="layers.0.self_attn.o_proj", rel_l2=0.05)
    cands = R.candidates(sig, ctx)
    fs = next(c for c in cands if c.remedy == "finer_scaling")
    site = EmulatedTarget(chip="h100-sxm", overrides=Overrides(rules=list(fs.rules))).site_numerics(
        "layers.0.self_attn.o_proj", "aten.mm")
    assert (site.matmul.a_scaling, site.matmul.b_scaling) == ("block:128", "block:128")
    assert site.matmul.a_format == "fp8_e4m3"  # still fp8
    assert R.load_builtin()["finer_scaling"].cheaper(fs, ctx)[0].rules[0].matmul.a_scaling == "block:512"
    from firstlight.bringup.planner import PlaybookPlanner, RunInfo
    from firstlight.bringup.playbook import Playbook

    ranked = PlaybookPlanner(Playbook("/nonexistent/pb.json")).rank(sig, cands, RunInfo("h100", "nvidia", "llama", "m"))
    assert ranked[0].remedy == "finer_scaling"


def test_cheaper_weight_formats_are_the_chips_own():
    """bf16 weights on an H100 get cheaper as fp8 (its ladder), never as Tenstorrent's block floats."""
    t = EmulatedTarget(chip="h100-sxm")
    ctx = R.RemedyContext(numerics=t.numerics, site=t.site_numerics)
    bf16 = R.Candidate("widen_weights", R.matmul_rules(None, None, "", b_format="bf16"), "weights in bf16 everywhere")
    formats = [c.rules[0].matmul.b_format for c in R.load_builtin()["widen_weights"].cheaper(bf16, ctx)]
    assert formats and "fp8_e4m3" in formats and not any(f.startswith("bfp") for f in formats)
