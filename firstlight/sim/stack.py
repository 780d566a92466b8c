"""Serving stacks as scheduler presets: what a vendor's runtime does to a step's shape and cost.

Stacks differ in ways that move results: how many sequences a batch may hold, whether prefill is
chunked into decode steps, whether new requests join a running batch (in-flight / continuous
batching) or wait for it to drain, and which shapes run from a captured graph. A decode step whose
batch has a captured CUDA graph (vLLM, TensorRT-LLM) or a tt-metal trace is padded up to the next
captured size and pays no eager launch cost; XLA (JetStream) and Neuron compile fixed shapes, so every
decode runs the full slot batch and prefills are padded to the next length bucket.

One YAML file per stack in `sim/stacks/`, each with its `source`. `StackCost` wraps a `CostModel`
with the padding; `apply_stack` fills a `ServeConfig`'s scheduler knobs.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from firstlight.errors import FirstlightError


class StackError(FirstlightError):
    """An unknown serving stack or a stack file with bad keys."""


class ServingStack(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    source: str
    description: str = ""
    max_num_seqs: int = Field(ge=1)
    max_num_batched_tokens: int = Field(ge=1)
    enable_chunked_prefill: bool
    inflight_batching: bool = True
    block_size: int = Field(default=16, ge=1)
    graph_capture_sizes: list[int] = []  # decode batch sizes replayed from a graph/trace; padded up to the next
    prefill_buckets: list[int] = []  # compiled prefill lengths; a prefill chunk is padded up to the next
    eager_step_overhead_us: float = Field(default=0.0, ge=0)  # extra host launch time of a non-graph step
    step_overhead_us: float | None = Field(default=None, ge=0)  # per-step host time; None = the hardware spec's

    @field_validator("graph_capture_sizes", "prefill_buckets")
    @classmethod
    def _sorted(cls, v: list[int]) -> list[int]:
        if any(x < 1 for x in v):
            raise ValueError("sizes must be >= 1")
        return sorted(set(v))

    def padded_decode(self, n: int) -> int | None:
        """The captured batch size a decode step of `n` sequences replays, or None (runs eagerly)."""
        i = bisect.bisect_left(self.graph_capture_sizes, n)
        return self.graph_capture_sizes[i] if i < len(self.graph_capture_sizes) else None

    def serve_fields(self) -> dict[str, Any]:
        """The ServeConfig fields this stack sets: its scheduler knobs and its name."""
        return {"max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
                "block_size": self.block_size, "stack": self.name}

    def padded_prefill(self, n: int) -> int:
        i = bisect.bisect_left(self.prefill_buckets, n)
        return self.prefill_buckets[i] if i < len(self.prefill_buckets) else n


def builtin_stack_dir() -> Path:
    return Path(__file__).resolve().parent / "stacks"


def builtin_stacks() -> list[str]:
    return sorted(p.stem for p in builtin_stack_dir().glob("*.yaml"))


def load_stack(name_or_path: str | Path) -> ServingStack:
    s = str(name_or_path)
    path = Path(s) if s.endswith((".yaml", ".yml")) else builtin_stack_dir() / f"{s}.yaml"
    if not path.is_file():
        raise StackError(f"unknown serving stack {s!r}: expected one of {builtin_stacks()} or a YAML file")
    try:
        return ServingStack.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as e:
        errs = "; ".join(f"{'.'.join(str(x) for x in er['loc'])}: {er['msg']}" for er in e.errors())
        raise StackError(f"serving stack {path}: {errs}") from None
    except yaml.YAMLError as e:
        raise StackError(f"serving stack {path} is not valid YAML: {e}") from None


def apply_stack(cfg: Any, stack: ServingStack) -> Any:
    """A copy of a ServeConfig with the stack's scheduler knobs."""
    return cfg.model_copy(update=stack.serve_fields())


class StackCost:
    """A CostModel seen through a stack: padded graph/trace shapes, bucketed prefills, eager launches."""

    def __init__(self, cost: Any, stack: ServingStack) -> None:
        self.cost = cost
        self.stack = stack
        self.eager_s = stack.eager_step_overhead_us * 1e-6

    def __getattr__(self, name: str) -> Any:  # par, step_s, model, hw ... come from the wrapped model
        return getattr(self.cost, name)

    def _shape(self, num_tokens: int, num_seqs: int, num_decode: int,
               prefill_chunks: list[tuple[int, int]] | tuple) -> tuple[int, int, list[tuple[int, int]], float]:
        st = self.stack
        if not prefill_chunks and num_decode == num_tokens and st.graph_capture_sizes:
            pad = st.padded_decode(num_decode)
            if pad is not None:
                return pad, pad, [], 0.0
        chunks = [(st.padded_prefill(n), c) for n, c in prefill_chunks] if st.prefill_buckets else list(prefill_chunks)
        extra = sum(n for n, _ in chunks) - sum(n for n, _ in prefill_chunks)
        return num_tokens + extra, num_seqs, chunks, self.eager_s

    def step_time(self, num_tokens: int, num_seqs: int, num_decode: int = 0, decode_ctx_sum: float = 0.0,
                  prefill_chunks: list[tuple[int, int]] | tuple = (), decode_window_ctx_sum: float | None = None,
                  ) -> float:
        if num_tokens <= 0:
            return 0.0
        t, s, chunks, extra = self._shape(num_tokens, num_seqs, num_decode, prefill_chunks)
        return self.cost.step_time(t, s, num_decode, decode_ctx_sum, chunks, decode_window_ctx_sum) + extra

    def pipelined_step_time(self, num_tokens: int, num_seqs: int, num_decode: int = 0, decode_ctx_sum: float = 0.0,
                            prefill_chunks: list[tuple[int, int]] | tuple = (), num_microbatches: int = 1,
                            schedule: str = "gpipe") -> tuple[float, float]:
        t, s, chunks, extra = self._shape(num_tokens, num_seqs, num_decode, prefill_chunks)
        span, busy = self.cost.pipelined_step_time(t, s, num_decode, decode_ctx_sum, chunks, num_microbatches,
                                                   schedule)
        return span + extra, busy
