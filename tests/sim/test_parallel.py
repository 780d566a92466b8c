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
    with pytest.raises(ParallelError, match="--tp 3 does not divide num_attention_heads=64"):
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
    with pytest.raises(ParallelError, match="--ep 3"):
        plan_memory(m, load_spec("h100"), ParallelConfig(tp=8, ep=3))
    with pytest.raises(ParallelError, match="no experts"):
        plan_memory(load_model("llama-3.1-8b"), load_spec("h100"), ParallelConfig(tp=2, ep=2))


def test_pipeline_bubble():
    assert pipeline_time(1.0, 8, 4) == 11.0
    assert pipeline_bubble_fraction(8, 4) == pytest.approx(3 / 11)


def _pp_cost(pp):
    from firstlight.sim.cost import CostModel

    return CostModel(load_model("llama-3.1-70b"), load_spec("h100"), ParallelConfig(tp=2, pp=pp))


@pytest.mark.parametrize("p,m", [(4, 1), (4, 4), (4, 8), (2, 16)])
def test_pipelined_step_bubble_matches_closed_form(p, m):
    cm = _pp_cost(p)
    # 64 decodes at equal context split into m equal micro-batches
    t, stage = cm.pipelined_step_time(64, 64, 64, 64 * 1000.0, [], num_microbatches=m)
    span = t - cm.step_s
    assert 1 - stage / span == pytest.approx(pipeline_bubble_fraction(m, p), rel=1e-12)
    # equal micro-batches: (m + p - 1) slots of one stage time
    assert span == pytest.approx(pipeline_time(stage / m, m, p), rel=1e-12)
    # async (virtual engines): no per-step fill once m >= p
    ta, _ = cm.pipelined_step_time(64, 64, 64, 64 * 1000.0, [], num_microbatches=m, schedule="async")
    assert ta - cm.step_s == pytest.approx(max(m, p) * stage / m, rel=1e-12)


def test_pipelined_step_unequal_microbatches_equals_explicit_stage_simulation():
    """sum(t_i) + (p-1) max(t_i) against a per-stage recurrence: f[i][s] = max(f[i-1][s], f[i][s-1]) + t_i."""
    from firstlight.sim.cost import split_microbatches

    p, m = 4, 3
    cm = _pp_cost(p)
    chunks = [(900, 0), (300, 0), (120, 512), (40, 0)]
    t, stage = cm.pipelined_step_time(10 + 1360, 14, 10, 10 * 700.0, chunks, num_microbatches=m)
    times = [(cm.step_time(*mb) - cm.step_s) / p for mb in split_microbatches(m, 10, 10 * 700.0, chunks)]
    assert len(times) == m and len(set(times)) == m  # really unequal
    finish = [[0.0] * (p + 1) for _ in range(m + 1)]
    for i in range(1, m + 1):
        for s in range(1, p + 1):
            finish[i][s] = max(finish[i - 1][s], finish[i][s - 1]) + times[i - 1]
    assert t - cm.step_s == pytest.approx(finish[m][p], rel=1e-12)
    assert stage == pytest.approx(sum(times))


def test_serving_with_pipeline_reports_closed_form_bubble():
    import numpy as np

    from firstlight.sim.serve import ServeConfig, run_serve
    from firstlight.sim.workload import Workload

    n, p, m = 64, 4, 4
    wl = Workload(np.zeros(n), np.full(n, 128, dtype=np.int64), np.full(n, 32, dtype=np.int64))
    res, sim = run_serve(load_model("llama-3.1-70b"), load_spec("h100"), wl,
                         ServeConfig(tp=2, pp=p, num_microbatches=m, max_num_seqs=n))
    assert res["num_finished"] == n
    # every step where all n requests decode splits into m equal micro-batches: the closed-form bubble
    rep = sim.replicas[0]
    full = [(d, s) for d, s, nd in zip(rep.step_durations, rep.step_stage_busy, rep.step_decodes, strict=True)
            if nd == n]
    assert len(full) >= 30
    for d, s in full:
        assert 1 - s / (d - rep.cost.step_s) == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)
    # all n arrive at t=0 and the first step (formed after the host window) prefills them together, so
    # every step splits into m equal micro-batches and the run's bubble is the closed form too
    assert rep.max_running == n and rep.num_steps == 32
    assert res["pipeline"]["bubble_fraction"][0] == pytest.approx((p - 1) / (m + p - 1), rel=1e-6)
    fast, _ = run_serve(load_model("llama-3.1-70b"), load_spec("h100"), wl,
                        ServeConfig(tp=2, pp=p, num_microbatches=m, max_num_seqs=n, pipeline_schedule="async"))
    # async with m >= p: no stage idles
    assert fast["pipeline"]["bubble_fraction"][0] < 0.05
    assert fast["e2e_s"]["p50"] < res["e2e_s"]["p50"]
