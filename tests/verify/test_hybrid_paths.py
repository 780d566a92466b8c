"""Serving paths of hybrid models (Gated DeltaNet, Mamba-2 layers): chunked prefill and decode carry each
row's recurrent state in a state slot; faults that only show there are caught on the path and localized."""

from __future__ import annotations

import pytest
import torch

from firstlight.targets.faulty import Fault, FaultyTarget
from firstlight.targets.registry import get_target
from firstlight.verify.harness import VerifyConfig, run_verify
from firstlight.verify.paths import RefSeq, serve_plan

CFG = VerifyConfig(new_tokens=8, ppl_tokens=0)
HYBRID = ["qwen3_next", "qwen3_5_moe", "granitemoehybrid", "nemotron_h"]


def _run(tiny_dirs, references, family, target, name="faulty"):
    return run_verify(tiny_dirs[family], target, name, config=CFG, reference=references(family))


def _main_pass_clean(res) -> bool:
    return all(b["isolated"]["ok"] for b in res.boundaries if "isolated" in b) and res.parity["ok"]


@pytest.mark.parametrize("family", HYBRID)
def test_eager_serves_hybrid_paths(tiny_dirs, references, family):
    """Chunked prefill of 3 rows of different lengths, then decode, through K/V pool and state slots:
    every step matches, and every row's final state matches HF's state after the same tokens."""
    res = _run(tiny_dirs, references, family, get_target("eager"), "eager")
    assert res.verdict == "match", res.reasons
    serve = res.paths["serve"]
    phases = [s["phase"] for s in serve["steps"]]
    assert phases.count("decode") == CFG.decode_steps and "prefill" in phases
    assert serve["ok"] and all(s["ok"] for s in serve["steps"]) and serve["kv_cache"]["ok"]
    state = serve["state"]
    assert state["ok"] and state["max_rel_l2"] < 1e-4  # against HF's cache, not only the target's own prefill
    # rows of different token counts run as separate forwards: no row holds padding tokens
    assert any(s["shape"][1] != CFG.chunk_size for s in serve["steps"] if s["phase"] == "prefill")


@pytest.mark.parametrize(("family", "fault", "module"), [
    pytest.param("granitemoehybrid", Fault("scale", op="aten.softplus", layer=1, value=1.2, phase="decode"),
                 "layers.1.mamba", id="mamba-step-granite"),
    pytest.param("qwen3_next", Fault("scale", op="aten.softplus", layer=2, value=1.2, phase="decode"),
                 "layers.2.linear_attn", id="deltanet-decay-qwen3_next"),
])
def test_decode_only_fault_in_a_recurrent_mixer_is_localized(tiny_dirs, references, family, fault, module):
    """The full-sequence pass never decodes: only the serve path's first decode step fails, and
    isolating that step's layers on HF's state before it names the mixer's op."""
    res = _run(tiny_dirs, references, family, FaultyTarget(torch.float32, faults=[fault]))
    assert res.verdict == "mismatch" and fault.hits > 0
    assert _main_pass_clean(res)
    serve = res.paths["serve"]
    k = serve["first_failing_step"]
    assert all(s["ok"] for s in serve["steps"] if s["phase"] == "prefill")
    assert serve["steps"][k]["phase"] == "decode" and k == min(s["step"] for s in serve["steps"] if s["phase"] == "decode")
    layer = int(module.split(".")[1])
    ff = res.first_failing
    assert (ff["path"], ff["step"], ff["phase"], ff["unit"]) == ("serve", k, "decode", f"layers.{layer}")
    units = serve["localization"]["units"]
    assert [u["unit"] for u in units][-1] == f"layers.{layer}" and all(u["ok"] for u in units[:-1])
    assert {"conv", "rec"} <= set(units[1])  # layer 0 is recurrent: judged on the states it writes too
    assert res.culprit["op"].startswith("aten.softplus") and res.culprit["module"] == module
    assert not serve["state"]["ok"] and serve["state"]["first_bad"]["layer"] == layer


@pytest.mark.parametrize(("family", "fault", "module", "part"), [
    pytest.param("granitemoehybrid", Fault("scale", op="aten.index_copy", module="layers.1.mamba", nth=0, value=1.5,
                                           phase="prefill"), "layers.1.mamba", "conv", id="conv-state-granite"),
    pytest.param("nemotron_h", Fault("scale", op="aten.index_copy", module="layers.2.mixer", nth=1, value=1.5,
                                     phase="prefill"), "layers.2.mixer", "rec", id="ssm-state-nemotron"),
])
def test_state_corrupted_between_chunks_is_caught(tiny_dirs, references, family, fault, module, part):
    """The state a prefill chunk writes into its slot (conv inputs, or the SSM state) is scaled: the
    first chunk of each row is right, the next chunk (which reads the carried state) is not."""
    res = _run(tiny_dirs, references, family, FaultyTarget(torch.float32, faults=[fault]))
    assert res.verdict == "mismatch" and fault.hits > 0
    assert _main_pass_clean(res)  # a full forward carries no state between passes
    serve = res.paths["serve"]
    steps = serve["steps"]
    k = serve["first_failing_step"]
    assert all(s["ok"] for s in steps if s["positions"][0] == 0)  # first chunks start from a zero state
    assert steps[k]["phase"] == "prefill" and steps[k]["positions"][0] > 0
    layer = int(module.split(".")[1])
    units = serve["localization"]["units"]
    assert units[-1]["unit"] == f"layers.{layer}" and not units[-1][part]["ok"]
    assert res.culprit["op"].startswith("aten.index_copy") and res.culprit["module"] == module
    assert not serve["state"]["ok"] and not serve["state"]["first_bad"]["vs_reference_ok"]


def test_uniform_rows_plan_has_no_padded_row():
    """A recurrent mixer cannot skip padding tokens: with `uniform_rows` every row of a step feeds all
    of its tokens or none (a padding row, on the scratch state slot), as the engine groups rows."""
    refs = [RefSeq(list(range(10)), {}, {}), RefSeq(list(range(5)), {}, {})]
    layout, steps = serve_plan(refs, [0, 1], [10, 5], num_decode=2, chunk=3, block_size=4, uniform_rows=True)
    assert [s.positions.tolist() for s in steps] == [
        [[0, 1, 2], [0, 1, 2]], [[3, 4, 5], [-1, -1, -1]], [[6, 7], [-1, -1]], [[8], [3]], [[9], [4]]]
    assert [s.state_slots.tolist() for s in steps] == [[0, 1], [0, 2], [0, 2], [0, 1], [0, 1]]
    assert layout.state_scratch == 2 and layout.num_state_slots == 3
    assert [s.filled_before for s in steps] == [[0, 0], [3, 3], [6, 3], [8, 3], [9, 4]]


@pytest.mark.slow
def test_inductor_serves_a_hybrid_model(tiny_dirs, references):
    """Step units with state pools as explicit inputs and outputs compile whole (~10 min on a busy 2-core CPU)."""
    res = _run(tiny_dirs, references, "granitemoehybrid", get_target("inductor"), "inductor")
    assert res.verdict == "match", res.reasons
    serve = res.paths["serve"]
    assert serve["ok"] and serve["state"]["ok"] and serve["state"]["max_rel_l2"] < 1e-4
    note = next(n for n in res.target_report["notes"] if "compiled by Inductor" in n)
    num_graphs, num_units = int(note.split()[0]), int(note.split(" for ")[1].split()[0])
    assert num_graphs >= num_units  # every unit went through Inductor, none fell back to eager
