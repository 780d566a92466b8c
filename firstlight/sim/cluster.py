"""A cluster from the command line: scale-up domains joined by a scale-out network, and collectives on it.

`ClusterConfig` says how many scale-up domains (nodes) there are, how devices connect inside one (the
spec's scale-up link and topology unless overridden), and the scale-out network: `fat_tree` (leaf /
spine, `radix` devices per leaf) or `rail_optimized` (local rank r of every node on rail switch r),
the per-device NIC bandwidth and the uplink oversubscription. From it:

- `graph(hw)`: the networkx fabric (`topology.cluster`), devices numbered node-major;
- `collective_time(...)`: an algorithm's steps routed over that graph (contention, hops), the
  time of a collective among ranks placed on given devices; for the cost model it is reduced to
  an alpha + n * beta line by routing twice (routing is linear in bytes once paths are fixed);
- `nccl_fabric(...)`: the same cluster as NCCL's tuner sees it (nodes, per-GPU intra/inter bandwidth).

Errors name the option: a cluster whose ranks have no path between them (`--network none` with more
than one node, or a scale-up topology that leaves devices disconnected) is a CollectiveError.
"""

from __future__ import annotations

from typing import Any

import networkx as nx
from pydantic import BaseModel, ConfigDict, Field

from firstlight.core.hardware import HardwareSpec
from firstlight.sim.collectives import CollectiveError, get_algorithm, route_steps
from firstlight.sim.collectives.nccl import NcclFabric
from firstlight.sim.topology import build_topology, cluster


class ClusterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_nodes: int = Field(default=1, ge=1)  # scale-up domains
    devices_per_node: int | None = Field(default=None, ge=1)  # default: the spec's scale-up domain size
    scale_up: str | None = None  # topology inside a node (default: the spec's scale-up topology)
    network: str = "fat_tree"  # fat_tree | rail_optimized | none (no scale-out: nodes are islands)
    nic_gbps: float | None = Field(default=None, gt=0)  # per device, per direction (default: spec scale_out)
    nic_latency_us: float | None = Field(default=None, ge=0)
    oversubscription: float = Field(default=1.0, ge=1.0)  # leaf uplinks : downlinks
    radix: int = Field(default=32, ge=1)  # fat tree: devices per leaf switch
    num_spines: int = Field(default=4, ge=1)
    sharp: bool = False  # in-network reduction on the scale-out switches (NCCL CollNet)

    def devices(self, hw: HardwareSpec) -> int:
        return self.num_nodes * self.per_node(hw)

    def per_node(self, hw: HardwareSpec) -> int:
        if self.devices_per_node:
            return self.devices_per_node
        up = hw.links.scale_up
        return up.domain_size if up else 1

    def links(self, hw: HardwareSpec) -> tuple[float, float, float, float]:
        """(intra bandwidth B/s, intra latency s, NIC bandwidth B/s, NIC latency s), network efficiency applied."""
        eff = hw.efficiency.network
        up, out = hw.links.scale_up, hw.links.scale_out
        intra_bw = up.bandwidth_bytes_per_s * eff if up else 1e9
        intra_lat = up.latency_s if up else 1e-6
        if self.nic_gbps is not None:
            nic_bw = self.nic_gbps * 1e9 * eff
        elif out is not None:
            nic_bw = out.bandwidth_bytes_per_s * eff
        else:
            nic_bw = 0.0
        nic_lat = self.nic_latency_us * 1e-6 if self.nic_latency_us is not None else (out.latency_s if out else 5e-6)
        return intra_bw, intra_lat, nic_bw, nic_lat

    def graph(self, hw: HardwareSpec) -> nx.DiGraph:
        g_node = self.per_node(hw)
        intra = self.scale_up or (hw.links.scale_up.topology if hw.links.scale_up else "switch")
        intra_bw, intra_lat, nic_bw, nic_lat = self.links(hw)
        if self.num_nodes > 1 and self.network == "none":
            g = nx.DiGraph(name=f"{self.num_nodes} islands of {g_node}")
            for k in range(self.num_nodes):
                local = build_topology(intra, g_node, intra_bw, intra_lat)
                g.update(nx.relabel_nodes(local, {n: (k * g_node + n if isinstance(n, int) else f"n{k}.{n}")
                                                  for n in local.nodes}))
            return g
        if self.num_nodes > 1 and nic_bw <= 0:
            raise CollectiveError(f"--nodes {self.num_nodes}: hardware {hw.name} has no scale_out link; give --nic-gbps")
        kw: dict[str, Any] = {"num_spines": self.num_spines, "oversubscription": self.oversubscription}
        if self.network == "fat_tree":
            kw["radix"] = self.radix
        return cluster(self.num_nodes, g_node, intra, intra_bw, intra_lat, nic_bw, nic_lat, self.network, **kw)

    def nccl_fabric(self, hw: HardwareSpec, ranks: int) -> NcclFabric:
        g_node = self.per_node(hw)
        nodes = max(1, -(-ranks // g_node))
        if ranks % nodes:
            raise CollectiveError(f"--ranks {ranks} do not fill {nodes} nodes of {g_node} devices evenly")
        intra_bw, _, nic_bw, _ = self.links(hw)
        nvls = hw.vendor.lower() == "nvidia" and (hw.links.scale_up is not None and
                                                   hw.links.scale_up.topology == "switch")
        return NcclFabric(ranks, nodes, intra_bw, nic_bw / self.oversubscription if nodes > 1 else intra_bw,
                          nvls=nvls, collnet=self.sharp, ll128=hw.vendor.lower() == "nvidia")


_LINES: dict[tuple, tuple[float, float]] = {}
_GRAPHS: dict[tuple[str, str], nx.DiGraph] = {}


def _line(cfg: ClusterConfig, hw: HardwareSpec, collective: str, algorithm: str, ranks: tuple[int, ...],
          alpha: float) -> tuple[float, float]:
    key = (cfg.model_dump_json(), hw.model_dump_json(), collective, algorithm, ranks, alpha)
    if key in _LINES:
        return _LINES[key]
    gkey = key[:2]
    if gkey not in _GRAPHS:
        _GRAPHS[gkey] = cfg.graph(hw)
    g = _GRAPHS[gkey]
    alg = get_algorithm(algorithm)
    p = len(ranks)
    t0 = route_steps(alg.steps(collective, p, 0.0), g, list(ranks), alpha=alpha).time_s
    t1 = route_steps(alg.steps(collective, p, 1e9), g, list(ranks), alpha=alpha).time_s
    _LINES[key] = (t0, (t1 - t0) / 1e9)
    return _LINES[key]


def collective_time(cfg: ClusterConfig, hw: HardwareSpec, collective: str, nbytes: float, ranks: list[int],
                    algorithm: str = "ring") -> float:
    """Seconds of `collective` among devices `ranks` of the cluster, the algorithm's flows routed on its graph."""
    if len(ranks) <= 1 or nbytes <= 0:
        return 0.0
    n = cfg.devices(hw)
    bad = [r for r in ranks if not 0 <= r < n]
    if bad:
        raise CollectiveError(f"ranks {bad} are not devices of the cluster (0..{n - 1})")
    alpha = hw.efficiency.collective_overhead_us * 1e-6
    a, b = _line(cfg, hw, collective, algorithm, tuple(ranks), alpha)
    return a + b * nbytes
