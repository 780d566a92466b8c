"""The bring-up loop on tiny models and an emulated chip whose defaults fail."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from firstlight.bringup import remedies as R
from firstlight.bringup import runbook
from firstlight.bringup.goal import parse_goal
from firstlight.bringup.loop import BringupConfig, BringupLoop, BringupState
from firstlight.bringup.playbook import Playbook
from firstlight.cli import app
from firstlight.verify.harness import VerifyConfig

GOAL = "kl<=2e-3,top1>=0.95"


def _loop(model: Path, chip: Path, out: Path, playbook: Path, budget: int = 12, perf_budget: int = 0,
          on_iteration=None) -> BringupLoop:
    cfg = BringupConfig(model_path=model, chip=str(chip), goal=parse_goal(GOAL), budget=budget,
                        perf_budget=perf_budget, out=out, prompt_ids=list(range(3, 35)),
                        verify=VerifyConfig(new_tokens=4, ppl_tokens=0))
    return BringupLoop(cfg, Playbook(playbook), on_iteration=on_iteration or (lambda s: runbook.write(out, s, str(model))))


def test_loop_reaches_the_goal_and_writes_a_runbook(tiny_checkpoint, failing_chip, tmp_path):
    model = tiny_checkpoint("llama", seed=3)
    loop = _loop(model, failing_chip, tmp_path / "out", tmp_path / "pb.json", perf_budget=3)
    state = loop.run()
    assert state.final["met"], state.iterations[-1]
    # the compiler lacks cos and sin: the rotary tables are built on the host (one remedy for both)
    assert state.kept[0]["remedy"] == "host_fallback"
    assert state.kept[0]["rules"][0] == {"module": "rotary", "fallback": "host", "why": state.kept[0]["rules"][0]["why"]}
    assert state.iterations[0]["after"]["error"].startswith("chip")
    assert state.iterations[1]["signature"]["kind"] == "op_not_lowered"
    assert state.iterations[1]["signature"]["module"] == "rotary"
    book = (tmp_path / "out" / "RUNBOOK.md").read_text()
    assert "## Iterations" in book and "firstlight verify --model" in book and "--overrides" in book
    ov = yaml.safe_load((tmp_path / "out" / "overrides.yaml").read_text())
    assert {"module": "rotary", "fallback": "host"}.items() <= ov["rules"][0].items()
    entries = json.loads((tmp_path / "pb.json").read_text())["entries"]
    assert {e["outcome"] for e in entries} & {"fixed", "moved"}
    # the final configuration verifies on its own
    from firstlight.targets.registry import get_target
    from firstlight.verify.harness import run_verify

    t = get_target(f"emulate:{failing_chip},overrides={tmp_path / 'out' / 'overrides.yaml'}")
    r = run_verify(model, t, "x", prompt_ids=list(range(3, 35)), config=VerifyConfig(new_tokens=4, ppl_tokens=0))
    assert parse_goal(GOAL).unmet(r.to_dict()) == []


def test_playbook_makes_the_second_family_cheaper(tiny_checkpoint, failing_chip, tmp_path):
    first = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "a", tmp_path / "pb.json").run()
    assert first.final["met"]
    learned = _loop(tiny_checkpoint("qwen3", seed=3), failing_chip, tmp_path / "b", tmp_path / "pb.json").run()
    fresh = _loop(tiny_checkpoint("qwen3", seed=3), failing_chip, tmp_path / "c", tmp_path / "empty.json").run()
    assert learned.final["met"] and fresh.final["met"]
    assert learned.final["verify_runs"] < fresh.final["verify_runs"]


def test_a_second_bringup_on_the_chip_starts_from_the_passing_configuration(tiny_checkpoint, failing_chip,
                                                                           tmp_path):
    pb = tmp_path / "pb.json"
    first = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "a", pb).run()
    assert first.final["met"] and first.prior == {"model": None}
    configs = json.loads(pb.read_text())["configs"]
    assert len(configs) == 1 and [c["description"] for c in configs[0]["kept"]] == \
        [c["description"] for c in first.kept]
    again = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "b", pb).run()
    # baseline, then every remedy of the first run at once: the goal holds in the second verify run
    assert again.iterations[1]["phase"] == "correctness (prior)" and again.iterations[1]["outcome"] == "fixed"
    assert again.final["met"] and again.final["verify_runs"] == 2 < first.final["verify_runs"]
    assert again.prior["outcome"] == "fixed" and again.kept == first.kept
    assert "correctness (prior)" in (tmp_path / "b" / "RUNBOOK.md").read_text()
    # a configuration is offered on its own chip only
    assert Playbook(pb).prior_config("h100-sxm", "llama") is None


def test_a_playbook_with_malformed_configurations_is_set_aside(tmp_path):
    pb = tmp_path / "pb.json"
    pb.write_text(json.dumps({"version": 1, "entries": [], "configs": [{"chip": "x"}]}))
    with pytest.warns(UserWarning, match="unreadable"):
        book = Playbook(pb)
    assert book.configs == [] and list(tmp_path.glob("pb.json.corrupt-*"))


def test_the_performance_phase_keeps_what_the_chip_cannot_compile_without(tiny_checkpoint, failing_chip, tmp_path):
    state = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "out", tmp_path / "pb.json",
                  perf_budget=20).run()
    assert state.final["met"] and state.kept[0]["description"] == "run rotary on the host"
    perf = [it for it in state.iterations if it["phase"] == "performance"]
    assert perf and all(it["remedy"]["description"] != "run rotary on the host" for it in perf)
    assert {"description": "run rotary on the host", "change": "remove",
            "why": "kept for an op the chip does not lower"}.items() <= next(
        s for s in state.skipped if s["description"] == "run rotary on the host").items()


def test_a_remedy_that_makes_things_worse_is_reverted(tiny_checkpoint, failing_chip, tmp_path, monkeypatch):
    monkeypatch.setattr(R, "REGISTRY", dict(R.load_builtin()))
    bad = tmp_path / "bad_remedy.py"
    bad.write_text(
        "from firstlight.bringup.remedies import Candidate, Remedy, register, rule\n"
        "def propose(sig, ctx):\n"
        "    return [Candidate('bfp2_everything', (rule(matmul={'b_format': 'bfp2_b'}),), 'bfp2 weights', cost_rank=-1)]\n"
        "register(Remedy('bfp2_everything', ('op_class', 'accumulation'), propose, cost='none',"
        "                primary=('op_class', 'accumulation')))\n")
    assert R.load_file(bad) == ["bfp2_everything"]
    state = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "out", tmp_path / "pb.json",
                  budget=5).run()
    tried = [it for it in state.iterations if (it.get("remedy") or {}).get("remedy") == "bfp2_everything"]
    assert tried and tried[0]["outcome"] == "worse"
    assert "bfp2_everything" not in [c["remedy"] for c in state.kept]


def test_interrupted_bringup_leaves_a_readable_runbook_and_resumes(tiny_checkpoint, failing_chip, tmp_path):
    out, pb = tmp_path / "out", tmp_path / "pb.json"
    model = tiny_checkpoint("llama", seed=3)

    def stop_after_three(state: BringupState) -> None:
        runbook.write(out, state, str(model))
        if len(state.iterations) == 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _loop(model, failing_chip, out, pb, on_iteration=stop_after_three).run()
    assert "## Iterations" in (out / "RUNBOOK.md").read_text()
    assert len(json.loads((out / "state.json").read_text())["iterations"]) == 3
    assert json.loads(pb.read_text())["entries"]  # the playbook is whole
    state = _loop(model, failing_chip, out, pb).run()
    assert state.final["met"] and len(state.iterations) > 3
    assert state.iterations[3]["phase"] == "resume"


@pytest.mark.parametrize("args, match", [
    (["--target", "eager"], "only emulated chips"),
    (["--target", "emulate:nope"], "unknown hardware 'nope'"),
    (["--goal", "ppl<<1"], "cannot parse"),
    (["--budget", "0"], "at least 1"),
])
def test_bad_input_exits_2_and_writes_nothing(tmp_path, tiny_dirs_bringup, args, match):
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bringup", "--model", str(tiny_dirs_bringup), "--out", str(out), *args])
    assert res.exit_code == 2, res.output
    assert match in res.output and not out.exists()


def test_unwritable_out_exits_2(tmp_path, tiny_dirs_bringup):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = CliRunner().invoke(app, ["bringup", "--model", str(tiny_dirs_bringup), "--out", str(blocker / "sub")])
    assert res.exit_code == 2 and "not writable" in res.output or "cannot write" in res.output


@pytest.fixture
def tiny_dirs_bringup(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", seed=3)


def test_performance_phase_prices_a_candidate_before_running_it(tiny_checkpoint, failing_chip, tmp_path):
    """A cheaper variant that a later rule overrides is priced no faster and costs no verify run."""
    loop = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "out", tmp_path / "pb.json")
    host = R.Candidate("host_fallback", (R.rule(module="rotary", fallback="host"),), "rotary on the host")
    hifi4, lofi = (R.Candidate("raise_fidelity", (R.rule(matmul={"fidelity": f}),), f) for f in ("hifi4", "lofi"))
    current = loop.evaluate([host, hifi4])
    assert current.result is not None and current.cost_ms is not None
    assert loop.price([host, hifi4], current) == pytest.approx(current.cost_ms)
    assert loop.price([host, lofi], current) < current.cost_ms  # LoFi: one pass instead of four
    assert loop.price([host, lofi, hifi4], current) == pytest.approx(current.cost_ms)  # hifi4 wins
    assert loop.price([hifi4], current) is None  # no host rotary: the trace changes, it must run
    # kept [host, hifi4, lofi]: lofi is in force, so removing it (hifi4 again) and removing or cheapening
    # hifi4 (overridden by lofi) are all priced no faster and skipped; only removing the host rotary runs
    current = loop.evaluate([host, hifi4, lofi])
    runs, loop.cfg.perf_budget = loop.runs, 3
    loop._performance([host, hifi4, lofi], current)
    skipped = {(s["change"], s["description"]) for s in loop.state.skipped}
    assert {("remove", "lofi"), ("remove", "hifi4")} <= skipped
    assert loop.runs == runs + 1 and loop.state.iterations[-1]["remedy"]["description"] == "rotary on the host"


def test_a_candidate_the_chip_cannot_run_is_an_error_not_a_crash(tiny_checkpoint, failing_chip, tmp_path):
    """An override the chip's numerics reject (a promotion interval that is not a whole number of MMAs)
    fails its verify run: the loop records `error`, reverts it and goes on."""
    loop = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "out", tmp_path / "pb.json")
    host = R.Candidate("host_fallback", (R.rule(module="rotary", fallback="host"),), "rotary on the host")
    bad = R.Candidate("split_k", (R.rule(matmul={"promotion_interval": 24}),), "K in 24s (mma_k is 16)")
    before = loop.evaluate([host])
    after = loop.evaluate([host, bad])
    assert after.result is None and "promotion_interval 24" in (after.error or "")
    from firstlight.bringup.loop import judge

    assert judge(before, after) == "error"


def test_a_finished_run_keeps_its_target_but_not_its_prepared_weights(tiny_checkpoint, failing_chip, tmp_path):
    """The loop holds a few Evaluations at a time; their prepared weights (fidelity parts, rounded copies)
    are dropped after each run so memory stays at a few model copies (Gemma 3 at HiFi4 ran out of 24 GB)."""
    loop = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "out", tmp_path / "pb.json")
    host = R.Candidate("host_fallback", (R.rule(module="rotary", fallback="host"),), "rotary on the host")
    ev = loop.evaluate([host])
    assert ev.result is not None and not ev.target._weights._cache and not ev.target._weights._rounded
    assert ev.target._weights._pinned  # a later forward on this target prepares them again
    assert loop.price([host], ev) == pytest.approx(ev.cost_ms)  # pricing needs no prepared weights


def test_a_candidate_that_changes_no_site_is_not_run(tiny_checkpoint, failing_chip, tmp_path):
    """Once the whole model is upcast, bf16 weights everywhere changes no op's numerics: skipped, no run."""
    loop = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "out", tmp_path / "pb.json")
    host = R.Candidate("host_fallback", (R.rule(module="rotary", fallback="host"),), "rotary on the host")
    up = R.Candidate("upcast_module", (R.rule(activation="fp32"), *R.matmul_rules(
        None, None, "", a_format="bf16", b_format="bf16", accumulator="fp32", fidelity="hifi4")), "upcast the whole model")
    weights = R.Candidate("widen_weights", R.matmul_rules(None, None, "", b_format="bf16"), "weights in bf16 everywhere")
    exact = R.Candidate("exact_transcendental", (R.rule(op="aten.exp", transcendental="exact"),), "exact exp")
    before = loop.evaluate([host])
    assert loop.changes_numerics(weights, before)  # bfp4 weights before the upcast
    current = loop.evaluate([host, up])
    assert not loop.changes_numerics(weights, current) and loop.changes_numerics(exact, current)


