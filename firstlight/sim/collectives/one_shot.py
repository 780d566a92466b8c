"""One-shot all-reduce: every rank pushes its whole buffer to all peers in one step and reduces
locally (vLLM's custom all-reduce for small messages). One alpha, (p-1) n/B on each egress port:
the latency-optimal choice for the KB-sized activations of a decode step."""

from __future__ import annotations

from firstlight.sim.collectives.base import Algorithm, Step, register_algorithm


@register_algorithm
class OneShot(Algorithm):
    name = "one_shot"
    supports = ("all_reduce", "all_gather")

    def closed_form(self, collective: str, p: int, nbytes: float, alpha: float, bandwidth: float) -> float:
        self.check(collective, p)
        per_peer = nbytes if collective == "all_reduce" else nbytes / p
        return alpha + (p - 1) * per_peer / bandwidth

    def steps(self, collective: str, p: int, nbytes: float) -> list[Step]:
        self.check(collective, p)
        per_peer = nbytes if collective == "all_reduce" else nbytes / p
        return [[(r, d, per_peer) for r in range(p) for d in range(p) if d != r]]
