"""Corpus → fixed-length token chunks, shuffled per epoch and sharded by rank."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from firstlight.errors import FirstlightError


def token_chunks(tokenizer: Any, text: str, chunk_len: int, max_tokens: int | None = None) -> torch.Tensor:
    """[N, chunk_len] token ids cut from the tokenized text (the tail shorter than chunk_len is dropped)."""
    ids: list[int] = []
    # tokenizing a multi-MB string at once is slow and memory-hungry; paragraphs keep it linear
    for para in text.split("\n\n"):
        if para.strip():
            ids.extend(tokenizer.encode(para + "\n\n", add_special_tokens=False))
        if max_tokens is not None and len(ids) >= max_tokens:
            break
    n = len(ids) // chunk_len
    if n == 0:
        raise FirstlightError(
            f"the corpus has {len(ids)} tokens, fewer than one chunk of {chunk_len}; use a larger corpus or lower --prefix-len"
        )
    return torch.tensor(ids[: n * chunk_len]).view(n, chunk_len)


def batches(chunks: torch.Tensor, batch_size: int, rank: int, world_size: int, seed: int, start_step: int = 0) -> Iterator[torch.Tensor]:
    """Endless [batch_size, L] batches; every rank sees a disjoint slice of the same permutation."""
    n = chunks.shape[0]
    per_step = batch_size * world_size
    if n < per_step:
        # repeat a small corpus so every rank still gets a full batch
        chunks = chunks.repeat((per_step + n - 1) // n, 1)
        n = chunks.shape[0]
    steps_per_epoch = n // per_step
    step = start_step
    while True:
        epoch, i = divmod(step, steps_per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))
        lo = i * per_step + rank * batch_size
        yield chunks[order[lo : lo + batch_size]]
        step += 1
