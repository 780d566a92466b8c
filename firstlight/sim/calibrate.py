"""Replay an engine trace through the cost model, and calibrate a spec's efficiency factors from traces.

A `firstlight.core.Trace` records every engine step's Batch and its measured times. Replay prices each
Batch with `CostModel.time` and compares. Calibration fits the spec's `efficiency` block on some traces
and reports the error on others it did not see (held out: another workload shape, another concurrency),
for step time and for per-request latency (TTFT, TPOT, e2e from simulating each trace's workload).

Two fits, because the engine times two things. **execute_s** (the forward passes) is a roofline: with
every efficiency at 1 and a 1 us kernel overhead each op of each step yields (t_compute, t_memory,
kernels), and under efficiencies (e_c, e_m) and overheads (k per kernel, o per step) the step is

    sum_ops max(t_compute / e_c, t_memory / e_m) + kernels * k + network + o

(with the spec's `overlap: additive`, the sum of the two times instead of their max; with its
`gemv_memory` set, a one-row linear's memory time is divided by its own fitted efficiency e_v)
fitted by least squares on relative error. k is fitted only when the kernel count varies between
steps (firstlight's grouped runner runs one forward per chunk length); otherwise k and o are collinear
and k stays at the spec's value. Network terms (TP all-reduce, PP sends) stay at the spec's network
efficiency: a one-device trace cannot see them. **Host time** (schedule_s + sample_s + the gap before
the next step while the engine is busy) is fitted as a + b * num_seqs (non-negative least squares):
a is scheduling and launch, b is per-sequence sampling, detokenize and output processing. The
calibrated spec's `step_overhead_us` = o + a and `seq_overhead_us` = b, because the serving
simulator's step is the whole engine step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from firstlight.core.batch import Batch, ScheduledSeq
from firstlight.core.hardware import EfficiencySpec, HardwareSpec, spec_from_dict
from firstlight.core.trace import StepRecord, Trace, TraceFormatError
from firstlight.errors import FirstlightError
from firstlight.sim.cost import CostModel
from firstlight.sim.model import ModelDesc
from firstlight.sim.parallel import ParallelConfig

NETWORK_OPS = ("tp_all_reduce", "pp_send")
FITTED = ("compute", "memory", "attention", "step_overhead_us", "seq_overhead_us", "gemv_memory")


class CalibrationError(FirstlightError):
    """A trace that cannot be replayed or fitted."""


def load_trace_steps(path: str | Path) -> Trace:
    try:
        trace = Trace.load(path)
    except FileNotFoundError:
        raise CalibrationError(f"trace file {path} does not exist; write one with the engine's --trace FILE") from None
    except (TraceFormatError, ValueError) as e:
        raise CalibrationError(f"--trace {path} is not a firstlight trace JSONL: {e}") from None
    steps = [s for s in trace.steps if s.batch.num_seqs > 0 and s.execute_s > 0]
    if not steps:
        raise CalibrationError(f"trace {path} has no steps with a non-empty batch and execute_s > 0")
    trace.steps = steps
    return trace


def abs_pct_errors(pred: np.ndarray, meas: np.ndarray) -> np.ndarray:
    return np.abs(pred - meas) / meas * 100.0


def error_summary(pred: np.ndarray, meas: np.ndarray) -> dict[str, float]:
    e = abs_pct_errors(pred, meas)
    return {"median_abs_pct": float(np.median(e)), "p90_abs_pct": float(np.percentile(e, 90)),
            "total_pred_s": float(pred.sum()), "total_meas_s": float(meas.sum())}


# ---- replay -----------------------------------------------------------------------------------------
def trace_runner(trace: Trace) -> str:
    """The runner the trace's engine used: `grouped` for firstlight's own engine, else `fused`."""
    return "grouped" if trace.meta.get("engine") == "firstlight" else "fused"


def replay(trace: Trace, model: ModelDesc, hw: HardwareSpec, par: ParallelConfig | None = None,
           efficiency: EfficiencySpec | None = None, runner: str | None = None) -> dict[str, Any]:
    """Predicted vs measured time of every step, against execute_s and against the whole step (total_s).

    The prediction includes the spec's step overhead as written; a calibrated spec's overhead holds the
    host time too, so compare it with `vs_total`."""
    cm = CostModel(model, hw, par, efficiency=efficiency, runner=runner or trace_runner(trace))
    pred = np.array([cm.time(s.batch) for s in trace.steps])
    meas = np.array([s.execute_s for s in trace.steps])
    total = np.array([s.total_s for s in trace.steps])
    rows = [{"step": s.batch.step, "num_seqs": s.batch.num_seqs, "num_prefill_tokens": s.batch.num_prefill_tokens,
             "num_decode_tokens": s.batch.num_decode_tokens, "measured_execute_s": float(m),
             "measured_total_s": float(t), "predicted_s": float(p)}
            for s, m, t, p in zip(trace.steps, meas, total, pred, strict=True)]
    return {"hardware": hw.name, "model": model.name, "num_steps": len(rows),
            "vs_execute": error_summary(pred, meas), "vs_total": error_summary(pred, total), "steps": rows}


# ---- the separable decomposition --------------------------------------------------------------------
@dataclass
class StepTerms:
    """Per-op roofline terms of every step at efficiency 1 (see module docstring)."""

    op_step: np.ndarray  # step index of each op
    t_compute: np.ndarray
    t_memory: np.ndarray
    kernels: np.ndarray  # per step
    network_s: np.ndarray  # per step
    num_steps: int
    seqs: np.ndarray | None = None  # per step
    is_attention: np.ndarray | None = None  # per op
    is_gemv: np.ndarray | None = None  # per op: a one-row linear
    overlap: str = "max"  # how an op's compute and memory time combine (EfficiencySpec.overlap)

    def predict(self, compute: float, memory: float, kernel_overhead_us: float, step_overhead_us: float,
                seq_overhead_us: float = 0.0, attention: float = 1.0, gemv_memory: float | None = None,
                ) -> np.ndarray:
        t_mem = self.t_memory / memory
        if gemv_memory is not None and self.is_gemv is not None:
            t_mem = np.where(self.is_gemv, self.t_memory / gemv_memory, t_mem)
        tc = self.t_compute / compute
        op_t = tc + t_mem if self.overlap == "additive" else np.maximum(tc, t_mem)
        if attention != 1.0 and self.is_attention is not None:
            op_t = np.where(self.is_attention, op_t / attention, op_t)
        t = np.bincount(self.op_step, weights=op_t, minlength=self.num_steps)
        t = t + self.kernels * kernel_overhead_us * 1e-6 + self.network_s + step_overhead_us * 1e-6
        if seq_overhead_us and self.seqs is not None:
            t = t + self.seqs * seq_overhead_us * 1e-6
        return t


def decompose(batches: list[Batch], model: ModelDesc, hw: HardwareSpec, par: ParallelConfig | None = None,
              runner: str = "fused") -> StepTerms:
    base = hw.efficiency
    unit = EfficiencySpec(compute=1.0, memory=1.0, network=base.network, kernel_overhead_us=1.0,
                          step_overhead_us=0.0, collective_overhead_us=base.collective_overhead_us,
                          overlap=base.overlap)
    cm = CostModel(model, hw, par, efficiency=unit, runner=runner)
    op_step: list[int] = []
    attn: list[bool] = []
    gemv: list[bool] = []
    tcs: list[float] = []
    tms: list[float] = []
    kernels = np.zeros(len(batches))
    network = np.zeros(len(batches))
    for j, b in enumerate(batches):
        for op in cm.step_ops(b):
            if op.name in NETWORK_OPS:
                network[j] += op.time_s
                continue
            tc, tm = op.flops / cm.flops_s, op.bytes / cm.mem_bw
            op_step.append(j)
            attn.append(op.name == "attention")
            gemv.append(op.gemv)
            tcs.append(tc)
            tms.append(tm)
            kernels[j] += (op.time_s - cm.combine(tc, tm)) / 1e-6
    return StepTerms(np.asarray(op_step, dtype=np.int64), np.asarray(tcs), np.asarray(tms), kernels, network,
                     len(batches), np.array([b.num_seqs for b in batches], dtype=np.float64), np.asarray(attn),
                     np.asarray(gemv, dtype=bool), base.overlap)


# ---- the fit ----------------------------------------------------------------------------------------
def fit_efficiency(terms: StepTerms, measured_s: np.ndarray, start: EfficiencySpec,
                   fit_kernel: bool | None = None, robust: bool = True) -> tuple[dict[str, float], Any]:
    """Least squares on relative error; efficiencies in (0, 1], overheads >= 0.

    Fits compute and memory efficiency, the step overhead and a per-sequence overhead (the runner's
    per-row work: input and block-table assembly, the padded KV gather), and the one-row (GEMV) memory
    efficiency when the spec sets one and the trace has one-row forwards. `fit_kernel=None` fits the
    per-kernel overhead too when the kernel count varies between steps by more than 5% (otherwise it
    is collinear with the step overhead and stays at the spec value). `robust` uses a soft-L1 loss, so
    a few steps slowed by another process on a shared machine do not drag the fit."""
    from scipy.optimize import least_squares

    if fit_kernel is None:
        k_cv = float(np.std(terms.kernels) / max(np.mean(terms.kernels), 1e-12))
        fit_kernel = k_cv > 0.05
    fit_gemv = start.gemv_memory is not None and terms.is_gemv is not None and bool(terms.is_gemv.any())
    # name: (start, lower, upper, scale)
    params: dict[str, tuple[float, float, float, float]] = {
        "compute": (start.compute, 1e-3, 1.0, 0.1), "memory": (start.memory, 1e-3, 1.0, 0.1),
        "attention": (start.attention, 1e-3, 1.0, 0.1),
        "step_overhead_us": (start.step_overhead_us, 0.0, np.inf, 10.0),
        "seq_overhead_us": (start.seq_overhead_us, 0.0, np.inf, 10.0)}
    if fit_kernel:
        params["kernel_overhead_us"] = (start.kernel_overhead_us, 0.0, np.inf, 1.0)
    if fit_gemv:
        params["gemv_memory"] = (float(start.gemv_memory or start.memory), 1e-3, 1.0, 0.1)
    names = list(params)
    x0 = np.array([v[0] for v in params.values()], dtype=float)
    lo = np.array([v[1] for v in params.values()])
    hi = np.array([v[2] for v in params.values()])
    x0 = np.clip(x0, lo + 1e-9, np.where(np.isinf(hi), np.inf, hi - 1e-9))

    def residual(x: np.ndarray) -> np.ndarray:
        p = dict(zip(names, x, strict=True))
        return terms.predict(p["compute"], p["memory"], p.get("kernel_overhead_us", start.kernel_overhead_us),
                             p["step_overhead_us"], p["seq_overhead_us"], p["attention"],
                             p.get("gemv_memory", start.gemv_memory)) / measured_s - 1.0

    scale = np.maximum(np.abs(x0), [v[3] for v in params.values()])
    kw: dict[str, Any] = {"loss": "soft_l1", "f_scale": 0.05} if robust else {}
    sol = least_squares(residual, x0, bounds=(lo, hi), x_scale=scale, **kw)
    fit = dict(zip(names, (float(v) for v in sol.x), strict=True))
    fit.setdefault("kernel_overhead_us", float(start.kernel_overhead_us))
    if start.gemv_memory is not None:
        fit.setdefault("gemv_memory", float(start.gemv_memory))
    return fit, sol


def host_times(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(host seconds, num_seqs) per step: schedule + sample + the idle gap before the next step when the
    engine was busy (the gap counts only up to 3x its median: longer ones are the engine waiting for work)."""
    steps = trace.steps
    host = np.array([s.schedule_s + s.sample_s for s in steps])
    seqs = np.array([s.batch.num_seqs for s in steps], dtype=np.float64)
    if len(steps) > 1:
        ends = np.array([s.start_s + s.total_s for s in steps[:-1]])
        gaps = np.array([s.start_s for s in steps[1:]]) - ends
        gaps = np.clip(gaps, 0.0, None)
        cap = 3 * float(np.median(gaps)) if gaps.size else 0.0
        host[:-1] += np.where(gaps <= cap, gaps, 0.0)
    return host, seqs


