"""A spec's `system` section as a fabric graph, and the link tensor parallelism really runs on.

A box or rack (`HardwareSpec.system`) lists link classes between its chips: NVLink into a switch,
Infinity Fabric or Gaudi RoCE as a full mesh, ICI as a torus, Tenstorrent Ethernet as a mesh of
explicit chip pairs. `system_graph` turns them into the networkx graph `collectives.route_steps`
prices flows on (devices are int nodes, switches string nodes; edges carry bytes/s and seconds per
direction). Two classes that join the same pair add their bandwidth (parallel links).

`tp_link(spec, tp)` answers the question the cost model asks for every TP collective: what alpha and
bandwidth does a collective over the first `tp` chips see? One ring step (every rank sends to the next)
and one direct step (every rank sends to every other) are routed on the graph at two message sizes;
step time is linear in the size, so the intercept is the path latency (alpha) and the slope gives the
bytes per second a rank injects. The better pattern wins: a ring on a switch or a ring of links, the
direct pattern on a full mesh (where a rank drives all its peer links at once). A TP group that spans a slow
inter-card link is priced on that link: T3K's 8-chip ring crosses 100 GbE Ethernet, an HGX board's
crosses NVLink, one n300's 2-chip ring its on-card Ethernet.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import networkx as nx

from firstlight.core.hardware import HardwareSpec, SystemLinkSpec, SystemSpec
from firstlight.errors import FirstlightError


class SystemTopologyError(FirstlightError):
    """A system whose chips cannot reach each other, or a TP group larger than the system."""


@dataclass(frozen=True)
class TPLink:
    alpha_s: float  # path latency of one ring step (no software overhead)
    bandwidth: float  # bytes/s one rank's ring flow gets (bottleneck share, per direction)
    via: str  # the link classes the ring crosses, slowest first


def _add(g: nx.DiGraph, a: object, b: object, bw: float, lat: float, name: str) -> None:
    for u, v in ((a, b), (b, a)):
        if g.has_edge(u, v):
            e = g.edges[u, v]
            e["bandwidth"] += bw
            e["latency"] = min(e["latency"], lat)
            e["names"].add(name)
        else:
            g.add_edge(u, v, bandwidth=bw, latency=lat, names={name})


def _grid_coords(dims: list[int]) -> list[tuple[int, ...]]:
    """Chip order on a 2D grid: a boustrophedon (snake) so consecutive ids are neighbours."""
    if len(dims) == 2:
        rows, cols = dims
        return [(r, c if r % 2 == 0 else cols - 1 - c) for r in range(rows) for c in range(cols)]
    return list(itertools.product(*[range(d) for d in dims]))


def _pattern_edges(lk: SystemLinkSpec, n: int) -> list[tuple[int, int] | tuple[int, str]]:
    g = lk.group_size or n
    out: list = []
    for base in range(0, n, g):
        ids = list(range(base, base + g))
        p = lk.pattern
        if p == "switch":
            out += [(i, f"sw:{lk.name}:{base // g}") for i in ids]
        elif p == "full_mesh":
            out += list(itertools.combinations(ids, 2))
        elif p in ("ring", "line"):
            out += [(ids[i], ids[i + 1]) for i in range(g - 1)]
            if p == "ring" and g > 2:
                out.append((ids[-1], ids[0]))
        else:  # mesh2d / torus2d / torus3d
            ndim = 3 if p == "torus3d" else 2
            dims = lk.dims or _square_dims(g, ndim)
            coords = _grid_coords(dims)
            index = {c: ids[i] for i, c in enumerate(coords)}
            wrap = p != "mesh2d"
            for c in coords:
                for axis, size in enumerate(dims):
                    if size == 1 or (not wrap and c[axis] == size - 1):
                        continue
                    nb = list(c)
                    nb[axis] = (c[axis] + 1) % size
                    pair = (index[c], index[tuple(nb)])
                    if size == 2 and wrap and c[axis] == 1:
                        continue  # a 2-long ring is one link, not two
                    out.append(pair)
    return out


def _square_dims(g: int, ndim: int) -> list[int]:
    best: list[int] | None = None
    for combo in itertools.product(range(1, g + 1), repeat=ndim):
        if combo[0] * (combo[1] if ndim > 1 else 1) * (combo[2] if ndim > 2 else 1) != g:
            continue
        cand = sorted(combo)
        if best is None or cand[-1] - cand[0] < best[-1] - best[0]:
            best = cand
    assert best is not None
    return best


def system_graph(system: SystemSpec) -> nx.DiGraph:
    """The system's chips and link classes as a directed graph (bandwidth in bytes/s per direction)."""
    g = nx.DiGraph(name=system.name)
    g.add_nodes_from(range(system.num_chips), kind="device")
    for lk in system.links:
        bw, lat = lk.bandwidth_gbps * 1e9, lk.latency_us * 1e-6
        pairs = lk.edges if lk.edges is not None else _pattern_edges(lk, system.num_chips)
        for a, b in pairs:
            if isinstance(b, str):
                g.add_node(b, kind="switch")
                _add(g, a, b, bw, lat / 2, lk.name)
            else:
                _add(g, a, b, bw, lat, lk.name)
    if system.num_chips > 1 and not nx.is_weakly_connected(g):
        parts = [sorted(x for x in c if isinstance(x, int)) for c in nx.weakly_connected_components(g)]
        raise SystemTopologyError(f"system {system.name!r}: chips are not all connected; groups {parts}. "
                           "Add a link class that joins them")
    return g


def tp_link(spec: HardwareSpec, tp: int) -> TPLink | None:
    """Alpha and bandwidth of a ring over chips 0..tp-1 of the spec's system; None without a system
    or when the group is larger than the system (then it leaves through the scale-out NICs)."""
    system = spec.system
    if system is None or tp <= 1 or tp > system.num_chips:
        return None
    from firstlight.sim.collectives import route_steps

    g = system_graph(system)
    ranks = list(range(tp))

    def step(nbytes: float) -> float:
        flows = [(i, (i + 1) % tp, nbytes) for i in range(tp)] if tp > 2 else [(0, 1, nbytes), (1, 0, nbytes)]
        return route_steps([flows], g, ranks).time_s

    def direct(nbytes: float) -> float:  # every rank sends to every other at once (one-shot / pairwise RS)
        flows = [(i, j, nbytes) for i in range(tp) for j in range(tp) if i != j]
        return route_steps([flows], g, ranks).time_s

    small, big = 1.0, 1e9
    t_small, t_big = step(small), step(big)
    bw = (big - small) / (t_big - t_small)
    alpha = max(t_small - small / bw, 0.0)
    # On a full mesh (Infinity Fabric, Gaudi RoCE) a rank reaches all peers at once, so collectives see the
    # sum of its links (RCCL/HCCL direct algorithms); on a switch or a ring the two patterns tie. Take the
    # pattern that moves more bytes per rank per second.
    d_small, d_big = direct(small), direct(big)
    bw_direct = (tp - 1) * (big - small) / (d_big - d_small)
    if bw_direct > bw * (1 + 1e-9):
        bw, alpha = bw_direct, max(d_small - (tp - 1) * small / bw_direct, 0.0)
    used: dict[str, float] = {}
    for i in range(tp):
        path = nx.shortest_path(g, ranks[i], ranks[(i + 1) % tp], weight="latency")
        for u, v in zip(path, path[1:], strict=False):
            for name in g.edges[u, v]["names"]:
                used[name] = g.edges[u, v]["bandwidth"]
    via = ", ".join(sorted(used, key=used.__getitem__))
    return TPLink(alpha, bw, via)
