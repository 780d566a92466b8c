from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from firstlight.engine.request import RequestStatus

from .sim_helpers import make_request, make_scheduler, reference_tokens, run_to_completion


def test_scheduler_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = "import sys, firstlight.engine.scheduler, firstlight.engine.kv_manager; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_single_request_generates_reference_tokens() -> None:
    sched = make_scheduler()
    req = make_request("a", [1, 2, 3, 4, 5], max_tokens=6)
    sched.add_request(req)
    run_to_completion(sched)
    assert req.status == RequestStatus.FINISHED_LENGTH
    assert req.output_token_ids == reference_tokens([1, 2, 3, 4, 5], 6)
    assert sched.kv.num_used_blocks == 0


def test_chunked_prefill_respects_budget() -> None:
    sched = make_scheduler(max_num_batched_tokens=8, max_model_len=200)
    req = make_request("a", list(range(30)), max_tokens=2)
    sched.add_request(req)
    batches = run_to_completion(sched)
    assert [b.num_tokens for b in batches] == [8, 8, 8, 6, 1]
    assert batches[0].seqs[0].is_prefill and not batches[-1].seqs[0].is_prefill
    assert req.output_token_ids == reference_tokens(list(range(30)), 2)


def test_decode_and_prefill_share_a_step() -> None:
    sched = make_scheduler(max_num_batched_tokens=16)
    sched.add_request(make_request("a", [1, 2, 3], max_tokens=10))
    b0 = sched.schedule()
    sched.update(b0, {"a": [7]})
    sched.add_request(make_request("b", list(range(40)), max_tokens=3))
    b1 = sched.schedule()
    assert [(s.request_id, s.num_tokens) for s in b1.seqs] == [("a", 1), ("b", 15)]
    assert b1.num_decode_tokens == 1 and b1.num_prefill_tokens == 15


def test_max_num_seqs_limits_running() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add_request(make_request(str(i), [i + 1, 2, 3], max_tokens=3))
    b = sched.schedule()
    assert b.num_seqs == 2 and sched.num_waiting == 3
    run_to_completion(sched)
    assert not sched.has_unfinished()


def test_preemption_newest_first_and_resume_same_tokens() -> None:
    # 6 blocks of 4 tokens: two requests that each grow to 5 blocks cannot both fit
    sched = make_scheduler(num_blocks=6, block_size=4, max_model_len=24, prefix_caching=False)
    a = make_request("a", list(range(1, 9)), max_tokens=12)
    b = make_request("b", list(range(50, 58)), max_tokens=12)
    sched.add_request(a)
    sched.add_request(b)
    batches = run_to_completion(sched)
    preempted = [rid for batch in batches for rid in batch.preempted_ids]
    assert preempted and preempted[0] == "b"  # the newest goes first
    assert b.num_preemptions >= 1
    assert a.output_token_ids == reference_tokens(a.prompt_token_ids, 12)
    assert b.output_token_ids == reference_tokens(b.prompt_token_ids, 12)
    assert sched.kv.num_used_blocks == 0


def test_abort_frees_blocks() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", list(range(10)), max_tokens=50))
    sched.add_request(make_request("b", list(range(10)), max_tokens=50))
    sched.update(sched.schedule(), {})
    assert sched.kv.num_used_blocks > 0
    sched.abort_requests(["a", "b", "missing"])
    assert sched.kv.num_used_blocks == 0 and not sched.has_unfinished()
    assert {r.status for r in sched.pop_finished()} == {RequestStatus.FINISHED_ABORTED}


def test_stop_token_and_eos() -> None:
    sched = make_scheduler()
    ref = reference_tokens([1, 2, 3], 5)
    a = make_request("a", [1, 2, 3], max_tokens=5, stop_token_ids=(ref[2],))
    sched.add_request(a)
    run_to_completion(sched)
    assert a.output_token_ids == ref[:3] and a.status == RequestStatus.FINISHED_STOPPED
    assert a.stop_reason == ref[2]


def test_prompt_too_long_rejected() -> None:
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="context length"):
        sched.add_request(make_request("a", list(range(16))))


