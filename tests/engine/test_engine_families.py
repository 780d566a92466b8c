"""The engine serves every family: greedy tokens equal `generate` for staggered prompts, with chunked
prefill, and after preemption (recompute)."""

from __future__ import annotations

import pytest

from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.request import SamplingParams
from firstlight.models.generate import generate_tokens
from firstlight.models.loader import load_model
from tests.engine.test_engine import prompts, run_staggered

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def family_models(tiny_checkpoint):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = load_model(tiny_checkpoint(family, seed=2))
        return cache[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_matches_generate_staggered(family_models, family):
    model, tok = family_models(family)
    ps = prompts(8)
    # a 16-token budget splits most prompts into chunks, and decode rows of several requests share a step
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=16))
    done = run_staggered(engine, ps, GREEDY)
    for i, p in enumerate(ps):
        assert done[i].output_token_ids == list(generate_tokens(model, p, 10)), f"{family} prompt {i}"
    assert engine.kv.num_used_blocks == 0


@pytest.mark.parametrize("family", ["mixtral", "qwen3_next"])
def test_engine_preemption_gives_same_tokens(family_models, family):
    model, tok = family_models(family)
    ps = prompts(6, seed=1)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=20, max_num_batched_tokens=32))
    done = run_staggered(engine, ps, params, every=1)
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(ps):
        assert done[i].output_token_ids == list(generate_tokens(model, p, 16)), f"prompt {i}"


def test_hybrid_engine_keeps_state_slots_and_turns_prefix_caching_off(family_models, caplog):
    model, tok = family_models("qwen3_next")
    with caplog.at_level("WARNING", logger="firstlight.engine.engine"):
        engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=3))
    assert "prefix caching is off" in caplog.text and engine.prefix_caching_off_reason
    assert not engine.kv.enable_prefix_caching
    # KV pools only for the one full-attention layer; state pools for the three linear-attention layers
    assert [p.numel() > 0 for p in engine.runner.k_pools] == [False, False, False, True]
    assert sorted(engine.runner.state_pools) == [0, 1, 2]
    shared = prompts(1, seed=3)[0]
    for p in (shared, shared):  # the same prompt twice: no cache hit, same tokens
        engine.add_request(p, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
        engine.kv.check_invariants()
    assert outs[0].output_token_ids == outs[1].output_token_ids == list(generate_tokens(model, shared, 10))
    assert all(o.num_cached_tokens == 0 for o in outs)
    assert engine.kv.num_free_slots == 3


def test_hybrid_engine_speculates_with_a_per_token_state_rollback(family_models):
    """Speculation on a hybrid model: the verify pass keeps its recurrent states per token (exactness
    over many steps and partial acceptances is in tests/speculative/test_mtp.py)."""
    from firstlight.engine.speculative.config import SpecConfig

    model, tok = family_models("qwen3_next")
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64, speculative=SpecConfig("mtp", 2)))
    p = prompts(1, seed=3)[0]
    engine.add_request(p, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
    assert outs[0].output_token_ids == list(generate_tokens(model, p, 10))
    assert engine.spec.stats.num_drafts > 0
