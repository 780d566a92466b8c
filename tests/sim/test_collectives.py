import pytest

from firstlight.sim.collectives import CollectiveError, collective_time, get_algorithm, route_steps
from firstlight.sim.topology import TopologyError, build_topology, cluster

N, B, A = 256e6, 100e9, 3e-6


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_ring_all_reduce_closed_form(p):
    t = collective_time("all_reduce", N, p, A, B, "ring")
    assert t == pytest.approx(2 * (p - 1) / p * N / B + 2 * (p - 1) * A)
    assert collective_time("all_gather", N, p, A, B, "ring") == pytest.approx(t / 2)


@pytest.mark.parametrize("topology", ["switch", "full_mesh"])
def test_ring_routed_on_ideal_fabric_matches_closed_form(topology):
    p = 8
    bw = B if topology == "switch" else B * (p - 1)  # full mesh splits a device's bandwidth over p-1 links
    g = build_topology(topology, p, bw, A)
    r = route_steps(get_algorithm("ring").steps("all_reduce", p, N), g)
    assert r.time_s == pytest.approx(2 * (p - 1) / p * N / B + 2 * (p - 1) * A)
    assert r.max_link_flows == 1


def test_halving_doubling_closed_form_and_power_of_two():
    p = 8
    t = collective_time("all_reduce", N, p, A, B, "halving_doubling")
    assert t == pytest.approx(2 * 3 * A + 2 * (p - 1) / p * N / B)
    g = build_topology("switch", p, B, A)
    assert collective_time("all_reduce", N, p, 0.0, B, "halving_doubling", graph=g) == pytest.approx(t)
    with pytest.raises(CollectiveError, match="power-of-two"):
        collective_time("all_reduce", N, 6, A, B, "halving_doubling")


def test_tree_beats_ring_for_small_messages_and_loses_for_large():
    p = 64
    assert collective_time("all_reduce", 1e3, p, A, B, "tree") < collective_time("all_reduce", 1e3, p, A, B, "ring")
    assert collective_time("all_reduce", 1e9, p, A, B, "tree") > collective_time("all_reduce", 1e9, p, A, B, "ring")
    g = build_topology("switch", 16, B, A)
    routed = collective_time("all_reduce", N, 16, 0.0, B, "tree", graph=g)
    assert routed <= collective_time("all_reduce", N, 16, A, B, "tree") * 1.0001


def test_contention_and_hops_show_up_on_a_torus():
    # pairwise all-to-all on a 4x4 torus: far pairs take several hops and share links
    g = build_topology("torus2d", 16, 4 * B, A)
    r = route_steps(get_algorithm("pairwise").steps("all_to_all", 16, N), g)
    ideal = get_algorithm("pairwise").closed_form("all_to_all", 16, N, A, B)
    assert r.max_hops == 4
    assert r.max_link_flows > 1
    assert r.time_s > ideal


def test_hierarchical_on_a_cluster_is_faster_than_flat_ring_across_nics():
    g = cluster(2, 8, "switch", 450e9, 1e-6, 50e9, 5e-6)
    flat = route_steps(get_algorithm("ring").steps("all_reduce", 16, N), g).time_s
    hier = route_steps(get_algorithm("hierarchical").steps("all_reduce", 16, N), g).time_s
    assert hier < flat
    closed = get_algorithm("hierarchical").closed_form("all_reduce", 16, N, 1e-6, 450e9, 5e-6, 50e9)
    assert hier == pytest.approx(closed, rel=0.05)


def test_fat_tree_oversubscription_slows_cross_leaf_traffic():
    full = build_topology("fat_tree", 16, B, A, radix=8, num_spines=2, oversubscription=1.0)
    over = build_topology("fat_tree", 16, B, A, radix=8, num_spines=2, oversubscription=4.0)
    steps = get_algorithm("pairwise").steps("all_to_all", 16, N)
    assert route_steps(steps, over).time_s > route_steps(steps, full).time_s


def test_bad_names():
    with pytest.raises(TopologyError, match="unknown topology 'hypercube'"):
        build_topology("hypercube", 8, B, A)
    with pytest.raises(CollectiveError, match="unknown collective algorithm"):
        collective_time("all_reduce", N, 8, A, B, "butterfly")
    with pytest.raises(CollectiveError, match="does not implement all_to_all"):
        collective_time("all_to_all", N, 8, A, B, "ring")


def test_nvls_in_switch_all_reduce_closed_form_routed_and_needs_a_switch():
    p = 8
    t = collective_time("all_reduce", N, p, A, B, "nvls")
    assert t == pytest.approx(A + N / B)
    # busbw = 2(p-1)/p * B: beats the ring's bound of B at large sizes
    assert t < collective_time("all_reduce", N, p, A, B, "ring")
    g = build_topology("switch", p, B, 2 * A)  # hops of A each; the up and down streams overlap
    r = route_steps(get_algorithm("nvls").steps("all_reduce", p, N), g)
    assert r.time_s == pytest.approx(t)
    assert r.max_link_flows == 1
    with pytest.raises(CollectiveError, match="no path"):
        route_steps(get_algorithm("nvls").steps("all_reduce", p, N), build_topology("torus2d", p, B, A))
    # auto (what the cost model's TP all-reduce uses) never picks nvls silently
    assert collective_time("all_reduce", N, p, A, B, "auto") > t
