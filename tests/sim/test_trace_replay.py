"""Engine traces as workloads: request lines, gzip, the CPU clock, replay through the serving simulator."""

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from firstlight.core.batch import Batch, ScheduledSeq
from firstlight.core.hardware import load_spec
from firstlight.core.trace import RequestRecord, StepRecord, Trace, TraceFormatError, infer_requests
from firstlight.errors import FirstlightError
from firstlight.sim.cli import app
from firstlight.sim.cost import CostModel
from firstlight.sim.model import model_from_config
from firstlight.sim.trace_replay import on_cpu_clock, replay_serve, trace_workload

TINY_CFG = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4000, "torch_dtype": "float32"}
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    return model_from_config(TINY_CFG, name="tiny")


def isolated_trace(model, hw, lengths: list[tuple[int, int]], gap_s: float = 10.0) -> Trace:
    """Requests that never overlap, each step timed by the cost model: what the simulator must reproduce."""
    cm = CostModel(model, hw)
    trace = Trace(meta={"engine": "synthetic", "config": {"block_size": 16, "max_num_seqs": 8,
                                                           "max_num_batched_tokens": 4096}})
    t = 0.0
    step = 0
    for i, (p, o) in enumerate(lengths):
        arrival = i * gap_s
        t = arrival
        rid = f"r{i}"
        batches = [Batch((ScheduledSeq(rid, p, 0, p),), step=step)]
        batches += [Batch((ScheduledSeq(rid, 1, p + j, p),), step=step + 1 + j) for j in range(o - 1)]
        first = None
        for b in batches:
            dt = cm.time(b)
            trace.steps.append(StepRecord(b, t, 0.0, dt, 0.0, cpu_s={"schedule": 0.0, "execute": dt / 2, "sample": 0.0}))
            t += dt
            first = t if first is None else first
        step += len(batches)
        trace.requests.append(RequestRecord(rid, arrival, p, o, first, t))
    return trace


def test_trace_round_trips_with_request_lines_and_gzip(tiny, tmp_path):
    tr = isolated_trace(tiny, load_spec("cpu-host"), [(64, 4), (200, 9)])
    path = tmp_path / "t.jsonl.gz"
    tr.save(path)
    with gzip.open(path, "rt") as f:
        assert sum('"request"' in line for line in f) == 2
    back = Trace.load(path)
    assert back.requests == tr.requests
    assert [s.to_dict() for s in back.steps] == [s.to_dict() for s in tr.steps]
    # requests rebuilt from the steps alone agree on lengths and on first-token / finish times
    inferred = infer_requests(back)
    assert [(r.num_prompt_tokens, r.num_output_tokens) for r in inferred] == [(64, 4), (200, 9)]
    assert [r.finish_s for r in inferred] == pytest.approx([r.finish_s for r in tr.requests])
    assert [r.first_token_s for r in inferred] == pytest.approx([r.first_token_s for r in tr.requests])


def test_replay_of_isolated_requests_is_exact(tiny):
    hw = load_spec("cpu-host")
    lengths = [(64, 4), (300, 12), (17, 1), (1000, 30)]
    r = replay_serve(isolated_trace(tiny, hw, lengths), tiny, hw)
    assert r["trace"]["num_requests"] == 4 and not r["trace"]["requests_inferred_from_steps"]
    for key in ("ttft", "tpot", "e2e"):
        assert r["vs_measured"][key]["median_abs_pct"] < 1e-6, key
    assert r["vs_measured"]["step"]["predicted_num_steps"] == sum(o for _, o in lengths)
    rows = r["requests"]
    assert [(q["num_prompt_tokens"], q["num_output_tokens"]) for q in rows] == lengths
    assert rows[2]["measured_tpot_s"] is None  # one output token: no TPOT
    # the same workload on other hardware is a what-if: the 1000-token prefill is far faster on an H100
    fast = replay_serve(isolated_trace(tiny, hw, lengths), tiny, load_spec("h100"))
    assert fast["requests"][3]["predicted_ttft_s"] < 0.2 * rows[3]["predicted_ttft_s"]
    assert fast["vs_measured"]["ttft"]["median_abs_pct"] > 50


def test_cpu_clock_warps_steps_and_requests(tiny):
    hw = load_spec("cpu-host")
    tr = isolated_trace(tiny, hw, [(64, 4), (128, 6)], gap_s=5.0)
    cpu = on_cpu_clock(tr)
    assert [s.total_s for s in cpu.steps] == pytest.approx([s.execute_s / 2 for s in tr.steps])
    busy0 = sum(s.execute_s for s in tr.steps[:4])
    # request 0 took half as long; the idle gap before request 1 is kept, so it arrives busy0/2 earlier
    r0, r1 = cpu.requests
    assert r0.finish_s - r0.arrival_s == pytest.approx(busy0 / 2)
    assert r1.arrival_s == pytest.approx(5.0 - busy0 / 2)
    assert r1.finish_s - r1.arrival_s == pytest.approx(sum(s.execute_s for s in tr.steps[4:]) / 2)
    old = Trace(tr.meta, [StepRecord(s.batch, s.start_s, 0.0, s.execute_s, 0.0) for s in tr.steps], tr.requests)
    with pytest.raises(FirstlightError, match="--clock wall"):
        on_cpu_clock(old)


