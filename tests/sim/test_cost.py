import pytest

from firstlight.core import Batch, ScheduledSeq
from firstlight.core.hardware import EfficiencySpec, load_spec
from firstlight.sim.cost import CostModel, _causal_pairs
from firstlight.sim.model import load_model
from firstlight.sim.parallel import ParallelConfig

IDEAL = EfficiencySpec(compute=1.0, memory=1.0, network=1.0, kernel_overhead_us=0, step_overhead_us=0,
                       collective_overhead_us=0)


def _decode(n: int, ctx: int) -> Batch:
    return Batch(tuple(ScheduledSeq(f"r{i}", 1, ctx - 1, 10) for i in range(n)))


def test_memory_bound_decode_is_weights_plus_kv_over_bandwidth():
    m = load_model("llama-3.1-8b")
    hw = load_spec("h100")
    cm = CostModel(m, hw, efficiency=IDEAL)
    ctx = 1000
    t = cm.time(_decode(1, ctx))
    # the input embedding table is gathered, not read: only the LM head half of the embeddings counts
    weights = (m.num_params() - m.vocab_size * m.hidden_size) * 2
    expected = (weights + m.kv_bytes_per_token() * ctx) / hw.memory.bandwidth_bytes_per_s
    assert t == pytest.approx(expected, rel=0.01)


def test_large_prefill_is_compute_bound():
    m = load_model("llama-3.1-8b")
    hw = load_spec("h100")
    cm = CostModel(m, hw, efficiency=IDEAL)
    n = 8192
    ops = cm.breakdown(Batch((ScheduledSeq("p", n, 0, n),)))
    # matmul weights (minus norms, embeddings) and causal attention pairs
    flops = 2 * (m.num_params() - 2 * m.vocab_size * m.hidden_size - 65 * m.hidden_size) * n
    flops += sum(g.num_layers * g.attention.flops_per_pair for g in m.groups) * n * (n + 1) / 2
    compute = [op for op in ops if op.bound == "compute"]
    assert {op.name for op in compute} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "attention"}
    assert sum(op.flops for op in compute) == pytest.approx(flops, rel=1e-6)
    assert sum(op.time_s for op in compute) == pytest.approx(flops / hw.flops_per_s("bf16"), rel=1e-6)
    # what is left (norms, activations, LM head) is memory-bound and small
    assert sum(op.time_s for op in ops) < 1.1 * flops / hw.flops_per_s("bf16")


def test_time_of_batch_equals_aggregate_step_time():
    cm = CostModel(load_model("llama-3.1-70b"), load_spec("h100"), ParallelConfig(tp=8))
    seqs = [ScheduledSeq(f"d{i}", 1, 500 + i, 100) for i in range(20)]
    seqs += [ScheduledSeq("p0", 256, 512, 2048), ScheduledSeq("p1", 1000, 0, 1000)]
    b = Batch(tuple(seqs))
    ctx = sum(500 + i + 1 for i in range(20))
    assert cm.time(b) == pytest.approx(cm.step_time(b.num_tokens, b.num_seqs, 20, ctx, [(256, 512), (1000, 0)]))
    assert sum(op.time_s for op in cm.breakdown(b)) == pytest.approx(cm.time(b))


def test_tp_splits_weight_time_and_adds_all_reduce():
    m = load_model("llama-3.1-70b")
    hw = load_spec("h100")
    one = CostModel(m, hw, ParallelConfig(tp=1), efficiency=IDEAL)
    eight = CostModel(m, hw, ParallelConfig(tp=8), efficiency=IDEAL)
    b = _decode(1, 100)
    comm = sum(op.time_s for op in eight.breakdown(b) if op.name == "tp_all_reduce")
    assert comm > 0
    assert eight.time(b) - comm == pytest.approx(one.time(b) / 8, rel=0.02)


def test_causal_pairs():
    assert _causal_pairs(4, 0, None) == 10
    assert _causal_pairs(2, 3, None) == 4 + 5
    assert _causal_pairs(10, 0, 4) == 1 + 2 + 3 + 4 * 7  # window caps keys per query
    assert _causal_pairs(3, 100, 4) == 12


def test_moe_reads_only_active_experts_and_imbalance_grows_with_ep():
    m = load_model("mixtral-8x7b")
    hw = load_spec("h100")
    cm = CostModel(m, hw, efficiency=IDEAL)
    one = [op for op in cm.token_ops(1) if op.name == "moe_experts"][0]
    many = [op for op in cm.token_ops(4096) if op.name == "moe_experts"][0]
    expert_bytes = m.groups[0].moe.expert_params * 2 * m.groups[0].num_layers
    assert one.bytes == pytest.approx(2 * expert_bytes, rel=0.01)  # top-2 of 8 experts for one token
    assert many.bytes > 7.9 * expert_bytes
    ep = CostModel(m, hw, ParallelConfig(tp=8, ep=8))
    assert ep.moe_imbalance_factor(64, 8) > ep.moe_imbalance_factor(64000, 8) > 1.0


def test_overlap_additive_sums_compute_and_memory_and_gemv_prices_one_row():
    m = load_model("llama-3.1-8b")
    hw = load_spec("h100")
    flops, nbytes = 3e12, 2e9
    tc, tm = flops / hw.flops_per_s("bf16"), nbytes / hw.memory.bandwidth_bytes_per_s
    cm_max = CostModel(m, hw, efficiency=IDEAL)
    add = IDEAL.model_copy(update={"overlap": "additive"})
    cm_add = CostModel(m, hw, efficiency=add)
    assert cm_max.roofline("x", flops, nbytes).time_s == pytest.approx(max(tc, tm))
    assert cm_add.roofline("x", flops, nbytes).time_s == pytest.approx(tc + tm)
    # the GEMV efficiency prices only one-row linears: a batch-1 decode's weights, not a batch-2 one's
    gemv = CostModel(m, hw, efficiency=IDEAL.model_copy(update={"gemv_memory": 0.5}))
    one, two = _decode(1, 100), _decode(2, 100)
    lin = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    t1 = {op.name: op.time_s for op in gemv.breakdown(one)}
    t1_ideal = {op.name: op.time_s for op in cm_max.breakdown(one)}
    for name in lin:
        assert t1[name] == pytest.approx(2 * t1_ideal[name], rel=1e-3)  # memory-bound at 1/0.5 the time
    assert t1["attention"] == pytest.approx(t1_ideal["attention"])
    assert gemv.time(two) == pytest.approx(cm_max.time(two))
    assert all(op.gemv == (op.name in lin) for op in gemv.step_ops(one))


def test_gpu_specs_keep_the_roofline_max():
    for name in ("h100", "h200", "mi300x", "tpu-v5e", "trn2"):
        eff = load_spec(name).efficiency
        assert eff.overlap == "max" and eff.gemv_memory is None, name
