"""Speculative decoding inside the continuous-batching engine (paged cache, many requests at once)."""

import json

import pytest
import torch

from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.request import SamplingParams
from firstlight.engine.speculative.config import SpecConfig
from firstlight.engine.speculative.medusa import MedusaHeads, model_name, save_heads
from firstlight.errors import FirstlightError

PROMPTS = [[1, 40, 41, 42, 43, 40, 41], [1, 7, 8, 9, 10, 11, 12, 13, 7, 8], [1, 100, 200, 50],
           [1, 5, 5, 5, 5], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 309, 310, 311]]


def _run(model, tok, spec, params, prompts=PROMPTS, **cfg):
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=cfg.pop("num_blocks", 128), speculative=spec, **cfg))
    plist = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, plist, strict=True)]
    done, chunks = {}, []
    for _ in range(2000):
        if not engine.has_unfinished():
            break
        for out in engine.step():
            chunks.append(len(out.new_token_ids))
            if out.finished:
                done[out.request_id] = out.output_token_ids
        engine.kv.check_invariants()
    engine.close()
    return [done[i] for i in ids], chunks, engine


@pytest.fixture(scope="module")
def heads_file(tiny, tmp_path_factory):
    model, _ = tiny
    heads = MedusaHeads(model.config.hidden_size, 4)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return save_heads(heads, tmp_path_factory.mktemp("heads") / "h.safetensors", model.config, model_name(model.config))


def _spec(method, heads_file, tmp_path, k=3):
    if method == "ngram":
        return SpecConfig("ngram", num_spec_tokens=k)
    if method == "draft-self":
        return SpecConfig("draft", num_spec_tokens=k, draft_layers=2)
    if method == "draft-model":
        from firstlight.models.tiny import write_tiny_checkpoint

        # same seed, fewer layers: shares the target's embedding, first layers and head
        d = write_tiny_checkpoint(tmp_path / "draft", "llama", seed=0, num_hidden_layers=2)
        return SpecConfig("draft", num_spec_tokens=k, draft_model=str(d))
    return SpecConfig("heads", num_spec_tokens=k, heads_path=str(heads_file))


@pytest.mark.parametrize("method", ["ngram", "draft-self", "draft-model", "heads"])
def test_greedy_engine_output_identical_to_no_speculation(tiny, heads_file, tmp_path, method):
    model, tok = tiny
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want, _, _ = _run(model, tok, None, greedy)
    got, chunks, engine = _run(model, tok, _spec(method, heads_file, tmp_path), greedy)
    assert got == want
    st = engine.spec.stats
    assert st.num_drafts > 0 and st.num_accepted_tokens > 0
    assert max(chunks) > 1  # streamed deltas carry several tokens
    # fewer steps than tokens: one target pass emitted several tokens
    assert engine.scheduler.num_steps < sum(len(w) for w in want)


def test_rollback_under_memory_pressure_and_small_budget(tiny, heads_file, tmp_path):
    """Few blocks (preemption) and a small token budget (proposals trimmed): still exact."""
    model, tok = tiny
    greedy = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want, _, _ = _run(model, tok, None, greedy)
    got, _, engine = _run(model, tok, _spec("ngram", heads_file, tmp_path, k=4), greedy, num_blocks=24,
                          max_num_batched_tokens=12)
    assert got == want
    assert engine.scheduler.num_preemptions > 0


def test_per_request_configuration(tiny, heads_file, tmp_path):
    model, tok = tiny
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, num_speculative_tokens=k) for k in (0, 1, 3, 0, 2)]
    want, _, _ = _run(model, tok, None, params)
    engine_spec = _spec("draft-self", heads_file, tmp_path, k=4)
    got, _, engine = _run(model, tok, engine_spec, params)
    assert got == want
    assert engine.spec.stats.accepted_per_pos[3] == 0  # nobody asked for more than 3


