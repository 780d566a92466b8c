"""Plain generation with a contiguous KV cache: prefill once, then one token per step.

The engine (continuous batching over a paged cache) replaces this for serving; this path is the
simple reference the engine's output is checked against, and what `firstlight generate` runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from firstlight.models.kv_cache import ContiguousKVCache
from firstlight.models.layers import CausalLM


@dataclass
class GenerationStats:
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_step_s: list[float] = field(default_factory=list)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.num_prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        # The first generated token comes from the prefill; the rest from decode steps.
        n = len(self.decode_step_s)
        return n / self.decode_s if self.decode_s else 0.0


def sample_token(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> int:
    """One token id from logits [V]: greedy at temperature 0, else nucleus sampling (Holtzman et al. 2020)."""
    if temperature <= 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        keep = sorted_probs.cumsum(-1) - sorted_probs < top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.inference_mode()
def generate_tokens(
    model: CausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_ids: tuple[int, ...] = (),
    stats: GenerationStats | None = None,
) -> Iterator[int]:
    """Yield generated token ids one at a time (stops after an EOS token or max_new_tokens)."""
    cfg = model.config
    if not prompt_ids:
        raise ValueError("the prompt is empty: give at least one token")
    total = len(prompt_ids) + max_new_tokens
    if total > cfg.max_position_embeddings:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
            f"context of {cfg.max_position_embeddings} tokens"
        )
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, total, dtype, device)
    generator = torch.Generator(device="cpu").manual_seed(seed) if seed is not None else None
    stats = stats if stats is not None else GenerationStats()
    stats.num_prompt_tokens = len(prompt_ids)

    t0 = time.perf_counter()
    ids = torch.tensor([prompt_ids], device=device)
    positions = torch.arange(len(prompt_ids), device=device).unsqueeze(0)
    hidden = model.forward_hidden(ids, positions, cache)
    logits = model.compute_logits(hidden[:, -1])[0]
    token = sample_token(logits, temperature, top_p, generator)
    stats.prefill_s = time.perf_counter() - t0
    for step in range(max_new_tokens):
        stats.num_generated_tokens += 1
        yield token
        if token in eos_token_ids or step == max_new_tokens - 1:
            return
        t0 = time.perf_counter()
        pos = len(prompt_ids) + step
        hidden = model.forward_hidden(
            torch.tensor([[token]], device=device), torch.tensor([[pos]], device=device), cache
        )
        token = sample_token(model.compute_logits(hidden[:, -1])[0], temperature, top_p, generator)
        dt = time.perf_counter() - t0
        stats.decode_s += dt
        stats.decode_step_s.append(dt)


class TextStreamer:
    """Incremental detokenization: emit text only once it decodes without a partial UTF-8 character."""

    def __init__(self, tokenizer) -> None:  # noqa: ANN001 - any HF tokenizer
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = 0  # characters already emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[self.emitted :], len(text)
        return new
