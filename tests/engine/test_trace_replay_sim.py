"""A fresh engine trace replays in the simulator: its requests are the workload, its steps the calibration."""

from __future__ import annotations

import numpy as np

from firstlight.core.trace import Trace
from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.request import SamplingParams


def record(model, tok, path, lengths: list[tuple[int, int]], concurrency: int) -> Trace:
    """Closed loop: keep `concurrency` requests in flight; random-id prompts, exact output lengths."""
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=256, max_num_seqs=8,
                                                max_num_batched_tokens=128, trace_path=path))
    rng = np.random.default_rng(0)
    nxt = 0
    while nxt < len(lengths) or engine.has_unfinished():
        while nxt < len(lengths) and len(engine.scheduler.requests) < concurrency:
            p, o = lengths[nxt]
            engine.add_request(rng.integers(3, 300, p).tolist(),
                               SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
            nxt += 1
        engine.step()
    engine.close()
    return Trace.load(path)


def test_fresh_trace_replays_within_calibration_error(tiny, tiny_ckpt, tmp_path) -> None:
    from firstlight.core.hardware import load_spec
    from firstlight.sim.calibrate import calibrate, replay
    from firstlight.sim.model import load_model as load_desc
    from firstlight.sim.trace_replay import on_cpu_clock, replay_serve, trace_workload

    model, tok = tiny
    lengths = [(12 + 7 * i % 40, 3 + 5 * i % 17) for i in range(16)]
    fit = record(model, tok, tmp_path / "fit.jsonl", lengths, concurrency=4)
    held = record(model, tok, tmp_path / "held.jsonl", [(60, 4)] * 6, concurrency=2)

    # the trace is a workload: every request, with the lengths the engine was given
    tw = trace_workload(fit)
    assert not tw.inferred and tw.num_skipped == 0
    assert sorted(zip(tw.workload.num_prompt_tokens.tolist(), tw.workload.num_output_tokens.tolist(),
                      strict=True)) == sorted(lengths)
    assert tw.engine == {"block_size": 4, "max_num_seqs": 8, "max_num_batched_tokens": 128,
                         "kv_capacity_tokens": 1024, "runner": "grouped"}
    assert all(s.cpu_s and s.cpu_s["execute"] > 0 for s in fit.steps)

    desc = load_desc(tiny_ckpt)
    cal = calibrate(fit, desc, load_spec("cpu-host"), holdout=[held], latency=True, clock="cpu")
    spec = load_spec("cpu-host").model_validate(cal["spec"])
    err = cal["in_sample"]["step"]
    # replaying the recorded Batches with the calibrated spec reproduces their step times to the
    # calibration's own error (same steps, same clock): the fit is what the replay uses
    rep = replay(on_cpu_clock(fit), desc, spec)
    assert abs(rep["vs_total"]["total_pred_s"] - err["total_pred_s"]) <= 0.05 * err["total_pred_s"]
    # simulating the trace's workload: the simulated steps' median sits within twice the calibration's p90
    # error (the simulator forms its own batches, and CPU step times on a shared machine wander: the
    # fit's own p90 measures that noise, so the bound scales with it; a broken replay is off by far more)
    sim = replay_serve(on_cpu_clock(fit), desc, spec)["vs_measured"]["step"]
    assert abs(sim["predicted_median_s"] / sim["measured_median_s"] - 1) * 100 <= max(2 * err["p90_abs_pct"], 35.0)
    print(f"\nin-sample step median |err| {err['median_abs_pct']:.1f}%, held-out "
          f"{cal['held_out']['step']['median_abs_pct']:.1f}%; held-out e2e per-request median |err| "
          f"{cal['held_out']['latency']['all']['e2e']['median_abs_pct']:.1f}%")
