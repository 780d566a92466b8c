"""Bench outputs on top of core.report: plots, CSV, result.json with the environment manifest."""

from __future__ import annotations

import csv
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from firstlight import __version__
from firstlight.bench.client import RequestRecord
from firstlight.core.report import environment_manifest, write_report


def _figure(w: float = 6.4, h: float = 4.2) -> Any:
    from matplotlib.figure import Figure  # no pyplot: no global backend state

    return Figure(figsize=(w, h))


def bench_manifest(result: Mapping[str, Any]) -> dict[str, Any]:
    server = result.get("server") or result.get("servers")
    return environment_manifest(tool=f"firstlight bench {__version__}", server=server,
                                seeds=result.get("seeds"), workload=result.get("workload"),
                                calibration=result.get("calibration"))


def latency_figures(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """TTFT and ITL (per token and per chunk) distributions of the measured, successful requests."""
    from firstlight.bench.metrics import per_request

    per = [per_request(r) for r in records if r.ok and not r.warmup and r.chunk_times]
    if not per:
        return {}
    fig = _figure(10, 3.6)
    axes = fig.subplots(1, 3)
    series = [("TTFT (ms)", [p["ttft_ms"] for p in per]),
              ("ITL per token (ms)", np.concatenate([p["itl_token_ms"] for p in per])),
              ("ITL per chunk (ms)", np.concatenate([p["itl_chunk_ms"] for p in per]))]
    for ax, (name, vals) in zip(axes, series, strict=True):
        vals = np.asarray(vals, dtype=float)
        if vals.size:
            ax.hist(vals, bins=min(60, max(5, vals.size // 5)), color="#3b6ea5")
            for q, style in ((50, "-"), (99, "--")):
                ax.axvline(np.percentile(vals, q), color="k", ls=style, lw=1, label=f"p{q}")
            ax.legend(fontsize=7)
        ax.set_xlabel(name)
        ax.set_ylabel("count")
    fig.tight_layout()
    return {"latency_distributions": fig}


def _summary_text(result: Mapping[str, Any]) -> str:
    m = result.get("metrics", {})
    lines = [f"label={result.get('label')!s} url={result.get('url')} model={result.get('model')}",
             f"requests={m.get('num_requests')} ok={m.get('num_ok')} errors={m.get('errors_by_kind')}"]
    for k in ("ttft_ms", "tpot_ms", "itl_token_ms", "itl_chunk_ms", "e2e_ms"):
        s = m.get(k)
        if isinstance(s, dict) and s.get("count"):
            lines.append(f"{k:13s} mean={s['mean']:.3f} median={s['median']:.3f} p90={s['p90']:.3f} "
                         f"p95={s['p95']:.3f} p99={s['p99']:.3f}")
    for k in ("request_throughput", "input_throughput", "output_throughput", "goodput"):
        if m.get(k) is not None:
            lines.append(f"{k:19s} {m[k]:.3f} /s")
    if m.get("num_input_tokens_unknown"):
        lines.append(f"input tokens unknown for {m['num_input_tokens_unknown']} requests (no --tokenizer and no "
                     "usage from the server): input_throughput not reported")
    if result.get("partial"):
        lines.append(f"PARTIAL: interrupted by {result.get('interrupted_by')}")
    return "\n".join(lines)


def write_run_report(out: Path, result: dict[str, Any], records: Sequence[RequestRecord], *, plots: bool = True) -> Path:
    result = dict(result)
    result["environment"] = bench_manifest(result)
    figs = latency_figures(records) if plots else {}
    m = result["metrics"]
    rows = [{"metric": k, **{s: v.get(s) for s in ("mean", "median", "p90", "p95", "p99")}, "formula": result["formulas"].get(k, "")}
            for k, v in m.items() if isinstance(v, dict) and "median" in v]
    return write_report(out, result, title=f"firstlight bench: {result.get('label') or result.get('url')}",
                        figures=figs, tables={"latency (ms)": rows}, summary=_summary_text(result))


# -- sweeps ----------------------------------------------------------------------------------------
SWEEP_COLUMNS = ("label", "url", "mode", "load", "num_requests", "num_ok", "num_errors", "request_throughput",
                 "output_throughput", "input_throughput", "goodput", "slo_attainment", "ttft_median_ms",
                 "ttft_p99_ms", "tpot_median_ms", "tpot_p99_ms", "itl_token_median_ms", "itl_chunk_median_ms",
                 "e2e_median_ms", "e2e_p99_ms", "tokens_per_s_per_user", "tokens_per_s_per_instance",
                 "usd_per_hour", "usd_per_1m_output_tokens", "pareto", "source")


def write_csv(path: Path, rows: Sequence[Mapping[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(SWEEP_COLUMNS), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow(r)


def _label_points(ax: Any, pts: Sequence[Mapping[str, Any]], xs: Sequence[Any], ys: Sequence[Any]) -> None:
    """Write each point's load next to it (c=8 for concurrency 8, r=2.5 for 2.5 req/s)."""
    for r, x, y in zip(pts, xs, ys, strict=True):
        if x is not None and y is not None:
            tag = "c" if r.get("mode") == "concurrency" else "r"
            ax.annotate(f"{tag}={r['load']:g}", (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6,
                        color="#444")


def sweep_figures(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Latency vs throughput, the Pareto frontier and cost; every point labelled with its load."""
    labels = sorted({r["label"] for r in rows})
    figs: dict[str, Any] = {}
    fig = _figure(10, 4)
    a1, a2 = fig.subplots(1, 2)
    for lab in labels:
        pts = sorted((r for r in rows if r["label"] == lab and r.get("output_throughput")), key=lambda r: r["load"])
        x = [r["output_throughput"] for r in pts]
        a1.plot(x, [r["ttft_median_ms"] for r in pts], "o-", label=f"{lab} median")
        a1.plot(x, [r["ttft_p99_ms"] for r in pts], "x--", label=f"{lab} p99")
        a2.plot(x, [r["tpot_median_ms"] for r in pts], "o-", label=f"{lab} median")
        a2.plot(x, [r["tpot_p99_ms"] for r in pts], "x--", label=f"{lab} p99")
        _label_points(a1, pts, x, [r["ttft_median_ms"] for r in pts])
        _label_points(a2, pts, x, [r["tpot_median_ms"] for r in pts])
    for ax, name in ((a1, "TTFT (ms)"), (a2, "TPOT (ms)")):
        ax.set_xlabel("output tokens/s (instance)")
        ax.set_ylabel(name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    figs["latency_throughput"] = fig
    fig = _figure()
    ax = fig.subplots()
    for lab in labels:
        pts = [r for r in rows if r["label"] == lab and r.get("tokens_per_s_per_user")]
        ax.scatter([r["tokens_per_s_per_user"] for r in pts], [r["tokens_per_s_per_instance"] for r in pts],
                   label=lab, s=18)
        _label_points(ax, pts, [r["tokens_per_s_per_user"] for r in pts], [r["tokens_per_s_per_instance"] for r in pts])
    front = sorted((r for r in rows if r.get("pareto")), key=lambda r: r["tokens_per_s_per_user"])
    ax.plot([r["tokens_per_s_per_user"] for r in front], [r["tokens_per_s_per_instance"] for r in front],
            "k-", lw=1, label="Pareto frontier")
    ax.set_xlabel("output tokens/s per user (1000 / median TPOT)")
    ax.set_ylabel("output tokens/s per instance")
    ax.legend(fontsize=7)
    fig.tight_layout()
    figs["pareto"] = fig
    if any(r.get("usd_per_1m_output_tokens") for r in rows):
        fig = _figure()
        ax = fig.subplots()
        for lab in labels:
            pts = [r for r in rows if r["label"] == lab and r.get("usd_per_1m_output_tokens")]
            ax.plot([r["tokens_per_s_per_user"] for r in pts], [r["usd_per_1m_output_tokens"] for r in pts], "o", label=lab)
            _label_points(ax, pts, [r["tokens_per_s_per_user"] for r in pts],
                          [r["usd_per_1m_output_tokens"] for r in pts])
        ax.set_xlabel("output tokens/s per user")
        ax.set_ylabel("$ per 1M output tokens")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
        fig.tight_layout()
        figs["cost"] = fig
    return figs