def test_old_engine_trace_replays_with_inferred_arrivals():
    """The SmolLM2 trace in docs/ was written before request lines: arrivals come from the steps."""
    tr = Trace.load(REPO / "docs/calibration/smollm2-engine-trace.jsonl.gz")
    tw = trace_workload(tr)
    assert tw.inferred and len(tw.request_ids) == 24
    assert tw.engine == {"block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 2048,
                         "kv_capacity_tokens": 1456 * 16, "runner": "grouped"}
    assert int(tw.workload.num_prompt_tokens.sum()) == sum(s.batch.num_prefill_tokens for s in tr.steps)
    assert (tw.measured_ttft_s > 0).all() and (tw.measured_e2e_s >= tw.measured_ttft_s).all()


def test_cli_serve_engine_trace_and_bad_formats(tiny, tmp_path):
    hw = load_spec("cpu-host")
    path = tmp_path / "engine.jsonl"
    isolated_trace(tiny, hw, [(64, 4), (300, 12)]).save(path)
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TINY_CFG))
    runner = CliRunner()
    r = runner.invoke(app, ["serve", "--trace", str(path), "--hw", "cpu-host", "--model", str(cfg),
                            "--per-request", "2", "--out", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    assert "TTFT" in r.output and "replayed on cpu-host" in r.output
    res = json.loads((tmp_path / "rep" / "result.json").read_text())
    assert len(res["requests"]) == 2 and res["vs_measured"]["e2e"]["median_abs_pct"] < 1e-6
    # a Chrome trace (the export format) and a random CSV are not workloads: the error names --trace
    chrome = tmp_path / "chrome.json"
    chrome.write_text(json.dumps(Trace.load(path).to_chrome(), indent=1))
    bad_csv = tmp_path / "x.csv"
    bad_csv.write_text("a,b\n1,2\n")
    for bad in (chrome, bad_csv):
        r = runner.invoke(app, ["serve", "--trace", str(bad), "--hw", "cpu-host", "--model", str(cfg)])
        assert r.exit_code != 0 and isinstance(r.exception, FirstlightError)
        assert "--trace" in str(r.exception) and "engine trace" in str(r.exception)
    with pytest.raises(TraceFormatError, match="trace_meta"):
        Trace.load(chrome)


def test_grouped_runner_prices_one_forward_per_chunk_length(tiny):
    hw = load_spec("cpu-host")
    fused, grouped = CostModel(tiny, hw), CostModel(tiny, hw, runner="grouped")
    b = Batch((ScheduledSeq("a", 1, 50, 10), ScheduledSeq("b", 1, 70, 10), ScheduledSeq("c", 32, 0, 32),
               ScheduledSeq("d", 32, 0, 40), ScheduledSeq("e", 100, 0, 100)))
    # three forwards: the decodes, the two 32-token chunks, the 100-token chunk
    assert len(grouped.forwards(b.num_tokens, b.num_seqs, 2, 122.0, [(32, 0), (32, 0), (100, 0)])) == 3
    parts = [Batch(b.seqs[:2]), Batch(b.seqs[2:4]), Batch(b.seqs[4:])]
    step = hw.efficiency.step_overhead_us * 1e-6
    assert grouped.time(b) == pytest.approx(sum(fused.time(p) - step for p in parts) + step, rel=1e-9)
    assert grouped.time(b) > fused.time(b)
    assert grouped.time(Batch(b.seqs[:2])) == pytest.approx(fused.time(Batch(b.seqs[:2])), rel=1e-12)


def test_workload_arrays_match_request_lines(tiny):
    hw = load_spec("cpu-host")
    tr = isolated_trace(tiny, hw, [(64, 4), (300, 12)])
    tw = trace_workload(tr)
    assert tw.workload.arrival_s.tolist() == [0.0, 10.0]
    assert np.allclose(tw.measured_e2e_s, [r.finish_s - r.arrival_s for r in tr.requests])


def test_trace_export_cli_one_track_per_request(tiny, tmp_path):
    from firstlight.core.trace_cli import app as trace_app

    path = tmp_path / "engine.jsonl.gz"
    isolated_trace(tiny, load_spec("cpu-host"), [(64, 4), (300, 12), (20, 2)]).save(path)
    out = tmp_path / "perfetto.json"
    r = CliRunner().invoke(trace_app, ["export", str(path), "--out", str(out)])
    assert r.exit_code == 0, r.output
    events = json.loads(out.read_text())["traceEvents"]
    names = {e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {"r0", "r1", "r2"}
    per_track = {}
    for e in events:
        if e["pid"] == 1 and e["ph"] == "X":
            per_track.setdefault(e["tid"], []).append(e["name"])
    # each request's track: one prefill slice, then one decode slice per further output token
    assert sorted(per_track.values(), key=len) == [["prefill", "decode"], ["prefill"] + ["decode"] * 3,
                                                   ["prefill"] + ["decode"] * 11]
    r = CliRunner().invoke(trace_app, ["export", str(out)])
    assert r.exit_code != 0 and "not a firstlight engine trace" in str(r.exception)
