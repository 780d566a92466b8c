import json

import pytest
from typer.testing import CliRunner

from firstlight.core.hardware import EfficiencySpec, load_spec, load_spec_file
from firstlight.sim.calibrate import CalibrationError, calibrate, load_trace_steps, replay, synthetic_trace
from firstlight.sim.cli import app
from firstlight.sim.model import load_model, model_from_config

TINY_CFG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4000, "torch_dtype": "float32"}
# cpu-host's form: compute and memory time add; a one-row product streams weights at its own rate
TRUE = EfficiencySpec(compute=0.42, memory=0.35, network=0.5, kernel_overhead_us=20, step_overhead_us=700,
                      collective_overhead_us=20, overlap="additive", gemv_memory=0.55)


@pytest.fixture(scope="module")
def tiny():
    return model_from_config(TINY_CFG, name="tiny")


def test_calibration_recovers_known_efficiencies(tiny):
    hw = load_spec("cpu-host")  # its shipped efficiency (0.5 / 0.6 / 0.6 / 1000 us) is the wrong starting point
    assert hw.efficiency.overlap == "additive"
    trace = synthetic_trace(tiny, hw, TRUE, num_steps=200, seed=1, noise=0.01, single_decode_fraction=0.25)
    r = calibrate(trace, tiny, hw)
    assert r["fit"]["compute"] == pytest.approx(TRUE.compute, rel=0.03)
    assert r["fit"]["memory"] == pytest.approx(TRUE.memory, rel=0.03)
    assert r["fit"]["gemv_memory"] == pytest.approx(TRUE.gemv_memory, rel=0.05)
    assert r["spec"]["efficiency"]["overlap"] == "additive"
    assert r["fit"]["step_overhead_us"] == pytest.approx(TRUE.step_overhead_us, rel=0.05)
    assert r["after"]["median_abs_pct"] < 1.5 < r["before"]["median_abs_pct"]
    assert r["after"]["p90_abs_pct"] < r["before"]["p90_abs_pct"]
    # host time (schedule + sample = 300 us per synthetic step) is added for the serving simulator
    assert r["efficiency"]["step_overhead_us"] == pytest.approx(r["fit"]["step_overhead_us"] + 300, rel=1e-6)


def test_additive_trace_is_not_fit_by_the_max_form(tiny):
    """The form matters: the same additive trace fitted with the roofline's max leaves a clear error."""
    hw = load_spec("cpu-host")
    trace = synthetic_trace(tiny, hw, TRUE, num_steps=200, seed=1, single_decode_fraction=0.25)
    r_add = calibrate(trace, tiny, hw)
    as_max = hw.model_copy(update={"efficiency": hw.efficiency.model_copy(update={"overlap": "max"})})
    r_max = calibrate(trace, tiny, as_max)
    assert r_add["after"]["median_abs_pct"] < 0.1 < 1.0 < r_max["after"]["median_abs_pct"]


def test_max_form_still_recovered_on_a_gpu_spec():
    """GPU specs keep the roofline (max) and one memory efficiency: a max-form trace is recovered."""
    hw = load_spec("h100")
    model = load_model("llama-3.1-8b")  # big enough that an H100 step is not all overhead
    assert hw.efficiency.overlap == "max" and hw.efficiency.gemv_memory is None
    true = EfficiencySpec(compute=0.55, memory=0.7, network=0.8, kernel_overhead_us=6, step_overhead_us=900)
    r = calibrate(synthetic_trace(model, hw, true, num_steps=200, seed=4, noise=0.01, single_decode_fraction=0.25),
                  model, hw)
    assert r["fit"]["compute"] == pytest.approx(true.compute, rel=0.03)
    assert r["fit"]["memory"] == pytest.approx(true.memory, rel=0.03)
    assert "gemv_memory" not in r["fit"] and r["spec"]["efficiency"]["gemv_memory"] is None
    assert r["spec"]["efficiency"]["overlap"] == "max"


def test_noise_free_fit_is_exact(tiny):
    hw = load_spec("cpu-host")
    r = calibrate(synthetic_trace(tiny, hw, TRUE, num_steps=60, seed=2), tiny, hw)
    for k in ("compute", "memory", "step_overhead_us"):
        assert r["fit"][k] == pytest.approx(getattr(TRUE, k), rel=1e-4)


def test_cli_calibrate_writes_valid_spec_and_replay_agrees(tiny, tmp_path):
    hw = load_spec("cpu-host")
    trace_path = tmp_path / "trace.jsonl"
    synthetic_trace(tiny, hw, TRUE, num_steps=80, seed=3, noise=0.01).save(trace_path)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_CFG))
    out = tmp_path / "cal.yaml"
    runner = CliRunner()
    r = runner.invoke(app, ["calibrate", "--trace", str(trace_path), "--hw", "cpu-host", "--model", str(cfg),
                            "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "median" in r.output and "p90" in r.output
    spec = load_spec_file(out)
    assert spec.efficiency.compute == pytest.approx(TRUE.compute, rel=0.03)
    assert "calibrated" in spec.sources["efficiency"]
    # replaying with the calibrated spec: small error; with the shipped one: large
    trace = load_trace_steps(trace_path)
    spec_exec = spec.model_copy(update={"efficiency": spec.efficiency.model_copy(
        update={"step_overhead_us": spec.efficiency.step_overhead_us - 300})})
    assert replay(trace, tiny, spec_exec)["vs_execute"]["median_abs_pct"] < 2.0
    assert replay(trace, tiny, hw)["vs_execute"]["median_abs_pct"] > 5.0
    r = runner.invoke(app, ["replay", "--trace", str(trace_path), "--hw", str(out), "--model", str(cfg)])
    assert r.exit_code == 0, r.output
    assert "predicted" in r.output


def test_bad_trace_is_a_clear_error(tmp_path, tiny):
    with pytest.raises(CalibrationError, match="does not exist"):
        load_trace_steps(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"trace_meta": {}}\n{"batch": 3}\n')
    with pytest.raises(CalibrationError, match="not a firstlight trace"):
        load_trace_steps(bad)
    empty = tmp_path / "empty.jsonl"
    empty.write_text('{"trace_meta": {}}\n')
    with pytest.raises(CalibrationError, match="no steps"):
        load_trace_steps(empty)
