"""Price an algorithm's steps on a fabric graph: route each flow, share links, count hops.

Per step, each flow takes the lowest-latency path (ties: fewest hops); flows that cross the same
directed link share its bandwidth equally, so a flow's time is the sum of its path latencies plus
its bytes over the slowest share on its path; the step ends with its slowest flow. This is the
usual bottleneck approximation of max-min fair sharing (cf. ASTRA-sim's analytical network backend).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import networkx as nx

from firstlight.sim.collectives.base import (
    ALGORITHMS,
    CollectiveError,
    Step,
    bus_bandwidth_factor,
    get_algorithm,
)


@dataclass
class RoutedResult:
    time_s: float
    num_steps: int
    max_hops: int
    max_link_flows: int  # the most flows that shared one link in one step (1 = no contention)
    step_times_s: list[float] = field(default_factory=list)


class _Router:
    """Equal-cost multipath: up to `max_paths` lowest-latency paths per pair; each flow takes the
    candidate whose busiest link is least loaded so far in its step (adaptive routing)."""

    max_paths = 8

    def __init__(self, graph: nx.DiGraph) -> None:
        self.graph = graph
        self._paths: dict[tuple[Any, Any], list[list[tuple[Any, Any]]]] = {}

    def candidates(self, a: Any, b: Any) -> list[list[tuple[Any, Any]]]:
        key = (a, b)
        if key not in self._paths:
            try:
                gen = nx.all_shortest_paths(self.graph, a, b, weight=lambda u, v, d: d["latency"] + 1e-12)
                paths = list(itertools.islice(gen, self.max_paths))
            except (nx.NetworkXNoPath, nx.NodeNotFound) as e:
                raise CollectiveError(f"fabric {self.graph.name!r} has no path from device {a} to {b}") from e
            self._paths[key] = [list(zip(p, p[1:], strict=False)) for p in paths]
        return self._paths[key]

    def pick(self, a: Any, b: Any, load: dict[tuple[Any, Any], int]) -> list[tuple[Any, Any]]:
        cands = self.candidates(a, b)
        if len(cands) == 1:
            return cands[0]
        return min(cands, key=lambda es: max(load[e] for e in es))


def route_steps(steps: list[Step], graph: nx.DiGraph, ranks: list[Any] | None = None,
                alpha: float = 0.0, bandwidth_scale: float = 1.0) -> RoutedResult:
    """Time of `steps` on `graph`; rank i runs on node `ranks[i]` (default: node i)."""
    router = _Router(graph)
    total = 0.0
    max_hops = 0
    max_share = 0
    times: list[float] = []
    for step in steps:
        load: dict[tuple[Any, Any], int] = defaultdict(int)
        paths = []
        for src, dst, nbytes in step:
            # an int is a rank; any other endpoint (nvls's switch "sw") is a graph node by name
            a = ranks[src] if ranks and isinstance(src, int) else src
            b = ranks[dst] if ranks and isinstance(dst, int) else dst
            if a == b:
                continue
            edges = router.pick(a, b, load)
            paths.append((edges, nbytes))
            for e in edges:
                load[e] += 1
        step_time = 0.0
        for edges, nbytes in paths:
            lat = sum(graph.edges[e]["latency"] for e in edges)
            slowest = max(load[e] / (graph.edges[e]["bandwidth"] * bandwidth_scale) for e in edges)
            step_time = max(step_time, lat + nbytes * slowest)
            max_hops = max(max_hops, len(edges))
        max_share = max([max_share, *load.values()])
        step_time += alpha if paths else 0.0
        times.append(step_time)
        total += step_time
    return RoutedResult(total, len(steps), max_hops, max_share, times)


def collective_time(collective: str, nbytes: float, p: int, alpha: float, bandwidth: float,
                    algorithm: str = "ring", graph: nx.DiGraph | None = None, ranks: list[Any] | None = None,
                    ) -> float:
    """Closed form when `graph` is None; else the algorithm's steps routed over `graph`.

    `algorithm="auto"` takes the fastest registered algorithm that implements the collective for p
    ranks (as NCCL's tuner picks between ring, tree and LL protocols by size).
    """
    if p <= 1 or nbytes <= 0:
        return 0.0
    if algorithm == "nccl":  # NCCL's own latency/bandwidth model and tuner, one node of p ranks (nccl.py)
        from firstlight.sim.collectives.nccl import NcclFabric, choose

        return choose(collective, nbytes, NcclFabric(p, 1, bandwidth, bandwidth, ll128=True))[2]
    if algorithm == "auto":
        best = float("inf")
        for name, alg in ALGORITHMS.items():
            if collective not in alg.supports or name in ("hierarchical", "nvls"):  # need a layout / a SHARP switch
                continue
            try:
                best = min(best, collective_time(collective, nbytes, p, alpha, bandwidth, name, graph, ranks))
            except CollectiveError:
                continue
        return best
    alg = get_algorithm(algorithm)
    if graph is None:
        return alg.closed_form(collective, p, nbytes, alpha, bandwidth)
    return route_steps(alg.steps(collective, p, nbytes), graph, ranks, alpha=alpha).time_s


def bus_bandwidth(collective: str, nbytes: float, p: int, time_s: float) -> float:
    """nccl-tests busbw in bytes/s: algbw (nbytes / time) times the collective's factor."""
    return nbytes / time_s * bus_bandwidth_factor(collective, p) if time_s > 0 else float("inf")
