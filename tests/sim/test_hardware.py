from pathlib import Path

import pytest
import yaml

from firstlight.core.hardware import HardwareSpecError, builtin_spec_names, load_spec, load_spec_file

REQUIRED = ["a100-80gb", "h100-sxm", "h200", "b200", "mi300x", "tpu-v5e", "trainium2", "wormhole-n300",
            "blackhole-p150", "cpu-host",
            # issue 17: chips and systems a user asks about
            "hgx-h100", "hgx-b200", "gb200-nvl72", "mi325x", "mi325x-x8", "mi350x", "mi350x-x8", "mi300x-x8",
            "gaudi2", "gaudi2-hls", "gaudi3", "gaudi3-hls", "tpu-v5p", "tpu-v5p-64", "tpu-v6e", "tpu-v6e-8",
            "inferentia2", "inf2-48xl", "trainium1", "trn1-32xl", "trn2-48xl", "wormhole-n150", "t3k",
            "galaxy-wormhole", "blackhole-p150x4",
            # issue 14 item 9: the pipeline-parallel validation rows (TensorRT-LLM on PCIe-only GPUs)
            "rtx-pro-6000"]


def test_all_required_specs_ship_and_validate():
    names = builtin_spec_names()
    for n in REQUIRED:
        assert n in names
        spec = load_spec(n)
        assert spec.memory.bandwidth_gbps > 0
        assert spec.source_of("compute_tflops.bf16" if "bf16" in spec.compute_tflops else "compute_tflops.fp32")
        assert spec.source_of("memory.bandwidth_gbps")


def test_aliases_and_known_figures():
    h100 = load_spec("h100")
    assert h100.name == "h100-sxm"
    assert h100.flops_per_s("bf16") == pytest.approx(989.4e12)
    assert h100.memory.bandwidth_bytes_per_s == pytest.approx(3.35e12)
    # fp4 is not listed on H100: falls back to the nearest wider dtype (fp8)
    assert h100.flops_per_s("fp4") == pytest.approx(1978.9e12)


def _write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "my-chip.yaml"
    p.write_text(yaml.safe_dump(data))
    return p


def _base() -> dict:
    return yaml.safe_load((Path(__file__).parents[2] / "firstlight/sim/specs/h100-sxm.yaml").read_text())


def test_missing_field_is_named_with_the_file(tmp_path):
    d = _base()
    del d["memory"]
    with pytest.raises(HardwareSpecError, match=r"my-chip\.yaml.*memory: field required"):
        load_spec_file(_write(tmp_path, d))


def test_negative_bandwidth_is_named(tmp_path):
    d = _base()
    d["memory"]["bandwidth_gbps"] = -5
    with pytest.raises(HardwareSpecError, match=r"memory\.bandwidth_gbps"):
        load_spec_file(_write(tmp_path, d))
    d = _base()
    d["links"]["scale_up"]["bandwidth_gbps"] = -1
    with pytest.raises(HardwareSpecError, match=r"links\.scale_up\.bandwidth_gbps"):
        load_spec_file(_write(tmp_path, d))


def test_unknown_key_and_missing_source_are_errors(tmp_path):
    d = _base()
    d["memory"]["bandwith_gbps"] = 1  # typo
    with pytest.raises(HardwareSpecError, match="bandwith_gbps"):
        load_spec_file(_write(tmp_path, d))
    d = _base()
    del d["sources"]["power_w"]
    with pytest.raises(HardwareSpecError, match="power_w"):
        load_spec_file(_write(tmp_path, d))


def test_unknown_spec_name_lists_choices():
    with pytest.raises(HardwareSpecError, match="h100-sxm"):
        load_spec("h900")
