"""Adaptive k: how many tokens to propose for a request, from its acceptance and the pass costs.

A step that verifies k proposals costs one target pass over 1 + k tokens; it emits
E(k) = 1 + a + a^2 + ... + a^k = (1 - a^(k+1)) / (1 - a) tokens on average when each proposal is
accepted with probability a given the ones before it were (Leviathan et al. 2023, eq. 1). The policy
picks, per request and step, the k in [0, cap] with the most tokens per unit of cost,
E(k) / c(1 + k), with c(n) = t_n / t_1 the measured cost of an n-token pass; k = 0 (decode
normally, c = 1, one token) wins when the proposals are not worth their pass.

Why costs and not a fixed schedule: on a GPU c(n) is ~1 for n up to tens of tokens (decode is
memory-bound), so proposing many tokens is nearly free; on a CPU the extra tokens cost compute (on
the 2-core dev VM c(5) ~ 1.6 and c(17) ~ 2.3) and, with MKL on AMD, c(2) and c(3) cost more than
c(5), so a schedule that backs off to k = 1 (HF's "heuristic") pays most where it gains least.

The acceptance a is estimated per request from its own history: accepted and tried proposal
positions, both decayed by `DECAY` per step, plus a prior of `PRIOR` (weight 2), high enough that
every request tries its proposer. Steps without proposals decay the evidence too, so a request whose
proposals stopped paying drifts back to the prior and tries again (after ~7 idle steps for the
heads below that never hit): that is the exploration, and it is what lets n-gram lookup pick a copy
back up after the text diverged for a while. (A slower idle decay, 0.95, was measured: it cut the
heads' probing but halved n-gram's gain on the copy-heavy requests.)

A proposer's own cost (`Proposer.cost(k)`, in target passes) is added to the pass: the heads read
the LM head once per call (0.22 of a SmolLM2-135M pass), a draft k times its layers and head.

The costs are measured once per model at engine start (`measure_pass_costs`, batch 1: ~20 passes,
about 2 s for SmolLM2-135M on one CPU core) or given in `SpecConfig.pass_costs`. At larger batches
the marginal cost of proposals is higher than at batch 1 on compute-bound hardware; the table does
not model that yet.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain

import torch

DECAY = 0.8  # per step, verified or not: the estimate follows a request into and out of copy-heavy stretches
PRIOR = 0.6  # optimistic enough that every request tries its proposer, even one with a cost of its own


@dataclass
class Acceptance:
    """Decayed counts of accepted and tried proposal positions for one request."""

    accepted: float = 0.0
    tried: float = 0.0

    @property
    def rate(self) -> float:
        return (self.accepted + 2 * PRIOR) / (self.tried + 2)

    def update(self, num_proposed: int, num_accepted: int) -> None:
        """After a verified step: positions up to the first rejection were tried."""
        self.accepted = DECAY * self.accepted + num_accepted
        self.tried = DECAY * self.tried + num_accepted + (1 if num_accepted < num_proposed else 0)

    def idle(self) -> None:
        """A step without proposals: the evidence ages."""
        self.accepted *= DECAY
        self.tried *= DECAY


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a step with k proposals emits on average (accepted + the target's own token)."""
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


def best_k(rate: float, costs: Sequence[float], cap: int, proposer_cost: Callable[[int], float] | None = None) -> int:
    """argmax over k in [0, cap] of expected_tokens(rate, k) / (costs[k] + proposer_cost(k));
    costs[k] = c(1 + k), costs[0] = 1; proposer_cost in the same units (default: free)."""
    best, best_value = 0, 1.0 / costs[0]
    for k in range(1, min(cap, len(costs) - 1) + 1):
        value = expected_tokens(rate, k) / (costs[k] + (proposer_cost(k) if proposer_cost else 0.0))
        if value > best_value * (1 + 1e-9):
            best, best_value = k, value
    return best


def decode_bytes(model: torch.nn.Module, num_layers: int | None = None) -> int:
    """Weight bytes one decode token reads: the first `num_layers` layers (all by default), the final
    norm and the LM head (the embedding lookup reads one row). A proposer's cost estimate: batch-1
    decode streams its weights, so cost ~ bytes read."""
    return module_bytes(*model.layers[:num_layers], model.norm, model.lm_head)


def module_bytes(*modules: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers of `modules` (quantized weights are often buffers),
    each tensor counted once."""
    seen: set[int] = set()
    total = 0
    for t in chain.from_iterable(chain(m.parameters(), m.buffers()) for m in modules):
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def interpolate_costs(measured: dict[int, float], max_k: int) -> list[float]:
    """c(1 + k) for k = 0 .. max_k from pass times at some sizes n (seconds), linear in between."""
    xs = sorted(measured)
    out = []
    for k in range(max_k + 1):
        n = min(max(1 + k, xs[0]), xs[-1])
        lo = max(x for x in xs if x <= n)
        hi = min(x for x in xs if x >= n)
        t = measured[lo] if hi == lo else measured[lo] + (measured[hi] - measured[lo]) * (n - lo) / (hi - lo)
        out.append(t / measured[1])
    out[0] = 1.0
    return out


@torch.inference_mode()
def time_passes(model: torch.nn.Module, sizes: Sequence[int], context: int = 64, repeats: int = 3) -> dict[int, float]:
    """Median seconds of a batch-1 pass over n tokens after `context` tokens (contiguous cache,
    logits included) for each n in `sizes`, timed interleaved (after one warm-up round) so load drift
    hits every size alike."""
    from firstlight.models.kv_cache import ContiguousKVCache

    cfg = model.config
    param = next(model.parameters())
    longest = context + max(sizes)
    cache = ContiguousKVCache(cfg.num_layers, 1, cfg.num_kv_heads, cfg.head_dim, longest, dtype=param.dtype,
                              device=param.device)
    ids = torch.ones(1, longest, dtype=torch.long, device=param.device)
    positions = torch.arange(longest, device=param.device)[None]
    sync = torch.cuda.synchronize if param.device.type == "cuda" else (lambda: None)

    def once(n: int) -> float:
        cache.length = context  # roll back to the prefix
        sync()
        t0 = time.perf_counter()
        model.compute_logits(model.forward_hidden(ids[:, context : context + n], positions[:, context : context + n], cache))
        sync()
        return time.perf_counter() - t0

    model.forward_hidden(ids[:, :context], positions[:, :context], cache)
    times: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(repeats + 1):
        for n in sizes:
            times[n].append(once(n))
    return {n: statistics.median(v[1:]) for n, v in times.items()}


def measure_pass_costs(model: torch.nn.Module, max_k: int, context: int = 64, repeats: int = 3) -> list[float]:
    """c(1 + k) for k = 0 .. max_k relative to a 1-token pass: sizes 1, 2, 3, 5, 9, 17 (up to 1 + max_k)
    and 1 + max_k timed, the others interpolated."""
    sizes = sorted({n for n in (1, 2, 3, 5, 9, 17) if n <= 1 + max_k} | {1 + max_k})
    return interpolate_costs(time_passes(model, sizes, context, repeats), max_k)
