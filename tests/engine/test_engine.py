from __future__ import annotations

import json

import pytest
import torch

from firstlight.core.trace import Trace
from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.llm import LLM
from firstlight.engine.request import SamplingParams
from firstlight.errors import FirstlightError

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def full_forward_greedy(model, ids: list[int], n: int) -> list[int]:
    """Reference: recompute the whole sequence every token, no cache at all."""
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(ids):]


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(3, 380, (ln,), generator=g).tolist() for ln in lens]


def run_staggered(engine: LLMEngine, ps: list[list[int]], params: SamplingParams, every: int = 2) -> dict:
    """Submit one prompt every `every` steps while the engine runs."""
    done, ids, pending, step = {}, {}, list(enumerate(ps)), 0
    while pending or engine.has_unfinished():
        if pending and step % every == 0:
            i, p = pending.pop(0)
            ids[engine.add_request(p, params).request_id] = i
        for out in engine.step():
            if out.finished:
                done[ids[out.request_id]] = out
        engine.kv.check_invariants()
        step += 1
        assert step < 2000
    return done


@pytest.mark.parametrize("block_size,budget", [(4, 16), (16, 64)])
def test_greedy_matches_full_forward_staggered(tiny, block_size, budget) -> None:
    model, tok = tiny
    ps = prompts(8)
    engine = LLMEngine(model, tok, EngineConfig(block_size=block_size, num_blocks=128, max_num_batched_tokens=budget))
    done = run_staggered(engine, ps, GREEDY)
    for i, p in enumerate(ps):
        assert done[i].output_token_ids == full_forward_greedy(model, p, 10), f"prompt {i}"
    assert engine.kv.num_used_blocks == 0


def test_preemption_gives_same_tokens(tiny) -> None:
    model, tok = tiny
    ps = prompts(6, seed=1)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # 24 blocks of 4 tokens cannot hold 6 sequences of up to ~64 tokens: preemptions must happen
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=24, max_num_batched_tokens=32))
    done = run_staggered(engine, ps, params, every=1)
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(ps):
        assert done[i].output_token_ids == full_forward_greedy(model, p, 24)
    assert engine.kv.num_used_blocks == 0


def test_prefix_cache_hits_give_same_tokens(tiny) -> None:
    model, tok = tiny
    shared = prompts(1, seed=2)[0] * 2  # a long shared prefix
    ps = [shared + [5, 6, 7], shared + [9, 10], shared + [5, 6, 7]]
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=128))
    outs = []
    for p in ps:
        engine.add_request(p, GREEDY)
        while engine.has_unfinished():
            outs += [o for o in engine.step() if o.finished]
    assert outs[1].num_cached_tokens >= 4 * (len(shared) // 4) - 4
    assert outs[2].num_cached_tokens == 4 * ((len(ps[2]) - 1) // 4)
    assert engine.kv.stats.num_hit_tokens == outs[1].num_cached_tokens + outs[2].num_cached_tokens
    for p, o in zip(ps, outs, strict=True):
        assert o.output_token_ids == full_forward_greedy(model, p, 10)


def test_seed_independent_of_batch_companions(tiny) -> None:
    model, tok = tiny
    p = prompts(1, seed=3)[0]
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = LLM((model, tok), block_size=4, num_blocks=128).generate([p], sp)[0].output_token_ids
    others = prompts(5, seed=4)
    mixed = LLM((model, tok), block_size=4, num_blocks=128).generate(
        others[:2] + [p] + others[2:],
        [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)] * 2 + [sp]
        + [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 3,
    )[2].output_token_ids
    assert alone == mixed
    other_seed = LLM((model, tok), block_size=4, num_blocks=128).generate(
        [p], sp.model_copy(update={"seed": 99})
    )[0].output_token_ids
    assert other_seed != alone


def test_logprobs_and_prompt_logprobs_match_full_forward(tiny) -> None:
    model, tok = tiny
    p = prompts(1, seed=5)[0]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    out = LLM((model, tok), block_size=4, num_blocks=64, max_num_batched_tokens=8).generate([p], sp)[0]
    full = torch.log_softmax(model(torch.tensor([p + out.output_token_ids]))[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(p)
    for j in range(1, len(p)):
        lp = out.prompt_logprobs[j]
        assert lp.token_id == p[j]
        assert lp.logprob == pytest.approx(float(full[j - 1, p[j]]), abs=1e-4)
        assert len(lp.top) == 2
    assert len(out.logprobs) == 4
    for k, lp in enumerate(out.logprobs):
        row = full[len(p) - 1 + k]
        assert lp.rank == 1 and lp.token_id == int(row.argmax())
        assert lp.logprob == pytest.approx(float(row.max()), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()


def test_stop_string_and_eos(tiny) -> None:
    model, tok = tiny
    llm = LLM((model, tok), block_size=4, num_blocks=64)
    base = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))[0]
    assert len(base.text) > 4
    stop = base.text[3:5]
    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=16, temperature=0.0, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == base.text[: base.text.index(stop)]
    ids = base.output_token_ids
    out2 = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(ids[2],)))[0]
    assert out2.output_token_ids == ids[: ids.index(ids[2]) + 1] and out2.finish_reason == "stop"


def test_abort_frees_blocks_and_bad_requests(tiny) -> None:
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64, max_model_len=128))
    req = engine.add_request(prompts(1)[0], SamplingParams(max_tokens=50))
    engine.step()
    assert engine.kv.num_used_blocks > 0
    engine.abort_request(req.request_id)
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished()
    with pytest.raises(FirstlightError, match="context length"):
        engine.add_request([1] * 100, SamplingParams(max_tokens=50))
    with pytest.raises(FirstlightError, match="range"):
        engine.add_request([100000], SamplingParams())


