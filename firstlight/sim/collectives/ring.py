"""Ring: p-1 steps per phase, each rank passes n/p to its right neighbour (bandwidth-optimal)."""

from __future__ import annotations

from firstlight.sim.collectives.base import Algorithm, Step, register_algorithm


@register_algorithm
class Ring(Algorithm):
    name = "ring"
    supports = ("all_reduce", "all_gather", "reduce_scatter")

    def _num_steps(self, collective: str, p: int) -> int:
        return 2 * (p - 1) if collective == "all_reduce" else p - 1

    def closed_form(self, collective: str, p: int, nbytes: float, alpha: float, bandwidth: float) -> float:
        self.check(collective, p)
        # all-reduce: 2(p-1)/p * n/B + 2(p-1)*alpha; all-gather / reduce-scatter: half of that
        return self._num_steps(collective, p) * (alpha + nbytes / p / bandwidth)

    def steps(self, collective: str, p: int, nbytes: float) -> list[Step]:
        self.check(collective, p)
        chunk = nbytes / p
        return [[(r, (r + 1) % p, chunk) for r in range(p)] for _ in range(self._num_steps(collective, p))]
