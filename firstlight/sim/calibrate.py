"""Replay an engine trace through the cost model, and calibrate a spec's efficiency factors from it.

A `firstlight.core.Trace` records every engine step's Batch and its measured `execute_s`. Replay prices
each Batch with `CostModel.time` and compares. Calibration fits the spec's `efficiency` factors
compute, memory and per-step overhead by least squares on the relative error of
execute_s against the prediction.

The fit is fast because the roofline separates: with every efficiency at 1 and a 1 us kernel
overhead, each op of each step yields (t_compute, t_memory, kernels), and under efficiencies
(e_c, e_m) and overheads (k per kernel, o per step) the step's time is

    sum_ops max(t_compute / e_c, t_memory / e_m) + kernels * k + network + o

The per-kernel overhead k stays at the spec's value: a step's kernel count barely varies (layers x
ops, plus one or two attention kernels), so k and o are collinear and only their sum per step is
identifiable; o absorbs it. The network terms (TP all-reduce, PP sends) are held at the spec's network efficiency: a
single-device trace cannot tell them apart. (MoE all-to-all time, when EP > TP, lands in the kernel
term; calibrate those from a trace without EP.) The step overhead is fitted on execute_s; the
calibrated spec adds the trace's median host time (schedule_s + sample_s) to it, because the serving
simulator's step overhead covers the whole engine step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from firstlight.core.batch import Batch, ScheduledSeq
from firstlight.core.hardware import EfficiencySpec, HardwareSpec, spec_from_dict
from firstlight.core.trace import StepRecord, Trace
from firstlight.errors import FirstlightError
from firstlight.sim.cost import CostModel
from firstlight.sim.model import ModelDesc
from firstlight.sim.parallel import ParallelConfig

NETWORK_OPS = ("tp_all_reduce", "pp_send")
FITTED = ("compute", "memory", "step_overhead_us")


class CalibrationError(FirstlightError):
    """A trace that cannot be replayed or fitted."""


def load_trace_steps(path: str | Path) -> Trace:
    try:
        trace = Trace.load(path)
    except FileNotFoundError:
        raise CalibrationError(f"trace file {path} does not exist; write one with the engine's --trace FILE") from None
    except ValueError as e:
        raise CalibrationError(f"trace {path} is not a firstlight trace JSONL: {e}") from None
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
def replay(trace: Trace, model: ModelDesc, hw: HardwareSpec, par: ParallelConfig | None = None,
           efficiency: EfficiencySpec | None = None) -> dict[str, Any]:
    """Predicted vs measured time of every step, against execute_s and against the whole step (total_s).

    The prediction includes the spec's step overhead as written; a calibrated spec's overhead holds the
    host time too, so compare it with `vs_total`."""
    cm = CostModel(model, hw, par, efficiency=efficiency)
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

    def predict(self, compute: float, memory: float, kernel_overhead_us: float, step_overhead_us: float) -> np.ndarray:
        op_t = np.maximum(self.t_compute / compute, self.t_memory / memory)
        t = np.bincount(self.op_step, weights=op_t, minlength=self.num_steps)
        return t + self.kernels * kernel_overhead_us * 1e-6 + self.network_s + step_overhead_us * 1e-6


def decompose(batches: list[Batch], model: ModelDesc, hw: HardwareSpec, par: ParallelConfig | None = None) -> StepTerms:
    base = hw.efficiency
    unit = EfficiencySpec(compute=1.0, memory=1.0, network=base.network, kernel_overhead_us=1.0,
                          step_overhead_us=0.0, collective_overhead_us=base.collective_overhead_us)
    cm = CostModel(model, hw, par, efficiency=unit)
    windows = [g.attention.sliding_window for g in model.groups if g.attention.sliding_window]
    token_cache: dict[int, list] = {}
    op_step: list[int] = []
    tcs: list[float] = []
    tms: list[float] = []
    kernels = np.zeros(len(batches))
    network = np.zeros(len(batches))
    for j, b in enumerate(batches):
        nd, ctx, wctx, chunks = cm._aggregate(b, windows[0] if windows else None)
        if b.num_tokens not in token_cache:
            token_cache[b.num_tokens] = cm.token_ops(b.num_tokens)
        ops = token_cache[b.num_tokens] + cm.logits_ops(b.num_seqs) + cm.attention_ops(nd, ctx, chunks, wctx)
        for op in ops:
            if op.name in NETWORK_OPS:
                network[j] += op.time_s
                continue
            tc, tm = op.flops / cm.flops_s, op.bytes / cm.mem_bw
            op_step.append(j)
            tcs.append(tc)
            tms.append(tm)
            kernels[j] += (op.time_s - max(tc, tm)) / 1e-6
    return StepTerms(np.asarray(op_step, dtype=np.int64), np.asarray(tcs), np.asarray(tms), kernels, network,
                     len(batches))


# ---- the fit ----------------------------------------------------------------------------------------
def fit_efficiency(terms: StepTerms, measured_s: np.ndarray, start: EfficiencySpec) -> tuple[dict[str, float], Any]:
    """Least squares on relative error; efficiencies in (0, 1], overheads >= 0."""
    from scipy.optimize import least_squares

    k = start.kernel_overhead_us
    x0 = np.array([start.compute, start.memory, start.step_overhead_us], dtype=float)
    lo = np.array([1e-3, 1e-3, 0.0])
    hi = np.array([1.0, 1.0, np.inf])
    x0 = np.clip(x0, lo + 1e-9, np.where(np.isinf(hi), np.inf, hi - 1e-9))

    def residual(x: np.ndarray) -> np.ndarray:
        return terms.predict(x[0], x[1], k, x[2]) / measured_s - 1.0

    sol = least_squares(residual, x0, bounds=(lo, hi), x_scale=np.maximum(np.abs(x0), [0.1, 0.1, 10.0]))
    return dict(zip(FITTED, (float(v) for v in sol.x), strict=True)), sol


def calibrate(trace: Trace, model: ModelDesc, hw: HardwareSpec, par: ParallelConfig | None = None,
              source: str = "trace") -> dict[str, Any]:
    """Fit the efficiency block; returns the fit, the errors before/after and the calibrated spec dict."""
    steps: list[StepRecord] = trace.steps
    if len(steps) < len(FITTED):
        raise CalibrationError(f"trace has {len(steps)} steps; calibration fits {len(FITTED)} factors and needs more")
    measured = np.array([s.execute_s for s in steps])
    terms = decompose([s.batch for s in steps], model, hw, par)
    e0 = hw.efficiency
    before = terms.predict(e0.compute, e0.memory, e0.kernel_overhead_us, e0.step_overhead_us)
    fit, sol = fit_efficiency(terms, measured, e0)
    after = terms.predict(fit["compute"], fit["memory"], e0.kernel_overhead_us, fit["step_overhead_us"])
    host_us = float(np.median([s.schedule_s + s.sample_s for s in steps])) * 1e6
    eff = e0.model_copy(update={**fit, "step_overhead_us": fit["step_overhead_us"] + host_us})
    err_before, err_after = error_summary(before, measured), error_summary(after, measured)
    data = hw.model_dump()
    data["name"] = f"{hw.name}-calibrated"
    data["efficiency"] = eff.model_dump()
    data["sources"] = {**hw.sources, "efficiency": (
        f"calibrated by `firstlight sim calibrate` from {source} ({len(steps)} steps, model {model.name}): "
        f"execute_s median |err| {err_before['median_abs_pct']:.1f}% -> {err_after['median_abs_pct']:.1f}%, "
        f"p90 {err_before['p90_abs_pct']:.1f}% -> {err_after['p90_abs_pct']:.1f}%; step overhead = fitted "
        f"{fit['step_overhead_us']:.0f} us + median host (schedule+sample) {host_us:.0f} us")}
    spec_from_dict(data, "calibrated spec")  # must validate like any shipped spec
    return {"hardware": hw.name, "model": model.name, "num_steps": len(steps), "fit": fit,
            "host_overhead_us": host_us, "efficiency": eff.model_dump(), "before": err_before, "after": err_after,
            "optimizer": {"status": int(sol.status), "nfev": int(sol.nfev), "cost": float(sol.cost)},
            "spec": data}


def write_spec_yaml(spec: dict[str, Any], path: str | Path) -> Path:
    import yaml

    path = Path(path)
    path.write_text(yaml.safe_dump(spec, sort_keys=False, width=120))
    return path


# ---- a synthetic trace (tests, docs) -----------------------------------------------------------------
def synthetic_trace(model: ModelDesc, hw: HardwareSpec, efficiency: EfficiencySpec, num_steps: int = 300,
                    seed: int = 0, noise: float = 0.0, par: ParallelConfig | None = None) -> Trace:
    """Steps of mixed decode/prefill Batches timed by the cost model at `efficiency` (x lognormal noise)."""
    rng = np.random.default_rng(seed)
    cm = CostModel(model, hw, par, efficiency=efficiency)
    trace = Trace(meta={"engine": "synthetic", "efficiency": efficiency.model_dump(), "seed": seed})
    t = 0.0
    for k in range(num_steps):
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
