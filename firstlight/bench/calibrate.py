"""`firstlight bench calibrate`: the client's own bias and capacity, measured on the reference server.

Bias: the reference server (a separate process) streams with exact, known delays, counted from
the kernel's receive stamp of the request, and stamps when it wrote each chunk. Measured minus
injected splits in two: the server's own lateness (its send stamp minus the schedule: the
reference process woken late on a busy machine) and the **client's bias** (what the client
measured minus what the server actually did: the delivery of the request and of the chunk, and any
delay in the client's clock reading). The client's bias is the figure the goal is about; the
total is printed next to it.

Capacity: a closed loop at high concurrency against near-zero delays; the completed streamed
requests per second are the most this client sustains on this machine (the reference server is
cheaper per request than the client, so the client saturates first; the client's CPU share
during the run is reported as evidence). An open-loop run at the target rate checks the rate is
held (achieved vs requested).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from firstlight.bench.load import LoadSpec
from firstlight.bench.reference import ReferenceConfig, reference_server
from firstlight.bench.run import RunConfig, calibration_path, run_benchmark
from firstlight.bench.workload import WorkloadSpec
from firstlight.core.report import environment_manifest


def _bias_point(url: str, cfg: ReferenceConfig, concurrency: int, num_requests: int, output_tokens: int,
                backend: str) -> dict[str, Any]:
    run = RunConfig(url=url, workload=WorkloadSpec(input_len="16", output_len=str(output_tokens)),
                    load=LoadSpec(mode="concurrency", concurrency=concurrency, num_requests=num_requests,
                                  warmup_requests=concurrency), backend=backend)
    res = run_benchmark(run)
    m = res.summary
    ok = [r for r in res.output.records if r.ok and not r.warmup]
    srv_ttft = [(r.server_times[0] - r.server_t0) * 1e3 for r in ok if r.server_t0 and r.server_times]
    cli_ttft = [(r.chunk_times[0] - r.t_send) * 1e3 for r in ok if r.server_t0 and r.server_times]
    out = {
        "concurrency": concurrency, "num_requests": m["num_requests"], "errors": m["errors_by_kind"],
        "injected": {"ttft_ms": cfg.first_token_ms, "itl_token_ms": cfg.per_token_ms,
                     "itl_chunk_ms": cfg.per_token_ms * cfg.tokens_per_chunk, "tpot_ms": cfg.per_token_ms},
        "request_throughput": m.get("request_throughput"),
        "arrival_clock": res.output.arrival_clock,
    }
    for k, inj in (("ttft_ms", cfg.first_token_ms), ("itl_token_ms", cfg.per_token_ms), ("tpot_ms", cfg.per_token_ms)):
        s = m.get(k) or {}
        out[f"{k}_bias_mean"] = s["mean"] - inj if s.get("mean") is not None else None
        out[f"{k}_bias_median"] = s["median"] - inj if s.get("median") is not None else None
        out[f"{k}_p99"] = s.get("p99")
    if srv_ttft:
        out["ttft_bias_server_part_mean"] = float(np.mean(srv_ttft)) - cfg.first_token_ms
        out["ttft_bias_client_part_mean"] = float(np.mean(np.subtract(cli_ttft, srv_ttft)))
    # per-token gap, client minus server, over each request's whole stream
    tpot_client = [((r.chunk_times[-1] - r.chunk_times[0]) - (r.server_times[-1] - r.server_times[0])) * 1e3
                   / (cfg.tokens_per_chunk * (len(r.chunk_times) - 1))
                   for r in ok if len(r.server_times) == len(r.chunk_times) > 1]
    if tpot_client:
        out["tpot_bias_client_part_mean"] = float(np.mean(tpot_client))
    return out


def _capacity(backend: str, concurrency: int, seconds: float, output_tokens: int) -> dict[str, Any]:
    cfg = ReferenceConfig(first_token_ms=1.0, per_token_ms=0.5, tokens_per_chunk=1)
    with reference_server(cfg) as url:
        # a short probe sizes the run to about `seconds`
        probe = run_benchmark(RunConfig(url=url, backend=backend,
                                        workload=WorkloadSpec(input_len="16", output_len=str(output_tokens)),
                                        load=LoadSpec(mode="concurrency", concurrency=concurrency, num_requests=concurrency * 4,
                                                      warmup_requests=concurrency)))
        n = max(concurrency * 4, int((probe.summary.get("request_throughput") or 500) * seconds))
        cpu0, t0 = time.process_time(), time.perf_counter()
        res = run_benchmark(RunConfig(url=url, backend=backend,
                                      workload=WorkloadSpec(input_len="16", output_len=str(output_tokens)),
                                      load=LoadSpec(mode="concurrency", concurrency=concurrency, num_requests=n,
                                                    warmup_requests=concurrency)))
        cpu = (time.process_time() - cpu0) / (time.perf_counter() - t0)
        closed = res.summary.get("request_throughput") or 0.0
        target = min(1000.0, 0.9 * closed)
        rate_run = run_benchmark(RunConfig(url=url, backend=backend,
                                           workload=WorkloadSpec(input_len="16", output_len=str(output_tokens)),
                                           load=LoadSpec(mode="rate", rate=target, arrival="constant",
                                                         num_requests=int(target * seconds), warmup_requests=50)))
    achieved = rate_run.summary.get("request_rate_achieved") or 0.0
    return {"concurrency": concurrency, "output_tokens": output_tokens, "tokens_per_chunk": 1,
            "max_streamed_requests_per_s": closed, "client_cpu_share": cpu,
            "errors": res.summary["errors_by_kind"],
            "open_loop_check": {"requested_rate": target, "achieved_rate": achieved,
                                "rel_error": (achieved - target) / target if target else None,
                                "completed_per_s": rate_run.summary.get("request_throughput"),
                                "errors": rate_run.summary["errors_by_kind"]}}


def calibrate(*, concurrencies: Sequence[int] = (1, 16, 64, 128), first_token_ms: float = 50.0,
              per_token_ms: float = 10.0, output_tokens: int = 16, requests_per_point: int = 384,
              capacity_concurrency: int = 256, capacity_seconds: float = 3.0, backend: str = "raw",
              save: bool = True, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measure bias at each concurrency (+ a multi-token-chunk point) and the client's capacity."""
    points = []
    cfg = ReferenceConfig(first_token_ms=first_token_ms, per_token_ms=per_token_ms, tokens_per_chunk=1)
    with reference_server(cfg) as url:
        for c in concurrencies:
            log(f"bias at concurrency {c} ...")
            points.append(_bias_point(url, cfg, c, max(requests_per_point, 2 * c), output_tokens, backend))
    mcfg = ReferenceConfig(first_token_ms=first_token_ms, per_token_ms=per_token_ms, tokens_per_chunk=4)
    with reference_server(mcfg) as url:
        log("bias with 4-token chunks at concurrency 16 ...")
        multi = _bias_point(url, mcfg, 16, requests_per_point // 2, output_tokens + 1, backend)
    log(f"capacity at concurrency {capacity_concurrency} ...")
    cap = _capacity(backend, capacity_concurrency, capacity_seconds, 8)
    result = {"kind": "firstlight.bench.calibration", "time_unix": time.time(), "backend": backend,
              "reference": {"first_token_ms": first_token_ms, "per_token_ms": per_token_ms,
                            "output_tokens": output_tokens},
              "bias": points, "multi_token_chunks": multi, "capacity": cap,
              "arrival_clock": points[0].get("arrival_clock") if points else None,
              "goals": {"ttft_bias_mean_ms_at_c64": 0.5, "streamed_requests_per_s": 1000},
              "environment": environment_manifest()}
    if save:
        p = calibration_path()
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(result, indent=2, default=str))
        result["saved_to"] = str(p)
    return result


