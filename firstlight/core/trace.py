"""A Trace: the Batches an engine ran, with measured times, as JSONL or Chrome/Perfetto JSON.

The JSONL form is one header line (`{"trace_meta": {...}}`) followed by one `StepRecord` per
line, so a trace is written as the engine runs and survives a crash up to the last step. The engine
also writes one `{"request": {...}}` line per finished request (`RequestRecord`: arrival, first
token, finish, token counts), so a trace is a workload too: the simulator replays its arrivals and
lengths and compares per-request latency. Traces without request lines (older ones) still load;
`infer_requests` rebuilds what the steps show. A `.gz` path is read and written gzip-compressed.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from firstlight.core.batch import Batch, ScheduledSeq


@dataclass
class StepRecord:
    """One engine step: the Batch and how long each phase of it took."""

    batch: Batch
    start_s: float  # wall clock (time.perf_counter based, relative to trace start)
    schedule_s: float
    execute_s: float
    sample_s: float
    op_times_s: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)  # e.g. kv usage, accepted spec tokens
    # CPU seconds the engine thread spent in each phase (time.thread_time; keys schedule, execute,
    # sample): on a shared machine, the part of the wall time that was not waiting for a core. Exact
    # with one torch thread (the work runs on the engine thread). Empty in older traces.
    cpu_s: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.execute_s + self.sample_s

    @property
    def num_recompute_tokens(self) -> dict[str, int]:
        """Per request, the tokens this step recomputes after a preemption (see `seq_phase`)."""
        return dict(self.batch.meta.get("num_recompute_tokens", {}))

    def to_dict(self) -> dict[str, Any]:
        return {
            "batch": self.batch.to_dict(),
            "start_s": self.start_s,
            "schedule_s": self.schedule_s,
            "execute_s": self.execute_s,
            "sample_s": self.sample_s,
            "op_times_s": self.op_times_s,
            "stats": self.stats,
            **({"cpu_s": self.cpu_s} if self.cpu_s else {}),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StepRecord:
        return cls(
            batch=Batch.from_dict(d["batch"]),
            start_s=float(d["start_s"]),
            schedule_s=float(d["schedule_s"]),
            execute_s=float(d["execute_s"]),
            sample_s=float(d["sample_s"]),
            op_times_s=dict(d.get("op_times_s", {})),
            stats=dict(d.get("stats", {})),
            cpu_s={k: float(v) for k, v in d.get("cpu_s", {}).items()},
        )


@dataclass
class RequestRecord:
    """One request as the engine saw it; times in seconds on the trace's clock (`StepRecord.start_s`)."""

    request_id: str
    arrival_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    first_token_s: float | None = None  # None: finished (aborted) before its first token
    finish_s: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    finish_reason: str | None = None
    inferred: bool = False  # rebuilt from the steps (no request line in the trace): arrival = first scheduled

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RequestRecord:
        return cls(**d)


class TraceFormatError(ValueError):
    """A file that is not a firstlight engine trace (JSONL with a `trace_meta` header)."""


def _open_text(path: Path, mode: str) -> TextIO:
    if path.suffix == ".gz":
        return gzip.open(path, mode + "t")  # type: ignore[return-value]
    return open(path, mode)  # noqa: SIM115 - the caller closes it


