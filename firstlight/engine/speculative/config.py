"""SpecConfig: which proposer, how many tokens, and the proposer's own options; checked on construction."""

from __future__ import annotations

from dataclasses import dataclass

from firstlight.errors import FirstlightError

METHODS = ("ngram", "draft", "heads", "mtp")


@dataclass(frozen=True)
class SpecConfig:
    method: str
    num_spec_tokens: int = 4  # k proposals verified per step (with adaptive_k: the most per step)
    # per request and step, k in [0, num_spec_tokens] with the most expected tokens per unit of pass
    # cost, from the request's own acceptance and the measured cost of (1 + k)-token passes
    # (spec/adaptive.py); pass_costs = c(1 + k) / c(1) for k = 0 .. num_spec_tokens skips the measurement
    adaptive_k: bool = False
    pass_costs: tuple[float, ...] | None = None
    # ngram
    min_ngram: int = 1
    max_ngram: int = 4
    # draft: a checkpoint dir with the target's tokenizer, or (draft_model=None) the target's first
    # `draft_layers` layers + its final norm and head (self-speculative)
    draft_model: str | None = None
    draft_layers: int | None = None
    # heads: a safetensors file from `firstlight train heads` (default: next to the target model)
    heads_path: str | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise FirstlightError(f"speculative method '{self.method}' is unknown; choose one of: {', '.join(METHODS)}")
        if not 1 <= self.num_spec_tokens <= 16:
            raise FirstlightError(f"num_spec_tokens must be in [1, 16], got {self.num_spec_tokens}")
        if self.pass_costs is not None and (len(self.pass_costs) < self.num_spec_tokens + 1
                                            or min(self.pass_costs) <= 0):
            raise FirstlightError(f"pass_costs must give c(1 + k) > 0 for k = 0 .. {self.num_spec_tokens}, "
                                  f"got {self.pass_costs}")
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise FirstlightError(f"ngram: need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise FirstlightError(f"draft_layers must be >= 1, got {self.draft_layers}")
