"""Perplexity over a token stream, and KL divergence of one model from another.

Perplexity = exp(mean NLL of each token given the tokens before it). The stream is cut into
windows of `window` tokens that overlap by `window - stride` (the HF "strided" method): every
token after the first window is scored with at least `window - stride` tokens of context, and
each token is scored exactly once.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

Logits = Callable[[torch.Tensor], torch.Tensor]  # ids [1, S] -> logits [1, S, V]


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    num_tokens: int


def windows(num_tokens: int, window: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first scored index) per window; each index in 1..num_tokens-1 scored once.

    The first window scores its tokens 1..window-1; each later one feeds `window` tokens and
    scores its last `stride`, so every scored token sees at least `window - stride` of context.
    """
    if not 1 <= stride < window:
        raise ValueError(f"stride must be in 1..window-1 ({window - 1}), got {stride}")
    first = 1
    while first < num_tokens:
        end = min(window if first == 1 else first + stride, num_tokens)
        yield max(0, end - window), end, first
        first = end


@torch.inference_mode()
def perplexity(logits_fn: Logits, ids: list[int], window: int = 512, stride: int = 256) -> PerplexityResult:
    if len(ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    tokens = torch.tensor([ids])
    total_nll, count = 0.0, 0
    for begin, end, first in windows(len(ids), window, stride):
        logits = logits_fn(tokens[:, begin:end]).float()  # [1, S, V]
        # logits at position p predict token p + 1
        pred = logits[0, first - begin - 1 : end - begin - 1]
        target = tokens[0, first:end]
        total_nll += F.cross_entropy(pred, target, reduction="sum").item()
        count += end - first
    mean = total_nll / count
    return PerplexityResult(perplexity=math.exp(mean), mean_nll=mean, num_tokens=count)


@torch.inference_mode()
def mean_kl(ref_fn: Logits, test_fn: Logits, ids: list[int], window: int = 512) -> float:
    """Mean over positions of KL(ref || test) of the next-token distributions, in nats."""
    tokens = torch.tensor([ids])
    total, count = 0.0, 0
    for begin in range(0, len(ids), window):
        chunk = tokens[:, begin : begin + window]
        ref_logp = F.log_softmax(ref_fn(chunk).float(), dim=-1)[0]
        test_logp = F.log_softmax(test_fn(chunk).float(), dim=-1)[0]
        total += (ref_logp.exp() * (ref_logp - test_logp)).sum().item()
        count += chunk.shape[1]
    return total / count
