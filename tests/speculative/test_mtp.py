"""Native MTP speculation on a hybrid model (tiny random Qwen3-Next with one MTP layer): greedy output is
unchanged, the batched MTP proposals equal a from-scratch computation, rejected proposals leave the
recurrent state untouched, and a checkpoint without an MTP layer is a clear error.

The tiny model's MTP layer is random, so it almost never guesses right (acceptance ~0): the rollback
of partial acceptances is exercised with an oracle proposer that knows the answer and errs on purpose.
"""

from __future__ import annotations

import pytest
import torch

from firstlight.engine.engine import EngineConfig, LLMEngine
from firstlight.engine.request import SamplingParams
from firstlight.engine.speculative.base import Proposal, Proposer, SpecRequest
from firstlight.engine.speculative.config import SpecConfig
from firstlight.errors import FirstlightError
from firstlight.models.loader import load_model
from tests.engine.test_engine import prompts, run_staggered

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid(tiny_checkpoint):
    model, tok = load_model(tiny_checkpoint("qwen3_next", seed=2))
    return model.eval(), tok


def _engine(model, tok, spec, **cfg):
    return LLMEngine(model, tok, EngineConfig(block_size=4, num_blocks=cfg.pop("num_blocks", 128),
                                              max_num_batched_tokens=cfg.pop("budget", 16), speculative=spec, **cfg))


def _tokens(done):
    return [done[i].output_token_ids for i in sorted(done)]


@pytest.fixture(scope="module")
def plain_tokens(hybrid):
    model, tok = hybrid
    return _tokens(run_staggered(_engine(model, tok, None), prompts(6, seed=4), GREEDY))


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_greedy_engine_output_identical_to_no_speculation(hybrid, plain_tokens, method):
    """6 staggered prompts, 16-token budget (chunked prefill next to verify passes), k = 3."""
    model, tok = hybrid
    engine = _engine(model, tok, SpecConfig(method, num_spec_tokens=3))
    assert _tokens(run_staggered(engine, prompts(6, seed=4), GREEDY)) == plain_tokens
    if method == "mtp":  # n-gram lookup finds little in random prompts; the MTP layer always proposes
        assert engine.spec.stats.num_drafts > 20
    assert engine.kv.num_used_blocks == 0 and engine.kv.num_free_slots == engine.kv.num_slots


def test_per_request_k_and_adaptive_k_keep_the_output(hybrid, plain_tokens):
    """Requests that never speculate (k = 0), fewer proposals than the engine's k, and adaptive k (which
    turns proposals off for steps at a time, so the MTP layer later catches up over several positions)."""
    model, tok = hybrid
    ks = [0, 1, 3, None, 2, None]
    params = [GREEDY.model_copy(update={"num_speculative_tokens": k}) for k in ks]
    spec = SpecConfig("mtp", num_spec_tokens=3, adaptive_k=True, pass_costs=(1.0, 1.1, 1.2, 1.3))
    engine = _engine(model, tok, spec)
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts(6, seed=4), params, strict=True)]
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
        engine.kv.check_invariants()
    assert [done[i] for i in ids] == plain_tokens
    assert engine.spec.stats.num_drafts > 0 and not engine.spec._pending


def test_seeded_sampling_reproducible_across_batch_orders(hybrid):
    model, tok = hybrid
    ps = prompts(4, seed=6)
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=i, ignore_eos=True) for i in range(4)]

    def run(order):  # a roomy budget: trimming proposals to a small one depends on the batch order
        engine = _engine(model, tok, SpecConfig("mtp", num_spec_tokens=3), budget=2048)
        ids = {engine.add_request(ps[i], params[i]).request_id: i for i in order}
        done = {}
        while engine.has_unfinished():
            done.update({ids[o.request_id]: o.output_token_ids for o in engine.step() if o.finished})
        return [done[i] for i in range(4)], engine.spec.stats.num_drafts

    (a, num_drafts), (b, _) = run([0, 1, 2, 3]), run([3, 2, 1, 0])
    assert a == b and num_drafts > 0


def _reference_proposals(model, token_ids, k):
    """MTP proposals from scratch (no cache): the target over the whole sequence, then the MTP layer over
    every position, its own output standing in for the target's hidden state at each new position."""
    n = len(token_ids)
    with torch.inference_mode():
        hidden = model.forward_hidden(torch.tensor([token_ids[:-1]]), torch.arange(n - 1)[None])[0]  # [N-1, E]
        ids, out = list(token_ids[1:]), []
        for _ in range(k):
            h = model.forward_mtp(hidden[None], torch.tensor([ids]), torch.arange(len(ids))[None])[0, -1]
            out.append(int(model.compute_logits(h).argmax()))
            hidden = torch.cat([hidden, h[None]])
            ids.append(out[-1])
    return out


