"""Fabrics as networkx graphs: devices are int nodes 0..p-1, switches are string nodes.

Every builder takes the per-device bandwidth (bytes/s per direction, all ports together) and the
device-to-device latency of one link, and spreads the bandwidth over the device's ports: a ring
gives each of its 2 links half, a 2D torus each of its 4 links a quarter, a full mesh each of its
p-1 links 1/(p-1) (MI300X: 7 x 64 GB/s). Edges are directed (one per direction) and carry
`bandwidth` (bytes/s) and `latency` (s).

Registered by name: `switch`, `full_mesh`, `ring`, `torus2d`, `torus3d`, `fat_tree`; and
`cluster(...)` joins scale-up domains through a scale-out fat tree. Adding one: a function and
`@register_topology("name")`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import networkx as nx

from firstlight.errors import FirstlightError


class TopologyError(FirstlightError):
    """An unknown topology or one that cannot hold the requested devices."""


TopologyBuilder = Callable[..., nx.DiGraph]
TOPOLOGIES: dict[str, TopologyBuilder] = {}


def register_topology(name: str) -> Callable[[TopologyBuilder], TopologyBuilder]:
    def deco(fn: TopologyBuilder) -> TopologyBuilder:
        TOPOLOGIES[name] = fn
        return fn

    return deco


def _link(g: nx.DiGraph, a: Any, b: Any, bandwidth: float, latency: float) -> None:
    g.add_edge(a, b, bandwidth=bandwidth, latency=latency)
    g.add_edge(b, a, bandwidth=bandwidth, latency=latency)


def _devices(g: nx.DiGraph, p: int) -> None:
    if p < 1:
        raise TopologyError(f"topology needs at least 1 device, got {p}")
    g.add_nodes_from(range(p), kind="device")


@register_topology("switch")
def switch(p: int, bandwidth: float, latency: float, **_: Any) -> nx.DiGraph:
    """One non-blocking switch (NVSwitch): device -> switch -> device, latency split over the 2 hops."""
    g = nx.DiGraph(name="switch")
    _devices(g, p)
    g.add_node("sw", kind="switch")
    for d in range(p):
        _link(g, d, "sw", bandwidth, latency / 2)
    return g


@register_topology("full_mesh")
def full_mesh(p: int, bandwidth: float, latency: float, **_: Any) -> nx.DiGraph:
    g = nx.DiGraph(name="full_mesh")
    _devices(g, p)
    per_link = bandwidth / max(p - 1, 1)
    for a, b in itertools.combinations(range(p), 2):
        _link(g, a, b, per_link, latency)
    return g


@register_topology("ring")
def ring(p: int, bandwidth: float, latency: float, **_: Any) -> nx.DiGraph:
    g = nx.DiGraph(name="ring")
    _devices(g, p)
    per_link = bandwidth / 2 if p > 2 else bandwidth
    for d in range(p):
        if p > 1:
            _link(g, d, (d + 1) % p, per_link, latency)
    return g


def _torus_dims(p: int, ndim: int, dims: tuple[int, ...] | None) -> tuple[int, ...]:
    if dims is not None:
        if math.prod(dims) != p or len(dims) != ndim:
            raise TopologyError(f"torus dims {dims} do not multiply to {p} devices in {ndim} dimensions")
        return dims
    # the most cubic factorization
    best: tuple[int, ...] | None = None
    for combo in itertools.product(range(1, p + 1), repeat=ndim - 1):
        rest = p
        ok = True
        for c in combo:
            if rest % c:
                ok = False
                break
            rest //= c
        if not ok:
            continue
        cand = tuple(sorted((*combo, rest)))
        if best is None or max(cand) - min(cand) < max(best) - min(best):
            best = cand
    assert best is not None
    return best


def _torus(p: int, ndim: int, bandwidth: float, latency: float, dims: tuple[int, ...] | None) -> nx.DiGraph:
    shape = _torus_dims(p, ndim, dims)
    g = nx.DiGraph(name=f"torus{ndim}d", dims=shape)
    _devices(g, p)
    per_link = bandwidth / (2 * ndim)
    coords = list(itertools.product(*[range(s) for s in shape]))
    index = {c: i for i, c in enumerate(coords)}
    for c in coords:
        for axis, size in enumerate(shape):
            if size == 1:
                continue
            nb = list(c)
            nb[axis] = (c[axis] + 1) % size
            if not g.has_edge(index[c], index[tuple(nb)]):
                _link(g, index[c], index[tuple(nb)], per_link, latency)
    return g


@register_topology("torus2d")
def torus2d(p: int, bandwidth: float, latency: float, dims: tuple[int, int] | None = None, **_: Any) -> nx.DiGraph:
    return _torus(p, 2, bandwidth, latency, dims)


@register_topology("torus3d")
def torus3d(p: int, bandwidth: float, latency: float, dims: tuple[int, int, int] | None = None,
            **_: Any) -> nx.DiGraph:
    return _torus(p, 3, bandwidth, latency, dims)


@register_topology("fat_tree")
def fat_tree(p: int, bandwidth: float, latency: float, radix: int = 8, num_spines: int = 4,
             oversubscription: float = 1.0, **_: Any) -> nx.DiGraph:
    """Two-level leaf/spine: `radix` devices per leaf, each leaf wired to every spine.

    Leaf-spine links carry radix*bandwidth/num_spines/oversubscription, so 1.0 is non-blocking.
    Latency is per hop: device-leaf-device is 2 hops; crossing the spine is 4.
    """
    g = nx.DiGraph(name="fat_tree")
    _devices(g, p)
    num_leaves = math.ceil(p / radix)
    for d in range(p):
        _link(g, d, f"leaf{d // radix}", bandwidth, latency / 2)
    if num_leaves > 1:
        up = radix * bandwidth / num_spines / oversubscription
        for leaf, spine in itertools.product(range(num_leaves), range(num_spines)):
            _link(g, f"leaf{leaf}", f"spine{spine}", up, latency / 2)
    return g


def build_topology(name: str, p: int, bandwidth: float, latency: float, **kw: Any) -> nx.DiGraph:
    if name not in TOPOLOGIES:
        raise TopologyError(f"unknown topology {name!r}: expected one of {sorted(TOPOLOGIES)}")
    return TOPOLOGIES[name](p, bandwidth, latency, **kw)


@register_topology("rail_optimized")
def rail_optimized(p: int, bandwidth: float, latency: float, devices_per_node: int = 8, num_spines: int = 4,
                   oversubscription: float = 1.0, **_: Any) -> nx.DiGraph:
    """Rail-optimized scale-out (NVIDIA DGX SuperPOD reference architecture): the NIC of local rank r of
    every node plugs into rail switch r, so same-rank traffic between nodes crosses one switch; other
    pairs go rail -> spine -> rail. Rail-spine links carry (nodes x bandwidth) / num_spines / oversubscription."""
    g = nx.DiGraph(name="rail_optimized")
    _devices(g, p)
    num_nodes = math.ceil(p / devices_per_node)
    for d in range(p):
        _link(g, d, f"rail{d % devices_per_node}", bandwidth, latency / 2)
    if devices_per_node > 1:
        up = num_nodes * bandwidth / num_spines / oversubscription
        for r, spine in itertools.product(range(min(devices_per_node, p)), range(num_spines)):
            _link(g, f"rail{r}", f"spine{spine}", up, latency / 2)
    return g


def cluster(num_nodes: int, devices_per_node: int, intra: str, intra_bandwidth: float, intra_latency: float,
            inter_bandwidth: float, inter_latency: float, network: str = "fat_tree", **net_kw: Any) -> nx.DiGraph:
    """Scale-up domains of `devices_per_node` (any registered topology) joined by a scale-out network
    (`fat_tree` or `rail_optimized`).

    Device d of node k is node id k*devices_per_node + d. Each device has its own NIC into the
    scale-out network, so inter-node traffic leaves through the NIC, not the scale-up links.
    """
    if network not in ("fat_tree", "rail_optimized"):
        raise TopologyError(f"--network {network!r}: expected fat_tree or rail_optimized")
    p = num_nodes * devices_per_node
    g = nx.DiGraph(name=f"cluster({num_nodes}x{devices_per_node} {intra})")
    _devices(g, p)
    for k in range(num_nodes):
        local = build_topology(intra, devices_per_node, intra_bandwidth, intra_latency)
        mapping = {n: (k * devices_per_node + n if isinstance(n, int) else f"n{k}.{n}") for n in local.nodes}
        g.update(nx.relabel_nodes(local, mapping))
    if num_nodes == 1:
        g.graph["devices_per_node"] = devices_per_node
        return g
    if network == "rail_optimized":
        net = rail_optimized(p, inter_bandwidth, inter_latency, devices_per_node=devices_per_node, **net_kw)
    else:
        net = fat_tree(p, inter_bandwidth, inter_latency, **net_kw)
    # keep NIC traffic off the scale-up graph: the fat tree's switches get their own names
    g.update(nx.relabel_nodes(net, {n: (n if isinstance(n, int) else f"net.{n}") for n in net.nodes}))
    g.graph["devices_per_node"] = devices_per_node
    return g


def device_nodes(g: nx.DiGraph) -> list[int]:
    return sorted(n for n, d in g.nodes(data=True) if d.get("kind") == "device")
