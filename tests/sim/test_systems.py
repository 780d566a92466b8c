"""Systems, not only chips: TP is priced on the links a box really has (T3K vs HGX vs one n300)."""

from pathlib import Path

import pytest
import yaml

from firstlight.core.batch import Batch, ScheduledSeq
from firstlight.core.hardware import HardwareSpecError, builtin_spec_names, load_spec, load_spec_file
from firstlight.sim.collectives import collective_time
from firstlight.sim.cost import CostModel
from firstlight.sim.model import load_model
from firstlight.sim.parallel import ParallelConfig
from firstlight.sim.system import system_graph, tp_link

SPECS = Path(__file__).parents[2] / "firstlight/sim/specs"


def _decode(n: int = 8, ctx: int = 1024) -> Batch:
    return Batch(tuple(ScheduledSeq(f"r{i}", 1, ctx, ctx) for i in range(n)))


def _allreduce_s(hw: str, tp: int, model: str = "llama-3.1-8b") -> tuple[float, CostModel]:
    cm = CostModel(load_model(model), load_spec(hw), ParallelConfig(tp=tp))
    ops = {op.name: op for op in cm.breakdown(_decode())}
    return ops["tp_all_reduce"].time_s, cm


def _expected_allreduce_s(cm: CostModel, bw_gbps: float, lat_us: float) -> float:
    """2 all-reduces per layer of m*hidden bf16 activations, on a link of the given figures."""
    m, h = 8, cm.model.hidden_size
    alpha = lat_us * 1e-6 + cm.eff.collective_overhead_us * 1e-6
    one = collective_time("all_reduce", m * h * 2, cm.par.tp, alpha, bw_gbps * 1e9 * cm.eff.network, "auto")
    return one * 2 * cm.model.num_layers


def test_t3k_tp8_is_priced_on_the_ethernet_links_not_nvlink():
    t3k, cm = _allreduce_s("t3k", 8)
    # the 8 chips reach each other only over 12.5-25 GB/s Ethernet links (from the YAML): whatever pattern
    # wins (ring or direct), a rank injects between one on-card link and its two inter-card links
    link = tp_link(cm.hw, 8)
    assert 12.5e9 <= link.bandwidth <= 25e9 + 12.5e9
    assert t3k == pytest.approx(_expected_allreduce_s(cm, link.bandwidth / 1e9, link.alpha_s * 1e6), rel=1e-9)
    hgx, cm_h = _allreduce_s("hgx-h100", 8)
    assert hgx == pytest.approx(_expected_allreduce_s(cm_h, 450, 1.0), rel=1e-9)
    assert t3k > 5 * hgx


def test_one_n300_tp2_uses_its_on_card_link():
    n300, cm = _allreduce_s("wormhole-n300", 2)
    assert n300 == pytest.approx(_expected_allreduce_s(cm, 12.5, 0.65), rel=1e-9)
    assert tp_link(cm.hw, 2).via == "on-card Ethernet"
    assert "inter-card Ethernet" in tp_link(load_spec("t3k"), 8).via


def test_tp8_prefill_on_t3k_is_network_bound_and_on_hgx_it_is_not():
    """A 2048-token prefill at TP8: all-reduces of 16 MB per layer. On T3K's 12.5 GB/s Ethernet ring they
    are most of the step; on NVLink (450 GB/s) a minority; the ratio follows the link bandwidths."""
    model = load_model("llama-3.1-8b")
    prefill = Batch((ScheduledSeq("p", 2048, 0, 2048),))

    def allreduce_and_step(hw: str) -> tuple[float, float]:
        cm = CostModel(model, load_spec(hw), ParallelConfig(tp=8))
        ops = {op.name: op.time_s for op in cm.breakdown(prefill)}
        return ops["tp_all_reduce"], cm.time(prefill)

    t3k_ar, t3k_step = allreduce_and_step("t3k")
    hgx_ar, hgx_step = allreduce_and_step("hgx-h100")
    assert t3k_ar / t3k_step > 0.5 > hgx_ar / hgx_step
    assert t3k_ar / hgx_ar > 20  # bandwidth ratio 36x, less the shared per-step alpha terms


def test_system_without_section_matches_the_same_links_as_a_system():
    """h100-sxm (scale_up switch, domain 8) and hgx-h100 (system: 8 chips on an NVSwitch) agree."""
    a, _ = _allreduce_s("h100-sxm", 8)
    b, _ = _allreduce_s("hgx-h100", 8)
    assert a == pytest.approx(b, rel=1e-9)


