"""Sliding-window layers keep only their window's KV blocks: a long request's local-layer blocks stay
bounded by the window (a 4K-token Gemma-3-style request on a tiny config), the released blocks go
back to the pool, sliding layers gather only the window's keys, and greedy tokens are unchanged."""

from __future__ import annotations

import pytest
import torch

from firstlight import kernels
from firstlight.core.batch import ScheduledSeq
from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.kv_groups import SlidingWindowGroups
from firstlight.engine.kv_manager import NULL_BLOCK, KVCacheManager
from firstlight.engine.request import Request, SamplingParams
from firstlight.models.generate import generate_tokens
from firstlight.models.loader import load_model
from firstlight.models.tiny import write_tiny_checkpoint
from tests.engine.test_engine import prompts, run_staggered

WINDOW, BLOCK = 8, 4
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("sliding")
    out = {}
    for family in ("gemma3_text", "mistral"):
        path = write_tiny_checkpoint(root / family, family=family, seed=4, max_position_embeddings=4224)
        out[family] = load_model(path)
    return out


def test_manager_releases_blocks_behind_the_window():
    kv = KVCacheManager(num_blocks=32, block_size=BLOCK, sliding_window=WINDOW)
    req = Request("r", list(range(3, 43)), SamplingParams(max_tokens=1), ())
    kv.allocate(req, 40)  # 10 blocks
    req.num_computed_tokens = 40
    kv.cache_full_blocks(req)
    # the next query is at position 40: keys from 33 on, i.e. blocks 8 and 9 (tokens 32..39)
    assert kv.release_out_of_window(req) == 8
    assert kv.block_tables["r"][:8] == [NULL_BLOCK] * 8 and NULL_BLOCK not in kv.block_tables["r"][8:]
    assert kv.num_held_blocks("r") == 2 and kv.num_used_blocks == 2
    assert kv.release_out_of_window(req) == 0  # idempotent
    kv.check_invariants()
    kv.free("r")
    assert kv.num_used_blocks == 0
    kv.check_invariants()


