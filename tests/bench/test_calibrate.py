"""`calibrate` stores its result under FIRSTLIGHT_HOME and every later run records it."""

from __future__ import annotations

import json

from firstlight.bench.calibrate import calibrate, format_calibration
from firstlight.bench.run import calibration_path, run_benchmark, write_run


def test_calibrate_small_is_stored_and_recorded(ref_url, cfg, tmp_path):
    r = calibrate(concurrencies=(2,), first_token_ms=5.0, per_token_ms=1.0, output_tokens=4, requests_per_point=8,
                  capacity_concurrency=8, capacity_seconds=0.3, log=lambda s: None)
    assert calibration_path().is_file() and str(calibration_path()).startswith(str(tmp_path))
    p = r["bias"][0]
    assert p["concurrency"] == 2 and p["errors"] == {} and p["ttft_ms_bias_mean"] is not None
    assert "ttft_bias_server_part_mean" in p and r["multi_token_chunks"]["injected"]["itl_chunk_ms"] == 4.0
    assert r["capacity"]["max_streamed_requests_per_s"] > 0
    assert "capacity:" in format_calibration(r)
    res = run_benchmark(cfg(ref_url, n=2, c=1))
    write_run(tmp_path / "run", res, plots=False)
    saved = json.loads((tmp_path / "run" / "result.json").read_text())
    assert saved["calibration"]["time_unix"] == r["time_unix"]