@pytest.mark.parametrize("name,tp,links", [("gb200-nvl72", 72, 1), ("galaxy-wormhole", 32, 1), ("tpu-v5p-64", 64, 1),
                                           ("trn2-48xl", 16, 1), ("mi300x-x8", 8, 1), ("gaudi3-hls", 8, 1)])
def test_every_system_routes_a_full_tp_ring(name, tp, links):
    spec = load_spec(name)
    g = system_graph(spec.system)
    assert len([n for n in g.nodes if isinstance(n, int)]) == spec.num_chips == tp
    link = tp_link(spec, tp)
    assert link is not None and link.bandwidth > 0 and link.alpha_s > 0


def test_full_mesh_collectives_use_every_peer_link():
    """MI300X / Gaudi 3 boxes: a rank drives all 7 peer links at once (direct reduce-scatter), so TP sees
    7 x 64 GB/s and 7 x 75 GB/s; a switch gives the uplink; a ring of links gives one link."""
    assert tp_link(load_spec("mi300x-x8"), 8).bandwidth == pytest.approx(7 * 64e9)
    assert tp_link(load_spec("gaudi3-hls"), 8).bandwidth == pytest.approx(7 * 75e9)
    assert tp_link(load_spec("hgx-h100"), 8).bandwidth == pytest.approx(450e9)
    assert tp_link(load_spec("inf2-48xl"), 12).bandwidth == pytest.approx(48e9)


def _t3k_dict() -> dict:
    return yaml.safe_load((SPECS / "t3k.yaml").read_text())


def test_link_to_a_chip_that_does_not_exist_names_the_key(tmp_path):
    d = _t3k_dict()
    d["system"]["links"][1]["edges"][0] = [0, 9]
    d["base"] = str(SPECS / "wormhole-n300.yaml")
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(HardwareSpecError, match=r"links\[1\] \('inter-card Ethernet'\)\.edges\[0\].*chip 9 does "
                                                r"not exist.*8 chips"):
        load_spec_file(p)


def test_disconnected_system_is_an_error(tmp_path):
    d = _t3k_dict()
    d["system"]["links"] = d["system"]["links"][:1]  # only the on-card pairs: four islands
    d["base"] = str(SPECS / "wormhole-n300.yaml")
    p = tmp_path / "islands.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(HardwareSpecError, match=r"chips \[1, 2, 3, 4, 5, 6\] have no path to chip 0"):
        load_spec_file(p)


def test_every_builtin_figure_has_a_source_or_an_estimate_flag():
    for name in builtin_spec_names():
        spec = load_spec(name)
        for f in spec.figures():
            assert f["source"], f"{name}: {f['path']} has no source"


def test_a_figure_without_a_source_fails(tmp_path):
    d = _t3k_dict()
    d["base"] = str(SPECS / "wormhole-n300.yaml")
    del d["sources"]["system.links.inter-card Ethernet"]
    p = tmp_path / "unsourced.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(HardwareSpecError, match=r"system\.links\.inter-card Ethernet\.bandwidth_gbps"):
        load_spec_file(p)
    d = yaml.safe_load((SPECS / "b200.yaml").read_text())
    d["sources"] = {k: v for k, v in d["sources"].items() if k != "compute_tflops"}
    d["sources"]["compute_tflops.fp8"] = "NVIDIA HGX B200 datasheet"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(HardwareSpecError, match=r"compute_tflops\.bf16"):  # fp8 alone covers only fp8
        load_spec_file(p)


def test_a_source_key_that_names_no_figure_is_an_error(tmp_path):
    d = yaml.safe_load((SPECS / "b200.yaml").read_text())
    d["sources"]["compute_tflops.fp9"] = "a typo"
    p = tmp_path / "typo.yaml"
    p.write_text(yaml.safe_dump(d))
    with pytest.raises(HardwareSpecError, match=r"sources\.compute_tflops\.fp9 names no figure"):
        load_spec_file(p)


def test_base_inherits_figures_and_sources():
    t3k, n300 = load_spec("t3k"), load_spec("wormhole-n300")
    assert t3k.compute_tflops == n300.compute_tflops and t3k.memory == n300.memory
    assert t3k.num_chips == 8 and n300.num_chips == 2
    assert t3k.source_of("memory.bandwidth_gbps") == n300.source_of("memory.bandwidth_gbps")
    assert load_spec("gb200-nvl72").compute_tflops["bf16"] == 2500  # overrides its base (b200: 2250)
