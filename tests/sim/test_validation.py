"""The published-measurement rows (docs/VALIDATION.md): structure, category summary, the PP and load helpers."""

import pytest

from firstlight.sim import validation as v


def test_every_row_is_sourced_and_categorised():
    kinds = {"decode", "prefill", "prefill+decode", "throughput", "pipeline", "latency-under-load", "collective"}
    for r in v.ROWS:
        assert r.kind in kinds, r.what
        assert r.measured > 0 and len(r.source) > 20, r.what
    got = {r.kind for r in v.ROWS}
    # issue 14 item 9: pipeline parallelism and latency under load are covered, with Trainium rows
    assert sum(r.kind == "pipeline" for r in v.ROWS) >= 2
    assert sum(r.kind == "latency-under-load" for r in v.ROWS) >= 2
    assert any(v._vendor(r) == "AWS" for r in v.ROWS)
    assert got <= kinds


def test_error_summary_groups_medians_and_worst():
    rows = [{"kind": "a", "vendor": "X", "error_pct": e} for e in (-1.0, 4.0, -9.0)]
    rows += [{"kind": "b", "vendor": "Y", "error_pct": e} for e in (10.0, -30.0)]
    by_kind = v.error_summary(rows, "kind")
    assert by_kind == {"a": (3, 4.0, 9.0), "b": (2, 30.0, 30.0)}
    md = v.to_markdown([{**r, "what": "w", "unit": "u", "measured": 1.0, "predicted": 1.0, "source": "s"}
                        for r in rows])
    assert "| category | rows | median abs error | max abs error |" in md
    assert "| b | 2 | 30.0% | 30.0% |" in md and "| X | 3 | 4.0% | 9.0% |" in md


def test_pipeline_rows_change_with_pp():
    """The PP rows really go through pp stages: two stages hold twice the KV of one, so the decode-heavy
    throughput more than doubles (as TensorRT-LLM's table does, 1787 -> 3707 tok/s)."""
    one = v._offline_output_tokens_per_s("llama-3.1-70b", "rtx-pro-6000", 1, 1000, 1000, 400, pp=1, precision="nvfp4")
    two = v._offline_output_tokens_per_s("llama-3.1-70b", "rtx-pro-6000", 1, 1000, 1000, 400, pp=2, precision="nvfp4")
    assert two > 1.5 * one


def test_closed_loop_itl_grows_with_concurrency():
    lo = v._closed_loop_itl_ms("llama-3.1-8b", "h100-sxm", 1, 512, 64, 1, requests_per_client=2)
    hi = v._closed_loop_itl_ms("llama-3.1-8b", "h100-sxm", 1, 512, 64, 64, requests_per_client=2)
    assert lo == pytest.approx(v._single_stream_p50_ms("llama-3.1-8b", "h100-sxm", 1, 512, 64, "tpot", "fp8"),
                               rel=1e-6)
    assert hi > lo