def fit_host(traces: list[Trace]) -> dict[str, float]:
    """host_s = a + b * num_seqs by non-negative least squares over every step of `traces` (microseconds)."""
    from scipy.optimize import nnls

    hs, ns = zip(*(host_times(t) for t in traces), strict=True)
    host, seqs = np.concatenate(hs), np.concatenate(ns)
    coef, _ = nnls(np.stack([np.ones_like(seqs), seqs], axis=1), host)
    return {"step_us": float(coef[0]) * 1e6, "seq_us": float(coef[1]) * 1e6}


def step_errors(traces: list[Trace], model: ModelDesc, hw: HardwareSpec, par: ParallelConfig | None,
                runner: str | None) -> dict[str, float]:
    """Per-step |error| of the whole step (execute + host: what the serving simulator's step stands for)."""
    pred, meas = [], []
    for t in traces:
        cm = CostModel(model, hw, par, runner=runner or trace_runner(t))
        pred.append(np.array([cm.time(s.batch) for s in t.steps]))
        meas.append(host_times(t)[0] + np.array([s.execute_s for s in t.steps]))
    return error_summary(np.concatenate(pred), np.concatenate(meas))


def request_errors(traces: list[Trace], model: ModelDesc, hw: HardwareSpec, par: ParallelConfig | None,
                   runner: str | None) -> dict[str, Any]:
    """Simulate each trace's workload on `hw` and compare per-request TTFT / TPOT / e2e with the engine's."""
    from firstlight.sim.trace_replay import replay_serve

    per: list[dict[str, Any]] = []
    errs: dict[str, list[np.ndarray]] = {"ttft": [], "tpot": [], "e2e": []}
    for t in traces:
        over: dict[str, Any] = {"tp": par.tp if par else 1, "pp": par.pp if par else 1}
        if runner:
            over["runner"] = runner
        r = replay_serve(t, model, hw, over)
        per.append({k: r["vs_measured"][k] for k in ("ttft", "tpot", "e2e")})
        for key in errs:
            meas = np.array([q[f"measured_{key}_s"] if q[f"measured_{key}_s"] is not None else np.nan
                             for q in r["requests"]], dtype=np.float64)
            pred = np.array([q[f"predicted_{key}_s"] if q[f"predicted_{key}_s"] is not None else np.nan
                             for q in r["requests"]], dtype=np.float64)
            ok = ~np.isnan(meas) & ~np.isnan(pred) & (meas > 0)
            errs[key].append(np.abs(pred[ok] - meas[ok]) / meas[ok] * 100)
    summary = {}
    for key, parts in errs.items():
        e = np.concatenate(parts) if parts else np.array([])
        summary[key] = ({"median_abs_pct": float(np.median(e)), "p90_abs_pct": float(np.percentile(e, 90)),
                         "num_requests": int(e.size)} if e.size else {})
    return {"all": summary, "per_trace": per}