def test_prefix_cache_hit_counts_and_correctness() -> None:
    sched = make_scheduler(block_size=4)
    prefix = list(range(100, 112))  # 3 full blocks
    a = make_request("a", prefix + [1, 2], max_tokens=3)
    sched.add_request(a)
    run_to_completion(sched)
    assert sched.kv.stats.num_hit_tokens == 0
    b = make_request("b", prefix + [7, 8, 9], max_tokens=3)
    sched.add_request(b)
    batch = sched.schedule()
    assert b.num_cached_tokens == 12 and sched.kv.stats.num_hit_tokens == 12
    assert batch.seqs[0].num_computed_tokens == 12 and batch.seqs[0].num_tokens == 3
    # the hit blocks are the very blocks `a` computed its prefix into
    assert batch.seqs[0].block_ids[:3] == tuple(sched.kv.cached[h] for h in _chain(prefix, 4))
    sched.update(batch, {"b": [sched_next(b)]})
    run_to_completion(sched)
    assert b.output_token_ids == reference_tokens(b.prompt_token_ids, 3)
    # a prompt equal to a cached prefix still computes its last token
    c = make_request("c", prefix, max_tokens=1)
    sched.add_request(c)
    sched.schedule()
    assert c.num_cached_tokens == 8


def _chain(tokens: list[int], block_size: int) -> list[int]:
    from firstlight.engine.kv_manager import hash_block

    out, parent = [], None
    for i in range(len(tokens) // block_size):
        parent = hash_block(parent, tuple(tokens[i * block_size : (i + 1) * block_size]))
        out.append(parent)
    return out


def sched_next(req) -> int:
    from .sim_helpers import fake_next_token

    return fake_next_token(req.all_token_ids)


def test_reset_prefix_cache() -> None:
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", list(range(20)), max_tokens=2))
    run_to_completion(sched)
    assert sched.kv.reset_prefix_cache() > 0
    sched.add_request(make_request("b", list(range(20)), max_tokens=2))
    sched.schedule()
    assert sched.requests["b"].num_cached_tokens == 0


request_strategy = st.tuples(
    st.lists(st.integers(0, 5), min_size=1, max_size=40),  # prompts from a small alphabet share prefixes
    st.integers(1, 20),  # max_tokens
    st.integers(0, 6),  # arrival step
    st.booleans(),  # aborted mid-way
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(request_strategy, min_size=1, max_size=12),
    num_blocks=st.integers(16, 48),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(4, 64),
    max_num_seqs=st.integers(1, 8),
)
def test_property_conservation_termination_and_tokens(reqs, num_blocks, block_size, budget, max_num_seqs):
    max_model_len = min(64, num_blocks * block_size)
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
    )
    from .sim_helpers import check_batch, fake_execute

    pending = sorted(enumerate(reqs), key=lambda x: x[1][2])
    objs = {}
    step = 0
    hits_before = 0
    while pending or sched.has_unfinished():
        assert step < 5000, "scheduler did not drain"
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _, abort) = pending.pop(0)
            prompt = prompt[: max_model_len - 1]
            r = make_request(str(i), prompt, max_tokens=max_tokens)
            objs[r.request_id] = (r, abort)
            sched.add_request(r)
        if step % 5 == 3:
            victims = [rid for rid, (r, ab) in objs.items() if ab and not r.is_finished]
            sched.abort_requests(victims[:1])
        batch = sched.schedule()
        sched.kv.check_invariants()
        check_batch(sched, batch)
        assert sched.kv.stats.num_hit_tokens >= hits_before
        hits_before = sched.kv.stats.num_hit_tokens
        if sched.has_unfinished() and not batch.seqs:
            raise AssertionError("nothing scheduled while requests are pending")
        sched.update(batch, fake_execute(sched, batch))
        sched.kv.check_invariants()
        step += 1
    assert sched.kv.num_used_blocks == 0
    for r, _ in objs.values():
        assert r.is_finished
        if r.status != RequestStatus.FINISHED_ABORTED:
            # greedy tokens are what an unbatched, unpreempted, uncached run gives
            ref = reference_tokens(r.prompt_token_ids, r.sampling_params.max_tokens)
            assert r.output_token_ids == ref[: len(r.output_token_ids)]
            assert r.num_tokens == max_model_len or len(r.output_token_ids) == r.sampling_params.max_tokens
