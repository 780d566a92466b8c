import json

import pytest
from typer.testing import CliRunner

from firstlight.errors import FirstlightError
from firstlight.sim.cli import app

runner = CliRunner()


def test_specs_model_step_collective():
    r = runner.invoke(app, ["specs"])
    assert r.exit_code == 0 and "mi300x" in r.output
    r = runner.invoke(app, ["model", "mixtral-8x7b"])
    assert r.exit_code == 0 and json.loads(r.output)["num_experts"] == 8
    r = runner.invoke(app, ["step", "--hw", "h100", "--model", "llama-3.1-8b", "--batch", "decode:8@512,prefill:256"])
    assert r.exit_code == 0 and "attention" in r.output and "step time" in r.output
    r = runner.invoke(app, ["collective", "--size", "64MB", "--ranks", "8", "--topology", "ring"])
    out = json.loads(r.output)
    assert r.exit_code == 0 and out["routed_s"] >= out["closed_form_s"]


def test_serve_writes_report(tmp_path):
    r = runner.invoke(app, ["serve", "--hw", "h100", "--model", "llama-3.1-8b", "--rate", "5", "--num-requests", "50",
                            "--out", str(tmp_path / "rep")])
    assert r.exit_code == 0, r.output
    res = json.loads((tmp_path / "rep" / "result.json").read_text())
    assert res["num_finished"] == 50 and "environment" in res
    assert (tmp_path / "rep" / "latency_cdfs.png").is_file()


@pytest.mark.parametrize("args,match", [
    (["fit", "--hw", "h100", "--model", "llama-3.1-70b"], "does not fit: needs"),
    (["fit", "--hw", "h100", "--model", "llama-3.1-70b", "--tp", "3"], "does not divide num_attention_heads"),
    (["collective", "--topology", "hypercube"], "unknown topology"),
    (["step", "--hw", "h900"], "unknown hardware"),
])
def test_bad_input_raises_firstlight_error(args, match):
    r = runner.invoke(app, args)
    assert r.exit_code != 0
    assert isinstance(r.exception, FirstlightError)
    assert match in str(r.exception)


def test_sim_never_imports_engine_or_torch():
    import subprocess
    import sys

    code = ("import sys, firstlight.sim.cli, firstlight.sim.serve, firstlight.sim.validation, firstlight.sim.calibrate, firstlight.sim.sweep; "
            "bad=[m for m in sys.modules if m == 'torch' or m.startswith('firstlight.engine')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
