"""Sweeps (resume, SLO search, Pareto, cost), compare, and the CLI's one-line errors."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest

from firstlight.bench.client import RequestRecord
from firstlight.bench.compare import compare_runs
from firstlight.bench.sweep import Sweep, SweepSpec, pareto_flags, parse_servers


class Interrupt(Exception):
    pass


def test_interrupted_sweep_resumes_without_repeating(ref_url, tmp_path, cfg):
    spec = SweepSpec(servers=parse_servers([ref_url], ["ref"], [3.6]), mode="concurrency", values=[1, 2, 4],
                     base=cfg("", n=6, out="4", warmup_requests=0), search=False)
    started: list[float] = []

    def stop_at_third(label, value):
        started.append(value)
        if len(started) == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        Sweep(spec, tmp_path, on_point=stop_at_third, log=lambda s: None).run()
    assert len((tmp_path / "points.jsonl").read_text().splitlines()) == 2
    again: list[float] = []
    result = Sweep(spec, tmp_path, on_point=lambda lab, v: again.append(v), log=lambda s: None).run()
    assert again == [4]
    assert [p["load"] for p in result["points"]] == [1, 2, 4]
    rows = list(csv.DictReader((tmp_path / "sweep.csv").open()))
    assert len(rows) == 3 and any(r["pareto"] == "True" for r in rows)
    # $/1M output tokens = $/h / (tok/s * 3600) * 1e6
    p = result["points"][0]
    assert p["usd_per_1m_output_tokens"] == pytest.approx(3.6 / (p["output_throughput"] * 3600) * 1e6)
    for f in ("latency_throughput.png", "pareto.png", "cost.png", "index.html", "result.json"):
        assert (tmp_path / f).is_file()
    assert json.loads((tmp_path / "result.json").read_text())["environment"]["seeds"] == {"workload": 0, "arrivals": 0}
    # a different sweep in the same dir is refused
    spec.base.workload.output_len = "5"
    with pytest.raises(Exception, match="different sweep"):
        Sweep(spec, tmp_path, log=lambda s: None)


def test_slo_search_bisects_to_the_threshold(tmp_path, monkeypatch, cfg):
    """With a fake point runner that meets the SLO up to load 13, bisection finds 13 exactly."""
    spec = SweepSpec(servers=parse_servers(["http://x"], ["x"], None), mode="concurrency", values=[1, 4],
                     base=cfg("", slo="ttft=100"), max_search_points=10)
    sw = Sweep(spec, tmp_path, log=lambda s: None)
    ran = []

    def fake(srv, value, source, info):
        ran.append(value)
        rec = {"label": srv.label, "load": value, "metrics": {"slo_attainment": 1.0 if value <= 13 else 0.5}}
        sw.done[(srv.label, float(value))] = rec
        return rec

    monkeypatch.setattr(sw, "_run_point", fake)
    for v in spec.values:
        fake(spec.servers[0], v, "grid", {})
    res = sw._search(spec.servers[0], {})
    assert res["max_load_meeting_slo"] == 13 and res["lowest_failing_load"] == 14
    assert ran[2:] == [8, 16, 12, 14, 13]  # doubling, then bisection


def test_pareto_frontier():
    rows = [{"tokens_per_s_per_user": u, "tokens_per_s_per_instance": t}
            for u, t in [(100, 50), (80, 200), (50, 400), (40, 300), (90, 100), (79, 199)]]
    assert pareto_flags(rows) == [True, True, True, False, True, False]


def _write_run(d, ttfts, seed):
    d.mkdir()
    rng = np.random.default_rng(seed)
    with (d / "requests.jsonl").open("w") as f:
        for i, t in enumerate(ttfts):
            times = [t / 1e3 + k * 0.01 + rng.uniform(0, 1e-4) for k in range(4)]
            r = RequestRecord(index=i, t_send=0.0, t_end=times[-1], status=200, chunk_times=times,
                              chunk_chars=[2] * 4, usage_completion_tokens=4)
            f.write(json.dumps(r.to_json()) + "\n")


def test_compare_bootstrap(tmp_path):
    rng = np.random.default_rng(0)
    _write_run(tmp_path / "a", rng.normal(50, 5, 200), 1)
    _write_run(tmp_path / "b", rng.normal(60, 5, 200), 2)
    _write_run(tmp_path / "c", rng.normal(50, 5, 200), 3)
    r = compare_runs(tmp_path / "a", tmp_path / "b", num_resamples=500)
    ttft = {x["stat"]: x for x in r["latency"] if x["metric"] == "ttft_ms"}
    assert ttft["mean"]["significant"] and ttft["mean"]["ci_low"] < 10 < ttft["mean"]["ci_high"] + 1.5
    same = compare_runs(tmp_path / "a", tmp_path / "c", num_resamples=500)
    assert not {x["stat"]: x for x in same["latency"] if x["metric"] == "ttft_ms"}["mean"]["significant"]


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "firstlight.cli", "bench", *args], capture_output=True, text=True,
                          timeout=60)


def test_cli_errors_are_one_line(tmp_path):
    p = _cli("run", "--url", "http://127.0.0.1:9", "--slo", "ttft=fast")
    assert p.returncode == 1 and "--slo 'ttft=fast' does not parse" in p.stderr and "Traceback" not in p.stderr
    p = _cli("run", "--url", "http://127.0.0.1:9", "--num-requests", "1")
    assert p.returncode == 1 and "unreachable" in p.stderr and "Traceback" not in p.stderr


def test_cli_run_and_sweep(ref_url, tmp_path):
    p = _cli("run", "--url", ref_url, "--num-requests", "4", "--concurrency", "2", "--output-len", "3",
             "--no-plots", "--out", str(tmp_path / "r"))
    assert p.returncode == 0, p.stderr
    assert json.loads((tmp_path / "r" / "result.json").read_text())["metrics"]["num_ok"] == 4
    p = _cli("sweep", "--url", ref_url, "--url", ref_url, "--label", "a", "--label", "b", "--rate", "20,40",
             "--num-requests", "4", "--output-len", "3", "--usd-per-hour", "1.5", "--out", str(tmp_path / "s"))
    assert p.returncode == 0, p.stderr
    rows = list(csv.DictReader((tmp_path / "s" / "sweep.csv").open()))
    assert [(r["label"], float(r["load"])) for r in rows] == [("a", 20), ("a", 40), ("b", 20), ("b", 40)]
    assert all(float(r["usd_per_1m_output_tokens"]) > 0 for r in rows)
