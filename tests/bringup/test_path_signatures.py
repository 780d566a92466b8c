"""Signatures of serving-path and long-range failures, from real verify runs with planted faults."""

from __future__ import annotations

import pytest

from firstlight.bringup import remedies as R
from firstlight.bringup.planner import PlaybookPlanner, RunInfo
from firstlight.bringup.playbook import Playbook
from firstlight.bringup.signatures import DecodeOnly, PositionDivergence, QualityOnly, TableMismatch, classify
from firstlight.targets.emulated import EmulatedTarget
from firstlight.targets.faulty import Fault, FaultyTarget
from firstlight.verify.harness import VerifyConfig, load_reference, run_verify


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    path = tiny_checkpoint("llama", seed=3)
    return path, load_reference(path)


def _verify(llama, fault, cfg=VerifyConfig(new_tokens=8, ppl_tokens=0), **kw):
    path, ref = llama
    return run_verify(path, FaultyTarget(faults=[fault]), "faulty", config=cfg, reference=ref, **kw).to_dict()


def test_a_decode_only_fault_is_a_decode_only_signature(llama):
    res = _verify(llama, Fault("scale", op="aten.silu", layer=2, value=1.2, phase="decode"))
    sig = classify(res)
    assert isinstance(sig, DecodeOnly), sig
    assert (sig.path, sig.phase, sig.unit, sig.module) == ("serve", "decode", "layers.2", "layers.2.mlp")
    assert sig.op.startswith("aten.silu") and sig.key() == "decode_only:transcendental"
    assert sig.step == res["paths"]["serve"]["first_failing_step"]


def test_a_table_a_serving_step_builds_is_a_table_mismatch(llama):
    sig = classify(_verify(llama, Fault("table", table="mask")))
    assert isinstance(sig, TableMismatch) and sig.table.startswith("tables.mask.")


def test_a_late_position_fault_is_a_position_divergence(llama):
    from firstlight.data import load_text
    from firstlight.models.loader import load_tokenizer

    ids = load_tokenizer(llama[0])(load_text("hamlet-sample")[:4000])["input_ids"]
    cfg = VerifyConfig(new_tokens=8, ppl_tokens=160, ppl_window=96, ppl_stride=32)
    res = _verify(llama, Fault("scale", op="aten.silu", layer=1, value=1.3, from_row=60), cfg, ppl_ids=ids)
    assert classify(res) == PositionDivergence(position=60, unit="layers.1")


def _path_result(own_ok: bool, kv_bad: dict | None = None, first_failing: dict | None = None):
    step = {"step": 1, "phase": "prefill", "ok": False, "vs_full_forward": {"ok": own_ok, "rel_l2": 0.0}}
    rec = {"ok": False, "first_failing_step": None if kv_bad else 1, "steps": [{"ok": True}, step],
           "kv_cache": {"ok": kv_bad is None, "first_bad": kv_bad}}
    return {"verdict": "mismatch", "reasons": ["serve path: step 1 (prefill, positions [0, 19]) fails"],
            "boundaries": [], "first_failing": first_failing, "culprit": None, "ops": [], "paths": {"serve": rec},
            "parity": {"top1_agreement": 1.0, "mean_kl": 0.005}}


def test_a_path_step_that_agrees_with_the_targets_own_forward_is_the_models_numerics():
    """Gemma 3 on Wormhole, upcast: the serve path's step equals the target's own full forward of its
    row, which misses the reference on that row. Not a path bug: a quality signature."""
    sig = classify(_path_result(True, first_failing={"unit": None, "path": "serve", "step": 1}))
    assert isinstance(sig, QualityOnly) and sig.key() == "quality_only:kl" and sig.reasons[0].startswith("serve path")
    sig = classify(_path_result(False, first_failing={"unit": None, "path": "serve", "step": 1}))
    assert sig == DecodeOnly(path="serve", step=1, phase="prefill") and sig.key() == "decode_only:cache"


def test_only_the_cached_kv_differing_aims_remedies_at_the_attention(tmp_path):
    sig = classify(_path_result(True, kv_bad={"layer": 4, "part": "v"}))
    assert sig == DecodeOnly(path="serve", phase="cache", unit="layers.4") and sig.key() == "decode_only:cache"
    t = EmulatedTarget(chip="trn2")
    ctx = R.RemedyContext(numerics=t.numerics, site=t.site_numerics,
                          modules=["layers.0", "layers.0.self_attn", "layers.0.mlp"])
    ranked = PlaybookPlanner(Playbook(tmp_path / "pb.json")).rank(sig, R.candidates(sig, ctx), RunInfo("trn2", "aws", "llama", "m"))
    assert ranked[0].description == "keep layers.*.self_attn in fp32"  # the direct answer: the cache's writer
    assert {"upcast layers.*.self_attn", "upcast the whole model"} <= {c.description for c in ranked}
