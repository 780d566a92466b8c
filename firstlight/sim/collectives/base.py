"""Collective algorithms as (a) alpha-beta closed forms and (b) steps of point-to-point flows.

Sizes follow nccl-tests: `nbytes` is the all-reduce buffer, the all-gather *output*, the
reduce-scatter *input* and the all-to-all send buffer of one rank. A step is a list of flows
`(src_rank, dst_rank, bytes)` that run at once; `route()` in `fabric.py` prices a step on a graph,
so contention (flows sharing a link) and hop counts show up.

Each algorithm is one class in its own module, registered by name with `@register_algorithm`.
Closed forms: Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations
in MPICH" (IJHPCA 2005); Patarasuk & Yuan, "Bandwidth optimal all-reduce algorithms" (2009).
"""

from __future__ import annotations

from typing import ClassVar

from firstlight.errors import FirstlightError

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")

Flow = tuple[int | str, int | str, float]  # a str endpoint is a graph node by name (a switch)
Step = list[Flow]


class CollectiveError(FirstlightError):
    """An unknown collective/algorithm or one that cannot run on this many ranks."""


class Algorithm:
    """One collective algorithm. Subclasses set `name`, `supports` and implement both views."""

    name: ClassVar[str] = ""
    supports: ClassVar[tuple[str, ...]] = ()

    def check(self, collective: str, p: int) -> None:
        if collective not in COLLECTIVES:
            raise CollectiveError(f"unknown collective {collective!r}: expected one of {list(COLLECTIVES)}")
        if collective not in self.supports:
            raise CollectiveError(
                f"algorithm {self.name!r} does not implement {collective}; it implements {list(self.supports)}"
            )
        if p < 1:
            raise CollectiveError(f"collective needs at least 1 rank, got {p}")

    def closed_form(self, collective: str, p: int, nbytes: float, alpha: float, bandwidth: float) -> float:
        """Time in seconds on an ideal fabric: every rank sends and receives at `bandwidth` at once."""
        raise NotImplementedError

    def steps(self, collective: str, p: int, nbytes: float) -> list[Step]:
        raise NotImplementedError


ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    ALGORITHMS[cls.name] = cls()
    return cls


def get_algorithm(name: str) -> Algorithm:
    if name not in ALGORITHMS:
        raise CollectiveError(f"unknown collective algorithm {name!r}: expected one of {sorted(ALGORITHMS)}")
    return ALGORITHMS[name]


def bus_bandwidth_factor(collective: str, p: int) -> float:
    """nccl-tests busbw = algbw * factor (nccl-tests doc/PERFORMANCE.md)."""
    if p <= 1:
        return 1.0
    return 2 * (p - 1) / p if collective == "all_reduce" else (p - 1) / p
