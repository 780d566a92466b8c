"""Mixed precision: per tensor-group dtypes change bytes and math rates where the profile says."""

import pytest

from firstlight.core.batch import Batch, ScheduledSeq
from firstlight.core.hardware import DTYPE_BYTES, EfficiencySpec, load_spec
from firstlight.sim.cost import CostModel
from firstlight.sim.model import load_model
from firstlight.sim.parallel import ParallelConfig, weight_bytes_per_device
from firstlight.sim.precision import PrecisionError, builtin_precisions, load_precision, precision_from_dict

UNIT = EfficiencySpec(compute=1.0, memory=1.0, network=1.0, kernel_overhead_us=0.0, step_overhead_us=0.0)


def test_block_float_bytes_include_the_amortized_scale():
    assert DTYPE_BYTES["bfp8"] == 1 + 1 / 16  # 16 mantissas share an 8-bit exponent
    assert DTYPE_BYTES["bfp4"] == 0.5 + 1 / 16
    assert DTYPE_BYTES["mxfp8"] == 1 + 1 / 32  # OCP MX: one E8M0 scale per 32
    assert DTYPE_BYTES["mxfp6"] == 0.75 + 1 / 32
    assert DTYPE_BYTES["mxfp4"] == 0.5 + 1 / 32
    assert DTYPE_BYTES["nvfp4"] == 0.5 + 1 / 16  # one E4M3 scale per 16


def test_every_builtin_profile_loads_with_a_source():
    names = builtin_precisions()
    for n in ("bf16", "fp8", "fp8-bf16kv", "w4a16", "w8a8", "nvfp4", "mxfp4", "tt-performance", "tt-accuracy"):
        assert n in names
    for n in names:
        assert load_precision(n).source.strip()


def test_tt_performance_weight_bytes_per_group():
    m = load_model("llama-3.1-8b", precision="tt-performance")
    n = m.params_by_group()
    assert sum(n.values()) == m.num_params()
    expected = n["attention"] * (1 + 1 / 16) + n["mlp"] * (0.5 + 1 / 16) + n["embedding"] * (1 + 1 / 16)
    assert m.weight_bytes() == pytest.approx(expected, rel=1e-12)
    assert m.kv_bytes_per_token() == pytest.approx(load_model("llama-3.1-8b").kv_bytes_per_token() / 2 * (1 + 1 / 16))
    # TP shards the same bytes: 8 ways minus the replicated norms
    assert weight_bytes_per_device(m, ParallelConfig(tp=8)) == pytest.approx(m.weight_bytes() / 8, rel=1e-4)


def test_explicit_fp8_profile_equals_the_legacy_single_dtype_path():
    legacy = load_model("llama-3.1-8b", weight_dtype="fp8", kv_dtype="fp8")
    prof = load_model("llama-3.1-8b", precision="fp8")
    b = Batch((ScheduledSeq("p", 512, 0, 512), *(ScheduledSeq(f"d{i}", 1, 900, 900) for i in range(16))))
    hw = load_spec("h100")
    assert CostModel(prof, hw).time(b) == pytest.approx(CostModel(legacy, hw).time(b), rel=1e-12)
    assert prof.weight_bytes() == legacy.weight_bytes()


def test_w4a16_saves_bytes_not_flops():
    """Weight-only int4: decode reads ~1/4 of bf16's weight bytes; prefill runs at the bf16 math rate."""
    hw = load_spec("h100")
    dec = Batch((ScheduledSeq("d", 1, 64, 64),))
    pre = Batch((ScheduledSeq("p", 4096, 0, 4096),))

    def t(prec: str, b: Batch, op: str) -> float:
        cm = CostModel(load_model("llama-3.1-8b", precision=prec), hw, efficiency=UNIT)
        return sum(o.time_s for o in cm.breakdown(b) if o.name == op)

    assert t("w4a16", dec, "gate_up_proj") == pytest.approx(t("bf16", dec, "gate_up_proj") / 4, rel=0.01)
    assert t("w4a16", pre, "gate_up_proj") == pytest.approx(t("bf16", pre, "gate_up_proj"), rel=1e-9)
    assert t("fp8", pre, "gate_up_proj") == pytest.approx(t("bf16", pre, "gate_up_proj") / 2, rel=0.01)


def test_tt_performance_mlp_runs_at_lofi_rate_and_attention_at_hifi2():
    hw = load_spec("wormhole-n150")
    cm = CostModel(load_model("llama-3.1-8b", precision="tt-performance"), hw, efficiency=UNIT)
    assert cm.flops_by_group["mlp"] == pytest.approx(262e12)  # FP8 figure = LoFi
    assert cm.flops_by_group["attention"] == pytest.approx(148e12)  # BLOCKFP8 figure = HiFi2


@pytest.mark.parametrize("data,match", [
    ({"mlp_weight": "bfp4"}, r"unknown tensor group 'mlp_weight'"),
    ({"mlp_weights": "bfp3"}, r"mlp_weights: unknown dtype 'bfp3'"),
    ({"math": {"ffn": "fp8"}}, r"math: unknown math group 'ffn'"),
    ({"math": {"mlp": "fp7"}}, r"math: unknown dtype 'fp7'"),
    ({"source": " "}, r"source: cite where the mix comes from"),
])
def test_bad_profiles_name_the_key(data, match):
    base = {"name": "x", "source": "test", "attention_weights": "bf16", "mlp_weights": "bf16", "kv_cache": "bf16",
            "activations": "bf16"}
    with pytest.raises(PrecisionError, match=match):
        precision_from_dict({**base, **data}, "my.yaml")


def test_unknown_profile_name_lists_the_builtins():
    with pytest.raises(PrecisionError, match="tt-performance"):
        load_precision("fp9")


def test_dtype_flags_override_the_profile_storage_groups_not_its_math():
    """--precision with --weight-dtype / --kv-dtype: the flags replace the profile's storage dtypes only."""
    base = load_model("llama-3.1-8b", precision="tt-performance")
    kv = load_model("llama-3.1-8b", precision="tt-performance", kv_dtype="fp8")
    assert kv.profile.kv_cache == "fp8" and kv.profile.mlp_weights == "bfp4" and kv.profile.name == "tt-performance+kvfp8"
    assert kv.weight_bytes() == base.weight_bytes()
    assert kv.kv_bytes_per_token() == pytest.approx(base.kv_bytes_per_token() / (1 + 1 / 16))
    w = load_model("llama-3.1-8b", precision="tt-performance", weight_dtype="bf16")
    assert {w.profile.weights(g) for g in ("attention", "mlp", "experts", "lm_head")} == {"bf16"}
    assert w.weight_bytes() == pytest.approx(load_model("llama-3.1-8b", precision="bf16").weight_bytes())
    assert w.profile.kv_cache == base.profile.kv_cache
    for g in ("attention", "mlp", "sdpa"):  # math rates stay the profile's (LoFi / HiFi2)
        assert w.profile.math_dtype(g) == base.profile.math_dtype(g)
    with pytest.raises(PrecisionError, match="--weight-dtype 'fp7'"):
        load_model("llama-3.1-8b", precision="fp8", weight_dtype="fp7")
