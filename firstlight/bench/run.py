"""One benchmark run: preflight, optional prefix-cache reset, load, metrics, outputs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from firstlight.bench.client import make_client, preflight, reset_prefix_cache
from firstlight.bench.load import LoadSpec, Runner, RunOutput
from firstlight.bench.metrics import FORMULAS, PERCENTILE_METHOD, SLO, summarize
from firstlight.bench.workload import Workload, WorkloadSpec
from firstlight.errors import FirstlightError


def firstlight_home() -> Path:
    return Path(os.environ.get("FIRSTLIGHT_HOME") or Path.home() / ".cache" / "firstlight")


def calibration_path() -> Path:
    return firstlight_home() / "bench" / "calibration.json"


def latest_calibration() -> dict[str, Any] | None:
    """The last `firstlight bench calibrate` result on this machine, or None."""
    p = calibration_path()
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


@dataclass
class RunConfig:
    url: str
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    load: LoadSpec = field(default_factory=LoadSpec)
    endpoint: str = "completions"
    model: str | None = None
    label: str = ""
    slo: str | None = None
    backend: str = "raw"
    reset_prefix_cache: bool = False
    ignore_eos: bool = True
    continuous_usage: bool = True
    extra_body: dict[str, Any] | None = None
    request_timeout_s: float = 600.0
    api_key: str | None = None


@dataclass
class RunResult:
    summary: dict[str, Any]
    output: RunOutput
    server: dict[str, Any]
    config: RunConfig
    prefix_cache_reset: bool | None = None
    notes: list[str] = field(default_factory=list)  # what the run changed on its own, said to the user

    @property
    def partial(self) -> bool:
        return self.output.interrupted_by is not None

    @property
    def all_failed(self) -> bool:
        return self.summary.get("num_requests", 0) > 0 and self.summary.get("num_ok", 0) == 0

    def result_json(self) -> dict[str, Any]:
        c = self.config
        return {
            "kind": "firstlight.bench.run",
            "partial": self.partial,
            "interrupted_by": self.output.interrupted_by,
            "notes": self.notes,
            "label": c.label,
            "url": c.url,
            "endpoint": c.endpoint,
            "model": c.model,
            "server": self.server,
            "workload": c.workload.to_json(),
            "load": c.load.to_json(),
            "seeds": {"workload": c.workload.seed, "arrivals": c.load.seed},
            "client_backend": c.backend,
            "ignore_eos": c.ignore_eos,
            "prefix_cache_reset": self.prefix_cache_reset,
            "metrics": self.summary,
            "formulas": FORMULAS,
            "percentile_method": PERCENTILE_METHOD,
            "clock": {"source": "time.perf_counter (CLOCK_MONOTONIC)", "chunk_arrival": self.output.arrival_clock,
                      "perf_counter_at_start": self.output.t_start,
                      "unix_time_at_start": time.time() - (time.perf_counter() - self.output.t_start)},
            "calibration": latest_calibration(),
        }


def run_benchmark(cfg: RunConfig, *, progress: Any = None, server_info: dict | None = None) -> RunResult:
    """Check the server, then run the load in a fresh event loop and summarize it."""
    server = server_info or preflight(cfg.url, api_key=cfg.api_key)
    if cfg.model is None:
        if not server["models"]:
            raise FirstlightError(f"server {cfg.url!r} lists no models; pass --model.")
        cfg.model = server["models"][0]
    if cfg.endpoint == "completions" and cfg.workload.kind == "multi-turn":
        raise FirstlightError("a multi-turn workload needs --endpoint chat.")
    cfg.load.validate()
    slo = SLO.parse(cfg.slo)
    workload = Workload(cfg.workload)
    reset = reset_prefix_cache(cfg.url, api_key=cfg.api_key) if cfg.reset_prefix_cache else None
    if cfg.reset_prefix_cache and not reset:
        server["prefix_cache_reset_supported"] = False
    out = asyncio.run(_drive(cfg, workload, progress))
    summary = summarize(out.records, slo, workload.tok)
    summary["num_incomplete"] = out.incomplete
    if out.ignore_eos_refused:
        cfg.ignore_eos = False
        server["ignore_eos_supported"] = False
    return RunResult(summary, out, server, cfg, reset, list(out.notes))


async def _drive(cfg: RunConfig, workload: Workload, progress: Any) -> RunOutput:
    client = make_client(cfg.backend, cfg.url, timeout_s=cfg.request_timeout_s, api_key=cfg.api_key)
    loop = asyncio.get_running_loop()
    signals: list[signal.Signals] = []
    try:
        runner = Runner(client, workload, cfg.load, endpoint=cfg.endpoint, model=cfg.model or "",
                        ignore_eos=cfg.ignore_eos, continuous_usage=cfg.continuous_usage,
                        extra_body=cfg.extra_body, progress=progress)
        # SIGINT / SIGTERM stop the load but keep what finished: the result is written, marked partial
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not the main thread
                loop.add_signal_handler(sig, runner.interrupt, sig.name)
                signals.append(sig)
        out = await runner.run()
        out.arrival_clock = client.arrival_clock
        return out
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        await client.aclose()


def write_requests_jsonl(path: Path, result: RunResult) -> None:
    with path.open("w") as f:
        for r in result.output.records:
            f.write(json.dumps(r.to_json()) + "\n")


def write_run(out_dir: str | Path, result: RunResult, *, plots: bool = True) -> Path:
    """result.json (+ environment manifest), requests.jsonl with raw timestamps, plots, index.html."""
    from firstlight.bench import report
    from firstlight.bench.vllm_export import vllm_result

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_requests_jsonl(out / "requests.jsonl", result)
    (out / "result.vllm.json").write_text(json.dumps(vllm_result(result), indent=2))
    return report.write_run_report(out, result.result_json(), result.output.records, plots=plots)
