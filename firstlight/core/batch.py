"""The Batch: what the scheduler hands the runner each step, and what the simulator prices.

One `ScheduledSeq` per request in the step says how many tokens run and which KV blocks they use.
Token ids are not part of the Batch: the runner reads them from its request state, and a trace
of Batches replays in the simulator without them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step."""

    request_id: str
    num_tokens: int  # tokens computed this step (a prefill chunk, 1 for decode, 1+k when speculating)
    num_computed_tokens: int  # tokens already in the KV cache before this step (= first position)
    num_prompt_tokens: int
    block_ids: tuple[int, ...] = ()  # -1: a block released because it fell out of the sliding window
    num_spec_tokens: int = 0  # of num_tokens, how many are speculative proposals being verified
    # models with full and sliding-window layers: the sliding layers' own table (engine/kv_groups.py)
    sliding_block_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise ValueError(f"ScheduledSeq {self.request_id}: num_tokens must be >= 1, got {self.num_tokens}")
        if self.num_computed_tokens < 0 or self.num_prompt_tokens < 0:
            raise ValueError(f"ScheduledSeq {self.request_id}: negative token counts")

    @property
    def is_prefill(self) -> bool:
        """True while this step still processes prompt tokens."""
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def context_len(self) -> int:
        """Tokens in the KV cache after this step (the attention span of its last query)."""
        return self.num_computed_tokens + self.num_tokens

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ScheduledSeq:
        d = dict(d)
        d["block_ids"] = tuple(d.get("block_ids", ()))
        d["sliding_block_ids"] = tuple(d.get("sliding_block_ids", ()))
        return cls(**d)


@dataclass(frozen=True)
class Batch:
    """The work of one engine step."""

    seqs: tuple[ScheduledSeq, ...]
    step: int = 0
    preempted_ids: tuple[str, ...] = ()  # requests preempted while forming this step
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_tokens - self.num_prefill_tokens

    @property
    def num_prefill_seqs(self) -> int:
        return sum(1 for s in self.seqs if s.is_prefill)

    @property
    def num_decode_seqs(self) -> int:
        return self.num_seqs - self.num_prefill_seqs

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "seqs": [asdict(s) for s in self.seqs],
            "preempted_ids": list(self.preempted_ids),
            "meta": dict(self.meta),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Batch:
        return cls(
            seqs=tuple(ScheduledSeq.from_dict(s) for s in d["seqs"]),
            step=int(d.get("step", 0)),
            preempted_ids=tuple(d.get("preempted_ids", ())),
            meta=dict(d.get("meta", {})),
        )
