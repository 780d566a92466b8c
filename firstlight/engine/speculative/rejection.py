"""Lossless speculative sampling (Leviathan et al. 2023, Alg. 1; Chen et al. 2023, Alg. 2).

For each proposed token d_i ~ q_i, in order: accept with probability min(1, p_i(d_i) / q_i(d_i)).
At the first rejection, emit a token drawn from norm(max(0, p_i - q_i)) and stop; when all k are
accepted, emit a bonus token drawn from p_{k+1}. The emitted sequence is distributed exactly as
sampling from the target p token by token. Greedy rows accept while d_i == argmax p_i and emit
argmax p at the first mismatch (or the bonus position). A deterministic proposal (q one-hot on d_i,
n-gram lookup) accepts with probability p_i(d_i) and resamples from p_i with d_i removed.

All rows are processed at once on padded tensors; randomness comes from each row's generator
(a seeded request reproduces its tokens whatever else is in the batch) or a shared one.
"""

from __future__ import annotations

import torch


def _uniform(n: int, k: int, generators: list[torch.Generator | None] | None, shared: torch.Generator | None) -> torch.Tensor:
    if generators is None:
        return torch.rand(n, k, generator=shared)
    return torch.stack([torch.rand(k, generator=g if g is not None else shared) for g in generators]) if n else torch.rand(0, k)


def _exp_noise(shape: tuple[int, int], generators: list[torch.Generator | None] | None, shared: torch.Generator | None) -> torch.Tensor:
    if generators is None:
        return torch.empty(shape).exponential_(generator=shared)
    rows = [torch.empty(shape[1]).exponential_(generator=g if g is not None else shared) for g in generators]
    return torch.stack(rows) if rows else torch.empty(shape)


@torch.inference_mode()
def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: list[int],
    draft_probs: torch.Tensor | None = None,
    is_greedy: list[bool] | None = None,
    generators: list[torch.Generator | None] | None = None,
    shared_generator: torch.Generator | None = None,
) -> list[list[int]]:
    """The tokens each row emits: its accepted proposals then one recovered or bonus token.

    target_probs: [N, K+1, V] target probabilities (after the request's temperature/top-p/top-k) at
        the positions that scored each proposal and, last, the bonus position. Only row i's first
        num_draft_tokens[i] + 1 positions are read.
    draft_token_ids: [N, K] long, padded. num_draft_tokens: k_i <= K per row.
    draft_probs: [N, K, V] the q each token was drawn from, or None when all proposals are
        deterministic (one-hot q). Rows of a deterministic proposal in a mixed batch pass one-hot rows.
    is_greedy: per row; greedy rows ignore q and the generators.
    generators: per row (None entries use `shared_generator`), or None for all-shared.
    """
    n, k_max = draft_token_ids.shape
    if target_probs.shape[:2] != (n, k_max + 1):
        raise ValueError(f"target_probs {tuple(target_probs.shape)} does not match {n} rows of {k_max} proposals + 1")
    num_draft = torch.tensor(num_draft_tokens, dtype=torch.long)
    greedy = torch.tensor(is_greedy if is_greedy is not None else [False] * n, dtype=torch.bool)
    probs = target_probs.float()
    ids = draft_token_ids.clamp(min=0)  # padding -> 0; masked out below

    p_draft = probs[:, :k_max].gather(2, ids.unsqueeze(-1)).squeeze(-1)  # [N, K]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs.float().gather(2, ids.unsqueeze(-1)).squeeze(-1)
    u = _uniform(n, k_max, generators, shared_generator)  # [N, K]
    accepted = u * q_draft < p_draft  # u < p/q without dividing by a zero q
    argmax = probs.argmax(-1)  # [N, K+1]
    accepted = torch.where(greedy[:, None], draft_token_ids == argmax[:, :k_max], accepted)
    valid = torch.arange(k_max)[None, :] < num_draft[:, None]
    accepted &= valid
    # leading run of accepts: the first position whose cumulative product drops to 0
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)  # [N]

    # The distribution of the final token: residual max(0, p - q) at a rejection, p at the bonus.
    rows = torch.arange(n)
    final_p = probs[rows, num_accepted]  # [N, V]
    rejected = num_accepted < num_draft
    if bool(rejected.any()):
        pos = num_accepted.clamp(max=max(k_max - 1, 0))
        if draft_probs is None:
            q_final = torch.zeros_like(final_p).scatter_(1, ids[rows, pos].unsqueeze(1), 1.0)
        else:
            q_final = draft_probs.float()[rows, pos]
        residual = (final_p - q_final).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # p == q makes the residual empty; a rejection then has probability 0, keep p for safety
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), final_p)
        final_p = torch.where(rejected[:, None], residual, final_p)
    noise = _exp_noise(tuple(final_p.shape), generators, shared_generator)
    sampled = (final_p / noise).argmax(-1)  # exponential race == categorical draw from final_p
    final = torch.where(greedy, argmax[rows, num_accepted], sampled)

    out = []
    for i in range(n):
        a = int(num_accepted[i])
        out.append(draft_token_ids[i, :a].tolist() + [int(final[i])])
    return out
