"""`firstlight bench compare A B`: differences of two runs with bootstrap confidence intervals.

Each run is resampled by request (percentile bootstrap, independent resamples of A and B); the
statistic's difference B - A gets the central `confidence` interval of the resampled differences,
and is called significant when that interval excludes zero. ITL enters as each request's mean
per-token ITL, so that the resampling unit stays the request (chunks of one stream are not
independent).

Two guards keep the table honest. A tail statistic is only called significant when each run has at
least `MIN_TAIL_SAMPLES` requests beyond it (p99 needs 500 requests, p90 50, the median 10): with
fewer, the bootstrap resamples the same few largest values and its interval is too narrow to mean
anything. And runs whose workloads or load differ are refused (`--allow-different` compares them
anyway, with the differences listed), because a latency difference between different loads says
nothing about the servers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from firstlight.bench.client import RequestRecord
from firstlight.bench.metrics import assign_chunk_tokens, per_request
from firstlight.errors import FirstlightError

_STATS = {"mean": lambda a: a.mean(axis=-1), "median": lambda a: np.median(a, axis=-1),
          "p90": lambda a: np.percentile(a, 90, axis=-1), "p99": lambda a: np.percentile(a, 99, axis=-1)}
_METRICS = ("ttft_ms", "tpot_ms", "itl_token_ms", "e2e_ms")
_TAIL = {"mean": 0.5, "median": 0.5, "p90": 0.1, "p99": 0.01}  # fraction of samples at or beyond the stat
MIN_TAIL_SAMPLES = 5
# result.json fields that must match for two runs to be comparable (the workload's seed and nonce may differ)
_LOAD_KEYS = ("mode", "concurrency", "rate", "arrival", "burstiness", "max_concurrency", "trace",
              "trace_time_scale", "ramp_up_s")


def min_samples(stat: str) -> int:
    return int(round(MIN_TAIL_SAMPLES / _TAIL[stat]))


def workload_differences(ra: dict[str, Any], rb: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(differences that make the runs incomparable, differences worth a warning)."""
    hard, soft = [], []
    wa, wb = ra.get("workload") or {}, rb.get("workload") or {}
    for k in sorted(set(wa) | set(wb)):
        if k in ("run_nonce",) or wa.get(k) == wb.get(k):
            continue
        (soft if k == "seed" else hard).append(f"workload.{k}: {wa.get(k)!r} vs {wb.get(k)!r}")
    la, lb = ra.get("load") or {}, rb.get("load") or {}
    for k in _LOAD_KEYS:
        if la.get(k) != lb.get(k):
            hard.append(f"load.{k}: {la.get(k)!r} vs {lb.get(k)!r}")
    for k in ("endpoint", "ignore_eos"):
        if ra.get(k) != rb.get(k):
            hard.append(f"{k}: {ra.get(k)!r} vs {rb.get(k)!r}")
    if la.get("num_requests") != lb.get("num_requests"):
        soft.append(f"load.num_requests: {la.get('num_requests')!r} vs {lb.get('num_requests')!r}")
    for side, r in (("A", ra), ("B", rb)):
        if r.get("partial"):
            soft.append(f"run {side} is partial (interrupted by {r.get('interrupted_by')})")
    return hard, soft


def load_run(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Per-request metric arrays (measured, successful requests) and the run's result.json."""
    p = Path(path)
    d = p if p.is_dir() else p.parent
    req, res = d / "requests.jsonl", d / "result.json"
    if not req.is_file():
        raise FirstlightError(f"{path}: no requests.jsonl there; pass the output dir of `firstlight bench run`.")
    result = json.loads(res.read_text()) if res.is_file() else {}
    cols: dict[str, list[float]] = {m: [] for m in _METRICS}
    for n, line in enumerate(req.read_text().splitlines(), 1):
        try:
            raw = json.loads(line)
        except json.JSONDecodeError:
            raise FirstlightError(f"{req}:{n}: not valid JSON.") from None
        rec = RequestRecord(**{k: v for k, v in raw.items() if k in RequestRecord.__dataclass_fields__})
        if rec.warmup or not rec.ok or not rec.chunk_times:
            continue
        if not rec.chunk_tokens:
            assign_chunk_tokens(rec)
        pr = per_request(rec)
        cols["ttft_ms"].append(pr["ttft_ms"])
        cols["e2e_ms"].append(pr["e2e_ms"])
        if pr["tpot_ms"] is not None:
            cols["tpot_ms"].append(pr["tpot_ms"])
        if len(pr["itl_token_ms"]):
            cols["itl_token_ms"].append(float(np.mean(pr["itl_token_ms"])))
    if not cols["ttft_ms"]:
        raise FirstlightError(f"{path}: no successful measured requests to compare.")
    return {k: np.asarray(v) for k, v in cols.items()}, result


def bootstrap_diff(a: np.ndarray, b: np.ndarray, stat: str, *, num_resamples: int = 2000, confidence: float = 0.95,
                   seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    f = _STATS[stat]
    sa = f(a[rng.integers(0, a.size, (num_resamples, a.size))])
    sb = f(b[rng.integers(0, b.size, (num_resamples, b.size))])
    d = sb - sa
    lo, hi = np.percentile(d, [50 * (1 - confidence), 100 - 50 * (1 - confidence)])
    va, vb = float(f(a)), float(f(b))
    return {"a": va, "b": vb, "diff": vb - va, "rel_diff": (vb - va) / va if va else None,
            "ci_low": float(lo), "ci_high": float(hi), "significant": bool(lo > 0 or hi < 0)}


def compare_runs(path_a: str | Path, path_b: str | Path, *, num_resamples: int = 2000, confidence: float = 0.95,
                 seed: int = 0, allow_different: bool = False) -> dict[str, Any]:
    a, ra = load_run(path_a)
    b, rb = load_run(path_b)
    hard, soft = workload_differences(ra, rb)
    if hard and not allow_different:
        raise FirstlightError(f"{path_a} and {path_b} ran different workloads or loads ({'; '.join(hard)}); their "
                              "latencies are not comparable. Rerun one to match, or pass --allow-different.")
    rows = []
    for m in _METRICS:
        if a[m].size < 2 or b[m].size < 2:
            continue
        for stat in _STATS:
            r = bootstrap_diff(a[m], b[m], stat, num_resamples=num_resamples, confidence=confidence, seed=seed)
            need = min_samples(stat)
            if min(a[m].size, b[m].size) < need:
                r["significant"] = False
                r["too_few_samples"] = f"{stat} needs >= {need} requests per run to be judged"
            rows.append({"metric": m, "stat": stat, **r})
    thr = []
    for k in ("request_throughput", "output_throughput", "goodput"):
        xa, xb = ra.get("metrics", {}).get(k), rb.get("metrics", {}).get(k)
        if xa is not None and xb is not None:
            thr.append({"metric": k, "a": xa, "b": xb, "diff": xb - xa,
                        "note": "one value per run: no CI (rerun each side to get one)"})
    return {"a": str(path_a), "b": str(path_b), "confidence": confidence, "num_resamples": num_resamples,
            "method": "percentile bootstrap over requests, B - A; significant when the CI excludes 0",
            "latency": rows, "throughput": thr, "num_requests": {"a": int(a["ttft_ms"].size), "b": int(b["ttft_ms"].size)},
            "differences": hard, "warnings": soft,
            "min_samples": {s: min_samples(s) for s in _STATS}}
