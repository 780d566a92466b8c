"""The engine serves every family: greedy tokens equal `generate` for staggered prompts, with chunked
prefill, and after preemption (recompute)."""

from __future__ import annotations

import pytest
import torch

from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.request import SamplingParams
from firstlight.models.generate import generate_tokens
from firstlight.models.loader import load_model
from tests.engine.test_engine import prompts, run_staggered

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "qwen3_5_moe", "granitemoehybrid", "nemotron_h",
            "deepseek_v3"]
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


@pytest.mark.parametrize("family", ["mixtral", "qwen3_next", "qwen3_5_moe", "granitemoehybrid", "nemotron_h",
                                    "deepseek_v3"])
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


@pytest.mark.parametrize("family", ["granitemoehybrid", "nemotron_h"])
def test_mamba_hybrid_speculates_with_a_per_token_state_rollback(family_models, family):
    """Granite 4.0-H and Nemotron-H with proposals accepted to every length (an oracle that errs on
    purpose): their Mamba-2 layers keep the conv and SSM states after every token of a verify pass, the
    state after the last accepted token is put back, and greedy equals `generate`."""
    from firstlight.engine.speculative.config import SpecConfig
    from tests.speculative.test_mtp import OracleProposer

    model, tok = family_models(family)
    ps = prompts(4, seed=5)
    want = [list(generate_tokens(model, p, 10)) for p in ps]
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=16,
                                                speculative=SpecConfig("ngram", 3)))
    engine.spec.proposer = OracleProposer({tuple(p): t for p, t in zip(ps, want, strict=True)})
    done = run_staggered(engine, ps, GREEDY)
    assert [done[i].output_token_ids for i in range(len(ps))] == want
    per_pos = engine.spec.stats.accepted_per_pos
    assert per_pos[0] > per_pos[2] > 0  # accepted runs of every length, and rejections after them


def test_mamba_hybrid_engine_keeps_conv_and_ssm_state_per_slot(family_models):
    """Granite 4.0-H: KV pools only for its attention layer; per Mamba layer a conv-input pool
    [slots + 1, conv_dim, K-1] and an fp32 SSM pool [slots + 1, H, P, N], counted in the slot bytes."""
    from firstlight.engine.runner import ModelRunner

    model, tok = family_models("granitemoehybrid")
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=3))
    assert [p.numel() > 0 for p in engine.runner.k_pools] == [False, False, True, False]
    assert sorted(engine.runner.state_pools) == [0, 1, 3]
    m = model.config.mamba
    conv, ssm = engine.runner.state_pools[0]
    assert conv.shape == (4, m.conv_dim, m.conv_kernel - 1) and conv.dtype == torch.float32
    assert ssm.shape == (4, m.num_heads, m.head_dim, m.state_size) and ssm.dtype == torch.float32
    per_layer = 4 * (m.conv_dim * (m.conv_kernel - 1) + m.num_heads * m.head_dim * m.state_size)
    assert ModelRunner.state_bytes_per_slot(model) == 3 * per_layer
    _serves_one_prompt_twice(engine, model)


def test_nemotron_h_engine_keeps_no_cache_for_mlp_and_moe_blocks(family_models):
    """Nemotron-H ("M-M*-EM"): a KV pool for its one attention block, state pools for its three Mamba-2
    blocks, nothing for its MLP and MoE blocks."""
    from firstlight.engine.runner import ModelRunner

    model, tok = family_models("nemotron_h")
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=3))
    assert [p.numel() > 0 for p in engine.runner.k_pools] == [False, False, False, True, False, False, False]
    assert sorted(engine.runner.state_pools) == [0, 2, 6]
    m = model.config.mamba
    per_layer = 4 * (m.conv_dim * (m.conv_kernel - 1) + m.num_heads * m.head_dim * m.state_size)
    assert ModelRunner.state_bytes_per_slot(model) == 3 * per_layer
    _serves_one_prompt_twice(engine, model)


def _serves_one_prompt_twice(engine: LLMEngine, model) -> None:
    """The same prompt twice at once: the same tokens as `generate`, every state slot free after."""
    shared = prompts(1, seed=3)[0]
    for _ in range(2):
        engine.add_request(shared, GREEDY)
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.finished]
        engine.kv.check_invariants()
    assert outs[0].output_token_ids == outs[1].output_token_ids == list(generate_tokens(model, shared, 10))
    assert engine.kv.num_free_slots == 3


@pytest.mark.slow
@pytest.mark.parametrize("family", ["granitemoehybrid"])
def test_hybrid_compiled_decode_matches_generate(family_models, family):
    """The compiled decode (padded batch buckets: padding rows read and write the scratch state slot)
    gives `generate`'s tokens on a Mamba hybrid. ~1-3 min of inductor compiling on a small CPU."""
    model, tok = family_models(family)
    ps = prompts(3, seed=4)
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64, max_num_seqs=4, compile_decode=True))
    done = run_staggered(engine, ps, GREEDY)
    for i, p in enumerate(ps):
        assert done[i].output_token_ids == list(generate_tokens(model, p, 10)), f"prompt {i}"
    assert engine.runner.num_decode_compiles <= engine.runner.max_decode_graphs
