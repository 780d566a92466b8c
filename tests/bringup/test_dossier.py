"""The dossier on tiny random checkpoints: sections, plots, the engine run, projections, bad input."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from firstlight.bringup import dossier_engine as DE
from firstlight.bringup.dossier import (
    DossierError,
    EngineRunSpec,
    ProjectionSpec,
    verify_section,
    write_dossier,
)
from firstlight.bringup.dossier_project import check_chips, project
from firstlight.cli import app

# small enough for the fast tier: a short arrival window, one bisection step
FAST_PROJECTION = ProjectionSpec(num_requests=16, window_s=1.0, max_requests=400, num_bisect=1, prompt_len=64,
                                 output_len=16)
SECTIONS = {"verify", "quality", "configuration", "engine", "projections", "environment", "plots", "model", "target"}


def _reference_server(first_token_ms: float, per_token_ms: float):
    """A stand-in for `firstlight serve` with exact latencies (bench/reference.py), quick to start."""
    def command(model_path: Path, port: int, spec: EngineRunSpec, threads: int) -> list[str]:
        return [sys.executable, "-m", "firstlight.bench.reference", "--port", str(port),
                "--first-token-ms", str(first_token_ms), "--per-token-ms", str(per_token_ms)]
    return command


@pytest.fixture(scope="module")
def overrides_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("ov") / "overrides.yaml"
    p.write_text("rules:\n- module: lm_head\n  matmul:\n    b_format: bf16\n")
    return p


def test_dossier_has_every_section_and_embeds_its_plots(tiny_checkpoint, overrides_file, tmp_path, monkeypatch):
    monkeypatch.setattr(DE, "_server_command", _reference_server(30.0, 3.0))
    model = tiny_checkpoint("llama", seed=3)
    out = tmp_path / "d"
    html = write_dossier(out, model=str(model), target="emulate:h100", overrides_file=overrides_file,
                         verify_result=None, project=["h100", "trn2"], bench=True,
                         engine=EngineRunSpec(num_requests=4, input_len=16, output_len=8, time_limit_s=120, threads=1),
                         projection=FAST_PROJECTION, verify_new_tokens=4, verify_ppl_tokens=128, threads=1)
    assert html == out / "index.html"
    d = json.loads((out / "dossier.json").read_text())
    assert set(d) >= SECTIONS
    # verify: every path it ran, with the numbers of the result it ran
    paths = {r["path"]: r for r in d["verify"]["paths"]}
    assert {"full forward: units in isolation", "full forward: teacher-forced logits",
            "perplexity (sliding windows)"} <= set(paths)
    assert d["verify"]["verdict"] in ("match", "mismatch") and d["verify"]["source"] == "run by the dossier"
    q = d["quality"]
    assert q["perplexity_ratio"] > 0 and q["perplexity_tokens"] == 127  # 128 tokens: 127 predictions
    assert 0 <= q["top1_agreement"] <= 1 and q["mean_kl"] >= 0
    # configuration: the overrides file as given and the chip's prediction for it
    c = d["configuration"]
    assert c["overrides_yaml"] == overrides_file.read_text() and c["overrides"]["rules"][0]["module"] == "lm_head"
    assert c["predicted"]["chip"] == "h100-sxm" and c["predicted"]["decode_tokens_per_s"] > 0
    assert f"--overrides {overrides_file}" in c["verify_command"]
    # engine: what the bench measured against a server with known latencies
    e = d["engine"]
    assert e["status"] == "ok", e
    assert e["num_ok"] == 4 and e["output_tokens_per_s"] > 0
    # the stand-in sends its first token at 30 ms and one every 3 ms after it (its words re-tokenize into a
    # different count with the tiny tokenizer, so TPOT per token is not 3 ms; the times are)
    assert 30.0 <= e["ttft_ms"]["median"] < 2000 and 30.0 + 7 * 3.0 <= e["e2e_ms"]["median"] < 5000
    assert e["machine"]["num_cpus"] == os.cpu_count() and e["machine"]["server_torch_threads"] == 1
    assert (out / "engine" / "bench" / "result.json").is_file()
    # projections: one row per chip, the rate found meets the SLO and the next one tried does not
    rows = {r["chip"]: r for r in d["projections"]["chips"]}
    assert set(rows) == {"h100", "trn2"}
    for r in rows.values():
        assert r["fits"] and r["meets_slo"] and r["output_tokens_per_s"] > 0 and r["usd_per_1m_output_tokens"] > 0
        assert r["ttft_p90_s"] <= FAST_PROJECTION.slo_ttft_s and r["tpot_p90_s"] <= FAST_PROJECTION.slo_tpot_s
        assert r["first_failing_rate_req_per_s"] is None or r["first_failing_rate_req_per_s"] > r["rate_req_per_s"]
    # the page embeds every plot, and each is a PNG next to it
    page = html.read_text()
    assert set(d["plots"]) == {"dossier-verify.png", "dossier-engine.png", "dossier-projections.png"}
    for name in d["plots"]:
        assert f"<img src='{name}'" in page
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "h100-sxm" in page and "trainium2" in page


def test_no_bench_skips_the_engine(tiny_checkpoint, tmp_path, monkeypatch):
    def never(*a, **k):
        raise AssertionError("the engine must not start with --no-bench")

    monkeypatch.setattr(DE, "_server_command", never)
    out = tmp_path / "d"
    res = CliRunner().invoke(app, ["dossier", "--model", str(tiny_checkpoint("llama", seed=3)), "--target", "eager",
                                   "--out", str(out), "--no-bench", "--ppl-tokens", "0", "--new-tokens", "4"])
    assert res.exit_code == 0, res.output
    d = json.loads((out / "dossier.json").read_text())
    assert d["engine"] == {"status": "skipped", "reason": "--no-bench"}
    assert not (out / "engine").exists() and "dossier-engine.png" not in d["plots"]
    assert d["verify"]["verdict"] == "match"  # eager fp32 is the reference's arithmetic
    assert d["configuration"]["predicted"] is None and d["projections"]["chips"] == []


def test_a_target_that_does_not_compile_is_reported_not_raised(tiny_checkpoint, failing_chip, tmp_path):
    out = tmp_path / "d"
    write_dossier(out, model=str(tiny_checkpoint("llama", seed=3)), target=f"emulate:{failing_chip}",
                  overrides_file=None, verify_result=None, project=[], bench=False, verify_new_tokens=4,
                  verify_ppl_tokens=0)
    d = json.loads((out / "dossier.json").read_text())
    assert d["verify"]["verdict"] == "could not run" and "aten.cos" in d["verify"]["error"]
    assert d["quality"] == {"measured": False}
    assert "aten.cos" in (out / "index.html").read_text()


def test_an_engine_that_fails_is_reported_with_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr(DE, "_server_command", lambda *a: [sys.executable, "-c",
                                                            "import sys; print('no such model here'); sys.exit(3)"])
    rec = DE.measure_engine(tmp_path / "m", tmp_path / "engine", EngineRunSpec(time_limit_s=60))
    assert rec["status"] == "failed" and "exited with code 3" in rec["reason"]
    assert "no such model here" in rec["server_log_tail"]


def test_projection_reports_a_chip_that_misses_the_slo(tiny_checkpoint):
    spec = ProjectionSpec(num_requests=8, window_s=1.0, max_requests=50, slo_tpot_s=1e-7, prompt_len=32,
                          output_len=8)
    r = project(tiny_checkpoint("llama", seed=3), check_chips(["trn2"]), spec)["chips"][0]
    assert r["fits"] and not r["meets_slo"] and r["rate_req_per_s"] == spec.min_rate and r["num_simulations"] == 1
    assert r["tpot_p90_s"] > spec.slo_tpot_s


def test_verify_section_shows_serving_paths_and_new_sections():
    result = {"verdict": "mismatch", "reasons": ["decode path: step 2"],
              "boundaries": [{"name": "embed", "isolated": {"ok": True, "rel_l2": 0.0}}],
              "parity": {"ok": True, "top1_agreement": 1.0, "mean_kl": 0.0, "num_positions": 9},
              "paths": {"decode": {"ok": False, "steps": [{"max_row_mean_kl": 0.5}, {"max_row_mean_kl": 2.0}],
                                   "first_failing_step": 1, "kv_cache": {"ok": True, "max_rel_l2": 0.0}}},
              "tables": [{"name": "rope.cos", "ok": False}, {"name": "mask", "ok": True}],
              "chunked": {"ok": True, "note": "a section a newer verify adds"},
              "long_range": {"first_position": 70, "window": 128, "first_unit": "layers.2", "mode": "isolated"}}
    s = verify_section(result, None, "given")
    rows = {r["path"]: r for r in s["paths"]}
    assert rows["serving path: decode"]["ok"] is False
    assert "first failing step 1" in rows["serving path: decode"]["detail"]
    assert "worst row mean KL 2" in rows["serving path: decode"]["detail"]
    assert rows["tables (rotary, masks, scales)"]["ok"] is False and "rope.cos" in rows["tables (rotary, masks, scales)"]["detail"]
    assert rows["chunked"]["ok"] is True
    assert s["findings"]["long_range"]["first_position"] == 70


@pytest.mark.parametrize("args, match", [
    (["--target", "emulate:h100", "--project", "h100,nochip"], "--project chip 'nochip'"),
    (["--target", "emulate:nope"], "unknown hardware 'nope'"),
    (["--target", "nope"], "unknown target 'nope'"),
    (["--target", "emulate:h100", "--overrides", "/nonexistent/ov.yaml"], "no such file"),
    (["--target", "emulate:h100", "--slo", "ttft=fast"], "not a number"),
])
def test_bad_input_exits_2_and_writes_nothing(tiny_checkpoint, tmp_path, args, match):
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["dossier", "--model", str(tiny_checkpoint("llama", seed=3)), "--out", str(out),
                                   *args])
    assert res.exit_code == 2, res.output
    assert match in res.output and not out.exists()


def test_unwritable_out_exits_2(tiny_checkpoint, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = CliRunner().invoke(app, ["dossier", "--model", str(tiny_checkpoint("llama", seed=3)), "--target", "eager",
                                   "--out", str(blocker / "sub")])
    assert res.exit_code == 2 and "cannot write" in res.output


def test_bringup_rejects_an_unknown_project_chip_before_writing(tiny_checkpoint, tmp_path):
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bringup", "--model", str(tiny_checkpoint("llama", seed=3)), "--target",
                                   "emulate:h100", "--project", "trn2,warp-drive", "--out", str(out)])
    assert res.exit_code == 2 and "'warp-drive'" in res.output and not out.exists()


def test_check_chips_names_the_unknown_chip():
    with pytest.raises(DossierError, match="'tpu-v99'"):
        check_chips(["h100", "tpu-v99"])


@pytest.mark.slow
def test_engine_run_on_our_engine(tiny_checkpoint, tmp_path):
    """The real `firstlight serve` on a tiny model, driven by the bench (about 30 s on 2 busy cores)."""
    rec = DE.measure_engine(tiny_checkpoint("llama", seed=3), tmp_path / "engine",
                            EngineRunSpec(num_requests=4, input_len=16, output_len=8, time_limit_s=240, threads=1))
    assert rec["status"] == "ok", rec
    assert rec["num_ok"] == 4 and rec["ttft_ms"]["median"] > 0 and rec["output_tokens_per_s"] > 0
    rows = [json.loads(line) for line in (tmp_path / "engine" / "bench" / "requests.jsonl").read_text().splitlines()]
    assert [r["usage_completion_tokens"] for r in rows] == [8] * 4  # the engine's own count (ignore_eos)


@pytest.mark.slow
def test_bringup_writes_the_dossier_of_its_final_configuration(tiny_checkpoint, failing_chip, tmp_path):
    """`firstlight bringup` ends with the dossier, on the loop's own final verify result (about 1 min)."""
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["bringup", "--model", str(tiny_checkpoint("llama", seed=3)), "--target",
                                   f"emulate:{failing_chip}", "--goal", "kl<=2e-3,top1>=0.95", "--perf-budget", "0",
                                   "--playbook", str(tmp_path / "pb.json"), "--project", "trn2", "--no-bench",
                                   "--threads", "1", "--out", str(out)])
    assert res.exit_code == 0, res.output
    d = json.loads((out / "dossier.json").read_text())
    assert d["verify"]["source"].startswith("given")
    assert d["configuration"]["overrides_yaml"] == (out / "overrides.yaml").read_text()
    assert "aten.cos" in d["configuration"]["overrides_yaml"] and d["configuration"]["predicted"]["decode_tokens_per_s"] > 0
    state = json.loads((out / "state.json").read_text())
    assert d["quality"]["mean_kl"] == pytest.approx(state["final"]["metrics"]["kl"], abs=1e-12)
    assert d["engine"]["status"] == "skipped" and [r["chip"] for r in d["projections"]["chips"]] == ["trn2"]
    page = (out / "index.html").read_text()
    assert "RUNBOOK.md" in page and "overrides.yaml" in page