def calibrate(trace: Trace | list[Trace], model: ModelDesc, hw: HardwareSpec, par: ParallelConfig | None = None,
              source: str = "trace", holdout: list[Trace] | None = None, runner: str | None = None,
              latency: bool = False, clock: str = "wall") -> dict[str, Any]:
    """Fit the efficiency block on `trace` (one or several); report in-sample and held-out errors.

    Returns the fit, execute_s errors before/after (in-sample), whole-step errors in-sample and on
    `holdout`, with `latency=True` per-request latency errors from simulating each trace's workload,
    and the calibrated spec dict. `clock="cpu"` first re-times every trace on the engine thread's CPU
    clock (`trace_replay.on_cpu_clock`): on a shared machine, what the engine would have measured alone."""
    if clock not in ("wall", "cpu"):
        raise CalibrationError(f"--clock {clock!r}: expected wall or cpu")
    fit_traces = trace if isinstance(trace, list) else [trace]
    if clock == "cpu":
        from firstlight.sim.trace_replay import on_cpu_clock

        fit_traces = [on_cpu_clock(t) for t in fit_traces]
        holdout = [on_cpu_clock(t) for t in holdout or []]
    steps = [s for t in fit_traces for s in t.steps]
    if len(steps) < len(FITTED) + 1:
        raise CalibrationError(f"traces have {len(steps)} steps; calibration fits up to {len(FITTED) + 1} factors "
                               "and needs more")
    runners = {runner or trace_runner(t) for t in fit_traces}
    if len(runners) > 1:
        raise CalibrationError("the fitted traces come from engines with different runners; fit them separately")
    run = runners.pop()
    measured = np.array([s.execute_s for s in steps])
    terms = decompose([s.batch for s in steps], model, hw, par, run)
    e0 = hw.efficiency
    before = terms.predict(e0.compute, e0.memory, e0.kernel_overhead_us, e0.step_overhead_us, e0.seq_overhead_us,
                           e0.attention, e0.gemv_memory)
    fit, sol = fit_efficiency(terms, measured, e0)
    after = terms.predict(fit["compute"], fit["memory"], fit["kernel_overhead_us"], fit["step_overhead_us"],
                          fit["seq_overhead_us"], fit["attention"], fit.get("gemv_memory"))
    host = fit_host(fit_traces)
    host_us = float(np.median(np.concatenate([host_times(t)[0] for t in fit_traces]))) * 1e6
    eff = e0.model_copy(update={**fit, "step_overhead_us": fit["step_overhead_us"] + host["step_us"],
                                "seq_overhead_us": fit["seq_overhead_us"] + host["seq_us"]})
    err_before, err_after = error_summary(before, measured), error_summary(after, measured)
    data = hw.model_dump()
    data["name"] = f"{hw.name}-calibrated"
    data["efficiency"] = eff.model_dump()
    data["sources"] = {**hw.sources, "efficiency": (
        f"calibrated by `firstlight sim calibrate` from {source} ({len(steps)} steps, model {model.name}, "
        f"runner {run}, {clock} clock, {e0.overlap} overlap): execute_s median |err| {err_before['median_abs_pct']:.1f}% -> "
        f"{err_after['median_abs_pct']:.1f}%, p90 {err_before['p90_abs_pct']:.1f}% -> {err_after['p90_abs_pct']:.1f}%; "
        f"step overhead = fitted {fit['step_overhead_us']:.0f} us + host {host['step_us']:.0f} us; per-sequence "
        f"host {host['seq_us']:.0f} us (schedule + sample + inter-step gap = a + b * num_seqs)")}
    calibrated = spec_from_dict(data, "calibrated spec")  # must validate like any shipped spec
    out: dict[str, Any] = {
        "hardware": hw.name, "model": model.name, "runner": run, "clock": clock, "num_traces": len(fit_traces),
        "num_steps": len(steps), "fit": fit, "host": host, "host_overhead_us": host_us,
        "efficiency": eff.model_dump(), "before": err_before, "after": err_after,
        "optimizer": {"status": int(sol.status), "nfev": int(sol.nfev), "cost": float(sol.cost)},
        "in_sample": {"step": step_errors(fit_traces, model, calibrated, par, runner)},
        "spec": data,
    }
    if holdout:
        out["held_out"] = {"num_traces": len(holdout), "num_steps": sum(len(t.steps) for t in holdout),
                           "step": step_errors(holdout, model, calibrated, par, runner)}
    if latency:
        out["in_sample"]["latency"] = request_errors(fit_traces, model, calibrated, par, runner)
        if holdout:
            out["held_out"]["latency"] = request_errors(holdout, model, calibrated, par, runner)
    return out


