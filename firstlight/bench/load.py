"""Load patterns and the run loop: who sends what, when.

Modes: `concurrency` (closed loop: C sessions in flight, the next starts when one ends), `rate`
(open loop: arrivals from a registered process, optionally capped by --max-concurrency) and
`trace` (open loop: arrival times and lengths replayed from a JSONL file). Arrival processes are
small functions in the `ARRIVALS` registry (one screen each, so they share a file).

Arrival times are absolute offsets from the run start, so a late wake-up never shifts the rest of
the schedule; the record keeps both the scheduled and the actual send time.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from firstlight.bench.client import RequestRecord, build_body, endpoint_path
from firstlight.bench.workload import MessagesTurn, Session, Workload, count_tokens
from firstlight.errors import FirstlightError

# -- arrival processes (offsets in seconds, unit: 1/rate) -------------------------------------------
ArrivalFn = Callable[[float, random.Random, float], Iterator[float]]


def _poisson(rate: float, rng: random.Random, _burst: float) -> Iterator[float]:
    t = 0.0
    while True:
        yield t
        t += rng.expovariate(rate)


def _gamma(rate: float, rng: random.Random, burstiness: float) -> Iterator[float]:
    """Gamma inter-arrivals with shape k = burstiness, mean 1/rate (k < 1 burstier, k = 1 Poisson)."""
    t = 0.0
    while True:
        yield t
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))


def _constant(rate: float, _rng: random.Random, _burst: float) -> Iterator[float]:
    i = 0
    while True:
        yield i / rate
        i += 1


ARRIVALS: dict[str, ArrivalFn] = {"poisson": _poisson, "gamma": _gamma, "constant": _constant}


def ramp_warp(offsets: Iterator[float], ramp_s: float) -> Iterator[float]:
    """Map arrivals of a steady process onto a linear ramp from 0 to full rate over `ramp_s`.

    With cumulative intensity L(t) = t^2 / (2 ramp) for t < ramp, else t - ramp / 2 (in units of the
    steady process), an arrival at steady time u happens at L^-1(u).
    """
    for u in offsets:
        if ramp_s <= 0:
            yield u
        elif u < ramp_s / 2:
            yield math.sqrt(2 * ramp_s * u)
        else:
            yield u + ramp_s / 2


def read_trace(path: str) -> list[dict[str, Any]]:
    """JSONL rows with `timestamp` (s) or `timestamp_ms`, optional `input_len`, `output_len`."""
    p = Path(path)
    if not p.is_file():
        raise FirstlightError(f"trace file {path!r} does not exist.")
    rows = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            t = float(r["timestamp"]) if "timestamp" in r else float(r["timestamp_ms"]) / 1e3
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            raise FirstlightError(f"{path}:{n}: expected a JSON object with 'timestamp' (s) or 'timestamp_ms'.") from None
        rows.append({"t": t, "input_len": r.get("input_len"), "output_len": r.get("output_len")})
    if not rows:
        raise FirstlightError(f"trace file {path!r} has no rows.")
    t0 = min(r["t"] for r in rows)
    for r in rows:
        r["t"] -= t0
    return sorted(rows, key=lambda r: r["t"])


@dataclass
class LoadSpec:
    mode: str = "concurrency"  # concurrency | rate | trace
    concurrency: int = 1
    rate: float = 1.0  # requests/s (sessions/s for multi-turn)
    arrival: str = "poisson"
    burstiness: float = 1.0
    trace: str | None = None
    trace_time_scale: float = 1.0  # >1 replays slower
    max_concurrency: int | None = None
    ramp_up_s: float = 0.0
    num_requests: int = 100  # measured requests (warm-up comes on top)
    warmup_requests: int = 0
    warmup_s: float = 0.0
    duration_s: float | None = None  # stop issuing after this long (warm-up included)
    drain_timeout_s: float = 60.0  # after the last issue, wait this long for in-flight requests
    seed: int = 0

    def validate(self) -> None:
        if self.mode not in ("concurrency", "rate", "trace"):
            raise FirstlightError(f"load mode {self.mode!r}: expected concurrency, rate or trace.")
        if self.mode == "concurrency" and self.concurrency < 1:
            raise FirstlightError(f"--concurrency {self.concurrency}: expected >= 1.")
        if self.mode == "rate":
            if not self.rate > 0:
                raise FirstlightError(f"--rate {self.rate}: expected > 0 requests/s.")
            if self.arrival not in ARRIVALS:
                raise FirstlightError(f"--arrival {self.arrival!r}: expected one of {sorted(ARRIVALS)}.")
            if self.arrival == "gamma" and not self.burstiness > 0:
                raise FirstlightError(f"--burstiness {self.burstiness}: expected > 0.")
        if self.mode == "trace" and not self.trace:
            raise FirstlightError("load mode trace needs --trace FILE.")
        if self.num_requests < 1 and not self.duration_s:
            raise FirstlightError("bound the run: give --num-requests >= 1 or --duration.")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _refuses_ignore_eos(rec: RequestRecord) -> bool:
    return rec.error == "http_422" or (rec.error == "http_400" and "ignore_eos" in rec.error_detail)


_KEEP = ("index", "session", "turn", "warmup", "t_scheduled", "input_tokens")


def _reset(rec: RequestRecord) -> None:
    """Clear what a failed attempt recorded, keeping who the request is and when it was due."""
    fresh = RequestRecord(index=rec.index)
    for f in fields(RequestRecord):
        if f.name not in _KEEP:
            setattr(rec, f.name, getattr(fresh, f.name))


@dataclass
class RunOutput:
    records: list[RequestRecord]
    t_start: float
    t_stop: float
    incomplete: int  # requests cut by the drain timeout or an interrupt (not measured)
    arrival_clock: str = ""  # what a chunk's arrival time is (the client's `arrival_clock`)
    interrupted_by: str | None = None  # SIGINT / SIGTERM: the run stopped early, its result is partial
    ignore_eos_refused: bool = False  # the server refused `ignore_eos`; requests went without it
    notes: list[str] = field(default_factory=list)


class Runner:
    """Drives one load run against one client."""

    def __init__(self, client: Any, workload: Workload, load: LoadSpec, *, endpoint: str, model: str,
                 ignore_eos: bool = True, continuous_usage: bool = True, extra_body: dict | None = None,
                 progress: Callable[[int], None] | None = None) -> None:
        load.validate()
        self.client, self.workload, self.load = client, workload, load
        self.endpoint, self.model, self.path = endpoint, model, endpoint_path(endpoint)
        self.body_kw = {"ignore_eos": ignore_eos, "continuous_usage": continuous_usage, "extra": extra_body}
        self.total = load.warmup_requests + load.num_requests if load.num_requests > 0 else 10**12
        self.limit = self.total  # requests this phase may issue (a closed loop's warm-up phase: the warm-up ones)
        self.issued = 0
        self.next_session = 0
        self.records: list[RequestRecord] = []
        self.progress = progress
        self.trace_rows = read_trace(load.trace) if load.mode == "trace" else []
        self.pregenerated: list[Session] = []
        self.interrupted_by: str | None = None
        self.ignore_eos_refused = False
        self._tasks: list[asyncio.Future] = []

    def interrupt(self, reason: str) -> None:
        """Stop now (a signal): in-flight requests are cut and recorded as incomplete; finished ones stay."""
        if self.interrupted_by is None:
            self.interrupted_by = reason
        for t in self._tasks:
            t.cancel()

    def _claim(self, t_sched: float) -> RequestRecord | None:
        if self.issued >= self.limit or (self.deadline is not None and time.perf_counter() >= self.deadline):
            return None
        i = self.issued
        self.issued += 1
        warm = i < self.load.warmup_requests or (t_sched - self.t_start) < self.load.warmup_s
        rec = RequestRecord(index=i, warmup=warm, t_scheduled=t_sched)
        self.records.append(rec)
        return rec

    def _session(self, i: int | None = None) -> Session:
        if i is None:
            i = self.next_session
            self.next_session += 1
        if i < len(self.pregenerated):
            return self.pregenerated[i]
        return self._make_session(i)

    def _make_session(self, i: int) -> Session:
        if self.trace_rows:
            row = self.trace_rows[i % len(self.trace_rows)]
            if row["input_len"] or row["output_len"]:
                return self.workload.session_with_lengths(
                    i, int(row["input_len"] or 128), int(row["output_len"] or 128))
        return self.workload.session(i)

    async def _run_session(self, sess: Session, t_sched: float) -> None:
        history: list[dict[str, Any]] = []
        for k, turn in enumerate(sess.turns):
            rec = self._claim(t_sched if k == 0 else time.perf_counter())
            if rec is None:
                return
            rec.session, rec.turn = sess.index, k
            rec.input_tokens = turn.input_tokens
            if self.endpoint == "chat":
                if isinstance(turn, MessagesTurn):
                    history = list(turn.messages)
                else:
                    history = history + [{"role": "user", "content": turn.text}]
                prompt: Any = history
                if self.workload.tok is not None and (k > 0 or isinstance(turn, MessagesTurn)):
                    # the whole history is the input (message contents; the chat template is not counted)
                    rec.input_tokens = sum(count_tokens(self.workload.tok, str(m.get("content", ""))) for m in history)
            else:
                prompt = turn.text
            body = build_body(self.endpoint, self.model, prompt, turn.max_tokens, **self.body_kw)
            await self.client.stream(rec, self.path, body)
            if body.get("ignore_eos") and _refuses_ignore_eos(rec):
                # a server without vLLM's extensions: once, without the field (and never again in this run)
                self.ignore_eos_refused = True
                self.body_kw["ignore_eos"] = False
                body.pop("ignore_eos")
                _reset(rec)
                await self.client.stream(rec, self.path, body)
            if self.progress:
                self.progress(1)
            if not rec.ok:
                return
            if self.endpoint == "chat":
                history = history + [{"role": "assistant", "content": rec.text}]

    async def run(self) -> RunOutput:
        # Prompts are made before the clock starts, so building them never delays a timestamp.
        n_pre = self.total if self.total <= 50_000 else 2_000  # duration-bound runs make the rest lazily
        self.pregenerated = [self._make_session(i) for i in range(n_pre)]
        self.t_start = time.perf_counter()
        self.deadline = self.t_start + self.load.duration_s if self.load.duration_s else None
        if self.load.mode == "concurrency":
            tasks = [asyncio.ensure_future(self._closed_loop())]
        else:
            tasks = [asyncio.ensure_future(self._open_loop())]
        self._tasks = tasks
        incomplete = 0
        try:
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            if self.interrupted_by is None:
                raise
        finally:
            for t in tasks:
                t.cancel()
        t_stop = time.perf_counter()
        for r in self.records:
            if r.t_end == 0.0:
                r.error, r.t_end = "incomplete", t_stop
                incomplete += 1
        notes = []
        if self.ignore_eos_refused:
            notes.append("the server refused `ignore_eos` (HTTP 422, or a 400 naming it): each refused request was "
                         "retried once without it and the rest sent without it, so outputs may stop early at EOS")
        return RunOutput(self.records, self.t_start, t_stop, incomplete, interrupted_by=self.interrupted_by,
                         ignore_eos_refused=self.ignore_eos_refused, notes=notes)

    async def _closed_loop(self) -> None:
        """Warm-up requests first, as a phase of their own at the same concurrency; the measured requests start
        once the last warm-up one has ended. (Mixed in, warm-up requests hold slots of the loop: at c = 32 with one
        warm-up request, the 32nd measured request waited for a whole batch to finish and then ran alone.)"""
        warm = min(self.load.warmup_requests, self.total)
        if warm:
            self.limit = warm
            await asyncio.gather(*(self._worker(w) for w in range(min(warm, self.load.concurrency))))
        self.limit = self.total
        await asyncio.gather(*(self._worker(w) for w in range(self.load.concurrency)))

    async def _worker(self, w: int) -> None:
        if self.load.ramp_up_s > 0:
            await asyncio.sleep(w * self.load.ramp_up_s / self.load.concurrency)
        while self.issued < self.limit and (self.deadline is None or time.perf_counter() < self.deadline):
            await self._run_session(self._session(), time.perf_counter())

    def _offsets(self) -> Iterator[float]:
        if self.trace_rows:
            scale = self.load.trace_time_scale
            n = len(self.trace_rows)
            span = self.trace_rows[-1]["t"] + (self.trace_rows[-1]["t"] / max(n - 1, 1))
            rep = 0
            while True:  # repeat the trace if more requests are asked for than it holds
                for r in self.trace_rows:
                    yield (r["t"] + rep * span) * scale
                rep += 1
        rng = random.Random(f"arrivals-{self.load.seed}")
        yield from ramp_warp(ARRIVALS[self.load.arrival](self.load.rate, rng, self.load.burstiness),
                             self.load.ramp_up_s)

    async def _open_loop(self) -> None:
        sem = asyncio.Semaphore(self.load.max_concurrency) if self.load.max_concurrency else None
        pending: set[asyncio.Task] = set()
        try:
            for sessions, off in enumerate(self._offsets()):
                t = self.t_start + off
                if self.deadline is not None and t >= self.deadline:
                    break
                if self.issued >= self.total:
                    break
                delay = t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if sem is not None:
                    await sem.acquire()
                sess = self._session(sessions)
                task = asyncio.ensure_future(self._guarded(sess, t, sem))
                pending.add(task)
                task.add_done_callback(pending.discard)
                await asyncio.sleep(0)  # let the task claim its request before the bound is checked
            if pending:
                await asyncio.wait(pending, timeout=self.load.drain_timeout_s)
        finally:  # drain timeout or interrupt: what is still in flight is cut (recorded as incomplete)
            for task in list(pending):
                task.cancel()

    async def _guarded(self, sess: Session, t: float, sem: asyncio.Semaphore | None) -> None:
        try:
            await self._run_session(sess, t)
        finally:
            if sem is not None:
                sem.release()