def test_a_reverted_candidate_is_retried_once_after_more_remedies_are_kept(tiny_checkpoint, failing_chip, tmp_path):
    loop = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "out", tmp_path / "pb.json")
    host = R.Candidate("host_fallback", (R.rule(module="rotary", fallback="host"),), "rotary on the host")
    hifi4 = R.Candidate("raise_fidelity", (R.rule(matmul={"fidelity": "hifi4"}),), "hifi4")
    exact = R.Candidate("exact_transcendental", (R.rule(op="aten.exp", transcendental="exact"),), "exact exp")
    current = loop.evaluate([host, hifi4])
    loop.state.reverted = [{"candidate": exact.to_dict(), "kept": 2, "retried": False}]
    assert loop._retry([host, hifi4], current) == []  # nothing kept since it was reverted
    loop.state.reverted[0]["kept"] = 1
    assert [c.key for c in loop._retry([host, hifi4], current)] == [exact.key]
    assert loop._retry([host, hifi4], current) == []  # once


def test_a_passing_configuration_credits_what_it_needs(tiny_checkpoint, failing_chip, tmp_path):
    """Kept remedies that a later one overrides entirely (an fp32 accumulator under a whole-model upcast)
    are `superseded` in the playbook, the others `essential`; the next bring-up ranks the essential first."""
    loop = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "out", tmp_path / "pb.json")
    host = R.Candidate("host_fallback", (R.rule(module="rotary", fallback="host"),), "rotary on the host")
    acc = R.Candidate("widen_accumulator", (R.rule(op="aten.mm", matmul={"accumulator": "fp32"}),),
                      "fp32 accumulator in aten.mm")  # the upcast's aten.mm rule sets it too (not bmm's)
    up = R.Candidate("upcast_module", (R.rule(activation="fp32"), *R.matmul_rules(
        None, None, "", a_format="bf16", b_format="bf16", accumulator="fp32", fidelity="hifi4")), "upcast the whole model")
    sig = {"kind": "unit_composition", "key": "unit_composition:layers"}
    loop.state.iterations = [{"remedy": c.to_dict(), "signature": sig, "outcome": "improved"} for c in (host, acc, up)]
    loop._credit([host, acc, up], loop.evaluate([host, acc, up]))
    assert {c["description"]: c["credit"] for c in loop.state.credit} == {
        "rotary on the host": "essential", "fp32 accumulator in aten.mm": "superseded",
        "upcast the whole model": "essential"}
    book = Playbook(tmp_path / "pb.json")
    info = ("wormhole-n300", "Tenstorrent", "llama")
    assert book.score("upcast_module", sig["key"], sig["kind"], *info) > book.score("widen_accumulator", sig["key"],
                                                                                    sig["kind"], *info)


