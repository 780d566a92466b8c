"""SpecConfig: which proposer, how many tokens, and the proposer's own options; checked on construction."""

from __future__ import annotations

from dataclasses import dataclass

from firstlight.errors import FirstlightError

METHODS = ("ngram", "draft", "heads")


@dataclass(frozen=True)
class SpecConfig:
    method: str
    num_spec_tokens: int = 4  # k proposals verified per step (with adaptive_k: the most per step)
    # per request, k moves between 1 and num_spec_tokens with the acceptance it gets: +2 after a
    # step whose proposals were all accepted, -1 after one with a rejection (HF assisted generation's
    # "heuristic" schedule). Long runs of correct guesses (copying from the prompt) get verified in
    # few passes; a request whose guesses fail pays for short verification passes only.
    adaptive_k: bool = False
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
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise FirstlightError(f"ngram: need 1 <= min_ngram <= max_ngram, got {self.min_ngram}, {self.max_ngram}")
        if self.draft_layers is not None and self.draft_layers < 1:
            raise FirstlightError(f"draft_layers must be >= 1, got {self.draft_layers}")
