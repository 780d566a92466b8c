"""The engine's speculative-decoding collaborator: verify this step's proposals, propose the next.

    batch = scheduler.schedule()          # a speculating request runs 1 + k tokens (ScheduledSeq.num_spec_tokens = k)
    out   = runner.execute(batch, ...)    # one target pass over the paged cache scores all k proposals
    spec.verify(out, ...)                 # rejection sampling → accepted proposals + 1 token per request
    scheduler.update(batch, tokens)       # appends them; rolls back the rejected proposals' KV
    spec.propose(scheduler.running)       # proposals for the next step (request.spec_token_ids)

Per request, `SamplingParams.num_speculative_tokens` overrides the engine's k (0 turns it off).
Requests whose next-token distribution depends on the tokens within the chunk in a way the
verifier does not model (repetition/presence/frequency penalties, min_tokens) or that ask for
logprobs are not speculated: they decode one token per step as without a proposer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from firstlight.engine.request import Request
from firstlight.engine.sampler import Sampler, filter_rows
from firstlight.engine.speculative.adaptive import Acceptance, best_k, measure_pass_costs
from firstlight.engine.speculative.base import SpecRequest
from firstlight.engine.speculative.config import SpecConfig
from firstlight.engine.speculative.registry import make_proposer
from firstlight.engine.speculative.rejection import rejection_sample


@dataclass
class SpecDecodeStats:
    """Counters with vLLM's meaning: a draft = one request's proposals verified in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts whose proposal i was accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_per_draft(self) -> float:
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecoder:
    def __init__(self, config: SpecConfig, model: Any, tokenizer: Any, sampler: Sampler) -> None:
        self.config = config
        self.proposer = make_proposer(config, model, tokenizer)
        self.sampler = sampler
        self.stats = SpecDecodeStats(accepted_per_pos=[0] * config.num_spec_tokens)
        self._q: dict[str, torch.Tensor | None] = {}  # the distributions pending proposals came from
        self._hidden: dict[str, torch.Tensor] = {}  # [E] the hidden state that sampled the last token
        # needs_all_hidden: per request, (first position, [n, E]) the hidden states the proposer has not
        # been given yet; after it took them, (next position, empty)
        self._pending: dict[str, tuple[int, torch.Tensor]] = {}
        self._acceptance: dict[str, Acceptance] = {}  # adaptive_k: each request's own history
        self.pass_costs: list[float] = []  # adaptive_k: c(1 + k) relative to a 1-token pass
        if config.adaptive_k:
            self.pass_costs = (list(config.pass_costs) if config.pass_costs is not None
                               else measure_pass_costs(model, config.num_spec_tokens))
        self.last_step: dict[str, int] = {}  # this step's counts, for the trace

    @property
    def needs_hidden(self) -> bool:
        return self.proposer.needs_hidden

    @property
    def needs_all_hidden(self) -> bool:
        return self.proposer.needs_all_hidden

    def num_spec_tokens(self, request: Request, max_model_len: int) -> int:
        """How many tokens to propose for a request now (0: decode it normally)."""
        p = request.sampling_params
        if p.has_penalties or request.num_output_tokens < p.min_tokens or p.logprobs is not None:
            return 0
        k = self._cap(request)
        if self.config.adaptive_k:
            rate = self._acceptance.setdefault(request.request_id, Acceptance()).rate
            k = best_k(rate, self.pass_costs, k, self.proposer.cost)
        # all accepted + the bonus token must fit in max_tokens and in the context
        return max(0, min(k, p.max_tokens - request.num_output_tokens - 1, max_model_len - request.num_tokens - 1))

    def _cap(self, request: Request) -> int:
        n = request.sampling_params.num_speculative_tokens
        return self.config.num_spec_tokens if n is None else n

    def _never_speculated(self, request: Request) -> bool:
        p = request.sampling_params
        return p.has_penalties or p.logprobs is not None or self._cap(request) == 0

    def _add_hidden(self, request: Request, hidden: torch.Tensor) -> None:
        """Queue a forward's hidden states [n, E] (the first at the request's num_computed_tokens, as
        before `scheduler.update`) for the proposer. A recompute after preemption starts over."""
        if self._never_speculated(request):
            return
        rid, start = request.request_id, request.num_computed_tokens
        if rid in self._pending:
            first, queued = self._pending[rid]
            if start > first + len(queued):
                raise RuntimeError(f"{rid}: hidden states from position {start} but the queue ends at "
                                   f"{first + len(queued)}")
            if start >= first:
                hidden, start = torch.cat([queued[: start - first], hidden]), first
        self._pending[rid] = (start, hidden)

    # ---- after the target pass ---------------------------------------------------------------
    @torch.inference_mode()
    def verify(self, exec_out: Any, requests: dict[str, Request]) -> dict[str, list[int]]:
        """Tokens each speculating request emits this step (rejection sampling, Leviathan et al. 2023)."""
        for rid in exec_out.sample_ids:  # plain rows: remember the hidden state that sampled
            if rid in exec_out.hidden:
                self._hidden[rid] = exec_out.hidden[rid][-1]
        for rid, hidden in exec_out.all_hidden.items():  # every non-speculative row, prefill chunks too
            if rid not in exec_out.spec_logits:
                self._add_hidden(requests[rid], hidden)
        rids = list(exec_out.spec_logits)
        self.last_step = {"num_drafts": len(rids), "num_draft_tokens": 0, "num_accepted_tokens": 0}
        if not rids:
            return {}
        reqs = [requests[r] for r in rids]
        ks = [exec_out.spec_logits[r].shape[0] - 1 for r in rids]
        k_max = max(ks)
        vocab = exec_out.spec_logits[rids[0]].shape[-1]
        probs = torch.zeros(len(rids), k_max + 1, vocab)
        draft_ids = torch.zeros(len(rids), k_max, dtype=torch.long)
        qs = [self._q.pop(r, None) for r in rids]
        draft_probs = torch.zeros(len(rids), k_max, vocab) if any(q is not None for q in qs) else None
        for i, (req, k) in enumerate(zip(reqs, ks, strict=True)):
            logits = exec_out.spec_logits[rids[i]].float()  # [1 + k, V]
            params = req.sampling_params
            if params.is_greedy:
                probs[i, : k + 1] = logits.softmax(-1)
            else:
                probs[i, : k + 1] = filter_rows(logits, [params] * len(logits)).softmax(-1)
            draft_ids[i, :k] = torch.tensor(req.spec_token_ids[:k], dtype=torch.long)
            if draft_probs is not None:
                q = qs[i]
                if q is None:  # a deterministic proposal in a mixed batch: q is one-hot
                    draft_probs[i, torch.arange(k), draft_ids[i, :k]] = 1.0
                else:
                    draft_probs[i, :k] = q[:k].float()
        emitted = rejection_sample(
            probs, draft_ids, ks, draft_probs,
            is_greedy=[r.sampling_params.is_greedy for r in reqs],
            generators=[self.sampler.generator(r) for r in reqs],
        )
        for rid, k, toks in zip(rids, ks, emitted, strict=True):
            num_accepted = len(toks) - 1
            self.stats.num_drafts += 1
            self.stats.num_draft_tokens += k
            self.stats.num_accepted_tokens += num_accepted
            for pos in range(num_accepted):
                self.stats.accepted_per_pos[pos] += 1
            self.last_step["num_draft_tokens"] += k
            self.last_step["num_accepted_tokens"] += num_accepted
            if self.config.adaptive_k:
                self._acceptance.setdefault(rid, Acceptance()).update(k, num_accepted)
            if rid in exec_out.hidden:
                self._hidden[rid] = exec_out.hidden[rid][num_accepted]
            if rid in exec_out.all_hidden:  # the last known token's and the accepted proposals' states
                self._add_hidden(requests[rid], exec_out.all_hidden[rid][: num_accepted + 1])
        return dict(zip(rids, emitted, strict=True))

    # ---- before the next step ------------------------------------------------------------------
    def propose(self, running: list[Request], max_model_len: int) -> None:
        """Fill `spec_token_ids` of the running requests that decode next step."""
        asks: list[SpecRequest] = []
        targets: list[Request] = []
        for req in running:
            if req.is_finished or req.num_computed_tokens != req.num_tokens - 1:
                continue  # still prefilling
            if req.spec_token_ids:
                continue  # not scheduled this step (token budget): its proposals still stand
            k = self.num_spec_tokens(req, max_model_len)
            hidden = self._hidden.get(req.request_id)
            pending = self._pending.get(req.request_id) if self.needs_all_hidden else None
            if k == 0 or (self.needs_hidden and hidden is None) or (self.needs_all_hidden and pending is None):
                if req.request_id in self._acceptance:
                    self._acceptance[req.request_id].idle()
                continue
            temperature = req.sampling_params.temperature
            ask = SpecRequest(req.request_id, req.all_token_ids, k, temperature, self.sampler.generator(req), hidden)
            if pending is not None:
                ask.hidden_start, ask.hidden_states = pending
            asks.append(ask)
            targets.append(req)
        if not asks:
            return
        for req, ask, prop in zip(targets, asks, self.proposer.propose(asks), strict=True):
            tokens = prop.token_ids[: ask.num_spec_tokens]
            req.spec_token_ids = list(tokens)
            self._q[req.request_id] = None if prop.probs is None else prop.probs[: len(tokens)]
            if ask.hidden_states is not None:  # the proposer has them now (an empty view would pin the pass's tensor)
                h = ask.hidden_states
                self._pending[req.request_id] = (ask.hidden_start + len(h), h.new_empty(0, h.shape[-1]))

    def free(self, request_id: str) -> None:
        self._q.pop(request_id, None)
        self._hidden.pop(request_id, None)
        self._pending.pop(request_id, None)
        self._acceptance.pop(request_id, None)
        self.proposer.free(request_id)
