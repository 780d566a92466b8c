"""What a proposer sees of a request, what it returns, and the interface every proposer implements."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch


@dataclass
class SpecRequest:
    """One request asking for proposals this step."""

    request_id: str
    token_ids: list[int]  # prompt + output so far; the last one is not in the target's KV cache yet
    num_spec_tokens: int  # k: how many tokens to propose (a proposer may return fewer)
    temperature: float = 0.0  # 0 = greedy: propose the proposer's argmax
    generator: torch.Generator | None = None  # the request's own generator when it is seeded
    hidden: torch.Tensor | None = None  # [E] target hidden state that predicted token_ids[-1] (heads only)
    # needs_all_hidden (MTP): the target's final hidden states [n, E] at positions hidden_start ..
    # len(token_ids) - 2 that this proposer has not been given before (n = 0: none new)
    hidden_states: torch.Tensor | None = None
    hidden_start: int = 0


@dataclass
class Proposal:
    """k proposed tokens and the distributions q they were drawn from.

    `probs` [k, V] is None for a deterministic proposal (q one-hot on each token: n-gram lookup, or a
    greedy draft), which the rejection sampler treats as such.
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.token_ids):
            raise ValueError(f"Proposal: {len(self.token_ids)} tokens but probs for {self.probs.shape[0]}")


class Proposer:
    """Base of all proposers. Stateless ones only implement `propose`."""

    name: ClassVar[str] = ""
    needs_hidden: ClassVar[bool] = False  # True: the engine passes the target's last hidden state
    needs_all_hidden: ClassVar[bool] = False  # True: ... the hidden states of every position, once each

    @classmethod
    def from_config(cls, cfg: Any, target: Any, tokenizer: Any) -> Proposer:
        """Build from a SpecConfig for a target model (CausalLM) and its tokenizer."""
        raise NotImplementedError

    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        raise NotImplementedError

    def free(self, request_id: str) -> None:
        """Drop any per-request state (the request finished or was preempted)."""

    def cost(self, k: int) -> float:
        """What proposing k tokens for one request costs, in target 1-token passes (adaptive k adds it
        to the verification pass). Default: free (n-gram lookup)."""
        return 0.0


def sample_from_logits(
    logits: torch.Tensor, temperature: float, generator: torch.Generator | None
) -> tuple[int, torch.Tensor | None]:
    """(token, q) for one position's logits [V]: argmax and None when greedy, else a draw and q."""
    if temperature <= 0:
        return int(logits.argmax()), None
    q = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(q, 1, generator=generator)), q


def draw_rows(logits: torch.Tensor, requests: list[SpecRequest]) -> list[tuple[int, torch.Tensor | None]]:
    """(token, q) per row of logits [B, V] for requests[b]: one batched argmax for the greedy rows, the
    request's own generator for the others (so its draws do not depend on the batch)."""
    greedy = logits.argmax(-1).tolist()
    return [(greedy[b], None) if r.temperature <= 0 else sample_from_logits(logits[b], r.temperature, r.generator)
            for b, r in enumerate(requests)]
