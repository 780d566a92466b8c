"""Design-space sweeps: every (hardware, tp, pp, rate) point through the serving simulator.

Points run in parallel, in batches: a local `multiprocessing` pool by default, or Ray tasks
(`use_ray=True`, optional dependency `firstlight[ray]`, imported only then; `ray_address` or
`RAY_ADDRESS` joins an existing cluster, otherwise a local one is started and shut down). Each point reports p90
TTFT/TPOT, throughput and $ per 1M output tokens; points that do not fit say why. The report is the
table, the Pareto frontier of cost vs p90 TPOT, and the cheapest point that meets the SLO.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from firstlight.errors import FirstlightError


class SweepError(FirstlightError):
    """Bad sweep arguments or a missing optional backend."""


@dataclass(frozen=True)
class SweepPoint:
    hw: str
    tp: int
    pp: int
    rate: float


@dataclass(frozen=True)
class SweepSpec:
    """Everything a worker needs to evaluate one point (picklable; the model is loaded in the worker)."""

    model: str
    num_requests: int = 500
    prompt_len: int = 512
    output_len: int = 128
    arrival: str = "poisson"
    len_dist: str = "fixed"
    seed: int = 0
    num_replicas: int = 1
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.1
    serve_kwargs: dict[str, Any] = field(default_factory=dict)
    precision: str | None = None  # precision profile name or YAML path
    stack: str | None = None  # serving-stack preset
    weight_dtype: str | None = None  # with `precision`: overrides its weight groups
    kv_dtype: str | None = None  # with `precision`: overrides its KV cache dtype


def parse_list(text: str, kind: type, what: str) -> list:
    try:
        out = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SweepError(f"{what} {text!r}: expected a comma-separated list of {kind.__name__}") from None
    if not out:
        raise SweepError(f"{what} is empty: give at least one value, e.g. {what} 1,2")
    return out


def parse_slo(text: str) -> tuple[float, float]:
    """`ttft=2000,tpot=50ms` -> (2.0, 0.05): (ttft, tpot) in seconds, defaults 2 s and 100 ms, from the one
    `--slo` syntax of bench and sim (firstlight/core/slo.py: milliseconds unless suffixed `s` or `ms`)."""
    from firstlight.core.slo import parse_slo_ms

    ms = {"ttft": 2000.0, "tpot": 100.0, **parse_slo_ms(text, ("ttft", "tpot"))}
    return ms["ttft"] / 1e3, ms["tpot"] / 1e3


def grid(hws: list[str], tps: list[int], pps: list[int], rates: list[float]) -> list[SweepPoint]:
    return [SweepPoint(h, t, p, r) for h, t, p, r in itertools.product(hws, tps, pps, rates)]


def evaluate(point: SweepPoint, spec: SweepSpec) -> dict[str, Any]:
    """One point: does it fit, and if so its latency, throughput and cost. Never raises a FirstlightError."""
    from firstlight.core.hardware import load_spec
    from firstlight.sim.model import load_model
    from firstlight.sim.serve import ServeConfig, run_serve
    from firstlight.sim.workload import make_workload

    row: dict[str, Any] = {**asdict(point), "num_devices": point.tp * point.pp * spec.num_replicas}
    try:
        hw = load_spec(point.hw)
        model = load_model(spec.model, weight_dtype=spec.weight_dtype, kv_dtype=spec.kv_dtype,
                           precision=spec.precision)
        wl = make_workload(spec.num_requests, point.rate, spec.prompt_len, spec.output_len, spec.arrival,
                           len_dist=spec.len_dist, seed=spec.seed)
        cfg = ServeConfig(tp=point.tp, pp=point.pp, num_replicas=spec.num_replicas, slo_ttft_s=spec.slo_ttft_s,
                          slo_tpot_s=spec.slo_tpot_s, **spec.serve_kwargs)
        if spec.stack:
            from firstlight.sim.stack import apply_stack, load_stack

            cfg = apply_stack(cfg, load_stack(spec.stack))
        result, _ = run_serve(model, hw, wl, cfg)
    except FirstlightError as e:
        return {**row, "fits": False, "reason": str(e)}
    ttft, tpot = result["ttft_s"].get("p90", float("nan")), result["tpot_s"].get("p90", float("nan"))
    return {**row, "fits": True, "reason": "", "precision": model.profile.name, "stack": spec.stack,
            "ttft_p90_s": ttft, "tpot_p90_s": tpot,
            "output_tokens_per_s": result["throughput"]["output_tokens_per_s"],
            "goodput_fraction": result["goodput"]["fraction_meeting_slo"],
            "usd_per_1m_output_tokens": result["cost"]["usd_per_1m_output_tokens"],
            "meets_slo": bool(ttft <= spec.slo_ttft_s and tpot <= spec.slo_tpot_s),
            "sim_wall_s": result["sim"]["wall_s"]}


def evaluate_many(points: list[SweepPoint], spec: SweepSpec) -> list[dict[str, Any]]:
    """A batch of points in one worker call: per-task overhead (process pickling, Ray scheduling) is paid once."""
    return [evaluate(p, spec) for p in points]


def _evaluate_batch(args: tuple[int, list[SweepPoint], SweepSpec]) -> tuple[int, list[dict[str, Any]]]:
    i, points, spec = args
    return i, evaluate_many(points, spec)


def _batches(points: list[SweepPoint], num_workers: int) -> list[list[SweepPoint]]:
    """About 4 batches per worker (load balance) of at least one point, in order."""
    size = max(1, len(points) // (4 * num_workers))
    return [points[i:i + size] for i in range(0, len(points), size)]


def run_sweep(points: list[SweepPoint], spec: SweepSpec, workers: int | None = None,
              use_ray: bool = False, ray_address: str | None = None,
              advance: Callable[[int], None] | None = None) -> list[dict[str, Any]]:
    """Evaluate every point; rows come back in the order of `points`. `advance(n)` is called as points
    finish (per point in one process, per batch of points in a pool or on Ray): a progress bar's hook.

    Local: a `spawn` process pool of `workers` (default: CPU count). Ray: `ray_address` joins a running
    cluster (`ray://host:10001`, or `auto` for the one this machine belongs to); None starts a local one."""
    advance = advance or (lambda n: None)
    if use_ray:
        return _run_ray(points, spec, ray_address, workers, advance)
    n = max(1, min(workers or os.cpu_count() or 1, len(points)))
    if n == 1:
        rows = []
        for p in points:
            rows.append(evaluate(p, spec))
            advance(1)
        return rows
    import multiprocessing as mp

    batches = _batches(points, n)
    parts: list[list[dict[str, Any]]] = [[] for _ in batches]
    with mp.get_context("spawn").Pool(n) as pool:  # spawn: no forked state from the parent
        for i, part in pool.imap_unordered(_evaluate_batch, [(i, b, spec) for i, b in enumerate(batches)]):
            parts[i] = part
            advance(len(part))
    return [row for part in parts for row in part]


def _run_ray(points: list[SweepPoint], spec: SweepSpec, address: str | None, workers: int | None,
             advance: Callable[[int], None]) -> list[dict[str, Any]]:
    try:
        import ray
    except ImportError:
        raise SweepError("--ray needs the optional dependency ray (pip install 'firstlight[ray]'); "
                         "run without --ray to use local processes") from None
    started = not ray.is_initialized()
    if started:
        kw: dict[str, Any] = {"ignore_reinit_error": True, "include_dashboard": False, "log_to_driver": False}
        if address:
            kw["address"] = address
        elif workers:
            kw["num_cpus"] = workers
        try:
            ray.init(**kw)
        except (ConnectionError, ValueError, RuntimeError) as e:
            raise SweepError(f"--ray-address {address!r}: cannot join a Ray cluster there ({e})") from None
    try:
        num = max(1, int(ray.cluster_resources().get("CPU", 1)))
        remote = ray.remote(evaluate_many)
        spec_ref = ray.put(spec)
        batches = _batches(points, num)
        refs = [remote.remote(b, spec_ref) for b in batches]
        index = {ref: i for i, ref in enumerate(refs)}
        parts: list[list[dict[str, Any]]] = [[] for _ in batches]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            parts[index[done[0]]] = ray.get(done[0])
            advance(len(parts[index[done[0]]]))
    finally:
        if started:
            ray.shutdown()
    return [row for part in parts for row in part]


def pareto_front(rows: list[dict[str, Any]], x: str = "tpot_p90_s", y: str = "usd_per_1m_output_tokens",
                 ) -> list[dict[str, Any]]:
    """Rows no other row beats on both x and y (lower is better), sorted by x."""
    pts = [r for r in rows if r.get("fits") and r.get(x) is not None and r.get(y) is not None]
    pts.sort(key=lambda r: (r[x], r[y]))
    front: list[dict[str, Any]] = []
    best_y = float("inf")
    for r in pts:
        if r[y] < best_y:
            front.append(r)
            best_y = r[y]
    return front


def best_meeting_slo(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    ok = [r for r in rows if r.get("meets_slo") and r.get("usd_per_1m_output_tokens") is not None]
    return min(ok, key=lambda r: (r["usd_per_1m_output_tokens"], r["num_devices"])) if ok else None


def pareto_figure(rows: list[dict[str, Any]], slo_tpot_s: float) -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    fits = [r for r in rows if r.get("fits") and r.get("usd_per_1m_output_tokens") is not None]
    for hw in sorted({r["hw"] for r in fits}):
        rs = [r for r in fits if r["hw"] == hw]
        ax.scatter([r["tpot_p90_s"] * 1e3 for r in rs], [r["usd_per_1m_output_tokens"] for r in rs], label=hw, s=18)
    front = pareto_front(fits)
    if front:
        ax.plot([r["tpot_p90_s"] * 1e3 for r in front], [r["usd_per_1m_output_tokens"] for r in front], "k--",
                lw=1, label="Pareto frontier")
    ax.axvline(slo_tpot_s * 1e3, color="r", lw=0.8, ls=":", label="TPOT SLO")
    ax.set_xlabel("p90 TPOT (ms)")
    ax.set_ylabel("$ per 1M output tokens")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def write_sweep_report(out_dir: str | Path, rows: list[dict[str, Any]], spec: SweepSpec) -> Path:
    from firstlight.core.report import write_report

    best = best_meeting_slo(rows)
    result = {"model": spec.model, "spec": {**asdict(spec), "serve_kwargs": {k: str(v) for k, v in
                                                                          spec.serve_kwargs.items()}}, "rows": rows, "pareto": pareto_front(rows), "best": best}
    table = [{k: r.get(k) for k in ("hw", "tp", "pp", "rate", "num_devices", "fits", "ttft_p90_s", "tpot_p90_s",
                                     "output_tokens_per_s", "usd_per_1m_output_tokens", "meets_slo")} for r in rows]
    summary = "best meeting the SLO: " + (f"{best['hw']} tp={best['tp']} pp={best['pp']} at {best['rate']} req/s, "
                                          f"${best['usd_per_1m_output_tokens']:.3f} per 1M output tokens"
                                          if best else "none")
    return write_report(out_dir, result, title=f"firstlight sim sweep: {spec.model}", summary=summary,
                        figures={"pareto_cost_vs_tpot": pareto_figure(rows, spec.slo_tpot_s)},
                        tables={"sweep": table})
