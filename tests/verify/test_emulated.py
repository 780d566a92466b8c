"""Emulated chips (`emulate:<chip>`): spec numerics, op coverage at compile time, overrides, pricing."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from firstlight.cli import app
from firstlight.core.hardware import HardwareSpecError, builtin_spec_dir, load_spec_file
from firstlight.models.loader import load_model
from firstlight.targets.base import TargetError
from firstlight.targets.emulated import EmulatedTarget, emulated_chips
from firstlight.targets.registry import get_target
from firstlight.verify import units as U
from firstlight.verify.harness import VerifyConfig, run_verify

ISSUE_CHIPS = ["wormhole-n300", "blackhole-p150", "trn2", "h100", "mi300x", "tpu-v5e", "mx"]


def _spec(tmp_path: Path, chip: str = "tpu-v5e", **numerics) -> Path:
    data = yaml.safe_load((builtin_spec_dir() / f"{chip}.yaml").read_text())
    for key, value in numerics.items():
        data["numerics"][key] = value
    p = tmp_path / f"{chip}-custom.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _verify(tiny_dirs, references, target: EmulatedTarget, family: str = "llama", new_tokens: int = 4):
    return run_verify(tiny_dirs[family], target, f"emulate:{target.chip}", prompt_ids=list(range(3, 35)),
                      config=VerifyConfig(new_tokens=new_tokens, ppl_tokens=0), reference=references(family))


@pytest.mark.parametrize("chip", ISSUE_CHIPS)
def test_every_issue_chip_has_sourced_numerics(chip):
    t = get_target(f"emulate:{chip}")
    assert isinstance(t, EmulatedTarget) and t.numerics.lowered_ops
    assert all(t.numerics.sources[k] for k in ("activation", "matmul", "lowered_ops"))
    assert t.tolerance_dtype in (torch.bfloat16, torch.float16, torch.float32)


def test_emulated_chips_lists_them():
    chips = emulated_chips()
    for name in ("wormhole-n300", "blackhole-p150", "trainium2", "h100-sxm", "mi300x", "tpu-v5e", "mx"):
        assert name in chips


@pytest.mark.parametrize("spec, match", [
    ("emulate:not-a-chip", "unknown hardware 'not-a-chip'"),
    ("emulate:a100", "no numerics section"),
    ("emulate", "needs a chip"),
    ("emulate:tpu-v5e,bogus=1", "unknown option"),
])
def test_bad_chip_is_a_target_error(spec, match):
    with pytest.raises(TargetError, match=match):
        get_target(spec)


def test_emulated_chip_refuses_a_low_precision_dtype():
    with pytest.raises(TargetError, match="--dtype float32"):
        get_target("emulate:tpu-v5e", torch.bfloat16)


def test_malformed_numerics_names_the_key(tmp_path):
    with pytest.raises(HardwareSpecError, match=r"numerics\.matmul\.bogus"):
        load_spec_file(_spec(tmp_path, matmul={"a_format": "bf16", "bogus": 1}))
    bad = yaml.safe_load(_spec(tmp_path).read_text())
    del bad["numerics"]["sources"]["lowered_ops"]
    (tmp_path / "nosrc.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(HardwareSpecError, match="numerics.sources has no entry for .*lowered_ops"):
        load_spec_file(tmp_path / "nosrc.yaml")
    with pytest.raises(TargetError, match=r"numerics\.matmul\.b_format.*no_such_format"):
        get_target(f"emulate:{_spec(tmp_path, matmul={'b_format': 'no_such_format'})}")
    with pytest.raises(TargetError, match=r"transcendentals\.exp"):
        get_target(f"emulate:{_spec(tmp_path, transcendentals={'exp': 'nope'})}")


def test_bf16_chip_matches_tiny_model_at_bf16_tolerance(tiny_dirs, references):
    r = _verify(tiny_dirs, references, get_target("emulate:tpu-v5e"))
    assert r.verdict == "match", r.reasons
    assert r.tolerance["dtype"] == "bfloat16"
    rep = r.target_report
    assert rep["ops_lowered"]["aten.mm"] > 0 and rep["ops_lowered"]["aten._softmax"] > 0
    pred = rep["details"]["predicted"]
    assert pred["chip"] == "tpu-v5e" and pred["decode_tokens_per_s"] > 0 and pred["prefill_ms"] > 0


def test_missing_op_fails_at_compile_naming_op_and_line(tmp_path, tiny_dirs, references):
    ops = [o for o in yaml.safe_load((builtin_spec_dir() / "tpu-v5e.yaml").read_text())["numerics"]["lowered_ops"]
           if o != "aten.rsqrt"]
    chip = _spec(tmp_path, lowered_ops=ops)
    with pytest.raises(TargetError, match=r"does not lower aten\.rsqrt .*firstlight/models/layers\.py:\d+"):
        _verify(tiny_dirs, references, get_target(f"emulate:{chip}"))
    # the two remedies a compiler offers: decompose it, or run it on the host
    ov = tmp_path / "ov.yaml"
    ov.write_text(yaml.safe_dump({"rules": [{"op": "aten.rsqrt", "decompose": True}]}))
    t = get_target(f"emulate:{chip},overrides={ov}")
    assert _verify(tiny_dirs, references, t).verdict == "match"
    assert "aten.rsqrt" not in t.ops_emulated and t.ops_emulated["aten.sqrt"] > 0
    ov.write_text(yaml.safe_dump({"rules": [{"op": "aten.rsqrt", "fallback": "host"}]}))
    t = get_target(f"emulate:{chip},overrides={ov}")
    r = _verify(tiny_dirs, references, t)
    assert r.verdict == "match" and t.ops_host["aten.rsqrt"] > 0
    assert r.target_report["details"]["predicted"]["host_fallback_ms_per_step"] > 0


def test_block_float_low_fidelity_chip_fails_and_blames_a_matmul(tmp_path, tiny_dirs, references):
    chip = _spec(tmp_path, "wormhole-n300", matmul={"a_format": "bfp4_b", "b_format": "bfp4_b", "fidelity": "lofi",
                                                    "accumulator": "bf16"},
                 lowered_ops=yaml.safe_load((builtin_spec_dir() / "tpu-v5e.yaml").read_text())["numerics"]["lowered_ops"])
    r = _verify(tiny_dirs, references, get_target(f"emulate:{chip}"))
    assert r.verdict == "mismatch"
    assert r.first_failing is not None
    assert r.culprit is None or r.culprit["op"].startswith(("aten.mm", "aten.addmm"))


def test_overrides_change_the_numerics_of_matching_ops_only(tmp_path, tiny_checkpoint):
    model, _ = load_model(tiny_checkpoint("llama", seed=3), torch.float32, with_tokenizer=False)
    ov = tmp_path / "ov.yaml"
    ov.write_text(yaml.safe_dump({"rules": [
        {"module": "layers.*.mlp", "matmul": {"b_format": "bfp4_b", "fidelity": "hifi4", "accumulator": "fp32"}},
        {"module": "lm_head", "activation": "fp32"},
        {"op": "aten.exp", "transcendental": "exact"},
    ]}))
    t = get_target(f"emulate:wormhole-n300,overrides={ov}")
    t.prepare(model)
    mlp = t.site_numerics("layers.2.mlp.down_proj", "aten.mm")
    attn = t.site_numerics("layers.2.self_attn.o_proj", "aten.mm")
    assert (mlp.matmul.b_format, mlp.matmul.fidelity, mlp.matmul.accumulator) == ("bfp4_b", "hifi4", "fp32")
    assert (attn.matmul.b_format, attn.matmul.fidelity) == ("bfp8_b", "lofi")
    assert t.site_numerics("lm_head", "aten.mm").activation == "fp32"
    assert t.site_numerics("layers.0.self_attn", "aten.exp").impl == "exact"
    assert t.site_numerics("layers.0.self_attn", "aten.bmm").matmul.b_format == "bf16"
    # cheaper weights are priced as fewer bytes
    base = get_target("emulate:wormhole-n300")
    base.prepare(load_model(tiny_checkpoint("llama", seed=3), torch.float32, with_tokenizer=False)[0])
    assert t.report().details["predicted"]["weight_bytes"] < base.report().details["predicted"]["weight_bytes"]


@pytest.mark.parametrize("rule, match", [
    ({"module": "layers.99.mlp", "activation": "fp32"}, r"rules\[0\]\.module: 'layers\.99\.mlp' names no module"),
    ({"op": "aten.not_an_op", "activation": "fp32"}, r"rules\[0\]\.op: 'aten\.not_an_op' is not an ATen op"),
    ({"op": "aten.mm", "matmul": {"fidelity": "ultra"}}, r"rules\[0\]\.matmul\.fidelity: unknown math fidelity"),
    ({"op": "aten.mm", "colour": "red"}, r"rules\.0\.colour: unknown key"),
    ({"op": "aten.cos", "decompose": True}, r"no decomposition for 'aten\.cos'"),
])
def test_bad_overrides_are_named(tmp_path, tiny_checkpoint, rule, match):
    ov = tmp_path / "ov.yaml"
    ov.write_text(yaml.safe_dump({"rules": [rule]}))
    with pytest.raises(TargetError, match=match):
        t = get_target(f"emulate:tpu-v5e,overrides={ov}")
        t.prepare(load_model(tiny_checkpoint("llama", seed=3), torch.float32, with_tokenizer=False)[0])


def test_verify_cli_bad_override_exits_2_and_writes_nothing(tmp_path, tiny_dirs):
    ov = tmp_path / "ov.yaml"
    ov.write_text(yaml.safe_dump({"rules": [{"module": "no.such.module", "activation": "fp32"}]}))
    out = tmp_path / "rep"
    res = CliRunner().invoke(app, ["verify", "--model", str(tiny_dirs["llama"]), "--target", "emulate:tpu-v5e",
                                   "--overrides", str(ov), "--out", str(out), "--new-tokens", "2", "--ppl-tokens", "0"])
    assert res.exit_code == 2, res.output
    assert "no.such.module" in res.output and not out.exists()
    res = CliRunner().invoke(app, ["verify", "--model", str(tiny_dirs["llama"]), "--target", "emulate:nope",
                                   "--out", str(out)])
    assert res.exit_code == 2 and "unknown hardware 'nope'" in res.output and not out.exists()


def test_verify_cli_reports_predicted_time(tmp_path, tiny_dirs):
    res = CliRunner().invoke(app, ["verify", "--model", str(tiny_dirs["qwen3"]), "--target", "emulate:trn2",
                                   "--json", "--new-tokens", "2", "--ppl-tokens", "0"])
    assert res.exit_code in (0, 1), res.output
    data = json.loads(res.stdout)
    assert data["target_report"]["details"]["predicted"]["chip"] == "trainium2"


def test_emulation_is_deterministic_and_same_under_inference_mode(tiny_checkpoint):
    model, _ = load_model(tiny_checkpoint("gemma3_text", seed=3), torch.float32, with_tokenizer=False)
    t = get_target("emulate:wormhole-n300,overrides=" + str(_host_tables()))
    model = t.prepare(model)
    unit = U.logits_unit(model)
    ids = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(0))
    params = [p.detach() for p in unit.params()]
    fn = t.compile(unit, (ids, *params), "logits")
    with torch.no_grad():
        a, b = fn(ids, *params), fn(ids, *params)
    with torch.inference_mode():
        c = fn(ids, *params)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(a, model(ids))  # it did compute differently from eager fp32


def _host_tables() -> Path:
    import tempfile

    p = Path(tempfile.mkdtemp()) / "host-tables.yaml"
    p.write_text(yaml.safe_dump({"rules": [{"op": "aten.cos", "fallback": "host"},
                                           {"op": "aten.sin", "fallback": "host"}]}))
    return p


def test_stochastic_rounding_is_seeded(tiny_checkpoint, tmp_path):
    model, _ = load_model(tiny_checkpoint("llama", seed=3), torch.float32, with_tokenizer=False)
    ov = tmp_path / "sr.yaml"
    ov.write_text(yaml.safe_dump({"rules": [{"matmul": {"accumulator": "bf16", "rounding": "stochastic"}}]}))
    outs = []
    for seed in (1, 1, 2):
        t = get_target(f"emulate:tpu-v5e,overrides={ov},seed={seed}")
        m = t.prepare(copy.deepcopy(model))
        unit = U.logits_unit(m)
        params = [p.detach() for p in unit.params()]
        ids = torch.arange(3, 40)[None]
        with torch.no_grad():
            outs.append(t.compile(unit, (ids, *params), "logits")(ids, *params))
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])
