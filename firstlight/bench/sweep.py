"""Sweeps over concurrency or rate on one or more servers; SLO search, Pareto frontier and cost.

Every finished point is appended (and fsynced) to `points.jsonl` in the output dir, so a sweep that
is interrupted resumes without repeating them. The highest load meeting the SLO is found by
bisection between the highest passing and the lowest failing load seen (growing the bracket by
doubling when the whole grid passes), not read off the grid.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from firstlight.bench.client import preflight
from firstlight.bench.metrics import SLO
from firstlight.bench.run import RunConfig, latest_calibration, run_benchmark, write_run
from firstlight.errors import FirstlightError


@dataclass
class ServerSpec:
    url: str
    label: str
    usd_per_hour: float | None = None


@dataclass
class SweepSpec:
    servers: list[ServerSpec]
    mode: str  # concurrency | rate
    values: list[float]
    base: RunConfig  # url/label/load.mode/value are filled per point
    search: bool = True
    slo_attainment: float = 0.9  # a point meets the SLO when this fraction of its requests does
    max_search_points: int = 6
    rate_rel_tol: float = 0.05

    def key_json(self) -> dict[str, Any]:
        """What must match for a resume to reuse finished points."""
        b = self.base
        return {"mode": self.mode, "servers": [asdict(s) for s in self.servers], "endpoint": b.endpoint,
                "model": b.model, "workload": {k: v for k, v in b.workload.to_json().items() if k != "run_nonce"},
                "load": b.load.to_json(), "slo": b.slo, "slo_attainment": self.slo_attainment,
                "backend": b.backend}


def _fmt(v: float) -> str:
    return f"{v:g}"


def _point_row(label: str, url: str, mode: str, load: float, m: dict[str, Any], usd_per_hour: float | None,
               source: str) -> dict[str, Any]:
    def g(metric: str, stat: str) -> float | None:
        s = m.get(metric)
        return s.get(stat) if isinstance(s, dict) else None

    out_tps = m.get("output_throughput")
    cost = (usd_per_hour / (out_tps * 3600) * 1e6) if (usd_per_hour and out_tps) else None
    return {"label": label, "url": url, "mode": mode, "load": load, "num_requests": m.get("num_requests"),
            "num_ok": m.get("num_ok"), "num_errors": m.get("num_errors"),
            "request_throughput": m.get("request_throughput"), "output_throughput": out_tps,
            "input_throughput": m.get("input_throughput"), "goodput": m.get("goodput"),
            "slo_attainment": m.get("slo_attainment"),
            "ttft_median_ms": g("ttft_ms", "median"), "ttft_p99_ms": g("ttft_ms", "p99"),
            "tpot_median_ms": g("tpot_ms", "median"), "tpot_p99_ms": g("tpot_ms", "p99"),
            "itl_token_median_ms": g("itl_token_ms", "median"), "itl_chunk_median_ms": g("itl_chunk_ms", "median"),
            "e2e_median_ms": g("e2e_ms", "median"), "e2e_p99_ms": g("e2e_ms", "p99"),
            "tokens_per_s_per_user": m.get("tokens_per_s_per_user"), "tokens_per_s_per_instance": out_tps,
            "usd_per_hour": usd_per_hour, "usd_per_1m_output_tokens": cost, "source": source}


def pareto_flags(rows: list[dict[str, Any]]) -> list[bool]:
    """True where no other point has >= tokens/s/user and >= tokens/s/instance with one strictly greater."""
    pts = [(r.get("tokens_per_s_per_user"), r.get("tokens_per_s_per_instance")) for r in rows]
    flags = []
    for i, (u, t) in enumerate(pts):
        if u is None or t is None:
            flags.append(False)
            continue
        dominated = any(j != i and u2 is not None and t2 is not None and u2 >= u and t2 >= t and (u2 > u or t2 > t)
                        for j, (u2, t2) in enumerate(pts))
        flags.append(not dominated)
    return flags


class Sweep:
    def __init__(self, spec: SweepSpec, out_dir: str | Path, *, resume: bool = True,
                 on_point: Callable[[str, float], None] | None = None, log: Callable[[str], None] = print) -> None:
        if spec.mode not in ("concurrency", "rate"):
            raise FirstlightError(f"sweep over {spec.mode!r}: expected concurrency or rate.")
        if not spec.values and not spec.search:
            raise FirstlightError("a sweep needs load values (e.g. --concurrency 1,4,16) or an SLO search.")
        if any(v <= 0 for v in spec.values):
            raise FirstlightError(f"sweep values {spec.values}: expected positive numbers.")
        labels = [s.label for s in spec.servers]
        if len(set(labels)) != len(labels):
            raise FirstlightError(f"server labels {labels} must be unique; pass one --label per --url.")
        self.spec, self.out, self.on_point, self.log = spec, Path(out_dir), on_point, log
        self.slo = SLO.parse(spec.base.slo)
        self.out.mkdir(parents=True, exist_ok=True)
        self.points_path = self.out / "points.jsonl"
        spec_path = self.out / "sweep_spec.json"
        key = spec.key_json()
        if spec_path.exists() and self.points_path.exists():
            old = json.loads(spec_path.read_text())
            if not resume:
                self.points_path.unlink()
            elif old != key:
                raise FirstlightError(f"{self.out} holds a different sweep (its sweep_spec.json differs); "
                                      "use another --out or --no-resume to start over.")
        spec_path.write_text(json.dumps(key, indent=2))
        self.done: dict[tuple[str, float], dict[str, Any]] = {}
        if self.points_path.exists():
            for p in repair_jsonl(self.points_path, log):
                self.done[(p["label"], float(p["load"]))] = p

    def _run_point(self, srv: ServerSpec, value: float, source: str, info: dict[str, Any]) -> dict[str, Any]:
        key = (srv.label, float(value))
        if key in self.done:
            return self.done[key]
        if self.on_point:
            self.on_point(srv.label, value)
        cfg = copy.deepcopy(self.spec.base)
        cfg.url, cfg.label = srv.url, srv.label
        cfg.load.mode = self.spec.mode
        if self.spec.mode == "concurrency":
            cfg.load.concurrency = int(value)
        else:
            cfg.load.rate = float(value)
        self.log(f"[{srv.label}] {self.spec.mode}={_fmt(value)} ({source}) ...")
        res = run_benchmark(cfg, server_info=copy.deepcopy(info))
        point_dir = self.out / "points" / f"{srv.label}_{self.spec.mode}_{_fmt(value)}"
        write_run(point_dir, res, plots=not res.partial)
        if res.partial:  # not a finished point: kept on disk, not in points.jsonl, so a resume runs it again
            err = FirstlightError(f"sweep interrupted by {res.output.interrupted_by} during {srv.label} "
                                  f"{self.spec.mode}={_fmt(value)} (its partial run is in {point_dir}); the "
                                  f"finished points are in {self.points_path}: rerun the same command to resume.")
            err.exit_code = 130 if res.output.interrupted_by == "SIGINT" else 143
            raise err
        row = _point_row(srv.label, srv.url, self.spec.mode, float(value), res.summary, srv.usd_per_hour, source)
        rec = {**row, "metrics": res.summary, "model": cfg.model}
        with self.points_path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.done[key] = rec
        m = res.summary
        self.log(f"[{srv.label}] {self.spec.mode}={_fmt(value)}: {m.get('request_throughput') or 0:.2f} req/s, "
                 f"{m.get('output_throughput') or 0:.1f} out tok/s, errors {m.get('errors_by_kind')}")
        return rec

    def _meets(self, rec: dict[str, Any]) -> bool:
        a = rec["metrics"].get("slo_attainment")
        return a is not None and a >= self.spec.slo_attainment

    def _search(self, srv: ServerSpec, info: dict[str, Any]) -> dict[str, Any]:
        """Bisection for the highest load whose SLO attainment >= the target."""
        integer = self.spec.mode == "concurrency"
        evals = 0

        def seen() -> list[tuple[float, bool]]:
            return sorted((v, self._meets(r)) for (lab, v), r in self.done.items() if lab == srv.label)

        if not seen():
            self._run_point(srv, 1.0, "search", info)
        while evals < self.spec.max_search_points:
            pts = seen()
            passing = [v for v, ok in pts if ok]
            lo = max(passing) if passing else 0.0
            failing = [v for v, ok in pts if not ok and v > lo]
            hi = min(failing) if failing else None
            if hi is None:
                nxt = lo * 2
            elif integer:
                if hi - lo <= 1:
                    break
                nxt = float((int(lo) + int(hi)) // 2)
            else:
                if (hi - lo) <= self.spec.rate_rel_tol * hi:
                    break
                nxt = (lo + hi) / 2 if lo > 0 else hi / 2
            if integer and nxt < 1:
                break
            self._run_point(srv, nxt, "search", info)
            evals += 1
        pts = seen()
        passing = [v for v, ok in pts if ok]
        best = max(passing) if passing else None
        failing = [v for v, ok in pts if not ok and (best is None or v > best)]
        return {"max_load_meeting_slo": best, "lowest_failing_load": min(failing) if failing else None,
                "bracket_closed": bool(failing), "slo": str(self.slo), "slo_attainment_target": self.spec.slo_attainment}

    def run(self) -> dict[str, Any]:
        infos = {s.label: preflight(s.url, api_key=self.spec.base.api_key) for s in self.spec.servers}
        search: dict[str, Any] = {}
        for srv in self.spec.servers:
            for v in self.spec.values:
                self._run_point(srv, v, "grid", infos[srv.label])
            if self.slo is not None and self.spec.search:
                search[srv.label] = self._search(srv, infos[srv.label])
        return self.finish(infos, search)

    def finish(self, infos: dict[str, Any], search: dict[str, Any]) -> dict[str, Any]:
        from firstlight.bench import report

        rows = [{k: v for k, v in r.items() if k != "metrics"} for r in
                sorted(self.done.values(), key=lambda r: (r["label"], r["load"]))]
        for r, flag in zip(rows, pareto_flags(rows), strict=True):
            r["pareto"] = flag
        report.write_csv(self.out / "sweep.csv", rows)
        b = self.spec.base
        result = {"kind": "firstlight.bench.sweep", "mode": self.spec.mode, "values": self.spec.values,
                  "servers": infos, "server_specs": [asdict(s) for s in self.spec.servers],
                  "workload": b.workload.to_json(), "load": b.load.to_json(), "endpoint": b.endpoint,
                  "seeds": {"workload": b.workload.seed, "arrivals": b.load.seed}, "slo": b.slo,
                  "slo_search": search, "points": rows, "client_backend": b.backend,
                  "pareto_axes": {"x": "tokens_per_s_per_user = 1000 / median TPOT (ms)",
                                  "y": "tokens_per_s_per_instance = output_throughput"},
                  "cost_formula": "usd_per_1m_output_tokens = usd_per_hour / (output_throughput * 3600) * 1e6",
                  "calibration": latest_calibration()}
        result["environment"] = report.bench_manifest(result)
        from firstlight.core.report import write_report

        summary = "\n".join(f"{lab}: highest {self.spec.mode} meeting SLO = {s['max_load_meeting_slo']}"
                            for lab, s in search.items())
        write_report(self.out, result, title="firstlight bench sweep", figures=report.sweep_figures(rows),
                     tables={"points": rows}, summary=summary)
        return result


def repair_jsonl(path: Path, log: Callable[[str], None] = print) -> list[dict[str, Any]]:
    """The records of a JSONL file appended to by a run that may have been killed mid-write.

    Keeps every line that parses as a JSON object; a torn line (a point cut mid-write) is dropped and
    the file rewritten without it, ending in a newline, so the next append starts on a line of its
    own instead of gluing itself to the fragment (which would lose that next point too).
    """
    raw = path.read_bytes()
    good: list[dict[str, Any]] = []
    kept: list[bytes] = []
    bad = 0
    for line in raw.split(b"\n"):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):
            rec = None
        if isinstance(rec, dict) and "label" in rec and "load" in rec:
            good.append(rec)
            kept.append(line)
        else:
            bad += 1
    clean = b"".join(x + b"\n" for x in kept)
    if clean != raw:
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_bytes(clean)
        tmp.replace(path)
        if bad:
            log(f"{path}: dropped {bad} torn line(s) left by an interrupted run; those points run again")
    return good


def parse_values(text: str | None, what: str) -> list[float]:
    if not text:
        return []
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise FirstlightError(f"{what} {text!r}: expected comma-separated numbers, e.g. 1,4,16.") from None
    return vals


def parse_servers(urls: list[str], labels: list[str] | None, prices: list[float] | None) -> list[ServerSpec]:
    labels = labels or []
    prices = prices or []
    if labels and len(labels) != len(urls):
        raise FirstlightError(f"{len(urls)} --url but {len(labels)} --label: give one label per URL.")
    if prices and len(prices) not in (1, len(urls)):
        raise FirstlightError(f"{len(urls)} --url but {len(prices)} --usd-per-hour: give one, or one per URL.")
    out = []
    for i, u in enumerate(urls):
        price = prices[i] if len(prices) == len(urls) else (prices[0] if prices else None)
        out.append(ServerSpec(u, labels[i] if labels else (f"s{i}" if len(urls) > 1 else "server"), price))
    return out


