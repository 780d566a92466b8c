"""The draft proposer drafts all requests in one batched forward per draft step (draft_cache.py)."""

import random

import pytest
import torch

from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.request import SamplingParams
from firstlight.engine.speculative.base import SpecRequest
from firstlight.engine.speculative.config import SpecConfig
from firstlight.engine.speculative.draft import DraftProposer, TruncatedModel, common_prefix_len
from firstlight.engine.speculative.draft_cache import DraftKVPool


def _prompts(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [[1] + [rng.randrange(2, 384) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_common_prefix_len():
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_len([1, 2, 3, 4], [1, 2, 3]) == 3
    for m in range(9):
        a = list(range(8))
        b = a[:m] + [99] + a[m + 1 :]
        assert common_prefix_len(a, b) == m


def test_pool_keeps_contents_through_growth_and_compaction():
    pool = DraftKVPool(2, 1, 2, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        for i, rid in enumerate("abcde"):
            slot = pool.acquire(rid)
            kv = pool.pass_over([slot], [[i] * (i + 1)])
            kv.begin(kv.positions)
            for layer in range(2):
                val = torch.full((1, 1, i + 1, 2), float(10 * i + layer))
                kv.update(layer, val, -val)
            kv.end()
        assert pool.num_slots >= 5 and pool.max_len >= 5
        pool.free("b")  # "e" (last slot) moves into b's slot
        pool.free("zzz")  # unknown: no-op
        assert sorted(pool.slot_of.values()) == [0, 1, 2, 3]
        for i, rid in enumerate("abcde"):
            if rid == "b":
                continue
            slot = pool.slot_of[rid]
            assert pool.tokens[slot] == [i] * (i + 1)
            for layer in range(2):
                assert torch.equal(pool.k[layer][slot, :, : i + 1], torch.full((1, i + 1, 2), float(10 * i + layer)))
                assert torch.equal(pool.v[layer][slot, :, : i + 1], -pool.k[layer][slot, :, : i + 1])
        pool.truncate(pool.slot_of["e"], 2)
        assert pool.length(pool.slot_of["e"]) == 2


def _simulate(proposer, reference, prompts, rounds, temperature, seed=0):
    """Rounds of propose → accept a random prefix + a corrected token; requests join and leave.

    `reference(round)` returns a proposer whose proposals the batched one must equal.
    """
    rng = random.Random(seed)
    tokens = {f"r{i}": list(p) for i, p in enumerate(prompts)}
    live = list(tokens)[: len(prompts) // 2]
    waiting = list(tokens)[len(prompts) // 2 :]
    gens = {rid: (torch.Generator().manual_seed(i), torch.Generator().manual_seed(i)) for i, rid in enumerate(tokens)}
    num_compared = 0
    for _ in range(rounds):
        if waiting and rng.random() < 0.5:
            live.append(waiting.pop())
        ks = {rid: rng.randrange(1, 5) for rid in live}
        rng.shuffle(live)
        asks = [SpecRequest(r, list(tokens[r]), ks[r], temperature, gens[r][0]) for r in live]
        want = reference().propose([SpecRequest(r, list(tokens[r]), ks[r], temperature, gens[r][1]) for r in live])
        got = proposer.propose(asks)
        for ask, g, w in zip(asks, got, want, strict=True):
            assert g.token_ids == w.token_ids, ask.request_id
            assert len(g.token_ids) == ask.num_spec_tokens
            if temperature > 0:
                torch.testing.assert_close(g.probs, w.probs, atol=1e-5, rtol=1e-4)
            else:
                assert g.probs is None
            num_compared += 1
            # the draft's KV holds the request's tokens + the proposals it fed (all but the last)
            assert proposer.pool.tokens[proposer.pool.slot_of[ask.request_id]] == ask.token_ids + g.token_ids[:-1]
            accepted = rng.randrange(0, len(g.token_ids) + 1)  # keep a prefix, then the target's token
            tokens[ask.request_id] += g.token_ids[:accepted] + [rng.randrange(2, 384)]
        if live and rng.random() < 0.3:
            gone = live.pop(rng.randrange(len(live)))
            proposer.free(gone)
        slots = proposer.pool.slot_of
        assert sorted(slots.values()) == list(range(len(slots)))  # dense
    return num_compared


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_proposals_equal_fresh_per_request_proposals(tiny, temperature):
    """With rollback, catch-up of different lengths, per-row k, joins and frees, the batched
    proposer proposes what a stateless request-by-request draft proposes from scratch."""
    model, _ = tiny
    draft = TruncatedModel(model, 2)
    proposer = DraftProposer(draft)
    n = _simulate(proposer, lambda: DraftProposer(draft, batched=False), _prompts(10), 14, temperature)
    assert n > 40


def test_batched_equals_per_request_with_separate_draft_model(tiny_checkpoint):
    from firstlight.models.loader import load_model

    draft, _ = load_model(tiny_checkpoint("llama", seed=5))
    proposer = DraftProposer(draft.eval())
    old = DraftProposer(draft, batched=False)  # stateful too: both roll back the same way
    assert _simulate(proposer, lambda: old, _prompts(8, seed=1), 10, 0.0, seed=1) > 20


def _engine_run(model, tok, spec, prompts, params, **cfg):
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=cfg.pop("num_blocks", 512), speculative=spec,
                                                **cfg))
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params, strict=True)]
    done = {}
    for _ in range(3000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
        engine.kv.check_invariants()
        if engine.spec is not None:  # the draft pool holds only live requests, densely
            slots = engine.spec.proposer.pool.slot_of
            assert sorted(slots.values()) == list(range(len(slots)))
            assert set(slots) <= {r.request_id for r in engine.scheduler.running} | set(engine._states)
    engine.close()
    return [done[i] for i in ids], engine


def test_many_concurrent_requests_of_different_lengths_greedy_identical(tiny):
    """16 requests of 4..40 prompt tokens and 8..40 output tokens, prefill chunked by a small
    budget (so they start decoding at different steps): greedy output equals no speculation, the
    KV invariants hold every step, and the draft ran batched (far fewer forwards than one per
    request per draft step)."""
    model, tok = tiny
    prompts = _prompts(16, seed=3)
    rng = random.Random(4)
    params = [SamplingParams(max_tokens=rng.randrange(8, 40), temperature=0.0, ignore_eos=True) for _ in prompts]
    want, _ = _engine_run(model, tok, None, prompts, params, max_num_batched_tokens=48)
    spec = SpecConfig("draft", num_spec_tokens=3, draft_layers=2)
    engine_box = {}
    calls = {"forwards": 0, "rows": 0}

    def run_and_count():
        got, engine = _engine_run(model, tok, spec, prompts, params, max_num_batched_tokens=48)
        engine_box["e"] = engine
        return got

    original = TruncatedModel.forward_hidden

    def counting(self, input_ids, positions, cache):
        calls["forwards"] += 1
        calls["rows"] += input_ids.shape[0]
        return original(self, input_ids, positions, cache)

    TruncatedModel.forward_hidden = counting
    try:
        got = run_and_count()
    finally:
        TruncatedModel.forward_hidden = original
    assert got == want
    engine = engine_box["e"]
    assert engine.spec.stats.num_accepted_tokens > 0
    assert engine.spec.proposer.pool.slot_of == {}  # every finished request freed its slot
    assert calls["rows"] > 2 * calls["forwards"]  # on average more than 2 requests per draft forward


def test_seeded_sampling_independent_of_batch_companions(tiny):
    """A seeded T=1 request emits the same tokens alone and next to 7 other requests."""
    model, tok = tiny
    prompts = _prompts(8, seed=7)
    spec = SpecConfig("draft", num_spec_tokens=3, draft_layers=2)
    seeded = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, seed=123, ignore_eos=True)
    alone, _ = _engine_run(model, tok, spec, prompts[:1], [seeded])
    others = [SamplingParams(max_tokens=30, temperature=t, seed=None if t == 0.7 else i, ignore_eos=True)
              for i, t in enumerate([0.0, 0.7, 1.0, 0.0, 1.3, 0.7, 1.0])]
    crowd, _ = _engine_run(model, tok, spec, prompts[1:4] + prompts[:1] + prompts[4:], others[:3] + [seeded] + others[3:])
    assert crowd[3] == alone[0]
    other_seed, _ = _engine_run(model, tok, spec, prompts[:1], [SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9,
                                                                               seed=124, ignore_eos=True)])
    assert other_seed[0] != alone[0]
