"""Collective algorithms (one registered class per module) and their pricing on fabrics."""

from firstlight.sim.collectives import (  # noqa: F401  (register)
    halving_doubling,
    hierarchical,
    nvls,
    one_shot,
    pairwise,
    ring,
    tree,
)
from firstlight.sim.collectives.base import (
    ALGORITHMS,
    COLLECTIVES,
    Algorithm,
    CollectiveError,
    bus_bandwidth_factor,
    get_algorithm,
    register_algorithm,
)
from firstlight.sim.collectives.fabric import RoutedResult, collective_time, route_steps

__all__ = [
    "ALGORITHMS",
    "COLLECTIVES",
    "Algorithm",
    "CollectiveError",
    "RoutedResult",
    "bus_bandwidth_factor",
    "collective_time",
    "get_algorithm",
    "register_algorithm",
    "route_steps",
]
