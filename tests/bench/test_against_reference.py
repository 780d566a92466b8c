"""The client measures the reference server's injected delays; errors are counted by kind."""

from __future__ import annotations

import json
import os
import socket
import urllib.request

import pytest

from firstlight.bench.reference import ReferenceConfig, reference_server
from firstlight.bench.run import run_benchmark, write_run
from firstlight.errors import FirstlightError

# The calibrated bias on this machine is ~0.3 ms (docs/BENCH.md); tests run on shared, busy cores,
# so they allow 1 ms on medians (TTFT) and 0.3 ms on per-token medians. CPU contention from other
# processes only ever makes things late, so a timing check gets up to 3 tries; when all fail on an
# overloaded machine (load average above the core count) the test is skipped, not failed.
TTFT_TOL_MS = 1.0
ITL_TOL_MS = 0.3


def timed(check, tries: int = 3):
    """Run `check()` (it asserts) up to `tries` times; skip instead of fail on an overloaded machine."""
    for i in range(tries):
        try:
            return check()
        except AssertionError:
            if i == tries - 1:
                load = os.getloadavg()[0]
                if load > (os.cpu_count() or 1):
                    pytest.skip(f"timing check missed on an overloaded machine (load {load:.1f})")
                raise


def test_ttft_itl_tpot_equal_injected_delays(ref_url, cfg):
    res = run_benchmark(cfg(ref_url, n=40, c=4, out="6"))
    m = res.summary
    assert m["num_ok"] == 40 and m["num_errors"] == 0 and m["num_warmup"] == 4
    assert m["output_tokens"]["min"] == m["output_tokens"]["max"] == 6
    assert m["token_count_source"] == {"server_usage_per_chunk": 40}
    for r in res.output.records:
        assert len(r.chunk_times) == 6 and r.t_send < r.chunk_times[0] <= r.t_end
    timed(lambda: _check_single(run_benchmark(cfg(ref_url, n=40, c=4, out="6")).summary))


def _check_single(m):
    assert abs(m["ttft_ms"]["median"] - 15.0) <= TTFT_TOL_MS
    assert abs(m["itl_token_ms"]["median"] - 3.0) <= ITL_TOL_MS
    assert abs(m["itl_chunk_ms"]["median"] - 3.0) <= ITL_TOL_MS
    assert abs(m["tpot_ms"]["median"] - 3.0) <= ITL_TOL_MS


def test_multi_token_chunks_give_per_token_itl(ref_multi_url, cfg):
    def check():
        m = run_benchmark(cfg(ref_multi_url, n=24, c=4, out="9")).summary  # chunks: 1 + 4 + 4 tokens
        assert m["itl_token_ms"]["count"] == 24 * 8 and m["itl_chunk_ms"]["count"] == 24 * 2
        assert abs(m["itl_token_ms"]["median"] - 2.0) <= ITL_TOL_MS
        assert abs(m["itl_chunk_ms"]["median"] - 8.0) <= 4 * ITL_TOL_MS
        assert abs(m["tpot_ms"]["median"] - 2.0) <= ITL_TOL_MS

    timed(check)


def test_multi_token_chunks_without_per_chunk_usage(ref_multi_url, cfg):
    def check():
        m = run_benchmark(cfg(ref_multi_url, n=8, c=2, out="9", continuous_usage=False)).summary
        assert m["token_count_source"] == {"server_usage_split_by_chars": 8}
        assert m["output_tokens"]["mean"] == 9
        assert abs(m["itl_token_ms"]["median"] - 2.0) <= ITL_TOL_MS

    timed(check)


def test_constant_rate_run_hits_requested_rate(ref_url, cfg):
    def check():
        res = run_benchmark(cfg(ref_url, n=100, mode="rate", rate=100.0, arrival="constant", warmup_requests=0))
        assert res.summary["request_rate_achieved"] == pytest.approx(100.0, rel=0.02)

    timed(check)


def test_chat_multi_turn_grows_history(ref_url, cfg):
    res = run_benchmark(cfg(ref_url, n=6, c=2, kind="multi-turn", num_turns=3, endpoint="chat",
                            warmup_requests=0))
    recs = sorted(res.output.records, key=lambda r: (r.session, r.turn))
    assert [r.turn for r in recs] == [0, 1, 2, 0, 1, 2]
    # turn k's prompt holds the earlier turns and their answers (6 words each)
    p = [r.usage_prompt_tokens for r in recs[:3]]
    assert p[0] == 16 and p[1] == 16 + 6 + 16 and p[2] == p[1] + 6 + 16


