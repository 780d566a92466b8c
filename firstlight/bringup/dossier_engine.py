"""The dossier's measured engine run: our engine (fp32, CPU) on this machine, driven by `firstlight bench`.

`firstlight serve` starts as a subprocess on 127.0.0.1 and a free port; once /health answers, the
bench package's Python API (bench/run.py `run_benchmark`) sends a small closed-loop workload with
exact token counts (the checkpoint's tokenizer), and the server is stopped. Every step is bounded
by `time_limit_s`. Any failure (the server does not start, requests fail, the time runs out) is
returned as `status: failed` with the reason and the tail of the server log: the dossier reports
it and goes on.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class EngineRunSpec:
    num_requests: int = 8
    input_len: int = 64
    output_len: int = 32
    concurrency: int = 4
    time_limit_s: float = 300.0  # server start + the whole load
    threads: int = 0  # torch threads in the server (0: one per CPU)
    kv_cache_gib: float = 0.25


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_command(model_path: Path, port: int, spec: EngineRunSpec, threads: int) -> list[str]:
    return [sys.executable, "-m", "firstlight.cli", "serve", "--model", str(model_path), "--port", str(port),
            "--host", "127.0.0.1", "--dtype", "float32", "--threads", str(threads),
            "--kv-cache-gib", str(spec.kv_cache_gib), "--max-num-seqs", str(max(spec.concurrency, 1))]


def _child_env() -> dict[str, str]:
    """The server imports this very firstlight (a worktree or a checkout), not whatever is installed."""
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def machine(threads: int) -> dict[str, Any]:
    from firstlight.core.report import _cpu_model

    return {"cpu": _cpu_model(), "num_cpus": os.cpu_count(), "server_torch_threads": threads,
            "load_average_1m": os.getloadavg()[0]}


def measure_engine(model_path: Path, out_dir: Path, spec: EngineRunSpec | None = None) -> dict[str, Any]:
    """Serve `model_path`, bench it, stop it; the summary (never raises for a failed run)."""
    spec = spec or EngineRunSpec()
    threads = spec.threads or os.cpu_count() or 1
    rec: dict[str, Any] = {"status": "failed", "reason": "", "spec": asdict(spec), "machine": machine(threads),
                           "engine": "firstlight serve (fp32, CPU)", "client": "firstlight bench (bench/run.py)"}
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = out_dir / "server.log"
    rec["server_log"] = str(log_path)
    deadline = time.monotonic() + spec.time_limit_s
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(_server_command(model_path, port, spec, threads), stdout=log, stderr=subprocess.STDOUT,
                                env=_child_env(), start_new_session=True)
    try:
        t0 = time.monotonic()
        problem = _wait_healthy(proc, url, deadline)
        if problem:
            rec["reason"] = problem
            return rec
        rec["server_start_s"] = time.monotonic() - t0
        rec.update(_bench(model_path, url, spec, deadline, out_dir))
    except Exception as e:  # noqa: BLE001 - the dossier reports any failure of the run, never crashes on it
        rec["status"], rec["reason"] = "failed", f"{type(e).__name__}: {e}"
    finally:
        _stop(proc)
        rec["machine"]["load_average_1m_after"] = os.getloadavg()[0]
        if rec["status"] != "ok":
            rec["server_log_tail"] = _tail(log_path)
    return rec


def _wait_healthy(proc: subprocess.Popen, url: str, deadline: float) -> str | None:
    import httpx

    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"`firstlight serve` exited with code {proc.returncode} before it was healthy"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return "`firstlight serve` did not answer /health within the time limit"


def _bench(model_path: Path, url: str, spec: EngineRunSpec, deadline: float, out_dir: Path) -> dict[str, Any]:
    from firstlight.bench.load import LoadSpec
    from firstlight.bench.run import RunConfig, run_benchmark, write_run
    from firstlight.bench.workload import WorkloadSpec

    left = max(deadline - time.monotonic(), 1.0)
    cfg = RunConfig(url=url, label="firstlight engine (fp32, CPU)",
                    workload=WorkloadSpec(input_len=f"fixed:{spec.input_len}", output_len=f"fixed:{spec.output_len}",
                                          tokenizer=str(model_path)),
                    load=LoadSpec(mode="concurrency", concurrency=spec.concurrency, num_requests=spec.num_requests,
                                  duration_s=left, drain_timeout_s=left),
                    request_timeout_s=left)
    res = run_benchmark(cfg)
    write_run(out_dir / "bench", res, plots=False)
    s = res.summary
    ok = s.get("num_ok", 0)
    out: dict[str, Any] = {
        "status": "ok" if ok and not s.get("num_errors") else "failed",
        "reason": "" if ok and not s.get("num_errors") else
        f"{s.get('num_errors', 0)} of {s.get('num_requests', 0)} requests failed: {s.get('errors_by_kind')}",
        "bench_dir": str(out_dir / "bench"),
        "num_requests": s.get("num_requests"), "num_ok": ok,
        "duration_s": s.get("duration_s"),
        "output_tokens_per_s": s.get("output_throughput"),
        "request_throughput": s.get("request_throughput"),
        "tokens_per_s_per_user": s.get("tokens_per_s_per_user"),
    }
    for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
        st = s.get(name) or {}
        out[name] = {k: st.get(k) for k in ("median", "p90", "p99", "mean")}
    return out


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def _tail(path: Path, num_chars: int = 1500) -> str:
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError:
        return ""
