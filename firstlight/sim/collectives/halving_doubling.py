"""Recursive halving (reduce-scatter) and recursive doubling (all-gather); together Rabenseifner's
all-reduce: 2 log2(p) alpha + 2 (p-1)/p n/B. Needs a power-of-two rank count."""

from __future__ import annotations

import math

from firstlight.sim.collectives.base import Algorithm, CollectiveError, Step, register_algorithm


@register_algorithm
class HalvingDoubling(Algorithm):
    name = "halving_doubling"
    supports = ("all_reduce", "all_gather", "reduce_scatter")

    def check(self, collective: str, p: int) -> None:
        super().check(collective, p)
        if p & (p - 1):
            raise CollectiveError(f"halving_doubling needs a power-of-two rank count, got {p}; use ring or tree")

    def closed_form(self, collective: str, p: int, nbytes: float, alpha: float, bandwidth: float) -> float:
        self.check(collective, p)
        one_phase = math.log2(p) * alpha + (p - 1) / p * nbytes / bandwidth
        return 2 * one_phase if collective == "all_reduce" else one_phase

    def _halving(self, p: int, nbytes: float) -> list[Step]:
        steps: list[Step] = []
        size = nbytes / 2
        dist = p // 2
        while dist >= 1:
            steps.append([(r, r ^ dist, size) for r in range(p)])
            size /= 2
            dist //= 2
        return steps

    def steps(self, collective: str, p: int, nbytes: float) -> list[Step]:
        self.check(collective, p)
        rs = self._halving(p, nbytes)
        ag = list(reversed(rs))
        return {"reduce_scatter": rs, "all_gather": ag, "all_reduce": rs + ag}[collective]
