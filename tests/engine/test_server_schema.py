"""Schemathesis against a real server on 127.0.0.1: every response must match the OpenAPI document the
server publishes (status codes, content types, headers, bodies), no input may cause a 5xx, and
requests the schema calls invalid must be refused (slow tier: a few minutes).

`positive_data_acceptance` is left out on purpose: whether a schema-valid request is served depends
on things no static schema states (the served model's name, the context length, --max-tokens-limit).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from .server_helpers import running_server

pytest.importorskip("schemathesis", reason="schemathesis is a dev extra: pip install -e '.[dev]'")


@pytest.mark.slow
def test_schemathesis_finds_no_5xx_and_no_schema_mismatch(tiny, tmp_path) -> None:
    from firstlight.engine.server_guard import ServerLimits

    model, tok = tiny
    limits = ServerLimits(max_tokens=16, request_timeout_s=20)
    with running_server(model, tok, limits=limits, block_size=4, num_blocks=512, max_model_len=256) as (url, _):
        cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json", "--checks", "all",
               "--exclude-checks", "positive_data_acceptance", "--phases", "coverage,fuzzing",
               "--max-examples", "40", "--workers", "1", "--seed", "1", "--max-time", "240",
               "--request-timeout", "60", "--no-color"]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=420)
    report = out.stdout + out.stderr
    assert out.returncode == 0, report[-6000:]
    assert "5xx" not in report.split("SUMMARY")[-1]
