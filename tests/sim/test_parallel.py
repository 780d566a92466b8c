import pytest

from firstlight.core.hardware import load_spec
from firstlight.sim.model import load_model
from firstlight.sim.parallel import (
    DoesNotFitError,
    ParallelConfig,
    ParallelError,
    pipeline_bubble_fraction,
    pipeline_time,
    plan_memory,
    weight_bytes_per_device,
)


def test_tp_must_divide_heads():
    with pytest.raises(ParallelError, match="tp=3 does not divide num_attention_heads=64"):
        plan_memory(load_model("llama-3.1-70b"), load_spec("h100"), ParallelConfig(tp=3))


def test_does_not_fit_names_the_sizes():
    with pytest.raises(DoesNotFitError, match=r"does not fit: needs 1\d\d\.\d GB per device.*has 7\d\.\d GB"):
        plan_memory(load_model("llama-3.1-70b"), load_spec("h100"), ParallelConfig(tp=1))


def test_fits_with_tp8_and_kv_capacity_is_consistent():
    m = load_model("llama-3.1-70b")
    hw = load_spec("h100")
    plan = plan_memory(m, hw, ParallelConfig(tp=8))
    assert plan.weight_bytes == pytest.approx(m.weight_bytes() / 8, rel=0.01)
    assert plan.kv_bytes_per_token == m.kv_bytes_per_token() / 8
    free = plan.capacity_bytes - plan.weight_bytes - plan.activation_bytes
    assert plan.kv_capacity_tokens == int(free // plan.kv_bytes_per_token)


def test_expert_parallel_splits_experts():
    m = load_model("mixtral-8x7b")
    w_tp = weight_bytes_per_device(m, ParallelConfig(tp=8))
    w_ep = weight_bytes_per_device(m, ParallelConfig(tp=8, ep=8))
    assert w_ep == pytest.approx(w_tp)  # same bytes per device, split by expert instead of by column
    with pytest.raises(ParallelError, match="ep=3"):
        plan_memory(m, load_spec("h100"), ParallelConfig(tp=8, ep=3))
    with pytest.raises(ParallelError, match="no experts"):
        plan_memory(load_model("llama-3.1-8b"), load_spec("h100"), ParallelConfig(tp=2, ep=2))


def test_pipeline_bubble():
    assert pipeline_time(1.0, 8, 4) == 11.0
    assert pipeline_bubble_fraction(8, 4) == pytest.approx(3 / 11)
