"""Discrete-event serving simulator: arrivals -> router -> replicas (continuous batching) -> metrics.

The loop pops the earliest event and calls its handler; handlers return the new events. There is one
event per arrival, per scheduler step of each replica and per KV transfer, never one per token:
a replica tracks its decoding sequences in aggregate (count, summed context, tokens-per-block
residues), so a step costs O(1) plus O(prefill chunks) no matter how large the batch.

The scheduler follows the engine's policy (vLLM v1 style): running decodes first, then running
prefill chunks, then new requests, under `max_num_batched_tokens` and `max_num_seqs`; KV is paged in
blocks of `block_size`; when a step needs blocks it does not have, the newest running request is
preempted (recompute: it goes back to the front of the queue and later prefills prompt + its output).

An idle replica that receives work starts its step at once, but forms the batch at the end of the
step's host overhead (the engine schedules after its loop wakes up): requests that arrive in that
window join the same step, as they do in an engine whose loop picks up every queued request.

Disaggregation: prefill replicas emit the first token and send the KV over the fabric (one transfer
at a time per prefill replica's link); decode replicas admit the transferred requests.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from firstlight.errors import FirstlightError
from firstlight.sim.cost import CostModel
from firstlight.sim.workload import Workload

ARRIVAL, STEP_DONE, KV_DONE, WAKE = 0, 1, 2, 3


class SimConfigError(FirstlightError):
    """Scheduler knobs or a deployment the simulator cannot run."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    block_size: int = 16
    enable_chunked_prefill: bool = True
    inflight_batching: bool = True  # False: new requests wait until the running batch drains (static batching)
    num_microbatches: int = 1  # with pp > 1: micro-batches each step is split into
    pipeline_schedule: str = "gpipe"  # gpipe (flush every step) | async (steps overlap, vLLM virtual engines)
    # admit a new request only if this fraction of all KV blocks stays free after it (vLLM's
    # BlockSpaceManager watermark, 0.01 by default): headroom for the running requests' next decode
    # blocks, so an admission does not force a preemption one step later (thrashing)
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.pipeline_schedule not in ("gpipe", "async"):
            raise SimConfigError(f"pipeline_schedule {self.pipeline_schedule!r}: expected gpipe or async")
        if not 0 <= self.watermark < 1:
            raise SimConfigError(f"scheduler watermark must be in [0, 1), got {self.watermark}")
        for k in ("max_num_batched_tokens", "max_num_seqs", "block_size", "num_microbatches"):
            if getattr(self, k) < 1:
                raise SimConfigError(f"scheduler {k} must be >= 1, got {getattr(self, k)}")


class Requests:
    """Per-request state as flat arrays (index = request id)."""

    def __init__(self, wl: Workload) -> None:
        n = len(wl)
        self.arrival = wl.arrival_s.tolist()
        self.prompt = wl.num_prompt_tokens.tolist()
        self.output = wl.num_output_tokens.tolist()
        self.cached = wl.num_cached_tokens.tolist() if wl.num_cached_tokens is not None else [0] * n
        self.first_token = [float("nan")] * n
        self.finish = [float("nan")] * n
        self.generated = [0] * n
        self.num_preemptions = [0] * n