@dataclass
class Trace:
    """A sequence of steps plus what produced them (model, dtype, machine, engine config)."""

    meta: dict[str, Any] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)
    requests: list[RequestRecord] = field(default_factory=list)

    def save(self, path: str | Path) -> None:
        with _open_text(Path(path), "w") as f:
            write_header(f, self.meta)
            for step in self.steps:
                append_step(f, step)
            for req in self.requests:
                append_request(f, req)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a JSONL trace (`.gz` too). Raises FileNotFoundError, or TraceFormatError (a ValueError)
        naming the line when the file is something else (a Chrome trace, a workload CSV, ...)."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"trace file {path} does not exist")
        trace = cls()
        seen_header = False
        try:
            with _open_text(path, "r") as f:
                for lineno, line in enumerate(f, 1):
                    line = line.strip()
                    if not line:
                        continue
                    try:
                        obj = json.loads(line)
                        if not isinstance(obj, dict):
                            raise TypeError(f"a JSON {type(obj).__name__}, not an object")
                        if "trace_meta" in obj:
                            trace.meta = obj["trace_meta"]
                            seen_header = True
                        elif not seen_header:
                            raise TraceFormatError(
                                f"{path}:{lineno}: not a firstlight engine trace: the first line must be the "
                                '{"trace_meta": ...} header the engine writes with --trace'
                            )
                        elif "request" in obj:
                            trace.requests.append(RequestRecord.from_dict(obj["request"]))
                        else:
                            trace.steps.append(StepRecord.from_dict(obj))
                    except TraceFormatError:
                        raise
                    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                        if not seen_header:
                            raise TraceFormatError(
                                f"{path}:{lineno}: not a firstlight engine trace (JSONL whose first line is the "
                                f'{{"trace_meta": ...}} header): {e}') from e
                        raise TraceFormatError(f"{path}:{lineno}: not a trace step ({e})") from e
        except (UnicodeDecodeError, OSError, EOFError) as e:
            raise TraceFormatError(f"{path}: not a text JSONL trace ({e})") from e
        if not seen_header:
            raise TraceFormatError(f"{path}: empty, or no trace_meta header: not a firstlight engine trace")
        return trace

    def to_chrome(self) -> dict[str, Any]:
        """Chrome trace-event JSON (open in Perfetto or chrome://tracing); times in microseconds.

        Process 0 is the engine (one slice per step phase); process 1 has one track per request:
        a `queued` slice from arrival to its first step, then a slice per step it ran in, named by
        what it did there (prefill, decode, recompute)."""
        events: list[dict[str, Any]] = [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "engine steps"}},
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "requests"}},
        ]
        for rec in self.steps:
            b = rec.batch
            args = {
                "step": b.step,
                "num_seqs": b.num_seqs,
                "num_prefill_tokens": b.num_prefill_tokens,
                "num_decode_tokens": b.num_decode_tokens,
                "num_recompute_tokens": sum(rec.num_recompute_tokens.values()),
                "request_ids": [s.request_id for s in b.seqs],
                "phases": [seq_phase(b, s) for s in b.seqs],
            }
            t = rec.start_s
            for name, dur in (("schedule", rec.schedule_s), ("execute", rec.execute_s), ("sample", rec.sample_s)):
                events.append(
                    {"name": name, "ph": "X", "ts": t * 1e6, "dur": dur * 1e6, "pid": 0, "tid": 0, "args": args}
                )
                t += dur
        events += self._request_tracks()
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": self.meta}

    def _request_tracks(self) -> list[dict[str, Any]]:
        requests = self.requests or infer_requests(self)
        tid = {r.request_id: i + 1 for i, r in enumerate(requests)}
        events: list[dict[str, Any]] = []
        first_step: dict[str, float] = {}
        for rec in self.steps:
            b = rec.batch
            for s in b.seqs:
                if s.request_id not in tid:
                    continue
                first_step.setdefault(s.request_id, rec.start_s)
                events.append({"name": seq_phase(b, s), "ph": "X", "ts": rec.start_s * 1e6, "dur": rec.total_s * 1e6,
                               "pid": 1, "tid": tid[s.request_id],
                               "args": {"step": b.step, "num_tokens": s.num_tokens,
                                        "num_computed_tokens": s.num_computed_tokens}})
        for r in requests:
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid[r.request_id],
                           "args": {"name": r.request_id}})
            start = first_step.get(r.request_id)
            if start is not None and start > r.arrival_s:
                events.append({"name": "queued", "ph": "X", "ts": r.arrival_s * 1e6, "dur": (start - r.arrival_s) * 1e6,
                               "pid": 1, "tid": tid[r.request_id], "args": {}})
            if r.first_token_s is not None:
                events.append({"name": "first token", "ph": "i", "s": "t", "ts": r.first_token_s * 1e6, "pid": 1,
                               "tid": tid[r.request_id], "args": {"ttft_ms": (r.first_token_s - r.arrival_s) * 1e3}})
        return events


def infer_requests(trace: Trace) -> list[RequestRecord]:
    """Requests rebuilt from the steps alone (traces written before request lines existed).

    Arrival is the start of the first step that schedules the request (queueing before it is not
    visible), the first token the end of the step whose chunk reaches the prompt's end, the finish
    the end of its last step, and outputs = the longest context it reached - prompt + 1 (the last
    step samples one token past its context)."""
    out: dict[str, RequestRecord] = {}
    for rec in trace.steps:
        end = rec.start_s + rec.total_s
        for s in rec.batch.seqs:
            r = out.get(s.request_id)
            if r is None:
                r = out[s.request_id] = RequestRecord(s.request_id, rec.start_s, s.num_prompt_tokens, 1,
                                                      inferred=True)
            if r.first_token_s is None and s.context_len >= s.num_prompt_tokens:
                r.first_token_s = end
            r.num_output_tokens = max(r.num_output_tokens, s.context_len - s.num_prompt_tokens + 1)
            r.finish_s = end
        for rid in rec.batch.preempted_ids:
            if rid in out:
                out[rid].num_preemptions += 1
    return sorted(out.values(), key=lambda r: r.arrival_s)


def seq_phase(batch: Batch, seq: ScheduledSeq) -> str:
    """What a sequence does in a step: "recompute" (rebuilding KV that a preemption dropped; the
    scheduler counts those tokens in `batch.meta["num_recompute_tokens"]`), else "prefill" (prompt
    tokens) or "decode". `Batch.num_prefill_tokens` / `num_decode_tokens` split by position only, so
    a recomputed chunk of output tokens counts there as decode tokens; this label tells them apart."""
    if batch.meta.get("num_recompute_tokens", {}).get(seq.request_id, 0) > 0:
        return "recompute"
    return "prefill" if seq.is_prefill else "decode"


def write_header(f: TextIO, meta: dict[str, Any]) -> None:
    f.write(json.dumps({"trace_meta": meta}) + "\n")


def append_step(f: TextIO, step: StepRecord) -> None:
    f.write(json.dumps(step.to_dict()) + "\n")
    f.flush()


def append_request(f: TextIO, request: RequestRecord) -> None:
    f.write(json.dumps({"request": request.to_dict()}) + "\n")
    f.flush()
