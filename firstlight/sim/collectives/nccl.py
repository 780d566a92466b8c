"""NCCL's own cost model: latency + bandwidth per (algorithm, protocol), and its tuner's choice.

Transcribed in form (not code) from NCCL `src/graph/tuning.cc` (`ncclTopoTuneModel`,
`ncclTopoGetAlgoTime`; NVIDIA/nccl 2.18-2.19, the version with NVLS and CollNet Direct/Chain):

    time(algo, proto, n) = latency(algo, proto) + n / algbw(algo, proto)

- **Protocols.** `Simple` moves data in large chunks with a flag per chunk (full bandwidth, the
  highest latency); `LL` (low latency) packs 4 bytes of data with a 4-byte flag into 8-byte stores
  (1/4 of the bus bandwidth for all-reduce, 1/3 otherwise, tiny latency); `LL128` packs 120 bytes of
  data with an 8-byte flag per 128-byte line (0.92 of the bandwidth, low latency; enabled by NCCL only
  on NVLink-connected Volta/Ampere/Hopper).
- **Algorithms.** `ring` (2(p-1) steps for all-reduce, algbw = busbw * p / (2(p-1))), `tree` (double
  binary tree: log-depth latency, algbw = busbw / 2 capped at 0.9 of the link), `collnet_direct` /
  `collnet_chain` (in-network reduction on SHARP InfiniBand switches, 0.9 of the link), `nvls` (NVLink
  SHARP: the NVSwitch reduces; one hop of 25 us base latency; algbw = the link, see `nvls.py`).
- **Latency.** baseLat[algo][proto] + per-hop hwLat[link][algo][proto] times the steps on each link
  class (NVLink inside a node, NET between nodes); tree: 2 (local depth x intra + log2(nodes) x inter).
- **Tree correction.** NCCL scales tree bandwidth by a measured factor per power-of-two size (64 B to
  128 MB) because its trees underperform the model at medium sizes; kept here.
- **Choice.** NCCL times every enabled (algo, proto) and takes the fastest: `choose()`.

`link_bw` is the achievable per-GPU bus bandwidth of the link class (the spec's bandwidth times its
network efficiency: NCCL's nChannels x per-channel speed). Across nodes the slower of the two link
classes bounds the bus (per GPU: its NIC's share, oversubscription included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from firstlight.sim.collectives.base import CollectiveError

PROTOCOLS = ("LL", "LL128", "Simple")
ALGORITHMS = ("tree", "ring", "collnet_direct", "collnet_chain", "nvls")

# microseconds; tuning.cc baseLat (Tree, Ring, CollNetDirect, CollNetChain, NVLS) x (LL, LL128, Simple)
BASE_LAT_US = {"tree": (6.8, 14.0, 8.4), "ring": (6.6, 14.0, 8.4), "collnet_direct": (0.0, 0.0, 0.0),
               "collnet_chain": (0.0, 0.0, 0.0), "nvls": (0.0, 0.0, 23.0)}
# per-hop latency, microseconds: hwLat[NVLINK] and hwLat[NET]
HW_LAT_US = {
    "nvlink": {"tree": (0.6, 1.25, 4.0), "ring": (0.6, 1.9, 3.4), "collnet_direct": (0.0, 0.0, 3.7),
               "collnet_chain": (0.0, 0.0, 2.8), "nvls": (0.0, 0.0, 25.0)},
    "net": {"tree": (5.0, 8.5, 14.0), "ring": (2.7, 4.0, 14.0), "collnet_direct": (0.0, 0.0, 10.7),
            "collnet_chain": (0.0, 0.0, 10.7), "nvls": (0.0, 0.0, 0.0)},
}
# treeCorrectionFactor[proto][log2(bytes / 64)], 64 B .. 128 MB
TREE_CORRECTION = {
    "LL": (1.0, 1.0, 1.0, 1.0, .9, .8, .7, .7, .7, .7, .6, .5, .4, .4, .5, .6, .7, .8, .9, 1.0, 1.0, 1.0),
    "LL128": (1.0, 1.0, 1.0, 1.0, 1.0, .9, .8, .8, .8, .7, .6, .6, .6, .5, .6, .6, .7, .7, .8, .9, .9, 1.0),
    "Simple": (.9, .9, .9, .9, .9, .9, .9, .8, .7, .6, .6, .5, .5, .5, .5, .5, .5, .6, .6, .7, .8, .9),
}


@dataclass(frozen=True)
class NcclFabric:
    """What NCCL's tuner sees: ranks, nodes, per-GPU bandwidth inside / between nodes, what the switches do."""

    num_ranks: int
    num_nodes: int = 1
    intra_bw: float = 370e9  # bytes/s per GPU, achievable (link x network efficiency)
    inter_bw: float = 50e9  # bytes/s per GPU through its NIC (share of oversubscribed uplinks included)
    nvls: bool = False  # NVSwitch with NVLink SHARP (Hopper / Blackwell HGX)
    collnet: bool = False  # SHARP in-network reduction on the scale-out switches
    ll128: bool = True  # NVLink-connected NVIDIA GPUs

    def __post_init__(self) -> None:
        if self.num_ranks < 1 or self.num_nodes < 1 or self.num_ranks % self.num_nodes:
            raise CollectiveError(f"NCCL fabric: {self.num_ranks} ranks do not split evenly over {self.num_nodes} nodes")


def _nsteps(collective: str, n: int) -> int:
    return 2 * (n - 1) if collective == "all_reduce" else n - 1