class Replica:
    """One model replica with its own scheduler, KV blocks and cost model."""

    def __init__(self, idx: int, cost: CostModel, sched: SchedulerConfig, kv_capacity_tokens: int,
                 reqs: Requests, role: str = "both") -> None:
        self.idx = idx
        self.cost = cost
        self.cfg = sched
        self.role = role  # both | prefill | decode
        self.reqs = reqs
        B = sched.block_size
        self.num_blocks = kv_capacity_tokens // B
        if self.num_blocks < 1:
            raise SimConfigError(f"replica {idx}: KV capacity {kv_capacity_tokens} tokens < one block of {B}")
        self.watermark_blocks = int(sched.watermark * self.num_blocks)
        self.free_blocks = self.num_blocks
        self.waiting: deque[int] = deque()
        self.prefilling: dict[int, list[int]] = {}  # rid -> [done, target]
        self.running: dict[int, None] = {}  # admission order: the last key is the newest
        # decode set: rid -> (join_step, computed_at_join, generated_at_join, finish_step)
        self.decode: dict[int, tuple[int, int, int, int]] = {}
        self.residue = [0] * B  # decode seqs whose next token opens a block at steps == r (mod B)
        self.ctx_base = 0  # sum(computed_at_join - join_step + 1) over decode seqs
        self.finish_at: dict[int, list[int]] = {}
        self.step = 0
        self.busy = False
        self.busy_s = 0.0
        self.stage_busy_s = 0.0  # with pp > 1: seconds one pipeline stage computed (busy_s minus bubbles)
        self.pipelined = cost.par.pp > 1
        self.step_stage_busy: list[float] = []  # with pp > 1: one stage's compute seconds per step
        self.num_steps = 0
        self.cur_chunks: list[tuple[int, int]] = []  # (rid, chunk) of the step in flight
        self.link_free_s = 0.0  # for KV transfers out of a prefill replica
        # ITL samples: one (step duration, decode seqs) pair per step
        self.wake_s = 0.0  # when an idle replica was woken (its step starts then; the batch forms a bit later)
        self.step_durations: list[float] = []
        self.step_decodes: list[int] = []
        self.max_running = 0

    # ---- bookkeeping ----------------------------------------------------------------------------
    def outstanding(self) -> int:
        return len(self.waiting) + len(self.running)

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.cfg.block_size)

    def _join_decode(self, rid: int, computed: int, generated: int) -> None:
        k = self.step
        out = self.reqs.output[rid]
        finish = k + out - generated - 1
        self.decode[rid] = (k, computed, generated, finish)
        self.residue[(k - computed) % self.cfg.block_size] += 1
        self.ctx_base += computed - k + 1
        self.finish_at.setdefault(finish, []).append(rid)

    def _leave_decode(self, rid: int) -> int:
        """Remove from the decode set; returns tokens in its KV now (before the current step runs)."""
        jj, computed, gen0, _ = self.decode.pop(rid)
        self.residue[(jj - computed) % self.cfg.block_size] -= 1
        self.ctx_base -= computed - jj + 1
        return computed + (self.step - jj)

    def admit_transferred(self, rid: int) -> None:
        """A request whose KV arrived from a prefill replica joins the waiting-for-blocks queue."""
        self.waiting.append(~rid)  # ~rid marks "KV already here, decode only"

    def _preempt_newest(self) -> bool:
        if not self.running:
            return False
        rid = next(reversed(self.running))
        del self.running[rid]
        reqs = self.reqs
        if rid in self.decode:
            jj, computed, gen0, _ = self.decode[rid]
            tokens = self._leave_decode(rid)
            reqs.generated[rid] = gen0 + (self.step - jj)
        else:
            tokens = self.prefilling.pop(rid)[0]
        self.free_blocks += self._blocks(tokens)
        reqs.num_preemptions[rid] += 1
        self.waiting.appendleft(rid)
        return True

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self, now: float) -> tuple[float, int, float, int] | None:
        """Form the next step; returns its STEP_DONE event or None (idle)."""
        cfg = self.cfg
        B = cfg.block_size
        # 1. decodes: blocks for tokens that open a new block; preempt the newest until they fit
        while self.decode and self.residue[self.step % B] > self.free_blocks:
            if not self._preempt_newest():
                break
        need = self.residue[self.step % B] if self.decode else 0
        self.free_blocks -= need
        nd = len(self.decode)
        budget = cfg.max_num_batched_tokens - nd
        chunks: list[tuple[int, int]] = []
        cost_chunks: list[tuple[int, int]] = []
        # 2. running prefills, oldest first
        for rid, st in self.prefilling.items():
            if budget <= 0:
                break
            done, target = st
            n = min(target - done, budget)
            blocks = self._blocks(done + n) - self._blocks(done)
            if blocks > self.free_blocks:
                break
            self.free_blocks -= blocks
            budget -= n
            chunks.append((rid, n))
            cost_chunks.append((n, done))
        # 3. new (or preempted, or transferred) requests
        reqs = self.reqs
        admit = cfg.inflight_batching or not self.running
        while admit and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            rid = self.waiting[0]
            if rid < 0:  # transferred KV: straight into decode
                r = ~rid
                blocks = self._blocks(reqs.prompt[r])
                if blocks > self.free_blocks:
                    break
                self.waiting.popleft()
                self.free_blocks -= blocks
                self.running[r] = None
                # it joins next step: its first decode token is computed then
                self.step += 1
                self._join_decode(r, reqs.prompt[r], reqs.generated[r])
                self.step -= 1
                continue
            target = reqs.prompt[rid] + reqs.generated[rid]
            done = reqs.cached[rid] if reqs.generated[rid] == 0 else 0  # prefix-cache hits are not recomputed
            n = min(target - done, budget) if cfg.enable_chunked_prefill else target - done
            if n > budget and chunks:
                break
            blocks = self._blocks(done + n)
            if blocks > self.free_blocks - (self.watermark_blocks if self.running else 0):
                break
            self.waiting.popleft()
            self.free_blocks -= blocks
            budget -= n
            self.running[rid] = None
            self.prefilling[rid] = [done, target]
            chunks.append((rid, n))
            cost_chunks.append((n, done))
        if nd == 0 and not chunks:
            if self.prefilling and self._preempt_newest():  # prefills stuck on KV: free the newest, retry
                return self.schedule(now)
            self.busy = False
            return None
        num_tokens = nd + sum(n for _, n in chunks)
        num_seqs = nd + len(chunks)
        ctx = self.ctx_base + nd * self.step
        if self.pipelined:
            dt, stage = self.cost.pipelined_step_time(num_tokens, num_seqs, nd, ctx, cost_chunks,
                                                      cfg.num_microbatches, cfg.pipeline_schedule)
            self.stage_busy_s += stage
            self.step_stage_busy.append(stage)
        else:
            dt = self.cost.step_time(num_tokens, num_seqs, nd, ctx, cost_chunks)
        self.cur_chunks = chunks
        self.busy = True
        self.busy_s += dt
        self.num_steps += 1
        self.step_durations.append(dt)
        self.step_decodes.append(nd)
        if len(self.running) > self.max_running:
            self.max_running = len(self.running)
        return (now + dt, STEP_DONE, 0.0, self.idx)

    def complete(self, now: float) -> list[int]:
        """Apply the finished step; returns request ids whose prefill finished on a prefill replica."""
        reqs = self.reqs
        handoff: list[int] = []
        for rid, n in self.cur_chunks:
            st = self.prefilling[rid]
            st[0] += n
            if st[0] < st[1]:
                continue
            computed = st[1]
            del self.prefilling[rid]
            if reqs.generated[rid] == 0:
                reqs.first_token[rid] = now
            reqs.generated[rid] += 1
            if reqs.generated[rid] >= reqs.output[rid]:
                self._finish(rid, computed, now)
            elif self.role == "prefill":
                del self.running[rid]
                self.free_blocks += self._blocks(computed)
                handoff.append(rid)
            else:
                self.step += 1  # joins the decode set from the next step on
                self._join_decode(rid, computed, reqs.generated[rid])
                self.step -= 1
        for rid in self.finish_at.pop(self.step, ()):
            entry = self.decode.get(rid)
            if entry is None or entry[3] != self.step:
                continue  # stale: preempted since
            tokens = self._leave_decode(rid) + 1
            reqs.generated[rid] = reqs.output[rid]
            self._finish(rid, tokens, now)
        self.step += 1
        return handoff

    def _finish(self, rid: int, tokens: int, now: float) -> None:
        self.reqs.finish[rid] = now
        self.running.pop(rid, None)
        self.free_blocks += self._blocks(tokens)


