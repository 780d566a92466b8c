"""Recompute after preemption is labelled in the Batch and the step trace, not mistaken for decode."""

from __future__ import annotations

from collections import defaultdict

from firstlight.core.trace import Trace, seq_phase
from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.request import SamplingParams

from .sim_helpers import make_request, make_scheduler, run_to_completion


def test_scheduler_counts_recompute_tokens_exactly() -> None:
    # 12 blocks of 4 tokens cannot hold 4 requests growing to 22 tokens each: preemptions must happen
    sched = make_scheduler(num_blocks=12, block_size=4, max_num_seqs=4, max_num_batched_tokens=6,
                           prefix_caching=False)
    for i in range(4):
        sched.add_request(make_request(f"r{i}", list(range(1 + i, 7 + i)), max_tokens=16))
    batches = run_to_completion(sched)
    assert sched.num_preemptions > 0
    expected: dict[str, int] = defaultdict(int)  # the KV each preemption dropped
    last_context: dict[str, int] = {}
    got: dict[str, int] = defaultdict(int)
    saw_output_recompute = False
    for batch in batches:
        for rid in batch.preempted_ids:
            expected[rid] += last_context.pop(rid, 0)
        recompute = batch.meta.get("num_recompute_tokens", {})
        for seq in batch.seqs:
            last_context[seq.request_id] = seq.context_len
            n = recompute.get(seq.request_id, 0)
            assert 0 <= n <= seq.num_tokens
            assert (seq_phase(batch, seq) == "recompute") == (n > 0)
            if n and not seq.is_prefill:
                saw_output_recompute = True  # a chunk of output tokens: "decode" by position alone
        for rid, n in recompute.items():
            got[rid] += n
    assert dict(got) == {rid: n for rid, n in expected.items() if n}
    assert saw_output_recompute
    assert not sched._recompute_until  # every recompute finished


def test_engine_trace_labels_recompute(tiny, tmp_path) -> None:
    model, tok = tiny
    trace_path = tmp_path / "trace.jsonl"
    cfg = EngineConfig(block_size=4, num_blocks=24, max_num_batched_tokens=32, enable_prefix_caching=False,
                       trace_path=trace_path)
    engine = LLMEngine(model, tok, cfg)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i in range(6):
        engine.add_request(list(range(3 + i, 30 + 3 * i)), params)
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        engine.step()
    engine.close()
    assert engine.scheduler.num_preemptions > 0
    trace = Trace.load(trace_path)
    preempted = {rid for rec in trace.steps for rid in rec.batch.preempted_ids}
    relabelled = {rid for rec in trace.steps for rid in rec.num_recompute_tokens}
    assert relabelled == preempted
    chrome = [e for e in trace.to_chrome()["traceEvents"] if e["pid"] == 0 and e["ph"] == "X"]  # the step track
    assert sum(e["args"]["num_recompute_tokens"] for e in chrome if e["name"] == "execute") == sum(
        sum(rec.num_recompute_tokens.values()) for rec in trace.steps
    )
    assert any("recompute" in e["args"]["phases"] for e in chrome)
    # steps without preemption carry no label: old traces and readers are unaffected
    assert any(not rec.batch.meta for rec in trace.steps)
