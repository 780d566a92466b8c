"""Pairwise exchange all-to-all: in step k rank r sends its block for rank (r+k) mod p (p-1 steps)."""

from __future__ import annotations

from firstlight.sim.collectives.base import Algorithm, Step, register_algorithm


@register_algorithm
class Pairwise(Algorithm):
    name = "pairwise"
    supports = ("all_to_all", "all_gather")

    def closed_form(self, collective: str, p: int, nbytes: float, alpha: float, bandwidth: float) -> float:
        self.check(collective, p)
        return (p - 1) * (alpha + nbytes / p / bandwidth)

    def steps(self, collective: str, p: int, nbytes: float) -> list[Step]:
        self.check(collective, p)
        return [[(r, (r + k) % p, nbytes / p) for r in range(p)] for k in range(1, p)]
