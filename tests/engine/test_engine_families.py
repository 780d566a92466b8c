"""The engine serves every family: greedy tokens equal `generate` for staggered prompts, with chunked
prefill, and after preemption (recompute)."""

from __future__ import annotations

import pytest

from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.request import SamplingParams
from firstlight.models.generate import generate_tokens
from firstlight.models.loader import load_model
from tests.engine.test_engine import prompts, run_staggered

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe"]
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


@pytest.mark.parametrize("family", FAMILIES[:1])
def test_engine_preemption_gives_same_tokens(family_models, family):
    model, tok = family_models(family)
    ps = prompts(6, seed=1)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=20, max_num_batched_tokens=32))
    done = run_staggered(engine, ps, params, every=1)
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(ps):
        assert done[i].output_token_ids == list(generate_tokens(model, p, 16)), f"prompt {i}"