def test_warmup_excluded_and_reset_prefix_cache(ref_url, cfg):
    res = run_benchmark(cfg(ref_url, n=10, c=2, warmup_requests=5, reset_prefix_cache=True))
    assert res.prefix_cache_reset is True
    assert res.summary["num_warmup"] == 5 and res.summary["num_requests"] == 10


def test_closed_loop_warms_up_before_measuring(ref_url, cfg):
    """Warm-up is a phase of its own: no measured request runs beside a warm-up one (at c = 4 with one warm-up
    request mixed in, the 4th measured request would start only when a measured one ends)."""
    res = run_benchmark(cfg(ref_url, n=4, c=4, warmup_requests=1))
    warm = [r for r in res.output.records if r.warmup]
    measured = [r for r in res.output.records if not r.warmup]
    assert len(warm) == 1 and len(measured) == 4 and all(r.ok for r in res.output.records)
    assert min(r.t_send for r in measured) >= warm[0].t_end
    # all four measured requests ran at once: each was sent before any of them ended
    assert max(r.t_send for r in measured) < min(r.t_end for r in measured)


def test_duration_bounds_the_run(ref_url, cfg):
    res = run_benchmark(cfg(ref_url, n=100000, mode="rate", rate=50.0, duration_s=0.5, warmup_requests=0))
    assert 10 <= len(res.output.records) <= 45


def test_server_errors_and_early_close_counted_and_run_continues(cfg):
    ref = ReferenceConfig(first_token_ms=2.0, per_token_ms=1.0, error_rate=0.25, early_close_rate=0.2, seed=3)
    with reference_server(ref) as url:
        res = run_benchmark(cfg(url, n=60, c=4, warmup_requests=0))
        metrics = urllib.request.urlopen(url + "/metrics").read().decode()
    counters = dict(line.split() for line in metrics.splitlines())
    m = res.summary
    assert m["num_requests"] == 60
    assert m["errors_by_kind"]["http_500"] == int(counters["reference_errors_total"]) > 0
    assert m["errors_by_kind"]["early_close"] == int(counters["reference_early_closes_total"]) > 0
    assert m["num_ok"] == 60 - m["num_errors"] == int(counters["reference_completed_total"])


def test_unreachable_url_fails_before_the_run(cfg):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(FirstlightError, match="unreachable.*No requests were sent"):
        run_benchmark(cfg(f"http://127.0.0.1:{port}"))


def test_run_outputs(ref_url, cfg, tmp_path):
    res = run_benchmark(cfg(ref_url, n=8, c=2, slo="ttft=100,tpot=50"))
    write_run(tmp_path / "run", res)
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert result["environment"]["tool"].startswith("firstlight bench")
    assert result["server"]["version"].startswith("firstlight-reference")
    assert result["seeds"] == {"workload": 0, "arrivals": 0}
    assert "tpot_ms" in result["formulas"] and result["percentile_method"] == "linear"
    assert result["metrics"]["num_good"] == 8
    assert "calibration" in result
    rows = [json.loads(x) for x in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and all(len(r["chunk_times"]) == 6 for r in rows)
    assert (tmp_path / "run" / "latency_distributions.png").stat().st_size > 1000
    assert "latency_distributions.png" in (tmp_path / "run" / "index.html").read_text()


def test_timeout_counted(cfg):
    with reference_server(ReferenceConfig(first_token_ms=2000.0)) as url:
        res = run_benchmark(cfg(url, n=2, c=2, warmup_requests=0, request_timeout_s=0.2))
    assert res.summary["errors_by_kind"] == {"timeout": 2}


def test_trace_replay(ref_url, cfg, tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp_ms": 1000 + 25 * i, "input_len": 5 + i, "output_len": 2 + i % 3} for i in range(12)]
    trace.write_text("\n".join(json.dumps(r) for r in rows))
    res = run_benchmark(cfg(ref_url, n=12, mode="trace", trace=str(trace), warmup_requests=0))
    recs = sorted(res.output.records, key=lambda r: r.index)
    offsets = [r.t_scheduled - recs[0].t_scheduled for r in recs]
    assert offsets == pytest.approx([0.025 * i for i in range(12)], abs=1e-9)
    assert [r.usage_prompt_tokens for r in recs] == [5 + i for i in range(12)]
    assert [r.output_tokens for r in recs] == [2 + i % 3 for i in range(12)]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 1}\n{"t": 2}\n')
    with pytest.raises(FirstlightError, match="bad.jsonl:2"):
        run_benchmark(cfg(ref_url, mode="trace", trace=str(bad)))