def test_long_gemma3_request_holds_only_its_window_on_local_layers(models):
    model, tok = models["gemma3_text"]
    assert len(model.config.kv_layers) == 4 and sum(1 for i in model.config.kv_layers if model.config.window(i)) == 3
    budget, prompt_len, new = 256, 4064, 32
    engine = LLMEngine(model, tok, EngineConfig(block_size=BLOCK, num_blocks=1100, max_num_seqs=2,
                                                max_num_batched_tokens=budget))
    kv = engine.kv
    assert isinstance(kv, SlidingWindowGroups)
    # local pools are sized for two requests' windows + one step, not for their contexts
    assert kv.sliding.num_blocks == 2 * (-(-(WINDOW - 1 + budget) // BLOCK) + 1)
    assert engine.runner.k_pools[0].shape[0] == kv.sliding.num_blocks * BLOCK + 1  # a sliding layer
    assert engine.runner.k_pools[2].shape[0] == 1100 * BLOCK + 1  # the global layer
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, 380, (prompt_len,), generator=g).tolist()
    req = engine.add_request(prompt, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    most_local = 0
    while engine.has_unfinished():
        outs = engine.step()
        kv.check_invariants()
        if not req.is_finished:
            local = kv.sliding.num_held_blocks(req.request_id)
            most_local = max(most_local, local)
            # after each step: only the blocks a future query can see, (W - 1) keys + the next token
            assert local <= -(-WINDOW // BLOCK) + 1, local
            assert kv.full.num_held_blocks(req.request_id) == -(-req.num_computed_tokens // BLOCK)
    assert req.num_tokens == prompt_len + new == 4096
    assert most_local <= 3 and kv.sliding.num_used_blocks == 0 and kv.full.num_used_blocks == 0
    assert outs[-1].output_token_ids == list(generate_tokens(model, prompt, new))


def test_sliding_layers_gather_only_the_window(models):
    model, tok = models["gemma3_text"]
    engine = LLMEngine(model, tok, EngineConfig(block_size=BLOCK, num_blocks=64, max_num_seqs=2))
    runner = engine.runner
    seqs = [ScheduledSeq("a", 2, 29, 10, tuple(range(8)), sliding_block_ids=(-1,) * 5 + (0, 1, 2)),
            ScheduledSeq("b", 2, 12, 12, tuple(range(8, 12)), sliding_block_ids=(-1, 3, 4, 5))]
    positions = torch.tensor([[29, 30], [12, 13]])
    cache = runner._make_cache(seqs, positions)
    full, local = cache.views["full_attention"], cache.views["sliding_attention"]
    assert full.key_positions.shape == (2, 31)  # the longest context
    assert local.key_positions.shape == (2, WINDOW - 1 + 2)  # W - 1 keys before the step + its 2 tokens
    assert local.key_positions[0].tolist() == list(range(22, 31))
    assert local.key_positions[1].tolist() == list(range(5, 14))
    # key 22 of row a lies in its table entry 5 -> block 0, offset 2; its new tokens go to block 2
    assert int(local.gather_slots[0, 0]) == 0 * BLOCK + 2
    assert local.write_slots.tolist() == [2 * BLOCK + 1, 2 * BLOCK + 2, 5 * BLOCK + 0, 5 * BLOCK + 1]
    assert full.write_slots.tolist() == [7 * BLOCK + 1, 7 * BLOCK + 2, 11 * BLOCK + 0, 11 * BLOCK + 1]


@pytest.mark.parametrize("num_keys,pad", [(None, 0), (40, 0), (40, 2)])
def test_slots_kernel_equals_the_tensor_ops(models, num_keys, pad):
    """firstlight::paged_slots (one call per group and forward) gives the slots the tensor ops give, for full and
    sliding groups, prefill chunks, a bucketed key length (compiled decode) and padding rows."""
    if kernels.load_kernel() is None:
        pytest.skip("firstlight's kernel extension is not in use")
    model, tok = models["gemma3_text"]
    runner = LLMEngine(model, tok, EngineConfig(block_size=BLOCK, num_blocks=64, max_num_seqs=4)).runner
    seqs = [ScheduledSeq("a", 2, 29, 10, tuple(range(8)), sliding_block_ids=(-1,) * 5 + (0, 1, 2)),
            ScheduledSeq("b", 2, 12, 12, tuple(range(8, 12)), sliding_block_ids=(-1, 3, 4, 5)),
            ScheduledSeq("c", 2, 0, 5, (20, 21), sliding_block_ids=(6, 7))]
    positions = torch.tensor([[29, 30], [12, 13], [0, 1]] + [[-1, -1]] * pad)
    assert runner.slots_kernel
    views = [runner._make_cache(seqs, positions, num_keys).views]
    runner.slots_kernel = False
    views.append(runner._make_cache(seqs, positions, num_keys).views)
    for t in ("full_attention", "sliding_attention"):
        got, ref = views[0][t], views[1][t]
        for name in ("write_slots", "gather_slots", "key_positions"):
            a, b = getattr(got, name), getattr(ref, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (t, name, a, b)


def test_mistral_only_sliding_layers_frees_blocks_and_matches_generate(models):
    model, tok = models["mistral"]
    ps = prompts(6, seed=3) + [torch.randint(3, 380, (300,), generator=torch.Generator().manual_seed(5)).tolist()]
    engine = LLMEngine(model, tok, EngineConfig(block_size=BLOCK, num_blocks=128, max_num_batched_tokens=32))
    assert isinstance(engine.kv, KVCacheManager) and engine.kv.sliding_window == WINDOW
    done = run_staggered(engine, ps, GREEDY)
    for i, p in enumerate(ps):
        assert done[i].output_token_ids == list(generate_tokens(model, p, 10)), f"prompt {i}"
    assert engine.kv.num_used_blocks == 0


def test_gemma3_prefix_hits_and_preemption_keep_tokens(models):
    model, tok = models["gemma3_text"]
    shared = torch.randint(3, 380, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    ps = [shared + p for p in prompts(5, seed=4)]
    ref = [list(generate_tokens(model, p, 16)) for p in ps]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    for num_blocks in (256, 30):  # roomy (prefix hits), then tight (preemptions)
        engine = LLMEngine(model, tok, EngineConfig(block_size=BLOCK, num_blocks=num_blocks, max_num_seqs=4,
                                                    max_num_batched_tokens=32))
        done = run_staggered(engine, ps, params, every=3)
        assert [done[i].output_token_ids for i in range(len(ps))] == ref, num_blocks
        if num_blocks == 256:
            assert engine.kv.stats.num_hit_tokens > 0
        else:
            assert engine.scheduler.num_preemptions > 0


def test_quantized_cache_with_window_groups_equals_keeping_every_block(models):
    """--kv-cache-dtype int8 on Gemma 3's two KV groups: the local layers' codes and scales live in
    their own (smaller) pools, and the tokens equal an int8 cache that keeps every block."""
    model, tok = models["gemma3_text"]
    ps = [p + p for p in prompts(4, seed=6)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    out = {}
    for evict in (True, False):
        engine = LLMEngine(model, tok, EngineConfig(block_size=BLOCK, num_blocks=256, max_num_seqs=4,
                                                    max_num_batched_tokens=32, kv_cache_dtype="int8",
                                                    free_out_of_window=evict))
        assert isinstance(engine.kv, SlidingWindowGroups) == evict
        assert engine.runner.scale_pools is not None
        assert engine.runner.scale_pools[0][0].shape[0] == engine.runner.k_pools[0].shape[0]
        done = run_staggered(engine, ps, params)
        out[evict] = [done[i].output_token_ids for i in range(len(ps))]
    assert out[True] == out[False]
