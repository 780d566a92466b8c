"""Heads speculation: trained Medusa heads (medusa.py) propose k tokens from the target's hidden state.

Why Medusa-style parallel heads rather than an EAGLE-style autoregressive layer: on a CPU the cost
of proposing is dominated by the LM head (for SmolLM2-135M, 28M of its 135M weights). K parallel
heads read the LM head once for all K proposals ([K, E] @ [E, V] in one matmul), and need no
per-request KV state, so rollback costs nothing. EAGLE reaches higher acceptance (Li et al. 2024)
but runs k sequential layer + LM-head steps per proposal and keeps a KV cache to roll back. The
measured acceptance and speed are in docs/SPECULATIVE.md.
"""

from __future__ import annotations

from typing import Any

import torch

from firstlight.engine.speculative.adaptive import decode_bytes, module_bytes
from firstlight.engine.speculative.base import Proposal, Proposer, SpecRequest, sample_from_logits
from firstlight.engine.speculative.config import SpecConfig
from firstlight.engine.speculative.medusa import HEADS_FILE, MedusaHeads, load_heads, model_name
from firstlight.engine.speculative.registry import register
from firstlight.errors import FirstlightError


@register
class HeadsProposer(Proposer):
    name = "heads"
    needs_hidden = True

    def __init__(self, target: Any, heads: MedusaHeads) -> None:
        self.target = target
        p = next(target.parameters())
        self.heads = heads.to(device=p.device, dtype=p.dtype).eval()
        # one proposal call reads the heads and the LM head once, whatever k (memory-bound estimate)
        self._cost = module_bytes(self.heads, target.lm_head) / decode_bytes(target)

    @classmethod
    def from_config(cls, cfg: SpecConfig, target: Any, tokenizer: Any) -> HeadsProposer:
        path = cfg.heads_path
        if path is None:
            raise FirstlightError(
                f"--speculative heads needs a heads file: pass --heads <file> (default: <model dir>/{HEADS_FILE})"
            )
        heads, _ = load_heads(path, target.config, model_name(target.config))
        if cfg.num_spec_tokens > heads.num_heads:
            raise FirstlightError(
                f"heads file {path} has {heads.num_heads} heads, fewer than num_spec_tokens={cfg.num_spec_tokens}; "
                "lower --num-spec-tokens or train more heads"
            )
        return cls(target, heads)

    def cost(self, k: int) -> float:
        return self._cost

    @torch.inference_mode()
    def propose(self, requests: list[SpecRequest]) -> list[Proposal]:
        if not requests:
            return []
        if any(r.hidden is None for r in requests):
            raise ValueError("heads proposer needs the target's hidden state for every request")
        hidden = torch.stack([r.hidden for r in requests])  # type: ignore[misc]  # [N, E]
        logits = self.target.compute_logits(self.heads(hidden)).float()  # [N, K, V]
        out = []
        for i, r in enumerate(requests):
            k = min(r.num_spec_tokens, self.heads.num_heads)
            if r.temperature <= 0:
                out.append(Proposal(logits[i, :k].argmax(-1).tolist()))
                continue
            draws = [sample_from_logits(logits[i, j], r.temperature, r.generator) for j in range(k)]
            out.append(Proposal([t for t, _ in draws], torch.stack([q for _, q in draws])))  # type: ignore[misc]
        return out