@pytest.mark.parametrize("method", ["ngram", "heads"])
def test_adaptive_k_is_exact_and_follows_acceptance(tiny, heads_file, tmp_path, method):
    """Greedy output is unchanged; k follows each request's acceptance under the given pass costs."""
    from dataclasses import replace

    from firstlight.engine.speculative.adaptive import best_k

    model, tok = tiny
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want, _, _ = _run(model, tok, None, greedy)
    cap = 8 if method == "ngram" else 4  # the heads file has 4 heads
    costs = tuple(1.0 + 0.15 * k for k in range(cap + 1))  # a CPU-like table: extra tokens cost
    spec = replace(_spec(method, heads_file, tmp_path, k=cap), adaptive_k=True, pass_costs=costs)
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=128, speculative=spec))
    ids = [engine.add_request(p, greedy).request_id for p in PROMPTS]
    done, ks = {}, set()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output_token_ids
        for r in engine.scheduler.running:  # what was proposed is what the policy chose (or fewer)
            acc = engine.spec._acceptance.get(r.request_id)
            if acc is not None:
                chosen = best_k(acc.rate, costs, cap, engine.spec.proposer.cost)
                assert len(r.spec_token_ids) <= chosen
                ks.add(chosen)
        engine.kv.check_invariants()
    engine.close()
    assert [done[i] for i in ids] == want
    assert len(ks) > 1  # k moved with the acceptance (0 included: not worth proposing)


def test_adaptive_policy_math():
    from firstlight.engine.speculative.adaptive import Acceptance, best_k, expected_tokens, interpolate_costs

    assert expected_tokens(0.0, 5) == 1.0 and expected_tokens(1.0, 5) == 6.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12
    flat = [1.0] * 17  # memory-bound (GPU-like): proposing is free, so propose the most
    assert best_k(0.3, flat, 16) == 16
    cpu = interpolate_costs({1: 1.0, 2: 1.66, 3: 2.08, 5: 1.64, 9: 1.87, 17: 2.28}, 16)  # the dev VM's MKL
    assert cpu[0] == 1.0 and abs(cpu[4] - 1.64) < 1e-9 and abs(cpu[6] - (1.64 + 0.23 * 2 / 4)) < 1e-9
    assert best_k(0.2, cpu, 16) == 0  # poor guesses are not worth a 1.6x pass
    assert best_k(0.95, cpu, 16) == 16
    assert best_k(0.7, cpu, 16) not in (1, 2)  # never the 2- and 3-token passes that cost more than 5
    a = Acceptance()
    assert abs(a.rate - 0.6) < 1e-12
    for _ in range(10):
        a.update(8, 8)
    assert a.rate > 0.9
    high = a.rate
    a.update(8, 0)
    assert a.rate < high
    high = a.rate
    for _ in range(30):
        a.idle()
    assert abs(a.rate - 0.6) < abs(high - 0.6)  # idle steps drift back to the prior


@pytest.mark.parametrize("method", ["ngram", "draft-self", "heads"])
def test_seeded_sampling_reproducible(tiny, heads_file, tmp_path, method):
    model, tok = tiny
    params = [SamplingParams(max_tokens=25, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True) for i in range(len(PROMPTS))]
    spec = _spec(method, heads_file, tmp_path)
    a, _, _ = _run(model, tok, spec, params)
    b, _, _ = _run(model, tok, spec, params[::-1], prompts=PROMPTS[::-1])  # other batch order
    assert a == b[::-1]


def test_metrics_and_trace_report_acceptance(tiny, heads_file, tmp_path):
    model, tok = tiny
    trace = tmp_path / "steps.jsonl"
    _, _, engine = _run(model, tok, _spec("ngram", heads_file, tmp_path), SamplingParams(max_tokens=30, temperature=0.0),
                        trace_path=trace)
    text = engine.metrics.render("tiny", 0.0, 0, 0)
    st = engine.spec.stats
    assert f'firstlight:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {st.num_accepted_tokens}' in text
    assert 'spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text
    lines = [json.loads(line) for line in trace.read_text().splitlines()[1:]]
    steps = [x for x in lines if "batch" in x]  # request lines (one per finished request) carry no stats
    assert sum(s["stats"].get("num_accepted_tokens", 0) for s in steps) == st.num_accepted_tokens
    assert sum(seq["num_spec_tokens"] for s in steps for seq in s["batch"]["seqs"]) == st.num_draft_tokens