def test_batched_mtp_proposals_equal_a_from_scratch_computation(hybrid):
    """Every step's proposals (catch-up over new positions, KV rolled back past the drafts, rows batched,
    a preemption restarting a request) equal the proposals computed from scratch for that request."""
    model, tok = hybrid
    engine = _engine(model, tok, SpecConfig("mtp", num_spec_tokens=3), num_blocks=14, budget=12)
    for p in prompts(5, seed=5):
        engine.add_request(p, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    num_checked = 0
    while engine.has_unfinished():
        engine.step()
        engine.kv.check_invariants()
        for r in engine.scheduler.running:
            if r.spec_token_ids:
                want = _reference_proposals(model, r.all_token_ids, len(r.spec_token_ids))
                assert r.spec_token_ids == want, r.request_id
                num_checked += 1
    assert num_checked > 15 and engine.scheduler.num_preemptions > 0


class OracleProposer(Proposer):
    """Proposes the known greedy continuation with one wrong token at a random place (or none), so every
    acceptance length 0 .. k happens."""

    name = "oracle"

    def __init__(self, answers: dict[tuple[int, ...], list[int]], seed: int = 0) -> None:
        self.answers = answers
        self.gen = torch.Generator().manual_seed(seed)

    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        out = []
        for r in requests:
            prompt = next(p for p in self.answers if tuple(r.token_ids[: len(p)]) == p)
            done = len(r.token_ids) - len(prompt)
            toks = list(self.answers[prompt][done : done + r.num_spec_tokens])
            wrong = int(torch.randint(0, r.num_spec_tokens + 1, (1,), generator=self.gen))
            if wrong < len(toks):
                toks[wrong] = (toks[wrong] + 1) % 384
            out.append(Proposal(toks))
        return out


def test_rejected_proposals_leave_the_recurrent_state_untouched(hybrid, plain_tokens):
    """Partial acceptance of every length: the state after the last accepted token is put back, so the
    output equals plain decoding (without the rollback the next token reads a state that saw rejected
    proposals, and the output diverges)."""
    model, tok = hybrid
    ps = prompts(6, seed=4)
    engine = _engine(model, tok, SpecConfig("ngram", num_spec_tokens=4))
    engine.spec.proposer = OracleProposer({tuple(p): t for p, t in zip(ps, plain_tokens, strict=True)})
    assert _tokens(run_staggered(engine, ps, GREEDY)) == plain_tokens
    per_pos = engine.spec.stats.accepted_per_pos
    assert per_pos[0] > per_pos[3] > 0  # accepted runs of every length, and rejections after them


@pytest.fixture(scope="module")
def no_mtp_ckpt(tmp_path_factory):
    from firstlight.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("no-mtp"), "qwen3_next", seed=1, num_nextn_predict_layers=0)


def test_mtp_on_a_checkpoint_without_an_mtp_layer_is_a_clear_error(tiny_checkpoint, no_mtp_ckpt):
    no_mtp, tok = load_model(no_mtp_ckpt)
    with pytest.raises(FirstlightError, match=r"num_nextn_predict_layers = 0 and no mtp\.\* weights"):
        _engine(no_mtp, tok, SpecConfig("mtp"))
    llama, tok = load_model(tiny_checkpoint("llama", seed=0))
    with pytest.raises(FirstlightError, match=r"llama has no multi-token-prediction layer"):
        _engine(llama, tok, SpecConfig("mtp"))


def test_draft_proposer_on_a_hybrid_model_is_a_clear_error(hybrid):
    model, tok = hybrid
    with pytest.raises(FirstlightError, match="recurrent layers.*use --speculative mtp or ngram"):
        _engine(model, tok, SpecConfig("draft", draft_layers=2))


def test_serve_mtp_without_an_mtp_layer_exits_with_the_message(no_mtp_ckpt):
    """The CLI path: the error is printed on one line and `serve` exits 1 before binding a port."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import firstlight

    cmd = [sys.executable, "-c", "from firstlight.cli import main; main()", "serve", "--model", str(no_mtp_ckpt),
           "--speculative", "mtp", "--port", "0"]
    env = {**os.environ, "PYTHONPATH": str(Path(firstlight.__file__).parents[1])}  # this checkout's package
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 1, res.stderr
    assert "num_nextn_predict_layers = 0" in res.stderr and "Traceback" not in res.stderr