def latency_us(collective: str, algo: str, proto: str, fab: NcclFabric) -> float:
    i = PROTOCOLS.index(proto)
    p, nodes = fab.num_ranks, fab.num_nodes
    lat = BASE_LAT_US[algo][i]
    intra = HW_LAT_US["nvlink"][algo][i] * (1.8 if nodes > 1 and proto == "LL" else 1.0)
    inter = HW_LAT_US["net"][algo][i]
    if algo == "ring":
        steps, inter_steps = _nsteps(collective, p), _nsteps(collective, nodes)
        return lat + (steps - inter_steps) * intra + inter_steps * inter
    if algo == "tree":
        return lat + 2 * ((p // nodes - 1) * intra + math.log2(nodes) * inter)
    if algo == "nvls":
        return lat + intra
    return lat + 2 * (p // nodes - 1) * intra + inter  # collnet


def algbw(collective: str, algo: str, proto: str, fab: NcclFabric) -> float:
    """Algorithm bandwidth in bytes/s (0 where NCCL does not run the pair)."""
    p, nodes = fab.num_ranks, fab.num_nodes
    bus = fab.intra_bw if nodes == 1 else min(fab.intra_bw, fab.inter_bw)
    if algo == "ring":
        if proto == "LL":
            bus *= 1 / 4 if (nodes > 1 or collective == "all_reduce") else 1 / 3
        elif proto == "LL128":
            bus *= 0.92
        return bus * p / _nsteps(collective, p)
    if algo == "tree":
        bus *= 0.9
        bus *= {"LL": 1 / 3.8, "LL128": 7 / 9 if nodes == 1 else 0.915, "Simple": 1.0}[proto]
        return bus * 0.5
    if algo.startswith("collnet"):
        if proto == "LL128":
            return 0.0
        return bus * 0.9 * (1 / 6 if proto == "LL" else 1.0) * 0.5
    if algo == "nvls":  # NVLink SHARP: each GPU sends and receives n bytes once (nvls.py)
        return fab.intra_bw if proto == "Simple" else 0.0
    raise CollectiveError(f"unknown NCCL algorithm {algo!r}: expected one of {ALGORITHMS}")


def enabled(collective: str, algo: str, proto: str, fab: NcclFabric) -> bool:
    if fab.num_ranks < 2:
        return False
    if collective != "all_reduce" and algo != "ring":
        return False  # NCCL 2.18: only all-reduce has a choice of algorithm
    if algo == "nvls" and not (fab.nvls and fab.num_nodes == 1):
        return False
    if algo.startswith("collnet") and not (fab.collnet and fab.num_nodes > 1):
        return False
    if proto == "LL128" and not fab.ll128:
        return False
    return algbw(collective, algo, proto, fab) > 0


def time_s(collective: str, nbytes: float, algo: str, proto: str, fab: NcclFabric) -> float:
    """NCCL's predicted time of one collective of `nbytes` (nccl-tests size convention)."""
    if collective not in ("all_reduce", "all_gather", "reduce_scatter"):
        raise CollectiveError(f"NCCL model covers all_reduce, all_gather, reduce_scatter, not {collective!r}")
    if not enabled(collective, algo, proto, fab):
        raise CollectiveError(f"NCCL does not run {collective} with {algo}/{proto} on this fabric")
    bw = algbw(collective, algo, proto, fab)
    lat = latency_us(collective, algo, proto, fab)
    if algo == "tree":
        log_size = int(math.log2(max(nbytes, 64) / 64))
        if log_size < len(TREE_CORRECTION[proto]):
            bw *= TREE_CORRECTION[proto][log_size]
    if (algo == "ring" and proto == "Simple" and fab.num_nodes > 1 and collective == "all_reduce"
            and nbytes >= fab.num_ranks / 16.0 * 65536):
        lat *= 1.9  # "plateau effect of ring" (tuning.cc)
    return lat * 1e-6 + nbytes / bw


def choose(collective: str, nbytes: float, fab: NcclFabric) -> tuple[str, str, float]:
    """(algorithm, protocol, seconds) NCCL's tuner picks: the fastest enabled pair."""
    best: tuple[str, str, float] | None = None
    for algo in ALGORITHMS:
        for proto in PROTOCOLS:
            if not enabled(collective, algo, proto, fab):
                continue
            t = time_s(collective, nbytes, algo, proto, fab)
            if best is None or t < best[2]:
                best = (algo, proto, t)
    if best is None:
        raise CollectiveError(f"no NCCL algorithm runs {collective} on {fab.num_ranks} ranks")
    return best


def busbw_table(collective: str, fab: NcclFabric, sizes: list[float]) -> list[dict[str, object]]:
    """nccl-tests busbw (GB/s) per size for every enabled (algo, proto), and the tuner's pick."""
    from firstlight.sim.collectives.base import bus_bandwidth_factor

    f = bus_bandwidth_factor(collective, fab.num_ranks)
    rows: list[dict[str, object]] = []
    for n in sizes:
        row: dict[str, object] = {"bytes": n}
        for algo in ALGORITHMS:
            for proto in PROTOCOLS:
                if enabled(collective, algo, proto, fab):
                    row[f"{algo}/{proto}"] = n / time_s(collective, n, algo, proto, fab) * f / 1e9
        a, p, t = choose(collective, n, fab)
        row["nccl_choice"] = f"{a}/{p}"
        row["nccl_busbw_gbps"] = n / t * f / 1e9
        rows.append(row)
    return rows
