"""The hybrid cache manager: KV blocks and recurrent state slots, conserved under any traffic."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from firstlight.engine.request import RequestStatus
from firstlight.engine.scheduler import Scheduler, SchedulerConfig
from firstlight.engine.state_slots import HybridCacheManager

from .sim_helpers import check_batch, fake_execute, make_request, reference_tokens, run_to_completion


def make_hybrid_scheduler(num_blocks=32, block_size=4, num_slots=4, max_num_seqs=8, budget=16, max_model_len=64):
    kv = HybridCacheManager(num_blocks, block_size, num_slots)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len)
    return Scheduler(cfg, kv)


def test_slot_taken_with_first_blocks_and_freed_with_them():
    sched = make_hybrid_scheduler(num_slots=2)
    for i in range(3):
        sched.add_request(make_request(str(i), [1, 2, 3], max_tokens=4))
    sched.schedule()
    kv = sched.kv
    assert set(kv.slot_of) == {"0", "1"} and kv.num_free_slots == 0
    assert sched.num_waiting == 1  # no slot left for the third, though blocks are plenty
    run_to_completion(sched)
    assert kv.num_free_slots == 2 and not kv.slot_of and kv.num_used_blocks == 0


def test_prefix_cache_is_off():
    sched = make_hybrid_scheduler()
    sched.add_request(make_request("a", list(range(20)), max_tokens=2))
    run_to_completion(sched)
    sched.add_request(make_request("b", list(range(20)), max_tokens=2))
    sched.schedule()
    assert sched.requests["b"].num_cached_tokens == 0 and not sched.kv.cached


request_strategy = st.tuples(
    st.lists(st.integers(0, 5), min_size=1, max_size=40),
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
    num_slots=st.integers(1, 8),
)
def test_property_blocks_and_slots_conserved(reqs, num_blocks, block_size, budget, max_num_seqs, num_slots):
    max_model_len = min(64, num_blocks * block_size)
    sched = make_hybrid_scheduler(num_blocks, block_size, num_slots, max_num_seqs, budget, max_model_len)
    pending = sorted(enumerate(reqs), key=lambda x: x[1][2])
    objs, step = {}, 0
    while pending or sched.has_unfinished():
        assert step < 5000, "scheduler did not drain"
        while pending and pending[0][1][2] <= step:
            i, (prompt, max_tokens, _, abort) = pending.pop(0)
            r = make_request(str(i), prompt[: max_model_len - 1], max_tokens=max_tokens)
            objs[r.request_id] = (r, abort)
            sched.add_request(r)
        if step % 5 == 3:
            victims = [rid for rid, (r, ab) in objs.items() if ab and not r.is_finished]
            sched.abort_requests(victims[:1])
        batch = sched.schedule()
        sched.kv.check_invariants()
        check_batch(sched, batch)
        # every request in the step holds a state slot, no two the same
        slots = [sched.kv.slot_of[s.request_id] for s in batch.seqs]
        assert len(set(slots)) == len(slots)
        if sched.has_unfinished() and not batch.seqs:
            raise AssertionError("nothing scheduled while requests are pending")
        sched.update(batch, fake_execute(sched, batch))
        sched.kv.check_invariants()
        step += 1
    assert sched.kv.num_used_blocks == 0 and sched.kv.num_free_slots == num_slots
    for r, _ in objs.values():
        assert r.is_finished
        if r.status != RequestStatus.FINISHED_ABORTED:
            ref = reference_tokens(r.prompt_token_ids, r.sampling_params.max_tokens)
            assert r.output_token_ids == ref[: len(r.output_token_ids)]
