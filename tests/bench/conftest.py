"""Fixtures: reference servers in child processes, and an isolated FIRSTLIGHT_HOME."""

from __future__ import annotations

import pytest

from firstlight.bench.load import LoadSpec
from firstlight.bench.reference import ReferenceConfig, reference_server
from firstlight.bench.run import RunConfig
from firstlight.bench.workload import WorkloadSpec


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch):
    monkeypatch.setenv("FIRSTLIGHT_HOME", str(tmp_path / "home"))


@pytest.fixture(scope="module")
def ref_url():
    """15 ms to first token, 3 ms per token, one token per chunk."""
    with reference_server(ReferenceConfig(first_token_ms=15.0, per_token_ms=3.0, tokens_per_chunk=1)) as url:
        yield url


@pytest.fixture(scope="module")
def ref_multi_url():
    """Four tokens per chunk (as speculative decoding sends them)."""
    with reference_server(ReferenceConfig(first_token_ms=10.0, per_token_ms=2.0, tokens_per_chunk=4)) as url:
        yield url


def make_cfg(url: str, *, n: int = 40, c: int = 4, out: str = "6", **kw) -> RunConfig:
    """A small run config: LoadSpec/WorkloadSpec fields may be passed as keywords."""
    load_kw = {k: kw.pop(k) for k in list(kw) if k in LoadSpec.__dataclass_fields__}
    wl_kw = {k: kw.pop(k) for k in list(kw) if k in WorkloadSpec.__dataclass_fields__}
    load = LoadSpec(**{"mode": "concurrency", "concurrency": c, "num_requests": n, "warmup_requests": 4, **load_kw})
    return RunConfig(url=url, workload=WorkloadSpec(**{"input_len": "16", "output_len": out, **wl_kw}), load=load, **kw)


@pytest.fixture
def cfg():
    return make_cfg
