"""Model presets for published results, serving-stack presets, and the CLI reporting what it used."""

import json

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from firstlight.core.hardware import load_spec
from firstlight.sim.cli import app
from firstlight.sim.cost import CostModel
from firstlight.sim.model import load_model
from firstlight.sim.serve import ServeConfig, run_serve
from firstlight.sim.stack import StackCost, StackError, builtin_stack_dir, builtin_stacks, load_stack
from firstlight.sim.workload import Workload


@pytest.mark.parametrize("name,total_b,active_b", [
    ("llama-2-13b", 13.0, 13.0), ("mixtral-8x22b", 140.6, 39.2), ("qwen3-8b", 8.19, 8.19),
    ("qwen3-32b", 32.8, 32.8), ("qwen3-30b-a3b", 30.5, 3.3), ("qwen3-235b-a22b", 235.1, 22.2),
    ("qwen3-0.6b", 0.6, 0.6), ("llama-3.1-405b", 405.9, 405.9), ("deepseek-v3", 671.0, 37.5),
])
def test_presets_match_published_parameter_counts(name, total_b, active_b):
    m = load_model(name)
    assert m.num_params() / 1e9 == pytest.approx(total_b, rel=0.01)
    assert m.num_active_params() / 1e9 == pytest.approx(active_b, rel=0.02)


def test_every_stack_has_a_source_and_the_five_vendor_stacks_ship():
    assert {"trtllm", "vllm", "jetstream", "tt-metal", "neuron"} <= set(builtin_stacks())
    for n in builtin_stacks():
        assert load_stack(n).source.strip()


def test_jetstream_pads_every_decode_to_its_slots():
    cm = CostModel(load_model("llama-3.1-8b"), load_spec("tpu-v6e"))
    js = StackCost(cm, load_stack("jetstream"))
    assert js.step_time(5, 5, 5, 5000.0) == pytest.approx(cm.step_time(128, 128, 5, 5000.0))
    # vLLM pads 5 -> 8 (a captured CUDA graph) and runs 600 eagerly with its launch cost
    vl = StackCost(cm, load_stack("vllm"))
    assert vl.step_time(5, 5, 5, 5000.0) == pytest.approx(cm.step_time(8, 8, 5, 5000.0))
    assert vl.step_time(600, 600, 600, 6e5) == pytest.approx(cm.step_time(600, 600, 600, 6e5) + 500e-6)
    # whole-prompt prefill padded to the next bucket
    assert js.step_time(1000, 1, 0, 0.0, [(1000, 0)]) == pytest.approx(cm.step_time(1024, 1, 0, 0.0, [(1024, 0)]))


def test_static_batching_makes_late_requests_wait_for_the_batch_to_drain(tmp_path):
    st = yaml.safe_load((builtin_stack_dir() / "vllm.yaml").read_text())
    st.update(name="static", inflight_batching=False)
    path = tmp_path / "static.yaml"
    path.write_text(yaml.safe_dump(st))
    wl = Workload(np.array([0.0, 0.05]), np.array([128, 128]), np.array([64, 64]))
    model, hw = load_model("llama-3.1-8b"), load_spec("h100")

    def ttft_second(stack: str) -> float:
        r, res = run_serve(model, hw, wl, ServeConfig(stack=stack))
        return float(res.reqs.first_token[1] - res.reqs.arrival[1]), float(res.reqs.finish[0])

    cont, _ = ttft_second("vllm")
    static, first_done = ttft_second(str(path))
    assert static > first_done - 0.05 > cont  # joins only after request 0 finished


def test_unknown_stack_names_the_choices():
    with pytest.raises(StackError, match="tt-metal"):
        load_stack("sglang-2")


def test_cli_serve_reports_precision_and_stack():
    r = CliRunner().invoke(app, ["serve", "--hw", "t3k", "--tp", "8", "--model", "llama-3.1-8b", "--precision",
                                 "tt-performance", "--stack", "tt-metal", "--rate", "2", "--num-requests", "20"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout[r.stdout.index("{"):])
    assert out["precision"]["name"] == "tt-performance" and out["precision"]["mlp_weights"] == "bfp4"
    assert out["stack"]["name"] == "tt-metal"
    assert "precision profile: tt-performance" in r.output


def test_cli_bad_precision_names_the_key(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text(yaml.safe_dump({"name": "x", "source": "t", "attention_weights": "bf16", "mlp_weights": "bf16",
                                 "kv_cache": "bf16", "activations": "bf16", "router_weights": "int8"}))
    r = CliRunner().invoke(app, ["step", "--precision", str(p)])
    assert r.exit_code != 0 and "unknown tensor group 'router_weights'" in str(r.exception)


def test_compare_marks_a_system_the_model_does_not_fit():
    from firstlight.sim.compare import CompareSpec, evaluate_system, to_markdown

    spec = CompareSpec(model="llama-3.1-405b")
    row = evaluate_system("wormhole-n300", "tt-performance", "tt-metal", spec)
    assert row["fits"] is False
    assert "| wormhole-n300 | 2 | tt-performance | tt-metal | does not fit |" in to_markdown([row], spec)


@pytest.mark.slow
def test_compare_finds_a_sustained_rate_that_meets_the_slo():
    from firstlight.sim.compare import CompareSpec, evaluate_system

    spec = CompareSpec(model="llama-3.1-8b", prompt_len=256, output_len=64, slo_ttft_s=1.0, slo_tpot_s=0.05,
                       num_requests=50, window_s=20)
    row = evaluate_system("hgx-h100", "fp8", "trtllm", spec)
    assert row["meets_slo"] and row["ttft_p90_s"] <= 1.0 and row["tpot_p90_s"] <= 0.05
    assert row["output_tokens_per_s"] == pytest.approx(row["rate_per_system"] * 64)


def test_cli_serve_stack_knobs_yield_to_explicit_options_and_combine_with_a_cluster(tmp_path):
    """--stack sets the scheduler knobs unless the option is given; it composes with --nodes and the dtype flags."""
    args = ["serve", "--hw", "h100", "--model", "llama-3.1-8b", "--precision", "fp8", "--kv-dtype", "bf16",
            "--stack", "trtllm", "--rate", "2", "--num-requests", "10", "--prompt-len", "128", "--output-len", "8",
            "--tp", "2", "--nodes", "1"]
    r = CliRunner().invoke(app, args + ["--out", str(tmp_path / "a")])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "a" / "result.json").read_text())["config"]
    st = load_stack("trtllm")
    assert (cfg["max_num_seqs"], cfg["block_size"]) == (2048, 32) == (st.max_num_seqs, st.block_size)
    assert cfg["stack"] == "trtllm" and cfg["cluster"]["num_nodes"] == 1
    assert json.loads(r.stdout[r.stdout.index("{"):])["precision"]["kv_cache"] == "bf16"
    r = CliRunner().invoke(app, args + ["--max-num-seqs", "3", "--out", str(tmp_path / "b")])
    assert r.exit_code == 0, r.output
    cfg = json.loads((tmp_path / "b" / "result.json").read_text())["config"]
    assert cfg["max_num_seqs"] == 3 and cfg["block_size"] == st.block_size
