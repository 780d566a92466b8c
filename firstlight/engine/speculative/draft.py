"""Draft-model speculation: a smaller model with the target's tokenizer proposes k tokens
autoregressively (Leviathan et al. 2023). With no draft checkpoint, the draft is the target's own
first `draft_layers` layers + its final norm and head (self-speculative, as in LayerSkip /
Draft & Verify, Zhang et al. 2023): no extra weights, no extra memory beyond its own KV.

All requests asking for proposals in an engine step are drafted together: each draft step is one
batched forward over B rows (one per request, each at its own position over its own slot of a
shared KV pool, `draft_cache.py`). Per request the draft's KV rolls back to the longest prefix it
shares with the request's tokens (rejected proposals drop out) and catches up on the rest: first a
catch-up prefill of all but the last missing token, rows grouped by that length (a new request's
prompt, or the 2-token [last proposal, bonus] after a fully accepted step), then k single-token
steps for all rows at once. `batched=False` keeps the earlier request-by-request loop (one growable
contiguous cache each), the reference for tests and the benchmark.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
from torch import nn

from firstlight.engine.speculative.adaptive import decode_bytes
from firstlight.engine.speculative.base import Proposal, Proposer, SpecRequest, draw_rows, sample_from_logits
from firstlight.engine.speculative.config import SpecConfig
from firstlight.engine.speculative.draft_cache import DraftKVPool
from firstlight.engine.speculative.registry import register
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


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists (bisection over C-speed slice compares)."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while lo < hi - 1:  # invariant: prefix lo equal, prefix hi not
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@register
class DraftProposer(Proposer):
    name = "draft"

    def __init__(self, draft: Any, batched: bool = True, target: Any = None) -> None:
        self.draft = draft
        self.batched = batched
        cfg = draft.config
        if cfg.state_layers:  # the draft's cache (draft_cache.py) holds K/V only, no recurrent state
            raise FirstlightError(
                f"--speculative draft: the draft ({cfg.model_type}) has linear-attention/recurrent layers, whose "
                "state the draft cache does not keep; use --speculative mtp or ngram for this model, or a "
                "--draft-model without recurrent layers"
            )
        p = next(draft.parameters())
        self.device = p.device
        num_layers = getattr(draft, "num_layers", cfg.num_layers)  # a TruncatedModel runs only its first layers
        self._kv_shape = (num_layers, cfg.num_kv_heads, cfg.head_dim, p.dtype, p.device)
        self.pool = DraftKVPool(*self._kv_shape)
        self._caches: dict[str, tuple[GrowableKVCache, list[int]]] = {}  # batched=False only
        # one draft token in target 1-token passes (weights read); unknown without the target: free
        self.token_cost = 0.0
        if target is not None:
            own = decode_bytes(target, draft.num_layers) if isinstance(draft, TruncatedModel) else decode_bytes(draft)
            self.token_cost = own / decode_bytes(target)

    def cost(self, k: int) -> float:
        return k * self.token_cost

    @classmethod
    def from_config(cls, cfg: SpecConfig, target: Any, tokenizer: Any) -> DraftProposer:
        if cfg.draft_model is None:
            return cls(TruncatedModel(target, cfg.draft_layers or max(1, len(target.layers) // 4)), target=target)
        from firstlight.models.hub import resolve
        from firstlight.models.loader import load_model

        dtype = next(target.parameters()).dtype
        draft, draft_tok = load_model(resolve(cfg.draft_model), dtype=dtype, device=str(next(target.parameters()).device))
        check_same_vocab(target, tokenizer, draft, draft_tok, cfg.draft_model)
        return cls(draft.eval(), target=target)

    def free(self, request_id: str) -> None:
        self.pool.free(request_id)
        self._caches.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        if not self.batched:
            return [self._propose_one(r) for r in requests]
        return self._propose_batched(requests) if requests else []

    # ---- batched: one forward per draft step for all requests ------------------------------------
    def _forward(self, slots: list[int], feeds: list[list[int]]) -> torch.Tensor:
        """Run feeds[b] (one length S) after slot b's cached tokens; hidden [B, S, E]."""
        kv = self.pool.pass_over(slots, feeds)
        return self.draft.forward_hidden(torch.tensor(feeds, device=self.device), kv.positions, kv)

    def _propose_batched(self, requests: list[SpecRequest]) -> list[Proposal]:
        # Rows in slot order: when the asking requests hold a dense run of slots (the usual case)
        # every pass reads the pool through a slice view.
        slots = [self.pool.acquire(r.request_id) for r in requests]
        order = sorted(range(len(requests)), key=slots.__getitem__)
        last: dict[int, int] = {}  # row -> the token its next draft step feeds
        catch_up: dict[int, list[int]] = defaultdict(list)  # catch-up length -> rows
        for i in order:
            r, slot = requests[i], slots[i]
            common = common_prefix_len(self.pool.tokens[slot], r.token_ids)
            common = min(common, len(r.token_ids) - 1)  # always run at least the last token
            self.pool.truncate(slot, common)  # rollback: keys past `common` are overwritten below
            if len(r.token_ids) - common > 1:
                catch_up[len(r.token_ids) - common - 1].append(i)
            last[i] = r.token_ids[-1]
        for n, rows in sorted(catch_up.items()):  # catch-up prefill, rows grouped by length
            self._forward([slots[i] for i in rows], [requests[i].token_ids[-1 - n : -1] for i in rows])
        tokens: list[list[int]] = [[] for _ in requests]
        qs: list[list[torch.Tensor | None]] = [[] for _ in requests]
        for step in range(max(r.num_spec_tokens for r in requests)):
            rows = [i for i in order if requests[i].num_spec_tokens > step]
            hidden = self._forward([slots[i] for i in rows], [[last[i]] for i in rows])  # [B, 1, E]
            logits = self.draft.compute_logits(hidden[:, -1])  # [B, V]
            for i, (tok, q) in zip(rows, draw_rows(logits, [requests[i] for i in rows]), strict=True):
                tokens[i].append(tok)
                qs[i].append(q)
                last[i] = tok
        return [
            Proposal(toks, None if r.temperature <= 0 else torch.stack(q))  # type: ignore[arg-type]
            for r, toks, q in zip(requests, tokens, qs, strict=True)
        ]

    # ---- batched=False: the earlier request-by-request loop ---------------------------------------
    def _cache(self, rid: str) -> tuple[GrowableKVCache, list[int]]:
        if rid not in self._caches:
            self._caches[rid] = (GrowableKVCache(*self._kv_shape), [])
        return self._caches[rid]

    def _propose_one(self, r: SpecRequest) -> Proposal:
        cache, seen = self._cache(r.request_id)
        common = min(common_prefix_len(seen, r.token_ids), len(r.token_ids) - 1)  # always run the last token
        cache.truncate(common)
        del seen[common:]
        feed = r.token_ids[common:]
        tokens: list[int] = []
        qs: list[torch.Tensor | None] = []
        for _ in range(r.num_spec_tokens):
            pos = torch.arange(len(seen), len(seen) + len(feed), device=self.device).unsqueeze(0)
            hidden = self.draft.forward_hidden(torch.tensor([feed], device=self.device), pos, cache)
            seen.extend(feed)
            tok, q = sample_from_logits(self.draft.compute_logits(hidden[0, -1]), r.temperature, r.generator)
            tokens.append(tok)
            qs.append(q)
            feed = [tok]
        probs = None if r.temperature <= 0 else torch.stack(qs)  # type: ignore[arg-type]
        return Proposal(tokens, probs)