def format_calibration(r: dict[str, Any]) -> str:
    lines = [f"client backend: {r['backend']}; reference delays: first token {r['reference']['first_token_ms']} ms, "
             f"per token {r['reference']['per_token_ms']} ms, {r['reference']['output_tokens']} tokens/request",
             "means in ms; client = the client's measurement bias (measured - what the server did), "
             "server = the reference server's lateness, total = measured - injected",
             "concurrency    req/s   TTFT: client   server    total   TPOT: client    total   ITL/token total"
             "  TTFT p99  errors"]
    nan = float("nan")
    for p in r["bias"] + [r["multi_token_chunks"]]:
        tag = " (4-token chunks)" if p is r["multi_token_chunks"] else ""
        lines.append(
            f"{p['concurrency']:>11}  {p['request_throughput'] or 0:7.1f}  "
            f"{p.get('ttft_bias_client_part_mean', nan):+13.3f} {p.get('ttft_bias_server_part_mean', nan):+8.3f} "
            f"{p['ttft_ms_bias_mean']:+8.3f}  {p.get('tpot_bias_client_part_mean', nan):+13.3f} {p['tpot_ms_bias_mean']:+8.3f}"
            f"  {p['itl_token_ms_bias_mean']:+15.3f}  {p['ttft_ms_p99']:8.2f}  {p['errors']}{tag}")
    c = r["capacity"]
    oc = c["open_loop_check"]
    lines.append(f"capacity: {c['max_streamed_requests_per_s']:.0f} streamed req/s at concurrency {c['concurrency']} "
                 f"({c['output_tokens']} tokens, 1/chunk; client CPU share {c['client_cpu_share']:.2f}); goal >= 1000")
    lines.append(f"open loop at {oc['requested_rate']:.0f} req/s (constant): achieved {oc['achieved_rate']:.1f} req/s "
                 f"({100 * (oc['rel_error'] or 0):+.2f} %)")
    c64 = [p for p in r["bias"] if p["concurrency"] == 64]
    r_clock = r.get("arrival_clock")
    if r_clock:
        lines.append(f"chunk arrival clock: {r_clock}")
    if c64:
        p = c64[0]
        lines.append(f"client's mean TTFT bias at concurrency 64: {p.get('ttft_bias_client_part_mean', nan):+.3f} ms "
                     f"(goal <= 0.5 ms); measured - injected {p['ttft_ms_bias_mean']:+.3f} ms, of which the "
                     f"reference server's lateness {p.get('ttft_bias_server_part_mean', nan):+.3f} ms")
    if r.get("saved_to"):
        lines.append(f"saved to {r['saved_to']} (recorded in every result.json)")
    return "\n".join(lines)