def test_an_accumulator_widened_to_no_effect_refutes_accumulation(tiny_checkpoint, failing_chip, tmp_path):
    from firstlight.bringup.signatures import Accumulation, OpClassError

    loop = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "out", tmp_path / "pb.json")
    sig = Accumulation(op="aten.mm.default", module="layers.0.self_attn.o_proj", reduction_len=576, accumulator="fp22")
    assert loop._refuted(sig) == sig
    wide = R.Candidate("widen_accumulator", (R.rule(matmul={"accumulator": "fp32"}),), "fp32 accumulator everywhere")
    loop.state.reverted.append({"candidate": wide.to_dict(), "kept": 0, "retried": False, "outcome": "no_effect",
                                "signature": sig.describe(), "key": sig.key()})
    assert loop._refuted(sig) == OpClassError(op_class="matmul", op=sig.op, module=sig.module)
    later = Accumulation(op="aten.mm.default", module="layers.1.mlp.down_proj", reduction_len=1536,
                         accumulator="fp22", growth=0.4)  # another run's evidence, the same narrow accumulator
    assert loop._refuted(later).kind == "op_class"


def test_the_performance_phase_walks_down_until_a_variant_fails(tiny_checkpoint, failing_chip, tmp_path, monkeypatch):
    """HiFi4 kept; the goal holds down to HiFi3: removing it fails, HiFi3 is kept, HiFi2 fails, and
    LoFi (less accurate still) is not run."""
    from firstlight.bringup.loop import Evaluation

    loop = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "out", tmp_path / "pb.json", perf_budget=3)
    host = R.Candidate("host_fallback", (R.rule(module="rotary", fallback="host"),), "rotary on the host")
    kept = [host, R.Candidate("raise_fidelity", (R.rule(matmul={"fidelity": "hifi4"}),), "math fidelity hifi4 everywhere")]
    current = loop.evaluate(kept)
    cost = {"hifi4": 4.0, "hifi3": 3.0, "hifi2": 2.0, "lofi": 1.0, None: 0.5}
    ran = []

    def fake(cands):
        fid = next((c.rules[0].matmul.fidelity for c in cands if c.remedy == "raise_fidelity"), None)
        ran.append(fid)
        return Evaluation(current.result, None, None, [] if fid in ("hifi4", "hifi3") else ["x"], cost[fid],
                          current.target)

    monkeypatch.setattr(loop, "evaluate", fake)
    monkeypatch.setattr(loop, "price", lambda k, c: None)
    current.cost_ms, current.unmet = cost["hifi4"], []
    out = loop._performance(kept, current)
    assert ran == [None, "hifi3", "hifi2"] and out.cost_ms == 3.0
    assert kept[1].rules[0].matmul.fidelity == "hifi3"