# ---- routers --------------------------------------------------------------------------------------
RouterFn = Callable[[list[Replica], int], Replica]
ROUTERS: dict[str, RouterFn] = {}


def register_router(name: str) -> Callable[[RouterFn], RouterFn]:
    def deco(fn: RouterFn) -> RouterFn:
        ROUTERS[name] = fn
        return fn

    return deco


@register_router("round_robin")
def round_robin(replicas: list[Replica], rid: int) -> Replica:
    return replicas[rid % len(replicas)]


@register_router("least_outstanding")
def least_outstanding(replicas: list[Replica], rid: int) -> Replica:
    return min(replicas, key=Replica.outstanding)


# ---- the loop -------------------------------------------------------------------------------------
@dataclass
class SimResult:
    reqs: Requests
    replicas: list[Replica]
    makespan_s: float
    num_events: int


def simulate(workload: Workload, replicas: list[Replica], router: str = "round_robin",
             decode_replicas: list[Replica] | None = None, kv_transfer_s: Callable[[int], float] | None = None,
             admission_delay_s: float = 0.0) -> SimResult:
    """Run to completion. With `decode_replicas`, `replicas` are prefill replicas (disaggregation).

    `admission_delay_s` (the spec's per-request overhead: API server, tokenization) passes between a
    request's arrival and its entering a replica's queue; its latencies still count from arrival."""
    if router not in ROUTERS:
        raise SimConfigError(f"unknown router {router!r}: expected one of {sorted(ROUTERS)}")
    route = ROUTERS[router]
    reqs = replicas[0].reqs
    all_replicas = replicas + (decode_replicas or [])
    n = len(workload)
    arrivals = [a + admission_delay_s for a in reqs.arrival] if admission_delay_s else reqs.arrival
    heap: list[tuple[float, int, float, int]] = [(arrivals[0], ARRIVAL, 0.0, 0)]
    pop, push = heapq.heappop, heapq.heappush
    num_events = 0
    now = 0.0

    def wake(rep: Replica) -> list:
        """An idle replica got work: its step starts now, the batch forms after the host window."""
        rep.busy = True
        rep.wake_s = now
        return [(now + rep.cost.step_s, WAKE, 0.0, rep.idx)]

    def on_arrival(rid: int) -> list:
        out = []
        if rid + 1 < n:
            out.append((arrivals[rid + 1], ARRIVAL, 0.0, rid + 1))
        rep = route(replicas, rid)
        rep.waiting.append(rid)
        if not rep.busy:
            out += wake(rep)
        return out

    def on_wake(idx: int) -> list:
        rep = all_replicas[idx]
        ev = rep.schedule(rep.wake_s)
        return [ev] if ev else []

    def on_step_done(idx: int) -> list:
        rep = all_replicas[idx]
        out = []
        for rid in rep.complete(now):
            assert decode_replicas is not None and kv_transfer_s is not None
            start = max(now, rep.link_free_s)
            rep.link_free_s = start + kv_transfer_s(rid)
            dest = route(decode_replicas, rid)
            out.append((rep.link_free_s, KV_DONE, 0.0, (dest.idx << 32) | rid))
        ev = rep.schedule(now)
        if ev:
            out.append(ev)
        return out

    def on_kv_done(payload: int) -> list:
        rep = all_replicas[payload >> 32]
        rep.admit_transferred(payload & 0xFFFFFFFF)
        return wake(rep) if not rep.busy else []

    handlers = (on_arrival, on_step_done, on_kv_done, on_wake)
    seq = 0
    while heap:
        now, kind, _, payload = pop(heap)
        num_events += 1
        for ev in handlers[kind](payload):
            seq += 1
            push(heap, (ev[0], ev[1], seq, ev[3]))
    return SimResult(reqs, all_replicas, now, num_events)