def write_spec_yaml(spec: dict[str, Any], path: str | Path) -> Path:
    import yaml

    path = Path(path)
    path.write_text(yaml.safe_dump(spec, sort_keys=False, width=120))
    return path


# ---- a synthetic trace (tests, docs) -----------------------------------------------------------------
def synthetic_trace(model: ModelDesc, hw: HardwareSpec, efficiency: EfficiencySpec, num_steps: int = 300,
                    seed: int = 0, noise: float = 0.0, par: ParallelConfig | None = None,
                    single_decode_fraction: float = 0.0) -> Trace:
    """Steps of mixed decode/prefill Batches timed by the cost model at `efficiency` (x lognormal noise);
    `single_decode_fraction` of the steps are one sequence's decode (a one-row forward: the GEMV term)."""
    rng = np.random.default_rng(seed)
    cm = CostModel(model, hw, par, efficiency=efficiency)
    trace = Trace(meta={"engine": "synthetic", "efficiency": efficiency.model_dump(), "seed": seed})
    t = 0.0
    for k in range(num_steps):
        if single_decode_fraction and rng.random() < single_decode_fraction:
            ctx = int(rng.integers(16, 2048))
            batch = Batch((ScheduledSeq(f"s{k}", 1, ctx, min(ctx, 8)),), step=k)
            execute = cm.time(batch) * (float(np.exp(rng.normal(0.0, noise))) if noise else 1.0)
            trace.steps.append(rec := StepRecord(batch, t, 2e-4, execute, 1e-4))
            t += rec.total_s
            continue
        seqs = []
        for i in range(int(rng.integers(0, 33))):
            ctx = int(rng.integers(16, 2048))
            seqs.append(ScheduledSeq(f"d{k}.{i}", 1, ctx, min(ctx, 8)))
        for i in range(int(rng.integers(0, 3)) if seqs else int(rng.integers(1, 3))):
            n, c = int(rng.integers(16, 513)), int(rng.integers(0, 1024))
            seqs.append(ScheduledSeq(f"p{k}.{i}", n, c, c + n))
        batch = Batch(tuple(seqs), step=k)
        # execute_s = the model's time at `efficiency` (its step overhead is what the fit should find)
        execute = cm.time(batch) * float(np.exp(rng.normal(0.0, noise))) if noise else cm.time(batch)
        rec = StepRecord(batch, t, 2e-4, execute, 1e-4)
        trace.steps.append(rec)
        t += rec.total_s
    return trace
