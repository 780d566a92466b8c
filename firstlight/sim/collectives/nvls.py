"""NVLink SHARP (NVLS) all-reduce: the reduction happens inside the NVSwitch.

Each GPU reads the switch-reduced sum of its 1/p slice (`multimem.ld_reduce`) and pushes it back with a
multicast store (`multimem.st`) that the switch replicates to all p GPUs. Per GPU the egress is about
n bytes and the ingress about n bytes, and NCCL pipelines the two phases so they use opposite link
directions at once: t = alpha + n/B, i.e. algbw = B and busbw = 2(p-1)/p * B -- against the ring's
2(p-1)/p * n/B. (NVIDIA Hopper architecture whitepaper, "NVLink SHARP"; NCCL 2.17+ `NCCL_ALGO=NVLS`.)

Only a fabric with an in-network-reduction switch can run it: the routed form sends every flow to and
from the switch node `sw`, so a torus or full mesh (no switch) raises CollectiveError.
"""

from __future__ import annotations

from firstlight.sim.collectives.base import Algorithm, CollectiveError, Step, register_algorithm

SWITCH = "sw"


@register_algorithm
class NVLS(Algorithm):
    name = "nvls"
    supports = ("all_reduce",)

    def check(self, collective: str, p: int) -> None:
        super().check(collective, p)
        if p < 2:
            raise CollectiveError(f"nvls needs at least 2 ranks on one switch, got {p}")

    def closed_form(self, collective: str, p: int, nbytes: float, alpha: float, bandwidth: float) -> float:
        self.check(collective, p)
        return alpha + nbytes / bandwidth

    def steps(self, collective: str, p: int, nbytes: float) -> list[Step]:
        self.check(collective, p)
        # one pipelined step: every GPU streams n bytes up to the switch and n reduced bytes back
        return [[(r, SWITCH, nbytes) for r in range(p)] + [(SWITCH, r, nbytes) for r in range(p)]]