def test_a_cheaper_variant_that_is_the_chips_default_is_not_run(tiny_checkpoint, failing_chip, tmp_path, monkeypatch):
    """bf16 weights kept on a bfp4 chip: bfp8 passes; bfp4 is what removing the remedy gives (tried
    already), so it is skipped; bfp2 fails and ends the walk."""
    from firstlight.bringup.loop import Evaluation

    loop = _loop(tiny_checkpoint("llama", seed=3), failing_chip, tmp_path / "out", tmp_path / "pb.json", perf_budget=8)
    host = R.Candidate("host_fallback", (R.rule(module="rotary", fallback="host"),), "rotary on the host")
    bf16 = R.Candidate("widen_weights", R.matmul_rules(None, None, "", b_format="bf16", b_scaling=None),
                       "weights in bf16 everywhere")
    kept = [host, bf16]
    current = loop.evaluate(kept)
    ran = []

    def fake(cands):
        fmt = next((c.rules[0].matmul.b_format for c in cands if c.remedy == "widen_weights"), "bfp4_b")
        ran.append(fmt)
        cost = {"bf16": 4.0, "bfp8_b": 3.0, "bfp4_b": 2.0, "bfp2_b": 1.0}[fmt]
        return Evaluation(current.result, None, None, [] if fmt in ("bf16", "bfp8_b") else ["x"], cost, current.target)

    monkeypatch.setattr(loop, "evaluate", fake)
    monkeypatch.setattr(loop, "price", lambda k, c: None)
    current.cost_ms, current.unmet = 4.0, []
    loop._performance(kept, current)
    assert ran[:3] == ["bfp4_b", "bfp8_b", "bfp2_b"]  # remove (= bfp4), bfp8 kept, bfp4 skipped, bfp2 fails
    assert any(s.get("why") == "the same numerics as without it" for s in loop.state.skipped)
