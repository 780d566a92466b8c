"""A Trace: the Batches an engine ran, with measured times, as JSONL or Chrome/Perfetto JSON.

The JSONL form is one header line (`{"trace_meta": {...}}`) followed by one `StepRecord` per
line, so a trace is written as the engine runs and survives a crash up to the last step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
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
        )


@dataclass
class Trace:
    """A sequence of steps plus what produced them (model, dtype, machine, engine config)."""

    meta: dict[str, Any] = field(default_factory=dict)
    steps: list[StepRecord] = field(default_factory=list)

    def save(self, path: str | Path) -> None:
        with open(path, "w") as f:
            write_header(f, self.meta)
            for step in self.steps:
                append_step(f, step)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"trace file {path} does not exist")
        trace = cls()
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                line = line.strip()
                if not line:
                    continue
                try:
                    obj = json.loads(line)
                    if "trace_meta" in obj:
                        trace.meta = obj["trace_meta"]
                    else:
                        trace.steps.append(StepRecord.from_dict(obj))
                except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
                    raise ValueError(f"{path}:{lineno}: not a trace step ({e})") from e
        return trace

    def to_chrome(self) -> dict[str, Any]:
        """Chrome trace-event JSON (open in Perfetto or chrome://tracing); times in microseconds."""
        events: list[dict[str, Any]] = []
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
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": self.meta}


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
