"""A short sweep against `firstlight serve` on a tiny random checkpoint (runs in CI, ~20 s)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import pytest

from firstlight.bench.load import LoadSpec
from firstlight.bench.run import RunConfig
from firstlight.bench.sweep import Sweep, SweepSpec, parse_servers
from firstlight.bench.workload import WorkloadSpec


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory):
    from firstlight.models.tiny import write_tiny_checkpoint

    ckpt = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", family="llama", seed=0)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "firstlight.cli", "serve", "--model", str(ckpt), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while time.time() < deadline:
            if proc.poll() is not None:
                pytest.skip(f"`firstlight serve` exited ({proc.returncode}): {proc.stderr.read()[-300:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("`firstlight serve` did not become healthy in 180 s")
        yield url, ckpt
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_short_sweep_against_engine(engine_url, tmp_path):
    url, ckpt = engine_url
    base = RunConfig(url="", workload=WorkloadSpec(input_len="uniform:8:24", output_len="8", tokenizer=str(ckpt)),
                     load=LoadSpec(num_requests=8, warmup_requests=2), slo="ttft=5s,tpot=1s", reset_prefix_cache=True)
    spec = SweepSpec(servers=parse_servers([url], ["engine"], [1.0]), mode="concurrency", values=[1, 4], base=base,
                     search=False)
    result = Sweep(spec, tmp_path, log=lambda s: None).run()
    for p in result["points"]:
        assert p["num_ok"] == 8 and p["num_errors"] == 0, p
        assert p["output_throughput"] > 0 and p["ttft_median_ms"] > 0
    assert (tmp_path / "pareto.png").is_file()
