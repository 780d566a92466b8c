"""Trace replay as a simulation: an engine trace's requests become the workload of `sim serve`.

A `firstlight.core.Trace` carries the engine's settings (header), every step's Batch and time, and one
line per finished request (arrival, first token, finish, prompt / output / prefix-cached tokens). From
it this module builds

- the workload: the requests' arrival times and prompt / output lengths (and the prompt tokens the
  prefix cache served, which the simulator does not recompute);
- the deployment the engine ran: max_num_seqs, max_num_batched_tokens, block_size, KV blocks, and the
  engine's runner (`grouped` for firstlight's own engine, see `sim/cost.py`);
- the measured latencies: per-request TTFT, TPOT, end-to-end, and the step times.

`replay_serve` runs that workload through the serving simulator and reports, per request and over
all requests, predicted vs measured. Any setting can be overridden (`--hw`, `--tp`, scheduler knobs),
which re-runs the same workload on hypothetical hardware: the comparison is then a what-if, not a
check.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from firstlight.core.hardware import HardwareSpec
from firstlight.core.trace import RequestRecord, StepRecord, Trace, TraceFormatError, infer_requests
from firstlight.errors import FirstlightError
from firstlight.sim.model import ModelDesc
from firstlight.sim.serve import ServeConfig, run_serve
from firstlight.sim.workload import Workload


class TraceReplayError(FirstlightError):
    """An engine trace that cannot be replayed."""


@dataclass(frozen=True)
class TraceWorkload:
    workload: Workload  # in arrival order; time 0 = the first arrival
    request_ids: list[str]
    measured_ttft_s: np.ndarray  # nan where unknown
    measured_tpot_s: np.ndarray  # nan for single-token outputs
    measured_e2e_s: np.ndarray
    measured_step_s: np.ndarray  # every step's whole time (schedule + execute + sample)
    engine: dict[str, Any]  # ServeConfig fields the engine ran with
    inferred: bool  # requests rebuilt from steps (old trace without request lines)
    num_skipped: int  # requests without a first token (aborted)


def load_engine_trace(path: str | Path, option: str = "--trace") -> Trace:
    """Load a trace, or raise a TraceReplayError that names the option and says what the file is not."""
    try:
        return Trace.load(path)
    except FileNotFoundError:
        raise TraceReplayError(f"{option} {path}: no such file") from None
    except TraceFormatError as e:
        raise TraceReplayError(
            f"{option} {path}: not a firstlight engine trace ({e}); record one with `firstlight serve --trace FILE`, "
            "or pass a workload JSONL/CSV with arrival_s,num_prompt_tokens,num_output_tokens"
        ) from None


def is_engine_trace(path: str | Path) -> bool:
    """Whether the file starts with an engine trace header (cheap: reads one line)."""
    import gzip

    p = Path(path)
    try:
        opener = gzip.open if p.suffix == ".gz" else open
        with opener(p, "rt") as f:  # type: ignore[operator]
            first = f.readline()
    except (OSError, UnicodeDecodeError, EOFError):
        return False
    return first.lstrip().startswith('{"trace_meta"')


def engine_settings(trace: Trace) -> dict[str, Any]:
    """The ServeConfig fields the engine ran with, from the trace header."""
    meta = trace.meta
    cfg = meta.get("config", {}) if isinstance(meta.get("config"), dict) else {}
    block = int(cfg.get("block_size") or 16)
    out: dict[str, Any] = {"block_size": block}
    for key in ("max_num_seqs", "max_num_batched_tokens"):
        if cfg.get(key):
            out[key] = int(cfg[key])
    num_blocks = meta.get("num_blocks") or cfg.get("num_blocks")
    if num_blocks:
        out["kv_capacity_tokens"] = int(num_blocks) * block
    if meta.get("engine") == "firstlight":
        out["runner"] = "grouped"
    return out


def trace_workload(trace: Trace) -> TraceWorkload:
    reqs: list[RequestRecord] = trace.requests or infer_requests(trace)
    done = [r for r in reqs if r.first_token_s is not None and r.finish_s is not None]
    if not done:
        raise TraceReplayError("the trace has no finished request to replay (no request lines and no steps)")
    done.sort(key=lambda r: r.arrival_s)
    t0 = done[0].arrival_s
    arrival = np.array([r.arrival_s - t0 for r in done])
    prompt = np.array([r.num_prompt_tokens for r in done], dtype=np.int64)
    output = np.array([max(1, r.num_output_tokens) for r in done], dtype=np.int64)
    cached = np.array([min(r.num_cached_tokens, r.num_prompt_tokens - 1) for r in done], dtype=np.int64)
    first = np.array([r.first_token_s for r in done], dtype=np.float64)
    finish = np.array([r.finish_s for r in done], dtype=np.float64)
    start = np.array([r.arrival_s for r in done])
    multi = output > 1
    tpot = np.full(len(done), np.nan)
    tpot[multi] = (finish - first)[multi] / (output[multi] - 1)
    steps = np.array([s.total_s for s in trace.steps if s.batch.num_seqs > 0])
    wl = Workload(arrival, prompt, output, cached if cached.any() else None)
    return TraceWorkload(wl, [r.request_id for r in done], first - start, tpot, finish - start, steps,
                         engine_settings(trace), any(r.inferred for r in done), len(reqs) - len(done))


def on_cpu_clock(trace: Trace) -> Trace:
    """The trace re-timed as if no other process had competed for the CPU.

    Every step's schedule / execute / sample time becomes the engine thread's CPU time for it
    (`StepRecord.cpu_s`); idle gaps between steps stay as they were; request times move with the step
    they fall in (a piecewise-linear warp of the clock). The schedule (which requests ran in which step)
    is the one the engine chose, so for open-loop traces the warped arrivals are "as recorded
    relative to the steps", not the original arrival process. Raises TraceReplayError when a step has
    no CPU times (traces written before they were recorded: use the wall clock)."""
    import bisect

    steps = trace.steps
    if not steps or any(not s.cpu_s for s in steps):
        raise TraceReplayError("--clock cpu: the trace has steps without CPU times (written by an older engine); "
                               "use --clock wall")
    old_start = [s.start_s for s in steps]
    new_steps = []
    shift = 0.0  # new time - old time at the start of the current step
    new_start = []
    for k, s in enumerate(steps):
        if k:
            gap = s.start_s - (steps[k - 1].start_s + steps[k - 1].total_s)
            prev = new_steps[-1]
            shift = prev.start_s + prev.total_s + max(gap, 0.0) - s.start_s
        ns = StepRecord(s.batch, s.start_s + shift, s.cpu_s.get("schedule", 0.0), s.cpu_s["execute"],
                        s.cpu_s.get("sample", 0.0), s.op_times_s, s.stats, s.cpu_s)
        new_steps.append(ns)
        new_start.append(ns.start_s)

    def warp(t: float | None) -> float | None:
        if t is None:
            return None
        k = bisect.bisect_right(old_start, t) - 1
        if k < 0:
            return t + (new_start[0] - old_start[0])
        old, new = steps[k], new_steps[k]
        if t <= old.start_s + old.total_s:
            frac = (t - old.start_s) / old.total_s if old.total_s > 0 else 1.0
            return new.start_s + frac * new.total_s
        return new.start_s + new.total_s + (t - old.start_s - old.total_s)

    reqs = [replace(r, arrival_s=warp(r.arrival_s), first_token_s=warp(r.first_token_s), finish_s=warp(r.finish_s))
            for r in (trace.requests or infer_requests(trace))]
    return Trace({**trace.meta, "clock": "cpu"}, new_steps, reqs)


def _abs_pct(pred: np.ndarray, meas: np.ndarray) -> np.ndarray:
    ok = ~np.isnan(pred) & ~np.isnan(meas) & (meas > 0)
    return np.abs(pred[ok] - meas[ok]) / meas[ok] * 100.0


def compare(pred: np.ndarray, meas: np.ndarray) -> dict[str, float]:
    """Per-request |error| (median, p90) and the distributions' p50 / p90 side by side."""
    e = _abs_pct(pred, meas)
    ok_p, ok_m = pred[~np.isnan(pred)], meas[~np.isnan(meas)]
    if e.size == 0 or ok_p.size == 0 or ok_m.size == 0:
        return {}
    return {"median_abs_pct": float(np.median(e)), "p90_abs_pct": float(np.percentile(e, 90)),
            "measured_p50_s": float(np.median(ok_m)), "predicted_p50_s": float(np.median(ok_p)),
            "measured_p90_s": float(np.percentile(ok_m, 90)), "predicted_p90_s": float(np.percentile(ok_p, 90)),
            "measured_mean_s": float(ok_m.mean()), "predicted_mean_s": float(ok_p.mean())}


