"""Draft-model speculation: a smaller model with the target's tokenizer proposes k tokens
autoregressively (Leviathan et al. 2023). With no draft checkpoint, the draft is the target's own
first `draft_layers` layers + its final norm and head (self-speculative, as in LayerSkip /
Draft & Verify, Zhang et al. 2023): no extra weights, no extra memory beyond its own KV.

The draft keeps a per-request KV cache of the tokens it has seen; on each call it rolls back to
the longest prefix it shares with the request's tokens (rejected proposals drop out) and catches up.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from firstlight.engine.spec.base import Proposal, Proposer, SpecRequest, sample_from_logits
from firstlight.engine.spec.config import SpecConfig
from firstlight.engine.spec.registry import register
from firstlight.errors import FirstlightError
from firstlight.models.kv_cache import ContiguousKVCache


class GrowableKVCache(ContiguousKVCache):
    """A batch-1 contiguous KV cache that grows on demand and can be truncated (rollback)."""

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__(num_layers, 1, num_kv_heads, head_dim, 0, dtype, device)

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)

    def begin(self, positions: torch.Tensor) -> torch.Tensor:
        needed = self.length + positions.shape[1]
        if needed > self.max_len:  # grow to 2x (amortized O(1) per token), keeping the committed prefix
            self.max_len = max(64, 2 * needed)
            for kv in (self.k, self.v):
                for i, t in enumerate(kv):
                    grown = t.new_zeros(*t.shape[:2], self.max_len, t.shape[3])
                    grown[:, :, : self.length] = t[:, :, : self.length]
                    kv[i] = grown
        return super().begin(positions)


class TruncatedModel(nn.Module):
    """The target's embed + first `num_layers` layers + final norm + head, sharing its weights."""

    def __init__(self, target: nn.Module, num_layers: int) -> None:
        super().__init__()
        total = len(target.layers)
        if not 1 <= num_layers < total:
            raise FirstlightError(f"draft_layers must be in [1, {total - 1}] for a {total}-layer target, got {num_layers}")
        self.target = target
        self.config = target.config
        self.num_layers = num_layers

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: Any) -> torch.Tensor:
        return self.target.forward_hidden(input_ids, positions, cache, num_layers=self.num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(hidden)


def check_same_vocab(target: Any, target_tok: Any, draft: Any, draft_tok: Any, draft_name: str) -> None:
    """Raise a FirstlightError naming the mismatch if the draft cannot propose the target's tokens."""
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise FirstlightError(
            f"draft model {draft_name} has a vocabulary of {dv} tokens but the target has {tv}; "
            "a draft must use the target's tokenizer (pick a model of the same family, or use --speculative ngram)"
        )
    if target_tok is not None and draft_tok is not None and target_tok.get_vocab() != draft_tok.get_vocab():
        raise FirstlightError(
            f"draft model {draft_name} has a different tokenizer than the target (same size, different tokens); "
            "a draft must use the target's tokenizer"
        )


@register
class DraftProposer(Proposer):
    name = "draft"

    def __init__(self, draft: Any) -> None:
        self.draft = draft
        self._caches: dict[str, tuple[GrowableKVCache, list[int]]] = {}

    @classmethod
    def from_config(cls, cfg: SpecConfig, target: Any, tokenizer: Any) -> DraftProposer:
        if cfg.draft_model is None:
            return cls(TruncatedModel(target, cfg.draft_layers or max(1, len(target.layers) // 4)))
        from firstlight.models.hub import resolve
        from firstlight.models.loader import load_model

        dtype = next(target.parameters()).dtype
        draft, draft_tok = load_model(resolve(cfg.draft_model), dtype=dtype, device=str(next(target.parameters()).device))
        check_same_vocab(target, tokenizer, draft, draft_tok, cfg.draft_model)
        return cls(draft.eval())

    def free(self, request_id: str) -> None:
        self._caches.pop(request_id, None)

    def _cache(self, rid: str) -> tuple[GrowableKVCache, list[int]]:
        if rid not in self._caches:
            cfg = self.draft.config
            p = next(self.draft.parameters())
            self._caches[rid] = (GrowableKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, p.dtype, p.device), [])
        return self._caches[rid]

    @torch.inference_mode()
    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        return [self._propose_one(r) for r in requests]

    def _propose_one(self, r: SpecRequest) -> Proposal:
        cache, seen = self._cache(r.request_id)
        common = 0
        for a, b in zip(seen, r.token_ids, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(r.token_ids) - 1)  # always run at least the last token
        cache.truncate(common)
        del seen[common:]
        device = next(self.draft.parameters()).device
        feed = r.token_ids[common:]
        tokens: list[int] = []
        qs: list[torch.Tensor | None] = []
        for _ in range(r.num_spec_tokens):
            pos = torch.arange(len(seen), len(seen) + len(feed), device=device).unsqueeze(0)
            hidden = self.draft.forward_hidden(torch.tensor([feed], device=device), pos, cache)
            seen.extend(feed)
            tok, q = sample_from_logits(self.draft.compute_logits(hidden[0, -1]), r.temperature, r.generator)
            tokens.append(tok)
            qs.append(q)
            feed = [tok]
        probs = None if r.temperature <= 0 else torch.stack(qs)  # type: ignore[arg-type]
        return Proposal(tokens, probs)
