"""Batch-1 speculative generation over a contiguous KV cache: the reference loop.

The engine runs the same propose → verify → rejection-sample → roll back cycle for many requests
over its paged cache; this loop is the small, readable version used by tests and the benchmark's
baseline rows. Rollback here is `cache.length = committed`: rejected keys are simply overwritten.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from firstlight.engine.speculative.base import Proposer, SpecRequest
from firstlight.engine.speculative.rejection import rejection_sample
from firstlight.models.kv_cache import ContiguousKVCache


@dataclass
class SpecStats:
    num_steps: int = 0  # target passes after the prefill
    num_proposed: int = 0
    num_accepted: int = 0
    num_emitted: int = 0
    accepted_per_step: list[int] = field(default_factory=list)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens emitted per target pass (accepted + the recovered/bonus one)."""
        return self.num_emitted / self.num_steps if self.num_steps else 0.0


def target_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """[.., V] logits → the distribution tokens are drawn from (greedy: argmax of any monotone map)."""
    return torch.softmax(logits.float() / (temperature if temperature > 0 else 1.0), dim=-1)


@torch.inference_mode()
def speculative_generate(
    model: torch.nn.Module,
    proposer: Proposer | None,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    num_spec_tokens: int = 4,
    temperature: float = 0.0,
    seed: int | None = None,
    eos_token_ids: tuple[int, ...] = (),
    stats: SpecStats | None = None,
) -> Iterator[list[int]]:
    """Yield chunks of generated tokens (one chunk per target pass); proposer=None is plain decoding."""
    cfg = model.config
    p = next(model.parameters())
    total = len(prompt_ids) + max_new_tokens + num_spec_tokens + 1
    cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, total, p.dtype, p.device)
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    stats = stats if stats is not None else SpecStats()
    rid = "spec-generate"

    def run(tokens: list[int]) -> torch.Tensor:
        pos = torch.arange(cache.length, cache.length + len(tokens), device=p.device).unsqueeze(0)
        return model.forward_hidden(torch.tensor([tokens], device=p.device), pos, cache)[0]  # [S, E]

    hidden = run(prompt_ids)
    probs = target_probs(model.compute_logits(hidden[-1:]), temperature)  # [1, V]
    first = rejection_sample(probs[None], torch.zeros(1, 0, dtype=torch.long), [0],
                             is_greedy=[temperature <= 0], generators=[gen])[0]
    out = list(first)
    h_last = hidden[-1]
    yield first
    try:
        while len(out) < max_new_tokens and out[-1] not in eos_token_ids:
            k = min(num_spec_tokens, max_new_tokens - len(out))
            proposal = None
            if proposer is not None and k > 0:
                req = SpecRequest(rid, prompt_ids + out, k, temperature, gen, h_last)
                proposal = proposer.propose([req])[0]
            drafts = proposal.token_ids[:k] if proposal is not None else []
            committed = cache.length
            hidden = run([out[-1], *drafts])  # [1+k, E]
            probs = target_probs(model.compute_logits(hidden), temperature)  # [1+k, V]
            q = proposal.probs[: len(drafts)][None] if proposal is not None and proposal.probs is not None else None
            emitted = rejection_sample(
                probs[None], torch.tensor([drafts], dtype=torch.long).reshape(1, len(drafts)), [len(drafts)],
                q, is_greedy=[temperature <= 0], generators=[gen],
            )[0]
            num_accepted = len(emitted) - 1
            cache.length = committed + len(emitted)  # roll back the rejected proposals' keys
            h_last = hidden[len(emitted) - 1]
            for i, t in enumerate(emitted):  # stop at EOS / max tokens inside the chunk
                if t in eos_token_ids or len(out) + i + 1 >= max_new_tokens:
                    emitted = emitted[: i + 1]
                    break
            stats.num_steps += 1
            stats.num_proposed += len(drafts)
            stats.num_accepted += num_accepted
            stats.num_emitted += len(emitted)
            stats.accepted_per_step.append(num_accepted)
            out.extend(emitted)
            yield emitted
    finally:
        if proposer is not None:
            proposer.free(rid)
