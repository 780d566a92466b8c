"""The scheduler: decides, every step, which requests run and how many tokens each computes.

Plain Python over plain objects (no torch), after vLLM v1's scheduler and nano-vllm: there are
no separate prefill and decode phases; every request simply has `num_tokens - num_computed_tokens`
tokens it still needs to compute, and a step hands out a token budget (`max_num_batched_tokens`)
first to running requests (oldest first; a decode needs 1, a long prompt gets a chunk), then to
waiting ones (preempted requests first, then by arrival). When the KV blocks run out, the newest
running request is preempted: its blocks are freed and it is recomputed from scratch when it is
admitted again (its prefix-cached blocks usually make that cheap). The Batch labels that work:
`meta["num_recompute_tokens"]` counts, per resumed request, the tokens it recomputes this step.

Output: one `firstlight.core.batch.Batch`. After the runner executes it and the sampler picks
tokens, `update` appends them, checks stop conditions and frees what finished.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from firstlight.core.batch import Batch, ScheduledSeq
from firstlight.engine.kv_groups import SlidingWindowGroups
from firstlight.engine.kv_manager import KVCacheManager
from firstlight.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens computed per step (the chunked-prefill budget)
    max_model_len: int = 2048  # prompt + output tokens of one request
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens must be >= max_model_len "
                f"({self.max_num_batched_tokens} < {self.max_model_len})"
            )


class Scheduler:
    """Moves Requests between waiting, running, preempted and finished; emits one Batch per step."""

    def __init__(self, config: SchedulerConfig, kv: KVCacheManager | SlidingWindowGroups) -> None:
        self.config = config
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()  # preempted requests go to the front
        self.running: list[Request] = []  # in admission order; the newest is preempted first
        self.finished_ids: list[str] = []  # finished since the last `pop_finished`
        self.num_steps = 0
        self.num_preemptions = 0
        # preempted request id -> tokens it had computed: what its next prefill chunks recompute
        self._recompute_until: dict[str, int] = {}
        # a request must fit in the cache on its own, or preempting everything else cannot help it
        self.max_model_len = min(config.max_model_len, kv.num_blocks * kv.block_size)

    # ---- request lifecycle -----------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        if request.num_prompt_tokens >= self.max_model_len:
            raise ValueError(
                f"request {request.request_id}: prompt of {request.num_prompt_tokens} tokens leaves no "
                f"room to generate within the context length {self.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.finish_request(rid, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request from outside the step (abort, or a stop string found by detokenization)."""
        assert status.is_finished
        request = self.requests.get(request_id)
        if request is None or request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._recompute_until.pop(request.request_id, None)
        self.kv.free(request.request_id)
        self.finished_ids.append(request.request_id)

    def pop_finished(self) -> list[Request]:
        """Finished requests since the last call; the scheduler forgets them."""
        out = [self.requests.pop(rid) for rid in self.finished_ids if rid in self.requests]
        self.finished_ids.clear()
        return out

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> Batch:
        """Pick this step's work. The Batch may be empty only if nothing is runnable."""
        budget = self.config.max_num_batched_tokens
        num_new: dict[str, int] = {}
        preempted: list[str] = []

        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = self._num_tokens_to_compute(request, budget)
            if n == 0:
                i += 1
                continue
            while not self.kv.can_allocate(request, n):
                if request.spec_token_ids:  # drop the proposals before preempting anyone
                    n -= len(request.spec_token_ids)
                    request.spec_token_ids.clear()
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                budget += num_new.pop(victim.request_id, 0)
                if victim is request:
                    break
            else:
                self.kv.allocate(request, n)
                num_new[request.request_id] = n
                budget -= n
                i += 1
                continue
            break  # the request itself was preempted: it was the newest, nothing else to do

        # 2. waiting requests, unless we just had to preempt (no room) or are at the seq limit
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                hits, num_hit_tokens = self.kv.get_computed_blocks(request)
                request.num_computed_tokens = 0
                remaining = request.num_tokens - num_hit_tokens
                n = min(remaining, budget)
                if n < remaining and not self.config.enable_chunked_prefill:
                    break
                if not self.kv.can_allocate(request, n, hits):
                    break
                self.kv.allocate(request, n, hits)
                request.num_computed_tokens = num_hit_tokens
                request.num_cached_tokens = num_hit_tokens
                self.waiting.popleft()
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                num_new[request.request_id] = n
                budget -= n

        seqs = tuple(
            ScheduledSeq(
                request_id=r.request_id,
                num_tokens=num_new[r.request_id],
                num_computed_tokens=r.num_computed_tokens,
                num_prompt_tokens=r.num_prompt_tokens,
                num_spec_tokens=len(r.spec_token_ids),
                **self.kv.seq_block_ids(r.request_id),
            )
            for r in self.running
            if r.request_id in num_new
        )
        meta: dict[str, object] = {}
        recompute = self._num_recompute_tokens(seqs)
        if recompute:
            meta["num_recompute_tokens"] = recompute
        batch = Batch(seqs=seqs, step=self.num_steps, preempted_ids=tuple(preempted), meta=meta)
        self.num_steps += 1
        return batch

    def _num_recompute_tokens(self, seqs: tuple[ScheduledSeq, ...]) -> dict[str, int]:
        """Per resumed request, how many of its tokens this step recomputes: KV it had computed before
        a preemption dropped it (prompt and output tokens alike; prefix-cache hits are not recomputed).
        Past that point the request is an ordinary prefill or decode again."""
        out: dict[str, int] = {}
        for seq in seqs:
            until = self._recompute_until.get(seq.request_id)
            if until is None:
                continue
            n = min(seq.context_len, until) - seq.num_computed_tokens
            if n > 0:
                out[seq.request_id] = n
            if seq.context_len >= until:
                del self._recompute_until[seq.request_id]
        return out

    def _num_tokens_to_compute(self, request: Request, budget: int) -> int:
        n = request.num_tokens - request.num_computed_tokens
        if n > budget and not self.config.enable_chunked_prefill:
            return 0
        if request.spec_token_ids:
            # a decode that verifies k proposals computes 1 + k tokens; keep what fits the budget
            # and the context (the proposals are only guesses, dropping some is always correct)
            room = min(budget - n, self.max_model_len - request.num_tokens)
            del request.spec_token_ids[max(0, room) :]
            n += len(request.spec_token_ids)
        return min(n, budget)

    def _preempt(self, request: Request) -> None:
        """Recompute-style preemption: drop its KV, put it at the head of the waiting queue."""
        self.running.remove(request)
        self.kv.free(request.request_id)
        rid = request.request_id
        self._recompute_until[rid] = max(self._recompute_until.get(rid, 0), request.num_computed_tokens)
        request.spec_token_ids.clear()
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def update(self, batch: Batch, sampled: dict[str, list[int]]) -> list[Request]:
        """Advance computed tokens, append sampled ones, stop what is done.

        `sampled` maps request id -> the tokens picked this step (empty or absent for a prefill
        chunk that does not yet reach the end of the request's tokens; for a speculative decode,
        the accepted proposals followed by the recovered or bonus token). Returns the requests that
        got new tokens or finished this step.
        """
        touched: list[Request] = []
        for seq in batch.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.is_finished or request.status != RequestStatus.RUNNING:
                continue  # aborted between schedule and update
            new_tokens = sampled.get(seq.request_id) or []
            status = None
            for token in new_tokens:
                request.output_token_ids.append(token)
                status = self.check_stop(request)
                if status is not None:
                    break
            num_computed = request.num_computed_tokens + seq.num_tokens
            if seq.num_spec_tokens:
                # speculative decode: `new_tokens` = accepted proposals + one more; the rejected
                # proposals' K/V are rolled back (their slots are rewritten next step, their
                # blocks trimmed below). A stop inside the chunk ends the request anyway.
                num_computed = min(num_computed, request.num_tokens - 1)
                request.spec_token_ids.clear()
            request.num_computed_tokens = num_computed
            self.kv.cache_full_blocks(request)
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            elif seq.num_spec_tokens:
                self.kv.trim(request.request_id, request.num_tokens)
            if status is None:
                self.kv.release_out_of_window(request)
            if new_tokens:
                touched.append(request)
        return touched

    def check_stop(self, request: Request) -> RequestStatus | None:
        """Stop token / EOS / max_tokens / context length, checked after each appended token."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if last in params.stop_token_ids:
                request.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and last in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
