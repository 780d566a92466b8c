"""benchmarks/servers.py --rounds: one result per server from its rounds (medians), and the per-round table's
same-round ratios against the best peer."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def servers():  # noqa: ANN201
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("servers")
    finally:
        sys.path.remove(str(BENCHMARKS))


def _round(name: str, rnd: int, decode: float, ttft: float, c8: float | None = None) -> dict:
    r = {"name": name, "round": rnd, "kernel": "int4", "single": {"tokens_per_s_per_user": decode,
                                                                 "ttft_ms": {"median": ttft}},
         "bound_single": {"copy_bandwidth_gbs": [20.0 + rnd, 30.0 + rnd]}}
    if c8 is not None:
        r["c8"] = {"output_throughput": c8}
    return r


def test_merge_rounds_takes_every_figure_s_median(servers) -> None:  # noqa: ANN001
    rs = [_round("firstlight-int4", i, d, t) for i, (d, t) in enumerate(((90.0, 300.0), (130.0, 250.0), (120.0, 400.0)))]
    merged = servers.merge_rounds(rs)
    assert merged["name"] == "firstlight-int4" and merged["kernel"] == "int4"
    assert merged["single"]["tokens_per_s_per_user"] == 120.0
    assert merged["single"]["ttft_ms"]["median"] == 300.0
    assert merged["bound_single"]["copy_bandwidth_gbs"] == [21.0, 31.0]  # element by element
    assert merged["rounds"] == rs
    assert servers.merge_rounds(rs[:1]) == rs[0]  # one round: as it was, no "rounds"


def test_per_round_ratios_compare_within_each_round(servers, capsys) -> None:  # noqa: ANN001
    # round 1 ran slow for everyone, round 2 fast: the same-round ratio is 1.25 both times although our slow
    # round (90) is below the peer's fast one (120)
    ours = [_round("firstlight-int4", 0, 90.0, 300.0, 60.0), _round("firstlight-int4", 1, 150.0, 200.0, 100.0)]
    peer = [_round("llama-cpp", 0, 72.0, 600.0, 20.0), _round("llama-cpp", 1, 120.0, 400.0, 25.0)]
    peer[0]["single"]["own_decode_tok_s"], peer[1]["single"]["own_decode_tok_s"] = 80.0, 100.0  # its eval time
    other = [_round("hf-serve", 0, 10.0, 450.0, 30.0), _round("hf-serve", 1, 11.0, 500.0, 50.0)]
    s = {"results": [servers.merge_rounds(x) for x in (ours, peer, other)]}
    servers.print_rounds(s, argparse.Namespace(concurrency=[8]))
    out = capsys.readouterr().out
    assert "2 rounds" in out
    lines = [line for line in out.splitlines() if line.startswith("| firstlight-int4")]
    decode, own, ttft, c8 = lines
    assert "| 90.0 | 150.0 | 120.0 | 1.25x (1.25-1.25) |" in decode
    assert "| 90.0 | 150.0 | 120.0 | 1.31x (1.12-1.50) |" in own  # against llama.cpp's own 80, then 100
    assert "1.75x (1.50-2.00)" in ttft  # best peer TTFT / ours: 450 / 300, then 400 / 200
    assert "| 60.0 | 100.0 | 80.0 | 2.00x (2.00-2.00) |" in c8  # against the best peer of each round: 30, then 50
    assert not any(line.startswith("| llama-cpp") and "x (" in line for line in out.splitlines())


def test_llama_eval_rate_reads_the_last_full_requests(servers, tmp_path) -> None:  # noqa: ANN001
    log = tmp_path / "llama-cpp.log"
    log.write_text("\n".join(
        f"llama_perf_context_print: prompt eval time =     564.53 ms /   128 tokens\n"
        f"llama_perf_context_print:        eval time =    {ms:8.2f} ms /   {k} runs   ({ms / k:.2f} ms per token)"
        for ms, k in ((15.24, 1), (27.38, 2), (1000.0, 127), (1270.0, 127), (2540.0, 127), (1587.5, 127))))
    # the warm-up's 127 runs at 1 s and the short probes are left out: 100, 50 and 80 tok/s -> 80
    assert servers.llama_eval_tok_s(log, 3) == pytest.approx(80.0)
    assert servers.llama_eval_tok_s(tmp_path / "llama-cpp.log", 1) == pytest.approx(80.0)
    (tmp_path / "empty.log").write_text("no perf lines")
    assert servers.llama_eval_tok_s(tmp_path / "empty.log", 3) is None


def test_llama_server_eval_lines_and_not_prompt_eval(servers, tmp_path) -> None:  # noqa: ANN001
    log = tmp_path / "llama-server.log"  # llama-server's per-request timings: "N tokens", prompt lines alike
    log.write_text("\n".join(
        f"prompt eval time =     {ms / 2:8.2f} ms /   128 tokens (    4.41 ms per token)\n"
        f"       eval time =    {ms:8.2f} ms /   127 tokens (    8.57 ms per token)"
        for ms in (1270.0, 1587.5, 2540.0)))
    assert servers.llama_eval_tok_s(log, 3) == pytest.approx(80.0)  # 100, 80, 50: the prompt lines left out
