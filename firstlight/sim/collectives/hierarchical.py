"""Hierarchical (2D) all-reduce: reduce-scatter inside each node, all-reduce of the 1/g shard
across nodes (one ring per local rank, each on its own NIC), all-gather inside each node.

Ranks are numbered node-major: rank = node * group_size + local. Time (ring inside and across):
2(g-1)(a1 + n/(g B1)) + 2(m-1)(a2 + n/(g m B2)) with g ranks per node and m nodes.
"""

from __future__ import annotations

from firstlight.sim.collectives.base import Algorithm, CollectiveError, Step, register_algorithm


@register_algorithm
class Hierarchical(Algorithm):
    name = "hierarchical"
    supports = ("all_reduce", "all_gather", "reduce_scatter")
    group_size = 8  # ranks per node; set per use: Hierarchical.with_group(g)

    @classmethod
    def with_group(cls, group_size: int) -> Hierarchical:
        alg = cls()
        alg.group_size = group_size
        return alg

    def check(self, collective: str, p: int) -> None:
        super().check(collective, p)
        if p % self.group_size and p > self.group_size:
            raise CollectiveError(f"hierarchical: {p} ranks are not a multiple of group_size={self.group_size}")

    def _shape(self, p: int) -> tuple[int, int]:
        g = min(self.group_size, p)
        return g, p // g

    def closed_form(self, collective: str, p: int, nbytes: float, alpha: float, bandwidth: float,
                    inter_alpha: float | None = None, inter_bandwidth: float | None = None) -> float:
        self.check(collective, p)
        g, m = self._shape(p)
        a2 = alpha if inter_alpha is None else inter_alpha
        b2 = bandwidth if inter_bandwidth is None else inter_bandwidth
        phases = 2 if collective == "all_reduce" else 1
        intra = phases * (g - 1) * (alpha + nbytes / g / bandwidth)
        inter = phases * (m - 1) * (a2 + nbytes / g / m / b2)
        return intra + inter

    def steps(self, collective: str, p: int, nbytes: float) -> list[Step]:
        self.check(collective, p)
        g, m = self._shape(p)
        intra = [[(k * g + r, k * g + (r + 1) % g, nbytes / g) for k in range(m) for r in range(g)]
                 for _ in range(g - 1)]
        inter_phases = 2 if collective == "all_reduce" else 1
        inter = [[(k * g + r, ((k + 1) % m) * g + r, nbytes / g / m) for k in range(m) for r in range(g)]
                 for _ in range(inter_phases * (m - 1))]
        if collective == "all_reduce":
            return intra + inter + intra
        if collective == "reduce_scatter":
            return intra + inter
        return inter + intra  # all_gather: across nodes first, then inside each node
