"""Prompt lookup decoding (Saxena 2023; vLLM's `ngram`): find the most recent earlier occurrence of
the context's last n tokens and propose the tokens that followed it. Tries n from `max_ngram` down to
`min_ngram`. No model, no state; q is one-hot on the proposals.
"""

from __future__ import annotations

from typing import Any

from firstlight.engine.speculative.base import Proposal, Proposer, SpecRequest
from firstlight.engine.speculative.config import SpecConfig
from firstlight.engine.speculative.registry import register


def ngram_lookup(tokens: list[int], k: int, min_ngram: int = 1, max_ngram: int = 4) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the last n tokens (longest n first)."""
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        # scan right to left: the most recent occurrence predicts best; skip the suffix itself
        for start in range(length - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + k]
                if follow:
                    return follow
    return []


@register
class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, min_ngram: int = 1, max_ngram: int = 4) -> None:
        self.min_ngram, self.max_ngram = min_ngram, max_ngram

    @classmethod
    def from_config(cls, cfg: SpecConfig, target: Any, tokenizer: Any) -> NgramProposer:
        return cls(cfg.min_ngram, cfg.max_ngram)

    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        return [Proposal(ngram_lookup(r.token_ids, r.num_spec_tokens, self.min_ngram, self.max_ngram)) for r in requests]
