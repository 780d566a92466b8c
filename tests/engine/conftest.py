from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", seed=0)


@pytest.fixture(scope="session")
def tiny(tiny_ckpt: Path) -> tuple[Any, Any]:
    from firstlight.models.loader import load_model

    return load_model(tiny_ckpt)
