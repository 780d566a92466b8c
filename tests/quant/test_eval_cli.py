"""`firstlight eval ppl|kl` on a tiny checkpoint: the table/JSON it prints and its input errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from firstlight.errors import FirstlightError
from firstlight.eval.cli import app

runner = CliRunner()


def test_ppl_with_quantization_prints_ratio_and_kl(tiny_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("FIRSTLIGHT_HOME", str(tmp_path))  # the GPTQ cache goes there
    calib = tmp_path / "calib.txt"
    calib.write_text("Some calibration text that is not the evaluation text, repeated a while. " * 40)
    res = runner.invoke(app, ["ppl", "--model", str(tiny_dirs["llama"]), "--quantization", "int8,fp8",
                              "--max-tokens", "200", "--window", "64", "--stride", "32", "--json",
                              "--calibration", str(calib)])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    rows = {r["format"]: r for r in out["results"]}
    assert set(rows) == {"none", "int8", "fp8"}
    assert rows["none"]["ppl_ratio"] == 1.0 and rows["none"]["num_tokens"] == 199
    assert rows["int8"]["method"] == "gptq" and "calib.txt" in rows["int8"]["calibration"]  # the default per format
    assert rows["fp8"]["method"] == "gptq"
    assert list((tmp_path / "cache" / "quant").glob("gptq-int8-*.safetensors"))
    for fmt in ("int8", "fp8"):
        r = rows[fmt]
        assert r["ppl_ratio"] == pytest.approx(r["perplexity"] / rows["none"]["perplexity"])
        assert r["mean_kl"] > 0 and r["weight_bytes"] < rows["none"]["weight_bytes"]


def test_kl_table(tiny_dirs):
    res = runner.invoke(app, ["kl", "--model", str(tiny_dirs["qwen2"]), "--quantization", "int4",
                              "--max-tokens", "100", "--window", "64", "--stride", "32"])
    assert res.exit_code == 0, res.output
    assert "int4" in res.output and "mean KL" in res.output


def test_empty_corpus_and_bad_inputs_are_errors(tiny_dirs, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n \n")
    model = str(tiny_dirs["llama"])
    res = runner.invoke(app, ["ppl", "--model", model, "--corpus", str(empty)])
    assert isinstance(res.exception, FirstlightError) and "is empty" in str(res.exception)
    res = runner.invoke(app, ["kl", "--model", model, "--quantization", "none"])
    assert isinstance(res.exception, FirstlightError) and "must name a format" in str(res.exception)
    res = runner.invoke(app, ["ppl", "--model", model, "--quantization", "int2", "--max-tokens", "50"])
    assert isinstance(res.exception, FirstlightError) and "unknown quantization format 'int2'" in str(res.exception)
    res = runner.invoke(app, ["ppl", "--model", model, "--window", "64", "--stride", "64"])
    assert isinstance(res.exception, FirstlightError) and "--stride" in str(res.exception)
