"""Binary tree: reduce to the root then broadcast, pipelined in `num_chunks` chunks.

Latency grows with log2(p) instead of p, bandwidth term does not shrink with p: the better choice
for small messages (NCCL uses a double binary tree for the same reason; Sanders et al. 2009).
"""

from __future__ import annotations

import math

from firstlight.sim.collectives.base import Algorithm, Step, register_algorithm


def _depth(rank: int) -> int:
    return int(math.log2(rank + 1))


@register_algorithm
class Tree(Algorithm):
    name = "tree"
    supports = ("all_reduce",)
    num_chunks = 8

    def closed_form(self, collective: str, p: int, nbytes: float, alpha: float, bandwidth: float) -> float:
        self.check(collective, p)
        if p == 1:
            return 0.0
        depth = _depth(p - 1)
        k = self.num_chunks
        fan_in = 2 if p > 2 else 1  # a parent receives from two children at once
        # reduce and broadcast phases, each depth + k - 1 pipelined steps of n/k bytes
        return 2 * (depth + k - 1) * (alpha + fan_in * nbytes / k / bandwidth)

    def steps(self, collective: str, p: int, nbytes: float) -> list[Step]:
        self.check(collective, p)
        if p == 1:
            return []
        depth = _depth(p - 1)
        k = self.num_chunks
        chunk = nbytes / k
        reduce_steps: list[Step] = []
        for t in range(depth + k - 1):
            step: Step = []
            for r in range(1, p):
                c = t - (depth - _depth(r))  # deeper ranks start first
                if 0 <= c < k:
                    step.append((r, (r - 1) // 2, chunk))
            reduce_steps.append(step)
        bcast = [[(dst, src, b) for src, dst, b in step] for step in reversed(reduce_steps)]
        return reduce_steps + bcast