def test_trace_written_and_exports(tiny, tmp_path) -> None:
    model, tok = tiny
    path = tmp_path / "t.jsonl"
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=16, trace_path=path))
    run_staggered(engine, prompts(3), GREEDY)
    engine.close()
    trace = Trace.load(path)
    assert trace.meta["engine"] == "firstlight" and len(trace.steps) >= 10
    assert all(s.execute_s > 0 and s.batch.num_tokens <= 16 for s in trace.steps)
    assert sum(s.batch.num_prefill_tokens for s in trace.steps) == sum(len(p) for p in prompts(3))
    assert len(trace.requests) == 3  # one request line per finished request
    for r in trace.requests:
        assert r.arrival_s <= r.first_token_s <= r.finish_s and r.num_output_tokens == GREEDY.max_tokens
    chrome = trace.to_chrome()
    steps = [e for e in chrome["traceEvents"] if e["pid"] == 0 and e["ph"] == "X"]
    assert len(steps) == 3 * len(trace.steps)
    tracks = {e["tid"] for e in chrome["traceEvents"] if e["pid"] == 1 and e["ph"] == "X"}
    assert len(tracks) == 3  # one track per request
    json.dumps(chrome)


@pytest.mark.parametrize("family", ["gemma3_text", "mistral", "qwen3"])
def test_other_families_greedy_match(family, tmp_path) -> None:
    """Sliding-window layers (gemma3, mistral) and qk-norm (qwen3) over the paged cache."""
    from firstlight.models.loader import load_model
    from firstlight.models.tiny import write_tiny_checkpoint

    model, tok = load_model(write_tiny_checkpoint(tmp_path / family, family=family, seed=1))
    ps = prompts(4, seed=7)
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=16))
    done = run_staggered(engine, ps, GREEDY)
    for i, p in enumerate(ps):
        assert done[i].output_token_ids == full_forward_greedy(model, p, 10), f"{family} prompt {i}"


def test_sample_logits_are_the_rows_in_place_when_they_are_consecutive() -> None:
    from firstlight.engine.runner import _consecutive_rows

    logits = torch.randn(4, 7)
    got = _consecutive_rows([logits[i] for i in range(4)])
    assert got is not None and got.data_ptr() == logits.data_ptr() and torch.equal(got, logits)
    assert torch.equal(_consecutive_rows([logits[1], logits[2]]), logits[1:3])
    # another order, a gap, another tensor or a strided row: not one block of rows (the caller stacks them)
    assert _consecutive_rows([logits[1], logits[0]]) is None
    assert _consecutive_rows([logits[0], logits[2]]) is None
    assert _consecutive_rows([logits[0], torch.randn(7)]) is None
    assert _consecutive_rows([logits[:, 0], logits[:, 1]]) is None
