"""NCCL's latency/bandwidth model and tuner; two-tier clusters from the CLI; TP/EP priced over them."""

import json

import pytest
from typer.testing import CliRunner

from firstlight.core.hardware import load_spec
from firstlight.errors import FirstlightError
from firstlight.sim.cli import app
from firstlight.sim.cluster import ClusterConfig, collective_time
from firstlight.sim.collectives import CollectiveError
from firstlight.sim.collectives.nccl import NcclFabric, algbw, choose, latency_us, time_s

runner = CliRunner()


def test_protocol_and_algorithm_terms_follow_tuning_cc():
    fab = NcclFabric(8, 1, 360e9, 360e9, nvls=False)
    # ring all-reduce: 2(p-1) NVLink hops on top of the base latency, per protocol
    assert latency_us("all_reduce", "ring", "LL", fab) == pytest.approx(6.6 + 14 * 0.6)
    assert latency_us("all_reduce", "ring", "Simple", fab) == pytest.approx(8.4 + 14 * 3.4)
    # busbw -> algbw: ring p/(2(p-1)); LL carries 1/4, LL128 0.92 of the link
    assert algbw("all_reduce", "ring", "Simple", fab) == pytest.approx(360e9 * 8 / 14)
    assert algbw("all_reduce", "ring", "LL", fab) == pytest.approx(360e9 / 4 * 8 / 14)
    assert algbw("all_reduce", "ring", "LL128", fab) == pytest.approx(360e9 * 0.92 * 8 / 14)
    # large messages: ring/Simple busbw tends to the link's achievable bandwidth
    n = 8 * 2**30
    t = time_s("all_reduce", n, "ring", "Simple", fab)
    assert n / t * 14 / 8 == pytest.approx(360e9, rel=0.01)


def test_tuner_moves_from_ll_to_simple_as_messages_grow():
    fab = NcclFabric(8, 1, 360e9, 360e9, nvls=False)
    picks = [choose("all_reduce", n, fab)[:2] for n in (8e3, 4e6, 8e9)]
    assert picks[0][1] == "LL" and picks[-1] == ("ring", "Simple")
    assert len({p for _, p in picks}) == 3  # LL, then LL128, then Simple
    # on an NVSwitch with NVLink SHARP, large all-reduces go to NVLS; other collectives stay on the ring
    nv = NcclFabric(8, 1, 360e9, 360e9, nvls=True)
    assert choose("all_reduce", 1e9, nv)[0] == "nvls" and choose("all_gather", 1e9, nv)[0] == "ring"
    # across 16 nodes the tree's log-depth latency wins small messages; CollNet needs SHARP switches
    multi = NcclFabric(128, 16, 360e9, 40e9)
    assert choose("all_reduce", 64e3, multi)[0] == "tree"
    with pytest.raises(CollectiveError, match="does not run"):
        time_s("all_reduce", 1e6, "collnet_direct", "Simple", multi)
    sharp = NcclFabric(128, 16, 360e9, 40e9, collnet=True)
    assert time_s("all_reduce", 1e9, "collnet_direct", "Simple", sharp) > 0


def test_two_tier_cluster_prices_cross_node_traffic_on_the_nic():
    hw = load_spec("h100")
    cl = ClusterConfig(num_nodes=2, nic_gbps=50)
    intra = collective_time(cl, hw, "all_reduce", 256e6, list(range(8)))
    inter = collective_time(cl, hw, "all_reduce", 256e6, list(range(4, 12)))  # 4 + 4 across the NICs
    assert inter > 3 * intra
    # oversubscribed leaf uplinks slow a fat tree's cross-leaf traffic; rails keep same-rank pairs on one switch
    wide = ClusterConfig(num_nodes=8, nic_gbps=50, radix=16)
    over = wide.model_copy(update={"oversubscription": 8.0})  # uplinks 16 x 40 / 4 / 8 < one NIC
    ranks = [0, 8, 16, 24, 32, 40, 48, 56]  # local rank 0 of every node
    assert collective_time(over, hw, "all_reduce", 1e9, ranks) > collective_time(wide, hw, "all_reduce", 1e9, ranks)
    rail = wide.model_copy(update={"network": "rail_optimized"})
    assert collective_time(rail, hw, "all_reduce", 1e9, ranks) <= collective_time(wide, hw, "all_reduce", 1e9, ranks)
    # nodes without a scale-out network: no path between ranks of different nodes, a clear error
    islands = ClusterConfig(num_nodes=2, network="none")
    with pytest.raises(CollectiveError, match="no path"):
        collective_time(islands, hw, "all_reduce", 1e6, [0, 8])


def test_cli_collective_table_and_cluster_options():
    r = runner.invoke(app, ["collective", "--hw", "h100", "--table"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.output)["busbw_gbps"]
    assert rows[0]["bytes"] == 8 * 1024 and rows[-1]["bytes"] == 8 * 2**30
    assert rows[0]["nccl_choice"] == "ring/LL" and rows[-1]["nccl_choice"] == "nvls/Simple"
    r = runner.invoke(app, ["collective", "--hw", "h100", "--nodes", "2", "--size", "64MB", "--network",
                            "rail_optimized"])
    out = json.loads(r.output)
    assert r.exit_code == 0 and out["ranks"] == 16 and out["nccl"]["algorithm"] in ("ring", "tree")
    r = runner.invoke(app, ["collective", "--hw", "h100", "--nodes", "2", "--network", "none"])
    assert r.exit_code != 0 and "no path" in str(r.exception)
    r = runner.invoke(app, ["collective", "--hw", "h100", "--nodes", "2", "--network", "torus"])
    assert r.exit_code != 0 and "--network" in str(r.exception)


def test_serve_on_a_cluster_and_ep_across_replicas():
    args = ["serve", "--hw", "h100", "--model", "mixtral-8x7b", "--tp", "2", "--replicas", "4", "--rate", "2",
            "--num-requests", "20", "--prompt-len", "256", "--output-len", "16"]
    base = runner.invoke(app, args)
    assert base.exit_code == 0, base.output
    # EP 8 spans the 4 replicas (--ep > --tp); on 1 node over NVLink, then on 4 nodes of 2 over the NICs
    one = runner.invoke(app, args + ["--ep", "8", "--nodes", "1"])
    assert one.exit_code == 0, one.output
    four = runner.invoke(app, args + ["--ep", "8", "--nodes", "4", "--devices-per-node", "2"])
    assert four.exit_code == 0, four.output
    assert json.loads(four.stdout)["tpot_s"]["p50"] > json.loads(one.stdout)["tpot_s"]["p50"]  # stderr: the profile
    bad = runner.invoke(app, args + ["--ep", "3"])
    assert bad.exit_code != 0 and isinstance(bad.exception, FirstlightError) and "--ep 3" in str(bad.exception)
    args3 = [a if a != "4" else "3" for a in args]  # 3 replicas x tp 2 = 6 devices: EP 4 cannot split them
    bad = runner.invoke(app, args3 + ["--ep", "4"])
    assert bad.exit_code != 0 and "--ep 4 does not divide the 6 devices" in str(bad.exception)
    small = runner.invoke(app, args + ["--nodes", "1", "--devices-per-node", "4"])
    assert small.exit_code != 0 and "--nodes" in str(small.exception)
