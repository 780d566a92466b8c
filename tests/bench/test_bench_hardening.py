"""Bench never loses a result and never reports one it does not have: each test reproduces a failure first
(a dead server, Ctrl-C, a torn points.jsonl, a server without usage, [DONE] or ignore_eos, two runs that
are not comparable) against the reference server in a child process."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from firstlight.bench.client import RequestRecord
from firstlight.bench.compare import compare_runs
from firstlight.bench.reference import ReferenceConfig, reference_server
from firstlight.bench.run import run_benchmark, write_run
from firstlight.errors import FirstlightError

from .conftest import make_cfg


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "firstlight.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout)


def _completed(url: str) -> int:
    import httpx

    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("reference_completed_total"):
            return int(line.split()[1])
    return 0


def test_all_requests_failed_exits_nonzero(tmp_path) -> None:
    with reference_server(ReferenceConfig(error_rate=1.0, error_status=503)) as url:
        p = _bench("run", "--url", url, "--out", str(tmp_path / "o"), "--num-requests", "6", "--input-len", "8",
                   "--output-len", "4", "--no-plots")
    assert p.returncode == 1, p.stdout + p.stderr
    assert "all 6 measured requests failed" in p.stderr and "http_503" in p.stderr and "Traceback" not in p.stderr
    assert json.loads((tmp_path / "o" / "result.json").read_text())["metrics"]["num_ok"] == 0  # still written


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_writes_finished_requests_marked_partial(tmp_path, sig, code) -> None:
    out = tmp_path / "o"
    with reference_server(ReferenceConfig(first_token_ms=5, per_token_ms=20)) as url:  # 20 tokens: ~0.4 s each
        proc = subprocess.Popen([sys.executable, "-m", "firstlight.cli", "bench", "run", "--url", url, "--out",
                                 str(out), "--num-requests", "1000", "--concurrency", "2", "--input-len", "8",
                                 "--output-len", "20", "--no-plots"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        deadline = time.monotonic() + 120
        while _completed(url) < 3 and time.monotonic() < deadline:  # a few requests finish (load-independent)
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.2)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == code, stdout + stderr
    res = json.loads((out / "result.json").read_text())
    assert res["partial"] is True and res["interrupted_by"] == sig.name
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    finished = [r for r in rows if r["error"] is None]
    assert 2 <= len(finished) < 1000 and res["metrics"]["num_ok"] == len(finished)
    assert any(r["error"] == "incomplete" for r in rows)  # the ones cut in flight, kept and labelled
    assert "marked partial" in stderr and "Traceback" not in stderr


def test_points_jsonl_torn_last_line_is_repaired(tmp_path) -> None:
    from firstlight.bench.sweep import repair_jsonl

    path = tmp_path / "points.jsonl"
    good = {"label": "s", "load": 1.0, "metrics": {}}
    path.write_text(json.dumps(good) + "\n" + '{"label": "s", "load": 2.0, "metr')  # killed mid-write
    logs: list[str] = []
    assert repair_jsonl(path, logs.append) == [good]
    assert "torn" in logs[0]
    with path.open("a") as f:  # what the sweep does next: append the point it runs again
        f.write(json.dumps({"label": "s", "load": 2.0, "metrics": {}}) + "\n")
    assert [r["load"] for r in repair_jsonl(path)] == [1.0, 2.0]  # both readable: nothing glued


def test_sweep_resumes_over_a_torn_line(tmp_path) -> None:
    from firstlight.bench.sweep import Sweep, SweepSpec, parse_servers

    with reference_server(ReferenceConfig(first_token_ms=2, per_token_ms=1)) as url:
        base = make_cfg("", n=4, c=1, out="3")
        spec = SweepSpec(servers=parse_servers([url], None, None), mode="concurrency", values=[1, 2], base=base,
                         search=False)
        Sweep(spec, tmp_path, log=lambda s: None).run()
        pts = tmp_path / "points.jsonl"
        lines = pts.read_text().splitlines()
        pts.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # the second point torn
        res = Sweep(spec, tmp_path, log=lambda s: None).run()
    assert [p["load"] for p in res["points"]] == [1.0, 2.0]
    assert len(pts.read_text().splitlines()) == 2
    # each point page carries its plots
    assert (tmp_path / "points" / "server_concurrency_2" / "latency_distributions.png").is_file()


def test_unknown_input_tokens_are_null_not_zero() -> None:
    with reference_server(ReferenceConfig(send_usage=0)) as url:
        res = run_benchmark(make_cfg(url, n=6, c=2))
    m = res.summary
    assert m["num_ok"] == 6 and m["num_input_tokens_unknown"] == 6
    assert m["total_input_tokens"] is None and m["input_throughput"] is None
    assert m["input_tokens"]["count"] == 0


def test_stream_without_done_after_finish_reason_is_complete() -> None:
    for backend in ("raw", "httpx"):
        with reference_server(ReferenceConfig(send_done=0)) as url:
            res = run_benchmark(make_cfg(url, n=6, c=2, backend=backend))
        assert res.summary["num_ok"] == 6, (backend, res.summary["errors_by_kind"])
        assert all(r.finish_reason == "length" for r in res.output.records)


def test_server_refusing_ignore_eos_gets_requests_without_it(tmp_path) -> None:
    with reference_server(ReferenceConfig(reject_ignore_eos=1)) as url:
        res = run_benchmark(make_cfg(url, n=8, c=2))
    assert res.summary["num_ok"] == 8 and res.summary["num_errors"] == 0
    assert res.config.ignore_eos is False and res.server["ignore_eos_supported"] is False
    assert any("ignore_eos" in n for n in res.notes)
    write_run(tmp_path, res, plots=False)
    assert json.loads((tmp_path / "result.json").read_text())["notes"] == res.notes


def test_vllm_compatible_export(tmp_path) -> None:
    with reference_server(ReferenceConfig()) as url:
        res = run_benchmark(make_cfg(url, n=10, c=2, out="5"))
    write_run(tmp_path, res, plots=False)
    v = json.loads((tmp_path / "result.vllm.json").read_text())
    for key in ("date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
                "duration", "completed", "failed", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "input_lens", "output_lens",
                "ttfts", "itls", "generated_texts", "errors", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms",
                "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms"):
        assert key in v, key
    assert v["completed"] == 10 and v["num_prompts"] == 10 and v["max_concurrency"] == 2
    assert v["request_rate"] == "inf" and len(v["ttfts"]) == 10 and all(len(x) == 4 for x in v["itls"])
    ours = res.summary["ttft_ms"]
    assert v["mean_ttft_ms"] == pytest.approx(ours["mean"]) and v["p99_ttft_ms"] == pytest.approx(ours["p99"])
    assert v["ttfts"][0] * 1e3 == pytest.approx(v["ttfts"][0] * 1e3)  # seconds, as vLLM writes them
    assert v["total_output_tokens"] == 50


def _run_dir(d: Path, ttfts: np.ndarray, workload: dict, load: dict) -> None:
    d.mkdir()
    with (d / "requests.jsonl").open("w") as f:
        for i, t in enumerate(ttfts):
            times = [t / 1e3 + k * 0.01 for k in range(4)]
            f.write(json.dumps(RequestRecord(index=i, t_end=times[-1], status=200, chunk_times=times,
                                             chunk_chars=[2] * 4, usage_completion_tokens=4).to_json()) + "\n")
    (d / "result.json").write_text(json.dumps({"workload": workload, "load": load, "endpoint": "completions",
                                               "metrics": {}}))


def test_compare_refuses_different_workloads(tmp_path) -> None:
    rng = np.random.default_rng(0)
    wl = {"kind": "synthetic", "input_len": "fixed:128", "output_len": "fixed:128", "seed": 0}
    load = {"mode": "concurrency", "concurrency": 4, "num_requests": 100}
    _run_dir(tmp_path / "a", rng.normal(50, 5, 100), wl, load)
    _run_dir(tmp_path / "b", rng.normal(60, 5, 100), {**wl, "input_len": "fixed:2048"}, load)
    _run_dir(tmp_path / "c", rng.normal(60, 5, 100), wl, {**load, "concurrency": 32})
    for other in ("b", "c"):
        with pytest.raises(FirstlightError, match="not comparable"):
            compare_runs(tmp_path / "a", tmp_path / other, num_resamples=200)
    r = compare_runs(tmp_path / "a", tmp_path / "b", num_resamples=200, allow_different=True)
    assert r["differences"] == ["workload.input_len: 'fixed:128' vs 'fixed:2048'"]
    _run_dir(tmp_path / "d", rng.normal(60, 5, 100), {**wl, "seed": 1}, load)  # a replicate: warned, compared
    assert "workload.seed" in compare_runs(tmp_path / "a", tmp_path / "d", num_resamples=200)["warnings"][0]


def test_compare_does_not_call_p99_significant_on_a_handful(tmp_path) -> None:
    wl, load = {"kind": "synthetic"}, {"mode": "concurrency", "concurrency": 1}
    _run_dir(tmp_path / "a", np.array([50.0, 51, 52, 53, 54, 55, 56, 57]), wl, load)
    _run_dir(tmp_path / "b", np.array([80.0, 81, 82, 83, 84, 85, 86, 300]), wl, load)
    rows = {(x["metric"], x["stat"]): x for x in compare_runs(tmp_path / "a", tmp_path / "b",
                                                               num_resamples=500)["latency"]}
    p99 = rows[("ttft_ms", "p99")]
    assert p99["ci_low"] > 0  # the bootstrap alone would call it significant ...
    assert p99["significant"] is False and "500" in p99["too_few_samples"]  # ... on 8 requests it is not judged
    assert rows[("ttft_ms", "p90")]["significant"] is False
    p = _bench("compare", str(tmp_path / "a"), str(tmp_path / "b"), "--resamples", "200")
    assert p.returncode == 0 and "n/a (too few)" in p.stdout


def test_sweep_plots_label_each_point_with_its_load() -> None:
    from firstlight.bench.report import sweep_figures

    rows = [{"label": "s", "mode": "concurrency", "load": c, "output_throughput": 10.0 * c, "ttft_median_ms": 5.0 * c,
             "ttft_p99_ms": 6.0 * c, "tpot_median_ms": 2.0 * c, "tpot_p99_ms": 3.0 * c,
             "tokens_per_s_per_user": 100.0 / c, "tokens_per_s_per_instance": 10.0 * c, "pareto": True}
            for c in (1, 4, 16)]
    figs = sweep_figures(rows)
    for name in ("latency_throughput", "pareto"):
        texts = {t.get_text() for ax in figs[name].axes for t in ax.texts}
        assert {"c=1", "c=4", "c=16"} <= texts, (name, texts)
    rows = [{**r, "mode": "rate", "load": r["load"] / 2} for r in rows]
    assert {"r=0.5", "r=2", "r=8"} <= {t.get_text() for ax in sweep_figures(rows)["pareto"].axes for t in ax.texts}


def test_interrupted_sweep_point_is_not_recorded_as_finished(tmp_path, monkeypatch) -> None:
    from firstlight.bench import sweep as sweep_mod
    from firstlight.bench.sweep import Sweep, SweepSpec, parse_servers

    real = sweep_mod.run_benchmark

    def interrupted_at_4(cfg, **kw):
        res = real(cfg, **kw)
        if cfg.load.concurrency == 4:
            res.output.interrupted_by = "SIGINT"  # as if Ctrl-C came during this point
        return res

    with reference_server(ReferenceConfig(first_token_ms=2, per_token_ms=1)) as url:
        spec = SweepSpec(servers=parse_servers([url], None, None), mode="concurrency", values=[1, 4],
                         base=make_cfg("", n=4, c=1, out="3"), search=False)
        monkeypatch.setattr(sweep_mod, "run_benchmark", interrupted_at_4)
        with pytest.raises(FirstlightError, match="rerun the same command to resume") as e:
            Sweep(spec, tmp_path, log=lambda s: None).run()
        assert e.value.exit_code == 130
        assert [json.loads(x)["load"] for x in (tmp_path / "points.jsonl").read_text().splitlines()] == [1.0]
        monkeypatch.setattr(sweep_mod, "run_benchmark", real)
        res = Sweep(spec, tmp_path, log=lambda s: None).run()  # the resume runs the cut point again
    assert [p["load"] for p in res["points"]] == [1.0, 4.0]
