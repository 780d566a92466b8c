"""The sampler: logits of one row per request -> one token per request (plus logprobs).

Order of operations follows vLLM v1's sampler: logprobs are taken from the raw model logits;
then penalties (repetition: CTRL, Keskar et al. 2019, divide positive / multiply negative logits
of seen tokens; presence/frequency: OpenAI's definition, subtract on output tokens), min_tokens
masking of stop tokens, greedy argmax or temperature -> top-k -> top-p -> min-p -> sample.

Seeded requests draw from their own `torch.Generator`, created on the first step and kept until
the request ends, so a seed gives the same tokens whatever else is in the batch. Sampling is a
categorical draw by inverse CDF (`inverse_cdf`): one uniform u per row, the first token whose cumulative
probability (fp64) exceeds u; one random number per row, where the exponential race (argmax p / E over the
vocabulary) drew one per token: 49,152 per row of SmolLM2 (benchmarks/sampler_speed.py). On CPU with our
kernel extension the same draw runs from the logits in two read-only passes per row (`firstlight::sample_rows`,
kernels/csrc/sampling.cpp), not torch's copy, scale, max, exp, sum and searches over every row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from firstlight import kernels
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


TOP_P_CANDIDATES = (64, 1024)  # filter_rows: top-p looks at this many most likely tokens first, then this many


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, top-k, top-p (nucleus, Holtzman et al. 2020), min-p (Nguyen et al. 2024); [V]."""
    return filter_rows(logits.unsqueeze(0), [params])[0]


def filter_rows(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """filter_logits of every row of logits [R, V] at once, each row with its own params (batched ops, which
    torch runs over the rows in parallel, where a loop ran them one by one)."""
    v, dev, ninf = logits.shape[-1], logits.device, float("-inf")
    x = logits / torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev).unsqueeze(1)
    ks = torch.tensor([p.top_k if 0 < p.top_k < v else v for p in params], device=dev)
    if (ks < v).any():
        vals = x.topk(int(ks[ks < v].max()), dim=-1).values  # [R, kmax], sorted
        kth = vals.gather(1, (ks.clamp(max=vals.shape[1]) - 1).unsqueeze(1))
        kth[ks == v] = ninf  # rows without top-k keep everything
        x = x.masked_fill(x < kth, ninf)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev)
    if (top_p < 1.0).any():
        # drop a token if the mass strictly before it already reaches top_p (always keeps the first). The
        # nucleus usually lies in the top 64 or 1024: then a topk (sorted) replaces the sort of the whole vocabulary
        # (49,152 entries: 3.5 ms a row); every token past those has at least their mass before it: dropped.
        sel = (top_p < 1.0).nonzero().flatten()
        probs_all = x[sel].softmax(-1)
        thresholds = top_p[sel].to(probs_all.dtype)
        filtered = torch.full((len(sel), v), ninf, dtype=x.dtype, device=dev)
        left = torch.ones(len(sel), dtype=torch.bool, device=dev)  # rows whose nucleus is not found yet
        for n in (*(c for c in TOP_P_CANDIDATES if c < v), v):
            rows = left.nonzero().flatten()
            if n < v:
                p_s, i_s = probs_all[rows].topk(n, dim=-1)
                found = p_s.sum(-1) >= thresholds[rows]  # else the nucleus reaches past these candidates
                rows, p_s, i_s = rows[found], p_s[found], i_s[found]
            else:  # the rest: sort the whole row
                p_s, i_s = probs_all[rows].sort(dim=-1, descending=True)
            left[rows] = False
            drop = (p_s.cumsum(-1) - p_s) >= thresholds[rows].unsqueeze(1)
            kept = x[sel[rows]].gather(1, i_s).masked_fill(drop, ninf)
            filtered[rows] = filtered[rows].scatter(1, i_s, kept)
            if not left.any():
                break
        x[sel] = filtered
    min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=dev).unsqueeze(1)
    if (min_p > 0).any():
        probs = x.softmax(-1)
        x = x.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), ninf)
    return x


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Per row of weights [R, V] (>= 0, unnormalized), the first index whose cumulative weight exceeds u * total
    (u [R] in [0, 1), fp64): a categorical draw; a zero weight is never picked. Cumulative sums in fp64, in two
    levels (over blocks of `block` entries, then inside the chosen block) so that only one fp32 pass reads V."""
    r, v = weights.shape
    if v % block:
        block = v
    nb = v // block
    blocks = weights.view(r, nb, block)
    cum = blocks.sum(-1, dtype=torch.float64).cumsum(-1)  # [R, nb]
    target = u * cum[:, -1]
    b = torch.searchsorted(cum, target.unsqueeze(1), right=True).squeeze(1).clamp_(max=nb - 1)
    before = torch.where(b > 0, cum.gather(1, (b - 1).clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    inner = blocks[torch.arange(r), b]  # [R, block]
    j = torch.searchsorted(inner.double().cumsum(-1) + before.unsqueeze(1), target.unsqueeze(1), right=True).squeeze(1)
    # u * total rounded up to the block's total: the block's last nonzero weight, not a zero one after it
    last_nonzero = block - 1 - (inner > 0).flip(-1).int().argmax(-1)
    j = torch.where(j >= block, last_nonzero, j)
    return b * block + j


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

        rows = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
        ours = logits.device.type == "cpu" and logits.stride(-1) == 1 and kernels.load_kernel() is not None
        if len(rows) == len(requests):
            tokens = torch.empty(len(requests), dtype=torch.long)
        elif ours:
            # greedy rows (the sampled ones are overwritten below) in one pass of ours: torch's argmax took ~1 ms
            # at 32 x 49,152 on 2 threads (kernels/csrc/sampling.cpp)
            tokens = kernels.argmax_rows(logits)
        else:
            tokens = logits.argmax(-1)
        if rows:
            ps = [requests[i].sampling_params for i in rows]
            u = torch.cat([torch.rand(1, generator=self._generator(requests[i]), dtype=torch.float64) for i in rows])
            # top-k / top-p / min-p rows: drawn from their filtered logits (temperature applied there)
            filt = [j for j, q in enumerate(ps) if q.top_k > 0 or q.top_p < 1.0 or q.min_p > 0.0]
            plain = sorted(set(range(len(ps))) - set(filt))
            filt_rows, plain_rows = [rows[j] for j in filt], [rows[j] for j in plain]
            f_logits = filter_rows(logits[filt_rows], [ps[j] for j in filt]) if filt else None
            if ours:
                # one pass of ours over each row, from the logits in place (kernels/csrc/sampling.cpp)
                if plain:
                    tokens[plain_rows] = kernels.sample_rows(
                        logits, torch.tensor(plain_rows),
                        torch.tensor([1.0 / ps[j].temperature for j in plain], dtype=torch.float32), u[plain])
                if filt:
                    tokens[filt_rows] = kernels.sample_rows(
                        f_logits, torch.arange(len(filt)), torch.ones(len(filt)), u[filt])
            else:
                e = logits[rows]  # [R, V], a copy: the in-place ops below leave `logits` alone
                e.div_(torch.tensor([q.temperature for q in ps], dtype=e.dtype).unsqueeze(1))
                if filt:
                    e[filt] = f_logits
                e.sub_(e.amax(-1, keepdim=True)).exp_()  # unnormalized probabilities (a filtered token: 0)
                tokens[rows] = inverse_cdf(e, u)
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