def replay_serve(trace: Trace, model: ModelDesc, hw: HardwareSpec, overrides: dict[str, Any] | None = None,
                 cost_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Simulate the trace's workload with the engine's settings (then `overrides`) and compare.

    Returns the usual `sim serve` summary plus `vs_measured` (TTFT, TPOT, e2e, step time) and
    `requests`: one row per request with measured and predicted latencies."""
    tw = trace_workload(trace)
    settings = {**tw.engine, **(overrides or {})}
    runner = settings.pop("runner", "fused")
    cfg = ServeConfig(**settings)
    result, res = run_serve(model, hw, tw.workload, cfg, {"runner": runner, **(cost_kwargs or {})})
    r = res.reqs
    arrival, first, finish = np.asarray(r.arrival), np.asarray(r.first_token), np.asarray(r.finish)
    out = tw.workload.num_output_tokens
    ttft, e2e = first - arrival, finish - arrival
    tpot = np.full(len(out), np.nan)
    multi = out > 1
    tpot[multi] = (finish - first)[multi] / (out[multi] - 1)
    steps = np.concatenate([np.asarray(rep.step_durations) for rep in res.replicas])
    result["runner"] = runner
    result["trace"] = {"num_requests": len(tw.request_ids), "num_skipped": tw.num_skipped,
                       "requests_inferred_from_steps": tw.inferred, "engine_settings": tw.engine}
    result["vs_measured"] = {
        "ttft": compare(ttft, tw.measured_ttft_s), "tpot": compare(tpot, tw.measured_tpot_s),
        "e2e": compare(e2e, tw.measured_e2e_s),
        "step": {"measured_num_steps": int(tw.measured_step_s.size), "predicted_num_steps": int(steps.size),
                 "measured_median_s": float(np.median(tw.measured_step_s)) if tw.measured_step_s.size else None,
                 "predicted_median_s": float(np.median(steps)) if steps.size else None,
                 "measured_total_s": float(tw.measured_step_s.sum()), "predicted_total_s": float(steps.sum())},
    }
    result["requests"] = [
        {"request_id": rid, "arrival_s": float(a), "num_prompt_tokens": int(p), "num_output_tokens": int(o),
         "measured_ttft_s": float(mt), "predicted_ttft_s": float(pt), "measured_tpot_s": _num(mp),
         "predicted_tpot_s": _num(pp), "measured_e2e_s": float(me), "predicted_e2e_s": float(pe)}
        for rid, a, p, o, mt, pt, mp, pp, me, pe in zip(
            tw.request_ids, tw.workload.arrival_s, tw.workload.num_prompt_tokens, out, tw.measured_ttft_s, ttft,
            tw.measured_tpot_s, tpot, tw.measured_e2e_s, e2e, strict=True)
    ]
    return result


def _num(x: float) -> float | None:
    return None if np.isnan(x) else float(x)
