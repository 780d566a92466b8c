"""Metrics and SLOs on hand-built records: exact values, no server."""

from __future__ import annotations

import random

import numpy as np
import pytest

from firstlight.bench.client import RequestRecord
from firstlight.bench.load import ARRIVALS, ramp_warp
from firstlight.bench.metrics import SLO, assign_chunk_tokens, summarize
from firstlight.errors import FirstlightError


def rec(i: int, ttft: float, gaps: list[float], tokens: list[int], t0: float = 0.0, error: str | None = None,
        warmup: bool = False) -> RequestRecord:
    times = [t0 + ttft]
    for g in gaps:
        times.append(times[-1] + g)
    r = RequestRecord(index=i, t_send=t0, t_end=times[-1], warmup=warmup, error=error, chunk_times=times,
                      chunk_chars=[3] * len(times), usage_completion_tokens=sum(tokens), usage_prompt_tokens=10)
    r.chunk_usage = list(np.cumsum(tokens))
    return r


def test_formulas_by_hand():
    # request 0: TTFT 100 ms, chunks of 1, 2, 3 tokens after gaps 20 ms and 60 ms
    r0 = rec(0, 0.100, [0.020, 0.060], [1, 2, 3])
    # request 1: TTFT 50 ms, 2 single-token chunks, 10 ms apart
    r1 = rec(1, 0.050, [0.010], [1, 1], t0=0.2)
    m = summarize([r0, r1])
    assert m["ttft_ms"]["mean"] == pytest.approx(75.0)
    # per chunk: 20, 60, 10; per token: 10, 10, 20, 20, 20, 10
    assert m["itl_chunk_ms"]["count"] == 3 and m["itl_chunk_ms"]["mean"] == pytest.approx(30.0)
    assert m["itl_token_ms"]["count"] == 6 and m["itl_token_ms"]["mean"] == pytest.approx(15.0)
    # TPOT = (e2e - ttft) / (out - 1): r0 (180-100)/5 = 16, r1 (60-50)/1 = 10
    assert m["tpot_ms"]["mean"] == pytest.approx(13.0)
    assert m["e2e_ms"]["max"] == pytest.approx(180.0)
    # window: first send 0.0 to last end 0.26
    assert m["duration_s"] == pytest.approx(0.26)
    assert m["output_throughput"] == pytest.approx(8 / 0.26)
    assert m["input_throughput"] == pytest.approx(20 / 0.26)
    assert m["request_throughput"] == pytest.approx(2 / 0.26)


def test_percentiles_are_linear_interpolation():
    recs = [rec(i, t / 1000, [0.01], [1, 1], t0=i) for i, t in enumerate([10, 20, 30, 40, 100])]
    m = summarize(recs)
    assert m["ttft_ms"]["median"] == pytest.approx(30.0)
    assert m["ttft_ms"]["p90"] == pytest.approx(40 + 0.6 * 60)  # rank 0.9*4 = 3.6
    assert m["ttft_ms"]["p99"] == pytest.approx(40 + 0.96 * 60)


def test_goodput_hand_computed():
    recs = [
        rec(0, 0.100, [0.010] * 4, [1] * 5),  # ttft 100, tpot 10  -> good
        rec(1, 0.300, [0.010] * 4, [1] * 5),  # ttft 300            -> bad (ttft)
        rec(2, 0.100, [0.060] * 4, [1] * 5),  # tpot 60             -> bad (tpot)
        rec(3, 0.150, [], [1]),  # one token: no TPOT, meets ttft   -> good
        rec(4, 0.100, [0.010], [1, 1], error="http_500"),  # error  -> not good, counted by kind
        rec(5, 0.900, [], [1], warmup=True),  # warm-up: excluded
    ]
    for r in recs[3:5]:
        r.t_end = r.chunk_times[-1]
    m = summarize(recs, SLO.parse("ttft=200,tpot=50"))
    assert m["num_requests"] == 5 and m["num_good"] == 2
    assert m["goodput"] == pytest.approx(2 / m["duration_s"])
    assert m["slo_attainment"] == pytest.approx(2 / 5)
    assert m["errors_by_kind"] == {"http_500": 1} and m["num_warmup"] == 1
    # e2e: 140, 340, 340, 150 ms
    assert summarize(recs, SLO.parse("e2e=0.3s"))["num_good"] == 2
    assert summarize(recs, SLO.parse("e2e=345"))["num_good"] == 4


@pytest.mark.parametrize("bad", ["ttft", "ttft=abc", "latency=5", "ttft=-1", "ttft=5,,", "tpot=5x"])
def test_bad_slo_string(bad):
    with pytest.raises(FirstlightError, match="--slo .* does not parse"):
        SLO.parse(bad)


def test_slo_units():
    s = SLO.parse("ttft=0.2s, tpot=50ms,e2e=3000")
    assert (s.ttft_ms, s.tpot_ms, s.e2e_ms) == (200.0, 50.0, 3000.0)


def test_split_by_chars_sums_to_usage():
    r = RequestRecord(index=0, chunk_times=[0, 1, 2], chunk_chars=[5, 10, 15], usage_completion_tokens=7)
    assert assign_chunk_tokens(r) == "server_usage_split_by_chars"
    assert sum(r.chunk_tokens) == 7 and r.chunk_tokens[0] <= r.chunk_tokens[2]


@pytest.mark.parametrize("name", ["poisson", "gamma", "constant"])
def test_arrival_processes_have_the_asked_mean_rate(name):
    gen = ARRIVALS[name](50.0, random.Random(1), 0.5)
    t = [next(gen) for _ in range(20001)]
    assert 20000 / t[-1] == pytest.approx(50.0, rel=0.03)


def test_gamma_burstiness_changes_dispersion():
    cv = {}
    for k in (0.25, 4.0):
        g = ARRIVALS["gamma"](10.0, random.Random(0), k)
        d = np.diff([next(g) for _ in range(5000)])
        cv[k] = d.std() / d.mean()
    assert cv[0.25] == pytest.approx(2.0, rel=0.1) and cv[4.0] == pytest.approx(0.5, rel=0.1)


def test_ramp_up_warp():
    out = list(ramp_warp(iter([0.0, 1.0, 2.0, 5.0]), ramp_s=4.0))
    # L(t) = t^2/8 below 4 s: u=1 -> sqrt(8); above: u + 2
    assert out == pytest.approx([0.0, 8 ** 0.5, 4.0, 7.0])
