"""The sampler: logits of one row per request -> one token per request (plus logprobs).

Order of operations follows vLLM v1's sampler: logprobs are taken from the raw model logits;
then penalties (repetition: CTRL, Keskar et al. 2019, divide positive / multiply negative logits
of seen tokens; presence/frequency: OpenAI's definition, subtract on output tokens), min_tokens
masking of stop tokens, greedy argmax or temperature -> top-k -> top-p -> min-p -> sample.

Seeded requests draw from their own `torch.Generator`, created on the first step and kept until
the request ends, so a seed gives the same tokens whatever else is in the batch. Sampling uses the
exponential-race form (argmax p / E, E ~ Exp(1)), equivalent to a categorical draw.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from firstlight.engine.request import Request, SamplingParams


@dataclass
class TokenLogprobs:
    """The logprob of a chosen token and the top-n alternatives at that position."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]] = field(default_factory=list)


def _top_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, n: int) -> list[TokenLogprobs]:
    """logprobs: [N, V] log-softmaxed; chosen: [N]."""
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1)  # [N]
    ranks = (logprobs > chosen_lp[:, None]).sum(1) + 1
    out = []
    if n > 0:
        top_v, top_i = logprobs.topk(n, dim=1)
        tops = [list(zip(i.tolist(), v.tolist(), strict=True)) for i, v in zip(top_i, top_v, strict=True)]
    else:
        tops = [[] for _ in range(len(chosen))]
    for t, lp, r, top in zip(chosen.tolist(), chosen_lp.tolist(), ranks.tolist(), tops, strict=True):
        out.append(TokenLogprobs(t, lp, r, top))
    return out


def apply_penalties(logits: torch.Tensor, request: Request) -> torch.Tensor:
    """Repetition (prompt + output tokens), presence and frequency (output tokens); logits: [V]."""
    p = request.sampling_params
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(request.all_token_ids)), dtype=torch.long)
        seen = seen[seen < vocab]
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and request.output_token_ids:
        out = torch.tensor(request.output_token_ids, dtype=torch.long)
        out = out[out < vocab]
        counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p (nucleus, Holtzman et al. 2020), min-p (Nguyen et al. 2024); [V]."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, idx = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token if the mass strictly before it already reaches top_p (always keeps the first)
        drop = (probs.cumsum(-1) - probs) >= params.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, idx, sorted_logits)
    if params.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return logits


class Sampler:
    """Picks one token per row; owns the per-request generators of seeded requests."""

    def __init__(self, seed: int = 0) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self._default = torch.Generator().manual_seed(seed)

    def free(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def generator(self, request: Request) -> torch.Generator:
        """The generator a request draws from (its own when seeded); speculative decoding shares it."""
        return self._generator(request)

    def _generator(self, request: Request) -> torch.Generator:
        seed = request.sampling_params.seed
        if seed is None:
            return self._default
        g = self._generators.get(request.request_id)
        if g is None:
            g = self._generators[request.request_id] = torch.Generator().manual_seed(seed)
        return g

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [N, V] (one row per request, in order). Returns token ids and optional logprobs."""
        logits = logits.float()
        num_lp = [r.sampling_params.logprobs for r in requests]
        raw_logprobs = logits.log_softmax(-1) if any(n is not None for n in num_lp) else None

        needs_processing = [
            r.sampling_params.has_penalties or r.num_output_tokens < r.sampling_params.min_tokens for r in requests
        ]
        if any(needs_processing):
            logits = logits.clone()
            for i, r in enumerate(requests):
                if not needs_processing[i]:
                    continue
                if r.sampling_params.has_penalties:
                    apply_penalties(logits[i], r)
                if r.num_output_tokens < r.sampling_params.min_tokens:
                    stops = set(r.sampling_params.stop_token_ids)
                    if not r.sampling_params.ignore_eos:
                        stops |= set(r.eos_token_ids)
                    ids = [t for t in stops if t < logits.shape[-1]]
                    if ids:
                        logits[i, ids] = float("-inf")

        tokens = logits.argmax(-1)  # greedy rows are done; the others are overwritten below
        for i, r in enumerate(requests):
            params = r.sampling_params
            if params.is_greedy:
                continue
            probs = filter_logits(logits[i], params).softmax(-1)
            race = torch.empty_like(probs).exponential_(generator=self._generator(r))
            tokens[i] = (probs / race).argmax()

        token_list = tokens.tolist()
        lps: list[TokenLogprobs | None] = [None] * len(requests)
        if raw_logprobs is not None:
            rows = [i for i, n in enumerate(num_lp) if n is not None]
            for i in rows:
                lps[i] = _top_logprobs(raw_logprobs[i : i + 1], tokens[i : i + 1], num_lp[i] or 0)[0]
        return token_list, lps


@torch.inference_mode()
def prompt_logprobs(logits: torch.Tensor, next_token_ids: list[int], n: int) -> list[TokenLogprobs]:
    """Logprobs of the prompt's tokens given the ones before: logits [S, V] predict next_token_ids [S]."""
    lp = logits.float().log_softmax(-1)
    return _top_logprobs(lp, torch.tensor(next_token_ids, dtype=torch.long), n)