def test_bad_inputs_are_clear_errors(tiny, tmp_path):
    from firstlight.models.loader import load_model
    from firstlight.models.tiny import write_tiny_checkpoint

    model, tok = tiny
    other_vocab = write_tiny_checkpoint(tmp_path / "v320", "llama", seed=3, vocab_size=320)
    with pytest.raises(FirstlightError, match="vocabulary of 320 tokens"):
        LLMEngine(model, tok, EngineConfig(num_blocks=16, speculative=SpecConfig("draft", draft_model=str(other_vocab))))
    other, _ = load_model(write_tiny_checkpoint(tmp_path / "q", "qwen2", seed=1))
    wrong = save_heads(MedusaHeads(64, 4), tmp_path / "other.safetensors", other.config, model_name(other.config))
    with pytest.raises(FirstlightError, match="was trained for model 'qwen2-4L-64d'"):
        LLMEngine(model, tok, EngineConfig(num_blocks=16, speculative=SpecConfig("heads", heads_path=str(wrong))))


def test_kv_trim_frees_only_the_tail_blocks_of_rejected_proposals():
    from firstlight.engine.kv_manager import KVCacheManager
    from firstlight.engine.request import Request

    kv = KVCacheManager(num_blocks=10, block_size=4)
    req = Request("r", list(range(1, 6)), SamplingParams())
    kv.allocate(req, 5 + 4)  # a 5-token context + 4 proposals: 3 blocks
    assert len(kv.block_tables["r"]) == 3
    req.num_computed_tokens = 6  # 1 accepted
    kv.cache_full_blocks(req)
    assert kv.trim("r", 7) == 1  # 7 tokens need 2 blocks
    assert len(kv.block_tables["r"]) == 2 and kv.num_free_blocks == 8
    assert kv.trim("r", 7) == 0
    kv.check_invariants()


def test_adaptive_k_measures_pass_costs_and_checks_given_ones(tiny):
    from firstlight.engine.speculative.adaptive import measure_pass_costs

    model, tok = tiny
    costs = measure_pass_costs(model, 6, context=8, repeats=1)
    assert len(costs) == 7 and costs[0] == 1.0 and min(costs) > 0
    engine = LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64,
                                                speculative=SpecConfig("ngram", 6, adaptive_k=True)))
    assert len(engine.spec.pass_costs) == 7
    engine.close()
    with pytest.raises(FirstlightError, match="pass_costs"):
        SpecConfig("ngram", 4, adaptive_k=True, pass_costs=(1.0, 1.1))


def test_proposer_costs_count_the_weights_they_read(tiny, heads_file, tmp_path):
    """Adaptive k charges a proposer what it reads: heads the LM head once, a draft k x its layers."""
    from firstlight.engine.speculative.adaptive import best_k, decode_bytes, module_bytes

    model, tok = tiny
    full = decode_bytes(model)
    engines = {m: LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=64, speculative=_spec(m, heads_file, tmp_path)))
               for m in ("ngram", "heads", "draft-self")}
    ngram, heads, draft = (engines[m].spec.proposer for m in ("ngram", "heads", "draft-self"))
    assert ngram.cost(4) == 0.0
    assert heads.cost(1) == heads.cost(4) == module_bytes(heads.heads, model.lm_head) / full
    assert abs(draft.cost(3) - 3 * decode_bytes(model, 2) / full) < 1e-12 and 0 < draft.cost(1) < 1
    flat = [1.0] * 5
    assert best_k(0.5, flat, 4) == 4 and best_k(0.5, flat, 4, draft.cost) < 4  # its own cost holds k back
    assert best_k(0.05, flat, 4, heads.cost) == 0
    for e in engines.values():
        e.close()
