from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from firstlight.core.hardware import builtin_spec_dir


@pytest.fixture(scope="session")
def failing_chip(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Wormhole's spec with bfp4 weights: fails verify on tiny models until remedied (and lacks cos/sin)."""
    data = yaml.safe_load((builtin_spec_dir() / "wormhole-n300.yaml").read_text())
    data["numerics"]["matmul"].update({"b_format": "bfp4_b", "accumulator": "bf16", "fidelity": "lofi"})
    p = tmp_path_factory.mktemp("chips") / "bfp4-chip.yaml"
    p.write_text(yaml.safe_dump(data))
    return p
