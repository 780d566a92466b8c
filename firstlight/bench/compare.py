"""`firstlight bench compare A B`: differences of two runs with bootstrap confidence intervals.

Each run is resampled by request (percentile bootstrap, independent resamples of A and B); the
statistic's difference B - A gets the central `confidence` interval of the resampled differences,
and is called significant when that interval excludes zero. ITL enters as each request's mean
per-token ITL, so that the resampling unit stays the request (chunks of one stream are not
independent).
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
                 seed: int = 0) -> dict[str, Any]:
    a, ra = load_run(path_a)
    b, rb = load_run(path_b)
    rows = []
    for m in _METRICS:
        if a[m].size < 2 or b[m].size < 2:
            continue
        for stat in _STATS:
            r = bootstrap_diff(a[m], b[m], stat, num_resamples=num_resamples, confidence=confidence, seed=seed)
            rows.append({"metric": m, "stat": stat, **r})
    thr = []
    for k in ("request_throughput", "output_throughput", "goodput"):
        xa, xb = ra.get("metrics", {}).get(k), rb.get("metrics", {}).get(k)
        if xa is not None and xb is not None:
            thr.append({"metric": k, "a": xa, "b": xb, "diff": xb - xa,
                        "note": "one value per run: no CI (rerun each side to get one)"})
    return {"a": str(path_a), "b": str(path_b), "confidence": confidence, "num_resamples": num_resamples,
            "method": "percentile bootstrap over requests, B - A; significant when the CI excludes 0",
            "latency": rows, "throughput": thr, "num_requests": {"a": int(a["ttft_ms"].size), "b": int(b["ttft_ms"].size)}}
