"""`firstlight verify` end to end: exit codes, reports, bad input."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from firstlight.cli import app


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


def _run(runner, *args):
    return runner.invoke(app, ["verify", *args, "--new-tokens", "4", "--ppl-tokens", "0"])


def test_match_exits_0_and_writes_report(runner, tiny_dirs, tmp_path):
    out = tmp_path / "rep"
    res = _run(runner, "--model", str(tiny_dirs["llama"]), "--target", "eager", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "MATCH" in res.output
    data = json.loads((out / "result.json").read_text())
    assert data["verdict"] == "match" and data["environment"]["seed"] == 0
    assert (out / "layer_error.png").stat().st_size > 0
    assert "layer_error.png" in (out / "index.html").read_text()
    assert data["paths"]["serve"]["ok"] and "serve path" in (out / "summary.md").read_text()
    assert "serve path (" in res.output  # the terminal summary has the serving path's line


def test_decode_only_fault_exits_1_naming_the_step(runner, tiny_dirs):
    spec = "faulty:op=aten.silu,layer=1,kind=scale,value=1.3,phase=decode"
    res = _run(runner, "--model", str(tiny_dirs["llama"]), "--target", spec, "--decode-steps", "2", "--json")
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert data["first_failing"]["path"] == "serve" and data["first_failing"]["phase"] == "decode"
    assert data["culprit"]["op"] == "aten.silu.default" and data["culprit"]["module"] == "layers.1.mlp"
    assert [s["phase"] for s in data["paths"]["serve"]["steps"]].count("decode") == 2


def test_negative_decode_steps_exits_2(runner, tiny_dirs):
    res = _run(runner, "--model", str(tiny_dirs["llama"]), "--decode-steps", "-1")
    assert res.exit_code == 2 and "--decode-steps -1" in res.output


def test_mismatch_exits_1_with_culprit_json(runner, tiny_dirs, tmp_path):
    spec = "faulty:op=aten.silu,layer=1,kind=offset,value=0.5"
    res = _run(runner, "--model", str(tiny_dirs["llama"]), "--target", spec, "--json")
    assert res.exit_code == 1, res.output
    data = json.loads(res.stdout)
    assert data["culprit"]["op"] == "aten.silu.default" and data["culprit"]["module"] == "layers.1.mlp"


def test_unknown_target_exits_2(runner, tiny_dirs):
    res = _run(runner, "--model", str(tiny_dirs["llama"]), "--target", "warp-drive")
    assert res.exit_code == 2 and "unknown target 'warp-drive'" in res.output


def test_target_file_without_class_exits_2(runner, tiny_dirs, tmp_path):
    f = tmp_path / "t.py"
    f.write_text("x = 1\n")
    res = _run(runner, "--model", str(tiny_dirs["llama"]), "--target", f"{f}:Chip")
    assert res.exit_code == 2 and "has no class 'Chip'" in res.output


def test_target_raising_while_compiling_exits_2(runner, tiny_dirs, tmp_path):
    f = tmp_path / "broken.py"
    f.write_text(
        "from firstlight.targets import Target\n"
        "class Broken(Target):\n"
        "    def compile(self, unit, example_inputs, key):\n"
        "        raise NotImplementedError('no kernel for aten::rsqrt on this chip')\n"
    )
    res = _run(runner, "--model", str(tiny_dirs["llama"]), "--target", f"{f}:Broken")
    assert res.exit_code == 2
    assert "failed to compile" in res.output and "no kernel for aten::rsqrt" in res.output


def test_prompt_file_missing_or_empty_exits_2(runner, tiny_dirs, tmp_path):
    res = _run(runner, "--model", str(tiny_dirs["llama"]), "--prompt-file", str(tmp_path / "none.txt"))
    assert res.exit_code == 2 and "not found" in res.output
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    res = _run(runner, "--model", str(tiny_dirs["llama"]), "--prompt-file", str(empty))
    assert res.exit_code == 2 and "is empty" in res.output


def test_prompt_file_is_used(runner, tiny_dirs, tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("Shall I compare thee to a summer's day?")
    res = runner.invoke(app, ["verify", "--model", str(tiny_dirs["qwen2"]), "--prompt-file", str(p), "--json",
                              "--new-tokens", "3", "--ppl-tokens", "0"])
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["tokens"]) == json.loads(res.stdout)["prompt_len"] + 3


def test_quantized_model_is_verified_and_its_error_located(runner, tiny_dirs):
    """int8 weights diverge measurably from the fp32 reference: verify runs and reports a mismatch."""
    res = _run(runner, "--model", str(tiny_dirs["llama"]), "--target", "eager", "--quantization", "int8", "--json")
    assert res.exit_code == 1, res.output
    data = json.loads(res.output.strip().splitlines()[-1])
    assert data["verdict"] != "match"


def test_unknown_quantization_exits_2(runner, tiny_dirs):
    res = _run(runner, "--model", str(tiny_dirs["llama"]), "--quantization", "int3")
    assert res.exit_code == 2
    assert "unknown quantization format 'int3'" in res.output
